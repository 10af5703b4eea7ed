//! Noninteractive grants: tokens for an HTTP server without a browser or a user, for a CI
//! runner or a service (`oauth.grant`).
//!
//! The same discovery as a login (protected-resource metadata that must name this server, the
//! issuer the operator pinned — it must be listed there — and its metadata, matched exactly),
//! but only the token endpoint is used, so neither an authorization endpoint nor PKCE is
//! required of the authorization server. The client's secret or key authenticates only at the
//! pinned issuer's own origin ([`flow::check_secret_destination`]), and when the metadata lists
//! its grant types the grant must be among them — otherwise nothing is sent.

use iteron_policy::url::EndpointUrl;

use super::flow::{self, OAuthClient};
use super::login::LoginOutcome;
use super::metadata::{self, Purpose};
use super::{Challenge, OAuthError, host_of};
use crate::net::ZoneClient;

/// The grant to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// RFC 6749 §4.4 with the client's secret or key.
    ClientCredentials,
}

impl Kind {
    /// The `grant_type` sent (and looked for in `grant_types_supported`).
    pub fn grant_type(self) -> &'static str {
        match self {
            Kind::ClientCredentials => "client_credentials",
        }
    }
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
                why: "the pinned issuer is not listed by the protected-resource metadata".into(),
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
    flow::check_secret_destination(&meta, &client)?;
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
    };
    Ok(LoginOutcome {
        resource: prm.resource,
        server: meta,
        client,
        requested: scope,
        tokens,
    })
}
