//! Turning a configured server into a connected MCP client. Shared by the operator commands
//! (`iteron mcp test|status|doctor`) and, later, the broker daemon.
//!
//! Secrets enter here and nowhere else: the values of variables the operator named
//! (`env`, `header_env`, `oauth.access_token_env`) are read through the lookup the caller
//! passes, go straight into the child's environment or into sensitive header values, and are
//! never stored, logged or shown.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::fmt;

use iteron_policy::config::{NetworkConfig, ServerConfig, Transport};

use crate::mcp::client::{Client, McpError, Options};
use crate::net::NetError;
use crate::spawn::{ChildSpec, child_env};

mod external;
mod grant;
mod http;
mod scrubber;
mod stdio;
mod stored;

use external::{connect_external, external_var};
use http::{configured_headers, connect_bearer, connect_http_with};
use stored::{access_of, load_stored, refresh_stored};

pub use external::{
    ExternalLogout, ExternalTokens, MAX_EXTERNAL_TOKENS, MAX_REVOKED_TOKENS, external_tokens,
    logout_external,
};
pub use grant::{client_key, credential_of, grant_request, login_noninteractive};
pub use scrubber::{KnownSecrets, LearnedSecrets, MAX_LEARNED_SECRETS};
pub use stdio::{SpawnContext, stdio_confinement};
pub(crate) use stored::StoredToken;

/// Why a configured server could not be connected.
#[derive(Debug)]
pub enum ConnectError {
    /// The MCP layer failed.
    Mcp(McpError),
    /// The network layer refused or failed.
    Net(NetError),
    /// A variable the configuration names is not set.
    MissingVariable(String),
    /// A variable's value cannot be an HTTP header value (the value is not shown).
    BadHeaderValue(String),
    /// The stored credential cannot be used; the operator must log in again.
    ReauthRequired(&'static str),
    /// OAuth (refresh) failed.
    OAuth(crate::oauth::OAuthError),
    /// The credential store failed.
    Credentials(String),
    /// The server's scrubber already knows [`MAX_LEARNED_SECRETS`] secrets; its credential
    /// would not be scrubbed, so the server is not used.
    ScrubberFull,
    /// A variable's value is not a whole number of unix seconds (`expires_at_env`; the value
    /// is not shown).
    BadExpiry(String),
    /// The externally managed token cannot be used (expired with nothing to renew it, its
    /// refresh refused, logged out); one secret-free line.
    External(String),
    /// The client's private key (`client_key_file`, `client_key_env`) cannot be used; the rule
    /// and where, never the key.
    ClientKey(String),
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectError::Mcp(e) => e.fmt(f),
            ConnectError::ScrubberFull => write!(
                f,
                "the server's scrubber already knows {MAX_LEARNED_SECRETS} secrets; restart the server"
            ),
            ConnectError::Net(e) => e.fmt(f),
            ConnectError::MissingVariable(n) => {
                write!(
                    f,
                    "environment variable {n} (named in the configuration) is not set"
                )
            }
            ConnectError::BadHeaderValue(n) => write!(
                f,
                "the value of environment variable {n} is not a valid HTTP header value"
            ),
            ConnectError::ReauthRequired(why) => {
                write!(f, "re-login required: {why} (iteron mcp auth login)")
            }
            ConnectError::OAuth(e) => e.fmt(f),
            ConnectError::Credentials(e) => write!(f, "credential store: {e}"),
            ConnectError::BadExpiry(n) => write!(
                f,
                "the value of environment variable {n} (the access token's expiry) is not a whole number of unix seconds"
            ),
            ConnectError::External(why) => f.write_str(why),
            ConnectError::ClientKey(why) => write!(f, "the client key {why}"),
        }
    }
}

impl std::error::Error for ConnectError {}

/// Connect to a configured server.
pub async fn connect(
    server: &ServerConfig,
    network: &NetworkConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    opts: Options,
    ctx: &SpawnContext,
) -> Result<Client, ConnectError> {
    match &server.transport {
        Transport::Stdio(st) => {
            let (env, _missing) = child_env(&st.env, None, lookup);
            let spec = ChildSpec {
                command: st.command.as_str().to_owned(),
                args: st.args.clone(),
                env,
                confine: Some(stdio_confinement(server, st, ctx)),
                egress: Some(crate::egress::Route {
                    dns: crate::net::Dns::of(network),
                    observer: ctx.egress.clone().unwrap_or_else(|| {
                        std::sync::Arc::new(crate::egress::Observer::new(
                            server.name.as_str(),
                            None,
                        ))
                    }),
                }),
            };
            Client::connect_stdio(spec, opts)
                .await
                .map_err(ConnectError::Mcp)
        }
        Transport::Http(h) if external_var(h).is_some() => {
            // Tokens rotated here are not taught to any scrubber but this connection's own;
            // the broker connects through `connect_with_credentials`, which shares its set.
            connect_external(server, h, network, lookup, opts, &LearnedSecrets::default()).await
        }
        Transport::Http(h) => {
            let headers = configured_headers(h, lookup)?;
            connect_http_with(h, network, headers, opts).await
        }
    }
}

/// Refresh when the access token expires within this margin.
pub const REFRESH_MARGIN_SECS: u64 = 30;

/// Most servers one run connects to at once: a broker's `list_tools`, an operator's
/// `iteron mcp status|doctor --connect`. The others wait for a free place, and each one's
/// deadline starts when it gets one.
pub const MAX_PARALLEL_CONNECTS: usize = 8;

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Connect like [`connect`], authorizing HTTP requests with the operator's stored OAuth
/// credential when there is one: a binding that no longer fits the configuration requires a
/// new login (never silent reuse); an expiring token is refreshed first; a 401 refreshes once
/// and connects again (nothing that may have been applied is ever resent). Every access token
/// the credential yields, now or later, is taught to `learned` (for the server's scrubber).
pub async fn connect_with_credentials(
    server: &ServerConfig,
    network: &NetworkConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    opts: Options,
    home: &crate::store::Home,
    ctx: SpawnContext,
    learned: &LearnedSecrets,
) -> Result<Client, ConnectError> {
    use secrecy::ExposeSecret;
    // An externally managed token is the server's credential, whatever a login once stored.
    if let Transport::Http(h) = &server.transport
        && external_var(h).is_some()
    {
        return connect_external(server, h, network, lookup, opts, learned).await;
    }
    let store = crate::credentials::CredentialStore::new(home);
    let stored = match &server.transport {
        Transport::Http(_) => load_stored(&store, server.name.as_str())
            .await
            .map_err(ConnectError::Credentials)?,
        Transport::Stdio(_) => None,
    };
    let grant = grant_request(server, lookup)?;
    // A noninteractive grant logs in by itself: with no credential, or one bound to another
    // configuration of the server (its own configuration says how to get a new one).
    let stale = stored
        .as_ref()
        .is_none_or(|c| crate::credentials::check_binding(&c.binding, server).is_err());
    let stored = match &grant {
        Some(g) if stale => Some(
            login_noninteractive(home, server, network, g, None)
                .await?
                .0,
        ),
        _ => stored,
    };
    let Some(cred) = stored else {
        return connect(server, network, lookup, opts, &ctx).await;
    };
    if crate::credentials::check_binding(&cred.binding, server).is_err() {
        return Err(ConnectError::ReauthRequired(
            "the server's configuration changed since login; run iteron mcp auth login again",
        ));
    }
    let mut token = match cred.secrets.expires_at {
        Some(t) if t <= unix_now() + REFRESH_MARGIN_SECS => {
            refresh_stored(&store, &cred, network, grant.as_ref()).await?
        }
        _ => access_of(&cred)?,
    };
    // A fresh set per connect: it cannot be full yet, so nothing here can be refused.
    let _ = learned.learn_credential(&cred) && learned.learn(token.token.expose_secret());
    let mut opts = opts;
    opts.token = Some(std::sync::Arc::new(StoredToken {
        store: crate::credentials::CredentialStore::new(home),
        server: server.name.to_string(),
        network: network.clone(),
        learned: learned.clone(),
        grant: grant.clone(),
        renewing: tokio::sync::Mutex::new(()),
    }));
    let mut refreshed = false;
    loop {
        match connect_bearer(server, network, lookup, opts.clone(), &ctx).await {
            // A 401 is a refusal before anything ran: refresh once and connect again.
            Err(ConnectError::Mcp(e)) if is_unauthorized(&e) && !refreshed => {
                refreshed = true;
                let fresh = load_stored(&store, server.name.as_str())
                    .await
                    .map_err(ConnectError::Credentials)?
                    .ok_or(ConnectError::ReauthRequired("the credential was removed"))?;
                token = refresh_stored(&store, &fresh, network, grant.as_ref()).await?;
                // At most a handful learned so far (one connect, one refresh): never full.
                let _ =
                    learned.learn_credential(&fresh) && learned.learn(token.token.expose_secret());
            }
            other => return other,
        }
    }
}

/// Read variable `var` as a secret, or fail naming it.
fn secret_var(
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    var: &iteron_policy::names::EnvName,
) -> Result<crate::oauth::SecretString, ConnectError> {
    let v = lookup(var.as_str()).ok_or_else(|| ConnectError::MissingVariable(var.to_string()))?;
    v.into_string()
        .map(crate::oauth::SecretString::from)
        .map_err(|_| ConnectError::BadHeaderValue(var.to_string()))
}

fn is_unauthorized(e: &McpError) -> bool {
    matches!(
        e,
        McpError::Transport(crate::mcp::TransportError {
            kind: crate::mcp::TransportErrorKind::Unauthorized { .. },
            ..
        })
    )
}
