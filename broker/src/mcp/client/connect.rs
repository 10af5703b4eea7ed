//! Connecting: starting a stdio server or reaching an HTTP one, a bounded restart of a stdio
//! server that died, the managed token, and closing.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::header::HeaderMap;

use iteron_policy::text;

use super::server_requests::ServerRequests;
use super::{
    AccessToken, Client, DroppedTool, Era, MAX_RESTART_BACKOFF, MAX_RESTARTS, McpError, Options,
    RESTART_BACKOFF, Restart, Transport,
};
use crate::mcp::http::HttpTransport;
use crate::mcp::jsonrpc::Certainty;
use crate::mcp::stdio::StdioTransport;
use crate::mcp::version::{Version, VersionPolicy};
use crate::mcp::{TransportError, TransportErrorKind};
use crate::spawn::ChildSpec;

impl Client {
    /// Start a stdio server and connect to it.
    pub async fn connect_stdio(spec: ChildSpec, opts: Options) -> Result<Client, McpError> {
        let spec_copy = spec.clone();
        let confined = spec.confine.is_some();
        let child = crate::spawn::spawn(spec).await.map_err(McpError::Spawn)?;
        let stderr = child.stderr_handle();
        let opts_scrub = opts.scrub.clone();
        let handler = Arc::new(ServerRequests {
            elicitor: opts.elicitor.clone(),
            scrub: opts.scrub.clone(),
        });
        let restart = Restart {
            spec: spec_copy,
            handler: handler.clone(),
            done: AtomicUsize::new(0),
        };
        let t = StdioTransport::start(child, handler);
        let start_deadline = opts.start_deadline;
        let hint = |reason: &mut String, lines: Vec<String>| {
            if !lines.is_empty() {
                reason.push_str("; its stderr ends: ");
                reason.push_str(&lines.join(" | "));
            }
            if confined {
                reason.push_str(
                    "; the server runs confined (see iteron mcp get: filesystem, network); grant more with sandbox.readable/writable, or web_egress for the network",
                );
            }
        };
        let connecting = Client::connect(Transport::Stdio(Box::new(t)), opts, Some(restart));
        let Ok(connected) = tokio::time::timeout(start_deadline, connecting).await else {
            // The connect future (and with it the child) is dropped: the spawner stops it.
            let mut reason = format!(
                "no answer within {} s of starting",
                start_deadline.as_secs_f64()
            );
            hint(&mut reason, stderr.lines_with(3, opts_scrub.as_deref()));
            return Err(McpError::Transport(TransportError {
                kind: TransportErrorKind::NoStart(reason),
                certainty: Certainty::NotSent,
            }));
        };
        match connected {
            Ok(c) => Ok(c),
            Err(McpError::Transport(TransportError {
                kind: TransportErrorKind::Closed(reason),
                certainty,
            })) => {
                // The server died while starting: its last words say why (a confined server
                // that was denied a file or a socket usually names it).
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut reason = reason;
                hint(&mut reason, stderr.lines_with(3, opts_scrub.as_deref()));
                Err(McpError::Transport(TransportError {
                    kind: TransportErrorKind::Closed(reason),
                    certainty,
                }))
            }
            Err(e) => Err(e),
        }
    }

    /// Connect to a Streamable HTTP endpoint through a zone-bound client.
    pub async fn connect_http(
        client: crate::net::ZoneClient,
        url: iteron_policy::url::EndpointUrl,
        fixed_headers: HeaderMap,
        opts: Options,
    ) -> Result<Client, McpError> {
        let handler = Arc::new(ServerRequests {
            elicitor: opts.elicitor.clone(),
            scrub: opts.scrub.clone(),
        });
        let t = HttpTransport::new(client, url, fixed_headers, handler, opts.token.clone());
        Client::connect(Transport::Http(t), opts, None).await
    }

    async fn connect(
        transport: Transport,
        opts: Options,
        restart: Option<Restart>,
    ) -> Result<Client, McpError> {
        let http = matches!(transport, Transport::Http(_));
        let start = match opts.version {
            VersionPolicy::Pin(v) if v.is_modern() => Era::Modern(v),
            VersionPolicy::Pin(v) => Era::Legacy(v),
            VersionPolicy::Auto => Era::Modern(Version::LATEST),
        };
        // A server is restarted only once it has been negotiated with: one that dies while
        // starting is reported (with its last stderr lines), not started again and again.
        let mut client = Client {
            transport: Mutex::new(Arc::new(transport)),
            restart: None,
            era: Mutex::new(start),
            next_id: AtomicU64::new(1),
            opts,
            http_transport: http,
            server_info: Mutex::new(None),
            tools: Mutex::new(HashMap::new()),
            dropped: Mutex::new(Vec::new()),
            cache: Mutex::new(VecDeque::new()),
            in_flight: AtomicUsize::new(0),
            session_lost: AtomicBool::new(false),
            revive_lock: tokio::sync::Mutex::new(()),
            reviving: AtomicBool::new(false),
        };
        match (client.opts.version, start) {
            (VersionPolicy::Pin(_), Era::Legacy(v)) => client.initialize(v).await?,
            (VersionPolicy::Pin(_), Era::Modern(_)) => {}
            (VersionPolicy::Auto, _) => client.negotiate().await?,
        }
        client.restart = restart;
        Ok(client)
    }

    pub(super) fn transport(&self) -> Arc<Transport> {
        match self.transport.lock() {
            Ok(t) => t.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// A stdio server that died is started again before the next request — at most
    /// [`MAX_RESTARTS`] times per client, each after a growing pause — and negotiated afresh.
    /// Requests that were in flight when it died already failed as `maybe_applied`; none is
    /// resent.
    pub(super) async fn revive(&self) -> Result<(), McpError> {
        if !self.opts.auto_restart
            || self.reviving.load(Ordering::SeqCst)
            || !matches!(&*self.transport(), Transport::Stdio(t) if t.is_closed())
        {
            return Ok(());
        }
        let _one_at_a_time = self.revive_lock.lock().await;
        // Whoever held the lock may have revived it already.
        let closed = matches!(&*self.transport(), Transport::Stdio(t) if t.is_closed());
        let Some(restart) = self.restart.as_ref().filter(|_| closed) else {
            return Ok(());
        };
        let n = restart.done.fetch_add(1, Ordering::SeqCst);
        if n >= MAX_RESTARTS {
            return Err(McpError::Transport(TransportError {
                kind: TransportErrorKind::Closed(format!(
                    "the server exited and was already restarted {MAX_RESTARTS} times"
                )),
                certainty: Certainty::NotSent,
            }));
        }
        let pause = RESTART_BACKOFF
            .saturating_mul(1 << n.min(4))
            .min(MAX_RESTART_BACKOFF);
        tokio::time::sleep(pause).await;
        if let Transport::Stdio(old) = &*self.transport() {
            old.close().await;
        }
        let child = crate::spawn::spawn(restart.spec.clone())
            .await
            .map_err(McpError::Spawn)?;
        let fresh = Arc::new(Transport::Stdio(Box::new(StdioTransport::start(
            child,
            restart.handler.clone(),
        ))));
        if let Ok(mut t) = self.transport.lock() {
            *t = fresh;
        }
        if let Ok(mut c) = self.cache.lock() {
            c.clear();
        }
        // Reset however the negotiation ends, a dropped future included.
        struct Reviving<'a>(&'a AtomicBool);
        impl Drop for Reviving<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        self.reviving.store(true, Ordering::SeqCst);
        let _reviving = Reviving(&self.reviving);
        match self.opts.version {
            VersionPolicy::Pin(v) if !v.is_modern() => self.initialize(v).await,
            VersionPolicy::Pin(v) => {
                self.set_era(Era::Modern(v));
                Ok(())
            }
            VersionPolicy::Auto => Box::pin(self.negotiate()).await,
        }
    }

    /// Restarts performed so far (stdio).
    pub fn restarts(&self) -> usize {
        self.restart
            .as_ref()
            .map_or(0, |r| r.done.load(Ordering::SeqCst).min(MAX_RESTARTS))
    }

    /// After the server refused the managed token: have its source renew it (the transport
    /// asks the source before every request, so the next one carries the new token).
    pub(super) async fn renew_token(&self) -> Result<(), McpError> {
        let Some(source) = &self.opts.token else {
            return Ok(());
        };
        source.refresh().await.map_err(|why| {
            McpError::Transport(TransportError {
                kind: TransportErrorKind::Unauthorized {
                    status: 401,
                    detail: text::single_line_capped(&why, 200),
                    challenge: None,
                },
                certainty: Certainty::NotSent,
            })
        })?;
        Ok(())
    }

    /// Authorize every later request with this bearer token when no token source manages the
    /// authorization (HTTP; no effect on stdio).
    pub fn set_bearer(&self, token: Option<&crate::oauth::SecretString>) {
        if let Transport::Http(t) = &*self.transport() {
            t.set_bearer(token);
        }
    }

    /// Authorize every later request with this access token when no token source manages the
    /// authorization: Bearer, or DPoP-bound with a fresh proof per request (HTTP; no effect on
    /// stdio).
    pub fn set_access(&self, token: &AccessToken) {
        if let Transport::Http(t) = &*self.transport() {
            match &token.dpop {
                Some(key) => t.set_dpop(&token.token, Arc::clone(key)),
                None => t.set_bearer(Some(&token.token)),
            }
        }
    }

    /// The era and version in use.
    pub fn era(&self) -> Era {
        self.era.lock().map_or(Era::Modern(Version::LATEST), |e| *e)
    }

    /// The server's name and version, if it gave them (terminal-safe).
    pub fn server_info(&self) -> Option<(String, String)> {
        self.server_info.lock().ok().and_then(|s| s.clone())
    }

    /// Tools dropped from the catalog at the last listing, and why.
    pub fn dropped_tools(&self) -> Vec<DroppedTool> {
        self.dropped.lock().map(|d| d.clone()).unwrap_or_default()
    }

    /// The last stderr lines of a stdio server (sanitized), for diagnostics.
    pub async fn stderr_tail(&self, lines: usize) -> Vec<String> {
        match &*self.transport() {
            Transport::Stdio(t) => t.stderr_tail(lines).await,
            Transport::Http(_) => Vec::new(),
        }
    }

    /// Close: DELETE the session (stateful HTTP), or stop the child (stdio; returns the rung of
    /// the shutdown ladder that ended it).
    /// Whether the server is gone for good from this client's point of view: a stdio server
    /// whose process closed its end (it exited or was killed). HTTP clients never are.
    pub fn is_closed(&self) -> bool {
        matches!(&*self.transport(), Transport::Stdio(t) if t.is_closed())
    }

    /// Why a closed stdio server's end closed.
    pub fn closed_reason(&self) -> Option<String> {
        match &*self.transport() {
            Transport::Stdio(t) => t.close_reason(),
            Transport::Http(_) => None,
        }
    }

    pub async fn close(&self) -> Option<crate::spawn::Ended> {
        match &*self.transport() {
            Transport::Stdio(t) => Some(t.close().await),
            Transport::Http(t) => {
                t.close().await;
                None
            }
        }
    }
}
