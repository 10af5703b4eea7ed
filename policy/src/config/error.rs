//! What can be wrong with a configuration file (one line naming the JSON path, line and
//! column, never a value), and why a server cannot be added.

use std::fmt;

use super::{MAX_CONFIG_BYTES, MAX_SERVERS, SCHEMA_VERSION, ValueError};
use crate::json::{Path, Pos, SyntaxError};
use crate::names::ServerName;

/// What was wrong with the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigErrorKind {
    /// The file is larger than [`MAX_CONFIG_BYTES`].
    TooLarge,
    /// Not well-formed JSON (or a duplicate key).
    Syntax(SyntaxError),
    /// `schema_version` is missing, not an integer, or not [`SCHEMA_VERSION`].
    SchemaVersion {
        /// The integer found, when it was one.
        found: Option<u64>,
    },
    /// A key this schema does not define.
    UnknownKey {
        /// The key, escaped for display.
        key: String,
        /// The keys allowed here.
        allowed: &'static [&'static str],
    },
    /// A key that must be present.
    MissingKey(&'static str),
    /// A value of the wrong JSON type.
    WrongType {
        /// What the schema wants.
        expected: &'static str,
        /// What the file has.
        found: &'static str,
    },
    /// A list longer than its bound.
    TooMany {
        /// The bound.
        max: usize,
    },
    /// The same item twice in a list, or two servers whose names fold alike.
    Duplicate {
        /// Where the first one is.
        first: Pos,
    },
    /// A value outside the allowed set of words.
    UnknownWord {
        /// The allowed words.
        allowed: &'static [&'static str],
    },
    /// A key that does not belong to this server's transport.
    NotForTransport {
        /// The key.
        key: &'static str,
        /// The server's transport.
        transport: &'static str,
    },
    /// A tool named in both `tools.allow` and `tools.deny`.
    AllowedAndDenied,
    /// An integer outside its bounds (or not a non-negative integer).
    OutOfRange {
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
    },
    /// A single value was refused.
    Value(ValueError),
    /// A key that only makes sense together with another one, or that excludes another one
    /// (fixed text naming both).
    Inconsistent(&'static str),
    /// An object that must have exactly one of these keys (an argument constraint).
    ExactlyOne {
        /// The keys, one of which must be given.
        allowed: &'static [&'static str],
    },
    /// A range whose `min` is greater than its `max`.
    RangeInverted,
    /// A key that only an allow rule may have.
    NotForDeny {
        /// The key.
        key: &'static str,
    },
}

/// A configuration error: where, and what. Its `Display` is one line and never quotes a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The JSON path.
    pub path: Path,
    /// The line and column.
    pub pos: Pos,
    /// What was wrong.
    pub kind: ConfigErrorKind,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.path, self.pos, self.kind)
    }
}

impl fmt::Display for ConfigErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigErrorKind::TooLarge => {
                write!(f, "configuration is larger than {MAX_CONFIG_BYTES} bytes")
            }
            ConfigErrorKind::Syntax(e) => e.fmt(f),
            ConfigErrorKind::SchemaVersion { found: Some(v) } => write!(
                f,
                "unsupported schema_version {v}; this iteron reads schema_version {SCHEMA_VERSION}"
            ),
            ConfigErrorKind::SchemaVersion { found: None } => write!(
                f,
                "schema_version must be the integer {SCHEMA_VERSION} (the only supported version)"
            ),
            ConfigErrorKind::UnknownKey { key, allowed } => {
                write!(f, "unknown key \"{key}\" (allowed: {})", allowed.join(", "))
            }
            ConfigErrorKind::MissingKey(k) => write!(f, "missing required key \"{k}\""),
            ConfigErrorKind::WrongType { expected, found } => {
                write!(f, "expected {expected}, found {found}")
            }
            ConfigErrorKind::TooMany { max } => write!(f, "more than {max} entries"),
            ConfigErrorKind::Duplicate { first } => {
                write!(f, "duplicate entry (first at {first})")
            }
            ConfigErrorKind::UnknownWord { allowed } => {
                write!(f, "must be one of: {}", allowed.join(", "))
            }
            ConfigErrorKind::NotForTransport { key, transport } => {
                write!(f, "\"{key}\" is not valid for a {transport} server")?;
                if *key == "url" {
                    f.write_str(" (set \"transport\": \"http\")")?;
                }
                Ok(())
            }
            ConfigErrorKind::AllowedAndDenied => {
                f.write_str("tool is listed in both tools.allow and tools.deny")
            }
            ConfigErrorKind::OutOfRange { min, max } => {
                write!(f, "must be an integer from {min} to {max}")
            }
            ConfigErrorKind::Value(e) => e.fmt(f),
            ConfigErrorKind::Inconsistent(why) => f.write_str(why),
            ConfigErrorKind::ExactlyOne { allowed } => {
                write!(f, "must have exactly one of: {}", allowed.join(", "))
            }
            ConfigErrorKind::RangeInverted => f.write_str("min is greater than max"),
            ConfigErrorKind::NotForDeny { key } => {
                write!(
                    f,
                    "\"{key}\" is for allow rules only (a deny rule counts nothing)"
                )
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// Why a server could not be added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddError {
    /// A server with this name (compared case-insensitively) exists.
    Exists(ServerName),
    /// The configuration already holds [`MAX_SERVERS`].
    Full,
}

impl fmt::Display for AddError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddError::Exists(n) => write!(f, "a server named {n} already exists"),
            AddError::Full => write!(f, "the configuration already holds {MAX_SERVERS} servers"),
        }
    }
}

impl std::error::Error for AddError {}
