//! The MCP client proper: version negotiation, requests with the right envelope and headers,
//! MRTR, pagination, the private list cache and the projection of results to text.
//!
//! Rules this module keeps:
//! - Probe 2026-07-28 first (`server/discover`); fall back to the stateful `initialize` only on
//!   an explicit legacy signal: `-32601` to the probe, a `-32022` whose `supported` lists only
//!   2025 versions, or on HTTP a 4xx whose body is not a recognised modern error. Transport
//!   failures, auth challenges, unknown versions and corrupt discovery results never downgrade.
//! - 2024-11-05 and 2025-03-26 are refused by name when a server negotiates them.
//! - A request whose fate is unknown (`maybe_applied`) is never resent. An effect
//!   (`tools/call`, `resources/read`, `prompts/get`: what the operator approved once) is never
//!   resent at all: on a refused token, a `-32022` or a `-32020` the client fixes what would
//!   make the next request work (a fresh token, the version from `supported`, a re-listed
//!   catalog) and reports the call `not_sent`. The only automatic repeats are of other requests
//!   the server *rejected* before acting: a `-32022` answer (retry with a version from its
//!   `supported` list) and a 401 (one refresh) — both bounded.
//! - MRTR: only `tools/call` may ask for input; each round gets a new id, `requestState` is
//!   echoed untouched and never carried to another request; rounds and input bytes are bounded.
//!   `input_required` on `resources/read` or `prompts/get` is a protocol error.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Map, Value, json};

use iteron_policy::names::ToolName;
use iteron_policy::text;

use super::elicit::{self, Elicitor, FormAnswer, FormRequest};
use super::headers::{self, ParamHeader};
use super::http::{HttpTransport, Post};
use super::jsonrpc::{Certainty, Id, RpcError, codes};
use super::stdio::StdioTransport;
use super::version::{self, REFUSED, Version, VersionPolicy};
use super::{Handler, HandlerFuture, Scrub, TransportError, TransportErrorKind};
use crate::spawn::{ChildSpec, SpawnError};

/// Deadline of an ordinary request.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// Deadline of a tool call.
pub const TOOL_CALL_DEADLINE: Duration = Duration::from_secs(300);
/// Most MRTR rounds in one call.
pub const MAX_MRTR_ROUNDS: usize = 4;
/// Most bytes of input responses in one MRTR round.
pub const MAX_MRTR_INPUT_BYTES: usize = 64 * 1024;
/// Most input requests in one MRTR round.
pub const MAX_MRTR_INPUT_REQUESTS: usize = 4;
/// Most bytes of one listing (all pages).
pub const MAX_LIST_BYTES: usize = 16 * 1024 * 1024;
/// Most bytes held by the private list cache.
pub const MAX_CACHE_BYTES: usize = 16 * 1024 * 1024;
/// Most pages in one listing.
pub const MAX_LIST_PAGES: usize = 64;
/// Most items in one listing.
pub const MAX_LIST_ITEMS: usize = 10_000;
/// Most tools in one server's catalog.
pub const MAX_TOOLS: usize = 1_000;
/// Most entries in the private list cache.
pub const MAX_CACHE_ENTRIES: usize = 256;
/// Most restarts of a stdio server that died, per client.
pub const MAX_RESTARTS: usize = 3;
/// First pause before a restart; it doubles each time.
pub const RESTART_BACKOFF: Duration = Duration::from_millis(200);
/// Longest pause before a restart.
pub const MAX_RESTART_BACKOFF: Duration = Duration::from_secs(5);

/// The one HTTP status whose body a modern probe inspects before falling back to the stateful
/// handshake (400 Bad Request, as the 2026-07-28 versioning rules say). A 404, a 429, a 5xx or
/// an auth challenge is an error, never a reason to downgrade.
const LEGACY_SIGNATURE_STATUS: u16 = 400;

/// Requests that are effects: sent at most once, never repeated by the client.
fn is_effect(method: &str) -> bool {
    matches!(method, "tools/call" | "resources/read" | "prompts/get")
}

/// What is needed to start a stdio server again.
struct Restart {
    spec: ChildSpec,
    handler: Arc<dyn Handler>,
    done: AtomicUsize,
}

/// Most automatic repeats of a rejected request.
const MAX_REJECTION_RETRIES: usize = 2;

const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
const META_CAPS: &str = "io.modelcontextprotocol/clientCapabilities";
const META_INFO: &str = "io.modelcontextprotocol/clientInfo";
const META_SERVER_INFO: &str = "io.modelcontextprotocol/serverInfo";

/// Everything the client can fail with. `Display` is one line, safe to show.
#[derive(Debug, Clone, PartialEq)]
pub enum McpError {
    /// The server process could not be started.
    Spawn(SpawnError),
    /// The transport failed.
    Transport(TransportError),
    /// The server answered with an error.
    Rpc {
        /// The error.
        error: RpcError,
        /// Whether the request was acted on (`not_sent` for validation rejections).
        certainty: Certainty,
    },
    /// The server broke the protocol.
    Protocol {
        /// What was wrong.
        detail: String,
        /// What is known about the effect.
        certainty: Certainty,
    },
    /// The server negotiated a version outside the support matrix.
    UnsupportedVersion(String),
    /// The server and client share no version.
    NoCommonVersion,
    /// A bound was exceeded.
    Limit {
        /// What.
        what: &'static str,
        /// The bound.
        max: usize,
    },
    /// The server needs operator input and none can be given (noninteractive, or refused).
    InputRefused(String),
    /// No such tool in the catalog (or it was dropped as invalid).
    UnknownTool,
    /// A tool call failed after `rounds` of its MRTR rounds had reached the server: whatever
    /// the last failure says, the server already ran the call that far, so it may have been
    /// applied.
    AfterInputRounds {
        /// Rounds the server answered with `input_required` before the failure.
        rounds: usize,
        /// The failure itself.
        error: Box<McpError>,
    },
}

impl McpError {
    /// What is known about the effect of the failed request.
    pub fn certainty(&self) -> Certainty {
        match self {
            McpError::Transport(t) => t.certainty,
            McpError::Rpc { certainty, .. } | McpError::Protocol { certainty, .. } => *certainty,
            McpError::AfterInputRounds { error, .. } => match error.certainty() {
                Certainty::Applied => Certainty::Applied,
                _ => Certainty::MaybeApplied,
            },
            _ => Certainty::NotSent,
        }
    }
}

impl fmt::Display for McpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            McpError::Spawn(e) => e.fmt(f),
            McpError::Transport(e) => e.fmt(f),
            McpError::Rpc { error, .. } => error.fmt(f),
            McpError::Protocol { detail, certainty } => {
                write!(f, "protocol error: {detail}")?;
                if *certainty == Certainty::MaybeApplied {
                    f.write_str(" (the request may have been applied; it was not retried)")?;
                }
                Ok(())
            }
            McpError::UnsupportedVersion(v) => write!(
                f,
                "the server negotiated protocol version {v}, which iteron does not support \
                 (supported: 2025-06-18, 2025-11-25, 2026-07-28)"
            ),
            McpError::NoCommonVersion => {
                f.write_str("the server supports none of 2025-06-18, 2025-11-25, 2026-07-28")
            }
            McpError::Limit { what, max } => {
                write!(f, "the server exceeded a limit: more than {max} {what}")
            }
            McpError::InputRefused(why) => write!(f, "the server asked for operator input: {why}"),
            McpError::UnknownTool => f.write_str("no such tool"),
            McpError::AfterInputRounds { rounds, error } => write!(
                f,
                "{error} (after {rounds} input rounds had reached the server: the call may have been applied)"
            ),
        }
    }
}

impl std::error::Error for McpError {}

impl From<TransportError> for McpError {
    fn from(e: TransportError) -> Self {
        McpError::Transport(e)
    }
}

fn protocol_error(detail: impl Into<String>, certainty: Certainty) -> McpError {
    McpError::Protocol {
        detail: detail.into(),
        certainty,
    }
}

/// An access token to present: as a Bearer token, or DPoP-bound to `dpop` (RFC 9449).
#[derive(Clone)]
pub struct AccessToken {
    /// The token.
    pub token: crate::oauth::SecretString,
    /// The key it is bound to, for a sender-constrained token.
    pub dpop: Option<Arc<crate::oauth::dpop::DpopKey>>,
}

impl AccessToken {
    /// A Bearer token.
    pub fn bearer(token: crate::oauth::SecretString) -> AccessToken {
        AccessToken { token, dpop: None }
    }
}

/// An access token being fetched (or refreshed); the error is an operator-facing line.
pub type TokenFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<AccessToken, String>> + Send + 'a>>;

/// Where an HTTP client's bearer token comes from when it is managed (an OAuth login): the
/// current token (refreshed first when it is about to expire), and a forced refresh after a
/// `401`.
pub trait TokenSource: Send + Sync {
    /// The token to send now.
    fn current(&self) -> TokenFuture<'_>;
    /// A new token after the server refused the current one.
    fn refresh(&self) -> TokenFuture<'_>;
}

/// Client settings.
#[derive(Clone)]
pub struct Options {
    /// How to choose the protocol version.
    pub version: VersionPolicy,
    /// `clientInfo.name`.
    pub name: String,
    /// `clientInfo.version`.
    pub version_string: String,
    /// The operator input seam; `None` (noninteractive) advertises nothing and refuses input.
    pub elicitor: Option<Arc<dyn Elicitor>>,
    /// Identity of the authorization context, for the private list cache (never a secret:
    /// callers pass a digest or a label).
    pub auth_context: String,
    /// Deadline of ordinary requests.
    pub request_deadline: Duration,
    /// Deadline of a tool call.
    pub tool_call_deadline: Duration,
    /// A managed bearer token (HTTP): sent on every request, refreshed on expiry, and on a
    /// `401` refreshed once and the refused request sent again (a `401` is a refusal: nothing
    /// ran) — unless it is an effect, which is reported `not_sent` instead.
    pub token: Option<Arc<dyn TokenSource>>,
    /// Known secret values to redact from everything the server sends (messages and stderr)
    /// before anything reads, cuts or shows it.
    pub scrub: Option<Arc<dyn Scrub>>,
    /// Whether a stdio server that died is started again by the client itself before the next
    /// request. The broker turns this off: its registry starts a new generation instead, so a
    /// call approved for one process never runs on another.
    pub auto_restart: bool,
    /// How long a stdio server may take from its start to a negotiated version. A server that
    /// takes longer is stopped and reported with its last stderr lines and, when confined, the
    /// confinement hint (an outer deadline around the connect would lose both).
    pub start_deadline: Duration,
}

/// The default [`Options::start_deadline`]: within the broker's and the CLI's 30 s connect
/// deadlines, so the start's own report is the one the operator sees.
pub const START_DEADLINE: Duration = Duration::from_secs(20);

impl Default for Options {
    fn default() -> Self {
        Options {
            version: VersionPolicy::Auto,
            name: "iteron".into(),
            version_string: env!("CARGO_PKG_VERSION").into(),
            elicitor: None,
            auth_context: String::new(),
            request_deadline: REQUEST_DEADLINE,
            tool_call_deadline: TOOL_CALL_DEADLINE,
            token: None,
            scrub: None,
            auto_restart: true,
            start_deadline: START_DEADLINE,
        }
    }
}

/// Answers server requests: `ping`, and `elicitation/create` only through an installed elicitor.
struct ServerRequests {
    elicitor: Option<Arc<dyn Elicitor>>,
    scrub: Option<Arc<dyn Scrub>>,
}

async fn ask(elicitor: &Arc<dyn Elicitor>, params: &Value) -> Result<Value, (i64, String)> {
    let schema = params
        .get("requestedSchema")
        .cloned()
        .unwrap_or(Value::Null);
    if params
        .get("mode")
        .and_then(Value::as_str)
        .is_some_and(|m| m != "form")
    {
        return Err((
            codes::INVALID_PARAMS,
            "only form elicitation is supported".into(),
        ));
    }
    elicit::check_form_schema(&schema).map_err(|e| (codes::INVALID_PARAMS, e))?;
    let message = params.get("message").and_then(Value::as_str).unwrap_or("");
    if message.len() > elicit::MAX_MESSAGE_BYTES {
        return Err((codes::INVALID_PARAMS, "the form message is too long".into()));
    }
    let message = message.to_owned();
    let answer = elicitor
        .ask(FormRequest {
            message,
            schema: schema.clone(),
        })
        .await;
    if let FormAnswer::Accept(content) = &answer {
        elicit::check_answers(&schema, content).map_err(|e| (codes::INVALID_PARAMS, e))?;
    }
    Ok(elicit::result_value(&answer))
}

impl Handler for ServerRequests {
    fn scrub(&self, message: &mut Value) {
        if let Some(s) = &self.scrub {
            s.scrub_value(message);
        }
    }

    fn handle(&self, method: &str, params: Value) -> HandlerFuture {
        let elicitor = self.elicitor.clone();
        let method = method.to_owned();
        Box::pin(async move {
            match (method.as_str(), elicitor) {
                ("ping", _) => Ok(json!({})),
                ("elicitation/create", Some(e)) => ask(&e, &params).await,
                _ => Err((
                    codes::METHOD_NOT_FOUND,
                    "not supported by this client".into(),
                )),
            }
        })
    }
}

/// The transport of a connected client.
pub enum Transport {
    /// A child process (boxed: it is much larger than the HTTP variant).
    Stdio(Box<StdioTransport>),
    /// Streamable HTTP.
    Http(HttpTransport),
}

/// The era and version in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Era {
    /// Stateful: negotiated once by `initialize`.
    Legacy(Version),
    /// Stateless: every request carries its version.
    Modern(Version),
}

impl Era {
    /// The version.
    pub fn version(self) -> Version {
        match self {
            Era::Legacy(v) | Era::Modern(v) => v,
        }
    }
}

/// A tool as listed, with its schema kept verbatim (never dereferenced).
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// The name (valid by the MCP grammar).
    pub name: String,
    /// The description, terminal-safe and bounded.
    pub description: String,
    /// The input schema exactly as the server sent it.
    pub input_schema: Value,
    headers: Vec<ParamHeader>,
}

/// A tool dropped from the catalog, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedTool {
    /// The name as sent (terminal-safe).
    pub name: String,
    /// Why.
    pub reason: String,
}

/// A tool call's result, projected to text for the agent.
#[derive(Debug, Clone, PartialEq)]
pub struct Projected {
    /// The text content, joined.
    pub text: String,
    /// Whether the server flagged the result as an error.
    pub is_error: bool,
    /// Notes on what was dropped (images, audio, …).
    pub notes: Vec<String>,
    /// The raw result (for the conformance client and diagnostics).
    pub raw: Value,
}

/// Project a `CallToolResult`/`GetPromptResult`-style content list to text. Text items are
/// kept; embedded text resources are kept; images and audio are dropped with a note.
pub fn project(result: &Value) -> Projected {
    let mut parts = Vec::new();
    let mut notes = Vec::new();
    let items = result
        .get("content")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for item in &items {
        match item.get("type").and_then(Value::as_str) {
            Some("text") => {
                if let Some(t) = item.get("text").and_then(Value::as_str) {
                    parts.push(t.to_owned());
                }
            }
            Some(kind @ ("image" | "audio")) => {
                let mime = item
                    .get("mimeType")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown type");
                notes.push(text::single_line_capped(
                    &format!(
                        "{kind} content ({mime}) dropped: iteron projects results to text only"
                    ),
                    200,
                ));
            }
            Some("resource") => {
                match item
                    .get("resource")
                    .and_then(|r| r.get("text"))
                    .and_then(Value::as_str)
                {
                    Some(t) => parts.push(t.to_owned()),
                    None => notes.push("binary embedded resource dropped".into()),
                }
            }
            Some("resource_link") => {
                let uri = item.get("uri").and_then(Value::as_str).unwrap_or("");
                parts.push(format!(
                    "[resource link: {}]",
                    text::single_line_capped(uri, 300)
                ));
            }
            _ => notes.push("content of an unknown type dropped".into()),
        }
    }
    if parts.is_empty()
        && let Some(s) = result.get("structuredContent")
    {
        parts.push(s.to_string());
    }
    Projected {
        text: parts.join("\n"),
        is_error: result
            .get("isError")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        notes,
        raw: result.clone(),
    }
}

struct CacheEntry {
    key: String,
    value: Value,
    bytes: usize,
    expires: Instant,
}

/// A connected MCP client.
pub struct Client {
    transport: Mutex<Arc<Transport>>,
    /// For stdio: how to start the server again after it died (bounded, with backoff).
    restart: Option<Restart>,
    era: Mutex<Era>,
    next_id: AtomicU64,
    opts: Options,
    http_transport: bool,
    server_info: Mutex<Option<(String, String)>>,
    tools: Mutex<HashMap<String, Tool>>,
    dropped: Mutex<Vec<DroppedTool>>,
    cache: Mutex<VecDeque<CacheEntry>>,
    in_flight: AtomicUsize,
    session_lost: AtomicBool,
    /// Serializes restarts: two requests that both find the server dead start it once.
    revive_lock: tokio::sync::Mutex<()>,
    /// Set while a restart negotiates with the fresh process: a request of that negotiation
    /// that finds the fresh process dead too fails at once instead of waiting for the
    /// restart lock its own caller holds (which would wait out the caller's whole deadline).
    reviving: AtomicBool,
}

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

fn capabilities(opts: &Options, era: Era, _http: bool) -> Value {
    let mut caps = Map::new();
    if opts.elicitor.is_some() {
        // Server requests are routed to the elicitor on every transport (the stdio reader
        // answers them while a call is in flight), so every era advertises forms.
        match era {
            Era::Legacy(Version::V2025_06_18) => {
                caps.insert("elicitation".into(), json!({}));
            }
            _ => {
                caps.insert("elicitation".into(), json!({"form": {}}));
            }
        }
    }
    Value::Object(caps)
}

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
        let t = HttpTransport::new(client, url, fixed_headers, handler);
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
        // A managed token authorizes the handshake too (a DPoP-bound one cannot ride in the
        // fixed headers: each request needs its own proof).
        if http {
            client.install_token(false).await?;
        }
        match (client.opts.version, start) {
            (VersionPolicy::Pin(_), Era::Legacy(v)) => client.initialize(v).await?,
            (VersionPolicy::Pin(_), Era::Modern(_)) => {}
            (VersionPolicy::Auto, _) => client.negotiate().await?,
        }
        client.restart = restart;
        Ok(client)
    }

    fn transport(&self) -> Arc<Transport> {
        match self.transport.lock() {
            Ok(t) => t.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// A stdio server that died is started again before the next request — at most
    /// [`MAX_RESTARTS`] times per client, each after a growing pause — and negotiated afresh.
    /// Requests that were in flight when it died already failed as `maybe_applied`; none is
    /// resent.
    async fn revive(&self) -> Result<(), McpError> {
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

    /// Install the managed token (if any) as the bearer; `refresh` forces a new one.
    async fn install_token(&self, refresh: bool) -> Result<(), McpError> {
        let Some(source) = &self.opts.token else {
            return Ok(());
        };
        let token = if refresh {
            source.refresh().await
        } else {
            source.current().await
        }
        .map_err(|why| {
            McpError::Transport(TransportError {
                kind: TransportErrorKind::Unauthorized {
                    status: 401,
                    detail: text::single_line_capped(&why, 200),
                    challenge: None,
                },
                certainty: Certainty::NotSent,
            })
        })?;
        self.set_access(&token);
        Ok(())
    }

    /// Authorize every later request with this bearer token (HTTP; no effect on stdio).
    pub fn set_bearer(&self, token: Option<&crate::oauth::SecretString>) {
        if let Transport::Http(t) = &*self.transport() {
            t.set_bearer(token);
        }
    }

    /// Authorize every later request with this access token: Bearer, or DPoP-bound with a
    /// fresh proof per request (HTTP; no effect on stdio).
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

    fn set_era(&self, era: Era) {
        if let Ok(mut e) = self.era.lock() {
            *e = era;
        }
    }

    fn record_server_info(&self, info: Option<&Value>) {
        let Some(info) = info else { return };
        let name = info.get("name").and_then(Value::as_str).unwrap_or("");
        let version = info.get("version").and_then(Value::as_str).unwrap_or("");
        if let Ok(mut s) = self.server_info.lock() {
            *s = Some((
                text::single_line_capped(name, 100),
                text::single_line_capped(version, 50),
            ));
        }
    }

    /// Probe 2026-07-28 with `server/discover`; fall back only on an explicit legacy signal.
    async fn negotiate(&self) -> Result<(), McpError> {
        let outcome = self
            .exchange(
                "server/discover",
                Map::new(),
                None,
                self.opts.request_deadline,
                false,
            )
            .await;
        match outcome {
            Ok(result) => {
                let supported: Vec<String> = result
                    .get("supportedVersions")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|v| v.as_str().map(str::to_owned))
                            .collect()
                    })
                    .ok_or_else(|| {
                        protocol_error(
                            "server/discover result has no supportedVersions",
                            Certainty::Applied,
                        )
                    })?;
                self.record_server_info(
                    result
                        .get("_meta")
                        .and_then(|m| m.get(META_SERVER_INFO))
                        .or_else(|| result.get("serverInfo")),
                );
                match version::best_common(&supported) {
                    Some(v) if v.is_modern() => {
                        self.set_era(Era::Modern(v));
                        Ok(())
                    }
                    Some(v) => self.initialize(v).await,
                    None => Err(McpError::NoCommonVersion),
                }
            }
            Err(McpError::Rpc { error, .. }) => {
                let legacy = match error.code {
                    codes::METHOD_NOT_FOUND => true,
                    codes::UNSUPPORTED_VERSION => {
                        // exchange() already retried with any modern version on offer; what
                        // remains is a list of 2025 versions (legacy) or nothing we speak.
                        let supported = supported_list(&error);
                        match version::best_common(&supported) {
                            Some(v) if !v.is_modern() => return self.initialize(v).await,
                            _ => return Err(McpError::NoCommonVersion),
                        }
                    }
                    codes::HEADER_MISMATCH | codes::MISSING_CAPABILITY | codes::INVALID_PARAMS => {
                        false
                    }
                    // On HTTP any other JSON-RPC error to the probe that came with a 400 Bad
                    // Request (e.g. -32000 "Server not initialized", -32600 "Missing session
                    // ID") is the legacy signature the spec names; errors with any other status
                    // (404, 429, a 5xx, a 2xx) are failures, reported as such.
                    _ => self.http_transport && error.http_status == Some(LEGACY_SIGNATURE_STATUS),
                };
                if legacy {
                    self.initialize(Version::LATEST_LEGACY).await
                } else {
                    Err(McpError::Rpc {
                        error,
                        certainty: Certainty::NotSent,
                    })
                }
            }
            Err(McpError::Transport(TransportError {
                kind: TransportErrorKind::Status { status, .. },
                ..
            })) if self.http_transport && status == LEGACY_SIGNATURE_STATUS => {
                self.initialize(Version::LATEST_LEGACY).await
            }
            Err(other) => Err(other),
        }
    }

    /// The stateful handshake.
    async fn initialize(&self, offer: Version) -> Result<(), McpError> {
        let era = Era::Legacy(offer);
        self.set_era(era);
        if let Transport::Http(h) = &*self.transport() {
            h.set_protocol_header(None);
            h.clear_session();
        }
        let params = json!({
            "protocolVersion": offer.as_str(),
            "capabilities": capabilities(&self.opts, era, self.http_transport),
            "clientInfo": {"name": self.opts.name, "version": self.opts.version_string},
        });
        let id = self.fresh_id();
        let result = self
            .raw(
                &id,
                "initialize",
                Some(params),
                HeaderMap::new(),
                self.opts.request_deadline,
                true,
            )
            .await?
            .map_err(|error| McpError::Rpc {
                certainty: if error.is_rejection() {
                    Certainty::NotSent
                } else {
                    Certainty::Applied
                },
                error,
            })?;
        let negotiated = result
            .get("protocolVersion")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                protocol_error(
                    "initialize result has no protocolVersion",
                    Certainty::Applied,
                )
            })?;
        let v = match Version::parse(negotiated) {
            Some(v) if !v.is_modern() => v,
            _ => {
                let shown = if REFUSED.contains(&negotiated) {
                    negotiated.to_owned()
                } else {
                    text::single_line_capped(negotiated, 40)
                };
                return Err(McpError::UnsupportedVersion(shown));
            }
        };
        self.record_server_info(result.get("serverInfo"));
        self.set_era(Era::Legacy(v));
        if let Transport::Http(h) = &*self.transport() {
            h.set_protocol_header(Some(v.as_str()));
        }
        self.notify("notifications/initialized").await?;
        if let Transport::Http(h) = &*self.transport() {
            h.open_listener();
        }
        self.session_lost.store(false, Ordering::SeqCst);
        Ok(())
    }

    fn fresh_id(&self) -> Id {
        Id::from_u64(self.next_id.fetch_add(1, Ordering::SeqCst))
    }

    async fn notify(&self, method: &str) -> Result<(), McpError> {
        match &*self.transport() {
            Transport::Stdio(t) => t.notify(method, None).await.map_err(McpError::from),
            Transport::Http(t) => notify_http(t, method, None).await.map_err(McpError::from),
        }
    }

    /// One request on the wire, no retries.
    async fn raw(
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
    async fn exchange(
        &self,
        method: &str,
        params: Map<String, Value>,
        name: Option<&str>,
        deadline: Duration,
        allow_header_retry: bool,
    ) -> Result<Value, McpError> {
        self.revive().await?;
        self.recover_session().await?;
        self.install_token(false).await?;
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
                    self.install_token(true).await?;
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

    fn cache_get(&self, key: &str) -> Option<Value> {
        let cache = self.cache.lock().ok()?;
        cache
            .iter()
            .find(|e| e.key == key && Instant::now() < e.expires)
            .map(|e| e.value.clone())
    }

    fn cache_put(&self, key: String, value: &Value) {
        // Only the modern era sends caching hints; an absent or non-positive ttlMs means 0.
        let ttl = value.get("ttlMs").and_then(Value::as_f64).unwrap_or(0.0);
        if ttl.is_nan() || ttl <= 0.0 {
            return;
        }
        let ttl = Duration::from_millis(ttl.min(86_400_000.0) as u64);
        let bytes = serde_json::to_vec(value).map_or(usize::MAX, |v| v.len());
        if bytes > MAX_CACHE_BYTES / 4 {
            return;
        }
        if let Ok(mut cache) = self.cache.lock() {
            cache.retain(|e| e.key != key && Instant::now() < e.expires);
            while cache.len() >= MAX_CACHE_ENTRIES
                || cache.iter().map(|e| e.bytes).sum::<usize>() + bytes > MAX_CACHE_BYTES
            {
                if cache.pop_front().is_none() {
                    break;
                }
            }
            cache.push_back(CacheEntry {
                key,
                value: value.clone(),
                bytes,
                expires: Instant::now() + ttl,
            });
        }
    }

    fn list_changed(&self) -> bool {
        match &*self.transport() {
            Transport::Stdio(t) => t.take_list_changed(),
            Transport::Http(t) => t.take_list_changed(),
        }
    }

    /// Every page of a listing, bounded in pages and items, through the private cache.
    async fn list_all(&self, method: &str, field: &str) -> Result<Vec<Value>, McpError> {
        if self.list_changed()
            && let Ok(mut c) = self.cache.lock()
        {
            c.clear();
        }
        let mut items = Vec::new();
        let mut listed_bytes = 0usize;
        let mut cursor: Option<String> = None;
        let mut seen_cursors = std::collections::HashSet::new();
        for _ in 0..MAX_LIST_PAGES {
            let mut params = Map::new();
            if let Some(c) = &cursor {
                params.insert("cursor".into(), c.clone().into());
            }
            let key = format!(
                "{}|{method}|{}|{}",
                self.era().version(),
                cursor.as_deref().unwrap_or(""),
                self.opts.auth_context
            );
            let page = match self.cache_get(&key) {
                Some(v) => v,
                None => {
                    let v = self
                        .exchange(method, params, None, self.opts.request_deadline, false)
                        .await?;
                    self.check_result_type(&v, false)?;
                    self.cache_put(key, &v);
                    v
                }
            };
            let list = page.get(field).and_then(Value::as_array).ok_or_else(|| {
                protocol_error(
                    format!("{method} result has no {field} list"),
                    Certainty::Applied,
                )
            })?;
            listed_bytes += serde_json::to_vec(list).map_or(usize::MAX, |v| v.len());
            if listed_bytes > MAX_LIST_BYTES {
                return Err(McpError::Limit {
                    what: "bytes in one listing",
                    max: MAX_LIST_BYTES,
                });
            }
            if items.len() + list.len() > MAX_LIST_ITEMS {
                return Err(McpError::Limit {
                    what: "items in one listing",
                    max: MAX_LIST_ITEMS,
                });
            }
            items.extend(list.iter().cloned());
            match page.get("nextCursor").and_then(Value::as_str) {
                Some(next) if !next.is_empty() => {
                    if !seen_cursors.insert(next.to_owned()) {
                        return Err(protocol_error(
                            "the server repeated a list cursor",
                            Certainty::Applied,
                        ));
                    }
                    cursor = Some(next.to_owned());
                }
                _ => return Ok(items),
            }
        }
        Err(McpError::Limit {
            what: "pages in one listing",
            max: MAX_LIST_PAGES,
        })
    }

    /// `resultType`: absent is complete; an unknown value is invalid; `input_required` only
    /// where MRTR is allowed.
    fn check_result_type(&self, v: &Value, mrtr_allowed: bool) -> Result<bool, McpError> {
        if !self.era().version().is_modern() {
            return Ok(false);
        }
        match v.get("resultType").and_then(Value::as_str) {
            None | Some("complete") => Ok(false),
            Some("input_required") if mrtr_allowed => Ok(true),
            Some("input_required") => Err(protocol_error(
                "the server asked for input on a request that cannot take it",
                Certainty::Applied,
            )),
            Some(_) => Err(protocol_error(
                "the server sent an unknown resultType",
                Certainty::Applied,
            )),
        }
    }

    /// The tool catalog. Tools with invalid names or invalid header annotations (HTTP, 2026) are
    /// dropped and reported by [`Client::dropped_tools`].
    pub async fn list_tools(&self) -> Result<Vec<Tool>, McpError> {
        let raw = self.list_all("tools/list", "tools").await?;
        if raw.len() > MAX_TOOLS {
            return Err(McpError::Limit {
                what: "tools",
                max: MAX_TOOLS,
            });
        }
        let check_headers = self.http_transport && self.era().version().is_modern();
        let mut tools = Vec::new();
        let mut dropped = Vec::new();
        for t in raw {
            let name = t.get("name").and_then(Value::as_str).unwrap_or("");
            let shown = text::single_line_capped(name, 128);
            if ToolName::parse(name).is_err() {
                dropped.push(DroppedTool {
                    name: shown,
                    reason: "the name is outside the MCP tool-name grammar".into(),
                });
                continue;
            }
            let schema = t.get("inputSchema").cloned().unwrap_or(Value::Null);
            let hdrs = if check_headers {
                match headers::param_headers(&schema) {
                    Ok(h) => h,
                    Err(e) => {
                        dropped.push(DroppedTool {
                            name: shown,
                            reason: format!("invalid x-mcp-header annotation ({e:?})"),
                        });
                        continue;
                    }
                }
            } else {
                Vec::new()
            };
            tools.push(Tool {
                name: name.to_owned(),
                description: text::single_line_capped(
                    t.get("description").and_then(Value::as_str).unwrap_or(""),
                    1024,
                ),
                input_schema: schema,
                headers: hdrs,
            });
        }
        if let Ok(mut map) = self.tools.lock() {
            map.clear();
            for t in &tools {
                map.insert(t.name.clone(), t.clone());
            }
        }
        if let Ok(mut d) = self.dropped.lock() {
            *d = dropped;
        }
        Ok(tools)
    }

    /// Call a tool. MRTR input requests go to the elicitor (if any); the call is never repeated
    /// after an unknown outcome.
    pub async fn call_tool(
        &self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<Projected, McpError> {
        let mut params = Map::new();
        params.insert("name".into(), name.into());
        params.insert("arguments".into(), Value::Object(arguments));
        for round in 0..=MAX_MRTR_ROUNDS {
            // Once a round reached the server, no later failure can say "not sent".
            let after = |error: McpError| {
                if round == 0 {
                    error
                } else {
                    McpError::AfterInputRounds {
                        rounds: round,
                        error: Box::new(error),
                    }
                }
            };
            let result = self
                .exchange(
                    "tools/call",
                    params.clone(),
                    Some(name),
                    self.opts.tool_call_deadline,
                    true,
                )
                .await
                .map_err(after)?;
            if !self.check_result_type(&result, true).map_err(after)? {
                return Ok(project(&result));
            }
            if round == MAX_MRTR_ROUNDS {
                // Never ask the operator for input that could not be sent.
                break;
            }
            // This round's input_required reached us: what fails from here follows a round
            // the server ran.
            let ran = |error: McpError| McpError::AfterInputRounds {
                rounds: round + 1,
                error: Box::new(error),
            };
            let responses = self.answer_input_requests(&result).await.map_err(ran)?;
            // The retry carries exactly this round's answers and state; nothing else.
            params.remove("inputResponses");
            params.remove("requestState");
            if let Some(r) = responses {
                params.insert("inputResponses".into(), r);
            }
            if let Some(state) = result.get("requestState") {
                params.insert("requestState".into(), state.clone());
            }
        }
        Err(McpError::AfterInputRounds {
            rounds: MAX_MRTR_ROUNDS + 1,
            error: Box::new(McpError::Limit {
                what: "input rounds in one tool call",
                max: MAX_MRTR_ROUNDS,
            }),
        })
    }

    async fn answer_input_requests(&self, result: &Value) -> Result<Option<Value>, McpError> {
        let Some(requests) = result.get("inputRequests") else {
            return Ok(None);
        };
        let requests = requests
            .as_object()
            .ok_or_else(|| protocol_error("inputRequests is not an object", Certainty::Applied))?;
        if requests.len() > MAX_MRTR_INPUT_REQUESTS {
            return Err(McpError::Limit {
                what: "input requests in one round",
                max: MAX_MRTR_INPUT_REQUESTS,
            });
        }
        let Some(elicitor) = self.opts.elicitor.clone() else {
            return Err(McpError::InputRefused(
                "this client is noninteractive, so the call fails closed".into(),
            ));
        };
        let mut out = Map::new();
        for (key, req) in requests {
            let method = req.get("method").and_then(Value::as_str).unwrap_or("");
            if method != "elicitation/create" {
                return Err(McpError::InputRefused(format!(
                    "{} requests are not supported",
                    text::single_line_capped(method, 60)
                )));
            }
            let params = req.get("params").cloned().unwrap_or(Value::Null);
            let answer = ask(&elicitor, &params)
                .await
                .map_err(|(_, why)| McpError::InputRefused(why))?;
            out.insert(key.clone(), answer);
        }
        let value = Value::Object(out);
        if serde_json::to_vec(&value).map_or(usize::MAX, |v| v.len()) > MAX_MRTR_INPUT_BYTES {
            return Err(McpError::Limit {
                what: "input bytes in one round",
                max: MAX_MRTR_INPUT_BYTES,
            });
        }
        Ok(Some(value))
    }

    /// Every resource.
    pub async fn list_resources(&self) -> Result<Vec<Value>, McpError> {
        self.list_all("resources/list", "resources").await
    }

    /// Read one resource (no MRTR: `input_required` is a protocol error).
    pub async fn read_resource(&self, uri: &str) -> Result<Value, McpError> {
        let mut params = Map::new();
        params.insert("uri".into(), uri.into());
        let v = self
            .exchange(
                "resources/read",
                params,
                Some(uri),
                self.opts.request_deadline,
                false,
            )
            .await?;
        self.check_result_type(&v, false)?;
        Ok(v)
    }

    /// Every prompt.
    pub async fn list_prompts(&self) -> Result<Vec<Value>, McpError> {
        self.list_all("prompts/list", "prompts").await
    }

    /// Get one prompt (no MRTR).
    pub async fn get_prompt(
        &self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<Value, McpError> {
        let mut params = Map::new();
        params.insert("name".into(), name.into());
        params.insert("arguments".into(), Value::Object(arguments));
        let v = self
            .exchange(
                "prompts/get",
                params,
                Some(name),
                self.opts.request_deadline,
                false,
            )
            .await?;
        self.check_result_type(&v, false)?;
        Ok(v)
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

fn supported_list(error: &RpcError) -> Vec<String> {
    error
        .data
        .as_ref()
        .and_then(|d| d.get("supported"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_projected_to_text_with_notes() {
        let p = project(&json!({"content": [
            {"type": "text", "text": "hello"},
            {"type": "image", "data": "AAAA", "mimeType": "image/png"},
            {"type": "resource", "resource": {"uri": "file:///x", "text": "body"}},
            {"type": "resource_link", "uri": "file:///y", "name": "y"},
            {"type": "audio", "data": "AAAA", "mimeType": "audio/wav"}
        ], "isError": true}));
        assert_eq!(p.text, "hello\nbody\n[resource link: file:///y]");
        assert!(p.is_error);
        assert_eq!(p.notes.len(), 2);
        assert!(p.notes[0].contains("image content (image/png) dropped"));
        let s = project(&json!({"content": [], "structuredContent": {"sum": 3}}));
        assert_eq!(s.text, "{\"sum\":3}");
    }

    #[test]
    fn capabilities_follow_era_transport_and_elicitor() {
        let mut opts = Options::default();
        assert_eq!(
            capabilities(&opts, Era::Modern(Version::V2026_07_28), true),
            json!({})
        );
        opts.elicitor = Some(Arc::new(elicit::AcceptDefaults));
        assert_eq!(
            capabilities(&opts, Era::Modern(Version::V2026_07_28), false),
            json!({"elicitation": {"form": {}}})
        );
        assert_eq!(
            capabilities(&opts, Era::Legacy(Version::V2025_11_25), false),
            json!({"elicitation": {"form": {}}})
        );
        assert_eq!(
            capabilities(&opts, Era::Legacy(Version::V2025_11_25), true),
            json!({"elicitation": {"form": {}}})
        );
        assert_eq!(
            capabilities(&opts, Era::Legacy(Version::V2025_06_18), true),
            json!({"elicitation": {}})
        );
    }
}
