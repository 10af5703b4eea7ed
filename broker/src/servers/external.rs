//! Externally managed tokens (`oauth.access_token_env`): read from the variables once per
//! process, renewed at `refresh_url` and held in memory only, revoked at `revoke_url` by
//! `auth logout`. What a logout revoked — the tokens the process held and the values the
//! variables named — is remembered (as SHA-256 digests) for the life of the process, whatever
//! server or configuration names it later: a revoked token is never presented again.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::sync::{Arc, OnceLock};

use iteron_policy::config::{NetworkConfig, ServerConfig, Transport};
use iteron_policy::zone::Zone;

use super::http::{bearer_header, configured_headers, connect_http_with};
use super::{
    ConnectError, LearnedSecrets, MAX_LEARNED_SECRETS, REFRESH_MARGIN_SECS, is_unauthorized,
    secret_var, unix_now,
};
use crate::mcp::client::{AccessToken, Client, Options};
use crate::net::{Net, NetConfig, endpoint_zone};

/// The variable an HTTP server's externally managed token is read from, if it has one.
pub(super) fn external_var(
    h: &iteron_policy::config::HttpServer,
) -> Option<&iteron_policy::names::EnvName> {
    h.oauth.as_ref().and_then(|o| o.access_token_env.as_ref())
}

/// Connect with the externally managed token (`oauth.access_token_env`): refreshed first when
/// `expires_at_env` says it expires within [`REFRESH_MARGIN_SECS`] (an expired token is never
/// sent), and once more after a `401` at connect; the token source goes on doing both for the
/// client's later requests.
pub(super) async fn connect_external(
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
    let mut opts = opts;
    opts.token = Some(source.clone());
    // Checked (and renewed when it expires) before connecting, for a typed error; the
    // transport asks the source again before every request, so no token rides in the fixed
    // headers.
    let token = source.get(false).await.map_err(ConnectError::External)?;
    // A value that cannot be a header is refused naming its variable.
    bearer_header(&token, &source.var)?;
    let mut refreshed = false;
    loop {
        let headers = configured_headers(h, lookup)?;
        match connect_http_with(h, network, headers, opts.clone()).await {
            // A 401 is a refusal before anything ran: renew once and connect again.
            Err(ConnectError::Mcp(e)) if is_unauthorized(&e) && !refreshed => {
                refreshed = true;
                source.get(true).await.map_err(ConnectError::External)?;
            }
            other => return other,
        }
    }
}

/// Most servers whose externally managed tokens one broker process holds (rotations are kept
/// per server; a configuration holds at most [`iteron_policy::config::MAX_SERVERS`]).
pub const MAX_EXTERNAL_TOKENS: usize = iteron_policy::config::MAX_SERVERS;

/// Most revoked tokens one process remembers: a logout adds the access and refresh tokens held
/// and the values the variables named (four; six when the server's configuration now names
/// other variables than its tokens were read from), and the variables of a process do not
/// change, so this is four per server a configuration may hold. Past it the process reads no
/// variable anew (fail closed) until it is restarted.
pub const MAX_REVOKED_TOKENS: usize = REVOKED_PER_SERVER * MAX_EXTERNAL_TOKENS;

/// Most tokens one logout remembers as revoked.
const REVOKED_PER_SERVER: usize = 4;

/// The SHA-256 of a token: what is remembered of a revoked one.
type Fingerprint = [u8; 32];

fn fingerprint(token: &crate::oauth::SecretString) -> Fingerprint {
    use secrecy::ExposeSecret;
    use sha2::Digest;
    sha2::Sha256::digest(token.expose_secret().as_bytes()).into()
}

/// What the broker holds of one server's externally managed token: the access token, its
/// expiry and the refresh token, rotated in place. In memory only — read from the variables
/// the first time the server (in this configuration) is used by this process, never written
/// anywhere; a broker restart starts again from the variables.
struct ExternalState {
    /// The configuration digest the state was read under; another configuration starts afresh.
    digest: String,
    /// The values the variables named when the state was read (access, then refresh token):
    /// a logout revokes what the state holds now and remembers these too.
    read: Vec<Fingerprint>,
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
    /// Shared with every [`ExternalToken`] made from this set, which looks here before each use.
    revoked: Arc<std::sync::Mutex<Revoked>>,
}

/// The tokens `auth logout` revoked in this process (at most `max`); `full` once one could not
/// be remembered.
struct Revoked {
    max: usize,
    tokens: HashSet<Fingerprint>,
    full: bool,
}

impl ExternalTokens {
    /// An empty set of at most `max` servers, remembering at most four revoked tokens per
    /// server ([`MAX_REVOKED_TOKENS`] for the process's own).
    pub fn new(max: usize) -> ExternalTokens {
        ExternalTokens {
            max,
            slots: std::sync::Mutex::new(HashMap::new()),
            revoked: Arc::new(std::sync::Mutex::new(Revoked {
                max: max.saturating_mul(REVOKED_PER_SERVER),
                tokens: HashSet::new(),
                full: false,
            })),
        }
    }

    fn revoked(&self) -> std::sync::MutexGuard<'_, Revoked> {
        lock_revoked(&self.revoked)
    }

    /// Remember tokens a logout revoked (or stopped using). One that cannot be remembered
    /// makes the set full: then no variable is read anew by this process (fail closed).
    fn remember(&self, tokens: impl IntoIterator<Item = Fingerprint>) {
        let mut r = self.revoked();
        for t in tokens {
            if r.tokens.contains(&t) {
                continue;
            }
            if r.tokens.len() >= r.max {
                r.full = true;
                continue;
            }
            r.tokens.insert(t);
        }
    }

    /// Whether a logout of this process revoked the token.
    fn is_revoked(&self, token: &crate::oauth::SecretString) -> bool {
        self.revoked().tokens.contains(&fingerprint(token))
    }
}

fn lock_revoked(m: &std::sync::Mutex<Revoked>) -> std::sync::MutexGuard<'_, Revoked> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl ExternalTokens {
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
        if self.revoked().full {
            return Err(ConnectError::External(format!(
                "the broker cannot remember more than {} revoked externally managed tokens, so it reads no token variable anew; restart it",
                self.revoked().max
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
    /// What logouts of this process revoked ([`ExternalTokens`]): looked at before every use,
    /// since a logout may revoke these tokens after this source was made (through another
    /// server naming the same variables, or while this one was connecting).
    revoked: Arc<std::sync::Mutex<Revoked>>,
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
            let read = std::iter::once(&access)
                .chain(refresh.as_ref())
                .map(fingerprint)
                .collect();
            // A value a logout of this process revoked is never presented again: a revoked
            // access token leaves the server logged out, a revoked refresh token is dropped.
            let logged_out = tokens.is_revoked(&access);
            let refresh = refresh.filter(|r| !tokens.is_revoked(r));
            Ok(ExternalState {
                digest: digest.clone(),
                read,
                access,
                expires_at,
                refresh,
                logged_out,
            })
        })?;
        Ok(ExternalToken {
            slot,
            endpoints: crate::oauth::external::Endpoints::of(h, secret),
            network: network.clone(),
            zone: endpoint_zone(&h.url).map_err(ConnectError::Net)?,
            var: var.to_string(),
            learned: learned.clone(),
            revoked: Arc::clone(&tokens.revoked),
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
        {
            let revoked = lock_revoked(&self.revoked);
            if revoked.tokens.contains(&fingerprint(&st.access)) {
                st.logged_out = true;
            }
            if st
                .refresh
                .as_ref()
                .is_some_and(|r| revoked.tokens.contains(&fingerprint(r)))
            {
                st.refresh = None;
            }
        }
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
/// else the ones the variables name. Whatever the revocation came to (and with no `revoke_url`
/// too), this process never sends them again: they, and the values the variables named, are
/// remembered as revoked, so a later connect of this server — or of any server whose variables
/// name them — is refused.
pub async fn logout_external(
    server: &ServerConfig,
    network: &NetworkConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
) -> Result<ExternalLogout, ConnectError> {
    logout_external_in(external_tokens(), server, network, lookup).await
}

async fn logout_external_in(
    tokens: &ExternalTokens,
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
    let endpoints = match o.revoke_url {
        None => None,
        Some(_) => {
            let secret = o
                .client_secret_env
                .as_ref()
                .map(|n| secret_var(lookup, n))
                .transpose()?;
            crate::oauth::external::Endpoints::of(h, secret)
        }
    };
    let http = match &endpoints {
        None => None,
        Some(_) => {
            let zone = endpoint_zone(&h.url).map_err(ConnectError::Net)?;
            let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
                .map_err(ConnectError::Net)?;
            Some(net.client(zone).map_err(ConnectError::Net)?)
        }
    };
    let revoke = async |access: Option<&crate::oauth::SecretString>,
                        refresh: Option<&crate::oauth::SecretString>| {
        match (&endpoints, &http) {
            (Some(ep), Some(http)) => {
                ExternalLogout::Revoked(ep.revoke(http, access, refresh).await)
            }
            _ => ExternalLogout::NoRevokeUrl,
        }
    };
    // What the variables name now (the slot may have been read under another configuration
    // of the server, naming other variables).
    let access = o
        .access_token_env
        .as_ref()
        .and_then(|n| secret_var(lookup, n).ok());
    let refresh = o
        .refresh_token_env
        .as_ref()
        .and_then(|n| secret_var(lookup, n).ok());
    let named: Vec<Fingerprint> = access
        .iter()
        .chain(refresh.iter())
        .map(fingerprint)
        .collect();
    if let Some(slot) = tokens.existing(server.name.as_str()) {
        let mut st = slot.lock().await;
        let outcome = revoke(Some(&st.access), st.refresh.as_ref()).await;
        st.logged_out = true;
        let held =
            std::iter::once(fingerprint(&st.access)).chain(st.refresh.as_ref().map(fingerprint));
        tokens.remember(
            held.chain(st.read.iter().copied())
                .chain(named)
                .collect::<Vec<_>>(),
        );
        st.refresh = None;
        return Ok(outcome);
    }
    let outcome = revoke(access.as_ref(), refresh.as_ref()).await;
    tokens.remember(named);
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::ExposeSecret;

    fn server(name: &str, client_id: &str) -> ServerConfig {
        let doc = serde_json::json!({"schema_version": 2, "mcp_servers": [{
            "name": name, "transport": "http", "url": "https://mcp.example/mcp",
            "oauth": {"access_token_env": "T", "refresh_token_env": "R",
                      "refresh_url": "https://as.example/token", "client_id": client_id}}]});
        let c = iteron_policy::config::Config::parse(doc.to_string().as_bytes()).unwrap();
        c.mcp_servers.into_iter().next().unwrap()
    }

    fn vars(t: &str, r: &str) -> impl Fn(&str) -> Option<OsString> + Sync + use<> {
        let (t, r) = (t.to_owned(), r.to_owned());
        move |k: &str| match k {
            "T" => Some(OsString::from(&t)),
            "R" => Some(OsString::from(&r)),
            _ => None,
        }
    }

    fn source(
        tokens: &ExternalTokens,
        s: &ServerConfig,
        lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    ) -> Result<ExternalToken, ConnectError> {
        let Transport::Http(h) = &s.transport else {
            unreachable!()
        };
        ExternalToken::new(
            s,
            h,
            &NetworkConfig::default(),
            lookup,
            &LearnedSecrets::default(),
            tokens,
        )
    }

    #[tokio::test]
    async fn a_logout_before_any_use_is_remembered_and_the_memory_is_bounded_failing_closed() {
        let tokens = ExternalTokens::new(2);
        let net = NetworkConfig::default();
        let a = server("a", "c");
        // No slot yet (the process never used the server): the logout still remembers what the
        // variables named, so a later connect never presents it.
        let out = logout_external_in(&tokens, &a, &net, &vars("t1", "r1")).await;
        assert!(matches!(out, Ok(ExternalLogout::NoRevokeUrl)));
        let e = source(&tokens, &a, &vars("t1", "r1"))
            .unwrap()
            .get(false)
            .await
            .err()
            .unwrap();
        assert!(e.contains("revoked by iteron mcp auth logout"), "{e}");
        // Another server whose variables name a new access token and the revoked refresh token:
        // the access token is used, the refresh token never presented.
        let b = source(&tokens, &server("b", "c"), &vars("t2", "r1")).unwrap();
        assert_eq!(b.get(false).await.unwrap().expose_secret(), "t2");
        let e = b.get(true).await.err().unwrap();
        assert!(e.contains("there is no refresh token to renew it"), "{e}");
        // A second logout of a server it holds adds nothing new (what it holds was read from
        // the variables already remembered).
        let _ = logout_external_in(&tokens, &a, &net, &vars("t1", "r1")).await;
        assert_eq!(tokens.revoked().tokens.len(), 2);
        // Four revoked tokens per server: logouts of servers never used fill the memory (8)…
        for (name, t, r) in [("c", "t3", "r3"), ("d", "t4", "r4"), ("e", "t5", "r5")] {
            let _ = logout_external_in(&tokens, &server(name, "c"), &net, &vars(t, r)).await;
        }
        assert_eq!(tokens.revoked().tokens.len(), 8);
        assert!(!tokens.revoked().full);
        // …and one over cannot be remembered: no variable is read anew by this process (a slot
        // already held stays as it was: the logged-out one stays logged out).
        let _ = logout_external_in(&tokens, &server("f", "c"), &net, &vars("t6", "r6")).await;
        assert!(tokens.revoked().full);
        let e = source(&tokens, &server("a", "other-client"), &vars("t7", "r7"))
            .err()
            .unwrap();
        assert!(
            e.to_string().contains("revoked externally managed tokens"),
            "{e}"
        );
        assert!(
            source(&tokens, &a, &vars("t1", "r1"))
                .unwrap()
                .get(false)
                .await
                .is_err()
        );
        iteron_test_support::record!(
            "P16",
            serde_json::json!({"revoked_per_server": REVOKED_PER_SERVER, "max": MAX_REVOKED_TOKENS, "full": "refused"}),
        );
    }

    #[tokio::test]
    async fn a_logout_stops_a_source_already_in_use_that_names_the_same_tokens() {
        let tokens = ExternalTokens::new(4);
        let net = NetworkConfig::default();
        // Server b names the same variables as a and is in use before a's logout.
        let b = source(&tokens, &server("b", "c"), &vars("t1", "r1")).unwrap();
        assert_eq!(b.get(false).await.unwrap().expose_secret(), "t1");
        let _ = logout_external_in(&tokens, &server("a", "c"), &net, &vars("t1", "r1")).await;
        // b never sends the revoked access token again, nor presents the revoked refresh token.
        let e = b.get(false).await.err().unwrap();
        assert!(e.contains("revoked by iteron mcp auth logout"), "{e}");
        let e = b.get(true).await.err().unwrap();
        assert!(e.contains("revoked by iteron mcp auth logout"), "{e}");
        // A source in use whose access token is its own but whose refresh token was revoked
        // keeps its access token and drops the refresh token.
        let c = source(&tokens, &server("c", "c"), &vars("t2", "r2")).unwrap();
        assert_eq!(c.get(false).await.unwrap().expose_secret(), "t2");
        let _ = logout_external_in(&tokens, &server("d", "c"), &net, &vars("t9", "r2")).await;
        assert_eq!(c.get(false).await.unwrap().expose_secret(), "t2");
        let e = c.get(true).await.err().unwrap();
        assert!(e.contains("there is no refresh token to renew it"), "{e}");
        iteron_test_support::record!("P16", serde_json::json!({"in_use": "stopped"}),);
    }
}
