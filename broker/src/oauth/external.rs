//! An externally managed access token: the env-named `oauth` block of an HTTP server
//! (`access_token_env`, `expires_at_env`, `refresh_url` with `refresh_token_env`, `revoke_url`,
//! `client_id`, `client_secret_env`).
//!
//! The operator named every endpoint here, so nothing is discovered; each one passed the
//! endpoint URL rules when the configuration was read, and every request goes through the
//! zone-bound client of the MCP server (a public server's block cannot send a refresh or a
//! revocation to a private, link-local or loopback address). A client secret goes only to the
//! origin of the operator's `issuer` when one is pinned, else to the origin of `refresh_url`
//! (or of `revoke_url` when there is no refresh): a `revoke_url` on another origin gets no
//! secret and the revocation is refused, said so.
//!
//! Refreshing presents the refresh token at `refresh_url` with the same `resource` on every
//! request (the configured `resource`, else the server URL) and validates the answer like any
//! token response ([`flow::parse_tokens`]). The rotated refresh token is kept by the caller in
//! the broker's memory only — never written to the configuration or a file.

use secrecy::SecretString;

use iteron_policy::config::{HttpServer, OAuthConfig};
use iteron_policy::url::EndpointUrl;

use super::flow::{self, ClientKind, OAuthClient, TokenAuth, Tokens};
use super::metadata::ServerMetadata;
use super::{OAuthError, Revoked};
use crate::net::ZoneClient;

/// Largest `expires_at_env` value accepted: the last second of the year 9999, in unix seconds.
pub const MAX_EXPIRES_AT: u64 = 253_402_300_799;
/// Longest `expires_at_env` value accepted, in bytes (the digits of [`MAX_EXPIRES_AT`]).
pub const MAX_EXPIRES_AT_DIGITS: usize = 12;

/// Parse the value of `expires_at_env`: unix seconds, 1 to [`MAX_EXPIRES_AT_DIGITS`] ASCII
/// digits (one trailing newline is tolerated), at most [`MAX_EXPIRES_AT`]. Anything else —
/// a sign, a fraction, spaces, a date — is `None`, and the caller refuses to send the token.
pub fn parse_expires_at(value: &str) -> Option<u64> {
    let v = value.strip_suffix('\n').unwrap_or(value);
    if v.is_empty() || v.len() > MAX_EXPIRES_AT_DIGITS || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok().filter(|n| *n <= MAX_EXPIRES_AT)
}

/// The operator's endpoints for an externally managed token, as the token endpoint functions
/// take them.
#[derive(Clone)]
pub struct Endpoints {
    /// The origin anchor (`issuer`) with `refresh_url` as the token endpoint and `revoke_url`
    /// as the revocation endpoint.
    pub meta: ServerMetadata,
    /// The client the token was issued to (id, and the secret when one is named).
    pub client: OAuthClient,
    /// The `resource` sent with every refresh.
    pub resource: String,
    /// Whether a refresh endpoint is configured.
    pub refreshable: bool,
}

fn origin_of(u: &EndpointUrl) -> String {
    u.as_url().origin().ascii_serialization()
}

impl Endpoints {
    /// The endpoints of `h`'s `oauth` block, with the client secret read by the caller;
    /// `None` when the block configures neither `refresh_url` nor `revoke_url` (nothing to
    /// contact).
    pub fn of(h: &HttpServer, secret: Option<SecretString>) -> Option<Endpoints> {
        let o: &OAuthConfig = h.oauth.as_ref()?;
        let token_endpoint = o.refresh_url.clone().or_else(|| o.revoke_url.clone())?;
        let issuer = o
            .issuer
            .as_ref()
            .map_or_else(|| origin_of(&token_endpoint), |i| i.as_str().to_owned());
        let meta = ServerMetadata {
            issuer: issuer.clone(),
            authorization_endpoint: None,
            token_endpoint,
            registration_endpoint: None,
            revocation_endpoint: o.revoke_url.clone(),
            token_endpoint_auth_methods: Vec::new(),
            scopes_supported: Vec::new(),
            cimd_supported: false,
            iss_parameter_supported: false,
            grant_types_supported: Vec::new(),
        };
        let client = OAuthClient {
            // The configuration requires a client id with either endpoint.
            id: o
                .client_id
                .as_ref()
                .map(|c| c.as_str().to_owned())
                .unwrap_or_default(),
            auth: if secret.is_some() {
                TokenAuth::Basic
            } else {
                TokenAuth::None
            },
            secret,
            key: None,
            dpop: None,
            kind: ClientKind::PreRegistered,
            issuer,
        };
        Some(Endpoints {
            meta,
            client,
            resource: o
                .resource
                .as_ref()
                .map_or_else(|| h.url.as_str().to_owned(), |r| r.as_str().to_owned()),
            refreshable: o.refresh_url.is_some(),
        })
    }

    /// Present `refresh_token` at `refresh_url` (the caller keeps the rotated one).
    pub async fn refresh(
        &self,
        http: &ZoneClient,
        refresh_token: &SecretString,
    ) -> Result<Tokens, OAuthError> {
        if !self.refreshable {
            return Err(OAuthError::Malformed(
                "configuration (no refresh_url to present a refresh token at)",
            ));
        }
        flow::refresh(
            http,
            &self.meta,
            &self.client,
            refresh_token,
            &self.resource,
        )
        .await
    }

    /// Revoke the refresh token (first) and the access token at `revoke_url`, best effort.
    pub async fn revoke(
        &self,
        http: &ZoneClient,
        access: Option<&SecretString>,
        refresh: Option<&SecretString>,
    ) -> Revoked {
        if self.meta.revocation_endpoint.is_none() {
            return Revoked::NotOffered;
        }
        let mut all = true;
        let mut any = false;
        for (token, hint) in [(refresh, "refresh_token"), (access, "access_token")] {
            let Some(t) = token else { continue };
            any = true;
            all &= matches!(
                flow::revoke(http, &self.meta, &self.client, t, hint).await,
                Ok(flow::Revocation::Accepted)
            );
        }
        match (any, all) {
            (false, _) => Revoked::NothingToRevoke,
            (true, true) => Revoked::Revoked,
            (true, false) => Revoked::Failed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_values_are_unix_seconds_within_bounds_and_one_over() {
        assert_eq!(parse_expires_at("0"), Some(0));
        assert_eq!(parse_expires_at("1796195805"), Some(1_796_195_805));
        assert_eq!(parse_expires_at("1796195805\n"), Some(1_796_195_805));
        assert_eq!(
            parse_expires_at(&MAX_EXPIRES_AT.to_string()),
            Some(MAX_EXPIRES_AT)
        );
        assert_eq!(parse_expires_at(&(MAX_EXPIRES_AT + 1).to_string()), None);
        assert_eq!(
            parse_expires_at(&"9".repeat(MAX_EXPIRES_AT_DIGITS + 1)),
            None
        );
        assert_eq!(
            parse_expires_at(&format!("0{}", "0".repeat(MAX_EXPIRES_AT_DIGITS))),
            None
        );
        for bad in [
            "",
            "\n",
            "-1",
            "+5",
            "1.5",
            " 5",
            "5 ",
            "5\n\n",
            "2026-12-01T00:00:00Z",
            "0x10",
            "\u{661}",
        ] {
            assert_eq!(parse_expires_at(bad), None, "{bad:?}");
        }
        iteron_test_support::record!(
            "P5",
            serde_json::json!({"max_expires_at": MAX_EXPIRES_AT, "max_digits": MAX_EXPIRES_AT_DIGITS}),
        );
    }

    #[test]
    fn the_secret_goes_to_the_refresh_urls_origin_unless_an_issuer_is_pinned() {
        let parse = |oauth: &str| {
            let doc = format!(
                r#"{{"schema_version": 2, "mcp_servers": [{{"name": "a", "transport": "http", "url": "https://mcp.example/mcp", "oauth": {{{oauth}}}}}]}}"#
            );
            let c = iteron_policy::config::Config::parse(doc.as_bytes()).unwrap();
            match &c.mcp_servers[0].transport {
                iteron_policy::config::Transport::Http(h) => h.clone(),
                iteron_policy::config::Transport::Stdio(_) => unreachable!(),
            }
        };
        let h = parse(
            r#""access_token_env": "T", "client_id": "c", "refresh_url": "https://as.example/t", "refresh_token_env": "R", "revoke_url": "https://revoke.example/r""#,
        );
        let e = Endpoints::of(&h, Some(SecretString::from("s3cr3t".to_owned()))).unwrap();
        assert_eq!(e.meta.issuer, "https://as.example");
        assert!(flow::same_origin_secret(
            &e.meta.issuer,
            &e.meta.token_endpoint
        ));
        assert!(!flow::same_origin_secret(
            &e.meta.issuer,
            e.meta.revocation_endpoint.as_ref().unwrap()
        ));
        assert_eq!(e.client.auth, TokenAuth::Basic);
        assert_eq!(e.resource, "https://mcp.example/mcp");
        assert!(e.refreshable);
        let h = parse(
            r#""access_token_env": "T", "client_id": "c", "issuer": "https://id.example", "revoke_url": "https://id.example/r", "resource": "https://mcp.example/""#,
        );
        let e = Endpoints::of(&h, None).unwrap();
        // The issuer and the resource as written (identifiers are never normalized).
        assert_eq!(e.meta.issuer, "https://id.example");
        assert_eq!(e.client.auth, TokenAuth::None);
        assert_eq!(e.resource, "https://mcp.example/");
        assert!(!e.refreshable);
        assert!(Endpoints::of(&parse(r#""access_token_env": "T""#), None).is_none());
    }
}
