//! Turning a configured server into a connected MCP client. Shared by the operator commands
//! (`iteron mcp test|status|doctor`) and, later, the broker daemon.
//!
//! Secrets enter here and nowhere else: the values of variables the operator named
//! (`env`, `header_env`, `oauth.access_token_env`) are read through the lookup the caller
//! passes, go straight into the child's environment or into sensitive header values, and are
//! never stored, logged or shown.

use std::ffi::OsString;
use std::fmt;

use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};

use iteron_policy::config::{NetworkConfig, ServerConfig, Transport};
use iteron_policy::zone::Zone;

use crate::mcp::client::{Client, McpError, Options};
use crate::net::{Net, NetConfig, NetError, TargetHost, judge_answer, target_host};
use crate::spawn::{ChildSpec, child_env};

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
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectError::Mcp(e) => e.fmt(f),
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
        }
    }
}

impl std::error::Error for ConnectError {}

fn secret_header(value: OsString, name: &str) -> Result<HeaderValue, ConnectError> {
    let s = zeroize::Zeroizing::new(
        value
            .into_string()
            .map_err(|_| ConnectError::BadHeaderValue(name.to_owned()))?,
    );
    let mut v = HeaderValue::from_str(s.as_str())
        .map_err(|_| ConnectError::BadHeaderValue(name.to_owned()))?;
    v.set_sensitive(true);
    Ok(v)
}

/// The secret values a server's configuration names (forwarded variables, header values,
/// bearer tokens), held only to scrub them from any text a server sends back — a server that
/// echoes an API key in an error must not get it printed.
#[derive(Default)]
pub struct KnownSecrets {
    fixed: Vec<zeroize::Zeroizing<String>>,
    learned: LearnedSecrets,
}

/// Most secrets one running server's scrubber learns. Beyond, its token source refuses to hand
/// out another (fail closed: nothing is forgotten, and a server cannot force endless
/// refreshes); restarting the server starts afresh.
pub const MAX_LEARNED_SECRETS: usize = 64;

/// Secret values learned while a server runs — every token and client secret its stored OAuth
/// credential holds whenever it is read, including ones a refresh rotated in or a new login
/// replaced — shared between the server's token source (which learns them) and its
/// [`KnownSecrets`] (which scrubs them).
#[derive(Clone, Default)]
pub struct LearnedSecrets(std::sync::Arc<std::sync::Mutex<Vec<zeroize::Zeroizing<String>>>>);

impl LearnedSecrets {
    /// Remember `value` (values shorter than 4 bytes are ignored, like configured ones).
    /// `false` when it is new and [`MAX_LEARNED_SECRETS`] are already known: the caller must
    /// not use it.
    pub fn learn(&self, value: &str) -> bool {
        if value.len() < 4 {
            return true;
        }
        let mut known = match self.0.lock() {
            Ok(k) => k,
            Err(p) => p.into_inner(),
        };
        if known.iter().any(|k| k.as_str() == value) {
            return true;
        }
        if known.len() >= MAX_LEARNED_SECRETS {
            return false;
        }
        known.push(zeroize::Zeroizing::new(value.to_owned()));
        true
    }

    /// Learn every secret of a stored credential; `false` if one could not be learned.
    pub fn learn_credential(&self, cred: &crate::credentials::Credential) -> bool {
        use secrecy::ExposeSecret;
        let s = &cred.secrets;
        std::iter::once(&s.access_token)
            .chain(s.refresh_token.iter())
            .chain(s.client_secret.iter())
            .all(|v| self.learn(v.expose_secret()))
    }

    fn scrub(&self, out: &mut String) {
        let known = match self.0.lock() {
            Ok(k) => k,
            Err(p) => p.into_inner(),
        };
        for secret in known.iter() {
            if out.contains(secret.as_str()) {
                *out = out.replace(secret.as_str(), "[REDACTED]");
            }
        }
    }
}

impl KnownSecrets {
    /// Collect the values of every variable `server` names (values shorter than 4 bytes are
    /// ignored: scrubbing them would mangle ordinary text and they protect nothing).
    pub fn of(
        server: &ServerConfig,
        lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    ) -> KnownSecrets {
        let names: Vec<String> = match &server.transport {
            Transport::Stdio(st) => st.env.iter().map(|n| n.as_str().to_owned()).collect(),
            Transport::Http(h) => h
                .header_env
                .values()
                .map(|v| v.as_str().to_owned())
                .chain(h.oauth.iter().flat_map(|o| {
                    [
                        o.access_token_env.as_ref(),
                        o.refresh_token_env.as_ref(),
                        o.client_secret_env.as_ref(),
                    ]
                    .into_iter()
                    .flatten()
                    .map(|v| v.as_str().to_owned())
                }))
                .collect(),
        };
        KnownSecrets {
            fixed: names
                .iter()
                .filter_map(|n| lookup(n))
                .filter_map(|v| v.into_string().ok())
                .filter(|v| v.len() >= 4)
                .map(zeroize::Zeroizing::new)
                .collect(),
            learned: LearnedSecrets::default(),
        }
    }

    /// Also scrub what `learned` learns while the server runs.
    pub fn with_learned(mut self, learned: LearnedSecrets) -> KnownSecrets {
        self.learned = learned;
        self
    }

    /// Also scrub the secrets of a stored OAuth credential (tokens and a registered client's
    /// secret): a server that echoes its bearer token must not hand it to the agent.
    pub fn with_credential(mut self, cred: &crate::credentials::Credential) -> KnownSecrets {
        use secrecy::ExposeSecret;
        let s = &cred.secrets;
        for v in std::iter::once(&s.access_token)
            .chain(s.refresh_token.iter())
            .chain(s.client_secret.iter())
        {
            let v = v.expose_secret();
            if v.len() >= 4 {
                self.fixed.push(zeroize::Zeroizing::new(v.to_owned()));
            }
        }
        self
    }

    /// `text` with every known secret value replaced by `[REDACTED]`.
    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for secret in &self.fixed {
            if out.contains(secret.as_str()) {
                out = out.replace(secret.as_str(), "[REDACTED]");
            }
        }
        self.learned.scrub(&mut out);
        out
    }
}

/// The binding zone of an HTTP server's endpoint: an IP literal is in its own zone, and
/// `localhost` is loopback; any other host name is bound to `public`, whatever its DNS answer
/// says today — so DNS can never move a server into a more privileged zone. (A binding recorded
/// at first login, or chosen by the operator, arrives with the credential store.)
pub fn endpoint_zone(server_url: &iteron_policy::url::EndpointUrl) -> Result<Zone, NetError> {
    match target_host(server_url) {
        TargetHost::Literal(ip) => judge_answer(&ip.to_string(), Zone::Loopback, &[ip]),
        TargetHost::Name(name) => {
            let bare = name.strip_suffix('.').unwrap_or(&name);
            Ok(if bare.eq_ignore_ascii_case("localhost") {
                Zone::Loopback
            } else {
                Zone::Public
            })
        }
        TargetHost::Missing => Err(NetError::Url("the URL has no host".into())),
    }
}

/// Where stdio servers run: the operator home their confinement denies, and the host ceiling
/// (a server admitted `web_egress` may open IPv4/IPv6 sockets).
#[derive(Debug, Clone)]
pub struct SpawnContext {
    /// `$ITERON_HOME`.
    pub home: std::path::PathBuf,
    /// The host ceiling.
    pub ceiling: iteron_policy::capability::CapabilitySet,
}

/// The confinement of a stdio server: the home denied; what its `sandbox` block grants;
/// network only when its admitted classes include `web_egress`; its limits or the defaults;
/// its `run_as` (default `nobody` under a root broker).
pub fn stdio_confinement(
    server: &ServerConfig,
    st: &iteron_policy::config::StdioServer,
    ctx: &SpawnContext,
) -> crate::confine::Spec {
    use iteron_policy::capability::Capability;
    let admitted = match server.policy.capabilities {
        Some(p) => ctx.ceiling.intersect(p),
        None => ctx.ceiling,
    };
    let paths = |v: &[iteron_policy::config::AbsolutePath]| {
        v.iter()
            .map(|p| std::path::PathBuf::from(p.as_str()))
            .collect()
    };
    crate::confine::Spec {
        deny: vec![ctx.home.clone()],
        readable: paths(&st.sandbox.readable),
        writable: paths(&st.sandbox.writable),
        network: admitted.contains(Capability::WebEgress),
        open_files: st
            .sandbox
            .max_open_files
            .unwrap_or(crate::confine::DEFAULT_OPEN_FILES),
        data_bytes: st
            .sandbox
            .max_memory_mb
            .map_or(crate::confine::DEFAULT_DATA_BYTES, |mb| mb << 20),
        processes: st.sandbox.max_processes,
        run_as: st.sandbox.run_as.unwrap_or_default(),
    }
}

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
            };
            Client::connect_stdio(spec, opts)
                .await
                .map_err(ConnectError::Mcp)
        }
        Transport::Http(h) => {
            let mut headers = configured_headers(h, lookup)?;
            if let Some(var) = h.oauth.as_ref().and_then(|o| o.access_token_env.as_ref()) {
                let token = lookup(var.as_str())
                    .ok_or_else(|| ConnectError::MissingVariable(var.to_string()))?;
                let mut bearer = OsString::from("Bearer ");
                bearer.push(token);
                // secret_header takes ownership and zeroizes its working copy.
                headers.insert(AUTHORIZATION, secret_header(bearer, var.as_str())?);
            }
            connect_http_with(h, network, headers, opts).await
        }
    }
}

/// The headers the configuration names (`header_env`), with their values from `lookup`.
fn configured_headers(
    h: &iteron_policy::config::HttpServer,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
) -> Result<HeaderMap, ConnectError> {
    let mut headers = HeaderMap::new();
    for (header, var) in &h.header_env {
        let value =
            lookup(var.as_str()).ok_or_else(|| ConnectError::MissingVariable(var.to_string()))?;
        let name = HeaderName::from_bytes(header.as_str().as_bytes())
            .map_err(|_| ConnectError::BadHeaderValue(var.to_string()))?;
        headers.insert(name, secret_header(value, var.as_str())?);
    }
    Ok(headers)
}

/// Connect to an HTTP server through the client of its binding zone.
async fn connect_http_with(
    h: &iteron_policy::config::HttpServer,
    network: &NetworkConfig,
    headers: HeaderMap,
    opts: Options,
) -> Result<Client, ConnectError> {
    let zone = endpoint_zone(&h.url).map_err(ConnectError::Net)?;
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let client = net.client(zone).map_err(ConnectError::Net)?;
    Client::connect_http(client, h.url.clone(), headers, opts)
        .await
        .map_err(ConnectError::Mcp)
}

/// Refresh when the access token expires within this margin.
pub const REFRESH_MARGIN_SECS: u64 = 30;

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Load a stored credential off the async runtime: a keyring read can take up to its 15 s
/// deadline and must not stall the other tasks.
async fn load_stored(
    store: &crate::credentials::CredentialStore,
    server: &str,
) -> Result<Option<crate::credentials::Credential>, String> {
    let (store, server) = (store.clone(), server.to_owned());
    tokio::task::spawn_blocking(move || store.load(&server).map_err(|e| e.to_string()))
        .await
        .map_err(|_| "the credential store task failed".to_owned())?
}

/// Refresh a stored credential: under the zone recorded at login, with the same `resource`,
/// and the rotated refresh token persisted (atomically, under the store's lock) before the new
/// access token is used.
async fn refresh_stored(
    store: &crate::credentials::CredentialStore,
    cred: &crate::credentials::Credential,
    network: &NetworkConfig,
) -> Result<crate::oauth::SecretString, ConnectError> {
    use crate::oauth::{flow, metadata};
    let Some(refresh_token) = &cred.secrets.refresh_token else {
        return Err(ConnectError::ReauthRequired(
            "the access token expired and there is no refresh token",
        ));
    };
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let http = net.client(cred.binding.zone).map_err(ConnectError::Net)?;
    let meta = metadata::discover_server(&http, &cred.binding.issuer)
        .await
        .map_err(ConnectError::OAuth)?;
    let client = flow::OAuthClient {
        id: cred.binding.client_id.clone(),
        secret: cred.secrets.client_secret.clone(),
        auth: cred.binding.token_auth,
        kind: cred.binding.client_kind,
        issuer: cred.binding.issuer.clone(),
    };
    let tokens = flow::refresh(&http, &meta, &client, refresh_token, &cred.binding.resource)
        .await
        .map_err(ConnectError::OAuth)?;
    let access = tokens.access.clone();
    let (store, server) = (store.clone(), cred.binding.server.clone());
    // Off the runtime, like `load_stored`; the rotated refresh token is persisted before the
    // new access token is handed out.
    tokio::task::spawn_blocking(move || {
        store.update_secrets(&server, |s| {
            s.access_token = tokens.access;
            if let Some(r) = tokens.refresh {
                s.refresh_token = Some(r);
            }
            s.expires_at = tokens.expires_in.map(|e| unix_now() + e);
        })
    })
    .await
    .map_err(|_| ConnectError::Credentials("the credential store task failed".into()))?
    .map_err(|e| ConnectError::Credentials(e.to_string()))?;
    Ok(access)
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
    ceiling: iteron_policy::capability::CapabilitySet,
    learned: &LearnedSecrets,
) -> Result<Client, ConnectError> {
    use secrecy::ExposeSecret;
    let ctx = SpawnContext {
        home: home.dir().to_path_buf(),
        ceiling,
    };
    let store = crate::credentials::CredentialStore::new(home);
    let stored = match &server.transport {
        Transport::Http(_) => load_stored(&store, server.name.as_str())
            .await
            .map_err(ConnectError::Credentials)?,
        Transport::Stdio(_) => None,
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
            refresh_stored(&store, &cred, network).await?
        }
        _ => cred.secrets.access_token.clone(),
    };
    // A fresh set per connect: it cannot be full yet, so nothing here can be refused.
    let _ = learned.learn_credential(&cred) && learned.learn(token.expose_secret());
    let mut opts = opts;
    opts.token = Some(std::sync::Arc::new(StoredToken {
        store: crate::credentials::CredentialStore::new(home),
        server: server.name.to_string(),
        network: network.clone(),
        learned: learned.clone(),
    }));
    let mut refreshed = false;
    loop {
        match connect_bearer(server, network, lookup, opts.clone(), &token, &ctx).await {
            // A 401 is a refusal before anything ran: refresh once and connect again.
            Err(ConnectError::Mcp(e)) if is_unauthorized(&e) && !refreshed => {
                refreshed = true;
                let fresh = load_stored(&store, server.name.as_str())
                    .await
                    .map_err(ConnectError::Credentials)?
                    .ok_or(ConnectError::ReauthRequired("the credential was removed"))?;
                token = refresh_stored(&store, &fresh, network).await?;
                // At most a handful learned so far (one connect, one refresh): never full.
                let _ = learned.learn_credential(&fresh) && learned.learn(token.expose_secret());
            }
            other => return other,
        }
    }
}

/// The operator's stored OAuth credential as the client's managed token: read from the store
/// at each request, refreshed (with rotation persisted first) when it is about to expire or
/// after a 401.
pub(crate) struct StoredToken {
    store: crate::credentials::CredentialStore,
    server: String,
    network: NetworkConfig,
    /// Every token handed out is learned here first.
    learned: LearnedSecrets,
}

impl StoredToken {
    #[cfg(test)]
    pub(crate) fn new(
        store: crate::credentials::CredentialStore,
        server: &str,
        learned: LearnedSecrets,
    ) -> StoredToken {
        StoredToken {
            store,
            server: server.to_owned(),
            network: NetworkConfig::default(),
            learned,
        }
    }

    async fn get(&self, force: bool) -> Result<crate::oauth::SecretString, String> {
        let cred = load_stored(&self.store, &self.server)
            .await?
            .ok_or("the credential was removed; log in again")?;
        let expiring = cred
            .secrets
            .expires_at
            .is_some_and(|t| t <= unix_now() + REFRESH_MARGIN_SECS);
        let too_many = || {
            format!(
                "this server was handed more than {MAX_LEARNED_SECRETS} distinct secrets since it started; restart it (iteron broker restart)"
            )
        };
        // Learned before use: a token the scrubber does not know is never handed out.
        if !self.learned.learn_credential(&cred) {
            return Err(too_many());
        }
        let token = if force || expiring {
            refresh_stored(&self.store, &cred, &self.network)
                .await
                .map_err(|e| e.to_string())?
        } else {
            cred.secrets.access_token.clone()
        };
        {
            use secrecy::ExposeSecret;
            if !self.learned.learn(token.expose_secret()) {
                return Err(too_many());
            }
        }
        Ok(token)
    }
}

impl crate::mcp::client::TokenSource for StoredToken {
    fn current(&self) -> crate::mcp::client::TokenFuture<'_> {
        Box::pin(self.get(false))
    }

    fn refresh(&self) -> crate::mcp::client::TokenFuture<'_> {
        Box::pin(self.get(true))
    }
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

async fn connect_bearer(
    server: &ServerConfig,
    network: &NetworkConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    opts: Options,
    token: &crate::oauth::SecretString,
    ctx: &SpawnContext,
) -> Result<Client, ConnectError> {
    use secrecy::ExposeSecret;
    let Transport::Http(h) = &server.transport else {
        return connect(server, network, lookup, opts, ctx).await;
    };
    let mut headers = configured_headers(h, lookup)?;
    let bearer = OsString::from(format!("Bearer {}", token.expose_secret()));
    headers.insert(
        AUTHORIZATION,
        secret_header(bearer, "the stored access token")?,
    );
    connect_http_with(h, network, headers, opts).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use iteron_policy::url::EndpointUrl;

    #[test]
    fn dns_never_chooses_the_binding_zone() {
        let z = |u: &str| endpoint_zone(&EndpointUrl::parse(u).unwrap()).unwrap();
        assert_eq!(z("https://mcp.example.com/mcp"), Zone::Public);
        assert_eq!(z("http://localhost:3000/mcp"), Zone::Loopback);
        assert_eq!(z("http://LOCALHOST./mcp"), Zone::Loopback);
        assert_eq!(z("http://127.0.0.1:8080/mcp"), Zone::Loopback);
        assert_eq!(z("https://10.0.0.5/mcp"), Zone::Private);
        assert_eq!(z("https://169.254.169.254/"), Zone::LinkLocal);
        assert!(endpoint_zone(&EndpointUrl::parse("https://224.0.0.1/").unwrap()).is_err());
    }
}
