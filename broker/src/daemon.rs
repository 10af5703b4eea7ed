//! `iteron broker serve`: the sockets, the peer checks, the per-connection loop and the
//! pipeline every effect goes through:
//!
//! exposure (policy ∩ filters; an unexposed tool answers exactly like an unknown one) →
//! `PreToolUse` hook seam → operator approval → the effect through the MCP client →
//! `PostToolUse` seam → audit → a text result.
//!
//! Bounds: [`frame::MAX_FRAME`] per frame, [`MAX_IN_FLIGHT`] requests per connection (the next
//! frame is not read until one finishes), [`MAX_CONNECTIONS`] per socket, [`HELLO_DEADLINE`]
//! for the first frame and [`frame::read_frame`]'s body deadline for every frame, the MCP
//! client's deadlines for effects, the approval deadline, and [`MAX_RESULT_TEXT`] for a result
//! sent back.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, mpsc, watch};

use iteron_policy::agentdef::{self, AgentDef};
use iteron_policy::capability::{Capability, CapabilitySet, Exposure, decide_exposure};
use iteron_policy::config::HookEvent;
use iteron_policy::config::ServerConfig;
use iteron_policy::names::ToolName;
use iteron_policy::text;

use crate::approvals::{self, Approvals, CallInfo, NotApproved};
use crate::audit::{self, AuditLog, Event};
use crate::catalog::Catalog;
use crate::hooks::Report;
use crate::ipc::frame::{self, MAX_FRAME};
use crate::ipc::proto::{self, Code, Fatal, PROTOCOL_VERSION, Refusal, Request, Role, State};
use crate::mcp::client::{McpError, Tool};
use crate::mcp::elicit::FormAnswer;
use crate::registry::{Registry, Slot, SlotError, Snapshot};
use crate::servers::KnownSecrets;
use crate::store::Home;

/// Requests in flight on one connection.
pub const MAX_IN_FLIGHT: usize = 16;
/// Open connections per socket.
pub const MAX_CONNECTIONS: usize = 256;
/// The first frame (`hello`) must arrive within this.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// Once a frame has started, the rest must arrive within this.
pub const FRAME_DEADLINE: Duration = Duration::from_secs(10);
/// The longest result text sent to the agent (the frame must stay under [`MAX_FRAME`]).
pub const MAX_RESULT_TEXT: usize = 768 * 1024;
/// The longest client label in `hello`.
pub const MAX_CLIENT_LABEL: usize = 64;
/// How long one answer frame may take to write before the connection is dropped.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(30);
/// How long in-flight work gets to wind down at shutdown before it is dropped.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The event a tool hook sees.
#[derive(Debug, Clone)]
pub struct ToolEvent {
    /// Session id.
    pub session: String,
    /// Server.
    pub server: String,
    /// Tool.
    pub tool: String,
    /// The arguments, as the canonical JSON of an object (the bytes the operator approves and
    /// the server is sent; hooks run with operator authority and see them).
    pub arguments: Arc<str>,
}

impl ToolEvent {
    /// The arguments as a JSON object (built only when needed: a waiting call keeps bytes).
    pub fn arguments_map(&self) -> Map<String, Value> {
        match serde_json::from_str(&self.arguments) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        }
    }
}

/// Weight charged for each JSON node of a call's arguments while the call is in flight (about
/// what one parsed node costs), on top of the bytes of their canonical JSON.
pub const ARGUMENT_NODE_WEIGHT: usize = 64;
/// Most argument weight one agent uid may have in calls in flight (waiting for a server, for
/// approval, or running).
pub const MAX_ARGUMENT_WEIGHT_PER_UID: usize = 32 * 1024 * 1024;
/// Most argument weight in flight across the broker.
pub const MAX_ARGUMENT_WEIGHT: usize = 96 * 1024 * 1024;

/// The number of JSON nodes of a value (every value, container or scalar, counts one).
pub fn json_nodes(v: &Value) -> usize {
    let mut n = 0usize;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        n += 1;
        match v {
            Value::Array(a) => stack.extend(a.iter()),
            Value::Object(m) => stack.extend(m.values()),
            _ => {}
        }
    }
    n
}

/// The argument weight of calls in flight, per agent uid and in total.
#[derive(Default)]
struct ArgumentBudget(Mutex<(HashMap<u32, usize>, usize)>);

/// One call's share of the [`ArgumentBudget`], given back when the call ends however it ends.
struct ArgumentCharge<'a> {
    budget: &'a ArgumentBudget,
    uid: u32,
    weight: usize,
}

impl ArgumentBudget {
    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<u32, usize>, usize)> {
        match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Charge `weight` to `uid`, unless that would pass the uid's or the broker's bound.
    fn charge(&self, uid: u32, weight: usize) -> Option<ArgumentCharge<'_>> {
        let charged = charge_step(
            &mut self.lock(),
            uid,
            weight,
            MAX_ARGUMENT_WEIGHT_PER_UID,
            MAX_ARGUMENT_WEIGHT,
        );
        // The charge is built only once it was made (and the lock is released): dropping one
        // gives its weight back.
        if charged {
            Some(ArgumentCharge {
                budget: self,
                uid,
                weight,
            })
        } else {
            None
        }
    }
}

/// Add `weight` for `uid` if both bounds hold afterwards.
fn charge_step(
    w: &mut (HashMap<u32, usize>, usize),
    uid: u32,
    weight: usize,
    per_uid: usize,
    total: usize,
) -> bool {
    let mine = w.0.get(&uid).copied().unwrap_or(0);
    if mine.saturating_add(weight) > per_uid || w.1.saturating_add(weight) > total {
        return false;
    }
    w.0.insert(uid, mine + weight);
    w.1 += weight;
    true
}

impl Drop for ArgumentCharge<'_> {
    fn drop(&mut self) {
        let mut w = self.budget.lock();
        if let Some(mine) = w.0.get_mut(&self.uid) {
            *mine = mine.saturating_sub(self.weight);
            if *mine == 0 {
                w.0.remove(&self.uid);
            }
        }
        w.1 = w.1.saturating_sub(self.weight);
    }
}

/// What a `PreToolUse` hook decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No objection (also: no hook, a failed hook, a timed-out hook).
    NoOpinion,
    /// Block, with a reason for the agent.
    Block(String),
}

/// A boxed future.
pub type HookFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The hook seam around every effect. Hooks tighten, never widen: a hook can block a call, not
/// approve one.
pub trait ToolHooks: Send + Sync {
    /// Before approval: a verdict, and a report per hook run (for the audit log).
    fn pre_tool_use<'a>(&'a self, event: &'a ToolEvent) -> HookFuture<'a, (Verdict, Vec<Report>)>;
    /// After the effect (its outcome word).
    fn post_tool_use<'a>(
        &'a self,
        event: &'a ToolEvent,
        outcome: &'a str,
    ) -> HookFuture<'a, Vec<Report>>;
    /// `SessionStart`, `UserPromptSubmit`, `Stop`: notifications, no opinion is taken.
    fn lifecycle<'a>(&'a self, event: HookEvent, payload: Value) -> HookFuture<'a, Vec<Report>>;
}

/// No hooks configured.
pub struct NoHooks;

impl ToolHooks for NoHooks {
    fn pre_tool_use<'a>(&'a self, _: &'a ToolEvent) -> HookFuture<'a, (Verdict, Vec<Report>)> {
        Box::pin(async { (Verdict::NoOpinion, Vec::new()) })
    }
    fn post_tool_use<'a>(&'a self, _: &'a ToolEvent, _: &'a str) -> HookFuture<'a, Vec<Report>> {
        Box::pin(async { Vec::new() })
    }
    fn lifecycle<'a>(&'a self, _: HookEvent, _: Value) -> HookFuture<'a, Vec<Report>> {
        Box::pin(async { Vec::new() })
    }
}

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

/// One refused peer at second `now`: whether it gets its own record, and how many refusals
/// before it were counted instead. `w` is (second, records this second, not recorded).
fn refused_step(w: &mut (u64, u32, u64), now: u64) -> (bool, u64) {
    if w.0 != now {
        w.0 = now;
        w.1 = 0;
    }
    if w.1 >= MAX_REFUSED_RECORDS_PER_SEC {
        w.2 += 1;
        return (false, 0);
    }
    w.1 += 1;
    (true, std::mem::take(&mut w.2))
}

/// Refused-peer audit records per second; beyond, they are counted and summarized (another
/// local user must not be able to fill the disk and so stop every effect).
pub const MAX_REFUSED_RECORDS_PER_SEC: u32 = 20;
/// Requests in flight across all connections of one socket (each holds at most one frame). A
/// connection waiting for its next frame has already reserved the slot that frame will use.
/// Each socket has its own pool, so the agent's load can never starve the operator's channel
/// (the one that approves, denies, cancels and stops).
pub const MAX_BROKER_IN_FLIGHT: usize = 512;

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
                kind: "hook",
                decision: if matches!(r.outcome, crate::hooks::Outcome::Blocked(_)) {
                    "blocked"
                } else {
                    "no_opinion"
                },
                outcome: match r.outcome {
                    crate::hooks::Outcome::Exited(0) => "ok",
                    crate::hooks::Outcome::Exited(_) => "exited",
                    crate::hooks::Outcome::Blocked(_) => "blocked",
                    crate::hooks::Outcome::Signalled(_) => "signalled",
                    crate::hooks::Outcome::TimedOut => "timed_out",
                    crate::hooks::Outcome::SpawnFailed(_) => "spawn_failed",
                },
                detail: Some(r.detail()),
                ..Event::default()
            });
        }
    }

    fn audit(&self, event: Event) {
        // A record that cannot be written does not pass silently: the log prints it, marks
        // itself failed, and every effect is refused from then on (see `CallRecord::open`).
        let _ = self.audit.append(&event);
    }
}

/// Prepare a socket path: a private parent directory (created with `dir_mode` if missing; an
/// existing one must be ours and not writable by others), and no live socket at the path.
fn prepare_socket(path: &Path, dir_mode: u32) -> Result<(), ServeError> {
    let fail = |what: &str| ServeError::Socket(format!("socket {}: {what}", path.display()));
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| fail("has no parent directory"))?;
    if !path.is_absolute() {
        return Err(fail("must be an absolute path"));
    }
    match std::fs::DirBuilder::new().mode(dir_mode).create(parent) {
        Ok(()) => {
            // The umask may have narrowed the mode; set exactly what was asked.
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(dir_mode))
                .map_err(|e| fail(&format!("cannot set the directory mode: {e}")))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(fail(&format!("cannot create the directory: {e}"))),
    }
    let meta = std::fs::symlink_metadata(parent)
        .map_err(|e| fail(&format!("cannot inspect the directory: {e}")))?;
    let euid = nix::unistd::geteuid().as_raw();
    if !meta.file_type().is_dir() {
        return Err(fail("the parent is not a directory"));
    }
    if meta.uid() != euid {
        return Err(fail("the parent directory is owned by another user"));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(fail("the parent directory is writable by group or others"));
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(fail(&format!("cannot inspect: {e}"))),
        Ok(m) if !m.file_type().is_socket() => Err(fail("exists and is not a socket")),
        Ok(_) => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(fail("another broker is listening on it"));
            }
            std::fs::remove_file(path)
                .map_err(|e| fail(&format!("cannot remove a stale socket: {e}")))
        }
    }
}

fn bind(path: &Path, dir_mode: u32, sock_mode: u32) -> Result<UnixListener, ServeError> {
    prepare_socket(path, dir_mode)?;
    let listener = UnixListener::bind(path).map_err(|e| {
        ServeError::Socket(format!("socket {}: cannot listen: {e}", path.display()))
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(sock_mode)).map_err(|e| {
        ServeError::Socket(format!(
            "socket {}: cannot set its mode: {e}",
            path.display()
        ))
    })?;
    Ok(listener)
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
        kind: "broker_start",
        decision: "allowed",
        outcome: "ok",
        detail: Some(
            if opts.interactive {
                "interactive"
            } else {
                "noninteractive"
            }
            .into(),
        ),
        ..Event::default()
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
    stop.await;
    let _ = stop_tx.send(true);
    broker.approvals.close();
    let _ = tokio::time::timeout(SHUTDOWN_GRACE * 2, async {
        let _ = agents.await;
        let _ = operators.await;
    })
    .await;
    broker.registry.close_all().await;
    broker.audit(Event {
        kind: "broker_stop",
        decision: "allowed",
        outcome: "ok",
        ..Event::default()
    });
    broker.audit.close();
    let _ = std::fs::remove_file(&opts.agent_socket);
    let _ = std::fs::remove_file(&opts.operator_socket);
    Ok(())
}

/// Answer a connection that is not served with one error frame (bounded to 1 s), then close.
fn refuse_connection(mut stream: UnixStream, refusal: Refusal) {
    tokio::spawn(async move {
        let body = serde_json::to_vec(&proto::error_frame(None, &refusal)).unwrap_or_default();
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            frame::write_frame(&mut stream, &body, MAX_FRAME),
        )
        .await;
    });
}

async fn accept_loop(
    broker: Arc<Broker>,
    listener: UnixListener,
    role: Role,
    allowed: Arc<Vec<u32>>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let per_uid: Arc<Mutex<HashMap<u32, usize>>> = Arc::new(Mutex::new(HashMap::new()));
    let mut shutdown = broker.shutdown.clone();
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.wait_for(|s| *s) => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let Ok((stream, _)) = accepted else {
            // Out of descriptors or similar: back off briefly instead of spinning.
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let peer = match stream.peer_cred() {
            Ok(c) => Peer {
                uid: c.uid(),
                pid: c.pid(),
            },
            Err(_) => continue,
        };
        if !allowed.contains(&peer.uid) {
            let (record, suppressed) = broker.refused_budget();
            if record {
                broker.audit(Event {
                    peer_uid: Some(peer.uid),
                    peer_pid: peer.pid,
                    kind: if role == Role::Agent {
                        "connect_agent"
                    } else {
                        "connect_operator"
                    },
                    decision: "refused",
                    outcome: "peer_uid_not_allowed",
                    detail: (suppressed > 0).then(|| {
                        format!("{suppressed} earlier refusals were not recorded one by one")
                    }),
                    ..Event::default()
                });
            }
            refuse_connection(
                stream,
                Refusal::new(Code::Refused, "this uid may not use this socket"),
            );
            continue;
        }
        let Some(mine) = UidConnection::take(&per_uid, peer.uid, MAX_CONNECTIONS_PER_UID) else {
            refuse_connection(
                stream,
                Refusal::new(
                    Code::Busy,
                    &format!(
                        "this uid has {MAX_CONNECTIONS_PER_UID} connections open already; close one"
                    ),
                ),
            );
            continue;
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            refuse_connection(
                stream,
                Refusal::new(Code::Busy, "too many open connections; try again later"),
            );
            continue;
        };
        let b = Arc::clone(&broker);
        conns.spawn(async move {
            connection(b, stream, role, peer).await;
            drop(permit);
            drop(mine);
        });
    }
    // Let every connection answer its in-flight requests `shutting_down`, then drop the rest.
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    conns.abort_all();
}

/// One of a uid's open connections, counted while it lives.
struct UidConnection {
    counts: Arc<Mutex<HashMap<u32, usize>>>,
    uid: u32,
}

impl UidConnection {
    /// Count one more connection for `uid`, unless it already has `max`.
    fn take(counts: &Arc<Mutex<HashMap<u32, usize>>>, uid: u32, max: usize) -> Option<Self> {
        let mut c = match counts.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let n = c.entry(uid).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(UidConnection {
            counts: Arc::clone(counts),
            uid,
        })
    }
}

impl Drop for UidConnection {
    fn drop(&mut self) {
        let mut c = match self.counts.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some(n) = c.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                c.remove(&self.uid);
            }
        }
    }
}

/// The last moment a connection did something (a frame arrived, a request finished) and how
/// many of its requests are in flight; [`idle_for`] resolves once it has been idle that long.
#[derive(Default)]
struct Activity {
    last: Mutex<Option<Instant>>,
    busy: std::sync::atomic::AtomicUsize,
}

impl Activity {
    fn touch(&self) {
        if let Ok(mut l) = self.last.lock() {
            *l = Some(Instant::now());
        }
    }
}

/// Resolves when nothing has been in flight and nothing arrived for `deadline`.
async fn idle_for(activity: &Activity, deadline: Duration) {
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
fn encode_answer(v: &Value) -> Vec<u8> {
    let body = serde_json::to_vec(v).unwrap_or_default();
    if body.len() <= MAX_FRAME {
        return body;
    }
    let id = v.get("id").cloned().unwrap_or(Value::Null);
    let r = Refusal::new(
        Code::Failed,
        "the answer is over the frame size bound and was not sent",
    )
    .with_certainty("maybe_applied");
    serde_json::to_vec(&json!({"id": id, "error": r.to_value()})).unwrap_or_default()
}

/// Queue an answer for the writer, waiting while the queue is full (a slow reader slows the
/// broker's answers down; nothing is dropped). Fails only when the writer is gone.
async fn send(tx: &mpsc::Sender<Vec<u8>>, v: &Value) {
    let _ = tx.send(encode_answer(v)).await;
}

/// Write queued answers in order until the queue closes or a frame cannot be written within
/// `deadline` (a peer that stops reading); then give up on the connection.
async fn write_answers<W: tokio::io::AsyncWrite + Unpin>(
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

async fn connection(broker: Arc<Broker>, stream: UnixStream, role: Role, peer: Peer) {
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
            kind: "protocol_error",
            decision: "refused",
            outcome: "connection_closed",
            detail: Some(format!("{} socket: {}", kind_of(role), f.refusal.message())),
            ..Event::default()
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
                    kind: "idle_close",
                    decision: "refused",
                    outcome: "connection_closed",
                    detail: Some(format!("idle for {} s", broker.idle_deadline.as_secs())),
                    ..Event::default()
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
        let (id, entry, request) = match proto::decode(role, state, &body) {
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
            Request::Hello(h) => {
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
            Request::EndSession => {
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
                        kind: entry.method,
                        decision: "allowed",
                        outcome: "ok",
                        ..Event::default()
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
                    let work = Box::pin(dispatch(&b, role, peer, s.as_deref(), other));
                    let answer = tokio::select! {
                        r = work => r,
                        _ = shut.wait_for(|s| *s) => Err(Refusal::new(
                            Code::ShuttingDown,
                            "the broker is shutting down; the request was cancelled (a tool call may or may not have been applied)",
                        ).with_certainty("maybe_applied")),
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

fn open_session(
    broker: &Broker,
    role: Role,
    peer: Peer,
    h: &proto::Hello,
) -> Result<(Option<Arc<Session>>, Value), Refusal> {
    if h.protocol != PROTOCOL_VERSION {
        return Err(Refusal::new(
            Code::Version,
            &format!("this broker speaks IPC protocol {PROTOCOL_VERSION} only"),
        ));
    }
    if h.client.len() > MAX_CLIENT_LABEL || text::check_untrusted(&h.client, false).is_err() {
        return Err(Refusal::new(
            Code::Protocol,
            &format!("the client label must be at most {MAX_CLIENT_LABEL} bytes of plain text"),
        ));
    }
    if role == Role::Operator && (h.agent_type.is_some() || h.model.is_some()) {
        return Err(Refusal::new(
            Code::Protocol,
            "agent_type and model belong to agent sessions",
        ));
    }
    if h.model.is_some() && h.agent_type.is_none() {
        return Err(Refusal::new(
            Code::Protocol,
            "model is only meaningful with agent_type",
        ));
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
    let snapshot = broker.registry.snapshot().map_err(|_| {
        Refusal::new(
            Code::Failed,
            "the broker's configuration cannot be read; ask the operator",
        )
    })?;
    let child = match &h.agent_type {
        None => None,
        Some(t) => {
            let def = resolve(&broker.catalog, t, h.model.as_deref()).map_err(|why| {
                broker.audit(Event {
                    peer_uid: Some(peer.uid),
                    peer_pid: peer.pid,
                    kind: "hello",
                    decision: "refused",
                    outcome: "agent_type_refused",
                    detail: Some(why.clone()),
                    ..Event::default()
                });
                Refusal::new(Code::Refused, &why)
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
        kind: "hello",
        decision: "allowed",
        outcome: "ok",
        detail: Some(detail),
        identity: child.as_ref().map(|c| c.def.identity.clone()),
        ..Event::default()
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

async fn dispatch(
    broker: &Broker,
    role: Role,
    peer: Peer,
    session: Option<&Session>,
    request: Request,
) -> Result<Value, Refusal> {
    if let Some(s) = session {
        check_wall_budget(s)?;
    }
    match (role, request, session) {
        (Role::Agent, Request::ListTools, Some(s)) => list_tools(broker, s).await,
        (Role::Agent, Request::CallTool(c), Some(s)) => match &s.child {
            None => call_tool(broker, s, c).await,
            Some(child) => {
                let _serial = child.serial.lock().await;
                check_wall_budget(s)?;
                let turn = child.turns.fetch_add(1, Ordering::SeqCst) + 1;
                if turn > child.def.budget.max_turns {
                    return Err(Refusal::new(
                        Code::Refused,
                        "the child's turn budget is spent; nothing was sent",
                    )
                    .with_certainty("not_sent"));
                }
                let limit = child.def.budget.max_consecutive_tool_errors;
                if child.consecutive_errors.load(Ordering::SeqCst) >= limit {
                    return Err(Refusal::new(
                        Code::Refused,
                        "the child reached its limit of consecutive tool errors; nothing was sent",
                    )
                    .with_certainty("not_sent"));
                }
                // The wall-clock budget bounds the call itself, not only its start.
                let left = Duration::from_secs(child.def.budget.max_wall_secs)
                    .saturating_sub(child.started.elapsed());
                let call = call_tool(broker, s, c);
                tokio::pin!(call);
                let r = tokio::select! {
                    // The call first: it must at least start (and open its record) even when
                    // the budget is about to run out.
                    biased;
                    r = &mut call => r,
                    _ = tokio::time::sleep(left) => {
                        // The call is dropped at the end of this block, after the flag is set:
                        // its record says the budget cut it.
                        child.budget_cut.store(true, Ordering::SeqCst);
                        Err(Refusal::new(
                            Code::Refused,
                            "the child's wall-clock budget ran out during the call; it may or may not have been applied",
                        )
                        .with_certainty("maybe_applied"))
                    }
                };
                let failed = match &r {
                    Ok(v) => v.get("is_error").and_then(Value::as_bool) == Some(true),
                    Err(_) => true,
                };
                if failed {
                    child.consecutive_errors.fetch_add(1, Ordering::SeqCst);
                } else {
                    child.consecutive_errors.store(0, Ordering::SeqCst);
                }
                r
            }
        },
        (Role::Agent, Request::ListResources(a), Some(s)) => {
            list_reads(broker, s, &a.server, false).await
        }
        (Role::Agent, Request::ListPrompts(a), Some(s)) => {
            list_reads(broker, s, &a.server, true).await
        }
        (Role::Agent, Request::ReadResource(r), Some(s)) => {
            server_read(broker, s, &r.server, Read::Resource(r.uri)).await
        }
        (Role::Agent, Request::GetPrompt(g), Some(s)) => {
            let arguments = g
                .arguments
                .into_iter()
                .map(|(k, v)| (k, Value::String(v)))
                .collect();
            server_read(broker, s, &g.server, Read::Prompt(g.name, arguments)).await
        }
        (Role::Agent, Request::ListSkills, Some(_)) => Ok(skills_index(&broker.catalog)),
        (Role::Agent, Request::UseSkill(u), Some(s)) => use_skill(broker, s, &u.name),
        (Role::Agent, Request::ResolveAgent(r), Some(s)) => {
            let answer = match resolve(&broker.catalog, &r.agent_type, r.model.as_deref()) {
                Ok(def) => json!({"agent": crate::catalog::agent_json(def, None), "reason": null}),
                Err(why) => json!({"agent": null, "reason": why}),
            };
            broker.audit(Event {
                session: Some(s.id.clone()),
                peer_uid: Some(s.peer.uid),
                peer_pid: s.peer.pid,
                kind: "resolve_agent",
                decision: if answer["agent"].is_null() {
                    "refused"
                } else {
                    "allowed"
                },
                outcome: "ok",
                ..Event::default()
            });
            Ok(answer)
        }
        (Role::Agent, Request::SubmitPrompt(p), Some(s)) => {
            if p.prompt.len() > proto::MAX_PROMPT {
                return Err(Refusal::new(
                    Code::Refused,
                    &format!("the prompt is over {} bytes", proto::MAX_PROMPT),
                ));
            }
            if s.child.is_none() {
                let reports = broker
                    .hooks
                    .lifecycle(
                        HookEvent::UserPromptSubmit,
                        json!({"event": "UserPromptSubmit", "session": s.id, "prompt": p.prompt}),
                    )
                    .await;
                broker.audit_hooks(Some(&s.id), s.peer, &reports);
            }
            Ok(json!({}))
        }
        (Role::Operator, req, _) => operator(broker, peer, req).await,
        // The table admits nothing else in an open session; this is unreachable by
        // construction, and refused rather than trusted if it ever were reached.
        _ => Err(Refusal::new(Code::Protocol, "request not allowed here")),
    }
}

/// A child whose wall-clock budget is spent gets nothing more.
fn check_wall_budget(s: &Session) -> Result<(), Refusal> {
    match &s.child {
        Some(c) if c.started.elapsed() > Duration::from_secs(c.def.budget.max_wall_secs) => {
            Err(Refusal::new(
                Code::Refused,
                "the child's wall-clock budget is spent; nothing was sent",
            )
            .with_certainty("not_sent"))
        }
        _ => Ok(()),
    }
}

/// Look up an agent definition for a request: the request-side grammar first, then the exact
/// (case-sensitive) name, then the model policy. Refusals are fixed texts that never quote the
/// caller's `agentType` or model.
fn resolve<'a>(
    catalog: &'a Catalog,
    agent_type: &str,
    model: Option<&str>,
) -> Result<&'a AgentDef, String> {
    if agentdef::check_agent_type(agent_type).is_err() {
        return Err(format!(
            "the agent type must be 1-{} bytes of ASCII letters, digits, '.', '_' or '-'",
            agentdef::MAX_NAME
        ));
    }
    if let Some(m) = model {
        agentdef::check_model_override(m).map_err(str::to_owned)?;
    }
    let Some(entry) = catalog.agent(agent_type) else {
        return Err("no agent definition with that name (names are case-sensitive)".into());
    };
    if matches!(entry.def.model, agentdef::ModelPolicy::Route(_))
        || model.is_some_and(|m| m != "inherit")
    {
        return Err("only the parent's model (inherit) can be used: this broker has no resolved provider, capability and pricing evidence for another route".into());
    }
    Ok(&entry.def)
}

fn skills_index(catalog: &Catalog) -> Value {
    json!({
        "skills": catalog.skills.iter().map(|s| json!({
            "name": s.name,
            "tier": s.tier.as_str(),
            "description": s.description,
        })).collect::<Vec<_>>()
    })
}

fn use_skill(broker: &Broker, s: &Session, name: &str) -> Result<Value, Refusal> {
    let outcome = broker.catalog.skill_body(name);
    broker.audit(Event {
        session: Some(s.id.clone()),
        peer_uid: Some(s.peer.uid),
        peer_pid: s.peer.pid,
        kind: "use_skill",
        decision: if outcome.is_ok() {
            "allowed"
        } else {
            "refused"
        },
        outcome: match &outcome {
            Ok(_) => "ok",
            Err(crate::catalog::UseSkillError::Unknown) => "unknown_skill",
            Err(crate::catalog::UseSkillError::Changed) => "changed_since_discovery",
        },
        detail: outcome
            .as_ref()
            .ok()
            .map(|(e, _)| format!("skill {} ({} tier)", e.name, e.tier.as_str())),
        ..Event::default()
    });
    match outcome {
        Ok((entry, body)) => Ok(json!({
            "name": entry.name,
            "tier": entry.tier.as_str(),
            "body": body,
        })),
        Err(crate::catalog::UseSkillError::Unknown) => {
            Err(Refusal::new(Code::NotFound, "unknown skill"))
        }
        Err(crate::catalog::UseSkillError::Changed) => Err(Refusal::new(
            Code::Refused,
            "the skill changed since it was discovered; it is available again after the broker restarts",
        )),
    }
}

/// The one message for every tool the agent may not see or that does not exist.
const UNKNOWN_TOOL: &str = "unknown tool";

fn unknown_tool() -> Refusal {
    Refusal::new(Code::UnknownTool, UNKNOWN_TOOL)
}

fn exposed(ceiling: CapabilitySet, server: &ServerConfig, tool: &str) -> bool {
    let Ok(name) = ToolName::parse(tool) else {
        return false;
    };
    matches!(
        decide_exposure(
            ceiling,
            &server.tools,
            &server.policy,
            &name,
            CapabilitySet::MCP_TOOL
        ),
        Exposure::Expose(_)
    )
}

/// The configuration as it is now: every request is decided on it, so a server removed or a
/// tool denied since a session opened is gone for that session too. Reading it costs a `stat`
/// when the file did not change. Fail closed: an unreadable configuration refuses the request.
fn current(broker: &Broker) -> Result<Arc<Snapshot>, Refusal> {
    broker.registry.snapshot().map_err(|_| {
        Refusal::new(
            Code::Failed,
            "the broker's configuration cannot be read; nothing was sent; ask the operator",
        )
        .with_certainty("not_sent")
    })
}

/// The exposed catalog of one server for this session (connecting first if needed). The
/// server's full catalog is retained per generation by the registry; what this session may
/// see is decided here, on the configuration `snap` is.
async fn session_catalog(
    broker: &Broker,
    s: &Session,
    snap: &Snapshot,
    server: &ServerConfig,
) -> Result<(Arc<Slot>, Arc<crate::mcp::client::Client>, Vec<Tool>), SlotError> {
    let (slot, client) = broker.registry.client(snap, server).await?;
    let all = broker
        .registry
        .catalog(&slot, &client)
        .await
        .map_err(|e| SlotError::Connect(slot.secrets().scrub(&e.to_string())))?;
    let ceiling = s.ceiling(&snap.config);
    let tools: Vec<Tool> = all
        .iter()
        .filter(|t| exposed(ceiling, server, &t.name))
        .cloned()
        .collect();
    Ok((slot, client, tools))
}

/// How long `list_tools` waits for one server's catalog (connecting included). Servers are
/// asked at once, so a hung one costs this once, not once per server.
pub const LIST_SERVER_DEADLINE: Duration = Duration::from_secs(15);

/// Run `futures` concurrently on this task and collect their outputs in order.
async fn join_all<T>(mut futures: Vec<Pin<Box<dyn Future<Output = T> + Send + '_>>>) -> Vec<T> {
    let mut out: Vec<Option<T>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in futures.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// What one server contributed to a `list_tools` answer.
enum Listed {
    Tools(Vec<Value>),
    Unavailable,
}

async fn list_tools(broker: &Broker, s: &Session) -> Result<Value, Refusal> {
    let snap = current(broker)?;
    let ceiling = s.ceiling(&snap.config);
    // A server none of whose tools the policy can expose is never started and never named
    // (a child's read-only ceiling exposes no MCP tool at all).
    let servers: Vec<&ServerConfig> = snap
        .config
        .mcp_servers
        .iter()
        .filter(|server| {
            iteron_policy::capability::server_tools_exposed(ceiling, &server.tools, &server.policy)
        })
        .collect();
    let asks: Vec<Pin<Box<dyn Future<Output = Listed> + Send + '_>>> = servers
        .iter()
        .map(|server| {
            let snap = &snap;
            let ask = async move {
                match tokio::time::timeout(
                    LIST_SERVER_DEADLINE,
                    session_catalog(broker, s, snap, server),
                )
                .await
                {
                    Ok(Ok((slot, _, catalog))) => {
                        let secrets = slot.secrets();
                        Listed::Tools(
                            catalog
                                .iter()
                                .map(|t| {
                                    // Scrubbed where the server's bytes came in; scrubbed again
                                    // here, value by value, for what came through another way.
                                    let mut input_schema = t.input_schema.clone();
                                    secrets.scrub_json(&mut input_schema);
                                    json!({
                                        "server": server.name.as_str(),
                                        "name": t.name,
                                        "description": secrets.scrub(&t.description),
                                        "input_schema": input_schema,
                                        // Whether calls can be approved (broker/src/rules.rs).
                                        "approval": crate::rules::marker(
                                            &broker.rules,
                                            &s.rule_counts,
                                            &snap.config,
                                            server.name.as_str(),
                                            &t.name,
                                            s.peer.uid,
                                            s.child.as_ref().map(|c| c.def.identity.as_str()),
                                            broker.approvals.interactive(),
                                        ),
                                    })
                                })
                                .collect(),
                        )
                    }
                    // The agent learns only that the server is unavailable; the operator sees
                    // why in `iteron broker status`.
                    _ => Listed::Unavailable,
                }
            };
            Box::pin(ask) as Pin<Box<dyn Future<Output = Listed> + Send + '_>>
        })
        .collect();
    let listed = join_all(asks).await;
    let mut tools = Vec::new();
    let mut unavailable = Vec::new();
    let mut notes = Vec::new();
    let mut used = 0usize;
    for (server, got) in servers.iter().zip(listed) {
        match got {
            Listed::Tools(entries) => {
                // A catalog that does not fit in what is left of the answer is left out whole,
                // for that server only, with a note (the answer itself always fits a frame).
                let size: usize = entries
                    .iter()
                    .map(|e| serde_json::to_vec(e).map_or(usize::MAX, |v| v.len()))
                    .fold(0usize, usize::saturating_add);
                if used.saturating_add(size) > MAX_RESULT_TEXT {
                    notes.push(format!(
                        "the catalog of server {} ({} tools, {size} bytes) does not fit in the answer (at most {MAX_RESULT_TEXT} bytes) and is left out",
                        server.name.as_str(),
                        entries.len()
                    ));
                    continue;
                }
                used += size;
                tools.extend(entries);
            }
            Listed::Unavailable => unavailable.push(server.name.as_str().to_owned()),
        }
    }
    broker.audit(Event {
        session: Some(s.id.clone()),
        peer_uid: Some(s.peer.uid),
        peer_pid: s.peer.pid,
        kind: "list_tools",
        decision: "allowed",
        outcome: "ok",
        ..Event::default()
    });
    Ok(json!({"tools": tools, "unavailable": unavailable, "notes": notes}))
}

/// Writes the call's audit record when the call ends however it ends — including when the
/// agent disconnects and the call's future is dropped mid-way.
struct CallRecord<'a> {
    broker: &'a Broker,
    session: &'a Session,
    event: Event,
    started: Instant,
    done: bool,
    /// The approval rule that approved the call, named in each of its records.
    rule: Option<crate::rules::RuleMark>,
}

impl<'a> CallRecord<'a> {
    /// Start the record of one effect request. When the audit log cannot be written the request
    /// is refused at once, the same way whatever it names (and that refusal is recorded if the
    /// log takes it).
    fn open(
        broker: &'a Broker,
        s: &'a Session,
        kind: &'static str,
        args_sha256: &str,
    ) -> Result<CallRecord<'a>, Refusal> {
        let mut record = CallRecord {
            broker,
            session: s,
            event: Event {
                session: Some(s.id.clone()),
                peer_uid: Some(s.peer.uid),
                peer_pid: s.peer.pid,
                kind,
                args_sha256: Some(args_sha256.to_owned()),
                ..Event::default()
            },
            started: Instant::now(),
            done: false,
            rule: None,
        };
        if let Err(gate) = broker.audit.effect_gate() {
            record.finish("refused", gate.outcome(), None);
            return Err(Refusal::new(Code::Refused, gate.refusal()));
        }
        Ok(record)
    }
}

impl CallRecord<'_> {
    fn finish(&mut self, decision: &'static str, outcome: &'static str, detail: Option<String>) {
        // A rule-approved call says so, and names the rule, in every record.
        self.event.decision = crate::rules::decision(self.rule.as_ref(), decision);
        self.event.outcome = outcome;
        self.event.detail = crate::rules::detail(self.rule.as_ref(), detail);
        self.event.duration_ms = elapsed_ms(self.started);
        self.broker.audit(self.event.clone());
        self.done = true;
    }
}

impl CallRecord<'_> {
    /// Write the "dispatching" record of an approved call, or say why the effect may not start
    /// (the log failed, or its disk is under the reserve).
    fn dispatching(&mut self) -> Result<(), audit::Gate> {
        let mut e = self.event.clone();
        e.decision = crate::rules::decision(self.rule.as_ref(), "approved");
        e.outcome = "dispatching";
        e.duration_ms = elapsed_ms(self.started);
        self.broker.audit.append_effect(&e)
    }
}

impl Drop for CallRecord<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.event.duration_ms = elapsed_ms(self.started);
            if self.event.decision.is_empty() {
                self.event.decision = "abandoned";
            }
            // Only a tool call is cut by the budget (a child's calls are serialized, and once
            // the budget is spent no other starts).
            let budget_cut = self.event.kind == "call_tool"
                && self
                    .session
                    .child
                    .as_ref()
                    .is_some_and(|c| c.budget_cut.load(Ordering::SeqCst));
            self.event.outcome = if budget_cut {
                "cancelled_by_budget"
            } else if *self.broker.shutdown.borrow() {
                "cancelled_by_shutdown"
            } else {
                "cancelled_by_disconnect"
            };
            self.broker.audit(self.event.clone());
        }
    }
}

/// The canonical bytes of a request's arguments, its digest, and its share of the argument
/// budget. The parsed tree is dropped here: from now on the call keeps only bytes (a waiting
/// call costs its bytes, not a tree many times their size).
fn take_arguments<'a>(
    broker: &'a Broker,
    s: &Session,
    arguments: Value,
) -> Result<(Arc<str>, String, ArgumentCharge<'a>), Refusal> {
    let nodes = json_nodes(&arguments);
    let canonical = audit::canonical_json(&arguments);
    drop(arguments);
    let args_sha256 = audit::sha256_hex(&canonical);
    let weight = canonical
        .len()
        .saturating_add(nodes.saturating_mul(ARGUMENT_NODE_WEIGHT));
    let Some(charge) = broker.arguments.charge(s.peer.uid, weight) else {
        broker.audit(Event {
            session: Some(s.id.clone()),
            peer_uid: Some(s.peer.uid),
            peer_pid: s.peer.pid,
            kind: "call_tool",
            args_sha256: Some(args_sha256),
            decision: "refused",
            outcome: "arguments_budget_full",
            ..Event::default()
        });
        return Err(Refusal::new(
            Code::Busy,
            &format!(
                "too many argument bytes are in calls in flight (at most {} MiB per agent uid, {} MiB in all); nothing was sent",
                MAX_ARGUMENT_WEIGHT_PER_UID >> 20,
                MAX_ARGUMENT_WEIGHT >> 20
            ),
        )
        .with_certainty("not_sent"));
    };
    // canonical_json writes serde_json's output, which is UTF-8.
    let text: Arc<str> = String::from_utf8(canonical)
        .map_err(|_| Refusal::new(Code::Protocol, "the arguments are not UTF-8"))?
        .into();
    Ok((text, args_sha256, charge))
}

async fn call_tool(broker: &Broker, s: &Session, c: proto::CallTool) -> Result<Value, Refusal> {
    let (arguments, args_sha256, _charge) = take_arguments(broker, s, Value::Object(c.arguments))?;
    // First, before anything tells known tools from unknown ones: an unwritable audit log
    // refuses every call alike.
    let mut record = CallRecord::open(broker, s, "call_tool", &args_sha256)?;
    let snap = match current(broker) {
        Ok(x) => x,
        Err(r) => {
            record.finish("refused", "config_unreadable", None);
            return Err(r);
        }
    };
    let Some(server) = snap.config.server(&c.server) else {
        record.finish("refused", "unknown_tool", None);
        return Err(unknown_tool());
    };
    record.event.server = Some(server.name.as_str().to_owned());
    let ceiling = s.ceiling(&snap.config);
    // Policy and filters first: a hidden tool never starts its server.
    if !exposed(ceiling, server, &c.tool) {
        record.finish("refused", "unknown_tool", None);
        return Err(unknown_tool());
    }
    let (slot, client, catalog) = match session_catalog(broker, s, &snap, server).await {
        Ok(x) => x,
        Err(SlotError::StaleSession) => {
            record.finish("refused", "stale_session", None);
            return Err(Refusal::new(
                Code::Refused,
                &SlotError::StaleSession.to_string(),
            ));
        }
        Err(SlotError::ShuttingDown) => {
            record.finish("refused", "shutting_down", None);
            return Err(Refusal::new(
                Code::ShuttingDown,
                "the broker is shutting down",
            ));
        }
        Err(_) => {
            record.finish("refused", "server_unavailable", None);
            return Err(Refusal::new(
                Code::Failed,
                "the server is unavailable; nothing was sent (the operator can see why in iteron broker status)",
            )
            .with_certainty("not_sent"));
        }
    };
    let generation = slot.generation();
    let Some(tool) = catalog.iter().find(|t| t.name == c.tool) else {
        record.finish("refused", "unknown_tool", None);
        return Err(unknown_tool());
    };
    record.event.tool = Some(tool.name.clone());
    let event = ToolEvent {
        session: s.id.clone(),
        server: server.name.as_str().to_owned(),
        tool: tool.name.clone(),
        arguments,
    };
    let epoch = before_effect(
        broker,
        s,
        &mut record,
        &event,
        &slot,
        generation,
        args_sha256,
    )
    .await?;
    // Exactly the bytes the operator approved are sent; the tree lives only for the call.
    let result = under_cancel(
        &slot,
        epoch,
        s,
        &event,
        client.call_tool(&tool.name, event.arguments_map()),
    )
    .await;
    let secrets = slot.secrets();
    let (answer, outcome, detail) = match result {
        None => cancelled_effect(),
        Some(Ok(p)) => {
            let mut text_out = secrets.scrub(&p.text);
            let mut notes = p.notes.clone();
            if cut_escaped(&mut text_out, MAX_RESULT_TEXT) {
                notes.push(format!(
                    "the result was cut to {MAX_RESULT_TEXT} bytes (as JSON text)"
                ));
            }
            let outcome = if p.is_error { "tool_error" } else { "ok" };
            (
                Ok(json!({"text": text_out, "is_error": p.is_error, "notes": notes})),
                outcome,
                None,
            )
        }
        Some(Err(e)) => failed_effect(&e, &secrets),
    };
    after_effect(broker, s, &mut record, &event, outcome, detail).await;
    answer
}

/// Resources and prompts: what a server offers beside tools. Listing them is like listing
/// tools; reading a resource or getting a prompt runs the server's code like a tool call, so it
/// goes the same way (exposure → `PreToolUse` → approval → `dispatching` record → effect →
/// outcome record → `PostToolUse`), the hooks seeing `resources/read` or `prompts/get` as the
/// tool.
const UNKNOWN_SERVER: &str = "no such server";

/// Most resources or prompts listed from one server; more are dropped with a note.
pub const MAX_LISTED: usize = 1000;
/// Most prompt arguments in one `get_prompt`.
pub const MAX_PROMPT_ARGUMENTS: usize = 64;
/// Longest prompt name or argument name in a request.
pub const MAX_PROMPT_NAME: usize = 256;

fn unknown_server() -> Refusal {
    Refusal::new(Code::UnknownTool, UNKNOWN_SERVER)
}

/// The server a resource or prompt request names, if this session may use it. A server that
/// is not offered answers exactly like one that does not exist, and is never started.
fn reads_server<'a>(
    s: &Session,
    snap: &'a Snapshot,
    name: &str,
) -> Result<&'a ServerConfig, Refusal> {
    let server = snap.config.server(name).ok_or_else(unknown_server)?;
    if !iteron_policy::capability::server_reads_exposed(s.ceiling(&snap.config), &server.policy) {
        return Err(unknown_server());
    }
    Ok(server)
}

/// The audit outcome and the agent's refusal when a server cannot be reached.
fn slot_refusal(e: &SlotError) -> (&'static str, Refusal) {
    match e {
        SlotError::StaleSession => (
            "stale_session",
            Refusal::new(Code::Refused, &SlotError::StaleSession.to_string()),
        ),
        SlotError::ShuttingDown => (
            "shutting_down",
            Refusal::new(Code::ShuttingDown, "the broker is shutting down"),
        ),
        _ => (
            "server_unavailable",
            Refusal::new(
                Code::Failed,
                "the server is unavailable; nothing was sent (the operator can see why in iteron broker status)",
            )
            .with_certainty("not_sent"),
        ),
    }
}

/// An untrusted string field of a server's answer, scrubbed and made terminal-safe.
fn field(v: &Value, key: &str, secrets: &KnownSecrets, max: usize) -> Value {
    match v.get(key).and_then(Value::as_str) {
        Some(t) => Value::String(text::escape_capped(&secrets.scrub(t), max)),
        None => Value::Null,
    }
}

/// `list_resources` and `list_prompts`.
async fn list_reads(
    broker: &Broker,
    s: &Session,
    server_name: &str,
    prompts: bool,
) -> Result<Value, Refusal> {
    let kind = if prompts {
        "list_prompts"
    } else {
        "list_resources"
    };
    let audit = |decision: &'static str, outcome: &'static str, server: Option<String>| {
        broker.audit(Event {
            session: Some(s.id.clone()),
            peer_uid: Some(s.peer.uid),
            peer_pid: s.peer.pid,
            kind,
            server,
            decision,
            outcome,
            ..Event::default()
        });
    };
    let snap = current(broker)?;
    let server = match reads_server(s, &snap, server_name) {
        Ok(x) => x,
        Err(r) => {
            audit("refused", "unknown_server", None);
            return Err(r);
        }
    };
    let name = server.name.as_str().to_owned();
    let (slot, client) = match broker.registry.client(&snap, server).await {
        Ok(x) => x,
        Err(e) => {
            let (outcome, r) = slot_refusal(&e);
            audit("refused", outcome, Some(name));
            return Err(r);
        }
    };
    let listed = if prompts {
        client.list_prompts().await
    } else {
        client.list_resources().await
    };
    let secrets = slot.secrets();
    let items = match listed {
        Ok(v) => v,
        Err(e) => {
            audit("allowed", "failed", Some(name));
            return Err(Refusal::new(
                Code::Failed,
                &secrets.scrub(&format!(
                    "the server did not list its {}: {}",
                    if prompts { "prompts" } else { "resources" },
                    describe_failure(&e, &secrets)
                )),
            ));
        }
    };
    let mut notes = Vec::new();
    let mut out = Vec::new();
    let mut used = 0usize;
    let mut unusable = 0usize;
    for item in items.iter().take(MAX_LISTED) {
        // What the agent sends back (a URI, a prompt or argument name) is passed exactly, or
        // not at all; what it only reads is made terminal-safe and bounded.
        let entry = if prompts {
            let Some(name) = exact(item, "name", valid_name, &secrets) else {
                unusable += 1;
                continue;
            };
            let arguments: Vec<Value> = item
                .get("arguments")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .take(MAX_PROMPT_ARGUMENTS)
                .filter_map(|a| {
                    Some(json!({
                        "name": exact(a, "name", valid_name, &secrets)?,
                        "description": field(a, "description", &secrets, 1024),
                        "required": a.get("required").and_then(Value::as_bool).unwrap_or(false),
                    }))
                })
                .collect();
            json!({
                "name": name,
                "description": field(item, "description", &secrets, 2048),
                "arguments": arguments,
            })
        } else {
            let Some(uri) = exact(item, "uri", valid_uri, &secrets) else {
                unusable += 1;
                continue;
            };
            json!({
                "uri": uri,
                "name": field(item, "name", &secrets, 256),
                "description": field(item, "description", &secrets, 2048),
                "mime_type": field(item, "mimeType", &secrets, 128),
            })
        };
        if !push_bounded(&mut out, entry, &mut used) {
            break;
        }
    }
    if unusable > 0 {
        notes.push(format!(
            "{unusable} entries were left out: a name or uri that is empty, too long, holds a control character or a secret"
        ));
    }
    if out.len() + unusable < items.len() {
        notes.push(format!(
            "{} of {} entries are shown (at most {MAX_LISTED}, and {MAX_RESULT_TEXT} bytes)",
            out.len(),
            items.len()
        ));
    }
    audit("allowed", "ok", Some(name));
    Ok(if prompts {
        json!({"prompts": out, "notes": notes})
    } else {
        json!({"resources": out, "notes": notes})
    })
}

fn valid_uri(u: &str) -> bool {
    !u.is_empty() && u.len() <= proto::MAX_RESOURCE_URI && !u.chars().any(char::is_control)
}

fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= MAX_PROMPT_NAME && !n.chars().any(char::is_control)
}

/// A name or URI the agent must be able to send back exactly: passed raw (JSON carries it
/// safely; the CLI escapes what it prints) if it is usable and holds no secret, else `None`.
fn exact(v: &Value, key: &str, valid: fn(&str) -> bool, secrets: &KnownSecrets) -> Option<String> {
    let raw = v.get(key).and_then(Value::as_str).filter(|t| valid(t))?;
    (secrets.scrub(raw) == raw).then(|| raw.to_owned())
}

/// Add `entry` to `out` while the entries stay within `*budget` bytes of JSON (so an answer
/// always fits in a frame); `false` once one would not.
fn push_bounded(out: &mut Vec<Value>, entry: Value, budget: &mut usize) -> bool {
    let size = serde_json::to_vec(&entry).map_or(usize::MAX, |v| v.len());
    if budget.saturating_add(size) > MAX_RESULT_TEXT {
        return false;
    }
    *budget += size;
    out.push(entry);
    true
}

/// One read a server performs for the agent.
enum Read {
    Resource(String),
    Prompt(String, Map<String, Value>),
}

/// `read_resource` and `get_prompt`: approved per call, audited before and after.
async fn server_read(
    broker: &Broker,
    s: &Session,
    server_name: &str,
    read: Read,
) -> Result<Value, Refusal> {
    let (kind, method, args) = match &read {
        Read::Resource(uri) => ("read_resource", "resources/read", json!({"uri": uri})),
        Read::Prompt(name, arguments) => (
            "get_prompt",
            "prompts/get",
            json!({"name": name, "arguments": arguments}),
        ),
    };
    let (arguments, args_sha256, _charge) = take_arguments(broker, s, args)?;
    let mut record = CallRecord::open(broker, s, kind, &args_sha256)?;
    let snap = match current(broker) {
        Ok(x) => x,
        Err(r) => {
            record.finish("refused", "config_unreadable", None);
            return Err(r);
        }
    };
    let server = match reads_server(s, &snap, server_name) {
        Ok(x) => x,
        Err(r) => {
            record.finish("refused", "unknown_server", None);
            return Err(r);
        }
    };
    record.event.server = Some(server.name.as_str().to_owned());
    // The request's own bounds, before anything starts or reaches the operator.
    let malformed = match &read {
        Read::Resource(uri) => (!valid_uri(uri)).then_some(
            "the uri is empty, over 2048 bytes or holds a control character; nothing was sent",
        ),
        Read::Prompt(name, arguments) => (!valid_name(name)
            || arguments.len() > MAX_PROMPT_ARGUMENTS
            || arguments.keys().any(|k| !valid_name(k)))
        .then_some(
            "the prompt name or an argument name is empty, over 256 bytes or holds a control character, or there are over 64 arguments; nothing was sent",
        ),
    };
    if let Some(why) = malformed {
        record.finish("refused", "bad_request", None);
        return Err(Refusal::new(Code::Refused, why).with_certainty("not_sent"));
    }
    let (slot, client) = match broker.registry.client(&snap, server).await {
        Ok(x) => x,
        Err(e) => {
            let (outcome, r) = slot_refusal(&e);
            record.finish("refused", outcome, None);
            return Err(r);
        }
    };
    let generation = slot.generation();
    // The tool hooks run around this effect too, with the MCP method as the tool's name.
    let event = ToolEvent {
        session: s.id.clone(),
        server: server.name.as_str().to_owned(),
        tool: method.to_owned(),
        arguments,
    };
    let epoch = before_effect(
        broker,
        s,
        &mut record,
        &event,
        &slot,
        generation,
        args_sha256,
    )
    .await?;
    let effect = async {
        match &read {
            Read::Resource(uri) => client.read_resource(uri).await,
            Read::Prompt(name, arguments) => client.get_prompt(name, arguments.clone()).await,
        }
    };
    let result = under_cancel(&slot, epoch, s, &event, effect).await;
    let secrets = slot.secrets();
    let (answer, outcome, detail) = match result {
        None => cancelled_effect(),
        Some(Ok(v)) => (
            Ok(match &read {
                Read::Resource(_) => project_contents(&v, &secrets),
                Read::Prompt(..) => project_prompt(&v, &secrets),
            }),
            "ok",
            None,
        ),
        Some(Err(e)) => failed_effect(&e, &secrets),
    };
    after_effect(broker, s, &mut record, &event, outcome, detail).await;
    answer
}

/// What every effect goes through between exposure and the effect itself: the `PreToolUse`
/// hooks (not for a child), the operator's approval, the checks that the server is still the
/// one the request was prepared for and was not cancelled meanwhile, and the `dispatching`
/// record (if it cannot be written, nothing is sent). Returns the cancel epoch the effect runs
/// under; on any refusal the call's record is finished and nothing was sent.
async fn before_effect(
    broker: &Broker,
    s: &Session,
    record: &mut CallRecord<'_>,
    event: &ToolEvent,
    slot: &Slot,
    generation: u64,
    args_sha256: String,
) -> Result<u64, Refusal> {
    let verdict = if s.child.is_none() {
        let (verdict, reports) = broker.hooks.pre_tool_use(event).await;
        broker.audit_hooks(Some(&s.id), s.peer, &reports);
        verdict
    } else {
        Verdict::NoOpinion
    };
    if let Verdict::Block(reason) = verdict {
        record.finish("blocked_by_hook", "refused", None);
        // Escaped once (by the hook runner), and capped so the certainty always fits.
        return Err(
            Refusal::rendered(Code::Refused, &crate::hooks::block_message(&reason))
                .with_certainty("not_sent"),
        );
    }
    record.event.decision = "awaiting_approval";
    // A cancel, restart or stop of this server from now on also stops this call.
    let epoch = slot.cancel_epoch();
    // Approval rules (broker/src/rules.rs): the operator's own rules approve or refuse ahead
    // of time; whatever they leave undecided goes on to the operator as before.
    // Judged on the rules as they are now: a rule the operator removed no longer approves.
    let snap = match current(broker) {
        Ok(x) => x,
        Err(r) => {
            record.finish("refused", "config_unreadable", None);
            return Err(r);
        }
    };
    let judged = crate::rules::judge(
        &broker.rules,
        &s.rule_counts,
        &snap.config.approvals,
        &crate::rules::Facts {
            server: &event.server,
            tool: &event.tool,
            arguments: &event.arguments,
            args_sha256: &args_sha256,
            uid: s.peer.uid,
            identity: s.child.as_ref().map(|c| c.def.identity.as_str()),
        },
    );
    let (approval, note) = match judged {
        crate::rules::Judged::Approved(mark) => {
            record.event.detail = Some(mark.detail());
            record.rule = Some(mark);
            (Ok(()), None)
        }
        crate::rules::Judged::Denied(mark) => {
            record.finish("denied_by_rule", "refused", Some(mark.detail()));
            return Err(crate::rules::denied_refusal(&mark));
        }
        crate::rules::Judged::Ask { note, park } => {
            let preview = approvals::Arguments::from_canonical(Arc::clone(&event.arguments));
            let info = CallInfo {
                session: s.id.clone(),
                peer_uid: s.peer.uid,
                peer_pid: s.peer.pid,
                server: event.server.clone(),
                tool: event.tool.clone(),
                args_sha256,
                arguments: preview,
            };
            (broker.approvals.approve_or_park(info, park).await, note)
        }
    };
    if let Err(why) = approval {
        let (code, outcome, msg) = not_approved(why);
        record.finish(
            if outcome == "denied" {
                "denied"
            } else {
                "refused"
            },
            outcome,
            note.clone(),
        );
        let msg = crate::rules::with_note(&msg, note.as_deref());
        return Err(Refusal::new(code, &msg).with_certainty("not_sent"));
    }
    record.event.decision = "approved";
    // The operator may have restarted or stopped the server while the call waited: never send
    // it to a different (or closed) connection than the one it was prepared for.
    if slot.generation() != generation || !slot.is_ready() {
        record.finish("approved", "server_restarted", None);
        return Err(Refusal::new(
            Code::Failed,
            "the server was restarted or stopped while the call waited for approval; nothing was sent",
        )
        .with_certainty("not_sent"));
    }
    if slot.cancel_epoch() != epoch {
        record.finish("approved", "cancelled_by_operator", None);
        return Err(Refusal::new(
            Code::Cancelled,
            "the operator cancelled calls on this server while this one waited; nothing was sent",
        )
        .with_certainty("not_sent"));
    }
    // The effect is audited before it happens.
    if let Err(gate) = record.dispatching() {
        record.finish("approved", gate.outcome(), None);
        return Err(Refusal::new(Code::Refused, gate.refusal()).with_certainty("not_sent"));
    }
    Ok(epoch)
}

/// Run `effect` as one call on `slot`: `None` if the operator cancels calls on the server (a
/// cancel, restart or stop) before it completes.
async fn under_cancel<T>(
    slot: &Slot,
    epoch: u64,
    s: &Session,
    event: &ToolEvent,
    effect: impl Future<Output = T>,
) -> Option<T> {
    let mut guard = slot.begin_call(
        epoch,
        approvals::CallContext {
            session: s.id.clone(),
            peer_uid: s.peer.uid,
            tool: event.tool.clone(),
        },
    );
    tokio::select! {
        biased;
        _ = guard.cancelled.changed() => None,
        r = effect => Some(r),
    }
}

type EffectEnd = (Result<Value, Refusal>, &'static str, Option<String>);

/// An effect the operator cancelled while it ran.
fn cancelled_effect() -> EffectEnd {
    (
        Err(Refusal::new(
            Code::Cancelled,
            "the operator cancelled calls on this server; the call may or may not have been applied",
        )
        .with_certainty("maybe_applied")),
        "cancelled_by_operator",
        Some("certainty maybe_applied".to_owned()),
    )
}

/// An effect that failed: the agent gets a fixed description (or the server's own error) and
/// the certainty; the audit record also gets the full failure, scrubbed.
fn failed_effect(e: &McpError, secrets: &KnownSecrets) -> EffectEnd {
    let certainty = e.certainty().as_str();
    let msg = secrets.scrub(&describe_failure(e, secrets));
    let failure = secrets.scrub(&e.to_string());
    (
        Err(Refusal::new(Code::Failed, &msg).with_certainty(certainty)),
        "failed",
        Some(format!("certainty {certainty}; {failure}")),
    )
}

/// Record an effect's outcome, then run the `PostToolUse` hooks (not for a child). The outcome
/// is recorded first: an agent that goes away during a hook cannot turn an applied effect into
/// a "cancelled" record.
async fn after_effect(
    broker: &Broker,
    s: &Session,
    record: &mut CallRecord<'_>,
    event: &ToolEvent,
    outcome: &'static str,
    detail: Option<String>,
) {
    record.finish("approved", outcome, detail);
    if s.child.is_none() {
        let reports = broker.hooks.post_tool_use(event, outcome).await;
        broker.audit_hooks(Some(&s.id), s.peer, &reports);
    }
}

/// `t` scrubbed and cut to what is left of `*used`'s budget of [`MAX_RESULT_TEXT`] bytes of
/// JSON, which it then uses up.
fn budgeted_text(
    t: &str,
    secrets: &KnownSecrets,
    used: &mut usize,
    notes: &mut Vec<String>,
) -> String {
    let mut t = secrets.scrub(t);
    if cut_escaped(&mut t, MAX_RESULT_TEXT.saturating_sub(*used)) {
        notes.push(format!(
            "the answer was cut to {MAX_RESULT_TEXT} bytes (as JSON text)"
        ));
    }
    *used += serde_json::to_string(&t).map_or(t.len(), |j| j.len().saturating_sub(2));
    t
}

/// The room the fields of one entry need besides its text (its other strings and the JSON
/// around them), charged before the text so that the whole answer stays bounded.
fn charge(entry: &Value, used: &mut usize) -> bool {
    let size = serde_json::to_vec(entry).map_or(usize::MAX, |v| v.len());
    if used.saturating_add(size) > MAX_RESULT_TEXT {
        return false;
    }
    *used += size;
    true
}

/// A `resources/read` answer as the agent gets it: text contents scrubbed, bounded together
/// (text and the other fields) to [`MAX_RESULT_TEXT`] bytes; binary contents named in a note.
fn project_contents(v: &Value, secrets: &KnownSecrets) -> Value {
    let mut notes = Vec::new();
    let mut used = 0usize;
    let mut contents = Vec::new();
    let all: &[Value] = v
        .get("contents")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice);
    for c in all.iter().take(MAX_LISTED) {
        if let Some(t) = c.get("text").and_then(Value::as_str) {
            let mut entry = json!({
                "uri": field(c, "uri", secrets, proto::MAX_RESOURCE_URI),
                "mime_type": field(c, "mimeType", secrets, 128),
                "text": "",
            });
            if !charge(&entry, &mut used) {
                notes.push(format!(
                    "the answer was cut to {MAX_RESULT_TEXT} bytes (as JSON text)"
                ));
                break;
            }
            entry["text"] = Value::String(budgeted_text(t, secrets, &mut used, &mut notes));
            contents.push(entry);
        } else if let Some(b) = c.get("blob").and_then(Value::as_str) {
            notes.push(format!(
                "a binary content of {} bytes (base64) was left out",
                b.len()
            ));
        } else {
            notes.push("a content without text was left out".to_owned());
        }
    }
    if all.len() > MAX_LISTED {
        notes.push(format!("{MAX_LISTED} of {} contents are shown", all.len()));
    }
    notes.truncate(MAX_NOTES);
    notes.dedup();
    json!({"contents": contents, "notes": notes})
}

/// Most notes in one answer.
const MAX_NOTES: usize = 32;

/// A `prompts/get` answer as the agent gets it: text messages (and an embedded resource's
/// text) scrubbed and bounded like [`project_contents`]; other content named in a note, in a
/// fixed vocabulary (the server's own `type` string is never echoed).
fn project_prompt(v: &Value, secrets: &KnownSecrets) -> Value {
    let mut notes = Vec::new();
    let description = field(v, "description", secrets, 2048);
    let mut used = serde_json::to_vec(&description).map_or(0, |d| d.len());
    let mut messages = Vec::new();
    let all: &[Value] = v
        .get("messages")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice);
    for m in all.iter().take(MAX_LISTED) {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                notes.push("a message with an unknown role was left out".to_owned());
                continue;
            }
        };
        let content = m.get("content").unwrap_or(&Value::Null);
        let kind = content.get("type").and_then(Value::as_str);
        let text = match kind {
            Some("text") => content.get("text").and_then(Value::as_str),
            Some("resource") => content
                .get("resource")
                .and_then(|r| r.get("text"))
                .and_then(Value::as_str),
            _ => None,
        };
        let Some(t) = text else {
            notes.push(
                match kind {
                    Some("image") => "an image content was left out",
                    Some("audio") => "an audio content was left out",
                    Some("resource_link") => "a resource link was left out",
                    Some("resource") => "a binary embedded resource was left out",
                    _ => "a non-text content was left out",
                }
                .to_owned(),
            );
            continue;
        };
        let mut entry = json!({"role": role, "text": ""});
        if !charge(&entry, &mut used) {
            notes.push(format!(
                "the answer was cut to {MAX_RESULT_TEXT} bytes (as JSON text)"
            ));
            break;
        }
        entry["text"] = Value::String(budgeted_text(t, secrets, &mut used, &mut notes));
        messages.push(entry);
    }
    if all.len() > MAX_LISTED {
        notes.push(format!("{MAX_LISTED} of {} messages are shown", all.len()));
    }
    notes.truncate(MAX_NOTES);
    notes.dedup();
    json!({
        "description": description,
        "messages": messages,
        "notes": notes,
    })
}

/// What the agent is told, and the audit outcome, when a call was not approved.
fn not_approved(why: NotApproved) -> (Code, &'static str, String) {
    match why {
        NotApproved::Noninteractive => (
            Code::ApprovalRequired,
            "approval_required",
            "this call needs an operator's approval (no approval rule approves it), and this broker is noninteractive; nothing was sent".to_owned(),
        ),
        NotApproved::Denied => (
            Code::Refused,
            "denied",
            "the operator denied this call; nothing was sent".to_owned(),
        ),
        NotApproved::TimedOut => (
            Code::Refused,
            "approval_timed_out",
            "no operator approved this call in time; nothing was sent".to_owned(),
        ),
        NotApproved::Full => (
            Code::Busy,
            "approval_queue_full",
            format!(
                "{} calls are already waiting for approval; nothing was sent",
                approvals::MAX_PENDING
            ),
        ),
        NotApproved::ShuttingDown => (
            Code::ShuttingDown,
            "shutting_down",
            "the broker is shutting down; nothing was sent".to_owned(),
        ),
    }
}

/// Cut `text` so that its JSON-escaped form is at most `max` bytes (control characters take six
/// bytes escaped, so the raw length alone could still overflow a frame). Returns whether it cut.
fn cut_escaped(text: &mut String, max: usize) -> bool {
    let mut size = 0usize;
    for (i, c) in text.char_indices() {
        size += match c {
            '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
            c if (c as u32) < 0x20 => 6,
            c => c.len_utf8(),
        };
        if size > max {
            text.truncate(i);
            return true;
        }
    }
    false
}

/// What the agent is told when a call fails: the server's own error message (its answer to
/// the call), or a fixed description — never transport details such as host names, addresses
/// or zones, which stay in the audit record and `iteron broker status`.
fn describe_failure(e: &McpError, secrets: &KnownSecrets) -> String {
    use crate::mcp::TransportErrorKind as K;
    match e {
        // Scrubbed before it is cut and escaped: a secret cut in half, or escaped, would no
        // longer be recognised.
        McpError::Rpc { error, .. } => format!(
            "the server answered with an error: {}",
            text::single_line_capped(&secrets.scrub(&error.message), 300)
        ),
        McpError::Transport(t) => match t.kind {
            K::Timeout => "the call did not complete in time".to_owned(),
            K::Unauthorized { .. } => "the server refused the broker's credentials".to_owned(),
            _ => "the connection to the server failed".to_owned(),
        },
        McpError::Protocol { .. } => "the server broke the protocol".to_owned(),
        McpError::Limit { what, max } => format!("a bound was exceeded: {what} (at most {max})"),
        McpError::InputRefused(why) => format!("the server needed input that was refused: {why}"),
        McpError::UnknownTool => "unknown tool".to_owned(),
        McpError::AfterInputRounds { rounds, error } => format!(
            "{} (after {rounds} input rounds had reached the server)",
            describe_failure(error, secrets)
        ),
        _ => "the tool call failed".to_owned(),
    }
}

async fn operator(broker: &Broker, peer: Peer, req: Request) -> Result<Value, Refusal> {
    let not_found = || Refusal::new(Code::NotFound, "no such server");
    let control = |kind: &'static str, server: &str| {
        broker.audit(Event {
            peer_uid: Some(peer.uid),
            peer_pid: peer.pid,
            kind,
            server: Some(server.to_owned()),
            decision: "allowed",
            outcome: "ok",
            ..Event::default()
        });
    };
    match req {
        Request::Status(a) => {
            let servers = broker
                .registry
                .status(a.server.as_deref())
                .ok_or_else(not_found)?;
            Ok(json!({
                "servers": servers,
                "interactive": broker.approvals.interactive(),
                "audit": broker.audit.state_json(),
            }))
        }
        Request::Cancel(a) => {
            let n = broker.registry.cancel(&a.server).ok_or_else(not_found)?;
            control("operator_cancel", &a.server);
            Ok(json!({"cancelled": n}))
        }
        Request::Restart(a) => {
            broker
                .registry
                .restart(&a.server, false)
                .await
                .ok_or_else(not_found)?;
            control("operator_restart", &a.server);
            Ok(json!({}))
        }
        Request::Stop(a) => {
            broker
                .registry
                .restart(&a.server, true)
                .await
                .ok_or_else(not_found)?;
            control("operator_stop", &a.server);
            Ok(json!({}))
        }
        Request::Logout(a) => {
            let outcome = broker
                .registry
                .logout_external(&a.server)
                .await
                .ok_or_else(not_found)?
                .map_err(|e| Refusal::new(Code::Failed, &e))?;
            control("operator_logout", &a.server);
            Ok(json!({"revoked": match outcome {
                crate::servers::ExternalLogout::NoRevokeUrl => "no_revoke_url",
                crate::servers::ExternalLogout::Revoked(r) => match r {
                    crate::oauth::Revoked::Revoked => "revoked",
                    crate::oauth::Revoked::NothingToRevoke => "nothing_to_revoke",
                    crate::oauth::Revoked::NotOffered => "no_revoke_url",
                    crate::oauth::Revoked::Failed => "failed",
                },
            }}))
        }
        Request::Catalog => Ok(broker.catalog.snapshot_json()),
        Request::Show(s) => broker.approvals.show(s.id, s.offset),
        Request::Pending(p) => {
            // Decoding refused anything over MAX_PENDING_WAIT_MS; the min only restates it.
            let wait = Duration::from_millis(p.wait_ms.min(proto::MAX_PENDING_WAIT_MS));
            Ok(json!({"pending": broker.approvals.list_wait(wait).await}))
        }
        Request::Decide(d) => {
            // Each call is decided — and audited — on its own, also when several are named.
            if d.args_sha256.is_some() && (d.id.is_none() || !d.ids.is_empty()) {
                return Err(Refusal::new(
                    Code::Refused,
                    "a digest names one call: give it with id, not ids",
                ));
            }
            let mut decided = Vec::new();
            let mut missing = Vec::new();
            let mut last = crate::approvals::Decided::NotWaiting;
            for item in d.all() {
                // Deferred approval: a parked call is approved only with its digest.
                last = broker
                    .approvals
                    .decide_checked(item, d.approve, d.args_sha256.as_deref());
                broker.audit(Event {
                    peer_uid: Some(peer.uid),
                    peer_pid: peer.pid,
                    kind: "operator_decide",
                    args_sha256: d
                        .args_sha256
                        .clone()
                        .filter(|x| iteron_policy::rules::Sha256Hex::parse(x).is_some()),
                    decision: if d.approve { "approved" } else { "denied" },
                    outcome: last.outcome(),
                    detail: Some(format!("pending item {item}")),
                    ..Event::default()
                });
                if last == crate::approvals::Decided::Done {
                    decided.push(item);
                } else {
                    missing.push(item);
                }
            }
            if d.id.is_some() && decided.is_empty() {
                Err(match last {
                    crate::approvals::Decided::DigestRequired => Refusal::new(
                        Code::Refused,
                        "this call was parked by a noninteractive broker: approve it with its args_sha256",
                    ),
                    crate::approvals::Decided::DigestMismatch => Refusal::new(
                        Code::Refused,
                        "the digest is not that of the waiting call; nothing was decided",
                    ),
                    _ => Refusal::new(Code::NotFound, "no such call is waiting"),
                })
            } else {
                Ok(json!({"decided": decided, "not_found": missing}))
            }
        }
        Request::Answer(a) => {
            let answer = match a.action {
                proto::FormAction::Accept => FormAnswer::Accept(a.content),
                proto::FormAction::Decline => FormAnswer::Decline,
                proto::FormAction::Cancel => FormAnswer::Cancel,
            };
            let action = match &answer {
                FormAnswer::Accept(_) => "accepted",
                FormAnswer::Decline => "declined",
                FormAnswer::Cancel => "cancelled",
            };
            let result = broker.approvals.answer(a.id, answer);
            broker.audit(Event {
                peer_uid: Some(peer.uid),
                peer_pid: peer.pid,
                kind: "operator_answer",
                decision: action,
                outcome: if result.is_ok() { "ok" } else { "refused" },
                detail: Some(format!("form {}", a.id)),
                ..Event::default()
            });
            match result {
                Ok(()) => Ok(json!({})),
                Err(crate::approvals::AnswerError::NotWaiting) => {
                    Err(Refusal::new(Code::NotFound, "no such form is waiting"))
                }
                Err(crate::approvals::AnswerError::Invalid(why)) => Err(Refusal::new(
                    Code::Refused,
                    &format!("the answer does not fit the form: {why}"),
                )),
            }
        }
        _ => Err(Refusal::new(Code::Protocol, "request not allowed here")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn results_are_cut_by_their_escaped_size_at_the_limit_and_one_over() {
        let mut exact = "a".repeat(MAX_RESULT_TEXT);
        assert!(!cut_escaped(&mut exact, MAX_RESULT_TEXT));
        assert_eq!(exact.len(), MAX_RESULT_TEXT);
        let mut over = "a".repeat(MAX_RESULT_TEXT + 1);
        assert!(cut_escaped(&mut over, MAX_RESULT_TEXT));
        assert_eq!(over.len(), MAX_RESULT_TEXT);
        // Escapes count as they are sent: a control character is six bytes, a quote two.
        let mut ctl = format!("{}\u{1}", "a".repeat(MAX_RESULT_TEXT - 6));
        assert!(!cut_escaped(&mut ctl, MAX_RESULT_TEXT));
        let mut ctl = format!("{}\u{1}", "a".repeat(MAX_RESULT_TEXT - 5));
        assert!(cut_escaped(&mut ctl, MAX_RESULT_TEXT));
        assert_eq!(ctl.len(), MAX_RESULT_TEXT - 5);
        // Never inside a character.
        let mut wide = "é".repeat(MAX_RESULT_TEXT / 2 + 1);
        assert!(cut_escaped(&mut wide, MAX_RESULT_TEXT));
        assert_eq!(wide.len(), MAX_RESULT_TEXT);
        crate::test_report::record(
            "P5",
            "broker/src/daemon.rs::results_are_cut_by_their_escaped_size_at_the_limit_and_one_over",
            serde_json::json!({"max_result_text": MAX_RESULT_TEXT}),
        );
    }

    fn canary_secrets() -> KnownSecrets {
        let learned = crate::servers::LearnedSecrets::default();
        assert!(learned.learn("canary-5e1f0a"));
        KnownSecrets::default().with_learned(learned)
    }

    #[test]
    fn read_answers_are_bounded_scrubbed_and_never_echo_a_server_type() {
        let secrets = canary_secrets();
        // 1000 contents with the longest URIs and big texts: the answer stays in a frame.
        let long_uri = format!("demo://{}", "u".repeat(2040));
        let contents: Vec<Value> = (0..1200)
            .map(|i| json!({"uri": long_uri, "mimeType": "text/plain", "text": format!("{i} canary-5e1f0a {}", "t".repeat(4000))}))
            .collect();
        let v = project_contents(&json!({"contents": contents}), &secrets);
        let size = serde_json::to_vec(&v).unwrap().len();
        assert!(size <= MAX_RESULT_TEXT + 4096, "{size}");
        assert!(size <= frame::MAX_FRAME);
        assert!(!v.to_string().contains("canary-5e1f0a"));
        assert!(v["notes"].to_string().contains("cut"), "{}", v["notes"]);
        // A prompt: unknown content types are named in a fixed vocabulary.
        let v = project_prompt(
            &json!({"description": "d canary-5e1f0a", "messages": [
                {"role": "user", "content": {"type": "text", "text": "hello canary-5e1f0a"}},
                {"role": "user", "content": {"type": "canary-5e1f0a-evil\u{1b}[2J"}},
                {"role": "system", "content": {"type": "text", "text": "x"}},
                {"role": "assistant", "content": {"type": "image", "data": "AAAA"}}
            ]}),
            &secrets,
        );
        let shown = v.to_string();
        assert!(
            !shown.contains("canary") && !shown.contains("evil"),
            "{shown}"
        );
        assert_eq!(v["messages"].as_array().unwrap().len(), 1);
        assert_eq!(v["messages"][0]["text"], "hello [REDACTED]");
        let notes: Vec<&str> = v["notes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect();
        assert_eq!(
            notes,
            [
                "a non-text content was left out",
                "a message with an unknown role was left out",
                "an image content was left out"
            ]
        );
    }

    /// Server answers shaped like `resources/read` and `prompts/get`: arbitrary strings where
    /// the fields go, the configured secret planted in some of them (in every field that can
    /// reach the agent), and arbitrary JSON in places.
    fn arb_server_answer() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let text = || {
            prop_oneof![
                any::<String>(),
                any::<String>().prop_map(|s| format!("{s}canary-5e1f0a{s}")),
            ]
        };
        let content = (
            prop_oneof![Just("text"), Just("resource"), Just("image"), Just("x")],
            text(),
        )
            .prop_map(|(kind, t)| {
                json!({"type": kind, "text": t, "resource": {"text": t}, "data": "AAAA"})
            });
        let message = (
            prop_oneof![Just("user"), Just("assistant"), Just("system")],
            content,
        )
            .prop_map(|(role, content)| json!({"role": role, "content": content}));
        let item = (text(), text(), text(), any::<bool>()).prop_map(|(uri, mime, t, blob)| {
            if blob {
                json!({"uri": uri, "mimeType": mime, "blob": t})
            } else {
                json!({"uri": uri, "mimeType": mime, "text": t})
            }
        });
        (
            prop::collection::vec(item, 0..6),
            prop::collection::vec(message, 0..6),
            text(),
            any::<i64>(),
        )
            .prop_map(|(contents, messages, description, n)| {
                json!({"contents": contents, "messages": messages, "description": description, "noise": n})
            })
    }

    /// Any server answer, projected as a resource read or a prompt: never a panic, never the
    /// configured secret, always within the answer's bound; names passed back exactly are
    /// always usable. Counted for the security report.
    #[test]
    fn projections_fuzzed_record() {
        let secrets = canary_secrets();
        let mut runner =
            proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(512));
        let executions = std::cell::Cell::new(0u64);
        let redacted = std::cell::Cell::new(0u64);
        runner
            .run(&arb_server_answer(), |v| {
                executions.set(executions.get() + 1);
                for out in [project_contents(&v, &secrets), project_prompt(&v, &secrets)] {
                    let shown = out.to_string();
                    proptest::prop_assert!(!shown.contains("canary-5e1f0a"));
                    proptest::prop_assert!(shown.len() <= MAX_RESULT_TEXT + 64 * 1024);
                    if shown.contains("[REDACTED]") {
                        redacted.set(redacted.get() + 1);
                    }
                }
                for item in v["contents"].as_array().into_iter().flatten() {
                    if let Some(x) = exact(item, "uri", valid_uri, &secrets) {
                        proptest::prop_assert!(valid_uri(&x) && !x.contains("canary-5e1f0a"));
                    }
                }
                Ok(())
            })
            .unwrap();
        // The secret did reach the projections (and was scrubbed) in many cases.
        assert!(redacted.get() > 50, "{}", redacted.get());
        let executions = executions.get();
        crate::test_report::record(
            "P10",
            "broker/src/daemon.rs::projections_fuzzed_record",
            serde_json::json!({"executions": executions, "crashes": 0}),
        );
    }

    #[test]
    fn names_the_agent_sends_back_are_exact_or_left_out() {
        let secrets = canary_secrets();
        let item = |name: &str| json!({"name": name});
        let got = |name: &str| exact(&item(name), "name", valid_name, &secrets);
        assert_eq!(got("a\\b ü"), Some("a\\b ü".to_owned()));
        assert_eq!(
            got(&"n".repeat(MAX_PROMPT_NAME)),
            Some("n".repeat(MAX_PROMPT_NAME))
        );
        assert_eq!(got(&"n".repeat(MAX_PROMPT_NAME + 1)), None);
        assert_eq!(got("bell\u{7}"), None);
        assert_eq!(got(""), None);
        assert_eq!(got("has canary-5e1f0a"), None);
        let uri = |u: &str| exact(&json!({"uri": u}), "uri", valid_uri, &secrets);
        let max = format!("x://{}", "u".repeat(proto::MAX_RESOURCE_URI - 4));
        assert_eq!(uri(&max), Some(max.clone()));
        assert_eq!(uri(&format!("{max}u")), None);
    }

    #[test]
    fn a_peer_that_stops_reading_is_given_up_after_the_write_deadline() {
        // The connection's writer runs `write_answers` with this deadline.
        assert_eq!(WRITE_DEADLINE, Duration::from_secs(30));
        let big = vec![b'x'; 64 * 1024];
        // A reader that starts draining within the deadline gets every frame (a generous
        // deadline: a loaded machine must not make this fail).
        let deadline = Duration::from_secs(3);
        rt().block_on(async {
            let (mut wr, mut rd) = tokio::io::duplex(1024);
            let (tx, mut rx) = mpsc::channel(4);
            tx.send(big.clone()).await.unwrap();
            tx.send(big.clone()).await.unwrap();
            drop(tx);
            let reader = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut got = Vec::new();
                tokio::io::AsyncReadExt::read_to_end(&mut rd, &mut got)
                    .await
                    .unwrap();
                got.len()
            });
            write_answers(&mut wr, &mut rx, deadline).await;
            drop(wr);
            assert_eq!(reader.await.unwrap(), 2 * (4 + big.len()));
        });
        // A reader that never reads: the writer stops at the deadline, leaving the rest queued.
        let deadline = Duration::from_millis(300);
        rt().block_on(async {
            let (mut wr, _rd) = tokio::io::duplex(1024);
            let (tx, mut rx) = mpsc::channel(4);
            tx.send(big.clone()).await.unwrap();
            tx.send(big.clone()).await.unwrap();
            let t = Instant::now();
            write_answers(&mut wr, &mut rx, deadline).await;
            let took = t.elapsed();
            assert!(took >= deadline, "{took:?}");
            assert!(took < deadline * 10, "{took:?}");
            assert!(rx.try_recv().is_ok(), "the second frame was not attempted");
        });
        crate::test_report::record(
            "P5",
            "broker/src/daemon.rs::a_peer_that_stops_reading_is_given_up_after_the_write_deadline",
            serde_json::json!({"write_deadline_s": WRITE_DEADLINE.as_secs()}),
        );
    }

    #[test]
    fn argument_weight_is_bounded_per_uid_and_in_all_at_the_limit_and_one_over() {
        let mut w = (HashMap::new(), 0usize);
        assert!(charge_step(&mut w, 1, 10, 10, 15));
        // One over the uid's bound.
        assert!(!charge_step(&mut w, 1, 1, 10, 15));
        // Another uid, up to the total bound and one over.
        assert!(charge_step(&mut w, 2, 5, 10, 15));
        assert!(!charge_step(&mut w, 3, 1, 10, 15));
        let budget = ArgumentBudget::default();
        let a = budget.charge(7, MAX_ARGUMENT_WEIGHT_PER_UID).unwrap();
        assert!(budget.charge(7, 1).is_none());
        // A refused charge gives nothing back.
        assert_eq!(budget.lock().1, MAX_ARGUMENT_WEIGHT_PER_UID);
        drop(a);
        // Given back when the call ends.
        assert!(budget.charge(7, 1).is_some());
        assert!(budget.lock().0.is_empty());
        assert_eq!(json_nodes(&json!({"a": [{}, 1, "x"], "b": null})), 6);
        crate::test_report::record(
            "P5",
            "broker/src/daemon.rs::argument_weight_is_bounded_per_uid_and_in_all_at_the_limit_and_one_over",
            serde_json::json!({"per_uid": MAX_ARGUMENT_WEIGHT_PER_UID, "total": MAX_ARGUMENT_WEIGHT}),
        );
    }

    #[test]
    fn refused_peer_records_are_bounded_per_second_one_over() {
        let mut w = (0, 0, 0);
        for _ in 0..MAX_REFUSED_RECORDS_PER_SEC {
            assert_eq!(refused_step(&mut w, 7), (true, 0));
        }
        // One over: counted, not recorded.
        assert_eq!(refused_step(&mut w, 7), (false, 0));
        assert_eq!(refused_step(&mut w, 7), (false, 0));
        // The next second's first record carries the count.
        assert_eq!(refused_step(&mut w, 8), (true, 2));
        assert_eq!(refused_step(&mut w, 8), (true, 0));
        crate::test_report::record(
            "P5",
            "broker/src/daemon.rs::refused_peer_records_are_bounded_per_second_one_over",
            serde_json::json!({}),
        );
    }
}
