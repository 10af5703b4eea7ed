//! The Streamable HTTP transport, over the one hardened client of [`crate::net`].
//!
//! Every message is a POST with `Accept: application/json, text/event-stream`; the answer is a
//! JSON body or an SSE stream, read with bounds ([`super::sse`]). Server requests that arrive on
//! a stream are answered with a new POST. In the stateful era the `Mcp-Session-Id` from a
//! successful `initialize` is sent on every later request (never one adopted from an error
//! response), and a stream that ends before the answer is resumed with `GET` +
//! `Last-Event-ID` — only when the server gave event ids, after its `retry` delay, a bounded
//! number of times. An unknown-session reply (400 or 404, JSON or text) is reported as
//! [`TransportErrorKind::SessionLost`]; the caller decides about re-initializing, and no
//! request is ever resent by this layer.
//!
//! A managed token ([`TokenSource`]) is asked for before **every** request that carries it —
//! the POSTs, the standalone `GET` stream and each of its reopenings, a resumption and the
//! session `DELETE` — so its expiry check (renewal first) and a logout's refusal hold for all of
//! them: no request reuses an `Authorization` the source would no longer give.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::Method;
use reqwest::header::{ACCEPT, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;

use iteron_policy::text;
use iteron_policy::url::EndpointUrl;

use super::client::{AccessToken, TokenSource};
use super::jsonrpc::{self, Certainty, Id, Incoming, RpcError};
use super::sse::{SseLimits, SseParser};
use super::{Handler, TransportError, TransportErrorKind};
use crate::net::{NetError, Request, Response, ZoneClient};

/// Largest JSON response body.
pub const MAX_JSON_BODY: usize = 8 * 1024 * 1024;
/// Largest error body read (4xx/5xx).
pub const MAX_ERROR_BODY: usize = 64 * 1024;
/// Most `GET` resumptions of one broken stream.
pub const MAX_RESUMPTIONS: u32 = 3;
/// Reconnect delay when the server gave none.
pub const DEFAULT_RETRY: Duration = Duration::from_millis(1000);
/// Longest reconnect delay honoured.
pub const MAX_RETRY: Duration = Duration::from_secs(10);
/// Most reopenings of the standalone GET stream per session.
pub const LISTENER_REOPENS: u32 = 100;
/// Longest wait, after the handshake, for the server to answer the standalone `GET`.
pub const LISTENER_READY_WAIT: Duration = Duration::from_secs(2);
/// Deadline of one exchange (a tool call may stream for a while).
pub const EXCHANGE_DEADLINE: Duration = Duration::from_secs(300);

const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";

/// A connected Streamable HTTP endpoint.
pub struct HttpTransport {
    inner: Arc<HttpInner>,
    listener: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

struct HttpInner {
    client: ZoneClient,
    url: EndpointUrl,
    /// Configured headers (values from named environment variables, bearer tokens). Secret:
    /// never logged, never shown.
    fixed_headers: HeaderMap,
    session: Mutex<Option<HeaderValue>>,
    protocol: Mutex<Option<String>>,
    /// The `Authorization` set by the caller when no token source manages it (sensitive; never
    /// shown): a Bearer token, or a DPoP-bound token presented with a fresh proof on every
    /// request.
    auth: Mutex<Option<Auth>>,
    /// The managed token, asked for before every request; when set, `auth` is not used.
    token: Option<Arc<dyn TokenSource>>,
    /// The last DPoP nonce the server gave (RFC 9449 §9).
    dpop_nonce: Mutex<Option<String>>,
    list_changed: AtomicBool,
    handler: Arc<dyn Handler>,
    limits: SseLimits,
}

/// How requests are authorized.
#[derive(Clone)]
enum Auth {
    /// `Authorization: Bearer <token>`.
    Bearer(HeaderValue),
    /// `Authorization: DPoP <token>` and a `DPoP` proof per request, bound to the token.
    Dpop {
        header: HeaderValue,
        token: secrecy::SecretString,
        key: Arc<crate::oauth::dpop::DpopKey>,
    },
}

impl Auth {
    /// `Authorization: Bearer <token>`, marked sensitive; `None` when the token cannot be a
    /// header value.
    fn bearer(token: &secrecy::SecretString) -> Option<Auth> {
        use secrecy::ExposeSecret;
        let mut v = HeaderValue::from_str(&format!("Bearer {}", token.expose_secret())).ok()?;
        v.set_sensitive(true);
        Some(Auth::Bearer(v))
    }

    /// `Authorization: DPoP <token>`, marked sensitive, with the key its proofs are made with.
    fn dpop(token: &secrecy::SecretString, key: Arc<crate::oauth::dpop::DpopKey>) -> Option<Auth> {
        use secrecy::ExposeSecret;
        let mut header = HeaderValue::from_str(&format!("DPoP {}", token.expose_secret())).ok()?;
        header.set_sensitive(true);
        Some(Auth::Dpop {
            header,
            token: token.clone(),
            key,
        })
    }

    fn of(token: &AccessToken) -> Option<Auth> {
        match &token.dpop {
            Some(key) => Auth::dpop(&token.token, Arc::clone(key)),
            None => Auth::bearer(&token.token),
        }
    }
}

/// One POST of a JSON-RPC message.
pub struct Post<'a> {
    /// The message.
    pub body: &'a Value,
    /// The id whose answer is awaited (`None` for notifications and responses).
    pub awaits: Option<&'a Id>,
    /// Extra headers (2026-07-28 standard and parameter headers).
    pub headers: HeaderMap,
    /// Whether this message may adopt an `Mcp-Session-Id` (only a successful `initialize`).
    pub adopt_session: bool,
    /// Whether this message is an effect (an approved call): sent once, so a DPoP nonce
    /// challenge is not answered by sending it again (the nonce is kept for the next request).
    pub effect: bool,
}

/// Largest body read (and discarded) in reply to one of our answers or notifications.
const MAX_ACK_BODY: usize = 64 * 1024;

fn network(e: &NetError) -> TransportError {
    let certainty = match e {
        NetError::Timeout { phase } if *phase != "connecting" => Certainty::MaybeApplied,
        // A redirect is an answer: the server had the request (and may have acted on it).
        NetError::Http { .. } | NetError::BodyTooLarge { .. } | NetError::Redirect { .. } => {
            Certainty::MaybeApplied
        }
        _ => Certainty::NotSent,
    };
    TransportError {
        kind: TransportErrorKind::Network(e.to_string()),
        certainty,
    }
}

fn protocol(why: impl Into<String>, certainty: Certainty) -> TransportError {
    TransportError {
        kind: TransportErrorKind::Protocol(why.into()),
        certainty,
    }
}

/// A short, safe summary of a `WWW-Authenticate` challenge: only `error` and `scope`.
fn challenge_summary(headers: &HeaderMap) -> String {
    let Some(v) = headers
        .get(reqwest::header::WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
    else {
        return "no challenge".into();
    };
    let mut parts = Vec::new();
    for key in ["error", "scope"] {
        let needle = format!("{key}=\"");
        if let Some(start) = v.find(&needle) {
            let rest = &v[start + needle.len()..];
            if let Some(end) = rest.find('"') {
                parts.push(format!("{key}={}", &rest[..end]));
            }
        }
    }
    if parts.is_empty() {
        "a bearer challenge".into()
    } else {
        text::single_line_capped(&parts.join(", "), 200)
    }
}

fn is_sse(resp: &Response) -> bool {
    resp.headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.to_ascii_lowercase().starts_with("text/event-stream"))
}

impl HttpTransport {
    /// A transport to `url` through `client` (already bound to the server's zone), sending
    /// `fixed_headers` on every request, and the token of `token` (asked for before each
    /// request) when there is one.
    pub fn new(
        client: ZoneClient,
        url: EndpointUrl,
        fixed_headers: HeaderMap,
        handler: Arc<dyn Handler>,
        token: Option<Arc<dyn TokenSource>>,
    ) -> HttpTransport {
        HttpTransport {
            inner: Arc::new(HttpInner {
                client,
                url,
                fixed_headers,
                session: Mutex::new(None),
                protocol: Mutex::new(None),
                auth: Mutex::new(None),
                token,
                dpop_nonce: Mutex::new(None),
                list_changed: AtomicBool::new(false),
                handler,
                limits: SseLimits::default(),
            }),
            listener: Mutex::new(None),
        }
    }

    /// Send this bearer token on every later request (or none) when no token source manages
    /// the authorization. The value is marked sensitive.
    pub fn set_bearer(&self, token: Option<&secrecy::SecretString>) {
        if let Ok(mut a) = self.inner.auth.lock() {
            *a = token.and_then(Auth::bearer);
        }
    }

    /// Present this DPoP-bound token on every later request (when no token source manages the
    /// authorization), each with a fresh proof of possession of `key` bound to the request's
    /// method and URL and to the token.
    pub fn set_dpop(&self, token: &secrecy::SecretString, key: Arc<crate::oauth::dpop::DpopKey>) {
        if let Some(auth) = Auth::dpop(token, key)
            && let Ok(mut a) = self.inner.auth.lock()
        {
            *a = Some(auth);
        }
    }

    /// See [`HttpInner::set_protocol_header`].
    pub fn set_protocol_header(&self, v: Option<&str>) {
        self.inner.set_protocol_header(v);
    }

    /// Forget the session (after a loss) and stop listening on it.
    pub fn clear_session(&self) {
        self.stop_listener();
        self.inner.clear_session();
    }

    /// Whether a session id is held.
    pub fn has_session(&self) -> bool {
        self.inner.has_session()
    }

    /// Whether the server said a list changed since the last call (and reset the flag).
    pub fn take_list_changed(&self) -> bool {
        self.inner.list_changed.swap(false, Ordering::SeqCst)
    }

    /// POST one message; see [`HttpInner::post`].
    pub async fn post(
        &self,
        post: Post<'_>,
    ) -> Result<Option<Result<Value, RpcError>>, TransportError> {
        self.inner.post(post).await
    }

    /// Stateful era: open the standalone `GET` stream on which servers send requests that
    /// belong to no POST (e.g. an elicitation raised inside a tool handler). A 405 means the
    /// server offers none. The stream is read with the same bounds and handler; it ends with the
    /// session.
    ///
    /// Returns once the server has answered the first `GET` (or refused it, or
    /// [`LISTENER_READY_WAIT`] passed): a server that sends a request on this stream while no
    /// stream is open may drop it (the TypeScript SDK does, without an event store), so the
    /// first call must not reach the server before the stream is there.
    pub async fn open_listener(&self) {
        self.stop_listener();
        let inner = self.inner.clone();
        let (ready, answered) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut ready = Some(ready);
            // Reopened when it ends (servers close idle streams), a bounded number of times,
            // with a pause; a 405 or any non-stream answer ends listening for good. Each
            // opening asks the token source anew: a token at its expiry is renewed first, and
            // one it no longer gives (logged out, nothing to renew it) ends listening.
            for attempt in 0..LISTENER_REOPENS {
                if attempt > 0 {
                    tokio::time::sleep(DEFAULT_RETRY).await;
                }
                let Ok(auth) = inner.credential().await else {
                    return;
                };
                let Ok(mut headers) =
                    inner.base_headers(&Method::GET, &HeaderMap::new(), auth.as_ref())
                else {
                    return;
                };
                headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
                let mut req = Request::new(Method::GET, inner.url.clone());
                req.headers = headers;
                req.timeout = Some(Duration::from_secs(24 * 3600));
                let sent = inner.client.send(req).await;
                // Answered or refused: either way the first call need not wait any longer
                // (dropping the sender on return says the same).
                if let Some(r) = ready.take() {
                    let _ = r.send(());
                }
                let Ok(mut resp) = sent else {
                    return;
                };
                if !(resp.status().is_success() && is_sse(&resp)) {
                    return;
                }
                resp.set_idle_timeout(Duration::from_secs(24 * 3600));
                let _ = inner.read_stream(resp, None).await;
            }
        });
        if let Ok(mut l) = self.listener.lock() {
            *l = Some(task);
        }
        // A slow or silent server costs at most this much; the session works without the
        // stream, only server requests outside a POST may then be lost.
        let _ = tokio::time::timeout(LISTENER_READY_WAIT, answered).await;
    }

    fn stop_listener(&self) {
        if let Ok(mut l) = self.listener.lock()
            && let Some(task) = l.take()
        {
            task.abort();
        }
    }

    /// End a stateful session with `DELETE` (best effort; 405 is fine).
    pub async fn close(&self) {
        self.stop_listener();
        self.inner.close().await;
    }
}

impl Drop for HttpTransport {
    fn drop(&mut self) {
        self.stop_listener();
    }
}

impl HttpInner {
    /// Send `MCP-Protocol-Version: v` on every later request (stateful era, after the
    /// handshake).
    fn set_protocol_header(&self, v: Option<&str>) {
        if let Ok(mut p) = self.protocol.lock() {
            *p = v.map(str::to_owned);
        }
    }

    fn clear_session(&self) {
        if let Ok(mut s) = self.session.lock() {
            *s = None;
        }
    }

    fn has_session(&self) -> bool {
        self.session.lock().is_ok_and(|s| s.is_some())
    }

    /// The authorization of the next request: the token source's current token (renewed first
    /// when it is about to expire), or what the caller set when there is no source. `Err` (one
    /// operator-facing line) when the source has no token to give: the request is not sent.
    async fn credential(&self) -> Result<Option<Auth>, String> {
        let Some(source) = &self.token else {
            return Ok(self.auth.lock().ok().and_then(|a| a.clone()));
        };
        let token = source
            .current()
            .await
            .map_err(|why| text::single_line_capped(&why, 300))?;
        Auth::of(&token)
            .map(Some)
            .ok_or_else(|| "the access token cannot be sent as an HTTP header value".to_owned())
    }

    /// The headers of a `method` request: the configured ones, `auth` (with a fresh DPoP proof
    /// for this method and URL), the session and version, then `extra`. `Err` only when a DPoP
    /// proof cannot be made (nothing is sent then).
    fn base_headers(
        &self,
        method: &Method,
        extra: &HeaderMap,
        auth: Option<&Auth>,
    ) -> Result<HeaderMap, TransportError> {
        let mut h = self.fixed_headers.clone();
        match auth.cloned() {
            Some(Auth::Bearer(v)) => {
                h.insert(reqwest::header::AUTHORIZATION, v);
            }
            Some(Auth::Dpop { header, token, key }) => {
                let nonce = self.dpop_nonce.lock().ok().and_then(|n| n.clone());
                let proof = key
                    .proof(
                        method.as_str(),
                        self.url.as_url(),
                        Some(&token),
                        nonce.as_deref(),
                    )
                    .ok()
                    .and_then(|p| HeaderValue::from_str(&p).ok())
                    .ok_or_else(|| {
                        protocol("a DPoP proof could not be made", Certainty::NotSent)
                    })?;
                h.insert(reqwest::header::AUTHORIZATION, header);
                h.insert(
                    HeaderName::from_static(crate::oauth::dpop::DPOP_HEADER),
                    proof,
                );
            }
            None => {}
        }
        h.insert(
            ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream"),
        );
        if let Ok(s) = self.session.lock()
            && let Some(v) = s.as_ref()
        {
            h.insert(HeaderName::from_static(SESSION_HEADER), v.clone());
        }
        if let Ok(p) = self.protocol.lock()
            && let Some(v) = p.as_ref()
            && let Ok(value) = HeaderValue::from_str(v)
        {
            h.insert(HeaderName::from_static(VERSION_HEADER), value);
        }
        for (k, v) in extra {
            h.insert(k.clone(), v.clone());
        }
        Ok(h)
    }

    /// Keep the DPoP nonce a response offers (RFC 9449 §9), for the next proof.
    fn keep_nonce(&self, resp: &Response) -> Option<String> {
        let n = resp
            .headers()
            .get(crate::oauth::dpop::NONCE_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|n| crate::oauth::dpop::valid_nonce(n))?
            .to_owned();
        if let Ok(mut held) = self.dpop_nonce.lock() {
            *held = Some(n.clone());
        }
        Some(n)
    }

    /// POST one message. Returns the answer to `post.awaits` (a result, or a JSON-RPC error —
    /// also when it came with a 4xx status), or `None` for an accepted notification/response.
    async fn post(
        &self,
        post: Post<'_>,
    ) -> Result<Option<Result<Value, RpcError>>, TransportError> {
        let body = serde_json::to_vec(post.body)
            .map_err(|e| protocol(e.to_string(), Certainty::NotSent))?;
        let mut nonce_retried = false;
        let (resp, sent_session, dpop) = loop {
            let auth = self.credential().await.map_err(|why| TransportError {
                kind: TransportErrorKind::NoCredential(why),
                certainty: Certainty::NotSent,
            })?;
            let dpop = matches!(auth, Some(Auth::Dpop { .. }));
            let mut headers = self.base_headers(&Method::POST, &post.headers, auth.as_ref())?;
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            let sent_session = headers.contains_key(SESSION_HEADER);
            let mut req = Request::new(Method::POST, self.url.clone());
            req.headers = headers;
            req.body = Some(body.clone());
            req.timeout = Some(EXCHANGE_DEADLINE);
            let resp = self.client.send(req).await.map_err(|e| network(&e))?;
            let offered = self.keep_nonce(&resp);
            // RFC 9449 §9: a 401 asking for a (new) nonce refused the request before anything
            // ran; it is sent once more with a new proof carrying that nonce — except an effect,
            // which is sent once whatever the answer: it is refused as not sent, and the next
            // request carries the nonce kept here.
            if resp.status().as_u16() == 401
                && !nonce_retried
                && !post.effect
                && offered.is_some()
                && dpop
                && resp
                    .headers()
                    .get(reqwest::header::WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(crate::oauth::parse_challenge)
                    .is_some_and(|c| c.error.as_deref() == Some(crate::oauth::dpop::USE_DPOP_NONCE))
            {
                nonce_retried = true;
                let _ = resp.body(MAX_ERROR_BODY).await;
                continue;
            }
            break (resp, sent_session, dpop);
        };
        let status = resp.status();
        if status.is_success()
            && post.adopt_session
            && let Some(v) = resp.headers().get(SESSION_HEADER)
            && v.len() <= 256
            && v.to_str()
                .is_ok_and(|s| s.bytes().all(|b| (0x21..=0x7e).contains(&b)))
            && let Ok(mut s) = self.session.lock()
        {
            *s = Some(v.clone());
        }
        if status.as_u16() == 202 {
            return Ok(None);
        }
        if status.is_success() && post.awaits.is_none() {
            // Our notification or answer was taken. Whatever body comes back is read bounded
            // and dropped — never parsed as a stream that could carry further server requests.
            let _ = resp.body(MAX_ACK_BODY).await;
            return Ok(None);
        }
        if status.is_success() {
            if is_sse(&resp) {
                return self.read_stream(resp, post.awaits).await;
            }
            let bytes = resp.body(MAX_JSON_BODY).await.map_err(|e| network(&e))?;
            if bytes.iter().all(u8::is_ascii_whitespace) {
                return match post.awaits {
                    None => Ok(None),
                    Some(_) => Err(protocol("empty response body", Certainty::MaybeApplied)),
                };
            }
            let msg = jsonrpc::parse_incoming_with(&bytes, &|v| self.handler.scrub(v))
                .map_err(|e| protocol(e.to_string(), Certainty::MaybeApplied))?;
            return match (msg, post.awaits) {
                (Incoming::Response { id, outcome }, Some(want)) if &id == want => {
                    Ok(Some(outcome))
                }
                (_, None) => Ok(None),
                _ => Err(protocol(
                    "the JSON response does not answer the request",
                    Certainty::MaybeApplied,
                )),
            };
        }
        // An error status. Read a bounded body and look for a JSON-RPC error in it.
        let code = status.as_u16();
        if code == 401 || code == 403 {
            let challenge = resp
                .headers()
                .get(reqwest::header::WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .and_then(crate::oauth::parse_challenge);
            let detail = if post.effect
                && code == 401
                && dpop
                && challenge.as_ref().and_then(|c| c.error.as_deref())
                    == Some(crate::oauth::dpop::USE_DPOP_NONCE)
            {
                "the server asked for a new DPoP nonce; it is kept for the next request, and this call was not sent again".to_owned()
            } else {
                challenge_summary(resp.headers())
            };
            return Err(TransportError {
                kind: TransportErrorKind::Unauthorized {
                    status: code,
                    detail,
                    challenge,
                },
                certainty: Certainty::NotSent,
            });
        }
        let bytes = resp.body(MAX_ERROR_BODY).await.unwrap_or_default();
        let rpc = jsonrpc::parse_incoming_with(&bytes, &|v| self.handler.scrub(v))
            .ok()
            .and_then(|m| match m {
                Incoming::Response {
                    outcome: Err(mut e),
                    ..
                } => {
                    e.http_status = Some(code);
                    Some(e)
                }
                _ => None,
            });
        let text_body = String::from_utf8_lossy(&bytes).to_ascii_lowercase();
        let session_gone = sent_session
            && (code == 404
                || (code == 400
                    && (text_body.contains("session")
                        || rpc
                            .as_ref()
                            .is_some_and(|e| e.message.to_ascii_lowercase().contains("session")))));
        if session_gone {
            return Err(TransportError {
                kind: TransportErrorKind::SessionLost,
                certainty: Certainty::NotSent,
            });
        }
        match rpc {
            Some(e) => Ok(Some(Err(e))),
            None => Err(TransportError {
                kind: TransportErrorKind::Status {
                    status: code,
                    detail: text::single_line_capped(&String::from_utf8_lossy(&bytes), 120),
                },
                certainty: if status.is_server_error() {
                    Certainty::MaybeApplied
                } else {
                    Certainty::NotSent
                },
            }),
        }
    }

    /// Read an SSE answer stream until the awaited response, answering server requests on the
    /// way, resuming a broken stream with `Last-Event-ID` where the server allows it.
    async fn read_stream(
        &self,
        mut resp: Response,
        awaits: Option<&Id>,
    ) -> Result<Option<Result<Value, RpcError>>, TransportError> {
        let mut parser = SseParser::new(self.limits);
        let mut resumptions = 0;
        loop {
            // A server may stay silent while a tool runs; the exchange deadline still applies.
            resp.set_idle_timeout(EXCHANGE_DEADLINE);
            let mut events = Vec::new();
            let ended = loop {
                match resp.next_chunk().await {
                    Ok(Some(chunk)) => {
                        parser
                            .feed(&chunk, &mut events)
                            .map_err(|e| protocol(e.to_string(), Certainty::MaybeApplied))?;
                        if !events.is_empty() {
                            // Progress: a polling server may close and be resumed again.
                            resumptions = 0;
                        }
                        for ev in events.drain(..) {
                            if ev.event.as_deref().is_some_and(|t| t != "message") {
                                continue;
                            }
                            // Once our request is on the wire, any failure here (including
                            // one while answering a server request) leaves its effect unknown.
                            let handled =
                                self.on_event(&ev.data, awaits).await.map_err(|mut e| {
                                    e.certainty = Certainty::MaybeApplied;
                                    e
                                })?;
                            if let Some(done) = handled {
                                return Ok(Some(done));
                            }
                        }
                    }
                    Ok(None) => break None,
                    Err(e) => break Some(e),
                }
            };
            let _ = parser.finish();
            let Some(want) = awaits else {
                return Ok(None);
            };
            let _ = want;
            // The stream ended (or broke) without our answer.
            let Some(last_id) = parser.last_event_id().map(str::to_owned) else {
                let why = ended.map_or_else(
                    || "the response stream ended without an answer".to_owned(),
                    |e| e.to_string(),
                );
                return Err(TransportError {
                    kind: TransportErrorKind::Closed(why),
                    certainty: Certainty::MaybeApplied,
                });
            };
            if resumptions >= MAX_RESUMPTIONS || !self.has_session_or_legacy() {
                return Err(TransportError {
                    kind: TransportErrorKind::Closed(format!(
                        "the response stream ended without an answer after {resumptions} resumptions"
                    )),
                    certainty: Certainty::MaybeApplied,
                });
            }
            resumptions += 1;
            let wait = parser.retry().unwrap_or(DEFAULT_RETRY).min(MAX_RETRY);
            tokio::time::sleep(wait).await;
            // The request is on the wire: whatever stops the resumption leaves it maybe applied.
            let auth = self.credential().await.map_err(|why| TransportError {
                kind: TransportErrorKind::NoCredential(why),
                certainty: Certainty::MaybeApplied,
            })?;
            let mut headers = self
                .base_headers(&Method::GET, &HeaderMap::new(), auth.as_ref())
                .map_err(|mut e| {
                    e.certainty = Certainty::MaybeApplied;
                    e
                })?;
            headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
            if let Ok(v) = HeaderValue::from_str(&last_id) {
                headers.insert(HeaderName::from_static("last-event-id"), v);
            }
            let mut req = Request::new(Method::GET, self.url.clone());
            req.headers = headers;
            req.timeout = Some(EXCHANGE_DEADLINE);
            let next = self.client.send(req).await.map_err(|e| {
                let mut t = network(&e);
                t.certainty = Certainty::MaybeApplied;
                t
            })?;
            if !next.status().is_success() || !is_sse(&next) {
                return Err(TransportError {
                    kind: TransportErrorKind::Status {
                        status: next.status().as_u16(),
                        detail: "resuming the response stream failed".into(),
                    },
                    certainty: Certainty::MaybeApplied,
                });
            }
            resp = next;
        }
    }

    /// Resumption exists only in the stateful era (the modern era removed it).
    fn has_session_or_legacy(&self) -> bool {
        self.protocol
            .lock()
            .is_ok_and(|p| p.as_deref().is_some_and(|v| v < "2026-07-28"))
    }

    /// Handle one SSE event; `Some` when it is the awaited answer.
    async fn on_event(
        &self,
        data: &str,
        awaits: Option<&Id>,
    ) -> Result<Option<Result<Value, RpcError>>, TransportError> {
        let msg = jsonrpc::parse_incoming_with(data.as_bytes(), &|v| self.handler.scrub(v))
            .map_err(|e| protocol(e.to_string(), Certainty::MaybeApplied))?;
        match msg {
            Incoming::Response { id, outcome } => {
                if awaits == Some(&id) {
                    return Ok(Some(outcome));
                }
                Ok(None)
            }
            Incoming::Notification { method, .. } => {
                if method.ends_with("/list_changed") {
                    self.list_changed.store(true, Ordering::SeqCst);
                }
                Ok(None)
            }
            Incoming::Request { id, method, params } => {
                // The modern era forbids server requests on streams (MRTR replaces them); such a
                // request is ignored rather than answered.
                if !self.has_session_or_legacy() {
                    return Ok(None);
                }
                let answer = self.handler.handle(&method, params).await;
                let reply = jsonrpc::response(&id, answer);
                // The answer travels on its own POST; its own reply is just an acknowledgement.
                let post = Post {
                    body: &reply,
                    awaits: None,
                    headers: HeaderMap::new(),
                    adopt_session: false,
                    effect: false,
                };
                Box::pin(self.post(post)).await.map(|_| None)
            }
        }
    }

    /// End the session with `DELETE`. Without a token the source still gives (a logout revoked
    /// it, or it expired with nothing to renew it) no `DELETE` is sent: the server ends the
    /// session by itself, and a revoked or expired token never goes out.
    async fn close(&self) {
        if !self.has_session() {
            return;
        }
        let mut req = Request::new(Method::DELETE, self.url.clone());
        let Ok(auth) = self.credential().await else {
            self.clear_session();
            return;
        };
        let Ok(headers) = self.base_headers(&Method::DELETE, &HeaderMap::new(), auth.as_ref())
        else {
            self.clear_session();
            return;
        };
        req.headers = headers;
        req.timeout = Some(Duration::from_secs(5));
        let _ = self.client.send(req).await;
        self.clear_session();
    }
}
