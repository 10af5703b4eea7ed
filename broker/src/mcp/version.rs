//! Protocol versions and eras.
//!
//! Iteron speaks 2025-06-18 and 2025-11-25 (the stateful era: `initialize`, sessions) and
//! 2026-07-28 (the modern, stateless era: a `_meta` envelope on every request). 2024-11-05 and
//! 2025-03-26 are refused when a server negotiates them: they are outside the support matrix.

use std::fmt;

/// A protocol version this client speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Version {
    /// 2025-06-18.
    V2025_06_18,
    /// 2025-11-25.
    V2025_11_25,
    /// 2026-07-28.
    V2026_07_28,
}

impl Version {
    /// Every supported version, oldest first.
    pub const ALL: [Version; 3] = [
        Version::V2025_06_18,
        Version::V2025_11_25,
        Version::V2026_07_28,
    ];
    /// The newest stateful version.
    pub const LATEST_LEGACY: Version = Version::V2025_11_25;
    /// The newest version.
    pub const LATEST: Version = Version::V2026_07_28;

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Version::V2025_06_18 => "2025-06-18",
            Version::V2025_11_25 => "2025-11-25",
            Version::V2026_07_28 => "2026-07-28",
        }
    }

    /// Parse a supported version; anything else (including the refused older ones) is `None`.
    pub fn parse(s: &str) -> Option<Version> {
        Version::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// Whether this version uses the stateless, per-request envelope.
    pub fn is_modern(self) -> bool {
        self >= Version::V2026_07_28
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Versions that exist but are outside the support matrix; a server that negotiates one is
/// refused by name.
pub const REFUSED: &[&str] = &["2024-11-05", "2025-03-26"];

/// How the client chooses a version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionPolicy {
    /// Probe 2026-07-28 first; fall back to the stateful handshake only on an explicit legacy
    /// signal.
    Auto,
    /// Use exactly this version (diagnostics and the conformance client).
    Pin(Version),
}

/// Pick the best version from a server's `supported` list (a `-32022` answer or
/// `server/discover`), if any is ours.
pub fn best_common(supported: &[String]) -> Option<Version> {
    supported.iter().filter_map(|s| Version::parse(s)).max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_order() {
        for v in Version::ALL {
            assert_eq!(Version::parse(v.as_str()), Some(v));
        }
        for old in REFUSED {
            assert_eq!(Version::parse(old), None);
        }
        assert!(Version::V2026_07_28.is_modern());
        assert!(!Version::V2025_11_25.is_modern());
        assert_eq!(
            best_common(&[
                "2024-11-05".into(),
                "2025-06-18".into(),
                "2099-01-01".into()
            ]),
            Some(Version::V2025_06_18)
        );
        assert_eq!(best_common(&["2025-03-26".into()]), None);
    }
}
