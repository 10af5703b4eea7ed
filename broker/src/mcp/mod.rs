//! Iteron's own MCP client: bounded everywhere, and never retrying a call that may already have
//! been applied.
//!
//! Layers, bottom up:
//! - [`jsonrpc`]: messages and the effect certainty every request carries;
//! - [`sse`]: the bounded Server-Sent Events parser;
//! - [`stdio`] and [`http`]: the two transports;
//! - [`client`]: version negotiation (2026-07-28 first, the stateful 2025 handshake only on an
//!   explicit legacy signal), the per-request envelope, MRTR, parameter headers, pagination,
//!   the private list cache and the projection of results to text.
#![forbid(unsafe_code)]

pub mod client;
pub mod elicit;
pub mod headers;
pub mod http;
pub mod jsonrpc;
pub mod sse;
pub mod stdio;
pub mod version;

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use serde_json::Value;

use self::jsonrpc::Certainty;

/// The future a [`Handler`] returns: the result for the server, or a JSON-RPC error.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<Value, (i64, String)>> + Send>>;

/// Answers requests a server sends to the client (`elicitation/create`, `ping`, …).
pub trait Handler: Send + Sync {
    /// Answer one server request.
    fn handle(&self, method: &str, params: Value) -> HandlerFuture;
    /// Clean one message the server sent, right after it is parsed and before anything reads,
    /// cuts or shows any part of it (known secret values are redacted). Nothing by default.
    fn scrub(&self, _message: &mut Value) {}
}

/// Removes known secret values from what a server sends: every string of every message
/// (before it is classified, cut or projected) and every stderr line (before it is cut).
pub trait Scrub: Send + Sync {
    /// Scrub every string of a parsed message, object keys included.
    fn scrub_value(&self, v: &mut Value);
    /// Scrub one line of text.
    fn scrub_text(&self, t: &str) -> String;
}

/// Why a transport could not deliver a request or its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportErrorKind {
    /// The connection is gone (child exited, stream closed, write failed).
    Closed(String),
    /// The answer did not come in time.
    Timeout,
    /// A stdio server did not get through its start in time (what it said, and the hint).
    NoStart(String),
    /// The server broke the protocol (bad framing, bad message, unexpected content type).
    Protocol(String),
    /// The HTTP exchange failed or was refused (zone, redirect, TLS, body cap).
    Network(String),
    /// An HTTP status without a JSON-RPC body.
    Status {
        /// The status code.
        status: u16,
        /// A short, sanitized description.
        detail: String,
    },
    /// The server no longer knows our session (legacy HTTP).
    SessionLost,
    /// The server wants authorization (401), or more scope (403 `insufficient_scope`).
    Unauthorized {
        /// 401 or 403.
        status: u16,
        /// The `WWW-Authenticate` challenge parameters worth showing (error, scope), sanitized.
        detail: String,
        /// The parsed Bearer challenge (no secret in it), for the OAuth layer.
        challenge: Option<crate::oauth::Challenge>,
    },
    /// The managed token could not be had for this request (expired with nothing to renew it,
    /// its renewal failed, revoked by a logout): the request was not sent with it. One
    /// operator-facing line, no secret.
    NoCredential(String),
}

/// A transport failure, with what is known about the request's effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportError {
    /// What failed.
    pub kind: TransportErrorKind,
    /// Whether the request may have been applied.
    pub certainty: Certainty,
}

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            TransportErrorKind::Closed(r) => write!(f, "connection closed: {r}"),
            TransportErrorKind::Timeout => f.write_str("the server did not answer in time"),
            TransportErrorKind::NoStart(r) => f.write_str(r),
            TransportErrorKind::Protocol(r) => write!(f, "protocol error: {r}"),
            TransportErrorKind::Network(r) => f.write_str(r),
            TransportErrorKind::Status { status, detail } => {
                write!(f, "the server answered HTTP {status}: {detail}")
            }
            TransportErrorKind::SessionLost => {
                f.write_str("the server no longer knows the session")
            }
            TransportErrorKind::Unauthorized { status, detail, .. } => {
                write!(
                    f,
                    "the server requires authorization (HTTP {status}): {detail}"
                )
            }
            TransportErrorKind::NoCredential(why) => f.write_str(why),
        }?;
        if self.certainty == Certainty::MaybeApplied {
            f.write_str(" (the request may have been applied; it was not retried)")?;
        }
        Ok(())
    }
}

impl std::error::Error for TransportError {}

/// A handler that refuses every server request: the noninteractive default. Elicitation is not
/// advertised with it, so a server that asks anyway gets "method not found".
pub struct RefuseAll;

impl Handler for RefuseAll {
    fn handle(&self, method: &str, _params: Value) -> HandlerFuture {
        let answer = if method == "ping" {
            Ok(Value::Object(serde_json::Map::new()))
        } else {
            Err((
                jsonrpc::codes::METHOD_NOT_FOUND,
                "not supported by this client".to_owned(),
            ))
        };
        Box::pin(async move { answer })
    }
}
