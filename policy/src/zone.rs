//! Network zones: which part of the network an address reaches, and whether a request bound to
//! one zone may go there.
//!
//! Zones are ordered by the privilege of what lives there, low to high:
//! `public` < `private` (RFC 1918, CGNAT 100.64/10, ULA fc00::/7) < `link_local`
//! (169.254/16, fe80::/10 — cloud metadata lives here) < `loopback`. A request may go to its
//! binding zone or lower ([`may_reach`]), never upward.
//!
//! Addresses that embed an IPv4 address are judged by what they embed, because that is where a
//! translator would deliver the packet: IPv4-mapped (`::ffff:a.b.c.d`), IPv4-compatible
//! (`::a.b.c.d`), IPv4-translated (`::ffff:0:a.b.c.d`), NAT64 (`64:ff9b::/96` and the local-use
//! `64:ff9b:1::/48`), 6to4 (`2002::/16`) and Teredo (`2001::/32`). Where more than one embedded
//! address is plausible (Teredo's server and client, or the RFC 6052 layouts an operator may use
//! inside the local-use NAT64 prefix) every candidate is judged: the most privileged zone wins,
//! and any candidate in a rejected range rejects the address. The one exception is a candidate
//! of `0.0.0.0/8`, which in these layouts means "no address here" (a translator never delivers
//! to it) and is skipped; an address whose candidates are all skipped is rejected.
//!
//! Addresses that are never a legitimate destination are rejected outright: unspecified,
//! multicast, broadcast, reserved, documentation and benchmarking ranges.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A network zone, ordered low to high privilege.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Zone {
    /// The internet.
    Public,
    /// Private networks: RFC 1918, CGNAT, unique local IPv6.
    Private,
    /// Link-local networks, including cloud metadata services.
    LinkLocal,
    /// This machine.
    Loopback,
}

impl Zone {
    /// Every zone, low to high.
    pub const ALL: [Zone; 4] = [Zone::Public, Zone::Private, Zone::LinkLocal, Zone::Loopback];

    /// The spelling used in configuration, errors and diagnostics.
    pub fn as_str(self) -> &'static str {
        match self {
            Zone::Public => "public",
            Zone::Private => "private",
            Zone::LinkLocal => "link_local",
            Zone::Loopback => "loopback",
        }
    }

    /// Parse the spelling of [`Zone::as_str`].
    pub fn parse(s: &str) -> Option<Zone> {
        Zone::ALL.into_iter().find(|z| z.as_str() == s)
    }
}

impl fmt::Display for Zone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an address is never a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rejected {
    /// `0.0.0.0/8`, `::` — reaches local services on Linux.
    Unspecified,
    /// Multicast ranges.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// Ranges reserved by IANA or for protocol use.
    Reserved,
    /// Documentation ranges.
    Documentation,
    /// Benchmarking ranges.
    Benchmarking,
}

impl Rejected {
    /// Lower-case description.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejected::Unspecified => "unspecified",
            Rejected::Multicast => "multicast",
            Rejected::Broadcast => "broadcast",
            Rejected::Reserved => "reserved",
            Rejected::Documentation => "documentation",
            Rejected::Benchmarking => "benchmarking",
        }
    }
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a request bound to `binding` may go to `target`: the same zone or a lower one.
pub fn may_reach(binding: Zone, target: Zone) -> bool {
    target <= binding
}

const fn v4(a: u8, b: u8, c: u8, d: u8) -> u32 {
    u32::from_be_bytes([a, b, c, d])
}

/// IPv4 ranges other than public, first match wins: (network, prefix length, verdict).
const V4_TABLE: &[(u32, u8, Result<Zone, Rejected>)] = &[
    (v4(255, 255, 255, 255), 32, Err(Rejected::Broadcast)),
    (v4(0, 0, 0, 0), 8, Err(Rejected::Unspecified)),
    (v4(10, 0, 0, 0), 8, Ok(Zone::Private)),
    (v4(100, 64, 0, 0), 10, Ok(Zone::Private)),
    (v4(127, 0, 0, 0), 8, Ok(Zone::Loopback)),
    (v4(169, 254, 0, 0), 16, Ok(Zone::LinkLocal)),
    (v4(172, 16, 0, 0), 12, Ok(Zone::Private)),
    (v4(192, 0, 0, 0), 24, Err(Rejected::Reserved)),
    (v4(192, 0, 2, 0), 24, Err(Rejected::Documentation)),
    (v4(192, 31, 196, 0), 24, Err(Rejected::Reserved)),
    (v4(192, 52, 193, 0), 24, Err(Rejected::Reserved)),
    (v4(192, 88, 99, 0), 24, Err(Rejected::Reserved)),
    (v4(192, 168, 0, 0), 16, Ok(Zone::Private)),
    (v4(192, 175, 48, 0), 24, Err(Rejected::Reserved)),
    (v4(198, 18, 0, 0), 15, Err(Rejected::Benchmarking)),
    (v4(198, 51, 100, 0), 24, Err(Rejected::Documentation)),
    (v4(203, 0, 113, 0), 24, Err(Rejected::Documentation)),
    (v4(224, 0, 0, 0), 4, Err(Rejected::Multicast)),
    (v4(240, 0, 0, 0), 4, Err(Rejected::Reserved)),
];

fn in_v4(addr: u32, net: u32, len: u8) -> bool {
    let mask = if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    };
    addr & mask == net & mask
}

/// Classify an IPv4 address.
pub fn classify_v4(ip: Ipv4Addr) -> Result<Zone, Rejected> {
    let addr = u32::from(ip);
    V4_TABLE
        .iter()
        .find(|(net, len, _)| in_v4(addr, *net, *len))
        .map_or(Ok(Zone::Public), |(_, _, verdict)| *verdict)
}

fn in_v6(addr: u128, net: u128, len: u8) -> bool {
    let mask = if len == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(len))
    };
    addr & mask == net & mask
}

const fn v6(segs: [u16; 8]) -> u128 {
    let mut out = 0u128;
    let mut i = 0;
    while i < 8 {
        out = (out << 16) | segs[i] as u128;
        i += 1;
    }
    out
}

/// IPv6 ranges with a fixed verdict, first match wins. Embedded-IPv4 forms are handled before
/// this table; `2000::/3` not listed here is public and everything else is reserved.
const V6_TABLE: &[(u128, u8, Result<Zone, Rejected>)] = &[
    (
        v6([0, 0, 0, 0, 0, 0, 0, 0]),
        128,
        Err(Rejected::Unspecified),
    ),
    (v6([0, 0, 0, 0, 0, 0, 0, 1]), 128, Ok(Zone::Loopback)),
    (
        v6([0x0100, 0, 0, 0, 0, 0, 0, 0]),
        64,
        Err(Rejected::Reserved),
    ),
    (
        v6([0x2001, 0x0002, 0, 0, 0, 0, 0, 0]),
        48,
        Err(Rejected::Benchmarking),
    ),
    (
        v6([0x2001, 0x0db8, 0, 0, 0, 0, 0, 0]),
        32,
        Err(Rejected::Documentation),
    ),
    // The rest of the IETF protocol assignments block (ORCHID, AMT, AS112, PCP anycast, …).
    (
        v6([0x2001, 0, 0, 0, 0, 0, 0, 0]),
        23,
        Err(Rejected::Reserved),
    ),
    (
        v6([0x3fff, 0, 0, 0, 0, 0, 0, 0]),
        20,
        Err(Rejected::Documentation),
    ),
    (
        v6([0x5f00, 0, 0, 0, 0, 0, 0, 0]),
        16,
        Err(Rejected::Reserved),
    ),
    (v6([0xfc00, 0, 0, 0, 0, 0, 0, 0]), 7, Ok(Zone::Private)),
    (v6([0xfe80, 0, 0, 0, 0, 0, 0, 0]), 10, Ok(Zone::LinkLocal)),
    (
        v6([0xfec0, 0, 0, 0, 0, 0, 0, 0]),
        10,
        Err(Rejected::Reserved),
    ),
    (
        v6([0xff00, 0, 0, 0, 0, 0, 0, 0]),
        8,
        Err(Rejected::Multicast),
    ),
    (v6([0x2000, 0, 0, 0, 0, 0, 0, 0]), 3, Ok(Zone::Public)),
];

fn ipv4_at(addr: u128, shift: u32) -> Ipv4Addr {
    // Truncation is the point: the 32 bits at `shift` are the embedded address.
    Ipv4Addr::from((addr >> shift) as u32)
}

/// The IPv4 addresses a translator could deliver this IPv6 address to, if it embeds any; more
/// than one when the layout is ambiguous.
fn embedded_v4(ip: Ipv6Addr) -> Vec<Ipv4Addr> {
    let a = u128::from(ip);
    // IPv4-mapped ::ffff:0:0/96 and IPv4-translated ::ffff:0:0:0/96.
    if in_v6(a, v6([0, 0, 0, 0, 0, 0xffff, 0, 0]), 96)
        || in_v6(a, v6([0, 0, 0, 0, 0xffff, 0, 0, 0]), 96)
    {
        return vec![ipv4_at(a, 0)];
    }
    // IPv4-compatible ::/96, except :: and ::1 which the table classifies.
    if in_v6(a, 0, 96) && a > 1 {
        return vec![ipv4_at(a, 0)];
    }
    // NAT64 well-known prefix (RFC 6052).
    if in_v6(a, v6([0x64, 0xff9b, 0, 0, 0, 0, 0, 0]), 96) {
        return vec![ipv4_at(a, 0)];
    }
    // NAT64 local-use prefix (RFC 8215): operators may use a /48 layout (v4 split around the
    // reserved u octet, bits 64..71) or any longer prefix up to /96; judge the plausible ones.
    if in_v6(a, v6([0x64, 0xff9b, 1, 0, 0, 0, 0, 0]), 48) {
        let bytes = ip.octets();
        let slash48 = Ipv4Addr::new(bytes[6], bytes[7], bytes[9], bytes[10]);
        let slash56 = Ipv4Addr::new(bytes[7], bytes[9], bytes[10], bytes[11]);
        let slash64 = Ipv4Addr::new(bytes[9], bytes[10], bytes[11], bytes[12]);
        return vec![slash48, slash56, slash64, ipv4_at(a, 0)];
    }
    // 6to4: 2002:AABB:CCDD::/48 embeds AA.BB.CC.DD.
    if in_v6(a, v6([0x2002, 0, 0, 0, 0, 0, 0, 0]), 16) {
        return vec![ipv4_at(a, 80)];
    }
    // Teredo: 2001:0:SSSS:SSSS:flags:port:CCCC:CCCC, server S and obfuscated client ~C.
    if in_v6(a, v6([0x2001, 0, 0, 0, 0, 0, 0, 0]), 32) {
        let server = ipv4_at(a, 64);
        let client = Ipv4Addr::from(!((a & 0xffff_ffff) as u32));
        return vec![server, client];
    }
    Vec::new()
}

/// Classify an IPv6 address, unwrapping embedded IPv4 first.
pub fn classify_v6(ip: Ipv6Addr) -> Result<Zone, Rejected> {
    let embedded = embedded_v4(ip);
    match embedded.as_slice() {
        [] => {}
        [only] => return classify_v4(*only),
        several => {
            let mut zone: Option<Zone> = None;
            for candidate in several {
                match classify_v4(*candidate) {
                    Err(Rejected::Unspecified) => {}
                    Err(other) => return Err(other),
                    Ok(z) => zone = Some(zone.map_or(z, |prev| prev.max(z))),
                }
            }
            return zone.ok_or(Rejected::Unspecified);
        }
    }
    let a = u128::from(ip);
    V6_TABLE
        .iter()
        .find(|(net, len, _)| in_v6(a, *net, *len))
        .map_or(Err(Rejected::Reserved), |(_, _, verdict)| *verdict)
}

/// Classify any address into a zone, or reject it.
pub fn classify(ip: IpAddr) -> Result<Zone, Rejected> {
    match ip {
        IpAddr::V4(v) => classify_v4(v),
        IpAddr::V6(v) => classify_v6(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn c(s: &str) -> Result<Zone, Rejected> {
        classify(s.parse().unwrap())
    }

    #[test]
    fn the_table_from_the_security_reference() {
        use Rejected::*;
        use Zone::*;
        let cases: &[(&str, Result<Zone, Rejected>)] = &[
            ("0.0.0.0", Err(Unspecified)),
            ("0.1.2.3", Err(Unspecified)),
            ("10.0.0.5", Ok(Private)),
            ("172.16.0.1", Ok(Private)),
            ("172.31.255.255", Ok(Private)),
            ("172.32.0.1", Ok(Public)),
            ("192.168.1.1", Ok(Private)),
            ("100.64.0.1", Ok(Private)),
            ("100.127.255.255", Ok(Private)),
            ("100.128.0.1", Ok(Public)),
            ("127.0.0.1", Ok(Loopback)),
            ("127.255.255.254", Ok(Loopback)),
            ("169.254.169.254", Ok(LinkLocal)),
            ("192.0.0.170", Err(Reserved)),
            ("192.0.2.1", Err(Documentation)),
            ("198.51.100.7", Err(Documentation)),
            ("203.0.113.9", Err(Documentation)),
            ("192.31.196.1", Err(Reserved)),
            ("192.175.48.1", Err(Reserved)),
            ("192.52.193.1", Err(Reserved)),
            ("192.88.99.1", Err(Reserved)),
            ("198.18.0.1", Err(Benchmarking)),
            ("198.19.255.255", Err(Benchmarking)),
            ("198.20.0.1", Ok(Public)),
            ("224.0.0.1", Err(Multicast)),
            ("239.255.255.250", Err(Multicast)),
            ("240.0.0.1", Err(Reserved)),
            ("255.255.255.255", Err(Broadcast)),
            ("93.184.216.34", Ok(Public)),
            ("8.8.8.8", Ok(Public)),
            ("::", Err(Unspecified)),
            ("::1", Ok(Loopback)),
            ("::ffff:127.0.0.1", Ok(Loopback)),
            ("::ffff:169.254.169.254", Ok(LinkLocal)),
            ("::ffff:10.1.2.3", Ok(Private)),
            ("::ffff:8.8.8.8", Ok(Public)),
            ("::ffff:0.0.0.0", Err(Unspecified)),
            ("::127.0.0.1", Ok(Loopback)),
            ("::ffff:0:127.0.0.1", Ok(Loopback)),
            ("64:ff9b::7f00:1", Ok(Loopback)),
            ("64:ff9b::a9fe:a9fe", Ok(LinkLocal)),
            ("64:ff9b::808:808", Ok(Public)),
            ("64:ff9b:1:7f00:1::", Ok(Loopback)),
            ("2002:7f00:1::", Ok(Loopback)),
            ("2002:a00:1::1", Ok(Private)),
            ("2002:808:808::1", Ok(Public)),
            ("2001::1", Err(Reserved)),
            ("64:ff9b:1::", Err(Unspecified)),
            ("64:ff9b:1::a00:1", Ok(Private)),
            ("2001:0:808:808:0:0:80ff:fffe", Ok(Loopback)),
            ("2001:0:808:808:0:0:f7f7:f7f7", Ok(Public)),
            ("100::1", Err(Reserved)),
            ("2001:2::1", Err(Benchmarking)),
            ("2001:10::1", Err(Reserved)),
            ("2001:20::1", Err(Reserved)),
            ("2001:db8::1", Err(Documentation)),
            ("3fff::1", Err(Documentation)),
            ("5f00::1", Err(Reserved)),
            ("fc00::1", Ok(Private)),
            ("fd00:ec2::254", Ok(Private)),
            ("fe80::1", Ok(LinkLocal)),
            ("fec0::1", Err(Reserved)),
            ("ff02::1", Err(Multicast)),
            ("2606:4700:4700::1111", Ok(Public)),
            ("4000::1", Err(Reserved)),
        ];
        for (addr, want) in cases {
            assert_eq!(c(addr), *want, "{addr}");
        }
    }

    #[test]
    fn reaching_goes_only_downward() {
        assert!(may_reach(Zone::Public, Zone::Public));
        assert!(!may_reach(Zone::Public, Zone::Private));
        assert!(!may_reach(Zone::Public, Zone::LinkLocal));
        assert!(!may_reach(Zone::Private, Zone::LinkLocal));
        assert!(may_reach(Zone::Loopback, Zone::Public));
        assert!(may_reach(Zone::LinkLocal, Zone::Private));
        for z in Zone::ALL {
            assert_eq!(Zone::parse(z.as_str()), Some(z));
        }
    }

    proptest! {
        #[test]
        fn a_mapped_address_has_the_zone_of_its_ipv4(raw in any::<u32>()) {
            let v = Ipv4Addr::from(raw);
            prop_assert_eq!(classify_v6(v.to_ipv6_mapped()), classify_v4(v));
        }

        #[test]
        fn nat64_and_6to4_never_reach_lower_than_their_ipv4(raw in any::<u32>()) {
            let v = Ipv4Addr::from(raw);
            let nat64 = Ipv6Addr::from(v6([0x64, 0xff9b, 0, 0, 0, 0, 0, 0]) | u128::from(raw));
            prop_assert_eq!(classify_v6(nat64), classify_v4(v));
            let six_to_four = Ipv6Addr::from(v6([0x2002, 0, 0, 0, 0, 0, 0, 0]) | (u128::from(raw) << 80) | 1);
            prop_assert_eq!(classify_v6(six_to_four), classify_v4(v));
        }

        #[test]
        fn every_address_is_classified_without_panic(raw in any::<u128>()) {
            let _ = classify_v6(Ipv6Addr::from(raw));
        }

        #[test]
        fn may_reach_is_the_order(a in 0usize..4, b in 0usize..4) {
            prop_assert_eq!(may_reach(Zone::ALL[a], Zone::ALL[b]), b <= a);
        }
    }
}
