//! OAuth for MCP servers: discovery (RFC 9728 protected-resource metadata, RFC 8414 and OpenID
//! discovery), client registration (pre-registered, client ID metadata document, RFC 7591
//! dynamic registration), the authorization-code flow with PKCE S256, RFC 9207 `iss` checks,
//! token exchange, refresh and revocation.
//!
//! Everything a server or an authorization server says is untrusted: every document is fetched
//! through [`crate::net`] under the binding zone of the MCP server (so a public server cannot
//! steer the broker to a private, link-local or loopback address), bodies are bounded, nothing
//! is followed on a redirect, issuers must match exactly, and endpoints must be published by the
//! issuer's own metadata and pass the endpoint URL rules. Secrets (codes, verifiers, tokens,
//! client secrets) live in [`SecretString`] and never reach `Debug`, `Display` or an error.
#![forbid(unsafe_code)]

pub mod dpop;
pub mod external;
pub mod flow;
pub mod grant;
pub mod jose;
pub mod login;
pub mod material;
pub mod metadata;

use std::fmt;

pub use secrecy::{ExposeSecret, SecretString};

use crate::net::NetError;

/// Largest OAuth or metadata response body (DESIGN §11).
pub const MAX_OAUTH_BODY: usize = 1024 * 1024;

/// Everything OAuth can refuse or fail with. `Display` is one line and never holds a secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OAuthError {
    /// The network layer refused or failed.
    Net(NetError),
    /// No protected-resource metadata could be found.
    NoResourceMetadata,
    /// The metadata's `resource` does not identify this server.
    ResourceMismatch,
    /// No usable authorization-server metadata.
    NoServerMetadata,
    /// The metadata's `issuer` is not the issuer it was fetched for.
    IssuerMismatch,
    /// A document was malformed (what, not the content).
    Malformed(&'static str),
    /// An endpoint failed the rules (which one, its host, and the rule it broke). The URL
    /// itself is never kept: its path or query may hold a secret.
    BadEndpoint {
        /// Which endpoint (the metadata key, or `issuer`).
        which: &'static str,
        /// The host of the refused URL, when one could be read ([`host_of`]).
        host: Option<String>,
        /// The rule it broke (fixed text).
        why: String,
    },
    /// The server does not offer PKCE with S256.
    NoPkce,
    /// No registration method is available (or the forced one is not).
    NoRegistration(&'static str),
    /// The authorization response failed a check.
    Callback(&'static str),
    /// The authorization server answered with an OAuth error.
    Server {
        /// The `error` code (a short ASCII token).
        error: String,
        /// HTTP status.
        status: u16,
    },
    /// A successful token response could not be used (malformed, oversized or unsafe tokens,
    /// another token type, an absurd lifetime). The tokens it carried were offered for
    /// revocation first: a grant nobody can hold is not left live.
    UnusableTokens {
        /// The rule the response broke (fixed text).
        why: &'static str,
        /// What became of the tokens it carried.
        revoked: Revoked,
    },
    /// The workload's identity token cannot be presented (where it comes from, and the rule).
    Identity {
        /// Where it comes from (a path or a variable name, never the token).
        source: String,
        /// Why (fixed text).
        why: &'static str,
    },
    /// The identity token file cannot be read (the rule and the path).
    IdentityFile {
        /// Why, naming the path.
        why: String,
    },
    /// An explicit re-login found the server naming another resource or authorization server
    /// than the stored login is bound to; it stays where it was unless the operator names the
    /// new one. Both identifiers are shown (escaped): the operator needs them to decide.
    Moved {
        /// What moved (`resource`, `authorization server`).
        what: &'static str,
        /// What the stored login is bound to.
        bound: String,
        /// What the server names now.
        now: String,
        /// The login flag that names the new one.
        flag: &'static str,
    },
}

/// A line of remote or file-system text made safe for an error.
pub(crate) fn text_line(s: &str) -> String {
    iteron_policy::text::single_line_capped(s, 300)
}

/// What became of tokens Iteron received but could not keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revoked {
    /// The response carried no token string to revoke.
    NothingToRevoke,
    /// The authorization server accepted the revocation of every token.
    Revoked,
    /// The authorization server offers no revocation endpoint.
    NotOffered,
    /// Revocation was refused or failed.
    Failed,
}

impl Revoked {
    /// One clause for an error line.
    pub fn as_str(self) -> &'static str {
        match self {
            Revoked::NothingToRevoke => "there was no new token to revoke",
            Revoked::Revoked => "the new tokens were revoked at the authorization server",
            Revoked::NotOffered => {
                "the authorization server offers no revocation, so the new tokens stay valid until they expire"
            }
            Revoked::Failed => "revoking the new tokens failed",
        }
    }
}

/// The host of a URL the rules refused, for an error line: what the `url` crate parsed (ASCII,
/// IDNA-encoded, bracketed for IPv6), only if it is visible ASCII of at most 253 bytes. Never
/// the path or query, which may hold a secret.
pub fn host_of(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok()?;
    let host = parsed.host_str()?;
    (!host.is_empty() && host.len() <= 253 && host.bytes().all(|b| b.is_ascii_graphic()))
        .then(|| host.to_owned())
}

impl fmt::Display for OAuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OAuthError::Net(e) => e.fmt(f),
            OAuthError::NoResourceMetadata => {
                f.write_str("no protected-resource metadata was found for the server")
            }
            OAuthError::ResourceMismatch => f.write_str(
                "the protected-resource metadata names another resource than this server; refused",
            ),
            OAuthError::NoServerMetadata => {
                f.write_str("no authorization-server metadata was found for the issuer")
            }
            OAuthError::IssuerMismatch => f.write_str(
                "the authorization-server metadata names another issuer than the one it was fetched for; refused",
            ),
            OAuthError::Malformed(what) => write!(f, "malformed {what}"),
            // No `name: value` shape: the redactor would take `token_endpoint: …` or
            // `authorization_endpoint: …` for a credential and hide the reason.
            OAuthError::BadEndpoint { which, host, why } => match host {
                Some(h) => write!(f, "refused {which} (host {h}): {why}"),
                None => write!(f, "refused {which} (no host could be read): {why}"),
            },
            OAuthError::NoPkce => f.write_str(
                "the authorization server does not advertise PKCE with S256; refused",
            ),
            OAuthError::NoRegistration(why) => write!(f, "cannot register a client: {why}"),
            OAuthError::Callback(why) => write!(f, "authorization response refused: {why}"),
            OAuthError::Server { error, status } => {
                write!(f, "the authorization server answered {status} {error}")
            }
            OAuthError::UnusableTokens { why, revoked } => write!(
                f,
                "the token response was refused because {why}; {}",
                revoked.as_str()
            ),
            OAuthError::Identity { source, why } => write!(f, "{source} {why}"),
            OAuthError::IdentityFile { why } => write!(f, "the identity token file {why}"),
            OAuthError::Moved {
                what,
                bound,
                now,
                flag,
            } => write!(
                f,
                "the server now names {what} \"{}\", but its login is bound to {what} \"{}\"; \
                 a re-login stays where it was (pass {flag} with the new one to move it)",
                text_line(now),
                text_line(bound)
            ),
        }
    }
}

impl std::error::Error for OAuthError {}

impl From<NetError> for OAuthError {
    fn from(e: NetError) -> Self {
        OAuthError::Net(e)
    }
}

/// Parameters of a `WWW-Authenticate: Bearer …` challenge (RFC 6750, RFC 9728). None of them is
/// a secret.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Challenge {
    /// `resource_metadata`: where the protected-resource metadata is.
    pub resource_metadata: Option<String>,
    /// `scope`: what the resource wants.
    pub scope: Option<String>,
    /// `error`: e.g. `invalid_token`, `insufficient_scope`.
    pub error: Option<String>,
}

/// Longest challenge header parsed.
pub const MAX_CHALLENGE_BYTES: usize = 8 * 1024;

/// Parse the Bearer (or, from a server that binds tokens, DPoP — RFC 9449 §7.1) challenge of a
/// `WWW-Authenticate` value: auth-params `key=token` or `key="quoted\"string"`, comma
/// separated. Other schemes and unknown keys are ignored; the first Bearer or DPoP challenge
/// is taken; a value longer than [`MAX_CHALLENGE_BYTES`] or with neither yields `None`.
pub fn parse_challenge(header: &str) -> Option<Challenge> {
    if header.len() > MAX_CHALLENGE_BYTES {
        return None;
    }
    let lower = header.to_ascii_lowercase();
    let scheme_at = |name: &str| {
        lower
            .match_indices(name)
            .find(|(i, _)| {
                (*i == 0 || matches!(header.as_bytes()[i - 1], b' ' | b','))
                    && header
                        .as_bytes()
                        .get(i + name.len())
                        .is_none_or(|b| *b == b' ' || *b == b',')
            })
            .map(|(i, _)| (i, i + name.len()))
    };
    let start = match (scheme_at("bearer"), scheme_at("dpop")) {
        (Some(b), Some(d)) => b.min(d).1,
        (Some((_, e)), None) | (None, Some((_, e))) => e,
        (None, None) => return None,
    };
    let mut c = Challenge::default();
    let bytes = header.as_bytes();
    let mut i = start;
    loop {
        while i < bytes.len() && matches!(bytes[i], b' ' | b',' | b'\t') {
            i += 1;
        }
        let key_start = i;
        while i < bytes.len()
            && (bytes[i].is_ascii_alphanumeric() || matches!(bytes[i], b'_' | b'-'))
        {
            i += 1;
        }
        if i == key_start || i >= bytes.len() || bytes[i] != b'=' {
            // End of this challenge's params (another scheme, or a token68).
            break;
        }
        let key = header[key_start..i].to_ascii_lowercase();
        i += 1;
        let value = if bytes.get(i) == Some(&b'"') {
            i += 1;
            let mut v = String::new();
            while i < bytes.len() && bytes[i] != b'"' {
                if bytes[i] == b'\\' && i + 1 < bytes.len() {
                    i += 1;
                }
                // Quoted strings are ASCII in practice; keep any UTF-8 intact.
                let ch = header[i..].chars().next()?;
                v.push(ch);
                i += ch.len_utf8();
            }
            if i >= bytes.len() {
                return None;
            }
            i += 1;
            v
        } else {
            let vs = i;
            while i < bytes.len() && !matches!(bytes[i], b',' | b' ') {
                i += 1;
            }
            header[vs..i].to_owned()
        };
        match key.as_str() {
            "resource_metadata" => c.resource_metadata = Some(value),
            "scope" => c.scope = Some(value),
            "error" => c.error = Some(value),
            _ => {}
        }
    }
    Some(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bearer_challenges_are_parsed() {
        let c = parse_challenge(
            r#"Bearer error="insufficient_scope", scope="mcp:read mcp:write", resource_metadata="https://r.example/.well-known/oauth-protected-resource/mcp""#,
        )
        .unwrap();
        assert_eq!(c.error.as_deref(), Some("insufficient_scope"));
        assert_eq!(c.scope.as_deref(), Some("mcp:read mcp:write"));
        assert_eq!(
            c.resource_metadata.as_deref(),
            Some("https://r.example/.well-known/oauth-protected-resource/mcp")
        );
        let c =
            parse_challenge(r#"Basic realm="x", Bearer realm="mcp",error=invalid_token"#).unwrap();
        assert_eq!(c.error.as_deref(), Some("invalid_token"));
        assert_eq!(parse_challenge("Basic realm=\"x\""), None);
        // A server that binds tokens challenges with DPoP (RFC 9449 §7.1).
        let c = parse_challenge(
            r#"DPoP error="use_dpop_nonce", resource_metadata="https://r.example/prm""#,
        )
        .unwrap();
        assert_eq!(c.error.as_deref(), Some("use_dpop_nonce"));
        assert_eq!(
            c.resource_metadata.as_deref(),
            Some("https://r.example/prm")
        );
        let c = parse_challenge(r#"DPoP algs="ES256", Bearer scope="a""#).unwrap();
        assert_eq!(c.scope, None, "the first challenge is taken");
        assert_eq!(parse_challenge("DPoPx error=x"), None);
        assert_eq!(parse_challenge("bearer").unwrap(), Challenge::default());
        let c = parse_challenge(r#"Bearer scope="a \"b\"""#).unwrap();
        assert_eq!(c.scope.as_deref(), Some("a \"b\""));
        assert_eq!(parse_challenge(r#"Bearer scope="unterminated"#), None);
        assert_eq!(
            parse_challenge(&format!(
                "Bearer scope=\"{}\"",
                "a".repeat(MAX_CHALLENGE_BYTES)
            )),
            None
        );
    }

    #[test]
    fn refusals_name_the_rule_and_the_host_but_not_the_url_and_survive_redaction() {
        use serde_json::json;
        let good = json!({
            "issuer": "https://as.example",
            "authorization_endpoint": "https://as.example/authorize",
            "token_endpoint": "https://as.example/token",
            "code_challenge_methods_supported": ["S256"],
        });
        let cases = [
            (
                "authorization_endpoint",
                "https://login.other.example/authorize?client_secret=hunter2hunter2",
                "refused authorization_endpoint (host login.other.example): it is on another origin",
            ),
            (
                "token_endpoint",
                "http://tokens.example/token?access_token=hunter2hunter2",
                "refused token_endpoint (host tokens.example): plain http is only allowed",
            ),
            (
                "token_endpoint",
                "https://token.example:0/t?refresh_token=hunter2hunter2",
                "refused token_endpoint (host token.example): endpoint URL port is 0",
            ),
            (
                "registration_endpoint",
                "https://u:hunter2hunter2@as.example/register",
                "refused registration_endpoint (host as.example): endpoint URL must not contain a user name",
            ),
            (
                "revocation_endpoint",
                "https://224.0.0.1/revoke?token=hunter2hunter2",
                "refused revocation_endpoint (host 224.0.0.1): endpoint URL host 224.0.0.1 is a multicast address",
            ),
        ];
        for (key, url, want) in cases {
            let mut doc = good.clone();
            doc[key] = json!(url);
            let e = metadata::validate_server("https://as.example", &doc).unwrap_err();
            // As the operator sees it: redacted and escaped.
            let line = iteron_policy::text::single_line(&e.to_string());
            assert!(line.starts_with(want), "{key}: {line}");
            assert!(!line.contains("[REDACTED]"), "{key}: {line}");
            assert!(
                !line.contains("hunter2") && !line.contains('?'),
                "{key}: {line}"
            );
        }
        // The secret rule of the token endpoint, at the time of use.
        let e = OAuthError::BadEndpoint {
            which: "token_endpoint",
            host: host_of("https://tokens.other.example/token"),
            why: "a client secret is only sent to the issuer's own origin".into(),
        };
        assert_eq!(
            iteron_policy::text::single_line(&e.to_string()),
            "refused token_endpoint (host tokens.other.example): a client secret is only sent to the issuer's own origin"
        );
        // What the old `name: reason` shape turned into (the red-team report's finding).
        assert!(
            iteron_policy::text::single_line(
                "refused authorization_endpoint: it is on another origin"
            )
            .contains("[REDACTED]")
        );
        // A host that cannot be read is said so, never replaced by the URL.
        assert_eq!(host_of("not a url"), None);
        assert_eq!(host_of("https://[::1]:8443/x?y"), Some("[::1]".to_owned()));
        iteron_test_support::record!("P12", json!({"cases": cases.len()}),);
    }

    proptest! {
        #[test]
        fn challenge_parsing_never_panics(s in "\\PC{0,200}") {
            let _ = parse_challenge(&s);
            let _ = parse_challenge(&format!("Bearer {s}"));
        }
    }
}
