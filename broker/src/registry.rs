//! The broker's live servers: one slot per configured server, lazy (nothing starts before the
//! first request that needs it), with a phase, a generation (bumped at every successful
//! connect), the negotiated version and the retained catalog. The operator can cancel a
//! server's in-flight calls, restart it (clears the catalog; the next request reconnects) or
//! stop it (it stays down until restarted).

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
}

impl Phase {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Starting => "starting",
            Phase::Ready => "ready",
            Phase::Failed => "failed",
            Phase::Stopped => "stopped",
        }
    }
}

/// Why a server could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotError {
    /// The operator stopped it.
    Stopped,
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
}

/// A call in flight on a slot (counted; cancellable).
pub struct CallGuard<'a> {
    slot: &'a Slot,
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

    /// Whether the server is connected.
    pub fn is_ready(&self) -> bool {
        let s = self.lock();
        s.phase == Phase::Ready && s.client.is_some()
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
    pub fn begin_call(&self, epoch: u64) -> CallGuard<'_> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let mut rx = self.cancel.subscribe();
        if *rx.borrow_and_update() == epoch {
            rx.mark_unchanged();
        } else {
            rx.mark_changed();
        }
        CallGuard {
            slot: self,
            cancelled: rx,
        }
    }

    fn status(&self) -> Value {
        let s = self.lock();
        json!({
            "name": self.name,
            "transport": self.transport,
            "phase": s.phase.as_str(),
            "generation": s.generation,
            "version": s.version,
            "tools": s.catalog.as_ref().map(|c| c.len()),
            "in_flight": self.in_flight.load(Ordering::SeqCst),
            "error": s.last_error,
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
        }
    }

    /// The configuration for a new session: loaded from disk now; the same snapshot (and epoch)
    /// as before when nothing changed.
    pub fn snapshot(&self) -> Result<Arc<Snapshot>, String> {
        let config = self.home.load().map_err(|e| e.to_string())?;
        let digest = config_digest(&config);
        let mut current = match self.snapshot.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some(s) = current.as_ref()
            && s.digest == digest
        {
            return Ok(Arc::clone(s));
        }
        let epoch = current.as_ref().map_or(1, |s| s.epoch + 1);
        let snap = Arc::new(Snapshot {
            epoch,
            config,
            digest,
        });
        *current = Some(Arc::clone(&snap));
        // Every configured server gets a slot (idle) so status shows it before first use.
        for server in &snap.config.mcp_servers {
            self.slot_for(server);
        }
        Ok(snap)
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
                        }),
                        starting: tokio::sync::Mutex::new(()),
                        cancel,
                        in_flight: AtomicUsize::new(0),
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
        let stale_client = {
            let mut s = slot.lock();
            if s.phase == Phase::Stopped {
                return Err(SlotError::Stopped);
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
            elicitor: self.approvals.elicitor(server.name.as_str()),
            auth_context: digest.clone(),
            scrub: Some(Arc::clone(&secrets) as Arc<dyn crate::mcp::Scrub>),
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
                snap.config.ceiling(),
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
        let mut s = slot.lock();
        s.secrets = secrets;
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
                s.epoch = snap.epoch;
                Ok((Arc::clone(&slot), client))
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

/// A connect failure (already scrubbed: a secret cut in half would no longer be recognised)
/// as one line.
fn describe(scrubbed: &str) -> String {
    iteron_policy::text::single_line_capped(scrubbed, 300)
}
