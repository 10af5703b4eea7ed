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
mod tests;
