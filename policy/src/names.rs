//! Name grammars. Every name that reaches a file path, a process environment, an HTTP header or
//! an operator's terminal passes one of these newtypes first, so later code can rely on the
//! grammar instead of re-checking it ("parse, don't validate").
//!
//! Error texts never repeat the rejected input: a mistyped `NAME=value` could be a secret.

use std::fmt;

use serde::Serialize;

/// Why a name was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameError {
    /// Empty.
    Empty,
    /// Longer than the grammar allows.
    TooLong {
        /// The limit in bytes.
        max: usize,
    },
    /// A character outside the grammar; `position` is the 1-based character index.
    BadCharacter {
        /// 1-based index of the first offending character.
        position: usize,
    },
    /// The first character may not start a name of this kind.
    BadStart,
    /// A reserved name.
    Reserved,
    /// An environment variable name with `=`: the value was given where only a name belongs.
    ValueGiven,
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NameError::Empty => f.write_str("is empty"),
            NameError::TooLong { max } => write!(f, "is longer than {max} bytes"),
            NameError::BadCharacter { position } => {
                write!(
                    f,
                    "has a character outside the allowed set at position {position}"
                )
            }
            NameError::BadStart => f.write_str("starts with a character that cannot start it"),
            NameError::Reserved => f.write_str("is reserved"),
            NameError::ValueGiven => f.write_str(
                "contains '=': give only the variable's NAME; its value is read from the \
                 environment when needed and is never stored",
            ),
        }
    }
}

impl std::error::Error for NameError {}

fn check(
    s: &str,
    max: usize,
    allowed: impl Fn(u8) -> bool,
    first_ok: impl Fn(u8) -> bool,
) -> Result<(), NameError> {
    if s.is_empty() {
        return Err(NameError::Empty);
    }
    if s.len() > max {
        return Err(NameError::TooLong { max });
    }
    for (i, c) in s.chars().enumerate() {
        let ok = c.is_ascii() && allowed(c as u8);
        if !ok {
            return Err(NameError::BadCharacter { position: i + 1 });
        }
    }
    if !s.as_bytes().first().is_some_and(|b| first_ok(*b)) {
        return Err(NameError::BadStart);
    }
    Ok(())
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// The validated name.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = NameError;
            fn from_str(s: &str) -> Result<Self, NameError> {
                Self::parse(s)
            }
        }
    };
}

/// Longest server name, in bytes.
pub const MAX_SERVER_NAME: usize = 64;
/// Longest environment variable name, in bytes.
pub const MAX_ENV_NAME: usize = 128;
/// Longest MCP tool name, in bytes (the 2025-11-25 tool-name guidance).
pub const MAX_TOOL_NAME: usize = 128;
/// Longest HTTP header name, in bytes.
pub const MAX_HEADER_NAME: usize = 64;

name_type!(
    /// An MCP server name: 1–64 bytes of ASCII letters, digits, `.`, `_`, `-`; not `.` or `..`
    /// (names become file names); not starting with `-` (it would read as a command-line flag).
    ServerName
);

impl ServerName {
    /// Validate a server name.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        check(
            s,
            MAX_SERVER_NAME,
            |b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'),
            |b| b != b'-',
        )?;
        if s == "." || s == ".." {
            return Err(NameError::Reserved);
        }
        Ok(ServerName(s.to_owned()))
    }

    /// The name folded to ASCII lower case. Two servers whose names fold alike are refused, so
    /// `GitHub` and `github` can never both be configured and confused for each other.
    pub fn folded(&self) -> String {
        self.0.to_ascii_lowercase()
    }
}

name_type!(
    /// An environment variable name, `[A-Za-z_][A-Za-z0-9_]*`, at most 128 bytes.
    EnvName
);

impl EnvName {
    /// Validate an environment variable name. `NAME=value` gets its own error so the operator
    /// learns that values are never stored.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        if s.contains('=') {
            return Err(NameError::ValueGiven);
        }
        check(
            s,
            MAX_ENV_NAME,
            |b| b.is_ascii_alphanumeric() || b == b'_',
            |b| b.is_ascii_alphabetic() || b == b'_',
        )?;
        Ok(EnvName(s.to_owned()))
    }
}

name_type!(
    /// An MCP tool name: 1–128 bytes of ASCII letters, digits, `_`, `-`, `.`; case-sensitive.
    ToolName
);

impl ToolName {
    /// Validate a tool name.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        check(
            s,
            MAX_TOOL_NAME,
            |b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'),
            |_| true,
        )?;
        Ok(ToolName(s.to_owned()))
    }
}

/// Headers the MCP client itself owns; configuration may not set them, because a configured value
/// could desynchronise framing, sessions or version negotiation.
pub const RESERVED_HEADERS: &[&str] = &[
    "accept",
    "connection",
    "content-encoding",
    "content-length",
    "content-type",
    "host",
    "keep-alive",
    "last-event-id",
    "mcp-method",
    "mcp-name",
    "mcp-protocol-version",
    "mcp-session-id",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

name_type!(
    /// An HTTP header name (RFC 9110 token characters), stored in ASCII lower case, at most 64
    /// bytes, and not one the client owns ([`RESERVED_HEADERS`], `mcp-param-*`).
    HeaderName
);

impl HeaderName {
    /// Validate a header name and fold it to lower case.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        check(
            s,
            MAX_HEADER_NAME,
            |b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b),
            |_| true,
        )?;
        let lower = s.to_ascii_lowercase();
        if RESERVED_HEADERS.contains(&lower.as_str()) || lower.starts_with("mcp-param-") {
            return Err(NameError::Reserved);
        }
        Ok(HeaderName(lower))
    }
}

/// Longest approval rule id, in bytes. Short enough that an id in an audit record's detail is
/// never mistaken for a random secret and redacted (that takes 40 bytes of mixed characters).
pub const MAX_RULE_ID: usize = 32;

name_type!(
    /// An approval rule's id: 1–32 bytes of ASCII letters, digits, `.`, `_`, `-`, starting with
    /// a letter or digit; unique within the configuration (compared exactly).
    RuleId
);

impl RuleId {
    /// Validate a rule id.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        check(
            s,
            MAX_RULE_ID,
            |b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'),
            |b| b.is_ascii_alphanumeric(),
        )?;
        Ok(RuleId(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn server_names_follow_the_grammar() {
        for ok in ["a", "github", "my.server_2-x", &"x".repeat(64), "A.B", "_x"] {
            ServerName::parse(ok).unwrap();
        }
        let bad: &[(&str, NameError)] = &[
            ("", NameError::Empty),
            (&"x".repeat(65), NameError::TooLong { max: 64 }),
            ("a b", NameError::BadCharacter { position: 2 }),
            ("a/b", NameError::BadCharacter { position: 2 }),
            ("é", NameError::BadCharacter { position: 1 }),
            ("ab\u{200b}", NameError::BadCharacter { position: 3 }),
            ("-x", NameError::BadStart),
            (".", NameError::Reserved),
            ("..", NameError::Reserved),
        ];
        for (input, want) in bad {
            assert_eq!(ServerName::parse(input).unwrap_err(), *want, "{input:?}");
        }
    }

    #[test]
    fn env_names_follow_the_grammar_and_refuse_values() {
        for ok in ["A", "_", "ITERON_MCP_TOKEN", "a1", &"A".repeat(128)] {
            EnvName::parse(ok).unwrap();
        }
        assert_eq!(
            EnvName::parse("FOO=bar").unwrap_err(),
            NameError::ValueGiven
        );
        assert_eq!(EnvName::parse("1A").unwrap_err(), NameError::BadStart);
        assert_eq!(
            EnvName::parse("A-B").unwrap_err(),
            NameError::BadCharacter { position: 2 }
        );
        assert_eq!(
            EnvName::parse(&"A".repeat(129)).unwrap_err(),
            NameError::TooLong { max: 128 }
        );
    }

    #[test]
    fn the_value_never_appears_in_an_env_name_error() {
        let e = EnvName::parse("TOKEN=sk-canary-1234").unwrap_err();
        assert!(!e.to_string().contains("canary"));
    }

    #[test]
    fn header_names_are_lowercased_and_reserved_ones_refused() {
        assert_eq!(HeaderName::parse("X-Tenant").unwrap().as_str(), "x-tenant");
        assert_eq!(
            HeaderName::parse("Authorization").unwrap().as_str(),
            "authorization"
        );
        for reserved in [
            "Host",
            "MCP-Session-Id",
            "mcp-param-region",
            "Content-Length",
        ] {
            assert_eq!(
                HeaderName::parse(reserved).unwrap_err(),
                NameError::Reserved
            );
        }
        assert!(HeaderName::parse("x tenant").is_err());
        assert!(HeaderName::parse("x:y").is_err());
    }

    #[test]
    fn tool_names_follow_the_mcp_guidance() {
        ToolName::parse("get_weather.v2-beta").unwrap();
        ToolName::parse(&"t".repeat(128)).unwrap();
        assert!(ToolName::parse(&"t".repeat(129)).is_err());
        assert!(ToolName::parse("a b").is_err());
        assert!(ToolName::parse("a/b").is_err());
    }

    #[test]
    fn rule_ids_follow_their_grammar_at_the_limit_and_one_over() {
        for ok in ["ci-echo", "a", "R.1_x-y", &"r".repeat(MAX_RULE_ID)] {
            RuleId::parse(ok).unwrap();
        }
        assert_eq!(
            RuleId::parse(&"r".repeat(MAX_RULE_ID + 1)).unwrap_err(),
            NameError::TooLong { max: MAX_RULE_ID }
        );
        assert_eq!(RuleId::parse("").unwrap_err(), NameError::Empty);
        assert_eq!(RuleId::parse("-x").unwrap_err(), NameError::BadStart);
        assert_eq!(RuleId::parse(".x").unwrap_err(), NameError::BadStart);
        assert_eq!(
            RuleId::parse("a b").unwrap_err(),
            NameError::BadCharacter { position: 2 }
        );
    }

    proptest! {
        #[test]
        fn server_name_accepts_exactly_the_grammar(s in "\\PC{0,70}") {
            let grammar = !s.is_empty() && s.len() <= 64
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
                && !s.starts_with('-') && s != "." && s != "..";
            prop_assert_eq!(ServerName::parse(&s).is_ok(), grammar);
        }

        #[test]
        fn env_name_accepts_exactly_the_grammar(s in "[A-Za-z0-9_=-]{0,10}") {
            let grammar = !s.is_empty()
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !s.as_bytes()[0].is_ascii_digit();
            prop_assert_eq!(EnvName::parse(&s).is_ok(), grammar);
        }
    }
}
