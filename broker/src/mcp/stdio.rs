//! The stdio transport: newline-delimited JSON-RPC over a child's stdin/stdout.
//!
//! One reader task owns stdout. It reads lines of at most [`MAX_LINE_BYTES`] (a longer line is
//! a protocol violation that ends the connection — never an unbounded buffer), routes responses
//! to the waiting request by id, answers server requests through the handler, and drops
//! notifications after noting `list_changed`. When the child's stdout ends, every pending
//! request fails with [`Certainty::MaybeApplied`]: the request was written, nobody knows what
//! happened, and nothing is resent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

use super::jsonrpc::{self, Certainty, Id, Incoming, RpcError};
use super::{Handler, TransportError, TransportErrorKind};
use crate::spawn::{ChildProcess, Ended, SHUTDOWN_GRACE};

/// Longest line accepted from a server, in bytes (DESIGN §11).
pub const MAX_LINE_BYTES: usize = 8 * 1024 * 1024;
/// Most server→client requests handled at once; one more ends the connection.
pub const MAX_SERVER_REQUESTS: usize = 8;
/// Longest wait to write one message to a server that stopped reading.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(10);

type Pending = Arc<Mutex<HashMap<Id, oneshot::Sender<Result<Value, RpcError>>>>>;

/// A connected stdio server.
pub struct StdioTransport {
    child: tokio::sync::Mutex<ChildProcess>,
    stdin: Arc<tokio::sync::Mutex<Option<tokio::process::ChildStdin>>>,
    pending: Pending,
    closed: Arc<AtomicBool>,
    close_reason: Arc<Mutex<Option<String>>>,
    list_changed: Arc<AtomicBool>,
}

async fn write_line(
    stdin: &tokio::sync::Mutex<Option<tokio::process::ChildStdin>>,
    msg: &Value,
) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    line.push(b'\n');
    let write = async {
        let mut guard = stdin.lock().await;
        let Some(w) = guard.as_mut() else {
            return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        };
        w.write_all(&line).await?;
        w.flush().await
    };
    tokio::time::timeout(WRITE_DEADLINE, write)
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the server stopped reading its input",
            )
        })?
}

/// Read one line of at most `max` bytes (without the newline). `Ok(None)` at end of stream.
async fn read_line<R: tokio::io::AsyncBufRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> Result<Option<()>, &'static str> {
    buf.clear();
    loop {
        let available = r.fill_buf().await.map_err(|_| "read error")?;
        if available.is_empty() {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err("the server closed stdout in the middle of a line")
            };
        }
        let (take, done) = match memchr::memchr(b'\n', available) {
            Some(i) => (i + 1, true),
            None => (available.len(), false),
        };
        if buf.len() + take > max + 1 {
            return Err("the server sent a line longer than the limit");
        }
        buf.extend_from_slice(&available[..take]);
        r.consume(take);
        if done {
            buf.pop();
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
            return Ok(Some(()));
        }
    }
}

struct PendingGuard<'a> {
    pending: &'a Pending,
    id: &'a Id,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut p) = self.pending.lock() {
            p.remove(self.id);
        }
    }
}

impl StdioTransport {
    /// Take over a spawned child's pipes and start routing its messages.
    pub fn start(mut child: ChildProcess, handler: Arc<dyn Handler>) -> StdioTransport {
        let stdin = Arc::new(tokio::sync::Mutex::new(child.stdin.take()));
        let stdout = child.stdout.take();
        let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
        let closed = Arc::new(AtomicBool::new(false));
        let close_reason = Arc::new(Mutex::new(None));
        let list_changed = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(tokio::sync::Semaphore::new(MAX_SERVER_REQUESTS));
        let t = StdioTransport {
            child: tokio::sync::Mutex::new(child),
            stdin: stdin.clone(),
            pending: pending.clone(),
            closed: closed.clone(),
            close_reason: close_reason.clone(),
            list_changed: list_changed.clone(),
        };
        tokio::spawn(async move {
            let reason = match stdout {
                None => "no stdout".to_owned(),
                Some(out) => {
                    let mut reader = BufReader::with_capacity(64 * 1024, out);
                    let mut buf = Vec::new();
                    loop {
                        match read_line(&mut reader, &mut buf, MAX_LINE_BYTES).await {
                            Ok(None) => break "the server closed stdout".to_owned(),
                            Err(why) => break why.to_owned(),
                            Ok(Some(())) => {}
                        }
                        if buf.iter().all(u8::is_ascii_whitespace) {
                            continue;
                        }
                        match jsonrpc::parse_incoming_with(&buf, &|v| handler.scrub(v)) {
                            Err(e) => break e.to_string(),
                            Ok(Incoming::Response { id, outcome }) => {
                                let waiter = pending.lock().ok().and_then(|mut p| p.remove(&id));
                                if let Some(tx) = waiter {
                                    let _ = tx.send(outcome);
                                }
                                // A response to no request of ours is ignored.
                            }
                            Ok(Incoming::Notification { method, .. }) => {
                                if method.ends_with("/list_changed") {
                                    list_changed.store(true, Ordering::SeqCst);
                                }
                            }
                            Ok(Incoming::Request { id, method, params }) => {
                                // A server may ask several things at once, not without limit.
                                let Ok(permit) = requests.clone().try_acquire_owned() else {
                                    break format!(
                                        "the server sent more than {MAX_SERVER_REQUESTS} concurrent requests"
                                    );
                                };
                                let handler = handler.clone();
                                let stdin = stdin.clone();
                                tokio::spawn(async move {
                                    let _permit = permit;
                                    let answer = handler.handle(&method, params).await;
                                    let msg = jsonrpc::response(&id, answer);
                                    let _ = write_line(&stdin, &msg).await;
                                });
                            }
                        }
                    }
                }
            };
            closed.store(true, Ordering::SeqCst);
            if let Ok(mut r) = close_reason.lock() {
                *r = Some(reason);
            }
            // Waiters see their sender dropped: MaybeApplied.
            if let Ok(mut p) = pending.lock() {
                p.clear();
            }
        });
        t
    }

    /// Why the server's end closed, once it has (terminal-safe).
    pub fn close_reason(&self) -> Option<String> {
        self.close_reason.lock().ok().and_then(|r| r.clone())
    }

    fn closed_error(&self, certainty: Certainty) -> TransportError {
        let reason = self
            .close_reason
            .lock()
            .ok()
            .and_then(|r| r.clone())
            .unwrap_or_else(|| "the server closed the connection".into());
        TransportError {
            kind: TransportErrorKind::Closed(reason),
            certainty,
        }
    }

    /// Send a request and wait for its response (at most `deadline`).
    pub async fn request(
        &self,
        id: &Id,
        method: &str,
        params: Option<Value>,
        deadline: Duration,
    ) -> Result<Result<Value, RpcError>, TransportError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(self.closed_error(Certainty::NotSent));
        }
        let (tx, rx) = oneshot::channel();
        if let Ok(mut p) = self.pending.lock() {
            p.insert(id.clone(), tx);
        }
        // Removes the waiter however this request ends (answer, error, timeout, or the caller
        // dropping the future), so the pending table cannot grow.
        let _waiter = PendingGuard {
            pending: &self.pending,
            id,
        };
        let msg = jsonrpc::request(id, method, params);
        if let Err(e) = write_line(&self.stdin, &msg).await {
            if let Ok(mut p) = self.pending.lock() {
                p.remove(id);
            }
            // A failed write may still have delivered part of the line.
            return Err(TransportError {
                kind: TransportErrorKind::Closed(format!("cannot write to the server: {e}")),
                certainty: Certainty::MaybeApplied,
            });
        }
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(outcome)) => Ok(outcome),
            Ok(Err(_)) => Err(self.closed_error(Certainty::MaybeApplied)),
            Err(_) => {
                if let Ok(mut p) = self.pending.lock() {
                    p.remove(id);
                }
                Err(TransportError {
                    kind: TransportErrorKind::Timeout,
                    certainty: Certainty::MaybeApplied,
                })
            }
        }
    }

    /// Send a notification.
    pub async fn notify(&self, method: &str, params: Option<Value>) -> Result<(), TransportError> {
        write_line(&self.stdin, &jsonrpc::notification(method, params))
            .await
            .map_err(|e| TransportError {
                kind: TransportErrorKind::Closed(format!("cannot write to the server: {e}")),
                certainty: Certainty::MaybeApplied,
            })
    }

    /// Whether the server said a list changed since the last call (and reset the flag).
    pub fn take_list_changed(&self) -> bool {
        self.list_changed.swap(false, Ordering::SeqCst)
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// The child's last stderr lines (sanitized), for diagnostics.
    pub async fn stderr_tail(&self, lines: usize) -> Vec<String> {
        self.child.lock().await.stderr_tail(lines)
    }

    /// Close: stdin EOF, then TERM, then KILL (see [`ChildProcess::shutdown`]).
    pub async fn close(&self) -> Ended {
        // A writer stuck on a server that stopped reading must not keep the child alive: if
        // stdin is busy, the ladder goes on without the EOF rung's help.
        if let Ok(mut stdin) = self.stdin.try_lock() {
            *stdin = None;
        }
        self.child.lock().await.shutdown(SHUTDOWN_GRACE).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_are_bounded_at_the_limit_and_one_over() {
        let max = 16;
        let exact = format!("{}\n", "x".repeat(max));
        let mut r = BufReader::new(exact.as_bytes());
        let mut buf = Vec::new();
        assert_eq!(read_line(&mut r, &mut buf, max).await, Ok(Some(())));
        assert_eq!(buf.len(), max);
        let over = format!("{}\n", "x".repeat(max + 1));
        let mut r = BufReader::new(over.as_bytes());
        assert!(read_line(&mut r, &mut buf, max).await.is_err());
        // An unterminated line longer than the limit fails without waiting for a newline.
        let endless = "y".repeat(max * 4);
        let mut r = BufReader::with_capacity(4, endless.as_bytes());
        assert!(read_line(&mut r, &mut buf, max).await.is_err());
        let mut r = BufReader::new(&b"a\r\nb\n"[..]);
        assert_eq!(read_line(&mut r, &mut buf, max).await, Ok(Some(())));
        assert_eq!(buf, b"a");
        assert_eq!(read_line(&mut r, &mut buf, max).await, Ok(Some(())));
        assert_eq!(read_line(&mut r, &mut buf, max).await, Ok(None));
        iteron_test_support::record!("P5", serde_json::json!({}),);
    }
}
