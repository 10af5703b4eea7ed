//! One request on the wire: its envelope and headers, the bounded repeats of a rejected request,
//! cancellation of an abandoned one, and recovery of a lost session.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Map, Value, json};

use super::negotiate::{capabilities, supported_list};
use super::{
    Client, Era, MAX_REJECTION_RETRIES, META_CAPS, META_INFO, META_VERSION, McpError, Transport,
    is_effect,
};
use crate::mcp::headers;
use crate::mcp::http::{HttpTransport, Post};
use crate::mcp::jsonrpc::{Certainty, Id, RpcError, codes};
use crate::mcp::version::{self, Version};
use crate::mcp::{TransportError, TransportErrorKind};

/// Counts a request as in flight for exactly as long as it lives (also when its future is
/// dropped), so session recovery never waits on a count that cannot come down.
/// Sends `notifications/cancelled` when a request's future is dropped before it completed.
/// Dropping cannot wait, so the notification is sent by a task on the current runtime (best
/// effort, bounded by 5 s).
struct AbandonGuard {
    cancel: Option<(Arc<Transport>, Value)>,
}

impl AbandonGuard {
    fn disarm(&mut self) {
        self.cancel = None;
    }
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if let (Some((transport, params)), Ok(rt)) =
            (self.cancel.take(), tokio::runtime::Handle::try_current())
        {
            rt.spawn(async move { send_cancel(&transport, params).await });
        }
    }
}

/// Post a notification (no answer awaited) on an HTTP transport.
async fn notify_http(
    t: &HttpTransport,
    method: &str,
    params: Option<Value>,
) -> Result<(), TransportError> {
    let body = super::jsonrpc::notification(method, params);
    t.post(Post {
        body: &body,
        awaits: None,
        headers: HeaderMap::new(),
        adopt_session: false,
        effect: false,
    })
    .await
    .map(|_| ())
}

async fn send_cancel(transport: &Transport, params: Value) {
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        match transport {
            Transport::Stdio(t) => t
                .notify("notifications/cancelled", Some(params))
                .await
                .is_ok(),
            Transport::Http(t) => notify_http(t, "notifications/cancelled", Some(params))
                .await
                .is_ok(),
        }
    })
    .await;
}

struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        InFlight(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Client {
    pub(super) fn fresh_id(&self) -> Id {
        Id::from_u64(self.next_id.fetch_add(1, Ordering::SeqCst))
    }

    pub(super) async fn notify(&self, method: &str) -> Result<(), McpError> {
        match &*self.transport() {
            Transport::Stdio(t) => t.notify(method, None).await.map_err(McpError::from),
            Transport::Http(t) => notify_http(t, method, None).await.map_err(McpError::from),
        }
    }

    /// One request on the wire, no retries.
    pub(super) async fn raw(
        &self,
        id: &Id,
        method: &str,
        params: Option<Value>,
        headers: HeaderMap,
        deadline: Duration,
        adopt_session: bool,
    ) -> Result<Result<Value, RpcError>, McpError> {
        let in_flight = InFlight::new(&self.in_flight);
        // If the caller drops this future (an agent that disconnected), the server is told the
        // request was abandoned; a completed request disarms the guard.
        let mut abandon = self.abandon_guard(id);
        let out = match &*self.transport() {
            Transport::Stdio(t) => t.request(id, method, params, deadline).await,
            Transport::Http(t) => {
                let body = super::jsonrpc::request(id, method, params);
                let post = Post {
                    body: &body,
                    awaits: Some(id),
                    headers,
                    adopt_session,
                    effect: super::is_effect(method),
                };
                match tokio::time::timeout(deadline, t.post(post)).await {
                    Err(_) => Err(TransportError {
                        kind: TransportErrorKind::Timeout,
                        certainty: Certainty::MaybeApplied,
                    }),
                    Ok(Ok(Some(outcome))) => Ok(outcome),
                    Ok(Ok(None)) => Err(TransportError {
                        kind: TransportErrorKind::Protocol(
                            "the server accepted a request without answering it".into(),
                        ),
                        certainty: Certainty::MaybeApplied,
                    }),
                    Ok(Err(e)) => Err(e),
                }
            }
        };
        abandon.disarm();
        drop(in_flight);
        if let Err(TransportError {
            kind: TransportErrorKind::SessionLost,
            ..
        }) = &out
        {
            self.session_lost.store(true, Ordering::SeqCst);
        }
        if let Err(TransportError {
            kind: TransportErrorKind::Timeout,
            ..
        }) = &out
        {
            self.cancel(id).await;
        }
        out.map_err(McpError::from)
    }

    /// Tell the server we gave up on a request. In the stateful era and on stdio that is
    /// `notifications/cancelled`; in the modern era on HTTP, dropping the response stream (which
    /// the timeout already did) is the cancellation. Best effort: the outcome stays unknown.
    async fn cancel(&self, id: &Id) {
        if let Some(params) = self.cancel_params(id, "deadline exceeded") {
            send_cancel(&self.transport(), params).await;
        }
    }

    /// The `notifications/cancelled` parameters for `id`, or `None` where closing the response
    /// stream is the cancellation (the modern era on HTTP).
    fn cancel_params(&self, id: &Id, reason: &str) -> Option<Value> {
        let modern_http = self.http_transport && self.era().version().is_modern();
        if modern_http {
            return None;
        }
        let mut params = json!({"requestId": id.to_value(), "reason": reason});
        if let Era::Modern(v) = self.era() {
            params["_meta"] = json!({
                META_VERSION: v.as_str(),
                META_CAPS: capabilities(&self.opts, self.era(), self.http_transport),
                META_INFO: {"name": self.opts.name, "version": self.opts.version_string},
            });
        }
        Some(params)
    }

    fn abandon_guard(&self, id: &Id) -> AbandonGuard {
        AbandonGuard {
            cancel: self
                .cancel_params(id, "the caller went away")
                .map(|params| (self.transport(), params)),
        }
    }

    /// Build params (the 2026 envelope where needed) and headers, send, and repeat only what
    /// the server rejected before acting (bounded).
    pub(super) async fn exchange(
        &self,
        method: &str,
        params: Map<String, Value>,
        name: Option<&str>,
        deadline: Duration,
        allow_header_retry: bool,
    ) -> Result<Value, McpError> {
        self.revive().await?;
        self.recover_session().await?;
        // An effect (an approved call) is sent once: whatever the server answers — a refused
        // token, an unsupported version, a header mismatch — the error is returned (with its
        // certainty) and what would make a new attempt work is fixed for the next request.
        let effect = is_effect(method);
        let mut token_refreshed = false;
        let mut rejections = 0;
        let mut header_retry = allow_header_retry;
        loop {
            let era = self.era();
            let mut p = params.clone();
            let mut headers = HeaderMap::new();
            if let Era::Modern(v) = era {
                let mut meta = p
                    .remove("_meta")
                    .and_then(|m| m.as_object().cloned())
                    .unwrap_or_default();
                meta.insert(META_VERSION.into(), v.as_str().into());
                meta.insert(
                    META_CAPS.into(),
                    capabilities(&self.opts, era, self.http_transport),
                );
                meta.insert(
                    META_INFO.into(),
                    json!({"name": self.opts.name, "version": self.opts.version_string}),
                );
                p.insert("_meta".into(), Value::Object(meta));
                if self.http_transport {
                    self.modern_headers(&mut headers, v, method, name, &params);
                }
            }
            let id = self.fresh_id();
            let send_params = if p.is_empty() {
                None
            } else {
                Some(Value::Object(p))
            };
            let sent = self
                .raw(&id, method, send_params, headers, deadline, false)
                .await;
            let sent = match sent {
                // (A nonce the server keeps refusing is no reason to renew the token: the
                // transport already sent the request once more with the nonce.)
                Err(McpError::Transport(TransportError {
                    kind:
                        TransportErrorKind::Unauthorized {
                            status: 401,
                            challenge,
                            ..
                        },
                    certainty: Certainty::NotSent,
                })) if self.opts.token.is_some()
                    && !token_refreshed
                    && challenge.as_ref().and_then(|c| c.error.as_deref())
                        != Some(crate::oauth::dpop::USE_DPOP_NONCE) =>
                {
                    token_refreshed = true;
                    self.renew_token().await?;
                    if effect {
                        return Err(McpError::Transport(TransportError {
                            kind: TransportErrorKind::Unauthorized {
                                status: 401,
                                detail: "the server refused the token; a fresh one is installed for the next request, and this one was not sent again".into(),
                                challenge: None,
                            },
                            certainty: Certainty::NotSent,
                        }));
                    }
                    continue;
                }
                other => other?,
            };
            match sent {
                Ok(v) => return Ok(v),
                Err(error) => {
                    if let Era::Modern(_) = era
                        && error.code == codes::UNSUPPORTED_VERSION
                        && rejections < MAX_REJECTION_RETRIES
                        && let Some(v) = version::best_common(&supported_list(&error))
                        && v.is_modern()
                    {
                        rejections += 1;
                        self.set_era(Era::Modern(v));
                        if !effect {
                            continue;
                        }
                    }
                    if let Era::Modern(_) = era
                        && error.code == codes::HEADER_MISMATCH
                        && header_retry
                        && method == "tools/call"
                    {
                        header_retry = false;
                        Box::pin(self.list_tools()).await?;
                        if !effect {
                            continue;
                        }
                    }
                    return Err(McpError::Rpc {
                        certainty: if error.is_rejection() {
                            Certainty::NotSent
                        } else {
                            Certainty::Applied
                        },
                        error,
                    });
                }
            }
        }
    }

    fn modern_headers(
        &self,
        headers: &mut HeaderMap,
        v: Version,
        method: &str,
        name: Option<&str>,
        params: &Map<String, Value>,
    ) {
        if let Ok(val) = HeaderValue::from_str(v.as_str()) {
            headers.insert(HeaderName::from_static("mcp-protocol-version"), val);
        }
        if let Ok(val) = HeaderValue::from_str(method) {
            headers.insert(HeaderName::from_static("mcp-method"), val);
        }
        if let Some(n) = name
            && let Ok(val) = HeaderValue::from_str(&headers::encode_value(n))
        {
            headers.insert(HeaderName::from_static("mcp-name"), val);
        }
        if method == "tools/call"
            && let Some(n) = name
            && let Some(args) = params.get("arguments").and_then(Value::as_object)
        {
            let param_headers = self
                .tools
                .lock()
                .ok()
                .and_then(|t| t.get(n).map(|tool| tool.headers.clone()))
                .unwrap_or_default();
            for (k, val) in headers::param_values(&param_headers, args) {
                headers.insert(k, val);
            }
        }
    }

    /// After a lost session (stateful HTTP), start a new one — but only when no request is in
    /// flight whose effect is unknown. The request that met the loss is never resent.
    async fn recover_session(&self) -> Result<(), McpError> {
        if !self.session_lost.load(Ordering::SeqCst) {
            return Ok(());
        }
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return Err(McpError::Transport(TransportError {
                kind: TransportErrorKind::SessionLost,
                certainty: Certainty::NotSent,
            }));
        }
        let offer = self.era().version();
        self.initialize(offer).await
    }
}
