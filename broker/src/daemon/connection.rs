//! One connection: the frame loop (hello deadline, idle deadline, requests in flight, the
//! answer writer and its deadline) and the session a `hello` opens.

use super::denial::Denial;
use super::session::{dispatch, resolve};
use super::{
    Broker, Child, FRAME_DEADLINE, HELLO_DEADLINE, MAX_CLIENT_LABEL, MAX_IN_FLIGHT, Peer,
    SHUTDOWN_GRACE, Session, WRITE_DEADLINE,
};
use crate::audit::Event;
use crate::audit::{Decision, Kind, Outcome};
use crate::ipc::frame::{self, MAX_FRAME};
use crate::ipc::proto::Reason;
use crate::ipc::proto::{
    self, AgentRequest, Code, Fatal, OperatorRequest, PROTOCOL_VERSION, Refusal, Request, Role,
    State,
};
use iteron_policy::config::HookEvent;
use iteron_policy::text;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::UnixStream;
use tokio::sync::{Semaphore, mpsc};

/// The last moment a connection did something (a frame arrived, a request finished) and how
/// many of its requests are in flight; [`idle_for`] resolves once it has been idle that long.
#[derive(Default)]
pub(super) struct Activity {
    pub(super) last: Mutex<Option<Instant>>,
    pub(super) busy: std::sync::atomic::AtomicUsize,
}

impl Activity {
    pub(super) fn touch(&self) {
        if let Ok(mut l) = self.last.lock() {
            *l = Some(Instant::now());
        }
    }
}

/// Resolves when nothing has been in flight and nothing arrived for `deadline`.
pub(super) async fn idle_for(activity: &Activity, deadline: Duration) {
    loop {
        let since = activity
            .last
            .lock()
            .ok()
            .and_then(|l| *l)
            .map_or(Duration::ZERO, |t| t.elapsed());
        if since >= deadline && activity.busy.load(Ordering::SeqCst) == 0 {
            return;
        }
        tokio::time::sleep(
            deadline
                .saturating_sub(since)
                .max(Duration::from_millis(50)),
        )
        .await;
    }
}

/// Serialize an answer; one over the frame bound becomes a `failed` answer that says the
/// effect (if the request had one) may have been applied.
pub(super) fn encode_answer(v: &Value) -> Vec<u8> {
    let body = serde_json::to_vec(v).unwrap_or_default();
    if body.len() <= MAX_FRAME {
        return body;
    }
    let id = v.get("id").cloned().unwrap_or(Value::Null);
    let r = Denial::AnswerTooLarge.refusal();
    serde_json::to_vec(&json!({"id": id, "error": r.to_value()})).unwrap_or_default()
}

/// Queue an answer for the writer, waiting while the queue is full (a slow reader slows the
/// broker's answers down; nothing is dropped). Fails only when the writer is gone.
pub(super) async fn send(tx: &mpsc::Sender<Vec<u8>>, v: &Value) {
    let _ = tx.send(encode_answer(v)).await;
}

/// Write queued answers in order until the queue closes or a frame cannot be written within
/// `deadline` (a peer that stops reading); then give up on the connection.
pub(super) async fn write_answers<W: tokio::io::AsyncWrite + Unpin>(
    wr: &mut W,
    rx: &mut mpsc::Receiver<Vec<u8>>,
    deadline: Duration,
) {
    while let Some(body) = rx.recv().await {
        match tokio::time::timeout(deadline, frame::write_frame(wr, &body, MAX_FRAME)).await {
            Ok(Ok(())) => {}
            _ => break,
        }
    }
}

pub(super) async fn connection(broker: Arc<Broker>, stream: UnixStream, role: Role, peer: Peer) {
    let (rd, mut wr) = stream.into_split();
    // Buffered: a frame is usually one read, not three.
    let mut rd = tokio::io::BufReader::with_capacity(16 * 1024, rd);
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(MAX_IN_FLIGHT + 2);
    let mut writer = tokio::spawn(async move {
        write_answers(&mut wr, &mut rx, WRITE_DEADLINE).await;
    });
    let permits = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let work = match role {
        Role::Agent => &broker.agent_work,
        Role::Operator => &broker.operator_work,
    };
    let mut tasks = tokio::task::JoinSet::new();
    let in_flight: Arc<Mutex<HashSet<u64>>> = Arc::new(Mutex::new(HashSet::new()));
    let mut state = State::AwaitingHello;
    let mut session: Option<Arc<Session>> = None;
    let mut shutdown = broker.shutdown.clone();
    let activity = Arc::new(Activity::default());
    activity.touch();
    let kind_of = |role: Role| {
        if role == Role::Agent {
            "agent"
        } else {
            "operator"
        }
    };
    let fatal = |f: &Fatal, session: &Option<Arc<Session>>| -> Value {
        broker.audit(Event {
            session: session.as_ref().map(|s| s.id.clone()),
            peer_uid: Some(peer.uid),
            peer_pid: peer.pid,
            detail: Some(format!("{} socket: {}", kind_of(role), f.refusal.message())),
            ..Event::new(
                Kind::ProtocolError,
                Decision::Refused,
                Outcome::ConnectionClosed,
            )
        });
        proto::error_frame(f.id, &f.refusal)
    };
    loop {
        // Wait for a free request slot, but keep watching the socket: an agent that goes away
        // while all its slots are busy must have its work cancelled now, not when a slot frees.
        let mut peeked = false;
        let permit = loop {
            tokio::select! {
                p = Arc::clone(&permits).acquire_owned() => break p.ok(),
                _ = shutdown.wait_for(|s| *s) => break None,
                r = tokio::io::AsyncBufReadExt::fill_buf(&mut rd), if !peeked => match r {
                    Ok(b) if !b.is_empty() => peeked = true,
                    _ => break None,
                },
            }
        };
        let Some(permit) = permit else { break };
        // And one of the socket-wide slots, so that many connections cannot hold unbounded work.
        let global = tokio::select! {
            p = Arc::clone(work).acquire_owned() => p.ok(),
            _ = shutdown.wait_for(|s| *s) => None,
        };
        let Some(global) = global else { break };
        let read = async {
            if state == State::AwaitingHello {
                match tokio::time::timeout(
                    HELLO_DEADLINE,
                    frame::read_frame(&mut rd, MAX_FRAME, FRAME_DEADLINE),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => Err(frame::FrameError::Timeout),
                }
            } else {
                frame::read_frame(&mut rd, MAX_FRAME, FRAME_DEADLINE).await
            }
        };
        let got = tokio::select! {
            r = read => r,
            _ = shutdown.wait_for(|s| *s) => break,
            // An open session with nothing in flight and nothing arriving is closed (and
            // audited), so idle connections cannot hold the socket's slots.
            _ = idle_for(&activity, broker.idle_deadline), if state == State::Open => {
                broker.audit(Event {
                    session: session.as_ref().map(|s| s.id.clone()),
                    peer_uid: Some(peer.uid),
                    peer_pid: peer.pid,
                    detail: Some(format!("idle for {} s", broker.idle_deadline.as_secs())),
                    ..Event::new(Kind::IdleClose, Decision::Refused, Outcome::ConnectionClosed)
                });
                break;
            }
        };
        activity.touch();
        let body = match got {
            Ok(Some(b)) => b,
            Ok(None) => break,
            Err(frame::FrameError::Io(_)) => break,
            Err(e) => {
                send(
                    &tx,
                    &fatal(
                        &Fatal {
                            id: None,
                            refusal: Refusal::new(Code::Protocol, &e.to_string()),
                        },
                        &session,
                    ),
                )
                .await;
                break;
            }
        };
        let (id, _, request) = match proto::decode(role, state, &body) {
            Ok(x) => x,
            Err(f) => {
                send(&tx, &fatal(&f, &session)).await;
                break;
            }
        };
        let fresh = match in_flight.lock() {
            Ok(mut set) => set.insert(id),
            Err(_) => false,
        };
        if !fresh {
            send(
                &tx,
                &fatal(
                    &Fatal {
                        id: Some(id),
                        refusal: Refusal::new(
                            Code::Protocol,
                            "a request with this id is still in flight",
                        ),
                    },
                    &session,
                ),
            )
            .await;
            break;
        }
        match request {
            Request::Agent(AgentRequest::Hello(h))
            | Request::Operator(OperatorRequest::Hello(h)) => {
                let opened = open_session(&broker, role, peer, &h);
                if let Ok(mut set) = in_flight.lock() {
                    set.remove(&id);
                }
                match opened {
                    Ok((s, result)) => {
                        if let Some(sess) = s.as_ref().filter(|s| s.child.is_none()) {
                            let reports = broker
                                .hooks
                                .lifecycle(
                                    HookEvent::SessionStart,
                                    json!({"event": "SessionStart", "session": sess.id, "client": h.client}),
                                )
                                .await;
                            broker.audit_hooks(Some(&sess.id), peer, &reports);
                        }
                        session = s;
                        state = State::Open;
                        send(&tx, &proto::ok_frame(id, result)).await;
                    }
                    Err(refusal) => {
                        send(
                            &tx,
                            &fatal(
                                &Fatal {
                                    id: Some(id),
                                    refusal,
                                },
                                &session,
                            ),
                        )
                        .await;
                        break;
                    }
                }
            }
            Request::Agent(AgentRequest::EndSession) => {
                if let Some(s) = session.as_ref().filter(|s| s.child.is_none()) {
                    let reports = broker
                        .hooks
                        .lifecycle(HookEvent::Stop, json!({"event": "Stop", "session": s.id}))
                        .await;
                    broker.audit_hooks(Some(&s.id), peer, &reports);
                }
                if let Some(s) = &session {
                    broker.audit(Event {
                        session: Some(s.id.clone()),
                        peer_uid: Some(peer.uid),
                        peer_pid: peer.pid,
                        ..Event::new(Kind::EndSession, Decision::Allowed, Outcome::Ok)
                    });
                }
                // Anything still in flight is cancelled by the close below.
                send(&tx, &proto::ok_frame(id, json!({}))).await;
                break;
            }
            other => {
                let b = Arc::clone(&broker);
                let tx = tx.clone();
                let act = Arc::clone(&activity);
                act.busy.fetch_add(1, Ordering::SeqCst);
                let s = session.clone();
                let flights = Arc::clone(&in_flight);
                let mut shut = broker.shutdown.clone();
                tasks.spawn(async move {
                    // Boxed: the request's future is large, and the task would otherwise be
                    // copied whole whenever tokio moves it.
                    let work = Box::pin(dispatch(&b, peer, s.as_deref(), other));
                    let answer = tokio::select! {
                        r = work => r,
                        _ = shut.wait_for(|s| *s) => Err(Denial::ShutdownDuringRequest.refusal()),
                    };
                    if let Ok(mut set) = flights.lock() {
                        set.remove(&id);
                    }
                    match answer {
                        Ok(v) => send(&tx, &proto::ok_frame(id, v)).await,
                        Err(r) => send(&tx, &proto::error_frame(Some(id), &r)).await,
                    }
                    drop(permit);
                    drop(global);
                    act.touch();
                    act.busy.fetch_sub(1, Ordering::SeqCst);
                });
            }
        }
        while tasks.try_join_next().is_some() {}
    }
    // The agent went away (or broke the protocol, or ended the session): in-flight work is
    // cancelled by dropping it — a pending approval disappears from the operator's list, an
    // MCP request is cancelled at the server, and each call's audit guard records it.
    if *shutdown.borrow() {
        // Give in-flight requests the chance to send their `shutting_down` answers.
        let _ = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
    }
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    drop(tx);
    if tokio::time::timeout(Duration::from_secs(5), &mut writer)
        .await
        .is_err()
    {
        writer.abort();
    }
}

pub(super) fn open_session(
    broker: &Broker,
    role: Role,
    peer: Peer,
    h: &proto::Hello,
) -> Result<(Option<Arc<Session>>, Value), Refusal> {
    if h.protocol != PROTOCOL_VERSION {
        return Err(Denial::Version.refusal());
    }
    if h.client.len() > MAX_CLIENT_LABEL || text::check_untrusted(&h.client, false).is_err() {
        return Err(Denial::BadClientLabel.refusal());
    }
    if role == Role::Operator && (h.agent_type.is_some() || h.model.is_some()) {
        return Err(Denial::AgentFieldsOnOperator.refusal());
    }
    if h.model.is_some() && h.agent_type.is_none() {
        return Err(Denial::ModelWithoutAgentType.refusal());
    }
    if role == Role::Operator {
        return Ok((
            None,
            json!({
                "protocol": PROTOCOL_VERSION,
                "broker": env!("CARGO_PKG_VERSION"),
                "interactive": broker.approvals.interactive(),
            }),
        ));
    }
    let snapshot = broker
        .registry
        .snapshot()
        .map_err(|_| Denial::HelloConfigUnreadable.refusal())?;
    let child = match &h.agent_type {
        None => None,
        Some(t) => {
            let def = resolve(&broker.catalog, t, h.model.as_deref()).map_err(|why| {
                broker.audit(Event {
                    peer_uid: Some(peer.uid),
                    peer_pid: peer.pid,
                    detail: Some(why.clone()),
                    ..Event::new(
                        Kind::Hello,
                        Decision::Refused,
                        Outcome::Because(Reason::AgentTypeRefused),
                    )
                });
                Denial::AgentTypeRefused(why).refusal()
            })?;
            Some(Child {
                def: def.clone(),
                started: Instant::now(),
                turns: AtomicU64::new(0),
                consecutive_errors: AtomicU64::new(0),
                serial: tokio::sync::Mutex::new(()),
                budget_cut: std::sync::atomic::AtomicBool::new(false),
            })
        }
    };
    let n = broker.next_session.fetch_add(1, Ordering::SeqCst);
    let id = format!("s{n}-{}", broker.session_salt);
    let detail = match &child {
        None => format!("client {}; config epoch {}", h.client, snapshot.epoch),
        Some(c) => format!(
            "child session of agent definition {} ({} tier); client {}",
            c.def.name,
            c.def.tier.as_str(),
            h.client
        ),
    };
    broker.audit(Event {
        session: Some(id.clone()),
        peer_uid: Some(peer.uid),
        peer_pid: peer.pid,
        detail: Some(detail),
        identity: child.as_ref().map(|c| c.def.identity.clone()),
        ..Event::new(Kind::Hello, Decision::Allowed, Outcome::Ok)
    });
    let mut result =
        json!({"protocol": PROTOCOL_VERSION, "session": id, "broker": env!("CARGO_PKG_VERSION")});
    if let (Some(c), Some(obj)) = (&child, result.as_object_mut()) {
        obj.insert("agent".into(), crate::catalog::agent_json(&c.def, None));
    }
    let session = Arc::new(Session {
        id: id.clone(),
        peer,
        child,
        rule_counts: crate::rules::SessionCounts::default(),
    });
    Ok((Some(session), result))
}
