//! What waits for the operator: tool calls to approve or deny, and forms (elicitation) to
//! answer. Both reach the operator only through the operator socket, never through anything
//! the agent sends, and both fail closed: a noninteractive broker refuses at once; otherwise
//! an unanswered item is refused when its deadline passes, and one whose requester went away
//! (the agent disconnected, the call was cancelled) disappears from the list.

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

/// Why nothing was approved.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// The arguments, terminal-safe, not redacted, capped at [`MAX_PREVIEW`] bytes (the
    /// operator decides on what will be sent).
    pub preview: String,
    /// The arguments' full size in bytes (compact JSON).
    pub args_bytes: usize,
}

enum Item {
    Call {
        info: CallInfo,
        reply: oneshot::Sender<bool>,
    },
    Form {
        server: String,
        message: String,
        schema: Value,
        reply: oneshot::Sender<FormAnswer>,
    },
}

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
        if !self.interactive {
            return Err(NotApproved::Noninteractive);
        }
        let (tx, rx) = oneshot::channel();
        let id = self.enqueue(Item::Call { info, reply: tx })?;
        let _remove = Remove(self, id);
        match tokio::time::timeout(self.deadline, rx).await {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => Err(NotApproved::Denied),
            Ok(Err(_)) => Err(NotApproved::ShuttingDown),
            Err(_) => Err(NotApproved::TimedOut),
        }
    }

    async fn ask_form(&self, server: String, request: FormRequest) -> FormAnswer {
        if !self.interactive {
            return FormAnswer::Decline;
        }
        let (tx, rx) = oneshot::channel();
        let Ok(id) = self.enqueue(Item::Form {
            server,
            message: request.message,
            schema: request.schema,
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
    pub fn elicitor(self: &Arc<Self>, server: &str) -> Option<Arc<dyn Elicitor>> {
        if !self.interactive {
            return None;
        }
        Some(Arc::new(OperatorForms {
            approvals: Arc::clone(self),
            server: server.to_owned(),
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
                    Item::Call { info, .. } => json!({
                        "id": id,
                        "kind": "call",
                        "age_secs": age,
                        "session": info.session,
                        "peer_uid": info.peer_uid,
                        "peer_pid": info.peer_pid,
                        "server": info.server,
                        "tool": info.tool,
                        "args_sha256": info.args_sha256,
                        "arguments": info.preview,
                        "arguments_bytes": info.args_bytes,
                        "arguments_cut": info.args_bytes > info.preview.len(),
                    }),
                    Item::Form {
                        server,
                        message,
                        schema,
                        ..
                    } => json!({
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

    /// Approve or deny a waiting call. `false` if there is no such call.
    pub fn decide(&self, id: u64, approve: bool) -> bool {
        let mut items = self.lock();
        if !matches!(
            items.get(&id),
            Some(Waiting {
                item: Item::Call { .. },
                ..
            })
        ) {
            return false;
        }
        match items.remove(&id) {
            Some(Waiting {
                item: Item::Call { reply, .. },
                ..
            }) => reply.send(approve).is_ok(),
            _ => false,
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
}

impl Elicitor for OperatorForms {
    fn ask(&self, request: FormRequest) -> Pin<Box<dyn Future<Output = FormAnswer> + Send>> {
        let approvals = Arc::clone(&self.approvals);
        let server = self.server.clone();
        Box::pin(async move { approvals.ask_form(server, request).await })
    }
}

/// The operator's preview of arguments: compact JSON, terminal-safe but not redacted (what is
/// approved must be visible), capped at [`MAX_PREVIEW`]; and the full size.
pub fn preview(arguments: &Map<String, Value>) -> (String, usize) {
    preview_json(&serde_json::to_string(arguments).unwrap_or_default())
}

/// The same, from the arguments' JSON text.
pub fn preview_json(raw: &str) -> (String, usize) {
    (text::escape_capped(raw, MAX_PREVIEW), raw.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> CallInfo {
        CallInfo {
            session: "s1".into(),
            peer_uid: 1000,
            peer_pid: Some(7),
            server: "srv".into(),
            tool: "t".into(),
            args_sha256: "00".into(),
            preview: "{}".into(),
            args_bytes: 2,
        }
    }

    async fn settle(a: &Approvals, n: usize) {
        for _ in 0..1000 {
            if a.list().len() == n {
                return;
            }
            tokio::task::yield_now().await;
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    #[test]
    fn noninteractive_refuses_at_once_and_offers_no_forms() {
        let a = Approvals::new(false, DEFAULT_DEADLINE);
        assert_eq!(
            rt().block_on(a.approve_call(info())),
            Err(NotApproved::Noninteractive)
        );
        assert!(a.elicitor("srv").is_none());
        assert!(a.list().is_empty());
    }

    #[test]
    fn approve_deny_timeout_and_abandon() {
        rt().block_on(async {
            let a = Approvals::new(true, Duration::from_secs(5));
            let a2 = Arc::clone(&a);
            let waiter = tokio::spawn(async move { a2.approve_call(info()).await });
            settle(&a, 1).await;
            let id = a.list()[0]["id"].as_u64().unwrap();
            assert!(!a.decide(id + 100, true));
            assert!(a.decide(id, true));
            assert_eq!(waiter.await.unwrap(), Ok(()));
            assert!(a.list().is_empty());

            let a2 = Arc::clone(&a);
            let waiter = tokio::spawn(async move { a2.approve_call(info()).await });
            settle(&a, 1).await;
            let id = a.list()[0]["id"].as_u64().unwrap();
            assert!(a.decide(id, false));
            assert_eq!(waiter.await.unwrap(), Err(NotApproved::Denied));

            // The requester goes away: the item disappears.
            let a2 = Arc::clone(&a);
            let waiter = tokio::spawn(async move { a2.approve_call(info()).await });
            settle(&a, 1).await;
            assert_eq!(a.list().len(), 1);
            waiter.abort();
            let _ = waiter.await;
            settle(&a, 0).await;
            assert!(a.list().is_empty());

            let quick = Approvals::new(true, Duration::from_millis(20));
            assert_eq!(quick.approve_call(info()).await, Err(NotApproved::TimedOut));
            assert!(quick.list().is_empty());
        });
    }

    #[test]
    fn the_queue_is_bounded() {
        rt().block_on(async {
            let a = Approvals::new(true, Duration::from_secs(5));
            let mut waiters = Vec::new();
            for _ in 0..MAX_PENDING {
                let a2 = Arc::clone(&a);
                waiters.push(tokio::spawn(async move { a2.approve_call(info()).await }));
            }
            for _ in 0..1000 {
                if a.list().len() == MAX_PENDING {
                    break;
                }
                tokio::task::yield_now().await;
            }
            assert_eq!(a.list().len(), MAX_PENDING);
            assert_eq!(a.approve_call(info()).await, Err(NotApproved::Full));
            a.close();
            for w in waiters {
                assert_eq!(w.await.unwrap(), Err(NotApproved::ShuttingDown));
            }
        });
        crate::test_report::record(
            "P5",
            "broker/src/approvals.rs::the_queue_is_bounded",
            serde_json::json!({}),
        );
    }

    #[test]
    fn forms_have_their_own_smaller_share() {
        rt().block_on(async {
            let a = Approvals::new(true, Duration::from_secs(5));
            let el = a.elicitor("srv").unwrap();
            let schema = json!({"type":"object","properties":{}});
            let mut asks = Vec::new();
            for _ in 0..MAX_PENDING_FORMS {
                asks.push(tokio::spawn(el.ask(FormRequest {
                    message: "m".into(),
                    schema: schema.clone(),
                })));
            }
            settle(&a, MAX_PENDING_FORMS).await;
            // One more form is cancelled at once; calls still have room.
            let extra = el
                .ask(FormRequest {
                    message: "m".into(),
                    schema: schema.clone(),
                })
                .await;
            assert_eq!(extra, FormAnswer::Cancel);
            let a2 = Arc::clone(&a);
            let call = tokio::spawn(async move { a2.approve_call(info()).await });
            settle(&a, MAX_PENDING_FORMS + 1).await;
            a.close();
            let _ = call.await;
            for t in asks {
                let _ = t.await;
            }
        });
    }

    #[test]
    fn forms_are_checked_against_their_schema() {
        rt().block_on(async {
            let a = Approvals::new(true, Duration::from_secs(5));
            let el = a.elicitor("srv").unwrap();
            let schema = json!({"type":"object","properties":{"name":{"type":"string"}},"required":["name"]});
            let ask = tokio::spawn(el.ask(FormRequest {
                message: "who?\u{202e}".into(),
                schema,
            }));
            settle(&a, 1).await;
            let listed = a.list();
            assert_eq!(listed[0]["kind"], "form");
            assert!(!listed[0]["message"].as_str().unwrap().contains('\u{202e}'));
            let id = listed[0]["id"].as_u64().unwrap();
            let mut wrong = Map::new();
            wrong.insert("name".into(), json!(5));
            assert!(a.answer(id, FormAnswer::Accept(wrong)).is_err());
            let mut right = Map::new();
            right.insert("name".into(), json!("op"));
            a.answer(id, FormAnswer::Accept(right.clone())).unwrap();
            assert_eq!(ask.await.unwrap(), FormAnswer::Accept(right));
        });
    }
}
