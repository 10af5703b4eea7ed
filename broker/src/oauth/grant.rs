//! Noninteractive grants: tokens for an HTTP server without a browser or a user, for a CI
//! runner or a service (`oauth.grant`).
//!
//! The same discovery as a login (protected-resource metadata that must name this server, the
//! issuer the operator pinned — it must be listed there — and its metadata, matched exactly),
//! but only the token endpoint is used, so neither an authorization endpoint nor PKCE is
//! required of the authorization server. The client's secret or key authenticates only at the
//! pinned issuer's own origin ([`flow::check_secret_destination`]), and when the metadata lists
//! its grant types the grant must be among them — otherwise nothing is sent.
//!
//! A workload identity token (`jwt_bearer`) is read from where the operator named it at every
//! exchange (a rotated file is picked up), checked to be one compact JWS of visible ASCII of
//! at most [`MAX_TOKEN_BYTES`], and never presented again once the authorization server refused
//! it: the exchange is not retried, with this token or another grant.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use secrecy::{ExposeSecret, SecretString};
use sha2::{Digest, Sha256};

use iteron_policy::url::EndpointUrl;

use super::flow::{self, MAX_TOKEN_BYTES, OAuthClient};
use super::login::LoginOutcome;
use super::metadata::{self, Purpose};
use super::{Challenge, OAuthError, host_of};
use crate::net::ZoneClient;

/// The grant to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// RFC 6749 §4.4 with the client's secret or key.
    ClientCredentials,
    /// RFC 7523 §2.1 with the workload's identity token.
    JwtBearer,
    /// Enterprise-managed authorization: the user's ID token exchanged at the identity
    /// provider for an ID-JAG (RFC 8693), presented as an RFC 7523 JWT-bearer grant.
    IdJag,
}

impl Kind {
    /// The `grant_type` sent (and looked for in `grant_types_supported`).
    pub fn grant_type(self) -> &'static str {
        match self {
            Kind::ClientCredentials => "client_credentials",
            Kind::JwtBearer | Kind::IdJag => flow::JWT_BEARER_GRANT,
        }
    }

    /// The configuration word (`oauth.grant`).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::ClientCredentials => "client_credentials",
            Kind::JwtBearer => "jwt_bearer",
            Kind::IdJag => "id_jag",
        }
    }
}

/// The enterprise identity provider of an ID-JAG grant: its issuer and Iteron's client there
/// (whose secret, if any, goes only to that issuer's origin).
#[derive(Clone)]
pub struct IdentityProvider {
    /// The provider's issuer (its metadata must name it exactly).
    pub issuer: String,
    /// Iteron's client at the provider.
    pub client: OAuthClient,
}

/// Where the workload's identity token comes from.
#[derive(Clone)]
pub enum IdentitySource {
    /// A file, read at every exchange.
    File(PathBuf),
    /// A value read once (an environment variable or a `$CREDENTIALS_DIRECTORY` credential:
    /// both are fixed for the life of the process), with what to call it in errors.
    Value(SecretString, String),
}

/// The workload's identity token and what was refused of it (shared by every clone: a token
/// the authorization server refused is never presented again by this process).
#[derive(Clone)]
pub struct IdentityToken {
    source: IdentitySource,
    refused: Refusal,
}

/// Most servers whose refused identity tokens one process remembers (a configuration holds at
/// most [`iteron_policy::config::MAX_SERVERS`]).
pub const MAX_REMEMBERED_REFUSALS: usize = iteron_policy::config::MAX_SERVERS;

type Refusal = Arc<Mutex<Option<[u8; 32]>>>;

impl IdentityToken {
    /// A token from `source`, whose refusal only this value and its clones remember.
    pub fn new(source: IdentitySource) -> IdentityToken {
        IdentityToken {
            source,
            refused: Arc::default(),
        }
    }

    /// A token from `source` for the server named `server`, whose refusal the whole process
    /// remembers: every connection to that server (the broker makes a new request value at
    /// each connect) sees what an earlier one was refused, so a refused token is not presented
    /// again after a reconnect either. At most [`MAX_REMEMBERED_REFUSALS`] servers are
    /// remembered; past that, servers whose token was never refused and that no request holds
    /// are forgotten, and a server that still cannot be remembered is refused its grant (fail
    /// closed).
    pub fn for_server(server: &str, source: IdentitySource) -> Result<IdentityToken, OAuthError> {
        Self::for_server_in(refusals(), MAX_REMEMBERED_REFUSALS, server, source)
    }

    fn for_server_in(
        map: &Mutex<std::collections::HashMap<String, Refusal>>,
        max: usize,
        server: &str,
        source: IdentitySource,
    ) -> Result<IdentityToken, OAuthError> {
        let mut map = match map.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if !map.contains_key(server) && map.len() >= max {
            // Forgotten: a server never refused whose memory no request holds now.
            map.retain(|_, r| {
                Arc::strong_count(r) > 1
                    || match r.lock() {
                        Ok(g) => g.is_some(),
                        Err(_) => true,
                    }
            });
            if map.len() >= max {
                return Err(OAuthError::Identity {
                    source: format!("the identity token of {}", super::text_line(server)),
                    why: "cannot be checked against earlier refusals: this process already remembers as many servers as a configuration may hold",
                });
            }
        }
        let refused = Arc::clone(map.entry(server.to_owned()).or_default());
        Ok(IdentityToken { source, refused })
    }

    fn shown(&self) -> String {
        match &self.source {
            IdentitySource::File(p) => format!("the identity token file {}", p.display()),
            IdentitySource::Value(_, what) => format!("the identity token {what}"),
        }
    }

    /// Read the token now and check its form.
    fn read(&self) -> Result<SecretString, OAuthError> {
        let bad = |why: &'static str| OAuthError::Identity {
            source: self.shown(),
            why,
        };
        let text = match &self.source {
            IdentitySource::File(p) => {
                let bytes =
                    super::material::read_shared_file(p, MAX_TOKEN_BYTES + 1).map_err(|why| {
                        OAuthError::IdentityFile {
                            why: super::text_line(&why),
                        }
                    })?;
                zeroize::Zeroizing::new(
                    String::from_utf8(bytes.to_vec()).map_err(|_| bad("is not text"))?,
                )
            }
            IdentitySource::Value(v, _) => zeroize::Zeroizing::new(v.expose_secret().to_owned()),
        };
        let token = text.trim_end_matches(['\n', '\r']);
        if token.is_empty() {
            return Err(bad("is empty"));
        }
        if token.len() > MAX_TOKEN_BYTES {
            return Err(bad("is longer than 16 KiB"));
        }
        let parts: Vec<&str> = token.split('.').collect();
        let b64url = |p: &str| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if parts.len() != 3 || !parts.iter().all(|p| b64url(p)) {
            return Err(bad("is not one compact JWT (three base64url parts)"));
        }
        Ok(SecretString::from(token.to_owned()))
    }

    /// Whether the token can be read and has the form it must have now (`doctor`); nothing
    /// is kept.
    pub fn check(&self) -> Result<(), OAuthError> {
        self.read().map(|_| ())
    }

    fn digest(token: &SecretString) -> [u8; 32] {
        Sha256::digest(token.expose_secret().as_bytes()).into()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<[u8; 32]>> {
        match self.refused.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}

/// The refusals the process remembers, per server ([`IdentityToken::for_server`]).
fn refusals() -> &'static Mutex<std::collections::HashMap<String, Refusal>> {
    static REFUSALS: std::sync::OnceLock<Mutex<std::collections::HashMap<String, Refusal>>> =
        std::sync::OnceLock::new();
    REFUSALS.get_or_init(Mutex::default)
}

/// What the operator configured for a noninteractive grant. The client carries its id, its
/// secret or key and how it authenticates; its `issuer` is the pinned one.
#[derive(Clone)]
pub struct GrantRequest {
    /// The MCP endpoint.
    pub server: EndpointUrl,
    /// A resource the metadata must name exactly.
    pub resource: Option<String>,
    /// The pinned issuer (the client's credentials go nowhere else).
    pub issuer: String,
    /// Scopes the operator chose (login flag or configuration), used as given.
    pub scopes: Option<String>,
    /// The pre-registered client.
    pub client: OAuthClient,
    /// The grant.
    pub kind: Kind,
    /// The workload's identity token (`jwt_bearer`).
    pub identity: Option<IdentityToken>,
    /// Ask for DPoP-bound tokens: a new key is made for each grant run.
    pub dpop: bool,
    /// The enterprise identity provider (`id_jag`).
    pub idp: Option<IdentityProvider>,
}

/// Discover, check, and run the grant once. Nothing is retried: a refusal is the answer.
pub async fn obtain(
    http: &ZoneClient,
    req: &GrantRequest,
    challenge: Option<&Challenge>,
) -> Result<LoginOutcome, OAuthError> {
    let prm =
        metadata::discover_resource(http, &req.server, challenge, req.resource.as_deref()).await?;
    let issuer =
        metadata::pinned_issuer(&prm.authorization_servers, &req.issuer).ok_or_else(|| {
            OAuthError::BadEndpoint {
                which: "issuer",
                host: host_of(&req.issuer),
                why: "the pinned issuer is not listed by the protected-resource metadata (issuers are compared exactly as written)".into(),
            }
        })?;
    let meta = metadata::discover_server_for(http, &issuer, Purpose::TokenEndpoint).await?;
    let grant_type = req.kind.grant_type();
    if !meta.grant_types_supported.is_empty()
        && !meta.grant_types_supported.iter().any(|g| g == grant_type)
    {
        return Err(OAuthError::NoRegistration(
            "the authorization server does not list the configured grant in grant_types_supported",
        ));
    }
    let mut client = req.client.clone();
    client.issuer = meta.issuer.clone();
    flow::ready_client(&meta, &mut client, req.dpop)?;
    // The operator's scopes as given; otherwise what the server asks for or lists.
    let challenged = challenge
        .and_then(|c| c.scope.as_deref())
        .map(|s| {
            s.split(' ')
                .filter(|t| iteron_policy::config::Scope::parse(t).is_ok())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|s| !s.is_empty());
    let scope = flow::choose_scope(
        req.scopes.as_deref(),
        None,
        challenged.as_deref(),
        &prm.scopes_supported,
        &[],
    );
    let tokens = match req.kind {
        Kind::ClientCredentials => {
            flow::client_credentials(http, &meta, &client, &prm.resource, scope.as_deref()).await?
        }
        Kind::JwtBearer | Kind::IdJag => {
            let identity = req.identity.as_ref().ok_or(OAuthError::NoRegistration(
                "the grant needs an identity token",
            ))?;
            let token = identity.read()?;
            let digest = IdentityToken::digest(&token);
            if *identity.lock() == Some(digest) {
                return Err(OAuthError::Identity {
                    source: identity.shown(),
                    why: "was refused by the authorization server and is not presented again; \
                          a new token is read at the next exchange",
                });
            }
            let (res, sc) = (prm.resource.as_str(), scope.as_deref());
            let got = match req.kind {
                Kind::IdJag => id_jag(http, req, &meta, &client, &token, res, sc).await,
                _ => flow::jwt_bearer(http, &meta, &client, &token, res, sc).await,
            };
            if let Err(OAuthError::Server { .. } | OAuthError::UnusableTokens { .. }) = &got {
                *identity.lock() = Some(digest);
            }
            got?
        }
    };
    Ok(LoginOutcome::new(prm.resource, meta, client, scope, tokens))
}

/// The two steps of enterprise-managed authorization: the ID token for an ID-JAG at the
/// identity provider (its metadata discovered and matched exactly, under the same zone, its
/// client's secret only to its own origin), then the ID-JAG as a JWT-bearer grant at the
/// authorization server. Neither step is retried.
async fn id_jag(
    http: &ZoneClient,
    req: &GrantRequest,
    meta: &metadata::ServerMetadata,
    client: &OAuthClient,
    id_token: &SecretString,
    resource: &str,
    scope: Option<&str>,
) -> Result<flow::Tokens, OAuthError> {
    let idp = req.idp.as_ref().ok_or(OAuthError::NoRegistration(
        "the id_jag grant needs an identity provider",
    ))?;
    let idp_meta = metadata::discover_server_for(http, &idp.issuer, Purpose::TokenEndpoint).await?;
    if !idp_meta.grant_types_supported.is_empty()
        && !idp_meta
            .grant_types_supported
            .iter()
            .any(|g| g == flow::TOKEN_EXCHANGE_GRANT)
    {
        return Err(OAuthError::NoRegistration(
            "the identity provider does not list token exchange in grant_types_supported",
        ));
    }
    let mut idp_client = idp.client.clone();
    idp_client.issuer = idp_meta.issuer.clone();
    idp_client.dpop = None;
    flow::check_secret_destination(&idp_meta, &idp_client)?;
    let jag = flow::exchange_for_id_jag(
        http,
        &idp_meta,
        &idp_client,
        id_token,
        &meta.issuer,
        resource,
        scope,
    )
    .await?;
    flow::jwt_bearer(http, meta, client, &jag, resource, scope).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn value(v: &str) -> IdentitySource {
        IdentitySource::Value(SecretString::from(v.to_owned()), "named by T".into())
    }

    #[test]
    fn refusals_are_shared_per_server_and_bounded_failing_closed() {
        let map = Mutex::default();
        let a = IdentityToken::for_server_in(&map, 2, "a", value("x")).unwrap();
        *a.lock() = Some([1; 32]);
        // A later request for the same server sees the refusal.
        let a2 = IdentityToken::for_server_in(&map, 2, "a", value("y")).unwrap();
        assert_eq!(*a2.lock(), Some([1; 32]));
        let b = IdentityToken::for_server_in(&map, 2, "b", value("x")).unwrap();
        assert_eq!(*b.lock(), None);
        // Full, and "b" still held by a request: nothing can be forgotten.
        assert!(IdentityToken::for_server_in(&map, 2, "c", value("x")).is_err());
        drop(b);
        // "b" (never refused, no longer held) is forgotten to make room; "a" is kept.
        let c = IdentityToken::for_server_in(&map, 2, "c", value("x")).unwrap();
        *c.lock() = Some([3; 32]);
        assert_eq!(
            *IdentityToken::for_server_in(&map, 2, "a", value("x"))
                .unwrap()
                .lock(),
            Some([1; 32])
        );
        // Full of refusals: a new server is refused, not given a blank memory.
        let e = IdentityToken::for_server_in(&map, 2, "d", value("x"))
            .err()
            .unwrap();
        assert!(e.to_string().contains("earlier refusals"), "{e}");
        iteron_test_support::record!(
            "P16",
            serde_json::json!({"remembered_servers_max": MAX_REMEMBERED_REFUSALS, "full": "refused"}),
        );
    }
}
