//! The client side of the IPC channel, for the agent and the operator commands. One request at
//! a time per connection; every answer is checked to carry the request's id.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tokio::net::UnixStream;

use crate::frame::{self, FrameError, MAX_FRAME};
use crate::proto::{self, AgentRequest, Hello, PROTOCOL_VERSION, Reply, Request};

/// How long the client waits for an answer that has started arriving.
const BODY_DEADLINE: Duration = Duration::from_secs(30);

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientError {
    /// The socket could not be reached.
    Connect(std::io::ErrorKind),
    /// The connection failed.
    Frame(FrameError),
    /// The broker closed the connection without answering.
    Closed,
    /// The socket is served by another user than the one who must serve it (the operator's
    /// commands talk only to a broker of their own uid).
    WrongPeer(u32),
    /// The broker's answer was not a valid answer to this request.
    Malformed,
    /// The broker answered with an error.
    Refused {
        /// The code (a wire name; a code this client does not know is kept as sent when it is
        /// plain: 1-32 lowercase letters and `_`; anything else makes the answer malformed).
        code: String,
        /// The reason (single line; re-sanitized here).
        message: String,
        /// For failed effects: whether they may have been applied.
        certainty: Option<String>,
    },
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Connect(kind) => write!(f, "cannot reach the broker socket: {kind}"),
            ClientError::Frame(e) => write!(f, "broker connection: {e}"),
            ClientError::Closed => f.write_str("the broker closed the connection"),
            ClientError::WrongPeer(uid) => write!(
                f,
                "the socket is served by uid {uid}, not by this user: it is not this operator's broker"
            ),
            ClientError::Malformed => f.write_str("the broker sent an answer that is not valid"),
            ClientError::Refused {
                code,
                message,
                certainty,
            } => {
                write!(f, "{code}: {message}")?;
                if let Some(c) = certainty {
                    write!(f, " (effect: {c})")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ClientError {}

/// One connection to a broker socket.
pub struct Connection {
    stream: UnixStream,
    next: u64,
}

impl Connection {
    /// Connect to a socket.
    pub async fn connect(path: &Path) -> Result<Connection, ClientError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|e| ClientError::Connect(e.kind()))?;
        Ok(Connection { stream, next: 1 })
    }

    /// Connect to a broker that must run as `uid` (the operator's own): the peer's credentials,
    /// as the kernel reports them, are checked before anything is sent.
    pub async fn connect_as(path: &Path, uid: u32) -> Result<Connection, ClientError> {
        let c = Connection::connect(path).await?;
        match c.stream.peer_cred() {
            Ok(cred) if cred.uid() == uid => Ok(c),
            Ok(cred) => Err(ClientError::WrongPeer(cred.uid())),
            Err(e) => Err(ClientError::Connect(e.kind())),
        }
    }

    /// Open the session (`hello`) with a client label.
    pub async fn hello(&mut self, client: &str) -> Result<Value, ClientError> {
        self.send(Request::Agent(AgentRequest::Hello(Hello {
            protocol: PROTOCOL_VERSION,
            client: client.to_owned(),
            agent_type: None,
            model: None,
        })))
        .await
    }

    /// Send one typed request and wait for its answer. (`hello` is spelled alike on both
    /// sockets, so [`Connection::hello`] serves both.)
    pub async fn send(&mut self, request: impl Into<Request>) -> Result<Value, ClientError> {
        let id = self.next;
        self.next += 1;
        let frame = request
            .into()
            .frame(id)
            .map_err(|_| ClientError::Malformed)?;
        self.exchange(id, &frame).await
    }

    /// Send raw bytes as one frame (tests and fuzzing).
    pub async fn send_raw(&mut self, body: &[u8]) -> Result<(), ClientError> {
        frame::write_frame(&mut self.stream, body, usize::MAX)
            .await
            .map_err(ClientError::Frame)
    }

    /// Read one frame as JSON (tests and fuzzing). `Ok(None)` when the broker closed.
    pub async fn read_value(&mut self) -> Result<Option<Value>, ClientError> {
        match frame::read_frame(&mut self.stream, MAX_FRAME, BODY_DEADLINE).await {
            Ok(None) => Ok(None),
            Ok(Some(body)) => serde_json::from_slice(&body)
                .map(Some)
                .map_err(|_| ClientError::Malformed),
            Err(FrameError::Io(_)) => Ok(None),
            Err(e) => Err(ClientError::Frame(e)),
        }
    }

    /// Send one request given by method name and parameters, and wait for its answer: for
    /// tests of the wire itself. Clients send typed requests ([`Connection::send`]).
    pub async fn request(&mut self, method: &str, params: Value) -> Result<Value, ClientError> {
        let id = self.next;
        self.next += 1;
        self.exchange(id, &proto::request_frame(id, method, params))
            .await
    }

    async fn exchange(&mut self, id: u64, frame: &Value) -> Result<Value, ClientError> {
        let body = serde_json::to_vec(frame).map_err(|_| ClientError::Malformed)?;
        let written = frame::write_frame(&mut self.stream, &body, MAX_FRAME).await;
        // A broker that refuses the connection (peer check, too many connections) answers and
        // closes at once, so the write may fail: its error frame is still there to read.
        let answer = match self.read_value().await {
            Ok(Some(v)) => v,
            Ok(None) => {
                return Err(written
                    .err()
                    .map_or(ClientError::Closed, ClientError::Frame));
            }
            Err(e) => return Err(written.err().map_or(e, ClientError::Frame)),
        };
        let reply = Reply::parse(&answer).ok_or(ClientError::Malformed)?;
        match reply.outcome {
            Ok(result) if reply.id == Some(id) => Ok(result),
            // A fatal error may carry a null id; any other id is a broken answer.
            Err(e) if reply.id.is_none_or(|a| a == id) => Err(ClientError::Refused {
                code: e.code,
                // The broker's reasons are already rendered: capped and checked again, never
                // escaped a second time (unsafe characters still are).
                message: iteron_policy::text::cap_rendered(&e.message, proto::MAX_REASON),
                certainty: e.certainty,
            }),
            _ => Err(ClientError::Malformed),
        }
    }
}
