//! What waits for the operator: tool calls to approve or deny, and forms (elicitation) to
//! answer. Both reach the operator only through the operator socket, never through anything
//! the agent sends, and both fail closed: a noninteractive broker refuses at once; otherwise
//! an unanswered item is refused when its deadline passes, and one whose requester went away
//! (the agent disconnected, the call was cancelled) disappears from the list.
//!
//! Deferred approval (opt-in, `approvals.deferred_secs` in the operator's configuration): a
//! noninteractive broker parks a call no rule approved, for that long, instead of refusing it at
//! once. A parked call is approved only by its id *and* its argument digest, so an operator-side
//! automation approves exactly the arguments it checked (a digest that does not match decides
//! nothing).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde_json::{Map, Value, json};
use tokio::sync::oneshot;

use crate::mcp::elicit::{self, Elicitor, FormAnswer, FormRequest};
use iteron_policy::text;

/// Most items waiting at once; beyond it a request is refused (nothing is queued unboundedly).
pub const MAX_PENDING: usize = 64;
/// Most forms waiting at once (within [`MAX_PENDING`]).
pub const MAX_PENDING_FORMS: usize = 8;
/// How long an item waits for the operator by default.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(120);
/// The longest argument preview shown to the operator.
pub const MAX_PREVIEW: usize = 4096;
/// Most bytes of a call's canonical arguments in one `show` answer. Written as a JSON string,
/// that text at most doubles (it holds no raw control character; `"` and `\` become two
/// bytes), so a chunk stays well inside the 1 MiB frame; longer arguments take several answers.
pub const SHOW_CHUNK: usize = 256 * 1024;

/// Why nothing was approved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotApproved {
    /// The broker has no operator channel.
    Noninteractive,
    /// The operator denied it.
    Denied,
    /// Nobody answered in time.
    TimedOut,
    /// Too many items are waiting.
    Full,
    /// The broker is stopping.
    ShuttingDown,
}

/// What became of one `decide`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decided {
    /// The call was approved or denied.
    Done,
    /// No such call is waiting.
    NotWaiting,
    /// The call is parked (deferred approval): approving it needs its argument digest.
    DigestRequired,
    /// The digest given is not the call's: nothing was decided.
    DigestMismatch,
}

impl Decided {
    /// The audit outcome of the operator's `decide`.
    pub fn outcome(self) -> crate::audit::Outcome {
        use crate::audit::Outcome;
        match self {
            Decided::Done => Outcome::Ok,
            Decided::NotWaiting => Outcome::NotFound,
            Decided::DigestRequired => Outcome::DigestRequired,
            Decided::DigestMismatch => Outcome::DigestMismatch,
        }
    }
}

/// Why a form answer was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnswerError {
    /// No such form is waiting.
    NotWaiting,
    /// The content does not fit the form's schema (the form stays waiting).
    Invalid(String),
}

/// A call waiting for approval, as the operator sees it.
#[derive(Debug, Clone)]
pub struct CallInfo {
    /// Session id.
    pub session: String,
    /// The agent's uid and pid.
    pub peer_uid: u32,
    /// The agent's pid.
    pub peer_pid: Option<i32>,
    /// Configured server.
    pub server: String,
    /// Exposed tool.
    pub tool: String,
    /// SHA-256 of the canonical arguments (as audited).
    pub args_sha256: String,
    /// The arguments: the whole canonical JSON and the operator's preview of it.
    pub arguments: Arguments,
}

impl CallInfo {
    /// The call as the operator's listings show it: the fields of `head`, then who asks for
    /// what (session, peer, server, tool, digest), then the fields of `tail`, in that order.
    fn described(&self, head: Value, tail: Value) -> Value {
        let caller = json!({
            "session": self.session,
            "peer_uid": self.peer_uid,
            "peer_pid": self.peer_pid,
            "server": self.server,
            "tool": self.tool,
            "args_sha256": self.args_sha256,
        });
        let mut out = serde_json::Map::new();
        for part in [head, caller, tail] {
            if let Value::Object(m) = part {
                out.extend(m);
            }
        }
        Value::Object(out)
    }
}

/// A call's arguments as the operator sees them: the whole canonical JSON (keys sorted, no
/// whitespace: the text whose SHA-256 is audited), and a preview of it that is terminal-safe,
/// not redacted (the operator decides on what will be sent) and capped at [`MAX_PREVIEW`]
/// bytes, with the number of bytes it leaves out.
#[derive(Debug, Clone)]
pub struct Arguments {
    full: Arc<str>,
    preview: text::Capped,
}

impl Arguments {
    /// From the canonical JSON of the arguments.
    pub fn from_canonical(full: Arc<str>) -> Arguments {
        let preview = text::escape_capped_counted(&full, MAX_PREVIEW);
        Arguments { full, preview }
    }

    /// The whole canonical JSON.
    pub fn full(&self) -> &Arc<str> {
        &self.full
    }

    /// The preview (terminal-safe, at most [`MAX_PREVIEW`] bytes).
    pub fn preview(&self) -> &str {
        &self.preview.text
    }

    /// Bytes of the canonical JSON the preview does not show (0: the preview is whole).
    pub fn omitted(&self) -> usize {
        self.preview.omitted
    }
}

enum Item {
    Call {
        info: CallInfo,
        reply: oneshot::Sender<bool>,
        /// Parked by a noninteractive broker: approving it needs the digest too.
        deferred: bool,
    },
    Form {
        server: String,
        message: String,
        schema: Value,
        /// The approved calls on that server the form came during (the operator sees them).
        calls: Vec<CallContext>,
        reply: oneshot::Sender<FormAnswer>,
    },
}

/// An approved call running on a server, as a form asked during it names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallContext {
    /// Session id.
    pub session: String,
    /// The agent's uid.
    pub peer_uid: u32,
    /// The tool (or `resources/read`, `prompts/get`).
    pub tool: String,
}

/// The approved calls running on one server right now. A server may ask the operator for
/// input only while one runs: a form is shown with the calls it came during, never unprompted.
#[derive(Default)]
pub struct CallsInFlight(Mutex<Vec<(u64, CallContext)>>);

/// Removes a call from [`CallsInFlight`] when it ends however it ends.
pub struct RunningCall {
    calls: Arc<CallsInFlight>,
    token: u64,
}

impl CallsInFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(u64, CallContext)>> {
        match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Count `ctx` as running until the returned guard is dropped.
    pub fn begin(self: &Arc<Self>, ctx: CallContext) -> RunningCall {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let token = NEXT.fetch_add(1, Ordering::SeqCst);
        self.lock().push((token, ctx));
        RunningCall {
            calls: Arc::clone(self),
            token,
        }
    }

    /// The calls running now (at most [`MAX_FORM_CALLS`] are named).
    pub fn now(&self) -> Vec<CallContext> {
        self.lock()
            .iter()
            .take(MAX_FORM_CALLS)
            .map(|(_, c)| c.clone())
            .collect()
    }
}

impl Drop for RunningCall {
    fn drop(&mut self) {
        self.calls.lock().retain(|(t, _)| *t != self.token);
    }
}

/// Most running calls a form names.
pub const MAX_FORM_CALLS: usize = 16;

struct Waiting {
    item: Item,
    since: SystemTime,
}

/// The operator's queue.
pub struct Approvals {
    interactive: bool,
    deadline: Duration,
    next: AtomicU64,
    items: Mutex<BTreeMap<u64, Waiting>>,
    closed: std::sync::atomic::AtomicBool,
    arrived: tokio::sync::Notify,
}

/// Removes an item when its requester stops waiting, however that happens.
struct Remove<'a>(&'a Approvals, u64);

impl Drop for Remove<'_> {
    fn drop(&mut self) {
        self.0.lock().remove(&self.1);
    }
}

impl Approvals {
    /// A queue; `interactive = false` refuses everything at once.
    pub fn new(interactive: bool, deadline: Duration) -> Arc<Approvals> {
        Arc::new(Approvals {
            interactive,
            deadline,
            next: AtomicU64::new(1),
            items: Mutex::new(BTreeMap::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
            arrived: tokio::sync::Notify::new(),
        })
    }

    /// Whether an operator channel exists.
    pub fn interactive(&self) -> bool {
        self.interactive
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Waiting>> {
        match self.items.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn enqueue(&self, item: Item) -> Result<u64, NotApproved> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(NotApproved::ShuttingDown);
        }
        let mut items = self.lock();
        if items.len() >= MAX_PENDING {
            return Err(NotApproved::Full);
        }
        // Forms have their own, smaller share, so servers asking for input cannot crowd out
        // the agent's calls (or grow the operator's list past a frame).
        if matches!(item, Item::Form { .. })
            && items
                .values()
                .filter(|w| matches!(w.item, Item::Form { .. }))
                .count()
                >= MAX_PENDING_FORMS
        {
            return Err(NotApproved::Full);
        }
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        items.insert(
            id,
            Waiting {
                item,
                since: SystemTime::now(),
            },
        );
        drop(items);
        self.arrived.notify_waiters();
        Ok(id)
    }

    /// Ask the operator to approve one call; resolves when they decide, the deadline passes,
    /// or (by dropping the future) the requester gives up.
    pub async fn approve_call(&self, info: CallInfo) -> Result<(), NotApproved> {
        self.approve_or_park(info, None).await
    }

    /// Like [`Approvals::approve_call`]; a noninteractive broker given `park` (deferred
    /// approval) parks the call for that long instead of refusing it at once, and then only
    /// its id with its digest approves it ([`Approvals::decide_checked`]).
    pub async fn approve_or_park(
        &self,
        info: CallInfo,
        park: Option<Duration>,
    ) -> Result<(), NotApproved> {
        let (deadline, deferred) = match (self.interactive, park) {
            (true, _) => (self.deadline, false),
            (false, Some(d)) => (d, true),
            (false, None) => return Err(NotApproved::Noninteractive),
        };
        let (tx, rx) = oneshot::channel();
        let id = self.enqueue(Item::Call {
            info,
            reply: tx,
            deferred,
        })?;
        let _remove = Remove(self, id);
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => Err(NotApproved::Denied),
            Ok(Err(_)) => Err(NotApproved::ShuttingDown),
            Err(_) => Err(NotApproved::TimedOut),
        }
    }

    async fn ask_form(
        &self,
        server: String,
        calls: &CallsInFlight,
        request: FormRequest,
    ) -> FormAnswer {
        if !self.interactive {
            return FormAnswer::Decline;
        }
        // Never unprompted: a form reaches the operator only during an approved call on that
        // server, and names it.
        let running = calls.now();
        if running.is_empty() {
            return FormAnswer::Decline;
        }
        let (tx, rx) = oneshot::channel();
        let Ok(id) = self.enqueue(Item::Form {
            server,
            message: request.message,
            schema: request.schema,
            calls: running,
            reply: tx,
        }) else {
            return FormAnswer::Cancel;
        };
        let _remove = Remove(self, id);
        match tokio::time::timeout(self.deadline, rx).await {
            Ok(Ok(answer)) => answer,
            _ => FormAnswer::Cancel,
        }
    }

    /// An elicitor for one server's client: its forms go to this queue. `None` for a
    /// noninteractive broker, so the client advertises no form support and fails closed.
    pub fn elicitor(
        self: &Arc<Self>,
        server: &str,
        calls: Arc<CallsInFlight>,
    ) -> Option<Arc<dyn Elicitor>> {
        if !self.interactive {
            return None;
        }
        Some(Arc::new(OperatorForms {
            approvals: Arc::clone(self),
            server: server.to_owned(),
            calls,
        }))
    }

    /// Like [`Approvals::list`], but when nothing is waiting, wait up to `wait` for an item.
    pub async fn list_wait(&self, wait: Duration) -> Vec<Value> {
        let arrived = self.arrived.notified();
        tokio::pin!(arrived);
        arrived.as_mut().enable();
        let now = self.list();
        if !now.is_empty() || wait.is_zero() {
            return now;
        }
        let _ = tokio::time::timeout(wait, arrived).await;
        self.list()
    }

    /// Everything waiting, oldest first, as shown to the operator.
    pub fn list(&self) -> Vec<Value> {
        let items = self.lock();
        items
            .iter()
            .map(|(id, w)| {
                let age = w.since.elapsed().map_or(0, |d| d.as_secs());
                match &w.item {
                    Item::Call { info, deferred, .. } => info.described(
                        json!({"id": id, "kind": "call", "deferred": deferred, "age_secs": age}),
                        json!({
                        "arguments": info.arguments.preview(),
                        "arguments_bytes": info.arguments.full().len(),
                        // From the cut itself: the escaped preview may be longer than the
                        // raw text, so comparing the two sizes can hide a cut.
                        "arguments_cut": info.arguments.omitted() > 0,
                        "arguments_omitted": info.arguments.omitted(),
                        }),
                    ),
                    Item::Form {
                        server,
                        message,
                        schema,
                        calls,
                        ..
                    } => json!({
                        "during": calls.iter().map(|c| json!({
                            "session": c.session,
                            "peer_uid": c.peer_uid,
                            "tool": c.tool,
                        })).collect::<Vec<_>>(),
                        "id": id,
                        "kind": "form",
                        "age_secs": age,
                        "server": server,
                        "message": text::single_line_capped(message, 1024),
                        "schema": schema,
                    }),
                }
            })
            .collect()
    }

    /// One waiting call with (part of) its whole arguments: the canonical JSON text from byte
    /// `offset` on (a character boundary), at most [`SHOW_CHUNK`] bytes of it, cut on a
    /// character boundary; `next_offset` says where the rest starts (null at the end).
    pub fn show(&self, id: u64, offset: usize) -> Result<Value, ShowError> {
        let items = self.lock();
        let Some(Waiting {
            item: Item::Call { info, .. },
            since,
        }) = items.get(&id)
        else {
            return Err(ShowError::NotWaiting);
        };
        let full: &str = info.arguments.full();
        if !full.is_char_boundary(offset) {
            return Err(ShowError::BadOffset {
                offset,
                len: full.len(),
            });
        }
        let mut end = full.len().min(offset.saturating_add(SHOW_CHUNK));
        while !full.is_char_boundary(end) {
            end -= 1;
        }
        let next = (end < full.len()).then_some(end);
        let age = since.elapsed().map_or(0, |d| d.as_secs());
        Ok(info.described(
            json!({"id": id, "kind": "call", "age_secs": age}),
            json!({
                "arguments_bytes": full.len(),
                "offset": offset,
                "arguments": full.get(offset..end).unwrap_or_default(),
                "next_offset": next,
            }),
        ))
    }

    /// Approve or deny a waiting call. `false` if there is no such call (or it is parked and
    /// needs its digest to be approved).
    pub fn decide(&self, id: u64, approve: bool) -> bool {
        self.decide_checked(id, approve, None) == Decided::Done
    }

    /// Approve or deny a waiting call, checking `args_sha256` when it is given: a digest that
    /// is not the call's decides nothing, and a parked call (deferred approval) is approved
    /// only with its digest (denying one needs none).
    pub fn decide_checked(&self, id: u64, approve: bool, args_sha256: Option<&str>) -> Decided {
        let mut items = self.lock();
        let Some(Waiting {
            item: Item::Call { info, deferred, .. },
            ..
        }) = items.get(&id)
        else {
            return Decided::NotWaiting;
        };
        match args_sha256 {
            Some(d) if d != info.args_sha256 => return Decided::DigestMismatch,
            None if approve && *deferred => return Decided::DigestRequired,
            _ => {}
        }
        match items.remove(&id) {
            Some(Waiting {
                item: Item::Call { reply, .. },
                ..
            }) => {
                if reply.send(approve).is_ok() {
                    Decided::Done
                } else {
                    Decided::NotWaiting
                }
            }
            _ => Decided::NotWaiting,
        }
    }

    /// Answer a waiting form. Accepted content is checked against the form's schema first; a
    /// content that does not fit is refused and the form stays waiting.
    pub fn answer(&self, id: u64, answer: FormAnswer) -> Result<(), AnswerError> {
        let mut items = self.lock();
        let Some(Waiting {
            item: Item::Form { schema, .. },
            ..
        }) = items.get(&id)
        else {
            return Err(AnswerError::NotWaiting);
        };
        if let FormAnswer::Accept(content) = &answer {
            elicit::check_answers(schema, content).map_err(AnswerError::Invalid)?;
        }
        match items.remove(&id) {
            Some(Waiting {
                item: Item::Form { reply, .. },
                ..
            }) => {
                let _ = reply.send(answer);
                Ok(())
            }
            _ => Err(AnswerError::NotWaiting),
        }
    }

    /// Refuse everything waiting and everything later (shutdown).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.lock().clear();
    }
}

struct OperatorForms {
    approvals: Arc<Approvals>,
    server: String,
    calls: Arc<CallsInFlight>,
}

impl Elicitor for OperatorForms {
    fn ask(&self, request: FormRequest) -> Pin<Box<dyn Future<Output = FormAnswer> + Send>> {
        let approvals = Arc::clone(&self.approvals);
        let server = self.server.clone();
        let calls = Arc::clone(&self.calls);
        Box::pin(async move { approvals.ask_form(server, &calls, request).await })
    }
}

/// The operator's view of a call's arguments, from the decoded object: its canonical JSON (as
/// audited) and the preview of that (see [`Arguments`]).
pub fn preview(arguments: &Map<String, Value>) -> Arguments {
    let canonical = crate::audit::canonical_json(&Value::Object(arguments.clone()));
    // serde_json writes UTF-8; were it ever not, the lossy text would not match the audited
    // digest, which `iteron approvals show` checks.
    let full = match String::from_utf8(canonical) {
        Ok(s) => s,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    };
    Arguments::from_canonical(Arc::from(full))
}

/// Why `show` has nothing to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShowError {
    /// No call of that id is waiting.
    NotWaiting,
    /// The offset falls inside a character (or past the end) of the `len`-byte arguments.
    BadOffset {
        /// The offset asked for.
        offset: usize,
        /// The length of the arguments, in bytes.
        len: usize,
    },
}

#[cfg(test)]
mod tests;
