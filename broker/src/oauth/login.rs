//! The operator's login: discovery → registration → the browser → the loopback callback →
//! the code exchange, every request through the zone-bound client of the MCP server.
//!
//! The loopback callback listens on 127.0.0.1 on an ephemeral port until its deadline. It takes
//! exactly one request as the authorization response: a `GET` of exactly `/callback` whose
//! query carries this attempt's `state` (once) and a `code` or an `error`. Every other request
//! — another path (404), another or a missing state, no code (400), an oversized head (431), a
//! connection that sends nothing in time — gets its error page and is ignored, so a stray tab
//! or another local process cannot end the login (only the deadline does). Connections are
//! served concurrently (at most [`MAX_CALLBACK_CONNECTIONS`] at once, each with
//! [`CALLBACK_READ_DEADLINE`]), so a connection that never speaks cannot hold the browser's up.
//!
//! The authorization URL is handed to a browser only when it does not cross into a more
//! privileged zone than the server's binding; otherwise (and with `--no-browser`) it is shown
//! for the operator to open. It carries the `state` and the PKCE challenge, which another local
//! user must not read (with both, they could complete an authorization of their own account
//! with this client and deliver its code to this callback): so it is never put in another
//! process's argument list. The opener is given the path of an [`OpenerPage`] instead — a 0600
//! file in the operator's private home that sends the browser on.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use iteron_policy::url::EndpointUrl;
use iteron_policy::zone::Zone;

use super::flow::{self, Attempt, ClientSettings, Mode, OAuthClient, Tokens};
use super::metadata::{self, ServerMetadata};
use super::{Challenge, OAuthError};
use crate::net::ZoneClient;
use crate::private_fs;

/// How long the callback waits for the browser.
pub const CALLBACK_DEADLINE: Duration = Duration::from_secs(300);
/// Largest request head read by the callback.
pub const MAX_CALLBACK_HEAD: usize = 8 * 1024;
/// Most callback connections served at once; further ones wait in the listen queue.
pub const MAX_CALLBACK_CONNECTIONS: usize = 16;
/// How long one callback connection may take to send its request head.
pub const CALLBACK_READ_DEADLINE: Duration = Duration::from_secs(5);

/// What the operator asked for.
#[derive(Clone)]
pub struct LoginRequest {
    /// The MCP endpoint.
    pub server: EndpointUrl,
    /// A resource the metadata must name exactly.
    pub resource: Option<String>,
    /// The issuer to use (pinned by the operator).
    pub issuer: Option<String>,
    /// Scopes chosen by the operator (login flag), never edited.
    pub operator_scopes: Option<String>,
    /// Scopes from the server configuration.
    pub configured_scopes: Option<String>,
    /// Scopes granted before: an explicit re-login asks for them together with the operator's
    /// (or, without `--scopes`, the discovered) ones.
    pub previous_scopes: Vec<String>,
    /// What the credential this login replaces is bound to (an explicit re-login): the login
    /// stays on that resource and issuer unless `resource` / `issuer` name others.
    pub previous: Option<Previous>,
    /// Registration mode.
    pub mode: Mode,
    /// Client settings (pre-registered id and secret, CIMD URL).
    pub client: ClientSettings,
    /// Ask for DPoP-bound tokens (a new key is made for the login).
    pub dpop: bool,
}

/// The resource and issuer a stored credential is bound to, exactly as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Previous {
    /// The resource of the binding.
    pub resource: String,
    /// The issuer of the binding.
    pub issuer: String,
}

/// A completed login. The tokens are secret.
pub struct LoginOutcome {
    /// The resource bound.
    pub resource: String,
    /// The authorization server's metadata (issuer and endpoints).
    pub server: ServerMetadata,
    /// The client used.
    pub client: OAuthClient,
    /// The scope requested (None: omitted).
    pub requested: Option<String>,
    /// The tokens.
    pub tokens: Tokens,
}

impl LoginOutcome {
    /// A login's outcome from its parts (the resource bound, the metadata of the server that
    /// issued the tokens, the client, the scope asked for).
    pub(crate) fn new(
        resource: String,
        server: ServerMetadata,
        client: OAuthClient,
        requested: Option<String>,
        tokens: Tokens,
    ) -> Self {
        LoginOutcome {
            resource,
            server,
            client,
            requested,
            tokens,
        }
    }
}

/// A bound loopback listener, ready before the browser is sent anywhere.
pub struct Callback {
    listener: TcpListener,
    /// `http://127.0.0.1:<port>/callback`.
    pub redirect_uri: String,
}

const PAGE_RECEIVED: &str =
    "Iteron received the authorization response. You can close this window.\n";
const PAGE_NOT_OURS: &str = "This is not the authorization response Iteron is waiting for (its \
    state does not match, or it carries no code); it was ignored.\n";

/// Write a plain-text answer and close.
async fn answer(stream: &mut TcpStream, status: &str, body: &str) {
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\nCache-Control: no-store\r\nReferrer-Policy: no-referrer\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(reply.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Serve one callback connection: `Some(url)` when it is the authorization response for
/// `state` (answered 200), `None` for anything else (answered with an error page, or dropped
/// when it sends nothing in time).
async fn serve_callback(mut stream: TcpStream, base: String, state: String) -> Option<String> {
    let read = async {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut buf).await.ok()?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
            if head.len() > MAX_CALLBACK_HEAD {
                return Some(Err(()));
            }
        }
        Some(Ok(head))
    };
    let head = match tokio::time::timeout(CALLBACK_READ_DEADLINE, read).await {
        Ok(Some(Ok(head))) => head,
        Ok(Some(Err(()))) => {
            answer(
                &mut stream,
                "431 Request Header Fields Too Large",
                "The request is too large; it was ignored.\n",
            )
            .await;
            return None;
        }
        _ => return None,
    };
    let line = String::from_utf8_lossy(&head);
    let mut parts = line.lines().next().unwrap_or("").split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    if method != "GET" || path != "/callback" {
        answer(&mut stream, "404 Not Found", "Not found.\n").await;
        return None;
    }
    let url = format!("{base}{target}");
    if !flow::answers_state(&state, &url) {
        answer(&mut stream, "400 Bad Request", PAGE_NOT_OURS).await;
        return None;
    }
    answer(&mut stream, "200 OK", PAGE_RECEIVED).await;
    Some(url)
}

impl Callback {
    /// Bind 127.0.0.1 on an ephemeral port.
    pub async fn bind() -> Result<Callback, OAuthError> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|_| OAuthError::Callback("cannot listen on 127.0.0.1"))?;
        let port = listener
            .local_addr()
            .map_err(|_| OAuthError::Callback("cannot listen on 127.0.0.1"))?
            .port();
        Ok(Callback {
            listener,
            redirect_uri: format!("http://127.0.0.1:{port}/callback"),
        })
    }

    /// Wait, until [`CALLBACK_DEADLINE`], for the authorization response to `attempt` and
    /// return its full URL. Everything else that reaches the listener is answered and ignored
    /// (see the module documentation).
    pub async fn wait(self, attempt: &Attempt) -> Result<String, OAuthError> {
        self.wait_for(attempt.state.clone(), CALLBACK_DEADLINE)
            .await
    }

    async fn wait_for(self, state: String, deadline: Duration) -> Result<String, OAuthError> {
        let base = self.redirect_uri.trim_end_matches("/callback").to_owned();
        let work = async {
            let mut tasks = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = self.listener.accept(), if tasks.len() < MAX_CALLBACK_CONNECTIONS => {
                        let (stream, _) = accepted
                            .map_err(|_| OAuthError::Callback("the callback listener failed"))?;
                        tasks.spawn(serve_callback(stream, base.clone(), state.clone()));
                    }
                    Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                        if let Ok(Some(url)) = done {
                            // Dropping the set aborts the connections still being served.
                            return Ok(url);
                        }
                    }
                }
            }
        };
        tokio::time::timeout(deadline, work)
            .await
            .map_err(|_| OAuthError::Callback("no authorization response before the deadline"))?
    }
}

/// The directory, inside the operator's private home, where [`OpenerPage`]s are written.
pub const OPENER_DIR: &str = "login";
/// Prefix of an opener page's file name.
const OPENER_PREFIX: &str = "authorize-";

/// A private page that sends the browser on to an authorization URL: the desktop's opener is
/// given this file's path, never the URL (which carries the `state` and the PKCE challenge,
/// and would be readable by every local user in the opener's and the browser's argument
/// lists). The file is created `O_EXCL`, 0600, in a 0700 directory of the operator's home, and
/// removed when the value is dropped (the login ended); pages a killed login left behind are
/// removed by the next one once they are older than [`CALLBACK_DEADLINE`].
pub struct OpenerPage {
    path: PathBuf,
}

impl OpenerPage {
    /// Write the page for `url` (an authorization URL built by [`flow::start`]) under
    /// `home/`[`OPENER_DIR`].
    pub fn write(home: &Path, url: &str) -> Result<OpenerPage, OAuthError> {
        let dir = home.join(OPENER_DIR);
        let failed = |_| OAuthError::Callback("cannot write the page that opens the browser");
        private_fs::ensure_private_dir(&dir).map_err(failed)?;
        remove_stale_pages(&dir);
        let name = format!("{OPENER_PREFIX}{}.html", flow::random_token(12)?);
        let path = dir.join(name);
        private_fs::write_new_file(&path, opener_html(url).as_bytes()).map_err(failed)?;
        Ok(OpenerPage { path })
    }

    /// The file to hand to the opener.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for OpenerPage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn remove_stale_pages(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let stale = e
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > CALLBACK_DEADLINE);
        if stale && e.file_name().to_string_lossy().starts_with(OPENER_PREFIX) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Escape text for an HTML attribute or element.
fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The page: an immediate refresh to `url` (no script), no referrer, and a link.
fn opener_html(url: &str) -> String {
    let u = html_escape(url);
    format!(
        "<!doctype html>\n<meta charset=\"utf-8\">\n<meta name=\"referrer\" content=\"no-referrer\">\n\
         <meta http-equiv=\"refresh\" content=\"0;url={u}\">\n<title>Iteron login</title>\n\
         <p>Continue to the <a href=\"{u}\" rel=\"noreferrer\">authorization server</a>.</p>\n"
    )
}

/// Split a scope string into unique tokens, keeping order.
fn tokens_of(s: Option<&str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for t in s.unwrap_or("").split([' ', ',']).filter(|t| !t.is_empty()) {
        if !out.iter().any(|x| x == t) {
            out.push(t.to_owned());
        }
    }
    out
}

/// Run the login. `present` receives the authorization URL and whether it may be opened
/// automatically (false when it would cross into a higher zone than `binding`); it returns
/// once the URL has been shown or handed to a browser.
pub async fn login(
    http: &ZoneClient,
    binding: Zone,
    req: &LoginRequest,
    challenge: Option<&Challenge>,
    present: impl Fn(&str, bool),
) -> Result<LoginOutcome, OAuthError> {
    // A pre-registered secret goes only to the issuer the operator pinned — never to whichever
    // authorization server the MCP server happens to name.
    let confidential = req.client.client_secret.is_some() || req.client.client_key.is_some();
    if confidential && req.issuer.is_none() {
        return Err(OAuthError::NoRegistration(
            "a pre-registered client secret needs a pinned issuer (--oauth-issuer)",
        ));
    }
    let prm =
        metadata::discover_resource(http, &req.server, challenge, req.resource.as_deref()).await?;
    // An explicit re-login stays on the resource and the issuer its credential is bound to
    // (compared exactly): a server that now names others does not move the login — the
    // operator does, by naming them. Refused before any authorization server is contacted.
    if let Some(prev) = &req.previous
        && req.resource.is_none()
        && prm.resource != prev.resource
    {
        return Err(OAuthError::Moved {
            what: "resource",
            bound: prev.resource.clone(),
            now: prm.resource.clone(),
            flag: "--oauth-resource",
        });
    }
    let issuer = match (&req.issuer, &req.previous) {
        (Some(pinned), _) => metadata::pinned_issuer(&prm.authorization_servers, pinned)
            .ok_or_else(|| OAuthError::BadEndpoint {
                which: "issuer",
                host: super::host_of(pinned),
                why: "the pinned issuer is not listed by the protected-resource metadata \
                      (issuers are compared exactly as written)"
                    .into(),
            })?,
        (None, Some(prev)) => metadata::pinned_issuer(&prm.authorization_servers, &prev.issuer)
            .ok_or_else(|| OAuthError::Moved {
                what: "authorization server",
                bound: prev.issuer.clone(),
                now: prm.authorization_servers[0].clone(),
                flag: "--oauth-issuer",
            })?,
        (None, None) => prm.authorization_servers[0].clone(),
    };
    let meta = metadata::discover_server(http, &issuer).await?;
    // A confidential pre-registered client whose secret could only go to another origin stops
    // here, before any registration or browser step.
    if confidential && !flow::same_origin_secret(&meta.issuer, &meta.token_endpoint) {
        return Err(OAuthError::BadEndpoint {
            which: "token_endpoint",
            host: super::host_of(meta.token_endpoint.as_str()),
            why: "it is on another origin than the pinned issuer, and a client secret is only \
                  ever sent to the issuer's own origin (scheme, host and port)"
                .into(),
        });
    }
    let callback = Callback::bind().await?;
    let mut client =
        flow::register(http, &meta, &req.mode, &req.client, &callback.redirect_uri).await?;
    // A dynamically registered confidential client's secret is checked likewise, before the
    // operator authorizes.
    flow::ready_client(&meta, &mut client, req.dpop)?;
    // Scope: the operator's choice as given, otherwise the configured, challenged or discovered
    // one — on a re-login, either together with what was granted before.
    // The challenge's scope is the server's word: only RFC 6749 scope tokens in it are taken.
    let challenged = challenge
        .and_then(|c| c.scope.as_deref())
        .map(|s| {
            tokens_of(Some(s))
                .into_iter()
                .filter(|t| iteron_policy::config::Scope::parse(t).is_ok())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|s| !s.is_empty());
    let discovered = flow::choose_scope(
        None,
        req.configured_scopes.as_deref(),
        challenged.as_deref(),
        &prm.scopes_supported,
        &meta.scopes_supported,
    );
    // On a re-login the scopes granted before are always asked for again: a step-up
    // (`--scopes` naming what a 403 asked for) never drops what the login already had. Fewer
    // scopes take a logout first.
    let asked = match &req.operator_scopes {
        Some(s) => tokens_of(Some(s)),
        None => tokens_of(discovered.as_deref()),
    };
    let mut all = req.previous_scopes.clone();
    for t in asked {
        if !all.contains(&t) {
            all.push(t);
        }
    }
    let scope = (!all.is_empty()).then(|| all.join(" "));
    let attempt = flow::start(
        &meta,
        &client,
        &callback.redirect_uri,
        &prm.resource,
        scope.clone(),
    )?;
    let auth_zone = meta
        .authorization_endpoint
        .as_ref()
        .and_then(|e| crate::net::endpoint_zone(e).ok())
        .unwrap_or(Zone::Loopback);
    present(&attempt.url, auth_zone <= binding);
    let returned = callback.wait(&attempt).await?;
    let code = match flow::finish(&attempt, &returned) {
        // Only scopes Iteron discovered get the one retry without scope; the operator's own
        // (login flag or configuration) are never edited. The error counts only in a response
        // that passed the state and iss checks.
        Err(OAuthError::Callback(_))
            if req.operator_scopes.is_none()
                && req.configured_scopes.is_none()
                && scope.is_some()
                && flow::response_error(&attempt, &returned).as_deref()
                    == Some("invalid_scope") =>
        {
            // Discovered scopes the provider rejects: one retry with no scope at all.
            let again = Callback::bind().await?;
            let retry = flow::start(&meta, &client, &again.redirect_uri, &prm.resource, None)?;
            present(&retry.url, auth_zone <= binding);
            let returned = again.wait(&retry).await?;
            let code = flow::finish(&retry, &returned)?;
            let tokens = flow::exchange(http, &meta, &client, &retry, code).await?;
            return Ok(LoginOutcome::new(prm.resource, meta, client, None, tokens));
        }
        other => other?,
    };
    let tokens = flow::exchange(http, &meta, &client, &attempt, code).await?;
    Ok(LoginOutcome::new(prm.resource, meta, client, scope, tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port_of(cb: &Callback) -> u16 {
        cb.redirect_uri
            .trim_start_matches("http://127.0.0.1:")
            .trim_end_matches("/callback")
            .parse()
            .unwrap()
    }

    async fn send(port: u16, raw: String) -> String {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let _ = s.write_all(raw.as_bytes()).await;
        let mut out = String::new();
        let _ = s.read_to_string(&mut out).await;
        out
    }

    fn get(path: &str) -> String {
        format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n")
    }

    #[tokio::test]
    async fn the_callback_takes_one_request_on_its_exact_path() {
        let cb = Callback::bind().await.unwrap();
        let uri = cb.redirect_uri.clone();
        assert!(uri.starts_with("http://127.0.0.1:") && uri.ends_with("/callback"));
        let port = port_of(&cb);
        let waiter = tokio::spawn(cb.wait_for("s".into(), CALLBACK_DEADLINE));
        assert!(
            send(port, get("/favicon.ico"))
                .await
                .starts_with("HTTP/1.1 404")
        );
        assert!(
            send(port, get("/callback?code=c&state=s"))
                .await
                .starts_with("HTTP/1.1 200")
        );
        let got = waiter.await.unwrap().unwrap();
        assert_eq!(
            got,
            format!("http://127.0.0.1:{port}/callback?code=c&state=s")
        );
        // One shot: the listener is gone.
        assert!(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn requests_without_this_state_or_a_code_are_answered_and_ignored_until_the_real_one() {
        let cb = Callback::bind().await.unwrap();
        let port = port_of(&cb);
        let waiter = tokio::spawn(cb.wait_for("st4te".into(), CALLBACK_DEADLINE));
        // Far more strays than connections served at once: none of them ends the wait.
        for i in 0..(3 * MAX_CALLBACK_CONNECTIONS) {
            let path = match i % 6 {
                0 => "/callback?code=c&state=forged".to_owned(),
                1 => "/callback?code=c".to_owned(),
                2 => "/callback?state=st4te".to_owned(),
                3 => "/callback?code=c&state=st4te&state=st4te".to_owned(),
                4 => "/callback?error=access_denied&state=st4tee".to_owned(),
                _ => format!("/other?code=c&state=st4te&n={i}"),
            };
            let reply = send(port, get(&path)).await;
            let want = if i % 6 == 5 {
                "HTTP/1.1 404"
            } else {
                "HTTP/1.1 400"
            };
            assert!(reply.starts_with(want), "{path}: {reply}");
            assert!(!waiter.is_finished(), "{path} ended the wait");
        }
        // An oversized head and a connection that never speaks are ignored too.
        let big = format!(
            "GET /callback?{} HTTP/1.1\r\n",
            "a".repeat(MAX_CALLBACK_HEAD + 10)
        );
        assert!(send(port, big).await.starts_with("HTTP/1.1 431"));
        let _silent = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        assert!(!waiter.is_finished());
        let reply = send(port, get("/callback?code=real&state=st4te")).await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        let got = waiter.await.unwrap().unwrap();
        assert!(got.ends_with("/callback?code=real&state=st4te"), "{got}");
        iteron_test_support::record!(
            "P12",
            serde_json::json!({"strays": 3 * MAX_CALLBACK_CONNECTIONS + 2}),
        );
    }

    #[tokio::test]
    async fn only_the_deadline_ends_a_wait_that_gets_no_answer() {
        let cb = Callback::bind().await.unwrap();
        let port = port_of(&cb);
        let waiter = tokio::spawn(cb.wait_for("s".into(), Duration::from_millis(600)));
        assert!(
            send(port, get("/callback?code=c&state=wrong"))
                .await
                .starts_with("HTTP/1.1 400")
        );
        assert!(matches!(
            waiter.await.unwrap(),
            Err(OAuthError::Callback(
                "no authorization response before the deadline"
            ))
        ));
    }

    #[test]
    fn the_opener_page_is_private_and_carries_the_url_only_in_its_content() {
        use std::os::unix::fs::PermissionsExt;
        let home = std::env::temp_dir().join(format!("iteron-opener-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&home);
        std::fs::create_dir_all(&home).unwrap();
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
        let url = "https://as.example/authorize?state=S3CR3TSTATE&code_challenge=CH&x=<\"'&>";
        let page = OpenerPage::write(&home, url).unwrap();
        let path = page.path().to_path_buf();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(!name.contains("S3CR3TSTATE") && !path.to_string_lossy().contains("state"));
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let dir = std::fs::metadata(home.join(OPENER_DIR)).unwrap();
        assert_eq!(dir.permissions().mode() & 0o777, 0o700);
        let html = std::fs::read_to_string(&path).unwrap();
        assert!(html.contains(
            "url=https://as.example/authorize?state=S3CR3TSTATE&amp;code_challenge=CH&amp;x=&lt;&quot;&#39;&amp;&gt;"
        ), "{html}");
        drop(page);
        assert!(!path.exists(), "the page outlived the login");
        let _ = std::fs::remove_dir_all(&home);
    }

    #[test]
    fn scope_tokens_are_split_and_deduplicated() {
        assert_eq!(tokens_of(Some("a b,a  c")), vec!["a", "b", "c"]);
        assert!(tokens_of(None).is_empty());
    }
}
