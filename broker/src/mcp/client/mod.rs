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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::elicit::Elicitor;
use super::http::HttpTransport;
use super::jsonrpc::{self, Certainty, RpcError};
use super::stdio::StdioTransport;
use super::version::{Version, VersionPolicy};
use super::{Handler, Scrub, TransportError};
use crate::spawn::{ChildSpec, SpawnError};

mod connect;
mod exchange;
mod methods;
mod negotiate;
mod project;
mod server_requests;
#[cfg(test)]
mod tests;

pub use methods::{DroppedTool, Tool};
pub use project::{Projected, project};

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
