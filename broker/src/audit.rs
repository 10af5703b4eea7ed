//! The audit log: `<home>/audit/<YYYY-MM-DD>.jsonl` (UTC dates), append-only, one JSON object
//! per line, hash-chained.
//!
//! Every record carries a sequence number that continues across files and `prev`, the SHA-256
//! (hex) of the previous record's line (64 zeros for the first record ever). `<home>/audit/head`
//! holds the sequence number and hash of the newest record; it is updated after each append.
//! `verify` walks every file in date order and detects an edited, reordered, inserted or
//! removed record (including removal at the end, through the head, and of a whole older file,
//! through the sequence numbers).
//!
//! The chain is anchored outside `audit/`: `<home>/audit-anchor` names a record of the newest
//! run (written after its first record and again at a clean stop), so a log that was removed or
//! cut short is refused by the broker and reported by `verify` instead of starting a new chain;
//! the broker prints the newest record at stop, `verify --format json` prints it, and `verify`
//! checks records the operator pinned (`Pin`); where journald runs, every record's sequence
//! number and hash go to it as well.
//!
//! A head one record behind its log is what a broker killed between a record and its head
//! leaves, and also what someone appending a well-chained record leaves; neither passes
//! silently: `verify` fails on it while no broker runs, and a broker start adopts it only if it
//! chains onto the record the head names, writing an `audit_tail_adopted` record that `verify`
//! reports from then on. Any other mismatch at the end stops the start.
//!
//! A record is written whole or not at all: a short or failed write is cut back to the file's
//! length before it, so the file always ends in a whole record, and nothing more is appended
//! (the failure is printed on the broker's stderr and every effect is refused). Records of an
//! agent uid's requests that are not effects are bounded per second and counted beyond
//! ([`MAX_AGENT_RECORDS_PER_SEC`]); below [`SPACE_RESERVE`] of free space they are only counted
//! and effects are refused, so no agent can fill the disk or silence the broker through the log.
//!
//! The chain is unkeyed: it makes accidental and partial edits evident and gives a reviewer a
//! single value (the head) to copy elsewhere; someone holding the operator's uid can rewrite
//! the whole log, its head and the anchor consistently (a pin kept elsewhere, or journald with
//! Forward Secure Sealing, still shows it). Records never contain arguments, results or secrets:
//! arguments appear only as the SHA-256 of their canonical JSON.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};

use crate::private_fs::{self, FsError, Lock};

mod files;
#[cfg(test)]
mod tests;
mod verify;
mod vocab;

use files::{
    HEAD, free_bytes, head_bytes, lock, notice, open_private_for_write, unix_second, write_anchor,
};
use verify::check_tail;

pub use files::{below_reserve, canonical_json, sha256_hex, utc};
pub use verify::{Inspection, Pin, Tampered, Verified, inspect, verify, visit};
pub use vocab::{Decision, Kind, Outcome};

/// `prev` of the first record.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The largest record line the log writes or accepts (a record holds ids, names and digests only).
pub const MAX_RECORD: usize = 16 * 1024;

/// Records of one agent uid's requests written per second, effects aside: beyond, they are
/// counted, and the count is written as one `audit_suppressed` record before that uid's next
/// written record (or at stop). Effect records (`approved`/`denied` decisions and `dispatching`
/// outcomes), operator actions, and broker start and stop are never counted instead of written.
pub const MAX_AGENT_RECORDS_PER_SEC: u32 = 50;

/// Free space (for an unprivileged writer) the log's filesystem must keep. Below it effects are
/// refused (`audit_low_space`) and agents' other records are counted instead of written, so the
/// records of effects in flight and the operator's actions still fit.
pub const SPACE_RESERVE: u64 = 16 * 1024 * 1024;

/// How long one measurement of free space is reused for records that are not effects (an effect
/// measures it each time).
const SPACE_RECHECK: Duration = Duration::from_secs(1);

/// Most records one verification checks against expected hashes (`iteron audit verify --expect`).
pub const MAX_PINS: usize = 64;

/// journald's native-protocol socket: each record's sequence number and hash are sent to it
/// when it exists.
pub const JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

/// The anchor's file name in the home, outside `audit/` (same format as `audit/head`).
pub const ANCHOR: &str = "audit-anchor";
const ANCHOR_TEMP: &str = ".audit-anchor.tmp-";

/// Most distinct uids whose record rates are tracked; beyond (after idle entries are dropped),
/// further uids share one budget.
const MAX_RATE_UIDS: usize = 1024;
/// The shared budget's key (no process has this uid).
const SHARED_RATE_UID: u32 = u32::MAX;

/// The record the broker writes when it adopts a record its head did not confirm.
pub const ADOPTED_KIND: &str = "audit_tail_adopted";
/// The record that counts an agent uid's records that were not written one by one.
pub const SUPPRESSED_KIND: &str = "audit_suppressed";
// The two words above are also `Kind::AuditTailAdopted` and `Kind::AuditSuppressed` (the
// reader matches the word, the writer the variant; a unit test keeps them equal).

/// The keys of a record, in the order they are written.
pub const KEYS: [&str; 15] = [
    "seq",
    "time",
    "session",
    "peer_uid",
    "peer_pid",
    "kind",
    "server",
    "tool",
    "args_sha256",
    "decision",
    "duration_ms",
    "outcome",
    "detail",
    "identity",
    "prev",
];

/// Why the log could not be opened or written.
#[derive(Debug)]
pub enum AuditError {
    /// The directory or a file could not be used.
    Fs(FsError),
    /// Another broker holds this home's audit log.
    Busy(PathBuf),
    /// The log on disk does not match its head or anchor; the broker refuses to append to it.
    Broken(String),
    /// A record could not be written whole.
    Append {
        /// The day file.
        path: PathBuf,
        /// What went wrong.
        why: String,
        /// Whether the file was cut back to its length before the write.
        restored: bool,
    },
}

impl fmt::Display for AuditError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuditError::Fs(e) => write!(f, "audit log: {e}"),
            AuditError::Busy(p) => write!(
                f,
                "audit log {} is held by another running broker",
                p.display()
            ),
            AuditError::Broken(why) => {
                write!(
                    f,
                    "audit log is inconsistent ({why}); run iteron audit verify"
                )
            }
            AuditError::Append {
                path,
                why,
                restored,
            } => write!(
                f,
                "audit log: cannot append to {}: {why}; {}",
                path.display(),
                if *restored {
                    "the file still ends in a whole record"
                } else {
                    "the partial record could not be removed"
                }
            ),
        }
    }
}

impl std::error::Error for AuditError {}

impl From<FsError> for AuditError {
    fn from(e: FsError) -> Self {
        AuditError::Fs(e)
    }
}

/// Why an effect may not start: its records might not be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// A write failed; nothing more is appended until the broker restarts.
    Failed,
    /// The log's filesystem has less than [`SPACE_RESERVE`] free.
    LowSpace {
        /// Free bytes measured.
        free: u64,
    },
}

impl Gate {
    /// The reason a request refused this way is given (also its audit outcome).
    pub fn reason(self) -> crate::ipc::proto::Reason {
        match self {
            Gate::Failed => crate::ipc::proto::Reason::AuditUnavailable,
            Gate::LowSpace { .. } => crate::ipc::proto::Reason::AuditLowSpace,
        }
    }

    /// What the agent is told (fixed text).
    pub fn refusal(self) -> &'static str {
        match self {
            Gate::Failed => {
                "the broker cannot write its audit log, so it performs no effects; ask the operator"
            }
            Gate::LowSpace { .. } => {
                "the disk holding the broker's audit log is nearly full, so it performs no effects; ask the operator"
            }
        }
    }
}

/// What happened, as recorded. Strings here are identifiers and fixed words chosen by the
/// broker, never caller text (server and tool names are those of the configuration or refused).
/// Built with [`Event::new`] and struct update syntax.
#[derive(Debug, Clone)]
pub struct Event {
    /// The session id (`None` before a session exists).
    pub session: Option<String>,
    /// Peer uid.
    pub peer_uid: Option<u32>,
    /// Peer pid.
    pub peer_pid: Option<i32>,
    /// What the record is about.
    pub kind: Kind,
    /// Server name (a configured one).
    pub server: Option<String>,
    /// Tool name (an exposed one).
    pub tool: Option<String>,
    /// SHA-256 of the canonical arguments.
    pub args_sha256: Option<String>,
    /// How far the request got.
    pub decision: Decision,
    /// Milliseconds from request to answer.
    pub duration_ms: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// A short fixed-vocabulary detail (e.g. the certainty of a failed effect), redacted.
    pub detail: Option<String>,
    /// For a child session's first record: the SHA-256 content identity of its agent
    /// definition (64 lowercase hex digits; anything else is not recorded).
    pub identity: Option<String>,
}

impl Event {
    /// A record of `kind` with its decision and outcome, every other field empty.
    pub fn new(kind: Kind, decision: Decision, outcome: Outcome) -> Event {
        Event {
            session: None,
            peer_uid: None,
            peer_pid: None,
            kind,
            server: None,
            tool: None,
            args_sha256: None,
            decision,
            duration_ms: 0,
            outcome,
            detail: None,
            identity: None,
        }
    }
}

/// One line of the log, serialized field by field in the order of [`KEYS`] (a derived
/// serializer: no intermediate JSON tree per record).
#[derive(serde::Serialize)]
struct Record<'a> {
    seq: u64,
    time: &'a str,
    session: Option<&'a str>,
    peer_uid: Option<u32>,
    peer_pid: Option<i32>,
    kind: &'a str,
    server: Option<&'a str>,
    tool: Option<&'a str>,
    args_sha256: Option<&'a str>,
    decision: &'a str,
    duration_ms: u64,
    outcome: &'a str,
    detail: Option<&'a str>,
    identity: Option<&'a str>,
    prev: &'a str,
}

/// One uid's records in the current second.
#[derive(Debug, Default, Clone, Copy)]
struct Window {
    second: u64,
    written: u32,
    /// Counted, not yet summarised.
    suppressed: u64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Space {
    measured: Option<Instant>,
    free: u64,
    low: bool,
}

struct Chain {
    seq: u64,
    prev: String,
    day: String,
    file: Option<File>,
    head: Option<File>,
    /// The anchor names a record of this run.
    anchored: bool,
    /// The first failure, as printed.
    failure: Option<String>,
    rates: HashMap<u32, Window>,
    suppressed_total: u64,
    space: Space,
}

/// Where each head goes besides `audit/head` (journald, when it runs).
struct Journal {
    socket: UnixDatagram,
    path: PathBuf,
    home: Vec<u8>,
}

/// How to open a log (the defaults are the broker's).
#[derive(Debug, Clone)]
pub struct Options {
    /// journald's socket (`None`: send nowhere). Nothing is sent when the path is not a socket.
    pub journal: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            journal: Some(PathBuf::from(JOURNAL_SOCKET)),
        }
    }
}

/// The open log of one broker (it holds `audit/.lock` for its lifetime).
pub struct AuditLog {
    home: PathBuf,
    dir: PathBuf,
    failed: AtomicBool,
    chain: Mutex<Chain>,
    journal: Option<Journal>,
    _lock: Lock,
}

/// Whether a record may be counted instead of written: one of an agent's requests that is not
/// an effect. Effects (`approved`/`denied` decisions, the `dispatching` record), operator
/// actions, refused peers (bounded on their own), and broker start and stop are always written.
fn limitable(e: &Event) -> bool {
    let kept_kind = match e.kind {
        Kind::OperatorDecide
        | Kind::OperatorAnswer
        | Kind::OperatorCancel
        | Kind::OperatorRestart
        | Kind::OperatorStop
        | Kind::OperatorLogout
        | Kind::ConnectAgent
        | Kind::ConnectOperator
        | Kind::BrokerStart
        | Kind::BrokerStop => true,
        Kind::Hello
        | Kind::EndSession
        | Kind::ProtocolError
        | Kind::IdleClose
        | Kind::ListTools
        | Kind::ListResources
        | Kind::ListPrompts
        | Kind::CallTool
        | Kind::ReadResource
        | Kind::GetPrompt
        | Kind::UseSkill
        | Kind::ResolveAgent
        | Kind::Hook
        | Kind::EgressRefused
        | Kind::AuditSuppressed
        | Kind::AuditTailAdopted => false,
    };
    e.peer_uid.is_some()
        && !matches!(
            e.decision,
            Decision::Approved | Decision::Denied | Decision::ApprovedByRule
        )
        && e.outcome != Outcome::Dispatching
        && !kept_kind
}

/// One limitable record at second `now`: whether it gets written. Beyond
/// [`MAX_AGENT_RECORDS_PER_SEC`] in one second it is counted in `suppressed` instead.
fn rate_step(w: &mut Window, now: u64) -> bool {
    if w.second != now {
        w.second = now;
        w.written = 0;
    }
    if w.written >= MAX_AGENT_RECORDS_PER_SEC {
        w.suppressed += 1;
        return false;
    }
    w.written += 1;
    true
}

/// The window of `uid`, dropping idle windows (and then sharing one) when too many are tracked.
fn window(rates: &mut HashMap<u32, Window>, uid: u32, now: u64) -> &mut Window {
    let mut key = uid;
    if !rates.contains_key(&uid) && rates.len() >= MAX_RATE_UIDS {
        rates.retain(|_, w| w.second == now || w.suppressed > 0);
        if rates.len() >= MAX_RATE_UIDS {
            key = SHARED_RATE_UID;
        }
    }
    rates.entry(key).or_default()
}

fn suppressed_event(uid: u32, n: u64) -> Event {
    Event {
        peer_uid: Some(uid),
        detail: Some(format!(
            "{n} records of this uid were counted, not written (at most {MAX_AGENT_RECORDS_PER_SEC} per second; none while the disk is under its reserve)"
        )),
        ..Event::new(Kind::AuditSuppressed, Decision::Allowed, Outcome::Counted)
    }
}

impl Journal {
    fn open(path: &Path, home: &Path) -> Option<Journal> {
        let meta = fs::symlink_metadata(path).ok()?;
        if !meta.file_type().is_socket() {
            return None;
        }
        let socket = UnixDatagram::unbound().ok()?;
        // Never wait for journald: a full queue drops the datagram, not the broker's time.
        socket.set_nonblocking(true).ok()?;
        Some(Journal {
            socket,
            path: path.to_path_buf(),
            home: home.as_os_str().as_bytes().to_vec(),
        })
    }

    /// One entry in journald's native protocol: `KEY=value` lines, and the home (which may hold
    /// any byte) in the length-prefixed form.
    fn entry(&self, seq: u64, hash: &str, kind: &str) -> Vec<u8> {
        let mut m = format!(
            "MESSAGE=iteron audit record {seq}:{hash} ({kind})\nPRIORITY=6\nSYSLOG_IDENTIFIER=iteron-broker\nITERON_AUDIT_SEQ={seq}\nITERON_AUDIT_SHA256={hash}\nITERON_AUDIT_KIND={kind}\n"
        )
        .into_bytes();
        m.extend_from_slice(b"ITERON_HOME\n");
        m.extend_from_slice(&(self.home.len() as u64).to_le_bytes());
        m.extend_from_slice(&self.home);
        m.push(b'\n');
        m
    }

    fn send(&self, seq: u64, hash: &str, kind: &str) {
        let _ = self
            .socket
            .send_to(&self.entry(seq, hash, kind), &self.path);
    }
}

impl AuditLog {
    /// Open (creating if needed) the log under `home`, take its lock, and continue its chain.
    /// Refuses a log whose end does not match its head, or that lacks the record its anchor
    /// names.
    pub fn open(home: &Path) -> Result<AuditLog, AuditError> {
        Self::open_with(home, &Options::default())
    }

    /// [`AuditLog::open`] with explicit options.
    pub fn open_with(home: &Path, opts: &Options) -> Result<AuditLog, AuditError> {
        private_fs::ensure_private_dir(home)?;
        let dir = home.join("audit");
        private_fs::ensure_private_dir(&dir)?;
        let lock_path = dir.join(".lock");
        let lock = private_fs::try_lock(&lock_path)?.ok_or(AuditError::Busy(dir.clone()))?;
        // Under the lock no other broker of this home writes an anchor.
        private_fs::remove_stale_temps(home, ANCHOR_TEMP);
        let tail = check_tail(home, &dir)?;
        let log = AuditLog {
            home: home.to_path_buf(),
            dir,
            failed: AtomicBool::new(false),
            chain: Mutex::new(Chain {
                seq: tail.next_seq,
                prev: tail.prev,
                day: String::new(),
                file: None,
                head: None,
                anchored: false,
                failure: None,
                rates: HashMap::new(),
                suppressed_total: 0,
                space: Space::default(),
            }),
            journal: opts.journal.as_deref().and_then(|p| Journal::open(p, home)),
            _lock: lock,
        };
        if let Some(seq) = tail.adopted {
            let why = format!(
                "record {seq} was on disk without its head: a broker was killed between writing it and its head, or someone else appended it"
            );
            notice(&format!(
                "audit log: {why}; it is adopted and that is recorded"
            ));
            log.append(&Event {
                detail: Some(why),
                ..Event::new(
                    Kind::AuditTailAdopted,
                    Decision::Allowed,
                    Outcome::UnconfirmedRecord,
                )
            })?;
        }
        Ok(log)
    }

    /// The directory of the log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a write failed (then nothing more is appended and every effect is refused).
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// Append one record (or count it: see [`MAX_AGENT_RECORDS_PER_SEC`] and
    /// [`SPACE_RESERVE`]). The line is written with a single `write` on an `O_APPEND` file and
    /// cut back if that write is short or fails; then the head is updated.
    pub fn append(&self, event: &Event) -> Result<(), AuditError> {
        let mut chain = lock(&self.chain);
        if self.failed() {
            return Err(AuditError::Broken(
                "an earlier write failed; nothing more is appended".into(),
            ));
        }
        let mut summary = None;
        if let Some(uid) = event.peer_uid {
            let limit = limitable(event);
            let low = limit && self.measure(&mut chain, false).low;
            let now = unix_second();
            let Chain {
                rates,
                suppressed_total,
                ..
            } = &mut *chain;
            let w = window(rates, uid, now);
            if limit {
                let written = if low {
                    w.suppressed += 1;
                    false
                } else {
                    rate_step(w, now)
                };
                if !written {
                    *suppressed_total += 1;
                    return Ok(());
                }
            }
            let n = std::mem::take(&mut w.suppressed);
            if n > 0 {
                summary = Some(suppressed_event(uid, n));
            }
        }
        if let Some(s) = summary {
            self.write(&mut chain, &s)?;
        }
        self.write(&mut chain, event)
    }

    /// Append the record of an effect about to happen, or say why the effect may not start.
    pub fn append_effect(&self, event: &Event) -> Result<(), Gate> {
        self.effect_gate()?;
        self.append(event).map_err(|_| Gate::Failed)
    }

    /// Whether an effect may start: the log is writable and its filesystem has
    /// [`SPACE_RESERVE`] free (measured now).
    pub fn effect_gate(&self) -> Result<(), Gate> {
        if self.failed() {
            return Err(Gate::Failed);
        }
        let mut chain = lock(&self.chain);
        let space = self.measure(&mut chain, true);
        if space.low {
            return Err(Gate::LowSpace { free: space.free });
        }
        Ok(())
    }

    /// The log's state for the operator (`status`): `state` is `ok`, `failed` or `low_space`.
    pub fn state_json(&self) -> Value {
        let failed = self.failed();
        let mut chain = lock(&self.chain);
        let space = self.measure(&mut chain, true);
        let (state, detail) = if failed {
            ("failed", chain.failure.clone())
        } else if space.low {
            (
                "low_space",
                Some(format!(
                    "{} bytes free, under the reserve of {SPACE_RESERVE}: effects are refused",
                    space.free
                )),
            )
        } else {
            ("ok", None)
        };
        json!({
            "state": state,
            "detail": detail,
            "newest": (chain.seq > 0).then(|| format!("{}:{}", chain.seq - 1, chain.prev)),
            "free_bytes": space.free,
            "reserve_bytes": SPACE_RESERVE,
            "suppressed_records": chain.suppressed_total,
        })
    }

    /// Measure free space (reusing a measurement younger than [`SPACE_RECHECK`] unless
    /// `fresh`), printing a line when it crosses the reserve.
    fn measure(&self, chain: &mut Chain, fresh: bool) -> Space {
        if !fresh
            && chain
                .space
                .measured
                .is_some_and(|t| t.elapsed() < SPACE_RECHECK)
        {
            return chain.space;
        }
        let free = free_bytes(&self.dir);
        let low = below_reserve(free);
        if low && !chain.space.low {
            notice(&format!(
                "audit log: only {free} bytes free on its filesystem, under the reserve of {SPACE_RESERVE}: effects are refused and agents' other records are counted, not written, until space is freed"
            ));
        } else if !low && chain.space.low {
            notice(&format!(
                "audit log: {free} bytes free again; effects are allowed"
            ));
        }
        chain.space = Space {
            measured: Some(Instant::now()),
            free,
            low,
        };
        chain.space
    }

    /// Write one record; the first failure marks the log failed and is printed.
    fn write(&self, chain: &mut Chain, event: &Event) -> Result<(), AuditError> {
        let result = Self::write_locked(&self.dir, chain, event).and_then(|(seq, hash)| {
            if let Some(j) = &self.journal {
                j.send(seq, &hash, event.kind.as_str());
            }
            if !chain.anchored {
                chain.anchored = true;
                write_anchor(&self.home, seq, &hash)?;
            }
            Ok(())
        });
        if let Err(e) = &result
            && !self.failed.swap(true, Ordering::SeqCst)
        {
            let line = e.to_string();
            notice(&format!(
                "AUDIT LOG FAILED: {line}; nothing more is written to it and every effect is refused until the broker is restarted"
            ));
            chain.failure = Some(line);
        }
        result
    }

    fn write_locked(
        dir: &Path,
        chain: &mut Chain,
        event: &Event,
    ) -> Result<(u64, String), AuditError> {
        let (time, day) = utc(SystemTime::now());
        if chain.day != day || chain.file.is_none() {
            let path = dir.join(format!("{day}.jsonl"));
            chain.file = Some(open_private_for_write(&path, true)?);
            chain.day = day;
        }
        let head = dir.join(HEAD);
        if chain.head.is_none() {
            chain.head = Some(open_private_for_write(&head, false)?);
        }
        let detail = event
            .detail
            .as_deref()
            .map(|d| iteron_policy::text::single_line_capped(d, 200));
        let record = Record {
            seq: chain.seq,
            time: &time,
            session: event.session.as_deref(),
            peer_uid: event.peer_uid,
            peer_pid: event.peer_pid,
            kind: event.kind.as_str(),
            server: event.server.as_deref(),
            tool: event.tool.as_deref(),
            args_sha256: event.args_sha256.as_deref(),
            decision: event.decision.as_str(),
            duration_ms: event.duration_ms,
            outcome: event.outcome.as_str(),
            detail: detail.as_deref(),
            identity: event
                .identity
                .as_deref()
                .filter(|i| i.len() == 64 && i.bytes().all(|b| b.is_ascii_hexdigit())),
            prev: &chain.prev,
        };
        let mut line = serde_json::to_vec(&record).unwrap_or_default();
        if line.is_empty() || line.len() > MAX_RECORD {
            return Err(AuditError::Broken("a record is over the size bound".into()));
        }
        let hash = sha256_hex(&line);
        line.push(b'\n');
        let path = dir.join(format!("{}.jsonl", chain.day));
        let (Some(file), Some(hf)) = (chain.file.as_ref(), chain.head.as_ref()) else {
            // Both were opened above.
            return Err(AuditError::Broken("the log files are not open".into()));
        };
        // Where this record starts: a short or failed write is cut back to it.
        let before = file
            .metadata()
            .map_err(private_fs::io_err("inspect", &path))?
            .len();
        let cut = |why: String| AuditError::Append {
            path: path.clone(),
            why,
            restored: file.set_len(before).is_ok(),
        };
        match (&*file).write(&line) {
            Ok(n) if n == line.len() => {}
            Ok(n) => {
                return Err(cut(format!(
                    "only {n} of {} bytes were written",
                    line.len()
                )));
            }
            Err(e) => return Err(cut(e.to_string())),
        }
        if let Err(e) = hf.write_all_at(&head_bytes(chain.seq, &hash), 0) {
            // The record goes too, and the head is put back: file and head stay in step.
            let err = cut(format!("cannot write the head: {e}"));
            if chain.seq > 0 {
                let _ = hf.write_all_at(&head_bytes(chain.seq - 1, &chain.prev), 0);
            }
            return Err(err);
        }
        let seq = chain.seq;
        chain.seq += 1;
        chain.prev.clone_from(&hash);
        Ok((seq, hash))
    }

    /// Flush the newest day file and the head to disk.
    pub fn sync(&self) {
        let chain = lock(&self.chain);
        if let Some(f) = chain.file.as_ref() {
            let _ = f.sync_all();
        }
        if let Some(h) = chain.head.as_ref() {
            let _ = h.sync_all();
        }
    }

    /// At a clean stop: write the counts still pending, flush, point the anchor at the newest
    /// record, and print it on stderr (the value to pin with `iteron audit verify --expect`).
    pub fn close(&self) {
        let mut chain = lock(&self.chain);
        if !self.failed() {
            let pending: Vec<(u32, u64)> = chain
                .rates
                .iter_mut()
                .filter(|(_, w)| w.suppressed > 0)
                .map(|(uid, w)| (*uid, std::mem::take(&mut w.suppressed)))
                .collect();
            for (uid, n) in pending {
                if self.write(&mut chain, &suppressed_event(uid, n)).is_err() {
                    break;
                }
            }
        }
        if let Some(f) = chain.file.as_ref() {
            let _ = f.sync_all();
        }
        if let Some(h) = chain.head.as_ref() {
            let _ = h.sync_all();
        }
        if chain.seq == 0 {
            notice("stopped; the audit log has no records");
            return;
        }
        let newest = format!("{}:{}", chain.seq - 1, chain.prev);
        if let Err(e) = write_anchor(&self.home, chain.seq - 1, &chain.prev) {
            notice(&format!("audit log: cannot update {ANCHOR}: {e}"));
        }
        let failed = if self.failed() {
            "; the audit log FAILED earlier (see above)"
        } else {
            ""
        };
        notice(&format!(
            "stopped; newest audit record {newest}{failed} (check it later: iteron audit verify --expect {newest})"
        ));
    }
}
