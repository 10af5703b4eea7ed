//! Endpoint URL rules for the MCP servers and OAuth endpoints an operator configures.
//!
//! An endpoint URL is accepted only if it is `https`, or plain `http` to a loopback host, and
//! carries no userinfo and no fragment. This module guards against:
//!
//! * **Credential leaks and authority confusion**: `https://user:pw@host/` would put a secret in
//!   logs and configuration dumps, and `http://trusted.example@127.0.0.1/` tricks a reader into
//!   seeing the wrong host. Any `@` in the authority is refused, even an empty userinfo
//!   (`http://@host/`, `https://:@host/`) that the parser would silently drop.
//! * **Cleartext to the network**: plain `http` is only allowed to the local machine, so tokens
//!   never cross a wire unencrypted.
//! * **String-based host tricks**: every host is judged on the host the `url` crate (a WHATWG
//!   URL parser) *parsed*, never on the text. `http://2130706433/`, `http://0x7f.1/`,
//!   `http://%31%32%37.0.0.1/` and fullwidth digits all *are* `127.0.0.1` and are judged as such;
//!   `http://127.0.0.1.nip.io/` is a domain name and is not. IPv4-mapped IPv6 addresses
//!   (`[::ffff:127.0.0.1]`) are judged by the IPv4 address they embed; IPv4-compatible
//!   (`[::127.0.0.1]`) and NAT64 (`[64:ff9b::7f00:1]`) forms are *not* loopback.
//! * **Resolver trust**: only the exact name `localhost` (any ASCII case, at most one trailing
//!   dot) counts as a loopback name. `foo.localhost` is not, because whether it resolves to the
//!   local machine depends on a resolver we do not control.
//! * **Invisible rewriting**: the parser silently strips leading/trailing controls and spaces,
//!   deletes tabs and newlines anywhere, and IDNA deletes invisible characters such as a soft
//!   hyphen from host names. Input containing any control, whitespace, formatting or
//!   default-ignorable character is refused *before* parsing, so what is stored is what the
//!   operator sees. Likewise, input that relies on the parser's error recovery in the URL's
//!   structure (`https:///host`, `http:host`, backslashes used as slashes) is refused rather
//!   than silently repaired.
//! * **Non-endpoints**: `https://0.0.0.0/` or `https://[::]/` name "any address", never a real
//!   endpoint; an IP literal that [`crate::zone::classify`] rejects (multicast, broadcast,
//!   documentation, benchmarking, reserved and the rest of `0.0.0.0/8`, also when embedded in
//!   an IPv4-mapped, NAT64, 6to4 or Teredo form) is never a destination either, and neither is
//!   port 0. The broker would refuse to connect to any of them; refusing them here means an
//!   operator learns it when adding the server (or loading the configuration), with the rule
//!   named, instead of at the first request.
//!
//! What it does *not* do: it performs no DNS resolution and no I/O, and it does not forbid
//! private or link-local addresses over `https` (the operator configured them deliberately).
//! Callers that connect must still apply their own connect-time checks.
//!
//! Accepted endpoint URLs are stored exactly as the `url` crate serializes them (lowercased
//! scheme and host, default port dropped, IPv4 forms canonicalized, and so on); nothing else is
//! rewritten. Identifiers ([`IdentifierUrl`]: issuers, resources) pass the same rules and are
//! stored as written, because they are compared as strings.

use std::cell::Cell;
use std::fmt;
use std::net::Ipv4Addr;

use ::url::{Host, SyntaxViolation, Url};

use crate::zone::{self, Rejected};
use icu_properties::props::{DefaultIgnorableCodePoint, GeneralCategory};
use icu_properties::{CodePointMapData, CodePointSetData};

/// Longest endpoint URL accepted, in bytes, before parsing.
///
/// The same limit also applies to the normalized form after parsing (percent-encoding can
/// make it longer than the input), so a stored URL always re-parses.
pub const MAX_URL_BYTES: usize = 2048;

/// A URL that passed the endpoint rules. Holds the parsed [`::url::Url`].
///
/// By construction: the scheme is `https`, or `http` with a loopback host (see [`judge_host`]);
/// there is a host, and an IP-literal host is one [`crate::zone::classify`] accepts; the port
/// is not 0; there is no userinfo and no fragment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointUrl(::url::Url);

impl EndpointUrl {
    /// Check `input` against the endpoint rules and parse it.
    ///
    /// Checks run in this order, and the first failure is returned: length, characters,
    /// `url` crate parse, scheme, userinfo, fragment, structure (slashes), host presence,
    /// plain-http-only-to-loopback, unspecified address, never-a-destination address, port 0,
    /// normalized length.
    pub fn parse(input: &str) -> Result<Self, UrlError> {
        if input.len() > MAX_URL_BYTES {
            return Err(UrlError::TooLong { len: input.len() });
        }
        check_characters(input)?;

        let seen = Violations::default();
        let record = |violation: SyntaxViolation| seen.record(violation);
        let url = Url::options()
            .syntax_violation_callback(Some(&record))
            .parse(input)
            .map_err(|_| UrlError::Malformed)?;

        let is_http = match url.scheme() {
            "https" => false,
            "http" => true,
            _ => return Err(UrlError::Scheme),
        };
        if seen.credentials.get() || !url.username().is_empty() || url.password().is_some() {
            return Err(UrlError::Userinfo);
        }
        if url.fragment().is_some() {
            return Err(UrlError::Fragment);
        }
        if seen.structure.get() {
            return Err(UrlError::Malformed);
        }
        let host = url.host().ok_or(UrlError::NoHost)?;
        let kind = judge_host(&host);
        if is_http && !matches!(kind, HostKind::LoopbackIp | HostKind::LocalhostName) {
            return Err(UrlError::PlainHttpNotLoopback);
        }
        if is_unspecified(&host) {
            return Err(UrlError::UnspecifiedHost);
        }
        if let Some(rejected) = never_a_destination(&host) {
            return Err(UrlError::NotADestination {
                address: host.to_string(),
                rejected,
            });
        }
        if url.port() == Some(0) {
            return Err(UrlError::PortZero);
        }
        let normalized_len = url.as_str().len();
        if normalized_len > MAX_URL_BYTES {
            return Err(UrlError::TooLong {
                len: normalized_len,
            });
        }
        Ok(Self(url))
    }

    /// The parsed URL.
    pub fn as_url(&self) -> &::url::Url {
        &self.0
    }

    /// The serialized (normalized) form, exactly as the `url` crate serializes it.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// True when the scheme is plain `http`, which the rules only allow to a loopback host.
    pub fn is_loopback_http(&self) -> bool {
        self.0.scheme() == "http"
    }

    /// `scheme://host[:port]` with no path, query or default port: safe to show anywhere
    /// (no userinfo exists by construction).
    pub fn origin_display(&self) -> String {
        self.0.origin().ascii_serialization()
    }
}

impl fmt::Display for EndpointUrl {
    /// Writes the normalized URL (the same text as [`EndpointUrl::as_str`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for EndpointUrl {
    /// Serializes as the normalized URL string.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// A URL that *identifies* something — an authorization server's issuer, a protected
/// resource — and is compared as a string (RFC 8414 §3.3, RFC 9728 §3.3). It passes every rule
/// of [`EndpointUrl`], and is kept, stored, shown and compared **exactly as written**: the
/// parser's normalization would turn `https://as.example` into `https://as.example/`, which is
/// another identifier, one that an authorization server naming itself `https://as.example`
/// never matches. What is kept is safe to show: the endpoint rules refuse every control,
/// whitespace, formatting and invisible character before parsing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentifierUrl {
    written: String,
    url: EndpointUrl,
}

impl IdentifierUrl {
    /// Check `input` against the endpoint rules ([`EndpointUrl::parse`]) and keep it as written.
    pub fn parse(input: &str) -> Result<Self, UrlError> {
        let url = EndpointUrl::parse(input)?;
        Ok(Self {
            written: input.to_owned(),
            url,
        })
    }

    /// The identifier exactly as written.
    pub fn as_str(&self) -> &str {
        &self.written
    }

    /// The parsed (normalized) URL, for connecting and for origin comparisons.
    pub fn endpoint(&self) -> &EndpointUrl {
        &self.url
    }
}

impl fmt::Display for IdentifierUrl {
    /// Writes the identifier as written.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.written)
    }
}

impl serde::Serialize for IdentifierUrl {
    /// Serializes as written.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.written)
    }
}

/// How a host was judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostKind {
    /// An IP literal on the loopback interface: IPv4 `127.0.0.0/8`, IPv6 `::1`, or an
    /// IPv4-mapped `::ffff:127.x.y.z`.
    LoopbackIp,
    /// The domain name `localhost` (ASCII case-insensitive, at most one trailing dot).
    LocalhostName,
    /// Any other IP literal, including unspecified, IPv4-compatible and NAT64 addresses.
    OtherIp,
    /// Any other domain name, including `*.localhost`.
    Domain,
}

/// Judge a parsed host.
///
/// IPv4 `127.0.0.0/8`, IPv6 `::1` and IPv4-mapped `::ffff:127.x.y.z` → [`HostKind::LoopbackIp`];
/// a domain equal to `localhost` (ASCII case-insensitive, at most ONE trailing dot) →
/// [`HostKind::LocalhostName`]; `*.localhost` and every other name → [`HostKind::Domain`]
/// (not loopback: we never trust a resolver for it); other IP literals → [`HostKind::OtherIp`].
///
/// IPv4-mapped addresses are unwrapped with [`std::net::Ipv6Addr::to_ipv4_mapped`], never
/// [`std::net::Ipv6Addr::to_ipv4`], which would also unwrap IPv4-compatible `::a.b.c.d` forms (and turn
/// `::1` into `0.0.0.1`).
pub fn judge_host(host: &::url::Host<&str>) -> HostKind {
    match host {
        Host::Ipv4(addr) => judge_ipv4(*addr),
        Host::Ipv6(addr) => {
            if addr.is_loopback() {
                HostKind::LoopbackIp
            } else if let Some(v4) = addr.to_ipv4_mapped() {
                judge_ipv4(v4)
            } else {
                HostKind::OtherIp
            }
        }
        Host::Domain(name) => {
            let name = name.strip_suffix('.').unwrap_or(name);
            if name.eq_ignore_ascii_case("localhost") {
                HostKind::LocalhostName
            } else {
                HostKind::Domain
            }
        }
    }
}

fn judge_ipv4(addr: Ipv4Addr) -> HostKind {
    if addr.is_loopback() {
        HostKind::LoopbackIp
    } else {
        HostKind::OtherIp
    }
}

/// `0.0.0.0`, `::`, or `::ffff:0.0.0.0` (the mapped form shares its IPv4 address's fate).
fn is_unspecified(host: &Host<&str>) -> bool {
    match host {
        Host::Ipv4(addr) => addr.is_unspecified(),
        Host::Ipv6(addr) => {
            addr.is_unspecified() || addr.to_ipv4_mapped().is_some_and(|v4| v4.is_unspecified())
        }
        Host::Domain(_) => false,
    }
}

/// Why an IP-literal host can never be a destination: the verdict of
/// [`crate::zone::classify`] on the parsed address (names are judged when they resolve).
fn never_a_destination(host: &Host<&str>) -> Option<Rejected> {
    let ip = match host {
        Host::Ipv4(a) => std::net::IpAddr::V4(*a),
        Host::Ipv6(a) => std::net::IpAddr::V6(*a),
        Host::Domain(_) => return None,
    };
    zone::classify(ip).err()
}

/// Why an endpoint URL was refused. The `Display` text is one line, starts lowercase, and never
/// contains the input URL (which may hold a password).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UrlError {
    /// Longer than [`MAX_URL_BYTES`], as written or once normalized.
    TooLong {
        /// Length in bytes of the offending form.
        len: usize,
    },
    /// Contains an ASCII or C1 control, whitespace (ASCII or Unicode), a formatting character
    /// (such as bidi overrides or zero-width joiners) or a default-ignorable character (such as
    /// a soft hyphen): the parser or IDNA would silently strip or hide it.
    InvalidCharacter {
        /// Byte offset of the first such character in the input.
        offset: usize,
        /// The character itself (reported as `U+XXXX`, never as the surrounding text).
        character: char,
    },
    /// The `url` crate refused it, or it relies on parser error recovery in its structure
    /// (not exactly `//` after the scheme, or backslashes used as slashes).
    Malformed,
    /// The scheme is neither `https` nor `http`.
    Scheme,
    /// There is no host.
    NoHost,
    /// A username or password is present, or the authority contains an `@` at all (even the
    /// empty `http://@host/` or `https://:@host/`, which the parser would silently drop).
    Userinfo,
    /// A fragment is present, even an empty `#`.
    Fragment,
    /// Plain `http` to a host that is not loopback.
    PlainHttpNotLoopback,
    /// The host is an unspecified ("any") address: `0.0.0.0`, `::` or `::ffff:0.0.0.0`.
    UnspecifiedHost,
    /// The host is an IP literal that is never a destination (multicast, broadcast,
    /// documentation, benchmarking, reserved, the rest of `0.0.0.0/8`), directly or embedded.
    NotADestination {
        /// The parsed address as the URL writes it (`224.0.0.1`, `[ff02::1]`): an IP literal,
        /// never a secret.
        address: String,
        /// Which range it is in.
        rejected: Rejected,
    },
    /// The port is 0, which no server listens on.
    PortZero,
}

impl fmt::Display for UrlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLong { len } => write!(
                f,
                "endpoint URL is too long: {len} bytes, the limit is {MAX_URL_BYTES} \
                 (as written and once normalized)"
            ),
            Self::InvalidCharacter { offset, character } => write!(
                f,
                "endpoint URL contains a control, whitespace or invisible character \
                 (U+{:04X}) at byte {offset}; remove it",
                u32::from(*character)
            ),
            Self::Malformed => f.write_str(
                "endpoint URL is malformed; write it as scheme://host[:port][/path][?query] \
                 with exactly two forward slashes after the scheme",
            ),
            Self::Scheme => f.write_str(
                "endpoint URL scheme is not allowed; use https (or http to a loopback host)",
            ),
            Self::NoHost => f.write_str("endpoint URL has no host"),
            Self::Userinfo => f.write_str(
                "endpoint URL must not contain a user name, password or '@' before the host; \
                 configure credentials separately",
            ),
            Self::Fragment => f.write_str("endpoint URL must not contain a fragment ('#')"),
            Self::PlainHttpNotLoopback => f.write_str(
                "plain http is only allowed to a loopback host; use https, or http to \
                 127.0.0.1, [::1] or localhost",
            ),
            Self::UnspecifiedHost => f.write_str(
                "endpoint URL host is an unspecified address (0.0.0.0 or ::), which is never a \
                 real endpoint; use the server's actual address",
            ),
            Self::NotADestination { address, rejected } => write!(
                f,
                "endpoint URL host {address} is a {} address, which is never a destination; \
                 use the server's actual address",
                rejected_text(*rejected)
            ),
            Self::PortZero => f.write_str(
                "endpoint URL port is 0, which no server listens on; give the server's actual \
                 port or none",
            ),
        }
    }
}

impl std::error::Error for UrlError {}

/// How a rejected range is named in an error.
fn rejected_text(r: Rejected) -> &'static str {
    match r {
        Rejected::Unspecified => "this-network (0.0.0.0/8)",
        Rejected::Multicast => "multicast",
        Rejected::Broadcast => "broadcast",
        Rejected::Reserved => "reserved",
        Rejected::Documentation => "documentation-only",
        Rejected::Benchmarking => "benchmarking-only",
    }
}

/// Syntax violations reported by the `url` crate that make us refuse the input.
#[derive(Default)]
struct Violations {
    /// An `@` was seen in the authority (`EmbeddedCredentials`, `UnencodedAtSign`).
    credentials: Cell<bool>,
    /// Structure relied on error recovery: not exactly `//` after the scheme, a backslash used
    /// as a slash, or ignored controls (the latter cannot happen after `check_characters`).
    structure: Cell<bool>,
}

impl Violations {
    fn record(&self, violation: SyntaxViolation) {
        match violation {
            SyntaxViolation::EmbeddedCredentials | SyntaxViolation::UnencodedAtSign => {
                self.credentials.set(true);
            }
            SyntaxViolation::ExpectedDoubleSlash
            | SyntaxViolation::Backslash
            | SyntaxViolation::C0SpaceIgnored
            | SyntaxViolation::TabOrNewlineIgnored => self.structure.set(true),
            // Bad percent escapes and non-URL code points are kept or percent-encoded
            // visibly; file-scheme and fragment violations cannot survive the other checks.
            _ => {}
        }
    }
}

/// Refuse any character the parser or IDNA would strip, hide or silently reinterpret.
fn check_characters(input: &str) -> Result<(), UrlError> {
    let general_category = CodePointMapData::<GeneralCategory>::new();
    let ignorable = CodePointSetData::new::<DefaultIgnorableCodePoint>();
    let bad = |c: char| {
        if c.is_ascii() {
            // ASCII controls (C0 and DEL) and space; `is_whitespace` below covers the rest.
            return c.is_ascii_control() || c == ' ';
        }
        c.is_control()
            || c.is_whitespace()
            || matches!(
                general_category.get(c),
                GeneralCategory::Format
                    | GeneralCategory::LineSeparator
                    | GeneralCategory::ParagraphSeparator
            )
            || ignorable.contains(c)
    };
    match input.char_indices().find(|&(_, c)| bad(c)) {
        Some((offset, character)) => Err(UrlError::InvalidCharacter { offset, character }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::Ipv6Addr;

    use HostKind::{Domain, LocalhostName, LoopbackIp, OtherIp};
    use UrlError::{
        Fragment, Malformed, NoHost, PlainHttpNotLoopback, PortZero, Scheme, UnspecifiedHost,
        Userinfo,
    };

    fn invalid(offset: usize, character: char) -> UrlError {
        UrlError::InvalidCharacter { offset, character }
    }

    fn never(address: &str, rejected: Rejected) -> UrlError {
        UrlError::NotADestination {
            address: address.to_owned(),
            rejected,
        }
    }

    /// Each input with its expected outcome: the host judgment when accepted, or the exact error.
    fn ssrf_corpus() -> Vec<(&'static str, Result<HostKind, UrlError>)> {
        vec![
            // Ordinary endpoints.
            ("https://mcp.example.com/mcp?x=1", Ok(Domain)),
            ("HTTPS://MCP.Example.COM/mcp", Ok(Domain)),
            ("https://mcp.example.com:8443/mcp", Ok(Domain)),
            ("https://bücher.example/mcp", Ok(Domain)),
            ("https://[2606:4700:4700::1111]/", Ok(OtherIp)),
            ("https://[::1]/", Ok(LoopbackIp)),
            // https to a private or link-local address is the operator's call.
            ("https://169.254.169.254/", Ok(OtherIp)),
            // Loopback IPv4 in every spelling the WHATWG parser folds to 127.0.0.1.
            ("http://127.0.0.1/", Ok(LoopbackIp)),
            ("http://127.0.0.1:8080/mcp", Ok(LoopbackIp)),
            ("http://127.255.255.254/", Ok(LoopbackIp)),
            ("http://2130706433/", Ok(LoopbackIp)),
            ("http://0x7f000001/", Ok(LoopbackIp)),
            ("http://0177.0.0.1/", Ok(LoopbackIp)),
            ("http://127.1/", Ok(LoopbackIp)),
            ("http://0x7f.1/", Ok(LoopbackIp)),
            ("http://127.0.0.1./", Ok(LoopbackIp)),
            ("http://%31%32%37.0.0.1/", Ok(LoopbackIp)),
            ("http://\u{FF11}\u{FF12}\u{FF17}.0.0.1/", Ok(LoopbackIp)),
            ("http://127\u{3002}0\u{3002}0\u{3002}1/", Ok(LoopbackIp)),
            // The same spellings of non-loopback addresses.
            ("http://167772161/", Err(PlainHttpNotLoopback)),
            ("http://0xa000001/", Err(PlainHttpNotLoopback)),
            ("http://012.0.0.1/", Err(PlainHttpNotLoopback)),
            ("http://%31%30.0.0.1/", Err(PlainHttpNotLoopback)),
            ("http://128.0.0.1/", Err(PlainHttpNotLoopback)),
            (
                "http://169.254.169.254/latest/meta-data/",
                Err(PlainHttpNotLoopback),
            ),
            ("http://10.0.0.1/", Err(PlainHttpNotLoopback)),
            // Unspecified ("any") addresses.
            ("http://0/", Err(PlainHttpNotLoopback)),
            ("http://0.0.0.0/", Err(PlainHttpNotLoopback)),
            ("http://[::]/", Err(PlainHttpNotLoopback)),
            ("https://0/", Err(UnspecifiedHost)),
            ("https://0.0.0.0:443/", Err(UnspecifiedHost)),
            ("https://[::]/", Err(UnspecifiedHost)),
            ("https://[::ffff:0.0.0.0]/", Err(UnspecifiedHost)),
            // IP literals that are never a destination, directly or embedded, and port 0.
            (
                "https://224.0.0.1/",
                Err(never("224.0.0.1", Rejected::Multicast)),
            ),
            (
                "https://239.255.255.250:1900/",
                Err(never("239.255.255.250", Rejected::Multicast)),
            ),
            (
                "https://[ff02::1]/",
                Err(never("[ff02::1]", Rejected::Multicast)),
            ),
            (
                "https://[::ffff:224.0.0.251]/",
                Err(never("[::ffff:e000:fb]", Rejected::Multicast)),
            ),
            (
                "https://192.0.2.10/mcp",
                Err(never("192.0.2.10", Rejected::Documentation)),
            ),
            (
                "https://198.51.100.7/",
                Err(never("198.51.100.7", Rejected::Documentation)),
            ),
            (
                "https://203.0.113.1/",
                Err(never("203.0.113.1", Rejected::Documentation)),
            ),
            (
                "https://[2001:db8::1]/",
                Err(never("[2001:db8::1]", Rejected::Documentation)),
            ),
            (
                "https://[64:ff9b::c000:201]/",
                Err(never("[64:ff9b::c000:201]", Rejected::Documentation)),
            ),
            (
                "https://[2002:cb00:7101::1]/",
                Err(never("[2002:cb00:7101::1]", Rejected::Documentation)),
            ),
            (
                "https://255.255.255.255/",
                Err(never("255.255.255.255", Rejected::Broadcast)),
            ),
            (
                "https://240.0.0.1/",
                Err(never("240.0.0.1", Rejected::Reserved)),
            ),
            (
                "https://198.18.0.1/",
                Err(never("198.18.0.1", Rejected::Benchmarking)),
            ),
            (
                "https://0.1.2.3/",
                Err(never("0.1.2.3", Rejected::Unspecified)),
            ),
            ("http://[::ffff:224.0.0.1]/", Err(PlainHttpNotLoopback)),
            ("https://a.example:0/", Err(PortZero)),
            ("https://a.example:00/mcp", Err(PortZero)),
            ("http://127.0.0.1:0/", Err(PortZero)),
            ("http://localhost:0/mcp", Err(PortZero)),
            ("https://[::1]:0/", Err(PortZero)),
            ("https://10.0.0.1:0/", Err(PortZero)),
            ("https://a.example:1/", Ok(Domain)),
            // IPv6 forms.
            ("http://[::1]/", Ok(LoopbackIp)),
            ("http://[::1]:3000/mcp", Ok(LoopbackIp)),
            ("http://[0:0:0:0:0:0:0:1]/", Ok(LoopbackIp)),
            ("http://[::ffff:127.0.0.1]/", Ok(LoopbackIp)),
            ("http://[::ffff:7f00:1]/", Ok(LoopbackIp)),
            (
                "http://[0:0:0:0:0:ffff:169.254.169.254]/",
                Err(PlainHttpNotLoopback),
            ),
            ("http://[::127.0.0.1]/", Err(PlainHttpNotLoopback)),
            ("http://[::7f00:1]/", Err(PlainHttpNotLoopback)),
            ("http://[64:ff9b::7f00:1]/", Err(PlainHttpNotLoopback)),
            ("http://[64:ff9b::127.0.0.1]/", Err(PlainHttpNotLoopback)),
            ("http://[fe80::1%25eth0]/", Err(Malformed)),
            ("http://[::1]:65536/", Err(Malformed)),
            // Names.
            ("http://localhost/", Ok(LocalhostName)),
            ("http://localhost:8080/mcp", Ok(LocalhostName)),
            ("http://localhost./", Ok(LocalhostName)),
            ("http://LOCALHOST/", Ok(LocalhostName)),
            ("http://LocalHost./", Ok(LocalhostName)),
            ("http://foo.localhost/", Err(PlainHttpNotLoopback)),
            ("http://localhost../", Err(PlainHttpNotLoopback)),
            ("http://localhost.localdomain/", Err(PlainHttpNotLoopback)),
            ("http://127.0.0.1.nip.io/", Err(PlainHttpNotLoopback)),
            ("http://example.com/", Err(PlainHttpNotLoopback)),
            // Userinfo and authority confusion.
            ("http://example.com@127.0.0.1/", Err(Userinfo)),
            ("https://user:pw@a.example/", Err(Userinfo)),
            ("https://user@a.example/", Err(Userinfo)),
            ("https://:pw@a.example/", Err(Userinfo)),
            ("http://@127.0.0.1/", Err(Userinfo)),
            ("https://:@a.example/", Err(Userinfo)),
            ("https://a.example@@b.example/", Err(Userinfo)),
            ("http://127.0.0.1\u{FF0F}@evil.example/", Err(Userinfo)),
            ("http://example.com\u{FF20}127.0.0.1/", Err(Malformed)),
            ("https://a.example\\@evil.example/", Err(Malformed)),
            // Fragments.
            ("http://127.0.0.1#@example.com/", Err(Fragment)),
            ("https://a.example/#", Err(Fragment)),
            ("https://a.example/#section", Err(Fragment)),
            ("https://a.example?x#", Err(Fragment)),
            // Schemes.
            ("ftp://ftp.example.com/file", Err(Scheme)),
            ("file:///etc/passwd", Err(Scheme)),
            ("javascript:alert(1)", Err(Scheme)),
            ("data:text/html,<script>alert(1)</script>", Err(Scheme)),
            ("ws://127.0.0.1/", Err(Scheme)),
            ("gopher://127.0.0.1:25/", Err(Scheme)),
            // Structure the parser would repair.
            ("https:///path", Err(Malformed)),
            ("https:////a.example/", Err(Malformed)),
            ("https://", Err(Malformed)),
            ("http:127.0.0.1/", Err(Malformed)),
            ("https:\\\\a.example/", Err(Malformed)),
            ("https://\\a.example/", Err(Malformed)),
            ("https://a.example\\mcp", Err(Malformed)),
            ("/relative/path", Err(Malformed)),
            ("", Err(Malformed)),
            // Characters the parser or IDNA would silently drop.
            (" https://a.example/", Err(invalid(0, ' '))),
            ("https://a.example/ ", Err(invalid(18, ' '))),
            ("https://a.ex\tample/", Err(invalid(12, '\t'))),
            ("https://a.example/\n", Err(invalid(18, '\n'))),
            ("https://a.example/\r\n", Err(invalid(18, '\r'))),
            ("https://a.example/\u{0}", Err(invalid(18, '\u{0}'))),
            ("https://a.example/\u{7F}", Err(invalid(18, '\u{7F}'))),
            ("https://a.example/\u{85}", Err(invalid(18, '\u{85}'))),
            ("https://exa\u{AD}mple.com/", Err(invalid(11, '\u{AD}'))),
            ("https://a.example\u{200B}/", Err(invalid(17, '\u{200B}'))),
            ("https://a.example/\u{202E}", Err(invalid(18, '\u{202E}'))),
            ("https://a.example/\u{3000}", Err(invalid(18, '\u{3000}'))),
            ("https://a.example/\u{FEFF}", Err(invalid(18, '\u{FEFF}'))),
            ("http://127.0.0.1/\u{2028}", Err(invalid(17, '\u{2028}'))),
        ]
    }

    #[test]
    fn every_corpus_input_gets_its_expected_outcome() {
        let corpus = ssrf_corpus();
        assert!(
            corpus.len() >= 40,
            "corpus has only {} entries",
            corpus.len()
        );
        for (input, want) in corpus {
            let got = EndpointUrl::parse(input).map(|ok| {
                let host = ok.as_url().host();
                judge_host(&host.expect("accepted URLs have a host"))
            });
            assert_eq!(got, want, "input {input:?}");
        }
    }

    #[test]
    fn error_messages_never_contain_the_input_and_are_one_lowercase_line() {
        for (input, want) in ssrf_corpus() {
            let Err(err) = want else { continue };
            let text = err.to_string();
            assert!(text.len() > 10, "{input:?}: {text:?}");
            assert!(
                !text.contains('\n') && !text.contains('\r'),
                "{input:?}: {text:?}"
            );
            assert!(
                text.starts_with(|c: char| c.is_ascii_lowercase()),
                "{text:?}"
            );
            if input.len() >= 8 {
                assert!(!text.contains(input), "{input:?}: {text:?}");
            }
        }
    }

    #[test]
    fn every_error_variant_has_a_distinct_one_line_lowercase_message() {
        let all = [
            UrlError::TooLong { len: 4096 },
            invalid(3, '\t'),
            Malformed,
            Scheme,
            NoHost,
            Userinfo,
            Fragment,
            PlainHttpNotLoopback,
            UnspecifiedHost,
            never("224.0.0.1", Rejected::Multicast),
            PortZero,
        ];
        let mut seen = std::collections::HashSet::new();
        for err in all {
            let text = err.to_string();
            assert!(
                text.starts_with(|c: char| c.is_ascii_lowercase()),
                "{text:?}"
            );
            assert!(!text.contains('\n'), "{text:?}");
            assert!(seen.insert(text.clone()), "duplicate message {text:?}");
            let _: &dyn std::error::Error = &err;
        }
        assert!(UrlError::TooLong { len: 4096 }.to_string().contains("4096"));
        assert!(invalid(3, '\t').to_string().contains("U+0009"));
    }

    #[test]
    fn never_a_destination_errors_name_the_rule_and_the_address() {
        for (input, rule) in [
            ("https://224.0.0.1/mcp", "224.0.0.1 is a multicast address"),
            ("https://[ff02::fb]/", "[ff02::fb] is a multicast address"),
            (
                "https://192.0.2.1/?token=abc",
                "192.0.2.1 is a documentation-only address",
            ),
            (
                "https://[2001:db8::5]:8443/",
                "[2001:db8::5] is a documentation-only address",
            ),
            (
                "https://0.0.0.7/",
                "0.0.0.7 is a this-network (0.0.0.0/8) address",
            ),
            ("https://mcp.example:0/mcp", "port is 0"),
        ] {
            let e = EndpointUrl::parse(input).unwrap_err().to_string();
            assert!(e.contains(rule), "{input}: {e}");
            assert!(!e.contains("token=abc") && !e.contains('\n'), "{e}");
            // Redaction keeps it whole: nothing here looks like a credential.
            assert_eq!(crate::text::single_line(&e), e);
        }
        iteron_test_support::record!("P12", serde_json::json!({}),);
    }

    #[test]
    fn userinfo_errors_do_not_echo_the_password() {
        let err = EndpointUrl::parse("https://user:pw@a.example/").unwrap_err();
        assert_eq!(err, Userinfo);
        assert!(!err.to_string().contains("pw"));
        for input in [
            "https://u:hunter2@a.example/",
            "http://u:hunter2@10.0.0.1/",
            "ftp://u:hunter2@a.example/",
            "https://u:hunter2@a.example/#x",
            " https://u:hunter2@a.example/",
            "https://u:hunter2@[fe80::1%25eth0]/",
            "https://u:hunter2@0.0.0.0/",
        ] {
            let err = EndpointUrl::parse(input).unwrap_err();
            assert!(!err.to_string().contains("hunter2"), "{input:?}: {err}");
            assert!(
                !format!("{err:?}").contains("hunter2"),
                "{input:?}: {err:?}"
            );
        }
    }

    #[test]
    fn plain_http_error_hints_at_https_and_loopback_hosts() {
        let text = PlainHttpNotLoopback.to_string();
        for hint in ["https", "127.0.0.1", "[::1]", "localhost"] {
            assert!(text.contains(hint), "{text:?} lacks {hint:?}");
        }
    }

    #[test]
    fn a_url_of_exactly_the_limit_is_accepted_and_one_byte_more_is_too_long() {
        let prefix = "https://a.example/";
        let at_limit = format!("{prefix}{}", "a".repeat(MAX_URL_BYTES - prefix.len()));
        assert_eq!(at_limit.len(), 2048);
        let ok = EndpointUrl::parse(&at_limit).unwrap();
        assert_eq!(ok.as_str(), at_limit);

        let over = format!("{at_limit}a");
        assert_eq!(over.len(), 2049);
        assert_eq!(
            EndpointUrl::parse(&over),
            Err(UrlError::TooLong { len: 2049 })
        );
        iteron_test_support::record!("P5", serde_json::json!({}),);
    }

    #[test]
    fn a_url_whose_normalized_form_exceeds_the_limit_is_too_long() {
        // 'é' is two bytes as written and six ("%C3%A9") once percent-encoded.
        let input = format!("https://a.example/{}", "é".repeat(1000));
        assert!(input.len() <= MAX_URL_BYTES);
        let err = EndpointUrl::parse(&input).unwrap_err();
        assert_eq!(
            err,
            UrlError::TooLong {
                len: "https://a.example/".len() + 6000
            }
        );
    }

    #[test]
    fn as_str_is_the_url_crate_normalization_with_lowercase_scheme_and_host() {
        let url = EndpointUrl::parse("HTTPS://MCP.Example.COM/mcp").unwrap();
        assert_eq!(url.as_str(), "https://mcp.example.com/mcp");
        assert_eq!(url.to_string(), "https://mcp.example.com/mcp");

        let url = EndpointUrl::parse("http://0x7f.1:8080/mcp").unwrap();
        assert_eq!(url.as_str(), "http://127.0.0.1:8080/mcp");

        let url = EndpointUrl::parse("http://[::ffff:127.0.0.1]/").unwrap();
        assert_eq!(url.as_str(), "http://[::ffff:7f00:1]/");

        let url = EndpointUrl::parse("https://mcp.example.com:443/a/../b?q=1").unwrap();
        assert_eq!(url.as_str(), "https://mcp.example.com/b?q=1");
        assert_eq!(url.as_url().query(), Some("q=1"));
    }

    #[test]
    fn origin_display_is_scheme_host_and_non_default_port_only() {
        let cases = [
            (
                "https://mcp.example.com:8443/mcp?x=1",
                "https://mcp.example.com:8443",
            ),
            ("https://mcp.example.com:443/mcp", "https://mcp.example.com"),
            ("http://[::1]:3000/x", "http://[::1]:3000"),
            ("http://LOCALHOST./mcp", "http://localhost."),
            ("https://bücher.example/", "https://xn--bcher-kva.example"),
        ];
        for (input, origin) in cases {
            assert_eq!(EndpointUrl::parse(input).unwrap().origin_display(), origin);
        }
    }

    #[test]
    fn is_loopback_http_is_true_only_for_plain_http() {
        assert!(
            EndpointUrl::parse("http://127.0.0.1/")
                .unwrap()
                .is_loopback_http()
        );
        assert!(
            EndpointUrl::parse("http://localhost/")
                .unwrap()
                .is_loopback_http()
        );
        assert!(
            !EndpointUrl::parse("https://[::1]/")
                .unwrap()
                .is_loopback_http()
        );
        assert!(
            !EndpointUrl::parse("https://a.example/")
                .unwrap()
                .is_loopback_http()
        );
    }

    #[test]
    fn serializes_as_the_normalized_string() {
        let url = EndpointUrl::parse("HTTPS://MCP.Example.COM/mcp").unwrap();
        assert_eq!(
            serde_json::to_string(&url).unwrap(),
            "\"https://mcp.example.com/mcp\""
        );
    }

    #[test]
    fn judge_host_unwraps_only_ipv4_mapped_addresses() {
        let v6 = |s: &str| judge_host(&Host::Ipv6(s.parse().unwrap()));
        assert_eq!(v6("::1"), LoopbackIp);
        assert_eq!(v6("::ffff:127.0.0.1"), LoopbackIp);
        assert_eq!(v6("::ffff:127.255.0.9"), LoopbackIp);
        assert_eq!(v6("::ffff:10.0.0.1"), OtherIp);
        // `to_ipv4()` would turn these into 127.0.0.1 / 0.0.0.1; they are not loopback.
        assert_eq!(v6("::127.0.0.1"), OtherIp);
        assert_eq!(v6("::"), OtherIp);
        assert_eq!(v6("64:ff9b::7f00:1"), OtherIp);
        assert_eq!(judge_host(&Host::Ipv4(Ipv4Addr::new(0, 0, 0, 1))), OtherIp);
    }

    #[test]
    fn judge_host_allows_localhost_with_at_most_one_trailing_dot() {
        let name = |s: &str| judge_host(&Host::Domain(s));
        assert_eq!(name("localhost"), LocalhostName);
        assert_eq!(name("LocalHost"), LocalhostName);
        assert_eq!(name("localhost."), LocalhostName);
        assert_eq!(name("localhost.."), Domain);
        assert_eq!(name(".localhost"), Domain);
        assert_eq!(name("foo.localhost"), Domain);
        assert_eq!(name("localhost.example"), Domain);
        assert_eq!(name("localhos"), Domain);
        assert_eq!(name(""), Domain);
    }

    /// Invariants every accepted URL must satisfy.
    fn check_accepted(url: &EndpointUrl) {
        let u = url.as_url();
        assert_eq!(u.username(), "");
        assert_eq!(u.password(), None);
        assert_eq!(u.fragment(), None);
        let host = u.host().expect("accepted URLs have a host");
        assert!(!is_unspecified(&host));
        assert_eq!(never_a_destination(&host), None);
        assert_ne!(u.port(), Some(0));
        let kind = judge_host(&host);
        match u.scheme() {
            "https" => assert!(!url.is_loopback_http()),
            "http" => {
                assert!(matches!(kind, LoopbackIp | LocalhostName), "{kind:?}");
                assert!(url.is_loopback_http());
            }
            other => panic!("scheme {other:?} accepted"),
        }
        assert!(url.as_str().len() <= MAX_URL_BYTES);
        // The stored form re-parses to the same value.
        assert_eq!(EndpointUrl::parse(url.as_str()).as_ref(), Ok(url));
        // The origin is a prefix of the URL, followed by the path.
        let origin = url.origin_display();
        assert!(url.as_str().starts_with(&origin));
        assert!(url.as_str()[origin.len()..].starts_with('/'));
    }

    /// Strings shaped like endpoint URLs, mostly well formed, with the tricks of the corpus mixed in.
    fn url_like() -> impl Strategy<Value = String> {
        let scheme = prop_oneof![
            4 => Just("https"),
            4 => Just("http"),
            1 => Just("HTTP"),
            1 => Just("ftp"),
            1 => Just("file"),
            1 => Just("javascript"),
        ];
        let sep = prop_oneof![
            8 => Just("://"),
            1 => Just(":"),
            1 => Just(":///"),
            1 => Just(":\\\\"),
            1 => Just(":/\\"),
        ];
        let userinfo = prop_oneof![
            8 => Just(""),
            1 => Just("@"),
            1 => Just(":@"),
            1 => Just("u:p@"),
            1 => Just("a.example@"),
        ];
        let host = prop_oneof![
            Just("127.0.0.1".to_owned()),
            Just("localhost".to_owned()),
            Just("localhost.".to_owned()),
            Just("[::1]".to_owned()),
            Just("[::ffff:7f00:1]".to_owned()),
            Just("0".to_owned()),
            Just("[::]".to_owned()),
            "[0-9a-fx.]{1,16}",
            "[a-zA-Z0-9%.\u{FF10}-\u{FF19}\u{3002}-]{1,16}",
            "\\[[0-9a-f:.]{1,20}\\]",
        ];
        let port = prop_oneof![
            3 => Just(String::new()),
            1 => (0u32..70000).prop_map(|p| format!(":{p}")),
        ];
        let rest = prop_oneof![
            6 => "(/[a-z0-9%.]{0,6}){0,3}(\\?[a-z0-9=&%]{0,8})?",
            1 => "[/a-z0-9?#@%.\\\\ \t\u{AD}\u{200B}]{0,12}",
        ];
        (scheme, sep, userinfo, host, port, rest)
            .prop_map(|(s, sep, ui, h, p, r)| format!("{s}{sep}{ui}{h}{p}{r}"))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn parse_never_panics_on_arbitrary_strings_and_upholds_the_rules(input in any::<String>()) {
            if let Ok(url) = EndpointUrl::parse(&input) {
                check_accepted(&url);
            }
        }

        #[test]
        fn every_accepted_url_like_string_upholds_the_rules(input in url_like()) {
            if let Ok(url) = EndpointUrl::parse(&input) {
                check_accepted(&url);
            }
        }

        #[test]
        fn an_ip_literal_is_accepted_exactly_when_the_zone_table_accepts_it(
            a in any::<Ipv4Addr>(),
            b in any::<Ipv6Addr>(),
        ) {
            let v4 = EndpointUrl::parse(&format!("https://{a}/"));
            let zone_ok = zone::classify_v4(a).is_ok();
            prop_assert_eq!(v4.is_ok(), zone_ok, "{} {:?}", a, v4);
            if !zone_ok {
                prop_assert!(
                    matches!(v4, Err(UnspecifiedHost | UrlError::NotADestination { .. })),
                    "{} {:?}", a, v4
                );
            }
            let v6 = EndpointUrl::parse(&format!("https://[{b}]/"));
            prop_assert_eq!(v6.is_ok(), zone::classify_v6(b).is_ok(), "{} {:?}", b, v6);
        }

        #[test]
        fn only_port_0_is_refused(port in 0u32..=65535, host in prop_oneof![
            Just("a.example"), Just("127.0.0.1"), Just("[::1]"), Just("10.1.2.3")
        ]) {
            let got = EndpointUrl::parse(&format!("https://{host}:{port}/mcp"));
            prop_assert_eq!(got.is_ok(), port != 0, "{} {:?}", port, got);
            if port == 0 {
                prop_assert_eq!(got.err(), Some(PortZero));
            }
            // Plain http: only loopback, and then the same port rule.
            let got = EndpointUrl::parse(&format!("http://{host}:{port}/mcp"));
            let loopback = matches!(host, "127.0.0.1" | "[::1]");
            let want = match (loopback, port) {
                (false, _) => Some(PlainHttpNotLoopback),
                (true, 0) => Some(PortZero),
                (true, _) => None,
            };
            prop_assert_eq!(got.err(), want);
        }

        #[test]
        fn an_ipv4_mapped_host_is_judged_like_its_ipv4_address(a in any::<Ipv4Addr>()) {
            for scheme in ["http", "https"] {
                let plain = EndpointUrl::parse(&format!("{scheme}://{a}/"));
                let mapped = EndpointUrl::parse(&format!("{scheme}://[::ffff:{a}]/"));
                prop_assert_eq!(plain.is_ok(), mapped.is_ok(), "{} {}", scheme, a);
                // The same verdict; a never-a-destination error names each as written.
                let verdict = |e: Option<UrlError>| e.map(|e| match e {
                    UrlError::NotADestination { rejected, .. } => UrlError::NotADestination {
                        address: String::new(),
                        rejected,
                    },
                    other => other,
                });
                prop_assert_eq!(verdict(plain.err()), verdict(mapped.err()), "{} {}", scheme, a);
            }
            let expected = if a.is_loopback() { LoopbackIp } else { OtherIp };
            let mapped: Ipv6Addr = a.to_ipv6_mapped();
            prop_assert_eq!(judge_host(&Host::Ipv6(mapped)), expected);
            prop_assert_eq!(judge_host(&Host::Ipv4(a)), expected);
        }
    }
}
