//! The operator's login: discovery → registration → the browser → the loopback callback →
//! the code exchange, every request through the zone-bound client of the MCP server.
//!
//! The loopback callback listens on 127.0.0.1 on an ephemeral port, answers exactly one request
//! on exactly `/callback` (others get 404, a bounded number of times), reads a bounded request
//! head, and gives up at a deadline. The authorization URL is handed to a browser only when it
//! does not cross into a more privileged zone than the server's binding; otherwise (and with
//! `--no-browser`) it is shown for the operator to open.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use iteron_policy::url::EndpointUrl;
use iteron_policy::zone::Zone;

use super::flow::{self, ClientSettings, Mode, OAuthClient, Tokens};
use super::metadata::{self, ServerMetadata};
use super::{Challenge, OAuthError};
use crate::net::ZoneClient;

/// How long the callback waits for the browser.
pub const CALLBACK_DEADLINE: Duration = Duration::from_secs(300);
/// Largest request head read by the callback.
pub const MAX_CALLBACK_HEAD: usize = 8 * 1024;
/// Most stray requests (wrong path) the callback tolerates before giving up.
pub const MAX_STRAY_REQUESTS: usize = 16;

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
    /// Scopes granted before (an explicit re-login unions them with the challenge).
    pub previous_scopes: Vec<String>,
    /// Registration mode.
    pub mode: Mode,
    /// Client settings (pre-registered id and secret, CIMD URL).
    pub client: ClientSettings,
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

/// A bound loopback listener, ready before the browser is sent anywhere.
pub struct Callback {
    listener: TcpListener,
    /// `http://127.0.0.1:<port>/callback`.
    pub redirect_uri: String,
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

    /// Wait for the one redirect to `/callback` and return its full URL.
    pub async fn wait(self) -> Result<String, OAuthError> {
        let base = self.redirect_uri.trim_end_matches("/callback").to_owned();
        let work = async {
            for _ in 0..=MAX_STRAY_REQUESTS {
                let (mut stream, _) = self
                    .listener
                    .accept()
                    .await
                    .map_err(|_| OAuthError::Callback("the callback listener failed"))?;
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = stream
                        .read(&mut buf)
                        .await
                        .map_err(|_| OAuthError::Callback("the browser's request broke off"))?;
                    if n == 0 {
                        break;
                    }
                    head.extend_from_slice(&buf[..n]);
                    if head.len() > MAX_CALLBACK_HEAD {
                        return Err(OAuthError::Callback("the callback request is too large"));
                    }
                }
                let line = String::from_utf8_lossy(&head);
                let mut parts = line.lines().next().unwrap_or("").split(' ');
                let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                let path = target.split('?').next().unwrap_or("");
                if method == "GET" && path == "/callback" {
                    let body =
                        "Iteron received the authorization response. You can close this window.\n";
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(reply.as_bytes()).await;
                    let _ = stream.shutdown().await;
                    return Ok(format!("{base}{target}"));
                }
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    )
                    .await;
            }
            Err(OAuthError::Callback(
                "too many unrelated requests reached the callback",
            ))
        };
        tokio::time::timeout(CALLBACK_DEADLINE, work)
            .await
            .map_err(|_| OAuthError::Callback("no authorization response before the deadline"))?
    }
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
    if req.client.client_secret.is_some() && req.issuer.is_none() {
        return Err(OAuthError::NoRegistration(
            "a pre-registered client secret needs a pinned issuer (--oauth-issuer)",
        ));
    }
    let prm =
        metadata::discover_resource(http, &req.server, challenge, req.resource.as_deref()).await?;
    let issuer = match &req.issuer {
        Some(pinned) => {
            if !prm.authorization_servers.iter().any(|s| s == pinned) {
                return Err(OAuthError::BadEndpoint {
                    which: "issuer",
                    why: "the pinned issuer is not listed by the protected-resource metadata"
                        .into(),
                });
            }
            pinned.clone()
        }
        None => prm.authorization_servers[0].clone(),
    };
    let meta = metadata::discover_server(http, &issuer).await?;
    let callback = Callback::bind().await?;
    let client =
        flow::register(http, &meta, &req.mode, &req.client, &callback.redirect_uri).await?;
    // Scope: the operator's choice is used as given; otherwise the configured, challenged or
    // discovered one — on a re-login, together with what was granted before.
    let discovered = flow::choose_scope(
        None,
        req.configured_scopes.as_deref(),
        challenge.and_then(|c| c.scope.as_deref()),
        &prm.scopes_supported,
        &meta.scopes_supported,
    );
    let scope = match &req.operator_scopes {
        Some(s) => Some(tokens_of(Some(s)).join(" ")),
        None => {
            let mut all = req.previous_scopes.clone();
            for t in tokens_of(discovered.as_deref()) {
                if !all.contains(&t) {
                    all.push(t);
                }
            }
            (!all.is_empty()).then(|| all.join(" "))
        }
    };
    let attempt = flow::start(
        &meta,
        &client,
        &callback.redirect_uri,
        &prm.resource,
        scope.clone(),
    )?;
    let auth_zone =
        crate::servers::endpoint_zone(&meta.authorization_endpoint).unwrap_or(Zone::Loopback);
    present(&attempt.url, auth_zone <= binding);
    let returned = callback.wait().await?;
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
            let returned = again.wait().await?;
            let code = flow::finish(&retry, &returned)?;
            let tokens = flow::exchange(http, &meta, &client, &retry, code).await?;
            return Ok(LoginOutcome {
                resource: prm.resource,
                server: meta,
                client,
                requested: None,
                tokens,
            });
        }
        other => other?,
    };
    let tokens = flow::exchange(http, &meta, &client, &attempt, code).await?;
    Ok(LoginOutcome {
        resource: prm.resource,
        server: meta,
        client,
        requested: scope,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_callback_takes_one_request_on_its_exact_path() {
        let cb = Callback::bind().await.unwrap();
        let uri = cb.redirect_uri.clone();
        assert!(uri.starts_with("http://127.0.0.1:") && uri.ends_with("/callback"));
        let port: u16 = uri
            .trim_start_matches("http://127.0.0.1:")
            .trim_end_matches("/callback")
            .parse()
            .unwrap();
        let waiter = tokio::spawn(cb.wait());
        let send = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        assert!(send("/favicon.ico").await.starts_with("HTTP/1.1 404"));
        assert!(
            send("/callback?code=c&state=s")
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
    async fn an_oversized_callback_request_is_refused() {
        let cb = Callback::bind().await.unwrap();
        let port: u16 = cb
            .redirect_uri
            .trim_start_matches("http://127.0.0.1:")
            .trim_end_matches("/callback")
            .parse()
            .unwrap();
        let waiter = tokio::spawn(cb.wait());
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let big = format!(
            "GET /callback?{} HTTP/1.1\r\n",
            "a".repeat(MAX_CALLBACK_HEAD + 10)
        );
        let _ = s.write_all(big.as_bytes()).await;
        assert!(matches!(
            waiter.await.unwrap(),
            Err(OAuthError::Callback(_))
        ));
    }

    #[test]
    fn scope_tokens_are_split_and_deduplicated() {
        assert_eq!(tokens_of(Some("a b,a  c")), vec!["a", "b", "c"]);
        assert!(tokens_of(None).is_empty());
    }
}
