//! The validated values of a configuration: absolute paths, commands, scopes, client ids, and
//! why a value is refused (never quoting it).

use std::fmt;

use serde::{Serialize, Serializer};

use super::{MAX_RUN_AS_ID, MAX_STRING_BYTES, MAX_TOKEN_BYTES};
use crate::egress::EgressRuleError;
use crate::names::NameError;
use crate::text::{self, UnsafeChar};
use crate::url::{EndpointUrl, UrlError};

/// An absolute path without NUL, `.`/`..` components or unsafe characters, at most
/// [`MAX_STRING_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct AbsolutePath(String);

impl AbsolutePath {
    /// Validate.
    pub fn parse(s: &str) -> Result<Self, ValueError> {
        check_text(s, MAX_STRING_BYTES)?;
        if !s.starts_with('/') {
            return Err(ValueError::NotAbsolute);
        }
        if s.split('/').any(|c| c == "." || c == "..") {
            return Err(ValueError::DotComponent);
        }
        Ok(AbsolutePath(s.to_owned()))
    }

    /// The path.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A stdio server's program: an absolute path, or a bare program name looked up on the broker's
/// fixed safe `PATH` at spawn time. Relative paths with a `/` are refused: they would depend on
/// the working directory of whoever starts the broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Command(String);

impl Command {
    /// Validate.
    pub fn parse(s: &str) -> Result<Self, ValueError> {
        if s.chars().any(char::is_whitespace) {
            // A command is one program; `/usr/bin/env TOKEN=… server` is not a command.
            return Err(ValueError::Whitespace);
        }
        if s.starts_with('/') {
            return AbsolutePath::parse(s).map(|p| Command(p.0));
        }
        check_text(s, MAX_STRING_BYTES)?;
        let bare = s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b));
        if !bare || s.starts_with('.') || s.starts_with('-') {
            return Err(ValueError::NotAbsolute);
        }
        Ok(Command(s.to_owned()))
    }

    /// The command text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An OAuth scope token (RFC 6749 §3.3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Scope(String);

impl Scope {
    /// Validate.
    pub fn parse(s: &str) -> Result<Self, ValueError> {
        if s.is_empty() {
            return Err(ValueError::Empty);
        }
        if s.len() > MAX_TOKEN_BYTES {
            return Err(ValueError::TooLong {
                max: MAX_TOKEN_BYTES,
            });
        }
        let ok = s
            .bytes()
            .all(|b| b == 0x21 || (0x23..=0x5b).contains(&b) || (0x5d..=0x7e).contains(&b));
        if !ok {
            return Err(ValueError::BadScope);
        }
        Ok(Scope(s.to_owned()))
    }

    /// The scope.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An OAuth client id: a plain identifier, or a client ID metadata document URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientId {
    /// A pre-registered identifier (printable ASCII, no spaces).
    Plain(String),
    /// A CIMD URL.
    Document(EndpointUrl),
}

impl ClientId {
    /// Validate: anything containing `://` must be an endpoint URL.
    pub fn parse(s: &str) -> Result<Self, ValueError> {
        if s.contains("://") {
            return EndpointUrl::parse(s)
                .map(ClientId::Document)
                .map_err(ValueError::Url);
        }
        if s.is_empty() {
            return Err(ValueError::Empty);
        }
        if s.len() > MAX_TOKEN_BYTES {
            return Err(ValueError::TooLong {
                max: MAX_TOKEN_BYTES,
            });
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ValueError::BadClientId);
        }
        Ok(ClientId::Plain(s.to_owned()))
    }

    /// The id as configured.
    pub fn as_str(&self) -> &str {
        match self {
            ClientId::Plain(s) => s,
            ClientId::Document(u) => u.as_str(),
        }
    }
}

impl Serialize for ClientId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Why a single value was refused (shared by the file reader and the command line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueError {
    /// Empty where a value is required.
    Empty,
    /// Over the byte bound.
    TooLong {
        /// The bound.
        max: usize,
    },
    /// Contains a NUL byte.
    Nul,
    /// Contains a character unsafe to display (bidi control, invisible, control, …).
    Unsafe(UnsafeChar),
    /// A path that must be absolute is not (or a command that is neither absolute nor bare).
    NotAbsolute,
    /// A path with a `.` or `..` component.
    DotComponent,
    /// Not an OAuth scope token.
    BadScope,
    /// A client id with spaces or non-printable characters.
    BadClientId,
    /// A name outside its grammar.
    Name(NameError),
    /// A URL that breaks the endpoint rules.
    Url(UrlError),
    /// Not `IP`, `IP:port` or `[IPv6]:port`, or an unspecified/multicast address or port 0.
    BadNameserver,
    /// Whitespace where one program path is expected.
    Whitespace,
    /// Not `nobody`, `root` or `UID:GID` within bounds.
    BadRunAs,
    /// Not 64 lowercase hex digits.
    BadDigest,
    /// Not a `YYYY-MM-DDTHH:MM:SSZ` time from 1970 on.
    BadTime,
    /// Not `namespace` or `host`.
    BadSandboxNetwork,
    /// Not a `sandbox.egress` entry.
    Egress(EgressRuleError),
}

impl fmt::Display for ValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueError::Empty => f.write_str("is empty"),
            ValueError::TooLong { max } => write!(f, "is longer than {max} bytes"),
            ValueError::Nul => f.write_str("contains a NUL character"),
            ValueError::Unsafe(u) => write!(f, "contains {u}"),
            ValueError::NotAbsolute => {
                f.write_str("must be an absolute path (or, for a command, a bare program name)")
            }
            ValueError::DotComponent => f.write_str("must not contain '.' or '..' components"),
            ValueError::BadScope => f.write_str("is not an OAuth scope token"),
            ValueError::BadClientId => {
                f.write_str("must be printable ASCII without spaces, or an https URL")
            }
            ValueError::Name(e) => e.fmt(f),
            ValueError::Url(e) => e.fmt(f),
            ValueError::Whitespace => f.write_str(
                "must be a single program without spaces; put arguments after -- (or in \"args\")",
            ),
            ValueError::BadNameserver => f.write_str(
                "must be IP, IP:port or [IPv6]:port (not unspecified, multicast or port 0)",
            ),
            ValueError::BadRunAs => write!(
                f,
                "must be \"nobody\", \"root\" or UID:GID (decimal, each 1 to {MAX_RUN_AS_ID})"
            ),
            ValueError::BadDigest => f.write_str("must be a SHA-256 in 64 lowercase hex digits"),
            ValueError::BadTime => {
                f.write_str("must be a UTC time written YYYY-MM-DDTHH:MM:SSZ (1970 or later)")
            }
            ValueError::BadSandboxNetwork => f.write_str("must be \"namespace\" or \"host\""),
            ValueError::Egress(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ValueError {}

pub(super) fn check_text(s: &str, max: usize) -> Result<(), ValueError> {
    if s.is_empty() {
        return Err(ValueError::Empty);
    }
    if s.len() > max {
        return Err(ValueError::TooLong { max });
    }
    if s.contains('\0') {
        return Err(ValueError::Nul);
    }
    text::check_untrusted(s, false).map_err(ValueError::Unsafe)
}

/// Validate one stdio argument: at most [`MAX_STRING_BYTES`], no NUL, nothing unsafe to display.
/// Empty arguments are legal.
pub fn check_arg(s: &str) -> Result<(), ValueError> {
    if s.is_empty() {
        return Ok(());
    }
    check_text(s, MAX_STRING_BYTES)
}
