//! Where a stdio server admitted `web_egress` may connect through the broker's egress path.
//!
//! Every destination is judged by the zone rules ([`crate::zone`]) on the whole answer (the
//! broker's `net::judge_answer`): the public zone is always reachable; a destination in a
//! higher zone (private, link-local, loopback) only when the server's `sandbox.egress` names
//! it ([`EgressRule`]): by exact host name, by `*.suffix`, or by a CIDR that holds every one
//! of its addresses. An answer that spans zones, or holds an address that is never a
//! destination, is refused whatever the list says.

use std::fmt;
use std::net::IpAddr;

use serde::{Serialize, Serializer};

/// Most entries in one server's `sandbox.egress`.
pub const MAX_EGRESS_RULES: usize = 32;
/// Longest host name (RFC 1035), in bytes.
pub const MAX_HOST_NAME: usize = 253;
/// Longest label of a host name, in bytes.
const MAX_LABEL: usize = 63;

/// One entry of `sandbox.egress`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressRule {
    /// Exactly this host name (lower case, no trailing dot).
    Name(String),
    /// Any name strictly beneath this suffix (`*.corp.example` admits `a.corp.example`, not
    /// `corp.example` itself).
    Suffix(String),
    /// Every address in this network (prefix length within the family's width; host bits
    /// zero).
    Cidr {
        /// The network address.
        net: IpAddr,
        /// The prefix length.
        len: u8,
    },
}

/// Why a `sandbox.egress` entry was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EgressRuleError {
    /// Not a host name, `*.suffix`, IP address or CIDR.
    Grammar,
    /// A CIDR whose prefix length is wider than its family, or whose host bits are set.
    BadCidr,
    /// `*` alone, or a suffix of a single label (`*.com` would admit a whole top-level
    /// domain).
    TooWide,
}

impl fmt::Display for EgressRuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EgressRuleError::Grammar => f.write_str(
                "must be a host name, *.suffix, an IP address or a CIDR (address/prefix length)",
            ),
            EgressRuleError::BadCidr => f.write_str(
                "is not a CIDR: the prefix length exceeds the address width or host bits are set",
            ),
            EgressRuleError::TooWide => {
                f.write_str("must name at least two labels after *. (a suffix, not a whole TLD)")
            }
        }
    }
}

fn is_host_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_HOST_NAME
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= MAX_LABEL
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
        // An all-numeric last label is an IP address written short, never a name.
        && !s
            .rsplit('.')
            .next()
            .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
}

fn width(ip: IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

fn in_net(addr: IpAddr, net: IpAddr, len: u8) -> bool {
    if addr.is_ipv4() != net.is_ipv4() {
        return false;
    }
    let w = u32::from(width(net));
    let host = w - u32::from(len);
    let mask = if host >= 128 {
        0
    } else {
        (u128::MAX << host) & (u128::MAX >> (128 - w))
    };
    bits(addr) & mask == bits(net) & mask
}

impl EgressRule {
    /// Parse one entry: a host name (ASCII, compared case-insensitively: stored lower case),
    /// `*.suffix` (at least two labels), an IP address (a network of one), or `IP/len`.
    pub fn parse(s: &str) -> Result<EgressRule, EgressRuleError> {
        if s.len() > MAX_HOST_NAME + 2 {
            return Err(EgressRuleError::Grammar);
        }
        if let Some((addr, len)) = s.split_once('/') {
            let net: IpAddr = addr.parse().map_err(|_| EgressRuleError::Grammar)?;
            if len.is_empty() || len.len() > 3 || !len.bytes().all(|b| b.is_ascii_digit()) {
                return Err(EgressRuleError::Grammar);
            }
            let len: u8 = len.parse().map_err(|_| EgressRuleError::BadCidr)?;
            if len > width(net) || {
                let host = u32::from(width(net) - len);
                host > 0 && bits(net) & (u128::MAX >> (128 - host)) != 0
            } {
                return Err(EgressRuleError::BadCidr);
            }
            return Ok(EgressRule::Cidr { net, len });
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(EgressRule::Cidr {
                net: ip,
                len: width(ip),
            });
        }
        let lower = s.to_ascii_lowercase();
        if let Some(suffix) = lower.strip_prefix("*.") {
            if !is_host_name(suffix) {
                return Err(EgressRuleError::Grammar);
            }
            if !suffix.contains('.') {
                return Err(EgressRuleError::TooWide);
            }
            return Ok(EgressRule::Suffix(suffix.to_owned()));
        }
        if lower == "*" {
            return Err(EgressRuleError::TooWide);
        }
        if !is_host_name(&lower) {
            return Err(EgressRuleError::Grammar);
        }
        Ok(EgressRule::Name(lower))
    }

    /// Whether this entry names `host` (a host name as the server asked for it; one trailing
    /// dot and case are ignored). A CIDR entry names no host name.
    pub fn names(&self, host: &str) -> bool {
        let host = host.strip_suffix('.').unwrap_or(host);
        match self {
            EgressRule::Name(n) => host.eq_ignore_ascii_case(n),
            EgressRule::Suffix(s) => {
                host.len() > s.len() + 1
                    && host.as_bytes()[host.len() - s.len() - 1] == b'.'
                    && host[host.len() - s.len()..].eq_ignore_ascii_case(s)
            }
            EgressRule::Cidr { .. } => false,
        }
    }

    /// Whether this entry holds `addr` (only a CIDR entry holds addresses).
    pub fn holds(&self, addr: IpAddr) -> bool {
        match self {
            EgressRule::Cidr { net, len } => in_net(addr, *net, *len),
            _ => false,
        }
    }
}

impl fmt::Display for EgressRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EgressRule::Name(n) => f.write_str(n),
            EgressRule::Suffix(s) => write!(f, "*.{s}"),
            EgressRule::Cidr { net, len } => write!(f, "{net}/{len}"),
        }
    }
}

impl Serialize for EgressRule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Whether `rules` admit a destination above the public zone: `host` is a name one of them
/// names (`literal` is false), or every address is held by one of them. The caller has
/// already judged the whole answer (one zone, no rejected address); this only lifts the
/// public ceiling for what the operator named.
pub fn admits(rules: &[EgressRule], host: &str, literal: bool, addrs: &[IpAddr]) -> bool {
    (!literal && rules.iter().any(|r| r.names(host)))
        || (!addrs.is_empty() && addrs.iter().all(|a| rules.iter().any(|r| r.holds(*a))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn entries_parse_to_names_suffixes_and_networks_and_nothing_wider() {
        assert_eq!(
            EgressRule::parse("Intranet.Example"),
            Ok(EgressRule::Name("intranet.example".into()))
        );
        assert_eq!(
            EgressRule::parse("*.corp.example"),
            Ok(EgressRule::Suffix("corp.example".into()))
        );
        assert_eq!(
            EgressRule::parse("10.0.0.0/8"),
            Ok(EgressRule::Cidr {
                net: ip("10.0.0.0"),
                len: 8
            })
        );
        assert_eq!(
            EgressRule::parse("169.254.169.254"),
            Ok(EgressRule::Cidr {
                net: ip("169.254.169.254"),
                len: 32
            })
        );
        assert_eq!(
            EgressRule::parse("fd00::/8"),
            Ok(EgressRule::Cidr {
                net: ip("fd00::"),
                len: 8
            })
        );
        for (bad, why) in [
            ("", EgressRuleError::Grammar),
            ("*", EgressRuleError::TooWide),
            ("*.com", EgressRuleError::TooWide),
            ("a..b", EgressRuleError::Grammar),
            ("-a.example", EgressRuleError::Grammar),
            ("a_b.example", EgressRuleError::Grammar),
            ("host.example.", EgressRuleError::Grammar),
            ("1.2.3", EgressRuleError::Grammar),
            ("http://x.example", EgressRuleError::Grammar),
            ("10.0.0.1/8", EgressRuleError::BadCidr),
            ("10.0.0.0/33", EgressRuleError::BadCidr),
            ("::/129", EgressRuleError::BadCidr),
            ("10.0.0.0/", EgressRuleError::Grammar),
            ("10.0.0.0/08x", EgressRuleError::Grammar),
            ("x.example/8", EgressRuleError::Grammar),
            ("*.ex ample.org", EgressRuleError::Grammar),
            ("bücher.example", EgressRuleError::Grammar),
        ] {
            assert_eq!(EgressRule::parse(bad), Err(why), "{bad:?}");
        }
        // Names at their bound and one over.
        let label = "a".repeat(63);
        let long = [label.as_str(); 4].join(".");
        let at = &long[..MAX_HOST_NAME];
        let at = at.trim_end_matches('.');
        assert!(EgressRule::parse(at).is_ok());
        assert!(EgressRule::parse(&format!("{}.b", "a".repeat(64))).is_err());
        assert_eq!(
            EgressRule::parse(&format!("{at}a.b")),
            Err(EgressRuleError::Grammar)
        );
        // Each renders as it is written in the configuration.
        for s in ["x.example", "*.corp.example", "10.0.0.0/8", "fe80::/10"] {
            assert_eq!(EgressRule::parse(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn names_suffixes_and_networks_match_exactly() {
        let name = EgressRule::parse("intranet.example").unwrap();
        assert!(name.names("intranet.example"));
        assert!(name.names("INTRANET.example."));
        assert!(!name.names("a.intranet.example"));
        assert!(!name.names("intranet.example.evil"));
        let suffix = EgressRule::parse("*.corp.example").unwrap();
        assert!(suffix.names("a.corp.example"));
        assert!(suffix.names("b.a.corp.example"));
        assert!(!suffix.names("corp.example"));
        assert!(!suffix.names("evilcorp.example"));
        assert!(!suffix.names("a.corp.example.evil"));
        let net = EgressRule::parse("10.77.0.0/16").unwrap();
        assert!(net.holds(ip("10.77.255.1")));
        assert!(!net.holds(ip("10.78.0.1")));
        assert!(!net.holds(ip("::ffff:10.77.0.1")), "families never mix");
        assert!(!net.names("10.77.0.1"));
        let all6 = EgressRule::parse("::/0").unwrap();
        assert!(all6.holds(ip("fe80::1")));
        assert!(!all6.holds(ip("127.0.0.1")));
        let one = EgressRule::parse("169.254.169.254").unwrap();
        assert!(one.holds(ip("169.254.169.254")));
        assert!(!one.holds(ip("169.254.169.253")));
        // A literal is admitted by the networks that hold it, never by a name entry.
        let rules = [name, net];
        assert!(admits(&rules, "intranet.example", false, &[ip("10.1.1.1")]));
        assert!(admits(&rules, "10.77.0.9", true, &[ip("10.77.0.9")]));
        assert!(!admits(&rules, "10.1.1.1", true, &[ip("10.1.1.1")]));
        assert!(admits(
            &rules,
            "other.example",
            false,
            &[ip("10.77.0.1"), ip("10.77.0.2")]
        ));
        assert!(!admits(
            &rules,
            "other.example",
            false,
            &[ip("10.77.0.1"), ip("10.1.0.2")]
        ));
        assert!(!admits(&rules, "other.example", false, &[]));
    }
}
