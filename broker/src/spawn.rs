//! Spawning and supervising stdio MCP servers.
//!
//! A child gets an environment built from nothing ([`child_env`]): a fixed safe `PATH` (unless
//! the operator configures one), `LANG`, and only the variables the operator named with
//! `--env NAME`. It runs in its own session and process group, hardened before exec
//! ([`crate::sys::harden_pre_exec`]), spawned from one long-lived thread (so `PR_SET_PDEATHSIG`
//! is tied to a thread that never exits). Its stderr is kept in a bounded ring for diagnostics.
//! Shutdown is a ladder: close stdin, wait; SIGTERM the group, wait; SIGKILL the group — so a
//! server that ignores stdin EOF is still reaped.
//!
//! **No descendant outlives its owner.** A process that leaves its owner's process group and
//! session (`setsid`, a double-forking daemon) escapes a group kill, so the spawning process
//! makes itself a child subreaper ([`crate::sys::become_subreaper`]) and so does every child
//! (before exec). An orphan below a running child is re-parented to that child; when the child
//! ends, its remaining descendants are re-parented to this process. Once a child is stopped
//! and reaped, [`sweep`] ends (SIGKILL) and reaps every process this process adopted that is
//! not one of its own children and whose session is not that of a child still being
//! supervised — repeatedly, until none is left, since ending one re-parents its own children
//! here. Processes in this process's own session are never touched (they were not started
//! by [`spawn`]). [`ChildProcess::shutdown`] returns once this is done; [`settle`] waits for
//! every child dropped without it.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use iteron_policy::names::EnvName;
use iteron_policy::text;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

mod env;
mod orphans;
mod scratch;
pub use env::*;
pub use orphans::*;
use scratch::scratch_dir;

/// `PATH` given to children unless the operator configures one.
pub const SAFE_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// `LANG` given to children.
pub const CHILD_LANG: &str = "C.UTF-8";
/// Bytes of a child's stderr kept for diagnostics (the most recent ones).
pub const STDERR_KEEP: usize = 16 * 1024;
/// Default wait at each rung of the shutdown ladder.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How long [`ChildProcess::shutdown`] waits for a child's group to be killed, the child
/// reaped and its adopted descendants ended.
pub const REAP_DEADLINE: Duration = Duration::from_secs(10);
/// Most rounds of one [`sweep`] (each round ends the adopted processes found, which
/// re-parents their own children here for the next round; a tree deeper than this is finished
/// by the next sweep).
pub const MAX_SWEEP_ROUNDS: usize = 1024;

/// What to start. Cloning copies the environment values (the client keeps one copy to restart
/// a server that died); they never leave memory except into the child.
#[derive(Clone)]
pub struct ChildSpec {
    /// The program (absolute, or bare to be found on the child's `PATH`).
    pub command: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// The complete environment (from [`child_env`]).
    pub env: Vec<EnvVar>,
    /// Confine the child ([`crate::confine`]): the command's install tree is added to what it
    /// may read, a private scratch directory (its `TMPDIR`, removed when it ends) to what it may
    /// write. `None` only for the MCP client's own unit tests and benchmarks.
    pub confine: Option<crate::confine::Spec>,
    /// For a confined `web_egress` server in its own network namespace: the DNS servers its
    /// egress path resolves with and where its refusals are counted ([`crate::egress`]).
    /// `None` there: the broker's system resolver, refusals counted for this child alone.
    pub egress: Option<crate::egress::Route>,
}

impl fmt::Debug for ChildSpec {
    /// Names only: environment values may be secrets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = self.env.iter().map(|(k, _)| k.to_string_lossy()).collect();
        f.debug_struct("ChildSpec")
            .field("command", &self.command)
            .field("args", &self.args.len())
            .field("env_names", &names)
            .field("confined", &self.confine.is_some())
            .field("egress", &self.egress.is_some())
            .finish()
    }
}

/// Why a child could not be started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpawnError {
    /// A bare command was not found on the child's `PATH`.
    NotFound(String),
    /// `exec` or the pre-exec hardening failed.
    Start {
        /// The command.
        command: String,
        /// The OS error.
        reason: String,
    },
    /// The spawner thread is gone.
    Spawner,
    /// The confinement could not be prepared (nothing was started).
    Confine(String),
}

impl fmt::Display for SpawnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpawnError::NotFound(c) => write!(f, "command {c} not found on the server PATH"),
            SpawnError::Start { command, reason } => {
                write!(f, "cannot start {command}: {reason}")
            }
            SpawnError::Spawner => f.write_str("the process spawner is not running"),
            SpawnError::Confine(why) => write!(f, "cannot confine the server: {why}"),
        }
    }
}

impl std::error::Error for SpawnError {}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it.
    Signal(i32),
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exited with code {c}"),
            Exit::Signal(s) => write!(f, "killed by signal {s}"),
        }
    }
}

/// Which rung of the shutdown ladder ended the child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It had already exited, or exited after stdin closed.
    OnEof,
    /// It needed SIGTERM.
    OnTerm,
    /// It needed SIGKILL.
    OnKill,
}

/// The most recent stderr bytes of a child.
#[derive(Default)]
struct Ring {
    bytes: VecDeque<u8>,
    dropped: u64,
}

type SpawnReply = std::sync::mpsc::Sender<Result<std::process::Child, SpawnError>>;
/// A spawn order: the command, its name for errors, and where to send the child.
type SpawnOrder = (Command, String, SpawnReply);
/// Which thread forks a child: the one for unconfined children, or one of the two for
/// confined children (one per seccomp filter: with and without internet sockets).
#[derive(Clone, Copy)]
enum Forker {
    Plain,
    Confined { inet: bool },
}

/// A forking thread: where its orders go, and the seccomp filter it is under (which each of
/// its children inherits), if it could install it.
struct Spawner {
    queue: Mutex<mpsc::Sender<SpawnOrder>>,
    filter: Option<Vec<nix::libc::sock_filter>>,
}

/// Three long-lived threads do every fork — [`Forker`] says which — so `PR_SET_PDEATHSIG`
/// never fires because a short-lived worker thread exited. The process becomes a child
/// subreaper first (see the module documentation); if it cannot, nothing is spawned.
///
/// A child inherits the bounding set and the seccomp filter of the thread that forked it: a
/// confined children's thread empties its own bounding set once, so that each child only
/// checks its set instead of dropping capability after capability (see
/// `sys::drop_bounding_set`), and puts itself under its children's filter
/// ([`crate::sys::filter_spawner_thread`]), so that no child installs one; a child started
/// without confinement keeps the broker's bounding set and has no filter.
fn spawner(kind: Forker) -> Option<&'static Spawner> {
    static SPAWNERS: [OnceLock<Option<Spawner>>; 3] =
        [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let (slot, name, inet) = match kind {
        Forker::Plain => (0, "iteron-spawner", None),
        Forker::Confined { inet: false } => (1, "iteron-spawner-c", Some(false)),
        Forker::Confined { inet: true } => (2, "iteron-spawner-n", Some(true)),
    };
    SPAWNERS[slot]
        .get_or_init(|| {
            crate::sys::become_subreaper().ok()?;
            // The filter `confine::prepare` builds for such a child.
            let filter = inet.map(|inet| {
                crate::sys::seccomp_socket_filter(
                    inet,
                    crate::sys::landlock_abi().is_none_or(|a| a < 3),
                )
            });
            let (tx, rx) = mpsc::channel::<SpawnOrder>();
            let (ready_tx, ready_rx) = mpsc::channel::<bool>();
            let own = filter.clone();
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    let filtered = own.as_deref().is_some_and(|f| {
                        crate::sys::empty_spawner_bounding_set();
                        crate::sys::filter_spawner_thread(f)
                    });
                    let _ = ready_tx.send(filtered);
                    while let Ok((mut cmd, shown, reply)) = rx.recv() {
                        let result = {
                            let mut owners = lock_owners();
                            let r = cmd.spawn();
                            if let Ok(c) = &r {
                                owners.insert(c.id() as i32);
                            }
                            r
                        };
                        let result = result.map_err(|e| SpawnError::Start {
                            command: shown,
                            reason: e.to_string(),
                        });
                        let _ = reply.send(result);
                    }
                })
                .ok()?;
            let filtered = ready_rx.recv().ok()?;
            Some(Spawner {
                queue: Mutex::new(tx),
                filter: filter.filter(|_| filtered),
            })
        })
        .as_ref()
}

/// A running stdio server.
pub struct ChildProcess {
    pid: i32,
    /// Its stdin (taken by the transport).
    pub stdin: Option<tokio::process::ChildStdin>,
    /// Its stdout (taken by the transport).
    pub stdout: Option<tokio::process::ChildStdout>,
    stderr: Arc<Mutex<Ring>>,
    /// Becomes true when the child's stderr reached end of file.
    stderr_eof: watch::Receiver<bool>,
    exit: watch::Receiver<Option<Exit>>,
    /// Tells the reaper to kill what is left of the group and reap the leader.
    reap: Option<mpsc::Sender<()>>,
    /// Becomes true when the reaper is done: group killed, leader reaped, adopted descendants
    /// ended ([`sweep`]), scratch directory removed.
    reaped: watch::Receiver<bool>,
    confinement: Option<Box<crate::confine::Effective>>,
    /// The egress proxy of a `web_egress` server (ends with the handle).
    _egress: Option<crate::egress::ProxyHandle>,
}

impl fmt::Debug for ChildProcess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChildProcess")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// Start a child. Must be called inside a tokio runtime.
pub async fn spawn(spec: ChildSpec) -> Result<ChildProcess, SpawnError> {
    let path_value = spec
        .env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.expose().to_string_lossy().into_owned())
        .unwrap_or_else(|| SAFE_PATH.to_owned());
    let shown = text::single_line_capped(&spec.command, 200);
    let program = resolve_program(&spec.command, &path_value)
        .ok_or_else(|| SpawnError::NotFound(shown.clone()))?;
    let mut cmd = Command::new(&program);
    cmd.args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v.expose())))
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut scratch = None;
    let mut confinement = None;
    let mut proxy_channel = None;
    let prepared = match &spec.confine {
        None => None,
        Some(c) => {
            let dir = scratch_dir().map_err(|e| SpawnError::Confine(e.to_string()))?;
            let mut c = c.clone();
            c.writable.push(dir.clone());
            cmd.env("TMPDIR", &dir);
            let fail = |e: std::io::Error| {
                let _ = std::fs::remove_dir_all(&dir);
                SpawnError::Confine(e.to_string())
            };
            // The install tree and the plan ask about the same paths: one memo for both.
            let (prepared, effective, channel) = crate::confine::memoized(|| {
                c.readable
                    .extend(crate::confine::install_tree(&program, &spec.args, &c.deny));
                crate::confine::prepare(&c)
            })
            .map_err(fail)?;
            if channel.is_some() {
                for (k, v) in crate::egress::proxy_env() {
                    cmd.env(k, v);
                }
            }
            proxy_channel = channel;
            // The scratch directory belongs to the uid the child runs as: handed over through
            // a descriptor of the directory itself, never through a link put in its place.
            if let Some((uid, gid)) = prepared.identity {
                use std::os::unix::fs::OpenOptionsExt;
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW)
                    .open(&dir)
                    .and_then(|d| std::os::unix::fs::fchown(&d, Some(uid), Some(gid)))
                    .map_err(fail)?;
            }
            scratch = Some(dir);
            confinement = Some(Box::new(effective));
            Some(prepared)
        }
    };
    let forker = match &spec.confine {
        Some(c) => Forker::Confined { inet: c.network },
        None => Forker::Plain,
    };
    let Some(sender) = spawner(forker) else {
        if let Some(d) = &scratch {
            let _ = std::fs::remove_dir_all(d);
        }
        return Err(SpawnError::Spawner);
    };
    let mut prepared = prepared;
    // The pool's namespace this child joins, to give back once it and its descendants ended.
    let give_back = prepared.as_mut().and_then(|p| p.give_back.take());
    if let Some(p) = prepared.as_mut()
        && let (Some(own), Some(theirs)) = (&p.seccomp, &sender.filter)
        && crate::sys::same_filter(own, theirs)
    {
        // Inherited at fork: installing it again would only stack a second copy.
        p.seccomp = None;
    }
    crate::sys::harden_pre_exec(&mut cmd, std::process::id() as i32, prepared);
    let (reply_tx, reply_rx) = mpsc::channel();
    {
        let guard = sender.queue.lock().map_err(|_| SpawnError::Spawner)?;
        guard
            .send((cmd, shown.clone(), reply_tx))
            .map_err(|_| SpawnError::Spawner)?;
    }
    let started = tokio::task::spawn_blocking(move || reply_rx.recv())
        .await
        .map_err(|_| SpawnError::Spawner)
        .and_then(|r| r.map_err(|_| SpawnError::Spawner))
        .and_then(|r| r);
    let mut child = match started {
        Ok(c) => c,
        Err(e) => {
            // Nothing started: the scratch directory goes now.
            if let Some(d) = &scratch {
                let _ = std::fs::remove_dir_all(d);
            }
            return Err(e);
        }
    };
    let pid = child.id() as i32;
    // A web_egress server's proxy listener arrived before its exec: serve it, or end the child
    // (a server without its only way out would fail in ways that are hard to read).
    let egress = match proxy_channel {
        None => None,
        Some(ch) => {
            let rules = spec
                .confine
                .as_ref()
                .map(|c| c.egress.clone())
                .unwrap_or_default();
            let route = spec.egress.clone().unwrap_or_else(|| crate::egress::Route {
                dns: crate::net::Dns::System,
                observer: Arc::new(crate::egress::Observer::new(&shown, None)),
            });
            match ch
                .listener()
                .and_then(|l| crate::egress::serve(l, rules, route))
            {
                Ok(h) => Some(h),
                Err(e) => {
                    let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                    let mut owners = lock_owners();
                    let _ = child.wait();
                    owners.remove(&pid);
                    drop(owners);
                    if let Some(d) = &scratch {
                        let _ = std::fs::remove_dir_all(d);
                    }
                    return Err(SpawnError::Confine(format!(
                        "the egress path could not be set up: {e}"
                    )));
                }
            }
        }
    };
    let stdin = child
        .stdin
        .take()
        .and_then(|s| tokio::process::ChildStdin::from_std(s).ok());
    let stdout = child
        .stdout
        .take()
        .and_then(|s| tokio::process::ChildStdout::from_std(s).ok());
    let stderr_pipe = child
        .stderr
        .take()
        .and_then(|s| tokio::process::ChildStderr::from_std(s).ok());
    let ring = Arc::new(Mutex::new(Ring::default()));
    let (eof_tx, stderr_eof) = watch::channel(stderr_pipe.is_none());
    if let Some(mut err) = stderr_pipe {
        let ring = ring.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                if let Ok(mut r) = ring.lock() {
                    r.bytes.extend(&buf[..n]);
                    while r.bytes.len() > STDERR_KEEP {
                        r.bytes.pop_front();
                        r.dropped += 1;
                    }
                }
            }
            let _ = eof_tx.send(true);
        });
    }
    let (exit_tx, exit_rx) = watch::channel(None);
    let (reap_tx, reap_rx) = mpsc::channel::<()>();
    let (reaped_tx, reaped_rx) = watch::channel(false);
    reaper_count(1);
    let reaper = std::thread::Builder::new()
        .name("iteron-reaper".into())
        .spawn(move || {
            use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
            // Observe the exit without reaping (WNOWAIT): while the leader is an unreaped
            // zombie its pid — and so its process-group id — cannot be reused, which makes the
            // final group kill below safe.
            let exit = loop {
                match waitid(
                    Id::Pid(Pid::from_raw(pid)),
                    WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT,
                ) {
                    Ok(WaitStatus::Exited(_, code)) => break Exit::Code(code),
                    Ok(WaitStatus::Signaled(_, sig, _)) => break Exit::Signal(sig as i32),
                    Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
                    Err(_) => break Exit::Code(-1),
                }
            };
            let _ = exit_tx.send(Some(exit));
            // Wait until the owner is done with the group (or gone), then kill whatever is left
            // of it — a server's own children included — and reap the leader.
            let _ = reap_rx.recv();
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            {
                // Reaped and forgotten under the lock: the pid is free for reuse only after.
                let mut owners = lock_owners();
                let _ = child.wait();
                owners.remove(&pid);
            }
            // Its descendants that left its group were re-parented here when it ended.
            let (_, none_left) = sweep();
            // Its namespace, if it had one from the pool, is handed back only when nothing of
            // the child is left (the pool checks it again before any reuse).
            if let Some(ns) = give_back.filter(|_| none_left) {
                crate::sys::give_back_isolated(ns);
            }
            if let Some(d) = scratch {
                let _ = std::fs::remove_dir_all(d);
                // The next confined start's directory, made here rather than on its way.
                scratch::refill();
            }
            let _ = reaped_tx.send(true);
            reaper_count(-1);
        });
    if let Err(e) = reaper {
        // No reaper (the closure and the child handle are gone): end and reap it here.
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        {
            let mut owners = lock_owners();
            let _ = nix::sys::wait::waitpid(Pid::from_raw(pid), None);
            owners.remove(&pid);
        }
        reaper_count(-1);
        return Err(SpawnError::Start {
            command: spec.command.clone(),
            reason: e.to_string(),
        });
    }
    Ok(ChildProcess {
        pid,
        stdin,
        stdout,
        stderr: ring,
        stderr_eof,
        exit: exit_rx,
        reap: Some(reap_tx),
        reaped: reaped_rx,
        confinement,
        _egress: egress,
    })
}

/// A handle on a child's stderr ring that outlives the child's transport (for diagnostics
/// after a failed start).
#[derive(Clone)]
pub struct StderrTail(Arc<Mutex<Ring>>);

impl StderrTail {
    /// The last non-empty lines, terminal-safe and redacted.
    pub fn lines(&self, max_lines: usize) -> Vec<String> {
        ring_tail(&self.0, max_lines, None)
    }

    /// The same, each line scrubbed of known secret values before it is cut.
    pub fn lines_with(
        &self,
        max_lines: usize,
        scrub: Option<&dyn crate::mcp::Scrub>,
    ) -> Vec<String> {
        ring_tail(&self.0, max_lines, scrub)
    }
}

fn ring_tail(
    ring: &Mutex<Ring>,
    max_lines: usize,
    scrub: Option<&dyn crate::mcp::Scrub>,
) -> Vec<String> {
    let Ok(r) = ring.lock() else {
        return Vec::new();
    };
    let bytes: Vec<u8> = r.bytes.iter().copied().collect();
    let text = String::from_utf8_lossy(&bytes);
    // Once the ring has dropped bytes, its first line is the tail of a longer one: it is
    // left out, so that the end of a secret cut at the ring's start is never shown.
    let skip_first = usize::from(r.dropped > 0);
    let lines: Vec<&str> = text
        .lines()
        .skip(skip_first)
        .filter(|l| !l.trim().is_empty())
        .collect();
    lines
        .iter()
        .skip(lines.len().saturating_sub(max_lines))
        .map(|l| match scrub {
            Some(s) => text::single_line_capped(&s.scrub_text(l), 300),
            None => text::single_line_capped(l, 300),
        })
        .collect()
}

impl ChildProcess {
    /// A handle on the stderr ring.
    pub fn stderr_handle(&self) -> StderrTail {
        StderrTail(Arc::clone(&self.stderr))
    }

    /// What the child's confinement enforces (`None`: unconfined).
    pub fn confinement(&self) -> Option<&crate::confine::Effective> {
        self.confinement.as_deref()
    }

    /// The process id (also its process-group id).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// How it ended, if it has.
    pub fn exit_status(&self) -> Option<Exit> {
        *self.exit.borrow()
    }

    /// A receiver that changes when the child exits.
    pub fn exit_watch(&self) -> watch::Receiver<Option<Exit>> {
        self.exit.clone()
    }

    /// Wait, at most `within`, until everything the child wrote to stderr has been read (a
    /// process that has exited can still have bytes in the pipe; one whose descendants keep
    /// the pipe open is waited for no longer than `within`).
    pub async fn stderr_drained(&self, within: Duration) {
        let mut rx = self.stderr_eof.clone();
        let _ = tokio::time::timeout(within, rx.wait_for(|done| *done)).await;
    }

    /// The last stderr lines, each made terminal-safe and redacted, at most `max_lines`.
    pub fn stderr_tail(&self, max_lines: usize) -> Vec<String> {
        ring_tail(&self.stderr, max_lines, None)
    }

    async fn wait_for(&mut self, within: Duration) -> bool {
        let mut rx = self.exit.clone();
        let done = async {
            loop {
                if rx.borrow().is_some() {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        };
        tokio::time::timeout(within, done).await.is_ok() && self.exit.borrow().is_some()
    }

    /// The shutdown ladder: close stdin and wait `grace`; SIGTERM the process group and wait
    /// `grace`; SIGKILL the group and wait for the reaper. Returns the rung that ended it, once
    /// the reaper has killed what was left of the group, reaped the child and ended every
    /// descendant that left it ([`sweep`]) — or after [`REAP_DEADLINE`].
    pub async fn shutdown(&mut self, grace: Duration) -> Ended {
        self.shutdown_within(grace, REAP_DEADLINE).await
    }

    /// [`ChildProcess::shutdown`], waiting at most `reap_deadline` for the reaper.
    async fn shutdown_within(&mut self, grace: Duration, reap_deadline: Duration) -> Ended {
        self.stdin = None;
        let ended = if self.wait_for(grace).await {
            Ended::OnEof
        } else {
            let _ = killpg(Pid::from_raw(self.pid), Signal::SIGTERM);
            if self.wait_for(grace).await {
                Ended::OnTerm
            } else {
                let _ = killpg(Pid::from_raw(self.pid), Signal::SIGKILL);
                let _ = self.wait_for(Duration::from_secs(30)).await;
                Ended::OnKill
            }
        };
        // The leader is gone; anything it left behind in its group goes too.
        self.release();
        let mut reaped = self.reaped.clone();
        let _ = tokio::time::timeout(reap_deadline, reaped.wait_for(|done| *done)).await;
        ended
    }

    /// Whether the reaper is done with this child (group killed, child reaped, adopted
    /// descendants ended, scratch directory removed).
    pub fn is_reaped(&self) -> bool {
        *self.reaped.borrow()
    }

    fn release(&mut self) {
        if let Some(tx) = self.reap.take() {
            let _ = tx.send(());
        }
    }

    /// Signal the whole group at once (used when the broker stops).
    pub fn kill_group(&self) {
        let _ = killpg(Pid::from_raw(self.pid), Signal::SIGKILL);
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if self.exit.borrow().is_none() {
            self.kill_group();
        }
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> EnvName {
        EnvName::parse(s).unwrap()
    }

    #[test]
    fn the_child_environment_is_built_from_nothing() {
        let lookup = |k: &str| match k {
            "API_TOKEN" => Some(OsString::from("secret-value")),
            "PATH" => Some(OsString::from("/evil/bin")),
            "LD_PRELOAD" => Some(OsString::from("/evil.so")),
            _ => None,
        };
        let (env, missing) = child_env(&[name("API_TOKEN"), name("NOT_SET")], None, lookup);
        let plain: Vec<(OsString, OsString)> = env
            .iter()
            .map(|(k, v)| (k.clone(), v.expose().to_os_string()))
            .collect();
        assert_eq!(
            plain,
            vec![
                ("PATH".into(), SAFE_PATH.into()),
                ("LANG".into(), CHILD_LANG.into()),
                ("API_TOKEN".into(), "secret-value".into()),
            ]
        );
        assert_eq!(format!("{:?}", env[2].1), "[value not shown]");
        assert_eq!(missing, vec![name("NOT_SET")]);
        let (env, _) = child_env(&[], Some("/opt/tools/bin"), lookup);
        assert_eq!(env[0].1.expose(), "/opt/tools/bin");
        let (env, _) = child_env(&[name("PATH")], None, lookup);
        assert_eq!(env.iter().filter(|(k, _)| k == "PATH").count(), 1);
        assert_eq!(env.last().unwrap().1.expose(), "/evil/bin");
    }

    #[test]
    fn bare_programs_are_found_only_on_the_given_path() {
        assert_eq!(
            resolve_program("sh", "/bin"),
            Some(PathBuf::from("/bin/sh"))
        );
        assert_eq!(resolve_program("sh", "relative:/nonexistent"), None);
        assert_eq!(resolve_program("/x/y", ""), Some(PathBuf::from("/x/y")));
    }

    #[tokio::test]
    async fn a_child_sees_only_its_built_environment_and_no_inherited_descriptors() {
        use std::os::fd::AsRawFd;
        // A descriptor the broker holds without close-on-exec: the child must not get it.
        let leaky = std::fs::File::open("/etc/passwd").unwrap();
        nix::fcntl::fcntl(
            &leaky,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )
        .unwrap();
        let leaky_fd = leaky.as_raw_fd() as u32;
        let (env, _) = child_env(&[], None, |_| None);
        let mut child = spawn(ChildSpec {
            command: "/bin/sh".into(),
            args: vec![
                "-c".into(),
                "env; for f in /proc/$$/fd/*; do echo fd:${f##*/}; done; grep NoNewPrivs /proc/$$/status; echo sid:$(cut -d' ' -f6 /proc/$$/stat)"
                    .into(),
            ],
            env,
            confine: None,
            egress: None,
        })
        .await
        .unwrap();
        let mut out = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .await
            .unwrap();
        assert!(child.wait_for(Duration::from_secs(5)).await);
        let lines: Vec<&str> = out.lines().collect();
        let env_lines: Vec<&&str> = lines.iter().filter(|l| l.contains('=')).collect();
        assert!(env_lines.iter().any(|l| l.starts_with("PATH=")));
        assert!(!out.contains("HOME="), "{out}");
        assert!(!out.contains("CARGO"), "{out}");
        assert!(out.contains("NoNewPrivs:\t1"), "{out}");
        // The shell holds 0, 1, 2 (and perhaps one for its own glob); nothing from the broker.
        let fds: Vec<u32> = lines
            .iter()
            .filter_map(|l| l.strip_prefix("fd:")?.parse().ok())
            .collect();
        assert!(fds.starts_with(&[0, 1, 2]), "{fds:?}");
        assert!(!fds.contains(&leaky_fd), "fd {leaky_fd} leaked: {fds:?}");
        assert!(fds.len() <= 4, "inherited descriptors: {fds:?}");
        // Its session id is its own pid (setsid).
        let sid: i32 = lines
            .iter()
            .find_map(|l| l.strip_prefix("sid:")?.parse().ok())
            .unwrap();
        assert_eq!(sid, child.pid());
    }

    #[tokio::test]
    async fn a_child_that_ignores_stdin_eof_is_terminated_and_one_that_ignores_term_is_killed() {
        let (env, _) = child_env(&[], None, |_| None);
        let mut polite = spawn(ChildSpec {
            command: "cat".into(),
            args: vec![],
            env: env.clone(),
            confine: None,
            egress: None,
        })
        .await
        .unwrap();
        assert_eq!(
            polite.shutdown(Duration::from_millis(500)).await,
            Ended::OnEof
        );
        let mut stubborn = spawn(ChildSpec {
            command: "/bin/sh".into(),
            args: vec!["-c".into(), "exec sleep 60".into()],
            env: env.clone(),
            confine: None,
            egress: None,
        })
        .await
        .unwrap();
        assert_eq!(
            stubborn.shutdown(Duration::from_millis(200)).await,
            Ended::OnTerm
        );
        assert_eq!(stubborn.exit_status(), Some(Exit::Signal(15)));
        let mut deaf = spawn(ChildSpec {
            command: "/bin/sh".into(),
            args: vec![
                "-c".into(),
                "trap '' TERM; while :; do sleep 0.05; done".into(),
            ],
            env,
            confine: None,
            egress: None,
        })
        .await
        .unwrap();
        assert_eq!(
            deaf.shutdown(Duration::from_millis(200)).await,
            Ended::OnKill
        );
        assert_eq!(deaf.exit_status(), Some(Exit::Signal(9)));
    }

    #[tokio::test]
    async fn stderr_is_kept_bounded_and_sanitized() {
        let (env, _) = child_env(&[], None, |_| None);
        let mut child = spawn(ChildSpec {
            command: "/bin/sh".into(),
            args: vec![
                "-c".into(),
                "i=0; while [ $i -lt 3000 ]; do echo \"line $i padding-padding-padding\" >&2; i=$((i+1)); done; printf 'esc \\033[31m Bearer abcdefghijklmnopqrstuvwxyz012345\\n' >&2"
                    .into(),
            ],
            env,
            confine: None,
            egress: None,
        })
        .await
        .unwrap();
        assert!(child.wait_for(Duration::from_secs(10)).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let total: usize = child.stderr.lock().unwrap().bytes.len();
        assert!(total <= STDERR_KEEP);
        let tail = child.stderr_tail(2);
        assert_eq!(tail.len(), 2);
        assert!(
            tail[1].starts_with("esc \\u{1b}[31m Bearer [REDACTED]"),
            "{tail:?}"
        );
    }

    #[test]
    fn the_threads_children_lists_find_an_adopted_orphan_as_a_scan_of_every_process_does() {
        crate::sys::become_subreaper().unwrap();
        // Held so that no reaper of another test sweeps the orphan away meanwhile.
        let _no_sweep = SWEEPING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // `sh` leaves a `sleep` behind and exits: the sleep is re-parented to this process.
        let out = std::process::Command::new("sh")
            .args(["-c", "sleep 30 >/dev/null 2>&1 & echo $!"])
            .output()
            .unwrap();
        let orphan: i32 = String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let me = std::process::id() as i32;
        let listed = thread_children().expect("this kernel lists each thread's children");
        assert!(listed.contains(&orphan), "{listed:?} lacks {orphan}");
        let fast = adopted(false);
        assert!(fast.iter().any(|(p, _)| *p == orphan), "{fast:?}");
        assert!(adopted(true).iter().any(|(p, _)| *p == orphan));
        let slow: Vec<i32> = all_pids()
            .into_iter()
            .filter(|p| parent_and_session(*p).is_some_and(|(pp, _)| pp == me))
            .collect();
        assert!(slow.contains(&orphan), "{slow:?}");
        // Its session is the one `sh` inherited, as the full scan reads it.
        assert_eq!(
            fast.iter().find(|(p, _)| *p == orphan).map(|(_, s)| *s),
            parent_and_session(orphan).map(|(_, s)| s)
        );
        nix::sys::signal::kill(Pid::from_raw(orphan), Signal::SIGKILL).unwrap();
        nix::sys::wait::waitpid(Pid::from_raw(orphan), None).unwrap();
        assert!(!adopted(false).iter().any(|(p, _)| *p == orphan));
        assert!(!adopted(true).iter().any(|(p, _)| *p == orphan));
    }

    #[test]
    fn a_sweep_stops_at_its_round_bound_and_the_next_one_finishes() {
        // A tree four levels deep: each round ends one level, then one round finds none.
        let levels = |n: usize| {
            let mut left = n;
            move || {
                if left == 0 {
                    0
                } else {
                    left -= 1;
                    1
                }
            }
        };
        assert_eq!(rounds_until_none(5, levels(4)), (4, true));
        // One round short: everything found was ended, but it cannot say nothing is left.
        assert_eq!(rounds_until_none(4, levels(4)), (4, false));
        let mut deeper = levels(6);
        assert_eq!(rounds_until_none(4, &mut deeper), (4, false));
        assert_eq!(rounds_until_none(4, &mut deeper), (2, true));
        assert_eq!(rounds_until_none(1, levels(0)), (0, true));
    }

    #[tokio::test]
    #[expect(
        clippy::await_holding_lock,
        reason = "the held sweep lock is what keeps the reaper (another thread) from finishing"
    )]
    async fn shutdown_waits_for_the_reaper_at_most_its_deadline() {
        let (env, _) = child_env(&[], None, |_| None);
        let spawn_cat = || {
            spawn(ChildSpec {
                command: "cat".into(),
                args: vec![],
                env: env.clone(),
                confine: None,
                egress: None,
            })
        };
        // A child not stopped yet: settle gives up at its deadline.
        let mut held = spawn_cat().await.unwrap();
        let t = std::time::Instant::now();
        assert!(!settle(Duration::from_millis(200)));
        assert!(t.elapsed() >= Duration::from_millis(200));
        // A sweep in progress (held here) keeps the reaper from finishing.
        let guard = SWEEPING.lock().unwrap();
        let t = std::time::Instant::now();
        let deadline = Duration::from_millis(300);
        assert_eq!(
            held.shutdown_within(Duration::from_millis(500), deadline)
                .await,
            Ended::OnEof
        );
        assert!(t.elapsed() >= deadline, "{:?}", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert!(!held.is_reaped());
        drop(guard);
        let mut rx = held.reaped.clone();
        tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|d| *d))
            .await
            .unwrap()
            .unwrap();
        // Unhindered, the wait ends as soon as the reaper is done, well before the deadline.
        let mut free = spawn_cat().await.unwrap();
        let t = std::time::Instant::now();
        free.shutdown_within(Duration::from_millis(500), Duration::from_secs(5))
            .await;
        assert!(free.is_reaped());
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[tokio::test]
    async fn a_missing_program_is_reported() {
        let e = spawn(ChildSpec {
            command: "no-such-program-iteron".into(),
            args: vec![],
            env: vec![("PATH".into(), "/bin".into())],
            confine: None,
            egress: None,
        })
        .await
        .unwrap_err();
        assert!(matches!(e, SpawnError::NotFound(_)));
        let e = spawn(ChildSpec {
            command: "/nonexistent/prog".into(),
            args: vec![],
            env: vec![],
            confine: None,
            egress: None,
        })
        .await
        .unwrap_err();
        assert!(matches!(e, SpawnError::Start { .. }), "{e}");
    }
}
