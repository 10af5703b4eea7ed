//! JSON-RPC 2.0 messages as the MCP client sees them, with the effect certainty every request
//! carries.
//!
//! Incoming bytes are untrusted: a message is parsed from a bounded buffer, classified into a
//! closed set (response, request, notification), and anything else is a protocol error. Error
//! texts that come from a server are bounded and made terminal-safe before anyone can show them.

use std::fmt;

use iteron_policy::text;
use serde_json::{Map, Value};

/// Longest server-supplied error message kept, in bytes.
pub const MAX_ERROR_MESSAGE: usize = 300;

/// What is known about whether a request's effect happened (shared with the IPC answers).
pub use crate::ipc::proto::Certainty;

/// A JSON-RPC id. Numbers are kept as their JSON text, so `0`, `1.0` and `"1"` stay distinct.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Id {
    /// A numeric id (canonical JSON text).
    Number(String),
    /// A string id.
    String(String),
}

impl Id {
    /// Our own ids are integers.
    pub fn from_u64(n: u64) -> Id {
        Id::Number(n.to_string())
    }

    /// The JSON value.
    pub fn to_value(&self) -> Value {
        match self {
            Id::Number(n) => serde_json::from_str(n).unwrap_or(Value::Null),
            Id::String(s) => Value::String(s.clone()),
        }
    }

    fn from_value(v: &Value) -> Option<Id> {
        match v {
            Value::Number(n) => Some(Id::Number(n.to_string())),
            Value::String(s) => Some(Id::String(s.clone())),
            _ => None,
        }
    }
}

/// A JSON-RPC error object from a server, sanitized.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcError {
    /// The code.
    pub code: i64,
    /// The message: one terminal-safe line of at most [`MAX_ERROR_MESSAGE`] bytes.
    pub message: String,
    /// `data`, kept for the protocol layer (never shown verbatim).
    pub data: Option<Value>,
    /// The HTTP status it came with, when it came over HTTP with an error status.
    pub http_status: Option<u16>,
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "server error {}: {}", self.code, self.message)
    }
}

impl RpcError {
    /// Parse an error object.
    pub fn from_value(v: &Value) -> Option<RpcError> {
        let obj = v.as_object()?;
        let code = obj.get("code")?.as_i64()?;
        let message = obj.get("message").and_then(Value::as_str).unwrap_or("");
        Some(RpcError {
            code,
            message: text::single_line_capped(message, MAX_ERROR_MESSAGE),
            data: obj.get("data").cloned(),
            http_status: None,
        })
    }

    /// Whether the server refused the request during validation, i.e. before acting on it.
    pub fn is_rejection(&self) -> bool {
        matches!(
            self.code,
            codes::PARSE_ERROR
                | codes::INVALID_REQUEST
                | codes::METHOD_NOT_FOUND
                | codes::INVALID_PARAMS
                | codes::HEADER_MISMATCH
                | codes::MISSING_CAPABILITY
                | codes::UNSUPPORTED_VERSION
        )
    }
}

/// Error codes the client recognizes.
pub mod codes {
    /// Parse error.
    pub const PARSE_ERROR: i64 = -32700;
    /// Invalid request.
    pub const INVALID_REQUEST: i64 = -32600;
    /// Method not found.
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// Invalid params (also a malformed 2026 envelope).
    pub const INVALID_PARAMS: i64 = -32602;
    /// Internal error.
    pub const INTERNAL_ERROR: i64 = -32603;
    /// 2026-07-28: a header disagrees with the body.
    pub const HEADER_MISMATCH: i64 = -32020;
    /// 2026-07-28: a required client capability is missing.
    pub const MISSING_CAPABILITY: i64 = -32021;
    /// 2026-07-28: unsupported protocol version; `data.supported` lists the server's.
    pub const UNSUPPORTED_VERSION: i64 = -32022;
}

/// A message from the server.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// An answer to one of our requests.
    Response {
        /// Our id.
        id: Id,
        /// The result, or the error.
        outcome: Result<Value, RpcError>,
    },
    /// A request from the server (id `0` included).
    Request {
        /// Its id.
        id: Id,
        /// The method.
        method: String,
        /// The params (an object, or null).
        params: Value,
    },
    /// A notification.
    Notification {
        /// The method.
        method: String,
        /// The params.
        params: Value,
    },
}

/// Why a message could not be understood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageError {
    /// Not JSON.
    NotJson,
    /// A batch (arrays were removed from MCP in 2025-06-18).
    Batch,
    /// JSON, but not a JSON-RPC 2.0 message.
    NotJsonRpc(&'static str),
}

impl fmt::Display for MessageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MessageError::NotJson => f.write_str("the server sent something that is not JSON"),
            MessageError::Batch => f.write_str("the server sent a JSON-RPC batch"),
            MessageError::NotJsonRpc(why) => {
                write!(f, "the server sent a malformed message: {why}")
            }
        }
    }
}

impl std::error::Error for MessageError {}

/// Parse one message. Batches are refused: the client never sends one, so no answer may be one.
pub fn parse_incoming(bytes: &[u8]) -> Result<Incoming, MessageError> {
    parse_incoming_with(bytes, &|_| {})
}

/// Parse one message and pass the parsed value through `scrub` before it is classified (so
/// that nothing — an error message cut to its bound included — sees it unscrubbed).
pub fn parse_incoming_with(
    bytes: &[u8],
    scrub: &dyn Fn(&mut Value),
) -> Result<Incoming, MessageError> {
    let mut v: Value = serde_json::from_slice(bytes).map_err(|_| MessageError::NotJson)?;
    scrub(&mut v);
    classify(v)
}

/// Classify an already-parsed value.
pub fn classify(v: Value) -> Result<Incoming, MessageError> {
    let Value::Object(mut obj) = v else {
        return Err(if v.is_array() {
            MessageError::Batch
        } else {
            MessageError::NotJsonRpc("not an object")
        });
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(MessageError::NotJsonRpc("jsonrpc is not \"2.0\""));
    }
    let id = match obj.get("id") {
        None | Some(Value::Null) => None,
        Some(v) => Some(Id::from_value(v).ok_or(MessageError::NotJsonRpc("bad id"))?),
    };
    if let Some(method) = obj.get("method") {
        let method = method
            .as_str()
            .ok_or(MessageError::NotJsonRpc("method is not a string"))?
            .to_owned();
        let params = obj.remove("params").unwrap_or(Value::Null);
        if !(params.is_object() || params.is_null() || params.is_array()) {
            return Err(MessageError::NotJsonRpc("params is not structured"));
        }
        return Ok(match id {
            Some(id) => Incoming::Request { id, method, params },
            None => Incoming::Notification { method, params },
        });
    }
    let id = id.ok_or(MessageError::NotJsonRpc("response without id"))?;
    match (obj.remove("result"), obj.remove("error")) {
        (Some(result), None) => Ok(Incoming::Response {
            id,
            outcome: Ok(result),
        }),
        (None, Some(err)) => Ok(Incoming::Response {
            id,
            outcome: Err(RpcError::from_value(&err)
                .ok_or(MessageError::NotJsonRpc("malformed error object"))?),
        }),
        _ => Err(MessageError::NotJsonRpc(
            "a response needs exactly one of result and error",
        )),
    }
}

/// Serialize a request.
pub fn request(id: &Id, method: &str, params: Option<Value>) -> Value {
    let mut m = Map::new();
    m.insert("jsonrpc".into(), "2.0".into());
    m.insert("id".into(), id.to_value());
    m.insert("method".into(), method.into());
    if let Some(p) = params {
        m.insert("params".into(), p);
    }
    Value::Object(m)
}

/// Serialize a notification.
pub fn notification(method: &str, params: Option<Value>) -> Value {
    let mut m = Map::new();
    m.insert("jsonrpc".into(), "2.0".into());
    m.insert("method".into(), method.into());
    if let Some(p) = params {
        m.insert("params".into(), p);
    }
    Value::Object(m)
}

/// Serialize our answer to a server request.
pub fn response(id: &Id, outcome: Result<Value, (i64, String)>) -> Value {
    let mut m = Map::new();
    m.insert("jsonrpc".into(), "2.0".into());
    m.insert("id".into(), id.to_value());
    match outcome {
        Ok(v) => {
            m.insert("result".into(), v);
        }
        Err((code, message)) => {
            m.insert(
                "error".into(),
                serde_json::json!({"code": code, "message": message}),
            );
        }
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_are_classified() {
        let r = parse_incoming(br#"{"jsonrpc":"2.0","id":7,"result":{"x":1}}"#).unwrap();
        assert_eq!(
            r,
            Incoming::Response {
                id: Id::from_u64(7),
                outcome: Ok(serde_json::json!({"x":1}))
            }
        );
        let r = parse_incoming(
            br#"{"jsonrpc":"2.0","id":0,"method":"sampling/createMessage","params":{}}"#,
        )
        .unwrap();
        assert!(matches!(r, Incoming::Request { id: Id::Number(ref n), .. } if n == "0"));
        let r = parse_incoming(br#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#)
            .unwrap();
        assert!(matches!(r, Incoming::Notification { .. }));
        let r = parse_incoming(br#"{"jsonrpc":"2.0","id":"a","error":{"code":-32022,"message":"no\u001b[31m","data":{"supported":["2026-07-28"]}}}"#).unwrap();
        let Incoming::Response {
            outcome: Err(e), ..
        } = r
        else {
            panic!()
        };
        assert_eq!(e.code, codes::UNSUPPORTED_VERSION);
        assert!(!e.message.contains('\u{1b}'));
        assert!(e.is_rejection());
    }

    #[test]
    fn malformed_messages_are_refused() {
        for bad in [
            &b"not json"[..],
            br#"[{"jsonrpc":"2.0","id":1,"result":{}}]"#,
            br#"{"jsonrpc":"1.0","id":1,"result":{}}"#,
            br#"{"jsonrpc":"2.0","result":{}}"#,
            br#"{"jsonrpc":"2.0","id":1,"result":{},"error":{"code":1,"message":""}}"#,
            br#"{"jsonrpc":"2.0","id":{},"result":{}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":5}"#,
            br#"{"jsonrpc":"2.0","id":1,"error":{"message":"no code"}}"#,
            br#""just a string""#,
        ] {
            assert!(
                parse_incoming(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn ids_keep_their_json_identity() {
        assert_ne!(Id::Number("1".into()), Id::String("1".into()));
        assert_eq!(Id::from_u64(0).to_value(), serde_json::json!(0));
        let req = request(&Id::from_u64(3), "tools/list", None);
        assert_eq!(
            req,
            serde_json::json!({"jsonrpc":"2.0","id":3,"method":"tools/list"})
        );
    }

    proptest! {
        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_incoming(&bytes);
        }

        #[test]
        fn responses_round_trip(n in any::<u32>(), s in ".{0,40}") {
            let id = Id::from_u64(u64::from(n));
            let msg = response(&id, Ok(serde_json::json!({"s": s})));
            let back = classify(msg).unwrap();
            prop_assert_eq!(back, Incoming::Response { id, outcome: Ok(serde_json::json!({"s": s})) });
        }
    }
}
