//! The broker's live servers: one slot per configured server, lazy (nothing starts before the
//! first request that needs it), with a phase, a generation (bumped at every successful
//! connect), the negotiated version and the retained catalog. The operator can cancel a
//! server's in-flight calls, restart it (clears the catalog; the next request reconnects) or
//! stop it (it stays down until restarted).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::watch;

use iteron_policy::config::{Config, ServerConfig};

use crate::approvals::Approvals;
use crate::mcp::client::{Client, Options, Tool};
use crate::servers::{self, ConnectError, KnownSecrets};
use crate::store::Home;

/// Reads the operator-named variables (`env`, `header_env`, …) from the broker's environment.
pub type Lookup = Arc<dyn Fn(&str) -> Option<OsString> + Send + Sync>;

/// Deadline of connecting and negotiating with a server.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(30);

/// How long a stdio server started by the broker has from its start to a negotiated version.
/// It ends before `list_tools`' own deadline for the server
/// ([`crate::daemon::LIST_SERVER_DEADLINE`]), so the start's report — the server's last stderr
/// lines and the confinement hint — is the one the operator sees in `broker status`.
pub const START_DEADLINE: Duration = Duration::from_secs(14);

/// The longest `last_error` kept for `broker status`: room for a start's reason, three stderr
/// lines of at most 300 bytes each and the confinement hint.
const MAX_LAST_ERROR: usize = 1280;

/// A server's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Never started (or restarted and not yet needed).
    Idle,
    /// Connecting.
    Starting,
    /// Connected.
    Ready,
    /// The last attempt to connect failed (the next request tries again).
    Failed,
    /// Stopped by the operator (stays down until restarted).
    Stopped,
    /// Its process ended (crashed, or was killed): the next request starts a new generation,
    /// within [`MAX_CRASH_RESTARTS`].
    Exited,
    /// No longer in the configuration: stopped, and never started again by this broker.
    Removed,
}

/// Most times a server whose process ended is started again before the operator looks; after
/// that it stays `failed` (with the reason) until `iteron broker restart`.
pub const MAX_CRASH_RESTARTS: u32 = 3;
/// The pause before the first restart of a server that ended; it doubles each time.
pub const CRASH_BACKOFF: Duration = Duration::from_millis(200);

impl Phase {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Starting => "starting",
            Phase::Ready => "ready",
            Phase::Failed => "failed",
            Phase::Stopped => "stopped",
            Phase::Exited => "exited",
            Phase::Removed => "removed",
        }
    }
}

/// Why a server could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotError {
    /// The operator stopped it.
    Stopped,
    /// It is no longer in the configuration.
    Removed,
    /// Connecting failed (sanitized, secret-free text).
    Connect(String),
    /// The session's configuration of this server is older than the running one.
    StaleSession,
    /// The broker is stopping.
    ShuttingDown,
}

impl std::fmt::Display for SlotError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotError::Stopped => f.write_str("the server was stopped by the operator"),
            SlotError::Removed => f.write_str("the server is no longer in the configuration"),
            SlotError::Connect(why) => write!(f, "the server could not be started: {why}"),
            SlotError::StaleSession => f.write_str(
                "the server's configuration changed since this session started; start a new session",
            ),
            SlotError::ShuttingDown => f.write_str("the broker is shutting down"),
        }
    }
}

/// An immutable configuration snapshot, shared by every session that saw the same file.
pub struct Snapshot {
    /// Increases whenever the configuration on disk changed between two sessions.
    pub epoch: u64,
    /// The configuration.
    pub config: Config,
    digest: String,
    /// What the configuration file looked like on disk when it was read (`None`: unknown).
    stamp: Option<FileStamp>,
}

/// Enough of a file's metadata to tell that it was replaced or written (a rename gives a new
/// inode; a write changes mtime, ctime or size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn stamp(path: &std::path::Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).ok()?;
    Some(FileStamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

struct SlotState {
    phase: Phase,
    generation: u64,
    client: Option<Arc<Client>>,
    catalog: Option<Arc<Vec<Tool>>>,
    version: Option<String>,
    last_error: Option<String>,
    /// The configuration the running client was started from.
    digest: String,
    epoch: u64,
    secrets: Arc<KnownSecrets>,
    /// Times its process ended since the operator last restarted it.
    exits: u32,
}

/// One configured server's live state.
pub struct Slot {
    name: String,
    transport: &'static str,
    state: Mutex<SlotState>,
    /// Serializes connecting, so two requests never start two processes.
    starting: tokio::sync::Mutex<()>,
    /// Bumped to cancel every call in flight on this server.
    cancel: watch::Sender<u64>,
    in_flight: AtomicUsize,
    /// Destinations its egress path refused, over every start (`web_egress` stdio servers).
    egress: Arc<crate::egress::Observer>,
    /// The approved calls running on it (what a form it asks for names).
    calls: Arc<crate::approvals::CallsInFlight>,
}

/// Held while a slot is `starting`: if the start is abandoned before it ends (the request
/// that needed the server ended, or a listing's deadline ran out and dropped it), the slot is
/// marked `failed` with the reason instead of staying `starting`. A start that ended has
/// already left `starting`, so dropping the guard then changes nothing.
struct StartGuard<'a> {
    slot: &'a Slot,
    began: std::time::Instant,
}

impl Drop for StartGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.slot.lock();
        if s.phase == Phase::Starting {
            s.phase = Phase::Failed;
            s.last_error = Some(format!(
                "its start was given up after {:.1} s, before the server answered (the request that needed it ended or ran out of time); the next request starts it again",
                self.began.elapsed().as_secs_f64()
            ));
        }
    }
}

/// A call in flight on a slot (counted; cancellable).
pub struct CallGuard<'a> {
    slot: &'a Slot,
    _running: crate::approvals::RunningCall,
    /// Fires when the operator cancels, restarts or stops the server.
    pub cancelled: watch::Receiver<u64>,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        self.slot.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Slot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The current generation.
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Whether the server is connected (and its process, for stdio, still there).
    pub fn is_ready(&self) -> bool {
        let s = self.lock();
        s.phase == Phase::Ready && s.client.as_ref().is_some_and(|c| !c.is_closed())
    }

    /// Secrets the server's configuration names, to scrub from what it sends back.
    pub fn secrets(&self) -> Arc<KnownSecrets> {
        Arc::clone(&self.lock().secrets)
    }

    /// The cancel counter now (taken when a call is queued for approval).
    pub fn cancel_epoch(&self) -> u64 {
        *self.cancel.borrow()
    }

    /// Start counting a call queued at cancel counter `epoch`; its `cancelled` fires on
    /// cancel/restart/stop — at once if one happened since `epoch`.
    pub fn begin_call(&self, epoch: u64, ctx: crate::approvals::CallContext) -> CallGuard<'_> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let mut rx = self.cancel.subscribe();
        if *rx.borrow_and_update() == epoch {
            rx.mark_unchanged();
        } else {
            rx.mark_changed();
        }
        CallGuard {
            slot: self,
            _running: self.calls.begin(ctx),
            cancelled: rx,
        }
    }

    fn status(&self) -> Value {
        let s = self.lock();
        let phase = match &s.client {
            Some(c) if s.phase == Phase::Ready && c.is_closed() => Phase::Exited,
            _ => s.phase,
        };
        json!({
            "name": self.name,
            "transport": self.transport,
            "phase": phase.as_str(),
            "exits": s.exits,
            "generation": s.generation,
            "protocol_version": s.version,
            // The name the status had before `protocol_version` (kept for its readers).
            "version": s.version,
            "tool_count": s.catalog.as_ref().map(|c| c.len()),
            "tools": s.catalog.as_ref().map(|c| c.iter().map(|t| t.name.clone()).collect::<Vec<_>>()),
            "in_flight": self.in_flight.load(Ordering::SeqCst),
            "error": s.last_error,
            "egress": self.egress.status_json(),
        })
    }
}

/// Every slot of the broker, plus the configuration snapshot.
pub struct Registry {
    home: Home,
    approvals: Arc<Approvals>,
    lookup: Lookup,
    slots: Mutex<HashMap<String, Arc<Slot>>>,
    snapshot: Mutex<Option<Arc<Snapshot>>>,
    closed: std::sync::atomic::AtomicBool,
    /// Where egress refusals are audited (set once by the daemon, before any slot exists).
    egress_audit: std::sync::OnceLock<crate::egress::AuditSink>,
}

fn config_digest(c: &Config) -> String {
    crate::audit::sha256_hex(c.to_json_pretty().as_bytes())
}

impl Registry {
    /// A registry over `home`'s configuration. `lookup` reads the operator-named variables
    /// (`env`, `header_env`, …) from the broker's environment.
    pub fn new(home: Home, approvals: Arc<Approvals>, lookup: Lookup) -> Registry {
        Registry {
            home,
            approvals,
            lookup,
            slots: Mutex::new(HashMap::new()),
            snapshot: Mutex::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
            egress_audit: std::sync::OnceLock::new(),
        }
    }

    /// Audit every egress refusal through `sink` (the daemon's log). Only the first call
    /// counts, and only slots made after it use it: call it before the first snapshot.
    pub fn audit_egress_with(&self, sink: crate::egress::AuditSink) -> bool {
        self.egress_audit.set(sink).is_ok()
    }

    /// The configuration for a new session: loaded from disk now; the same snapshot (and epoch)
    /// as before when nothing changed.
    pub fn snapshot(&self) -> Result<Arc<Snapshot>, String> {
        let path = self.home.config_path();
        let before = stamp(&path);
        {
            let current = match self.snapshot.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            // Unchanged on disk: no read, no parse (this runs for every request).
            if let Some(s) = current.as_ref()
                && before.is_some()
                && s.stamp == before
            {
                return Ok(Arc::clone(s));
            }
        }
        let config = self.home.load().map_err(|e| e.to_string())?;
        // Read between two equal stamps, or it is not trusted to stand for the file.
        let after = stamp(&path);
        let digest = config_digest(&config);
        let mut current = match self.snapshot.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some(s) = current.as_ref()
            && s.digest == digest
        {
            if before == after && s.stamp != after {
                let same = Arc::new(Snapshot {
                    epoch: s.epoch,
                    config,
                    digest,
                    stamp: after,
                });
                *current = Some(Arc::clone(&same));
                return Ok(same);
            }
            return Ok(Arc::clone(s));
        }
        let epoch = current.as_ref().map_or(1, |s| s.epoch + 1);
        let snap = Arc::new(Snapshot {
            epoch,
            config,
            digest,
            stamp: if before == after { after } else { None },
        });
        *current = Some(Arc::clone(&snap));
        drop(current);
        // Every configured server gets a slot (idle) so status shows it before first use; a
        // slot whose server left the configuration is stopped and marked removed.
        for server in &snap.config.mcp_servers {
            self.slot_for(server);
        }
        self.retire_removed(&snap.config);
        Ok(snap)
    }

    /// Stop every server that is no longer configured (its calls are cancelled, its process
    /// stopped and reaped in the background) and mark it removed; one configured again later
    /// comes back idle.
    fn retire_removed(&self, config: &Config) {
        let slots: Vec<Arc<Slot>> = match self.slots.lock() {
            Ok(g) => g.values().cloned().collect(),
            Err(p) => p.into_inner().values().cloned().collect(),
        };
        for slot in slots {
            if config.server(&slot.name).is_some() {
                let mut s = slot.lock();
                if s.phase == Phase::Removed {
                    s.phase = Phase::Idle;
                    s.last_error = None;
                }
                continue;
            }
            let old = {
                let mut s = slot.lock();
                if s.phase == Phase::Removed {
                    continue;
                }
                s.phase = Phase::Removed;
                s.catalog = None;
                s.last_error = Some("removed from the configuration; stopped".into());
                s.client.take()
            };
            slot.cancel.send_modify(|x| *x += 1);
            if let Some(c) = old
                && let Ok(rt) = tokio::runtime::Handle::try_current()
            {
                rt.spawn(async move {
                    c.close().await;
                });
            }
        }
    }

    fn slot_for(&self, server: &ServerConfig) -> Arc<Slot> {
        let mut slots = match self.slots.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        Arc::clone(
            slots
                .entry(server.name.as_str().to_owned())
                .or_insert_with(|| {
                    let (cancel, _) = watch::channel(0);
                    Arc::new(Slot {
                        name: server.name.as_str().to_owned(),
                        transport: server.transport.as_str(),
                        state: Mutex::new(SlotState {
                            phase: Phase::Idle,
                            generation: 0,
                            client: None,
                            catalog: None,
                            version: None,
                            last_error: None,
                            digest: String::new(),
                            epoch: 0,
                            secrets: Arc::new(KnownSecrets::default()),
                            exits: 0,
                        }),
                        starting: tokio::sync::Mutex::new(()),
                        cancel,
                        in_flight: AtomicUsize::new(0),
                        egress: Arc::new(crate::egress::Observer::new(
                            server.name.as_str(),
                            self.egress_audit.get().cloned(),
                        )),
                        calls: Arc::default(),
                    })
                }),
        )
    }

    /// The slot of a configured server, by exact name.
    pub fn slot(&self, name: &str) -> Option<Arc<Slot>> {
        let slots = match self.slots.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        slots.get(name).cloned()
    }

    /// The connected client of `server` (as configured in `snap`), connecting first if needed.
    pub async fn client(
        &self,
        snap: &Snapshot,
        server: &ServerConfig,
    ) -> Result<(Arc<Slot>, Arc<Client>), SlotError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(SlotError::ShuttingDown);
        }
        let slot = self.slot_for(server);
        let digest = crate::credentials::config_digest(server);
        let _starting = slot.starting.lock().await;
        // A server whose process ended: reap it, and start a new generation within the budget.
        let crashed = {
            let mut s = slot.lock();
            match s.client.as_ref() {
                Some(c) if c.is_closed() => {
                    s.exits += 1;
                    s.catalog = None;
                    s.phase = Phase::Exited;
                    s.client.take()
                }
                _ => None,
            }
        };
        if let Some(dead) = crashed {
            let how = dead
                .closed_reason()
                .map_or_else(|| "it ended".to_owned(), |r| s_line(&r));
            // Reaped here: no zombie is left behind.
            dead.close().await;
            let mut s = slot.lock();
            if s.exits > MAX_CRASH_RESTARTS {
                s.phase = Phase::Failed;
                s.last_error = Some(format!(
                    "the server's process ended {} times ({how}); it is not started again until iteron broker restart {}",
                    s.exits, slot.name
                ));
            } else {
                s.last_error = Some(format!(
                    "the server's process ended ({how}); restart {} of {MAX_CRASH_RESTARTS}",
                    s.exits
                ));
            }
        }
        let backoff = {
            let s = slot.lock();
            if s.phase == Phase::Failed && s.exits > MAX_CRASH_RESTARTS {
                return Err(SlotError::Connect(s.last_error.clone().unwrap_or_default()));
            }
            (s.phase == Phase::Exited)
                .then(|| CRASH_BACKOFF.saturating_mul(1 << s.exits.saturating_sub(1).min(4)))
        };
        if let Some(pause) = backoff {
            tokio::time::sleep(pause).await;
        }
        let stale_client = {
            let mut s = slot.lock();
            if s.phase == Phase::Stopped {
                return Err(SlotError::Stopped);
            }
            if s.phase == Phase::Removed {
                return Err(SlotError::Removed);
            }
            match (s.client.clone(), s.digest == digest) {
                (Some(c), true) => {
                    s.epoch = s.epoch.max(snap.epoch);
                    return Ok((Arc::clone(&slot), c));
                }
                (Some(_), false) if s.epoch > snap.epoch => return Err(SlotError::StaleSession),
                // A newer configuration of this server: replace the running one.
                (Some(_), false) => {
                    s.catalog = None;
                    s.phase = Phase::Starting;
                    s.client.take()
                }
                // Not running: an older session must not bring back an older configuration.
                (None, false) if s.epoch > snap.epoch && !s.digest.is_empty() => {
                    return Err(SlotError::StaleSession);
                }
                (None, _) => {
                    s.phase = Phase::Starting;
                    None
                }
            }
        };
        // From here until the outcome is stored, the slot says `starting`.
        let _abandoned = StartGuard {
            slot: &slot,
            began: std::time::Instant::now(),
        };
        if let Some(old) = stale_client {
            slot.cancel.send_modify(|n| *n += 1);
            old.close().await;
        }
        let learned = servers::LearnedSecrets::default();
        let secrets =
            Arc::new(KnownSecrets::of(server, &|k| (self.lookup)(k)).with_learned(learned.clone()));
        // The client scrubs every message and stderr line with the same secrets the daemon
        // scrubs answers with, before anything reads or cuts them.
        let opts = Options {
            elicitor: self
                .approvals
                .elicitor(server.name.as_str(), Arc::clone(&slot.calls)),
            auth_context: digest.clone(),
            scrub: Some(Arc::clone(&secrets) as Arc<dyn crate::mcp::Scrub>),
            // A dead process is replaced by the registry (a new generation), never behind it.
            auto_restart: false,
            start_deadline: START_DEADLINE,
            ..Options::default()
        };
        let lookup = Arc::clone(&self.lookup);
        let mut connected = tokio::time::timeout(
            CONNECT_DEADLINE,
            servers::connect_with_credentials(
                server,
                &snap.config.network,
                &move |k| lookup(k),
                opts,
                &self.home,
                servers::SpawnContext {
                    home: self.home.dir().to_path_buf(),
                    ceiling: snap.config.ceiling(),
                    egress: Some(Arc::clone(&slot.egress)),
                },
                &learned,
            ),
        )
        .await;
        // A stored OAuth credential's tokens are scrubbed too: what it held after connecting
        // (refresh token, client secret), and every access token handed out since, rotations
        // and new logins included (learned by its token source, into the same shared set).
        if let (Ok(Ok(_)), iteron_policy::config::Transport::Http(_)) =
            (&connected, &server.transport)
        {
            let store = crate::credentials::CredentialStore::new(&self.home);
            let name = server.name.as_str().to_owned();
            let loaded = tokio::task::spawn_blocking(move || store.load(&name))
                .await
                .ok()
                .and_then(Result::ok)
                .flatten();
            if let Some(cred) = loaded
                && !learned.learn_credential(&cred)
            {
                // Fail closed: a server whose secrets cannot all be scrubbed is not used.
                if let Ok(Ok(c)) =
                    std::mem::replace(&mut connected, Ok(Err(ConnectError::ScrubberFull)))
                {
                    c.close().await;
                }
            }
        }
        // Stopped by the operator or removed from the configuration while it started (judged
        // under the same lock as the outcome is stored): the new process is not used, and the
        // slot keeps saying so.
        let stored = {
            let mut s = slot.lock();
            s.secrets = secrets;
            let ended = match s.phase {
                Phase::Stopped => Some(SlotError::Stopped),
                Phase::Removed => Some(SlotError::Removed),
                _ => None,
            };
            match ended {
                Some(why) => Err((why, connected.ok().and_then(Result::ok))),
                None => Ok(Self::store_outcome(
                    &mut s, &slot, connected, digest, snap.epoch,
                )),
            }
        };
        match stored {
            Ok(outcome) => outcome,
            Err((why, unused)) => {
                if let Some(client) = unused {
                    client.close().await;
                }
                Err(why)
            }
        }
    }

    /// Store what a start came to in the slot (locked by the caller): the client as the next
    /// generation, or why it failed.
    fn store_outcome(
        s: &mut SlotState,
        slot: &Arc<Slot>,
        connected: Result<Result<Client, ConnectError>, tokio::time::error::Elapsed>,
        digest: String,
        epoch: u64,
    ) -> Result<(Arc<Slot>, Arc<Client>), SlotError> {
        match connected {
            Ok(Ok(client)) => {
                let client = Arc::new(client);
                s.phase = Phase::Ready;
                s.generation += 1;
                s.version = Some(client.era().version().as_str().to_owned());
                s.client = Some(Arc::clone(&client));
                s.catalog = None;
                s.last_error = None;
                s.digest = digest;
                s.epoch = epoch;
                Ok((Arc::clone(slot), client))
            }
            Ok(Err(e)) => {
                let why = describe(&s.secrets.scrub(&e.to_string()));
                s.phase = Phase::Failed;
                s.last_error = Some(why.clone());
                Err(SlotError::Connect(why))
            }
            Err(_) => {
                let why = format!(
                    "no answer within {} s of starting",
                    CONNECT_DEADLINE.as_secs()
                );
                s.phase = Phase::Failed;
                s.last_error = Some(why.clone());
                Err(SlotError::Connect(why))
            }
        }
    }

    /// The server's catalog (fetched once per generation and retained).
    pub async fn catalog(
        &self,
        slot: &Slot,
        client: &Client,
    ) -> Result<Arc<Vec<Tool>>, crate::mcp::client::McpError> {
        if let Some(c) = slot.lock().catalog.clone() {
            return Ok(c);
        }
        let tools = Arc::new(client.list_tools().await?);
        let mut s = slot.lock();
        if s.client
            .as_ref()
            .is_some_and(|c| std::ptr::eq(&**c, client))
        {
            s.catalog = Some(Arc::clone(&tools));
        }
        Ok(tools)
    }

    /// Status of one server (by exact name) or all, starting nothing.
    pub fn status(&self, name: Option<&str>) -> Option<Vec<Value>> {
        let slots = match self.slots.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let mut out: Vec<(String, Value)> = slots
            .iter()
            .filter(|(n, _)| name.is_none_or(|x| x == n.as_str()))
            .map(|(n, s)| (n.clone(), s.status()))
            .collect();
        if name.is_some() && out.is_empty() {
            return None;
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Some(out.into_iter().map(|(_, v)| v).collect())
    }

    /// Cancel every call in flight on a server. Returns how many were in flight.
    pub fn cancel(&self, name: &str) -> Option<usize> {
        let slot = self.slot(name)?;
        let n = slot.in_flight.load(Ordering::SeqCst);
        slot.cancel.send_modify(|x| *x += 1);
        Some(n)
    }

    /// Restart (`stop = false`: back to idle, reconnect on next use) or stop a server. Calls in
    /// flight are cancelled and the process is stopped and reaped.
    pub async fn restart(&self, name: &str, stop: bool) -> Option<()> {
        let slot = self.slot(name)?;
        slot.cancel.send_modify(|x| *x += 1);
        let _starting = slot.starting.lock().await;
        let old = {
            let mut s = slot.lock();
            s.catalog = None;
            s.version = None;
            s.last_error = None;
            s.exits = 0;
            if s.phase == Phase::Removed {
                return None;
            }
            s.phase = if stop { Phase::Stopped } else { Phase::Idle };
            s.client.take()
        };
        if let Some(c) = old {
            c.close().await;
        }
        Some(())
    }

    /// `auth logout` of an externally managed token, through the running broker: revoke at
    /// `revoke_url` what this broker holds for `name` (its rotated refresh token and current
    /// access token, else the variables' ones), refuse to send them again, and restart the
    /// server so no client keeps the revoked bearer. `None` when no server has that name.
    pub async fn logout_external(
        &self,
        name: &str,
    ) -> Option<Result<servers::ExternalLogout, String>> {
        let snap = match self.snapshot() {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        let server = snap.config.server(name)?.clone();
        let lookup = Arc::clone(&self.lookup);
        let outcome =
            servers::logout_external(&server, &snap.config.network, &move |k| lookup(k)).await;
        self.restart(name, false).await;
        Some(outcome.map_err(|e| e.to_string()))
    }

    /// Shutdown: refuse new connects, cancel everything, stop and reap every child.
    pub async fn close_all(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let slots: Vec<Arc<Slot>> = match self.slots.lock() {
            Ok(g) => g.values().cloned().collect(),
            Err(p) => p.into_inner().values().cloned().collect(),
        };
        let mut closing = tokio::task::JoinSet::new();
        for slot in slots {
            slot.cancel.send_modify(|x| *x += 1);
            let client = {
                let mut s = slot.lock();
                s.phase = Phase::Stopped;
                s.catalog = None;
                s.client.take()
            };
            if let Some(c) = client {
                // All servers are stopped at once: a slow one does not delay the others.
                closing.spawn(async move {
                    c.close().await;
                });
            }
        }
        while closing.join_next().await.is_some() {}
    }
}

fn s_line(t: &str) -> String {
    iteron_policy::text::single_line_capped(t, 200)
}

/// A connect failure (already scrubbed: a secret cut in half would no longer be recognised)
/// as one line.
fn describe(scrubbed: &str) -> String {
    iteron_policy::text::single_line_capped(scrubbed, MAX_LAST_ERROR)
}
