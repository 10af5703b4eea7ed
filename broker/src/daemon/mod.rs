//! `iteron broker serve`: the sockets, the peer checks, the per-connection loop and the
//! pipeline every effect goes through:
//!
//! exposure (policy ∩ filters; an unexposed tool answers exactly like an unknown one) →
//! `PreToolUse` hook seam → operator approval → the effect through the MCP client →
//! `PostToolUse` seam → audit → a text result.
//!
//! Bounds: [`crate::ipc::frame::MAX_FRAME`] per frame, [`MAX_IN_FLIGHT`] requests per connection (the next
//! frame is not read until one finishes), [`MAX_CONNECTIONS`] per socket, [`HELLO_DEADLINE`]
//! for the first frame and [`crate::ipc::frame::read_frame`]'s body deadline for every frame, the MCP
//! client's deadlines for effects, the approval deadline, and [`MAX_RESULT_TEXT`] for a result
//! sent back.
//!
//! The module map, along the pipeline's seams:
//! - `listen`: the sockets and the peer gate; `connection`: one connection's frame loop
//!   and the session a `hello` opens; `session`: a session's requests by kind;
//! - `listing`: exposure and the listings; `effect`: the effect pipeline, with
//!   `arguments` (a call's bytes and their budget) and `record` (its audit record);
//! - `project`: the answers as the agent gets them; `denial`: the refusals it sees —
//!   `Denial` is the only route from an internal cause to the agent: its code, certainty,
//!   reason, audit decision and outcome, and message are each one exhaustive match;
//! - `operator`: the operator socket's requests.
//!
//! The hook seam (`ToolHooks`) lives in [`crate::hooks`] and is re-exported here.
#![forbid(unsafe_code)]

mod arguments;
mod connection;
mod denial;
mod effect;
mod listen;
mod listing;
mod operator;
mod project;
mod record;
mod session;

use self::arguments::ArgumentBudget;
pub use self::arguments::{
    ARGUMENT_NODE_WEIGHT, MAX_ARGUMENT_WEIGHT, MAX_ARGUMENT_WEIGHT_PER_UID, json_nodes,
};
use self::listen::{accept_loop, bind, refused_step};
pub use self::listing::{
    LIST_DEADLINE, LIST_SERVER_DEADLINE, MAX_LIST_PARALLEL, MAX_LISTED, MAX_PROMPT_ARGUMENTS,
    MAX_PROMPT_NAME,
};
use crate::approvals::Approvals;
use crate::audit::{self, AuditLog, Event};
use crate::audit::{Decision, Kind, Outcome};
use crate::catalog::Catalog;
use crate::hooks::Report;
pub use crate::hooks::{HookFuture, NoHooks, ToolEvent, ToolHooks, Verdict};
use crate::ipc::proto::Role;
use crate::registry::Registry;
use crate::store::Home;
use iteron_policy::agentdef::AgentDef;
use iteron_policy::capability::{Capability, CapabilitySet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Semaphore, watch};

/// Requests in flight on one connection.
pub const MAX_IN_FLIGHT: usize = 16;
/// Open connections per socket.
pub const MAX_CONNECTIONS: usize = 256;
/// The first frame (`hello`) must arrive within this.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// Once a frame has started, the rest must arrive within this.
pub const FRAME_DEADLINE: Duration = Duration::from_secs(10);
/// The longest result text sent to the agent (the frame must stay under [`crate::ipc::frame::MAX_FRAME`]).
pub const MAX_RESULT_TEXT: usize = 768 * 1024;
/// The longest client label in `hello`.
pub const MAX_CLIENT_LABEL: usize = 64;
/// How long one answer frame may take to write before the connection is dropped.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(30);
/// How long in-flight work gets to wind down at shutdown before it is dropped.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How to run the broker.
pub struct ServeOptions {
    /// The agent socket.
    pub agent_socket: PathBuf,
    /// The operator socket.
    pub operator_socket: PathBuf,
    /// Uids allowed on the agent socket.
    pub allow_uids: Vec<u32>,
    /// Whether approvals can be asked (false: every approval is refused at once).
    pub interactive: bool,
    /// How long an approval or form waits for the operator.
    pub approval_deadline: Duration,
    /// Skills and agent definitions, discovered once for this run.
    pub catalog: Arc<Catalog>,
    /// How long a connection may sit with no request in flight and no frame arriving before
    /// it is closed ([`DEFAULT_IDLE_DEADLINE`] unless the operator says otherwise).
    pub idle_deadline: Duration,
}

/// How long an open connection may stay idle (nothing in flight, no frame) by default.
pub const DEFAULT_IDLE_DEADLINE: Duration = Duration::from_secs(600);
/// Open connections one uid may hold on the agent socket, so that one agent's connections
/// (idle or not) can never lock the others out of the socket's [`MAX_CONNECTIONS`].
pub const MAX_CONNECTIONS_PER_UID: usize = 64;

/// Why the broker could not start.
#[derive(Debug)]
pub enum ServeError {
    /// A socket could not be set up.
    Socket(String),
    /// The audit log could not be opened.
    Audit(audit::AuditError),
    /// The configuration cannot be read.
    Config(String),
}

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServeError::Socket(why) => f.write_str(why),
            ServeError::Audit(e) => e.fmt(f),
            ServeError::Config(why) => write!(f, "configuration: {why}"),
        }
    }
}

impl std::error::Error for ServeError {}

/// The peer of a connection (from `SO_PEERCRED`).
#[derive(Debug, Clone, Copy)]
struct Peer {
    uid: u32,
    pid: Option<i32>,
}

struct Session {
    id: String,
    peer: Peer,
    /// Set for a child session bound to an agent definition.
    child: Option<Child>,
    /// Approval rules: calls each rule approved in this session (broker/src/rules.rs).
    rule_counts: crate::rules::SessionCounts,
}

/// A child session: a read-only ceiling, no lifecycle hooks, and the budgets the broker can
/// observe (tool calls, wall seconds, consecutive tool errors).
struct Child {
    def: AgentDef,
    started: Instant,
    turns: AtomicU64,
    consecutive_errors: AtomicU64,
    /// A child's calls run one at a time, so its budget checks and counts cannot race.
    serial: tokio::sync::Mutex<()>,
    /// Set when the wall-clock budget ran out during a call (which is then dropped): its
    /// record says so instead of "cancelled by disconnect".
    budget_cut: std::sync::atomic::AtomicBool,
}

impl Session {
    /// The classes this session may use: the host ceiling, narrowed to `read_only` for a child.
    fn ceiling(&self, config: &iteron_policy::config::Config) -> CapabilitySet {
        let host = config.ceiling();
        match self.child {
            Some(_) => host.intersect(CapabilitySet::of(&[Capability::ReadOnly])),
            None => host,
        }
    }
}

struct Broker {
    registry: Registry,
    approvals: Arc<Approvals>,
    audit: AuditLog,
    hooks: Arc<dyn ToolHooks>,
    catalog: Arc<Catalog>,
    shutdown: watch::Receiver<bool>,
    next_session: AtomicU64,
    session_salt: String,
    /// Refused-peer records in the current second, and how many were left out.
    refused_window: Mutex<(u64, u32, u64)>,
    /// Requests in flight across the agent socket's connections.
    agent_work: Arc<Semaphore>,
    /// Requests in flight across the operator socket's connections.
    operator_work: Arc<Semaphore>,
    /// The arguments of calls in flight.
    arguments: ArgumentBudget,
    /// See [`ServeOptions::idle_deadline`].
    idle_deadline: Duration,
    /// Approval rules: calls each rule approved in this run (broker/src/rules.rs).
    rules: crate::rules::RunCounts,
}

/// Refused-peer audit records per second; beyond, they are counted and summarized (another
/// local user must not be able to fill the disk and so stop every effect).
pub const MAX_REFUSED_RECORDS_PER_SEC: u32 = 20;
/// Requests in flight across all connections of one socket (each holds at most one frame). A
/// connection waiting for its next frame has already reserved the slot that frame will use.
/// Each socket has its own pool, so the agent's load can never starve the operator's channel
/// (the one that approves, denies, cancels and stops).
pub const MAX_BROKER_IN_FLIGHT: usize = 512;

/// How often a running broker looks at its configuration without any request (a `stat` when
/// nothing changed): a server removed from the configuration is stopped within this bound even
/// when no agent asks anything.
pub const CONFIG_WATCH_INTERVAL: Duration = Duration::from_secs(2);

fn elapsed_ms(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Broker {
    /// Whether this refused peer gets its own record (and how many were left out before it).
    fn refused_budget(&self) -> (bool, u64) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut w = match self.refused_window.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        refused_step(&mut w, now)
    }

    fn audit_hooks(&self, session: Option<&str>, peer: Peer, reports: &[Report]) {
        for r in reports {
            self.audit(Event {
                session: session.map(str::to_owned),
                peer_uid: Some(peer.uid),
                peer_pid: peer.pid,
                detail: Some(r.detail()),
                ..Event::new(
                    Kind::Hook,
                    if matches!(r.outcome, crate::hooks::Outcome::Blocked(_)) {
                        Decision::Blocked
                    } else {
                        Decision::NoOpinion
                    },
                    match r.outcome {
                        crate::hooks::Outcome::Exited(0) => Outcome::Ok,
                        crate::hooks::Outcome::Exited(_) => Outcome::Exited,
                        crate::hooks::Outcome::Blocked(_) => Outcome::Blocked,
                        crate::hooks::Outcome::Signalled(_) => Outcome::Signalled,
                        crate::hooks::Outcome::TimedOut => Outcome::TimedOut,
                        crate::hooks::Outcome::SpawnFailed(_) => Outcome::SpawnFailed,
                    },
                )
            });
        }
    }

    fn audit(&self, event: Event) {
        // A record that cannot be written does not pass silently: the log prints it, marks
        // itself failed, and every effect is refused from then on (see `CallRecord::open`).
        let _ = self.audit.append(&event);
    }
}

/// What a started broker reports.
#[derive(Debug, Clone)]
pub struct Ready {
    /// The agent socket.
    pub agent_socket: PathBuf,
    /// The operator socket.
    pub operator_socket: PathBuf,
}

/// Run the broker until `stop` resolves (SIGTERM in the CLI). Sets up both sockets, then calls
/// `ready`. On stop: no new connections, every in-flight request is answered `shutting_down`
/// and cancelled, every child is stopped and reaped, the sockets are removed.
pub async fn serve(
    home: Home,
    opts: ServeOptions,
    hooks: Arc<dyn ToolHooks>,
    lookup: crate::registry::Lookup,
    stop: impl Future<Output = ()>,
    ready: impl FnOnce(&Ready),
) -> Result<(), ServeError> {
    // The configuration must be readable before anything listens.
    home.load().map_err(|e| ServeError::Config(e.to_string()))?;
    let audit = AuditLog::open(home.dir()).map_err(ServeError::Audit)?;
    let own = nix::unistd::geteuid().as_raw();
    let others = opts.allow_uids.iter().any(|u| *u != own);
    // Another uid must be able to traverse to the agent socket and connect; the peer check is
    // the gate. The operator socket stays private.
    let (dir_mode, sock_mode) = if others {
        (0o711, 0o666)
    } else {
        (0o700, 0o600)
    };
    let agent_listener = bind(&opts.agent_socket, dir_mode, sock_mode)?;
    let operator_listener = bind(&opts.operator_socket, 0o700, 0o600)?;
    let approvals = Approvals::new(opts.interactive, opts.approval_deadline);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut salt = [0u8; 6];
    let _ = getrandom::fill(&mut salt);
    let broker = Arc::new(Broker {
        registry: Registry::new(home, Arc::clone(&approvals), lookup),
        approvals,
        audit,
        hooks,
        catalog: Arc::clone(&opts.catalog),
        shutdown: stop_rx.clone(),
        next_session: AtomicU64::new(1),
        session_salt: audit::sha256_hex(&salt)[..8].to_owned(),
        refused_window: Mutex::new((0, 0, 0)),
        agent_work: Arc::new(Semaphore::new(MAX_BROKER_IN_FLIGHT)),
        operator_work: Arc::new(Semaphore::new(MAX_BROKER_IN_FLIGHT)),
        arguments: ArgumentBudget::default(),
        idle_deadline: opts.idle_deadline,
        rules: crate::rules::RunCounts::default(),
    });
    // Refused egress destinations are audited here (weakly held: no reference cycle).
    let weak = Arc::downgrade(&broker);
    broker.registry.audit_egress_with(Arc::new(move |e| {
        if let Some(b) = weak.upgrade() {
            b.audit(e);
        }
    }));
    // Every configured server is listed (idle) from the start; nothing is started.
    broker.registry.snapshot().map_err(ServeError::Config)?;
    broker.audit(Event {
        detail: Some(
            if opts.interactive {
                "interactive"
            } else {
                "noninteractive"
            }
            .into(),
        ),
        ..Event::new(Kind::BrokerStart, Decision::Allowed, Outcome::Ok)
    });
    ready(&Ready {
        agent_socket: opts.agent_socket.clone(),
        operator_socket: opts.operator_socket.clone(),
    });
    let agents = tokio::spawn(accept_loop(
        Arc::clone(&broker),
        agent_listener,
        Role::Agent,
        Arc::new(opts.allow_uids.clone()),
    ));
    let operators = tokio::spawn(accept_loop(
        Arc::clone(&broker),
        operator_listener,
        Role::Operator,
        Arc::new(vec![own]),
    ));
    // The configuration is looked at on a timer too (weakly held: the task never keeps the
    // broker alive); a file that does not load now is reported to the next request instead.
    let watcher = {
        let weak = Arc::downgrade(&broker);
        let mut stopped = stop_rx.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(CONFIG_WATCH_INTERVAL) => {}
                    _ = stopped.changed() => return,
                }
                let Some(b) = weak.upgrade() else { return };
                let _ = b.registry.snapshot();
            }
        })
    };
    stop.await;
    let _ = stop_tx.send(true);
    watcher.abort();
    broker.approvals.close();
    let _ = tokio::time::timeout(SHUTDOWN_GRACE * 2, async {
        let _ = agents.await;
        let _ = operators.await;
    })
    .await;
    broker.registry.close_all().await;
    broker.audit(Event {
        ..Event::new(Kind::BrokerStop, Decision::Allowed, Outcome::Ok)
    });
    broker.audit.close();
    let _ = std::fs::remove_file(&opts.agent_socket);
    let _ = std::fs::remove_file(&opts.operator_socket);
    Ok(())
}

#[cfg(test)]
mod tests;
