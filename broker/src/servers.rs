//! Turning a configured server into a connected MCP client. Shared by the operator commands
//! (`iteron mcp test|status|doctor`) and, later, the broker daemon.
//!
//! Secrets enter here and nowhere else: the values of variables the operator named
//! (`env`, `header_env`, `oauth.access_token_env`) are read through the lookup the caller
//! passes, go straight into the child's environment or into sensitive header values, and are
//! never stored, logged or shown.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::sync::{Arc, OnceLock};

use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};

use iteron_policy::config::{NetworkConfig, ServerConfig, Transport};
use iteron_policy::zone::Zone;

use crate::mcp::client::{AccessToken, Client, McpError, Options};
use crate::net::{Net, NetConfig, NetError, TargetHost, judge_answer, target_host};
use crate::scrub::Patterns;
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
/// echoes an API key in an error must not get it printed. Every form of every value is looked
/// for at once ([`crate::scrub`]): raw, JSON-escaped, base64, percent-encoded; a value that
/// contains another is redacted whole.
#[derive(Default)]
pub struct KnownSecrets {
    fixed: Patterns,
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
pub struct LearnedSecrets(std::sync::Arc<std::sync::Mutex<Patterns>>);

impl LearnedSecrets {
    fn lock(&self) -> std::sync::MutexGuard<'_, Patterns> {
        match self.0.lock() {
            Ok(k) => k,
            Err(p) => p.into_inner(),
        }
    }

    /// Remember `value` (values shorter than 4 bytes are ignored, like configured ones).
    /// `false` when it is new and [`MAX_LEARNED_SECRETS`] are already known: the caller must
    /// not use it.
    pub fn learn(&self, value: &str) -> bool {
        if value.len() < crate::scrub::MIN_SECRET {
            return true;
        }
        let mut known = self.lock();
        if known.has(value) {
            return true;
        }
        if known.secrets() >= MAX_LEARNED_SECRETS {
            return false;
        }
        known.add(value);
        true
    }

    /// Learn every secret of a stored credential; `false` if one could not be learned.
    pub fn learn_credential(&self, cred: &crate::credentials::Credential) -> bool {
        use secrecy::ExposeSecret;
        let s = &cred.secrets;
        std::iter::once(&s.access_token)
            .chain(s.refresh_token.iter())
            .chain(s.client_secret.iter())
            .chain(s.dpop_key.iter())
            .all(|v| self.learn(v.expose_secret()))
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
        let mut fixed = Patterns::default();
        for value in names.iter().filter_map(|n| lookup(n)) {
            if let Ok(v) = value.into_string() {
                let v = zeroize::Zeroizing::new(v);
                fixed.add(&v);
            }
        }
        KnownSecrets {
            fixed,
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
            .chain(s.dpop_key.iter())
        {
            self.fixed.add(v.expose_secret());
        }
        self
    }

    /// `text` with every known secret value, in any of its forms, replaced by `[REDACTED]`;
    /// `None` when there is nothing to replace.
    pub fn scrub_changed(&self, text: &str) -> Option<String> {
        let mut ranges = Vec::new();
        self.fixed.find(text, &mut ranges);
        self.learned.lock().find(text, &mut ranges);
        if ranges.is_empty() {
            return None;
        }
        Some(crate::scrub::redact(text, ranges).into_owned())
    }

    /// `text` with every known secret value, in any of its forms, replaced by `[REDACTED]`.
    pub fn scrub(&self, text: &str) -> String {
        self.scrub_changed(text).unwrap_or_else(|| text.to_owned())
    }

    /// Scrub every string of a JSON value (object keys included).
    pub fn scrub_json(&self, v: &mut serde_json::Value) {
        crate::scrub::scrub_value(v, &|s| self.scrub_changed(s));
    }
}

impl crate::mcp::Scrub for KnownSecrets {
    fn scrub_value(&self, v: &mut serde_json::Value) {
        self.scrub_json(v);
    }
    fn scrub_text(&self, t: &str) -> String {
        self.scrub(t)
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
    /// Where a `web_egress` server's refused destinations are counted and audited (`None`:
    /// counted for that one start only).
    pub egress: Option<std::sync::Arc<crate::egress::Observer>>,
}

/// The confinement of a stdio server: the home denied; what its `sandbox` block grants;
/// network only when its admitted classes include `web_egress` (through the broker's egress
/// path unless `sandbox.network` is `host`; `sandbox.egress` names what it may reach above the
/// public zone); its limits or the defaults; its `run_as` (default `nobody` under a root
/// broker).
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
        net_mode: st.sandbox.network.unwrap_or_default(),
        egress: st.sandbox.egress.clone(),
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

/// The variable an HTTP server's externally managed token is read from, if it has one.
fn external_var(h: &iteron_policy::config::HttpServer) -> Option<&iteron_policy::names::EnvName> {
    h.oauth.as_ref().and_then(|o| o.access_token_env.as_ref())
}

/// Connect with the externally managed token (`oauth.access_token_env`): refreshed first when
/// `expires_at_env` says it expires within [`REFRESH_MARGIN_SECS`] (an expired token is never
/// sent), and once more after a `401` at connect; the token source goes on doing both for the
/// client's later requests.
async fn connect_external(
    server: &ServerConfig,
    h: &iteron_policy::config::HttpServer,
    network: &NetworkConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    opts: Options,
    learned: &LearnedSecrets,
) -> Result<Client, ConnectError> {
    let source = Arc::new(ExternalToken::new(
        server,
        h,
        network,
        lookup,
        learned,
        external_tokens(),
    )?);
    let var = source.var.clone();
    let mut opts = opts;
    opts.token = Some(source.clone());
    let mut token = source.get(false).await.map_err(ConnectError::External)?;
    let mut refreshed = false;
    loop {
        let mut headers = configured_headers(h, lookup)?;
        headers.insert(AUTHORIZATION, bearer_header(&token, &var)?);
        match connect_http_with(h, network, headers, opts.clone()).await {
            // A 401 is a refusal before anything ran: renew once and connect again.
            Err(ConnectError::Mcp(e)) if is_unauthorized(&e) && !refreshed => {
                refreshed = true;
                token = source.get(true).await.map_err(ConnectError::External)?;
            }
            other => return other,
        }
    }
}

fn bearer_header(
    token: &crate::oauth::SecretString,
    what: &str,
) -> Result<HeaderValue, ConnectError> {
    use secrecy::ExposeSecret;
    secret_header(
        OsString::from(format!("Bearer {}", token.expose_secret())),
        what,
    )
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
///
/// When the authorization server refuses the refresh token (`invalid_grant`), or rotates it
/// into tokens Iteron cannot use (they are revoked by [`crate::oauth::flow`]), the dead refresh
/// token is dropped and the credential marked `refresh_failed`: `auth status` says so and only
/// a new login helps. When the rotated tokens cannot be stored (over the credential bound, a
/// full disk, a busy lock), they are revoked at the authorization server, never just dropped.
async fn refresh_stored(
    store: &crate::credentials::CredentialStore,
    cred: &crate::credentials::Credential,
    network: &NetworkConfig,
    grant: Option<&crate::oauth::grant::GrantRequest>,
) -> Result<AccessToken, ConnectError> {
    use crate::oauth::{OAuthError, flow, metadata};
    let Some(refresh_token) = &cred.secrets.refresh_token else {
        // A noninteractive grant needs no refresh token: the broker runs it again.
        if let Some(g) = grant {
            let (renewed, _) = obtain_and_store(store, cred, network, g).await?;
            return access_of(&renewed);
        }
        return Err(ConnectError::ReauthRequired(
            if cred.secrets.refresh_failed {
                "the authorization server refused the refresh token"
            } else {
                "the access token expired and there is no refresh token"
            },
        ));
    };
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let http = net.client(cred.binding.zone).map_err(ConnectError::Net)?;
    let meta = metadata::discover_server_for(
        &http,
        &cred.binding.issuer,
        metadata::Purpose::TokenEndpoint,
    )
    .await
    .map_err(ConnectError::OAuth)?;
    // A pre-registered client's secret or key comes from where the operator named it.
    let client = flow::OAuthClient {
        id: cred.binding.client_id.clone(),
        secret: cred
            .secrets
            .client_secret
            .clone()
            .or_else(|| grant.and_then(|g| g.client.secret.clone())),
        key: grant.and_then(|g| g.client.key.clone()),
        // A DPoP-bound grant is refreshed with the key it is bound to.
        dpop: stored_dpop_key(cred)?,
        auth: cred.binding.token_auth,
        kind: cred.binding.client_kind,
        issuer: cred.binding.issuer.clone(),
    };
    let (store, server) = (store.clone(), cred.binding.server.clone());
    let tokens =
        match flow::refresh(&http, &meta, &client, refresh_token, &cred.binding.resource).await {
            Ok(t) => t,
            Err(e) => {
                let refused = match &e {
                    OAuthError::Server { error, .. } if error == "invalid_grant" => {
                        Some("the authorization server refused the refresh token (invalid_grant)")
                    }
                    OAuthError::UnusableTokens { .. } => Some(
                        "the authorization server rotated the refresh token into tokens that \
                         could not be kept",
                    ),
                    _ => None,
                };
                let Some(why) = refused else {
                    return Err(ConnectError::OAuth(e));
                };
                let (store, server) = (store.clone(), server.clone());
                // Best effort: the refusal is reported whether or not the mark is written.
                let _ = tokio::task::spawn_blocking(move || {
                    store.update_secrets(&server, |s| {
                        s.refresh_token = None;
                        s.refresh_failed = true;
                    })
                })
                .await;
                if let OAuthError::UnusableTokens { .. } = e {
                    return Err(ConnectError::OAuth(e));
                }
                return Err(ConnectError::ReauthRequired(why));
            }
        };
    let access = tokens.access.clone();
    let rotated = tokens.refresh.clone();
    let expires_at = tokens.expires_at(unix_now());
    // Off the runtime, like `load_stored`; the rotated refresh token is persisted before the
    // new access token is handed out.
    let stored = tokio::task::spawn_blocking(move || {
        store.update_secrets(&server, |s| {
            s.access_token = tokens.access;
            if let Some(r) = tokens.refresh {
                s.refresh_token = Some(r);
            }
            s.expires_at = expires_at;
            s.refresh_failed = false;
        })
    })
    .await
    .map_err(|_| "the credential store task failed".to_owned())
    .and_then(|r| r.map_err(|e| e.to_string()))
    .and_then(|existed| {
        if existed {
            Ok(())
        } else {
            Err("the credential was removed while it was being refreshed".to_owned())
        }
    });
    if let Err(why) = stored {
        // The authorization server has rotated the grant into tokens nobody holds now:
        // revoke them rather than leave them live.
        let revoked = flow::revoke_all(&http, &meta, &client, &access, rotated.as_ref()).await;
        return Err(ConnectError::Credentials(format!(
            "{why}; {}",
            revoked.as_str()
        )));
    }
    Ok(AccessToken {
        token: access,
        dpop: client.dpop,
    })
}

/// The access token of a stored credential as it is presented (DPoP-bound when it has a key).
fn access_of(cred: &crate::credentials::Credential) -> Result<AccessToken, ConnectError> {
    Ok(AccessToken {
        token: cred.secrets.access_token.clone(),
        dpop: stored_dpop_key(cred)?,
    })
}

/// The DPoP key a stored credential's tokens are bound to, if any.
fn stored_dpop_key(
    cred: &crate::credentials::Credential,
) -> Result<Option<Arc<crate::oauth::dpop::DpopKey>>, ConnectError> {
    cred.secrets
        .dpop_key
        .as_ref()
        .map(|k| {
            crate::oauth::dpop::DpopKey::from_stored(k)
                .map(Arc::new)
                .map_err(|_| ConnectError::ReauthRequired("the stored DPoP key cannot be read"))
        })
        .transpose()
}

/// The client's private key, read from where the operator named it (`client_key_file`, else
/// `client_key_env`, whose `$CREDENTIALS_DIRECTORY` credential wins over the environment).
pub fn client_key(
    o: &iteron_policy::config::OAuthConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
) -> Result<Option<Arc<crate::oauth::jose::SigningKey>>, ConnectError> {
    use crate::oauth::jose::{MAX_KEY_PEM_BYTES, SigningKey};
    let pem = match (&o.client_key_file, &o.client_key_env) {
        (Some(path), _) => {
            let bytes = crate::oauth::material::read_private_file(
                std::path::Path::new(path.as_str()),
                MAX_KEY_PEM_BYTES,
            )
            .map_err(|why| ConnectError::ClientKey(format!("file {why}")))?;
            zeroize::Zeroizing::new(String::from_utf8(bytes.to_vec()).map_err(|_| {
                ConnectError::ClientKey(format!("file is not text: {}", path.as_str()))
            })?)
        }
        (None, Some(var)) => {
            use secrecy::ExposeSecret;
            let v = secret_var(lookup, var)?;
            zeroize::Zeroizing::new(v.expose_secret().to_owned())
        }
        (None, None) => return Ok(None),
    };
    let where_ = o
        .client_key_file
        .as_ref()
        .map(|p| format!("in {}", p.as_str()))
        .or_else(|| o.client_key_env.as_ref().map(|v| format!("named by {v}")))
        .unwrap_or_default();
    SigningKey::from_pem(&pem)
        .map(|k| Some(Arc::new(k)))
        .map_err(|e| ConnectError::ClientKey(format!("{where_}: {e}")))
}

/// The noninteractive grant `server` is configured for (`oauth.grant`), with the client's
/// secret or key read from where the operator named them; `None` for a browser login.
pub fn grant_request(
    server: &ServerConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
) -> Result<Option<crate::oauth::grant::GrantRequest>, ConnectError> {
    use crate::oauth::flow::{ClientKind, OAuthClient, TokenAuth};
    use crate::oauth::grant::{GrantRequest, IdentitySource, IdentityToken, Kind};
    use iteron_policy::config::{ClientAuth, Grant};
    let Transport::Http(h) = &server.transport else {
        return Ok(None);
    };
    let Some(o) = &h.oauth else {
        return Ok(None);
    };
    let kind = match o.grant {
        None | Some(Grant::AuthorizationCode) => return Ok(None),
        Some(Grant::ClientCredentials) => Kind::ClientCredentials,
        Some(Grant::JwtBearer) => Kind::JwtBearer,
        Some(Grant::IdJag) => Kind::IdJag,
    };
    // The identity token: a file is read at every exchange; a variable's value is fixed.
    let identity = match (&o.identity_token_file, &o.identity_token_env) {
        (Some(path), _) => Some(IdentityToken::new(IdentitySource::File(
            std::path::PathBuf::from(path.as_str()),
        ))),
        (None, Some(var)) => Some(IdentityToken::new(IdentitySource::Value(
            secret_var(lookup, var)?,
            format!("named by {var}"),
        ))),
        (None, None) => None,
    };
    let secret = o
        .client_secret_env
        .as_ref()
        .map(|n| secret_var(lookup, n))
        .transpose()?;
    let key = client_key(o, lookup)?;
    let auth = match (o.token_endpoint_auth, &key, &secret) {
        (Some(ClientAuth::PrivateKeyJwt), _, _) | (None, Some(_), _) => TokenAuth::PrivateKeyJwt,
        (Some(ClientAuth::ClientSecretPost), _, _) => TokenAuth::Post,
        (Some(ClientAuth::ClientSecretBasic), _, _) | (None, None, Some(_)) => TokenAuth::Basic,
        (None, None, None) => TokenAuth::None,
    };
    // The configuration guarantees a plain client id and a pinned issuer for these grants.
    let issuer = o
        .issuer
        .as_ref()
        .map(|i| i.as_str().to_owned())
        .ok_or(ConnectError::ReauthRequired("the grant needs oauth.issuer"))?;
    Ok(Some(GrantRequest {
        server: h.url.clone(),
        resource: o.resource.as_ref().map(|r| r.as_str().to_owned()),
        issuer: issuer.clone(),
        scopes: (!o.scopes.is_empty()).then(|| {
            o.scopes
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        }),
        client: OAuthClient {
            id: o
                .client_id
                .as_ref()
                .map(|c| c.as_str().to_owned())
                .unwrap_or_default(),
            secret,
            key,
            dpop: None,
            auth,
            kind: ClientKind::PreRegistered,
            issuer,
        },
        kind,
        identity,
        dpop: o.dpop == Some(true),
        idp: match (&o.idp_issuer, &o.idp_client_id) {
            (Some(iss), Some(id)) => {
                let idp_secret = o
                    .idp_client_secret_env
                    .as_ref()
                    .map(|n| secret_var(lookup, n))
                    .transpose()?;
                // As the operator wrote it: the provider's metadata must name it exactly.
                let issuer = iss.as_str().to_owned();
                Some(crate::oauth::grant::IdentityProvider {
                    issuer: issuer.clone(),
                    client: OAuthClient {
                        id: id.as_str().to_owned(),
                        auth: if idp_secret.is_some() {
                            TokenAuth::Basic
                        } else {
                            TokenAuth::None
                        },
                        secret: idp_secret,
                        key: None,
                        dpop: None,
                        kind: ClientKind::PreRegistered,
                        issuer,
                    },
                })
            }
            _ => None,
        },
    }))
}

/// The credential a completed login or grant yields for `server` (bound to its current
/// configuration and `zone`). A pre-registered client's secret is not copied into it: it is
/// read from where the operator named it whenever it is needed; a dynamically registered
/// client's secret exists nowhere else and is kept.
pub fn credential_of(
    server: &ServerConfig,
    outcome: crate::oauth::login::LoginOutcome,
    zone: Zone,
    now: u64,
) -> crate::credentials::Credential {
    use crate::credentials::{Binding, Credential, Secrets};
    let words = |s: Option<&str>| -> Vec<String> {
        s.unwrap_or("")
            .split(' ')
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let granted = words(
        outcome
            .tokens
            .scope
            .as_deref()
            .or(outcome.requested.as_deref()),
    );
    let backend = match &server.transport {
        Transport::Http(h) => h.oauth.as_ref().and_then(|o| o.credential_store),
        Transport::Stdio(_) => None,
    }
    .unwrap_or(iteron_policy::config::CredentialBackend::File);
    let expires_at = outcome.tokens.expires_at(now);
    let client_secret = match outcome.client.kind {
        crate::oauth::flow::ClientKind::Dynamic => outcome.client.secret.clone(),
        _ => None,
    };
    Credential {
        binding: Binding {
            server: server.name.to_string(),
            resource: outcome.resource,
            issuer: outcome.server.issuer.clone(),
            zone,
            client_id: outcome.client.id.clone(),
            client_kind: outcome.client.kind,
            token_auth: outcome.client.auth,
            requested_scopes: words(outcome.requested.as_deref()),
            granted_scopes: granted,
            config_digest: crate::credentials::config_digest(server),
            secret_store: backend,
        },
        secrets: Secrets {
            access_token: outcome.tokens.access,
            refresh_token: outcome.tokens.refresh,
            client_secret,
            expires_at,
            refresh_failed: false,
            dpop_key: outcome.client.dpop.as_ref().map(|k| k.stored()),
        },
    }
}

/// Run a noninteractive grant for the server `cred` binds (or, with no credential yet, for
/// `server`) under its binding zone and store what it yields, replacing the stored credential
/// whole. Tokens that cannot be stored are revoked, never left live. Returns the credential and
/// the authorization server's metadata.
async fn obtain_and_store(
    store: &crate::credentials::CredentialStore,
    cred: &crate::credentials::Credential,
    network: &NetworkConfig,
    grant: &crate::oauth::grant::GrantRequest,
) -> Result<
    (
        crate::credentials::Credential,
        crate::oauth::metadata::ServerMetadata,
    ),
    ConnectError,
> {
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let http = net.client(cred.binding.zone).map_err(ConnectError::Net)?;
    let mut req = grant.clone();
    // A renewal stays on the resource it was bound to.
    req.resource = Some(cred.binding.resource.clone());
    let outcome = crate::oauth::grant::obtain(&http, &req, None)
        .await
        .map_err(ConnectError::OAuth)?;
    store_outcome(store, cred, outcome, &http).await
}

/// Store a grant's outcome over `previous` (its binding, with the new tokens and scopes).
async fn store_outcome(
    store: &crate::credentials::CredentialStore,
    previous: &crate::credentials::Credential,
    outcome: crate::oauth::login::LoginOutcome,
    http: &crate::net::ZoneClient,
) -> Result<
    (
        crate::credentials::Credential,
        crate::oauth::metadata::ServerMetadata,
    ),
    ConnectError,
> {
    let meta = outcome.server.clone();
    let client = outcome.client.clone();
    let granted: Vec<String> = outcome
        .tokens
        .scope
        .as_deref()
        .or(outcome.requested.as_deref())
        .unwrap_or("")
        .split(' ')
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect();
    let mut cred = previous.clone();
    cred.binding.resource = outcome.resource;
    cred.binding.granted_scopes = granted;
    cred.secrets.expires_at = outcome.tokens.expires_at(unix_now());
    cred.secrets.access_token = outcome.tokens.access;
    cred.secrets.refresh_token = outcome.tokens.refresh;
    cred.secrets.refresh_failed = false;
    // A new grant is bound to the key it was obtained with.
    cred.secrets.dpop_key = client.dpop.as_ref().map(|k| k.stored());
    save_or_revoke(store, http, &client, cred, meta).await
}

/// Run `server`'s noninteractive grant for the first time (no credential, or one bound to
/// another configuration) and store the result. Shared by the broker and `auth login`.
pub async fn login_noninteractive(
    home: &crate::store::Home,
    server: &ServerConfig,
    network: &NetworkConfig,
    grant: &crate::oauth::grant::GrantRequest,
    challenge: Option<&crate::oauth::Challenge>,
) -> Result<
    (
        crate::credentials::Credential,
        crate::oauth::metadata::ServerMetadata,
    ),
    ConnectError,
> {
    let Transport::Http(h) = &server.transport else {
        return Err(ConnectError::ReauthRequired("not an HTTP server"));
    };
    let zone = endpoint_zone(&h.url).map_err(ConnectError::Net)?;
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let http = net.client(zone).map_err(ConnectError::Net)?;
    let outcome = crate::oauth::grant::obtain(&http, grant, challenge)
        .await
        .map_err(ConnectError::OAuth)?;
    let store = crate::credentials::CredentialStore::new(home);
    let meta = outcome.server.clone();
    let client = outcome.client.clone();
    let cred = credential_of(server, outcome, zone, unix_now());
    save_or_revoke(&store, &http, &client, cred, meta).await
}

/// Store a freshly granted credential; if it cannot be stored, revoke its tokens at the
/// authorization server (so no live token is left that nothing holds) and say so.
async fn save_or_revoke(
    store: &crate::credentials::CredentialStore,
    http: &crate::net::ZoneClient,
    client: &crate::oauth::flow::OAuthClient,
    cred: crate::credentials::Credential,
    meta: crate::oauth::metadata::ServerMetadata,
) -> Result<
    (
        crate::credentials::Credential,
        crate::oauth::metadata::ServerMetadata,
    ),
    ConnectError,
> {
    let saved = cred.clone();
    let store2 = store.clone();
    let result = tokio::task::spawn_blocking(move || store2.save(&saved).map(|_| ()))
        .await
        .map_err(|_| "the credential store task failed".to_owned())
        .and_then(|r| r.map_err(|e| e.to_string()));
    if let Err(why) = result {
        let revoked = crate::oauth::flow::revoke_all(
            http,
            &meta,
            client,
            &cred.secrets.access_token,
            cred.secrets.refresh_token.as_ref(),
        )
        .await;
        return Err(ConnectError::Credentials(format!(
            "{why}; {}",
            revoked.as_str()
        )));
    }
    Ok((cred, meta))
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
                token = refresh_stored(&store, &fresh, network, grant.as_ref()).await?;
                // At most a handful learned so far (one connect, one refresh): never full.
                let _ =
                    learned.learn_credential(&fresh) && learned.learn(token.token.expose_secret());
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
    /// The noninteractive grant that renews the credential when it has no refresh token.
    grant: Option<crate::oauth::grant::GrantRequest>,
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
            grant: None,
        }
    }

    async fn get(&self, force: bool) -> Result<AccessToken, String> {
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
            refresh_stored(&self.store, &cred, &self.network, self.grant.as_ref())
                .await
                .map_err(|e| e.to_string())?
        } else {
            access_of(&cred).map_err(|e| e.to_string())?
        };
        {
            use secrecy::ExposeSecret;
            if !self.learned.learn(token.token.expose_secret()) {
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

/// Most servers whose externally managed tokens one broker process holds (rotations are kept
/// per server; a configuration holds at most [`iteron_policy::config::MAX_SERVERS`]).
pub const MAX_EXTERNAL_TOKENS: usize = iteron_policy::config::MAX_SERVERS;

/// What the broker holds of one server's externally managed token: the access token, its
/// expiry and the refresh token, rotated in place. In memory only — read from the variables
/// the first time the server (in this configuration) is used by this process, never written
/// anywhere; a broker restart starts again from the variables.
struct ExternalState {
    /// The configuration digest the state was read under; another configuration starts afresh.
    digest: String,
    access: crate::oauth::SecretString,
    expires_at: Option<u64>,
    refresh: Option<crate::oauth::SecretString>,
    /// `auth logout` revoked these tokens through the broker: nothing is sent with them again.
    logged_out: bool,
}

type ExternalSlot = Arc<tokio::sync::Mutex<ExternalState>>;

/// The externally managed tokens of one process, per server name (at most `max`). The async
/// lock of each serializes its refreshes, so a refresh token is never presented twice.
pub struct ExternalTokens {
    max: usize,
    slots: std::sync::Mutex<HashMap<String, ExternalSlot>>,
}

impl ExternalTokens {
    /// An empty set of at most `max` servers.
    pub fn new(max: usize) -> ExternalTokens {
        ExternalTokens {
            max,
            slots: std::sync::Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, ExternalSlot>> {
        match self.slots.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The slot of `server` under `digest`, made by `init` when there is none (or the one held
    /// belongs to another configuration of the server).
    fn slot(
        &self,
        server: &str,
        digest: &str,
        init: impl FnOnce() -> Result<ExternalState, ConnectError>,
    ) -> Result<ExternalSlot, ConnectError> {
        let mut slots = self.lock();
        if let Some(s) = slots.get(server)
            && s.try_lock().map_or(true, |st| st.digest == digest)
        {
            // A slot being refreshed (locked) belongs to the current configuration: another
            // one would have replaced it before any refresh could start under it.
            return Ok(Arc::clone(s));
        }
        if !slots.contains_key(server) && slots.len() >= self.max {
            return Err(ConnectError::External(format!(
                "the broker already holds the externally managed tokens of {} servers; restart it",
                self.max
            )));
        }
        let slot = Arc::new(tokio::sync::Mutex::new(init()?));
        slots.insert(server.to_owned(), Arc::clone(&slot));
        Ok(slot)
    }

    /// The slot of `server`, if this process holds one.
    fn existing(&self, server: &str) -> Option<ExternalSlot> {
        self.lock().get(server).cloned()
    }
}

/// The process's externally managed tokens.
pub fn external_tokens() -> &'static ExternalTokens {
    static TOKENS: OnceLock<ExternalTokens> = OnceLock::new();
    TOKENS.get_or_init(|| ExternalTokens::new(MAX_EXTERNAL_TOKENS))
}

/// An externally managed token as the client's managed token ([`crate::mcp::client::TokenSource`]):
/// renewed at `refresh_url` when `expires_at_env` says it expires within
/// [`REFRESH_MARGIN_SECS`] (never sent expired) and once after a `401`, the rotated refresh
/// token kept in the broker's memory.
pub(crate) struct ExternalToken {
    slot: ExternalSlot,
    endpoints: Option<crate::oauth::external::Endpoints>,
    network: NetworkConfig,
    zone: Zone,
    /// `access_token_env`, for messages.
    var: String,
    learned: LearnedSecrets,
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

impl ExternalToken {
    fn new(
        server: &ServerConfig,
        h: &iteron_policy::config::HttpServer,
        network: &NetworkConfig,
        lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
        learned: &LearnedSecrets,
        tokens: &ExternalTokens,
    ) -> Result<ExternalToken, ConnectError> {
        let o = h
            .oauth
            .as_ref()
            .ok_or(ConnectError::External("no oauth block".into()))?;
        let var = o
            .access_token_env
            .as_ref()
            .ok_or(ConnectError::External("no access_token_env".into()))?;
        let secret = o
            .client_secret_env
            .as_ref()
            .map(|n| secret_var(lookup, n))
            .transpose()?;
        let digest = crate::credentials::config_digest(server);
        let slot = tokens.slot(server.name.as_str(), &digest, || {
            let access = secret_var(lookup, var)?;
            let expires_at = match &o.expires_at_env {
                None => None,
                Some(n) => {
                    let v = secret_var(lookup, n)?;
                    use secrecy::ExposeSecret;
                    Some(
                        crate::oauth::external::parse_expires_at(v.expose_secret())
                            .ok_or_else(|| ConnectError::BadExpiry(n.to_string()))?,
                    )
                }
            };
            let refresh = o
                .refresh_token_env
                .as_ref()
                .map(|n| secret_var(lookup, n))
                .transpose()?;
            Ok(ExternalState {
                digest: digest.clone(),
                access,
                expires_at,
                refresh,
                logged_out: false,
            })
        })?;
        Ok(ExternalToken {
            slot,
            endpoints: crate::oauth::external::Endpoints::of(h, secret),
            network: network.clone(),
            zone: endpoint_zone(&h.url).map_err(ConnectError::Net)?,
            var: var.to_string(),
            learned: learned.clone(),
        })
    }

    fn http(&self) -> Result<crate::net::ZoneClient, String> {
        let net = Net::new(NetConfig::from_operator(&self.network).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        net.client(self.zone).map_err(|e| e.to_string())
    }

    /// The token to send: renewed first when it expires within the margin or when `force`
    /// (after a `401`).
    async fn get(&self, force: bool) -> Result<crate::oauth::SecretString, String> {
        use secrecy::ExposeSecret;
        let mut st = self.slot.lock().await;
        if st.logged_out {
            return Err(format!(
                "the externally managed token named by {} was revoked by iteron mcp auth logout; restart the broker with a new token",
                self.var
            ));
        }
        let expiring = st
            .expires_at
            .is_some_and(|t| t <= unix_now().saturating_add(REFRESH_MARGIN_SECS));
        if force || expiring {
            self.renew(&mut st, expiring).await?;
        }
        if !self.learned.learn(st.access.expose_secret()) {
            return Err(format!(
                "this server was handed more than {MAX_LEARNED_SECRETS} distinct secrets since it started; restart it (iteron broker restart)"
            ));
        }
        Ok(st.access.clone())
    }

    /// Present the held refresh token at `refresh_url` and keep what comes back (the rotated
    /// refresh token replaces the old one). A refresh token the authorization server refuses
    /// (`invalid_grant`), or rotates into tokens that cannot be used (they are revoked), is
    /// dropped: it is never presented again.
    async fn renew(&self, st: &mut ExternalState, expiring: bool) -> Result<(), String> {
        use crate::oauth::OAuthError;
        let (Some(ep), Some(rt)) = (
            self.endpoints.as_ref().filter(|e| e.refreshable),
            st.refresh.clone(),
        ) else {
            return Err(if expiring {
                format!(
                    "the access token named by {} expires (by its expires_at_env) and there is no refresh token to renew it; nothing was sent",
                    self.var
                )
            } else {
                format!(
                    "the server refused the access token named by {}, and there is no refresh token to renew it",
                    self.var
                )
            });
        };
        let http = self.http()?;
        match ep.refresh(&http, &rt).await {
            Ok(tokens) => {
                use secrecy::ExposeSecret;
                // Learned before anything can hand them out; a full scrubber refuses below.
                let _ = self.learned.learn(tokens.access.expose_secret());
                if let Some(r) = &tokens.refresh {
                    let _ = self.learned.learn(r.expose_secret());
                }
                st.expires_at = tokens.expires_at(unix_now());
                st.access = tokens.access;
                if let Some(r) = tokens.refresh {
                    st.refresh = Some(r);
                }
                Ok(())
            }
            Err(e) => {
                if matches!(&e, OAuthError::Server { error, .. } if error == "invalid_grant")
                    || matches!(e, OAuthError::UnusableTokens { .. })
                {
                    st.refresh = None;
                }
                Err(format!(
                    "renewing the access token named by {}: {e}",
                    self.var
                ))
            }
        }
    }
}

impl crate::mcp::client::TokenSource for ExternalToken {
    fn current(&self) -> crate::mcp::client::TokenFuture<'_> {
        Box::pin(async { self.get(false).await.map(AccessToken::bearer) })
    }

    fn refresh(&self) -> crate::mcp::client::TokenFuture<'_> {
        Box::pin(async { self.get(true).await.map(AccessToken::bearer) })
    }
}

/// What `auth logout` did to an externally managed token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExternalLogout {
    /// The configuration names no `revoke_url`: nothing was revoked.
    NoRevokeUrl,
    /// The outcome at `revoke_url`.
    Revoked(crate::oauth::Revoked),
}

/// Revoke `server`'s externally managed tokens at `revoke_url` (best effort): the ones this
/// process holds (the rotated refresh token and the current access token) when it holds them,
/// else the ones the variables name; then nothing is sent with them again by this process.
pub async fn logout_external(
    server: &ServerConfig,
    network: &NetworkConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
) -> Result<ExternalLogout, ConnectError> {
    let Transport::Http(h) = &server.transport else {
        return Err(ConnectError::External("not an HTTP server".into()));
    };
    let o = h
        .oauth
        .as_ref()
        .ok_or(ConnectError::External("no oauth block".into()))?;
    if o.revoke_url.is_none() {
        return Ok(ExternalLogout::NoRevokeUrl);
    }
    let secret = o
        .client_secret_env
        .as_ref()
        .map(|n| secret_var(lookup, n))
        .transpose()?;
    let Some(ep) = crate::oauth::external::Endpoints::of(h, secret) else {
        return Ok(ExternalLogout::NoRevokeUrl);
    };
    let zone = endpoint_zone(&h.url).map_err(ConnectError::Net)?;
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let http = net.client(zone).map_err(ConnectError::Net)?;
    if let Some(slot) = external_tokens().existing(server.name.as_str()) {
        let mut st = slot.lock().await;
        let revoked = ep
            .revoke(&http, Some(&st.access), st.refresh.as_ref())
            .await;
        st.logged_out = true;
        st.refresh = None;
        return Ok(ExternalLogout::Revoked(revoked));
    }
    let access = o
        .access_token_env
        .as_ref()
        .and_then(|n| secret_var(lookup, n).ok());
    let refresh = o
        .refresh_token_env
        .as_ref()
        .and_then(|n| secret_var(lookup, n).ok());
    Ok(ExternalLogout::Revoked(
        ep.revoke(&http, access.as_ref(), refresh.as_ref()).await,
    ))
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
    token: &AccessToken,
    ctx: &SpawnContext,
) -> Result<Client, ConnectError> {
    let Transport::Http(h) = &server.transport else {
        return connect(server, network, lookup, opts, ctx).await;
    };
    let mut headers = configured_headers(h, lookup)?;
    // A DPoP-bound token needs a proof per request: the client installs it from its token
    // source before the first one; a Bearer token also rides in the fixed headers.
    if token.dpop.is_none() {
        headers.insert(
            AUTHORIZATION,
            bearer_header(&token.token, "the stored access token")?,
        );
    }
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
        // A literal that is never a destination does not even make an endpoint URL.
        assert!(EndpointUrl::parse("https://224.0.0.1/").is_err());
    }

    fn arb_secret() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        proptest::collection::vec(
            prop_oneof![
                Just('"'),
                Just('\\'),
                Just('/'),
                Just('\n'),
                Just('\u{7}'),
                Just('<'),
                Just('&'),
                Just(' '),
                Just('+'),
                Just('%'),
                Just('é'),
                Just('\u{202e}'),
                Just('😀'),
                proptest::char::range('a', 'z'),
                proptest::char::range('0', '9'),
            ],
            8..20,
        )
        .prop_map(|c| c.into_iter().collect())
    }

    /// A server message with the secrets (one inside the other, every special character) in
    /// any of their forms planted in any string — keys included, at any depth — holds none of
    /// them, in no form, once scrubbed and serialized: what any field of it shows (a tool name,
    /// a description, a schema, a MIME type, structured content, an error) is clean.
    #[test]
    fn every_field_of_a_server_message_is_scrubbed_of_every_form_fuzzed_record() {
        use proptest::prelude::*;
        use serde_json::{Value, json};
        let strategy = (
            arb_secret(),
            arb_secret(),
            proptest::collection::vec((0usize..64, 0usize..8, any::<bool>()), 1..6),
        );
        let mut runner =
            proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(256));
        let executions = std::cell::Cell::new(0u64);
        runner
            .run(&strategy, |(a, b, plants)| {
                executions.set(executions.get() + 1);
                let outer = format!("{b}{a}{b}");
                let learned = LearnedSecrets::default();
                prop_assert!(learned.learn(&a) && learned.learn(&outer));
                let k = KnownSecrets::default().with_learned(learned);
                let mut msg = json!({"jsonrpc": "2.0", "id": 1, "result": {
                    "tools": [{"name": "t", "description": "d", "inputSchema": {"type": "object", "properties": {"p": {"description": "x"}}}}],
                    "content": [{"type": "image", "mimeType": "image/png", "data": "AAAA"}],
                    "structuredContent": {"k": ["v"]},
                    "error": {"message": "m"}
                }});
                let slots = [
                    "/result/tools/0/name", "/result/tools/0/description",
                    "/result/tools/0/inputSchema/properties/p/description",
                    "/result/content/0/mimeType", "/result/structuredContent/k/0",
                    "/result/error/message",
                ];
                for (which, slot, key) in &plants {
                    let secret = if which % 2 == 0 { &a } else { &outer };
                    let all = crate::scrub::forms(secret);
                    let form = all[which % all.len()].as_str().to_owned();
                    let path = slots[slot % slots.len()];
                    if *key {
                        // As an object key, next to the field.
                        let (parent, _) = path.rsplit_once('/').unwrap_or(("", ""));
                        if let Some(Value::Object(m)) = msg.pointer_mut(parent) {
                            m.insert(format!("k{form}k"), json!(1));
                        } else if let Some(Value::Array(v)) = msg.pointer_mut(parent) {
                            v.push(json!({ format!("k{form}k"): 1 }));
                        }
                    } else if let Some(v) = msg.pointer_mut(path) {
                        *v = Value::String(format!("{}{form}{}", "p".repeat(which * 7), "q"));
                    }
                }
                k.scrub_json(&mut msg);
                let shown = msg.to_string();
                for secret in [&a, &outer] {
                    for form in crate::scrub::forms(secret) {
                        prop_assert!(!shown.contains(form.as_str()));
                    }
                    // And as the strings themselves hold them (after JSON decoding).
                    let mut strings = Vec::new();
                    fn walk(v: &Value, out: &mut Vec<String>) {
                        match v {
                            Value::String(s) => out.push(s.clone()),
                            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
                            Value::Object(m) => m.iter().for_each(|(k, x)| {
                                out.push(k.clone());
                                walk(x, out)
                            }),
                            _ => {}
                        }
                    }
                    walk(&msg, &mut strings);
                    prop_assert!(!strings.iter().any(|s| s.contains(secret.as_str())));
                }
                Ok(())
            })
            .unwrap();
        crate::test_report::record(
            "P10",
            "broker/src/servers.rs::every_field_of_a_server_message_is_scrubbed_of_every_form_fuzzed_record",
            serde_json::json!({"executions": executions.get(), "crashes": 0}),
        );
    }
}
