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

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::private_fs::{self, FsError, Lock};

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
    /// The audit outcome of a request refused for this reason.
    pub fn outcome(self) -> &'static str {
        match self {
            Gate::Failed => "audit_unavailable",
            Gate::LowSpace { .. } => "audit_low_space",
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
#[derive(Debug, Clone, Default)]
pub struct Event {
    /// The session id (`None` before a session exists).
    pub session: Option<String>,
    /// Peer uid.
    pub peer_uid: Option<u32>,
    /// Peer pid.
    pub peer_pid: Option<i32>,
    /// Request kind (`call_tool`, `hello`, `refused_peer`, …).
    pub kind: &'static str,
    /// Server name (a configured one).
    pub server: Option<String>,
    /// Tool name (an exposed one).
    pub tool: Option<String>,
    /// SHA-256 of the canonical arguments.
    pub args_sha256: Option<String>,
    /// The decision (`allowed`, `approved`, `denied`, `refused`, …).
    pub decision: &'static str,
    /// Milliseconds from request to answer.
    pub duration_ms: u64,
    /// The outcome (`ok`, `tool_error`, `failed`, `cancelled`, …).
    pub outcome: &'static str,
    /// A short fixed-vocabulary detail (e.g. the certainty of a failed effect), redacted.
    pub detail: Option<String>,
    /// For a child session's first record: the SHA-256 content identity of its agent
    /// definition (64 lowercase hex digits; anything else is not recorded).
    pub identity: Option<String>,
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

/// Hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::credentials::hex(&Sha256::digest(bytes))
}

/// JSON with object keys sorted (recursively) and no whitespace: the form whose SHA-256 the
/// log records for arguments.
pub fn canonical_json(v: &Value) -> Vec<u8> {
    fn sort(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                let mut out = Map::new();
                for k in keys {
                    out.insert(k.clone(), sort(&m[k]));
                }
                Value::Object(out)
            }
            Value::Array(a) => Value::Array(a.iter().map(sort).collect()),
            other => other.clone(),
        }
    }
    serde_json::to_vec(&sort(v)).unwrap_or_default()
}

/// Days since 1970-01-01 to a civil (proleptic Gregorian) date.
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` and `YYYY-MM-DD` for a time.
pub fn utc(t: SystemTime) -> (String, String) {
    let since = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs() as i64;
    let (y, mo, d) = civil(secs.div_euclid(86_400));
    let rem = secs.rem_euclid(86_400);
    let day = format!("{y:04}-{mo:02}-{d:02}");
    let time = format!(
        "{day}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60,
        since.subsec_millis()
    );
    (time, day)
}

fn unix_second() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Longest line the log prints on the broker's stderr.
const MAX_NOTICE: usize = 1024;

/// One line on the broker's stderr: terminal-safe, but not redacted (it carries record hashes,
/// which look like tokens to the redactor, and never a secret).
fn notice(line: &str) {
    let _ = writeln!(
        io::stderr(),
        "iteron broker: {}",
        iteron_policy::text::escape_capped(line, MAX_NOTICE)
    );
}

fn is_day_file(name: &str) -> bool {
    let b = name.as_bytes();
    name.len() == 16
        && name.ends_with(".jsonl")
        && b[..10].iter().enumerate().all(|(i, c)| {
            if i == 4 || i == 7 {
                *c == b'-'
            } else {
                c.is_ascii_digit()
            }
        })
}

/// The day files of a log directory, oldest first.
fn day_files(dir: &Path) -> Result<Vec<PathBuf>, FsError> {
    let mut names = Vec::new();
    let entries = fs::read_dir(dir).map_err(private_fs::io_err("list", dir))?;
    for entry in entries {
        let entry = entry.map_err(private_fs::io_err("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_day_file(&name) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

const HEAD: &str = "head";
const HEAD_LEN: usize = 20 + 1 + 64 + 1;

fn head_bytes(seq: u64, hash: &str) -> Vec<u8> {
    format!("{seq:020} {hash}\n").into_bytes()
}

fn is_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn parse_head(bytes: &[u8]) -> Option<(u64, String)> {
    let s = std::str::from_utf8(bytes).ok()?;
    let s = s.strip_suffix('\n')?;
    let (seq, hash) = s.split_once(' ')?;
    if seq.len() != 20 || !seq.bytes().all(|b| b.is_ascii_digit()) || !is_hash(hash) {
        return None;
    }
    Some((seq.parse().ok()?, hash.to_owned()))
}

/// Read a private file (never following a symlink, never blocking on a FIFO); `None` if missing.
/// Open (creating 0600 if needed, never through a symlink) a file of the log for writing —
/// appending, or in place for the head — and check it is private, ours and not linked twice.
fn open_private_for_write(path: &Path, append: bool) -> Result<File, AuditError> {
    let mut o = OpenOptions::new();
    if append {
        o.append(true);
    } else {
        o.write(true).truncate(false);
    }
    let file = o
        .create(true)
        .mode(0o600)
        .custom_flags((nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK).bits())
        .open(path)
        .map_err(private_fs::io_err("open", path))?;
    let meta = file
        .metadata()
        .map_err(private_fs::io_err("inspect", path))?;
    private_fs::check_private(path, &meta, false)?;
    Ok(file)
}

fn read_private(path: &Path, max: u64) -> Result<Option<Vec<u8>>, FsError> {
    let flags = nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK;
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits())
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err(FsError::NotPlain {
                path: path.to_path_buf(),
                expected: "regular file",
            });
        }
        Err(e) => return Err(private_fs::io_err("open", path)(e)),
    };
    let meta = file
        .metadata()
        .map_err(private_fs::io_err("inspect", path))?;
    private_fs::check_private(path, &meta, false)?;
    let mut out = Vec::new();
    io::Read::read_to_end(&mut io::Read::take(&file, max), &mut out)
        .map_err(private_fs::io_err("read", path))?;
    Ok(Some(out))
}

/// A head-format file (`audit/head`, `audit-anchor`): `None` if missing.
fn read_pointer(path: &Path, what: &str) -> Result<Option<(u64, String)>, AuditError> {
    match read_private(path, HEAD_LEN as u64 + 1)? {
        None => Ok(None),
        Some(b) => parse_head(&b)
            .map(Some)
            .ok_or_else(|| AuditError::Broken(format!("{what} is unreadable"))),
    }
}

/// The home and `audit/` must be private directories of ours (as the broker requires); `false`
/// when `audit/` does not exist.
fn check_dirs(home: &Path, dir: &Path) -> Result<bool, FsError> {
    for path in [home, dir] {
        match fs::symlink_metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(private_fs::io_err("inspect", path)(e)),
            Ok(meta) => private_fs::check_private(path, &meta, true)?,
        }
    }
    Ok(true)
}

/// Replace the anchor atomically (fresh 0600 file, fsync, rename, directory fsync).
fn write_anchor(home: &Path, seq: u64, hash: &str) -> Result<(), FsError> {
    let tmp = home.join(private_fs::temp_name(ANCHOR_TEMP));
    let target = home.join(ANCHOR);
    private_fs::write_new_file(&tmp, &head_bytes(seq, hash))?;
    if let Err(e) = fs::rename(&tmp, &target) {
        let _ = fs::remove_file(&tmp);
        return Err(private_fs::io_err("rename", &target)(e));
    }
    private_fs::sync_dir(home)
}

/// Free bytes for an unprivileged writer on the filesystem of `dir` (0 when unknown: fail closed).
#[allow(
    clippy::useless_conversion,
    reason = "the statvfs field types are narrower than u64 on some targets"
)]
fn free_bytes(dir: &Path) -> u64 {
    nix::sys::statvfs::statvfs(dir).map_or(0, |s| {
        u64::from(s.blocks_available()).saturating_mul(u64::from(s.fragment_size()))
    })
}

/// Whether `free` bytes are below [`SPACE_RESERVE`] (exactly the reserve is enough).
pub fn below_reserve(free: u64) -> bool {
    free < SPACE_RESERVE
}

/// Whether a record may be counted instead of written: one of an agent's requests that is not
/// an effect. Effects (`approved`/`denied` decisions, the `dispatching` record), operator
/// actions, refused peers (bounded on their own), and broker start and stop are always written.
fn limitable(e: &Event) -> bool {
    e.peer_uid.is_some()
        && !matches!(e.decision, "approved" | "denied" | "approved_by_rule")
        && e.outcome != "dispatching"
        && !e.kind.starts_with("operator_")
        && !e.kind.starts_with("connect_")
        && !e.kind.starts_with("broker_")
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
        kind: SUPPRESSED_KIND,
        decision: "allowed",
        outcome: "counted",
        detail: Some(format!(
            "{n} records of this uid were counted, not written (at most {MAX_AGENT_RECORDS_PER_SEC} per second; none while the disk is under its reserve)"
        )),
        ..Event::default()
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

/// A record as read back: what the chain and the anchor need.
#[derive(Debug, Clone)]
struct Rec {
    seq: u64,
    prev: String,
    kind: String,
    hash: String,
}

/// Check that `line` is a record as the log writes it (the documented keys, a sequence number,
/// a well-formed `prev`, a time within `day`).
fn parse_record(line: &[u8], day: &str) -> Result<Rec, &'static str> {
    if line.is_empty() {
        return Err("empty line");
    }
    if line.len() > MAX_RECORD {
        return Err("record over the size bound");
    }
    let v: Value = serde_json::from_slice(line).map_err(|_| "not a JSON record")?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    if obj.len() != KEYS.len() || !KEYS.iter().all(|k| obj.contains_key(*k)) {
        return Err("the record's fields were changed");
    }
    let seq = obj
        .get("seq")
        .and_then(Value::as_u64)
        .ok_or("the sequence number is not a number")?;
    let prev = obj
        .get("prev")
        .and_then(Value::as_str)
        .filter(|p| is_hash(p))
        .ok_or("the chain is broken (the prev hash is malformed)")?;
    let kind = obj
        .get("kind")
        .and_then(Value::as_str)
        .ok_or("the kind is not a string")?;
    let time = obj.get("time").and_then(Value::as_str).unwrap_or("");
    if !time.starts_with(day) {
        return Err("the record's date does not match its file");
    }
    Ok(Rec {
        seq,
        prev: prev.to_owned(),
        kind: kind.to_owned(),
        hash: sha256_hex(line),
    })
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `YYYY-MM-DD` of a day file.
fn day_of(path: &Path) -> String {
    file_name(path).chars().take(10).collect()
}

/// The newest two records (newest first), across files.
fn newest_two(files: &[PathBuf]) -> Result<Vec<Rec>, AuditError> {
    let mut out = Vec::new();
    for path in files.iter().rev() {
        let bytes = read_private(path, u64::MAX)?.unwrap_or_default();
        if bytes.is_empty() {
            continue;
        }
        let Some(body) = bytes.strip_suffix(b"\n") else {
            return Err(AuditError::Broken(format!(
                "{} ends in a partial record",
                file_name(path)
            )));
        };
        let day = day_of(path);
        for line in body.rsplit(|b| *b == b'\n') {
            let rec = parse_record(line, &day).map_err(|why| {
                AuditError::Broken(format!(
                    "{} ends in a malformed record: {why}",
                    file_name(path)
                ))
            })?;
            out.push(rec);
            if out.len() == 2 {
                return Ok(out);
            }
        }
    }
    Ok(out)
}

/// The hash of record `seq`, looking only into the file that holds it.
fn find_hash(files: &[PathBuf], seq: u64) -> Result<Option<String>, AuditError> {
    let malformed = |path: &Path, why: &str| {
        AuditError::Broken(format!(
            "{} holds a malformed record: {why}",
            file_name(path)
        ))
    };
    for path in files.iter().rev() {
        let day = day_of(path);
        let start = read_private(path, MAX_RECORD as u64 + 1)?.unwrap_or_default();
        let Some(first) = start
            .split(|b| *b == b'\n')
            .next()
            .filter(|l| !l.is_empty())
        else {
            continue;
        };
        if parse_record(first, &day)
            .map_err(|w| malformed(path, w))?
            .seq
            > seq
        {
            continue;
        }
        let bytes = read_private(path, u64::MAX)?.unwrap_or_default();
        let body = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
        for line in body.split(|b| *b == b'\n') {
            let rec = parse_record(line, &day).map_err(|w| malformed(path, w))?;
            if rec.seq == seq {
                return Ok(Some(rec.hash));
            }
        }
        return Ok(None);
    }
    Ok(None)
}

/// Where the broker continues the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Tail {
    next_seq: u64,
    prev: String,
    /// The newest record, which the head did not confirm (it is adopted, and that recorded).
    adopted: Option<u64>,
}

/// The broker's check of the log's end before it appends: the newest record must be the one
/// the head names, or its successor chained to it (a broker killed between the two writes); the
/// record the anchor names must be in the log with its hash.
fn check_tail(home: &Path, dir: &Path) -> Result<Tail, AuditError> {
    let head = read_pointer(&dir.join(HEAD), "the head")?;
    let anchor = read_pointer(&home.join(ANCHOR), ANCHOR)?;
    let files = day_files(dir)?;
    let recent = newest_two(&files)?;
    let (tail, last) = match (head, recent.first()) {
        (None, None) => {
            if let Some((aseq, _)) = anchor {
                return Err(AuditError::Broken(format!(
                    "the log is missing or empty but {ANCHOR} names record {aseq}: it was removed (restore it; to start a new log on purpose, move audit/ and {ANCHOR} away together)"
                )));
            }
            return Ok(Tail {
                next_seq: 0,
                prev: GENESIS.to_owned(),
                adopted: None,
            });
        }
        (Some(_), None) => return Err(AuditError::Broken("records are missing".into())),
        (None, Some(_)) => return Err(AuditError::Broken("the head is missing".into())),
        (Some((hseq, hhash)), Some(last)) => {
            let before = recent.get(1);
            if let Some(b) = before
                && (b.seq + 1 != last.seq || b.hash != last.prev)
            {
                return Err(AuditError::Broken(
                    "the newest two records are not chained".into(),
                ));
            }
            let adopted = if last.seq == hseq && last.hash == hhash {
                None
            } else if last.seq == hseq + 1
                && last.prev == hhash
                && before.is_some_and(|b| b.seq == hseq && b.hash == hhash)
            {
                Some(last.seq)
            } else if last.seq < hseq {
                return Err(AuditError::Broken(
                    "records at the end were removed (the head names a later record)".into(),
                ));
            } else {
                return Err(AuditError::Broken(
                    "the newest record does not match the head".into(),
                ));
            };
            (
                Tail {
                    next_seq: last.seq + 1,
                    prev: last.hash.clone(),
                    adopted,
                },
                last,
            )
        }
    };
    if let Some((aseq, ahash)) = anchor {
        let found = if aseq > last.seq {
            None
        } else if let Some(r) = recent.iter().find(|r| r.seq == aseq) {
            Some(r.hash.clone())
        } else {
            find_hash(&files, aseq)?
        };
        match found {
            None => {
                return Err(AuditError::Broken(format!(
                    "the log ends before record {aseq}, which {ANCHOR} names: records were removed"
                )));
            }
            Some(h) if h != ahash => {
                return Err(AuditError::Broken(format!(
                    "record {aseq} does not match {ANCHOR}: the log was rewritten"
                )));
            }
            Some(_) => {}
        }
    }
    Ok(tail)
}

/// The state of a log as `iteron mcp doctor` reports it without a running broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspection {
    /// `ok`, `failed` (a broker would refuse to start) or `low_space`.
    pub state: &'static str,
    /// One line.
    pub detail: String,
    /// Free bytes on the log's filesystem.
    pub free: u64,
}

/// What a broker starting now would find: the same checks as [`AuditLog::open`] (without the
/// lock, writing nothing), and the free space.
pub fn inspect(home: &Path) -> Inspection {
    let dir = home.join("audit");
    let checked = check_dirs(home, &dir)
        .map_err(AuditError::Fs)
        .and_then(|exists| {
            if exists {
                check_tail(home, &dir).map(Some)
            } else {
                match read_pointer(&home.join(ANCHOR), ANCHOR)? {
                    Some((aseq, _)) => Err(AuditError::Broken(format!(
                        "audit/ is missing but {ANCHOR} names record {aseq}: the log was removed"
                    ))),
                    None => Ok(None),
                }
            }
        });
    let free = free_bytes(if dir.is_dir() { &dir } else { home });
    match checked {
        Err(e) => Inspection {
            state: "failed",
            detail: format!("a broker would refuse to start: {e}"),
            free,
        },
        Ok(_) if below_reserve(free) => Inspection {
            state: "low_space",
            detail: format!(
                "{free} bytes free, under the reserve of {SPACE_RESERVE}: effects would be refused"
            ),
            free,
        },
        Ok(None) => Inspection {
            state: "ok",
            detail: "no audit log yet".into(),
            free,
        },
        Ok(Some(t)) => Inspection {
            state: "ok",
            detail: match t.adopted {
                None => format!("{} records; the newest matches the head", t.next_seq),
                Some(s) => format!(
                    "{} records; record {s} is not confirmed by the head (a broker start adopts it and records that)",
                    t.next_seq
                ),
            },
            free,
        },
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
                kind: ADOPTED_KIND,
                decision: "allowed",
                outcome: "unconfirmed_record",
                detail: Some(why),
                ..Event::default()
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
                j.send(seq, &hash, event.kind);
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
            kind: event.kind,
            server: event.server.as_deref(),
            tool: event.tool.as_deref(),
            args_sha256: event.args_sha256.as_deref(),
            decision: event.decision,
            duration_ms: event.duration_ms,
            outcome: event.outcome,
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

/// A record the operator expects in the log: its sequence number and hash (`SEQ:SHA256`, as
/// the broker prints at stop and `verify` prints as `pin`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    /// Sequence number.
    pub seq: u64,
    /// SHA-256 of the record's line (64 lowercase hex digits).
    pub sha256: String,
}

impl Pin {
    /// Parse `SEQ:SHA256`; the error is a fixed text.
    pub fn parse(s: &str) -> Result<Pin, &'static str> {
        const WHY: &str =
            "an expected record is SEQ:SHA256 (a sequence number, a colon and 64 hex digits)";
        let (seq, hash) = s.split_once(':').ok_or(WHY)?;
        if seq.is_empty() || seq.len() > 20 || !seq.bytes().all(|b| b.is_ascii_digit()) {
            return Err(WHY);
        }
        let sha256 = hash.to_ascii_lowercase();
        if !is_hash(&sha256) {
            return Err(WHY);
        }
        Ok(Pin {
            seq: seq.parse().map_err(|_| WHY)?,
            sha256,
        })
    }
}

impl fmt::Display for Pin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.seq, self.sha256)
    }
}

/// The result of a successful verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Records checked.
    pub records: u64,
    /// Day files checked.
    pub files: usize,
    /// The newest record (the value to copy elsewhere and pin); `None` for an empty log.
    pub newest: Option<Pin>,
    /// Records after the head that a running broker was still writing.
    pub being_written: u64,
    /// Records a broker adopted at its start although the head did not confirm them (each
    /// followed by an `audit_tail_adopted` record): a crash, or a record someone else appended.
    pub adopted: Vec<u64>,
    /// The record `audit-anchor` names, checked.
    pub anchor: Option<Pin>,
    /// Expected records checked.
    pub expected: usize,
}

/// Where and why verification failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tampered {
    /// The file (name only), if the failure is inside one.
    pub file: Option<String>,
    /// The 1-based line, if the failure is on one.
    pub line: Option<usize>,
    /// What is wrong.
    pub why: String,
}

impl fmt::Display for Tampered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.file, self.line) {
            (Some(file), Some(line)) => write!(f, "{file} line {line}: {}", self.why),
            (Some(file), None) => write!(f, "{file}: {}", self.why),
            _ => f.write_str(&self.why),
        }
    }
}

/// Whether a broker holds this log's lock now (it may be between a record and its head).
fn broker_running(dir: &Path) -> bool {
    let flags = nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK;
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits())
        .open(dir.join(".lock"))
    else {
        return false;
    };
    // A shared lock taken and dropped at once: it fails only while a broker holds its
    // exclusive one.
    matches!(file.try_lock_shared(), Err(fs::TryLockError::WouldBlock))
}

/// Verify the whole log under `home`, and that it holds each `expect`ed record. Reads only and
/// never takes the lock; refuses what the broker refuses (a symlinked, foreign or open home or
/// `audit/`, a hard-linked or open file).
pub fn verify(home: &Path, expect: &[Pin]) -> Result<Verified, Tampered> {
    let fail = |file: Option<&Path>, line: Option<usize>, why: &str| Tampered {
        file: file.map(file_name),
        line,
        why: why.to_owned(),
    };
    let dir = home.join("audit");
    let exists = check_dirs(home, &dir).map_err(|e| fail(None, None, &e.to_string()))?;
    let live_before = exists && broker_running(&dir);
    let pointer = |path: &Path, what: &str| {
        read_pointer(path, what).map_err(|e| match e {
            AuditError::Broken(why) => fail(None, None, &why),
            AuditError::Fs(e) => fail(None, None, &e.to_string()),
            other => fail(None, None, &other.to_string()),
        })
    };
    let head = if exists {
        pointer(&dir.join(HEAD), "the head file")?
    } else {
        None
    };
    let anchor = pointer(&home.join(ANCHOR), ANCHOR)?;
    let files = if exists {
        day_files(&dir).map_err(|e| fail(None, None, &e.to_string()))?
    } else {
        Vec::new()
    };
    let mut wanted: BTreeSet<u64> = expect.iter().map(|p| p.seq).collect();
    wanted.extend(anchor.iter().map(|a| a.0));
    wanted.extend(head.iter().map(|h| h.0));
    let mut found: HashMap<u64, String> = HashMap::new();
    let mut adopted = Vec::new();
    let mut expect_seq = 0u64;
    let mut prev = GENESIS.to_owned();
    for path in &files {
        let p = Some(path.as_path());
        let bytes = read_private(path, u64::MAX)
            .map_err(|e| fail(p, None, &e.to_string()))?
            .unwrap_or_default();
        if !bytes.is_empty() && bytes.last() != Some(&b'\n') {
            return Err(fail(p, None, "the file ends in a partial record"));
        }
        let day = day_of(path);
        let Some(body) = bytes.strip_suffix(b"\n") else {
            continue;
        };
        for (i, line) in body.split(|b| *b == b'\n').enumerate() {
            let n = Some(i + 1);
            let rec = parse_record(line, &day).map_err(|why| fail(p, n, why))?;
            if rec.prev != prev {
                return Err(fail(
                    p,
                    n,
                    "the chain is broken (a record before this one was edited, removed or moved)",
                ));
            }
            if rec.seq != expect_seq {
                return Err(fail(p, n, "the sequence number is out of order"));
            }
            if rec.kind == ADOPTED_KIND {
                adopted.push(rec.seq.saturating_sub(1));
            }
            if wanted.contains(&rec.seq) {
                found.insert(rec.seq, rec.hash.clone());
            }
            prev = rec.hash;
            expect_seq += 1;
        }
    }
    let records = expect_seq;
    let mut being_written = 0;
    match (head, records) {
        (None, 0) => {}
        (None, _) => return Err(fail(None, None, "the head file is missing")),
        (Some(_), 0) => {
            return Err(fail(
                None,
                None,
                "records are missing (the log is empty but has a head)",
            ));
        }
        (Some((hseq, hhash)), _) => {
            let last = records - 1;
            if hseq > last {
                return Err(fail(
                    None,
                    None,
                    "records at the end were removed (the head names a later record)",
                ));
            }
            if found.get(&hseq) != Some(&hhash) {
                return Err(fail(
                    None,
                    None,
                    if hseq == last {
                        "the newest record does not match the head"
                    } else {
                        "the record the head names does not match it"
                    },
                ));
            }
            being_written = last - hseq;
            if being_written > 0 && !(live_before || broker_running(&dir)) {
                return Err(fail(
                    None,
                    None,
                    &if being_written == 1 {
                        format!(
                            "the newest record ({last}) is not confirmed by the head: a broker was killed between writing it and its head, or someone else appended it (the chain up to it is intact; a broker start adopts it and records that it did)"
                        )
                    } else {
                        format!(
                            "the newest {being_written} records are not confirmed by the head: someone other than the broker appended them"
                        )
                    },
                ));
            }
        }
    }
    let check = |seq: u64, hash: &str, whose: &str| -> Result<(), Tampered> {
        match found.get(&seq) {
            _ if seq >= records => Err(fail(
                None,
                None,
                &format!(
                    "the log ends before record {seq}, which {whose} names: records or the whole log were removed"
                ),
            )),
            Some(h) if h == hash => Ok(()),
            _ => Err(fail(
                None,
                None,
                &format!("record {seq} does not match {whose}: the log was rewritten"),
            )),
        }
    };
    if let Some((aseq, ahash)) = &anchor {
        check(*aseq, ahash, ANCHOR)?;
    }
    for p in expect {
        check(p.seq, &p.sha256, "an expected record (--expect)")?;
    }
    Ok(Verified {
        records,
        files: files.len(),
        newest: (records > 0).then(|| Pin {
            seq: records - 1,
            sha256: prev,
        }),
        being_written,
        adopted,
        anchor: anchor.map(|(seq, sha256)| Pin { seq, sha256 }),
        expected: expect.len(),
    })
}

/// Verify the whole log under `home` (as [`verify`]), then hand each verified record to
/// `visit`, oldest first, as its JSON object. Records written after the verification are not
/// visited. Reads only.
pub fn visit(
    home: &Path,
    mut visit: impl FnMut(&Map<String, Value>),
) -> Result<Verified, Tampered> {
    let verified = verify(home, &[])?;
    let dir = home.join("audit");
    let mut left = verified.records;
    let files = if left == 0 {
        Vec::new()
    } else {
        day_files(&dir).map_err(|e| Tampered {
            file: None,
            line: None,
            why: e.to_string(),
        })?
    };
    for path in &files {
        if left == 0 {
            break;
        }
        let bytes = read_private(path, u64::MAX)
            .map_err(|e| Tampered {
                file: Some(file_name(path)),
                line: None,
                why: e.to_string(),
            })?
            .unwrap_or_default();
        for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            if left == 0 {
                break;
            }
            left -= 1;
            if let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(line) {
                visit(&obj);
            }
        }
    }
    Ok(verified)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::os::unix::fs::PermissionsExt;

    fn home() -> PathBuf {
        let base = std::env::temp_dir().join(format!(
            "iteron-audit-{}-{}",
            std::process::id(),
            private_fs::temp_name("t")
        ));
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new().mode(0o700).create(&base).unwrap();
        base
    }

    /// A log that sends nothing to journald.
    fn open(h: &Path) -> Result<AuditLog, AuditError> {
        AuditLog::open_with(h, &Options { journal: None })
    }

    fn event(i: u64) -> Event {
        Event {
            session: Some(format!("s{i}")),
            peer_uid: Some(1000),
            peer_pid: Some(42),
            kind: "call_tool",
            server: Some("srv".into()),
            tool: Some("echo".into()),
            args_sha256: Some(sha256_hex(&canonical_json(&json!({"i": i})))),
            decision: "approved",
            duration_ms: i,
            outcome: "ok",
            detail: None,
            identity: None,
        }
    }

    /// A cheap request of an agent: counted, not written, beyond the rate.
    fn cheap(uid: u32) -> Event {
        Event {
            session: Some("s1".into()),
            peer_uid: Some(uid),
            peer_pid: Some(42),
            kind: "list_tools",
            decision: "allowed",
            outcome: "ok",
            ..Event::default()
        }
    }

    fn write_log(n: u64) -> (PathBuf, PathBuf) {
        let h = home();
        let log = open(&h).unwrap();
        for i in 0..n {
            log.append(&event(i)).unwrap();
        }
        let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
        (h, file)
    }

    fn lines(path: &Path) -> Vec<String> {
        fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn put(path: &Path, lines: &[String]) {
        let mut s = lines.join("\n");
        if !lines.is_empty() {
            s.push('\n');
        }
        fs::write(path, s).unwrap();
    }

    /// A record as someone else would forge it: `base` with another sequence number, chained
    /// to `prev`.
    fn forged(base: &str, seq: u64, prev: &str) -> String {
        let mut v: Value = serde_json::from_str(base).unwrap();
        v["seq"] = json!(seq);
        v["prev"] = json!(prev);
        v["outcome"] = json!("forged");
        serde_json::to_string(&v).unwrap()
    }

    fn hash(line: &str) -> String {
        sha256_hex(line.as_bytes())
    }

    fn broken(r: Result<AuditLog, AuditError>) -> String {
        match r {
            Err(AuditError::Broken(why)) => why,
            Err(e) => panic!("not Broken: {e}"),
            Ok(_) => panic!("the log was opened"),
        }
    }

    /// Mount a tmpfs of `size` at a fresh directory (root only); `None` with the reason when
    /// that is impossible here.
    struct Tmpfs(PathBuf);

    impl Tmpfs {
        fn mount(size: &str) -> Result<Tmpfs, String> {
            if !nix::unistd::geteuid().is_root() {
                return Err("not root, cannot mount a tmpfs".into());
            }
            let dir = home();
            let out = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700")])
                .arg("tmpfs")
                .arg(&dir)
                .output()
                .map_err(|e| format!("cannot run mount: {e}"))?;
            if !out.status.success() {
                let _ = fs::remove_dir(&dir);
                return Err(format!(
                    "mount -t tmpfs failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            Ok(Tmpfs(dir))
        }
    }

    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
            let _ = fs::remove_dir(&self.0);
        }
    }

    #[test]
    fn records_carry_exactly_the_documented_keys_in_order() {
        let (_home, file) = write_log(2);
        let line = lines(&file)[1].clone();
        let v: Value = serde_json::from_str(&line).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, KEYS);
        assert_eq!(v["seq"], 1);
    }

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(19_723), (2024, 1, 1));
        assert_eq!(civil(19_782), (2024, 2, 29));
        assert_eq!(civil(20_787), (2026, 11, 30));
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_796_004_245_123);
        assert_eq!(utc(t).0, "2026-11-30T02:04:05.123Z");
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let a = json!({"b": 1, "a": {"y": [1, {"d": 1, "c": 2}], "x": null}});
        assert_eq!(
            String::from_utf8(canonical_json(&a)).unwrap(),
            r#"{"a":{"x":null,"y":[1,{"c":2,"d":1}]},"b":1}"#
        );
    }

    #[test]
    fn a_written_log_verifies_and_continues_across_reopen() {
        let (h, file) = write_log(5);
        let v = verify(&h, &[]).unwrap();
        assert_eq!((v.records, v.files, v.being_written), (5, 1, 0));
        assert_eq!(v.newest.as_ref().unwrap().seq, 4);
        assert_eq!(v.newest.unwrap().sha256, hash(&lines(&file)[4]));
        let log = open(&h).unwrap();
        log.append(&event(9)).unwrap();
        assert_eq!(verify(&h, &[]).unwrap().records, 6);
        assert!(lines(&file)[5].contains("\"seq\":5"));
        // No argument values, only their digest.
        assert!(!fs::read_to_string(&file).unwrap().contains("\"i\""));
        for f in [&file, &h.join("audit/head"), &h.join(ANCHOR)] {
            assert_eq!(fs::metadata(f).unwrap().permissions().mode() & 0o777, 0o600);
        }
    }

    #[test]
    fn a_second_broker_cannot_open_the_same_log() {
        let h = home();
        let _first = open(&h).unwrap();
        assert!(matches!(open(&h), Err(AuditError::Busy(_))));
    }

    #[test]
    fn every_kind_of_tampering_is_detected() {
        type Tamper = fn(&Path, &Path);
        let cases: Vec<(&str, Tamper)> = vec![
            ("edit a field", |_, f| {
                let mut l = lines(f);
                l[2] = l[2].replace("\"approved\"", "\"denied\"");
                put(f, &l);
            }),
            ("edit the last record", |_, f| {
                let mut l = lines(f);
                l[4] = l[4].replace("\"ok\"", "\"failed\"");
                put(f, &l);
            }),
            ("swap two records", |_, f| {
                let mut l = lines(f);
                l.swap(1, 2);
                put(f, &l);
            }),
            ("remove a middle record", |_, f| {
                let mut l = lines(f);
                l.remove(2);
                put(f, &l);
            }),
            ("remove the first record", |_, f| {
                let mut l = lines(f);
                l.remove(0);
                put(f, &l);
            }),
            ("remove the last two records", |_, f| {
                let mut l = lines(f);
                l.truncate(3);
                put(f, &l);
            }),
            ("remove the whole file", |_, f| fs::remove_file(f).unwrap()),
            ("remove the head", |h, _| {
                fs::remove_file(h.join("audit").join(HEAD)).unwrap()
            }),
            ("duplicate a record", |_, f| {
                let mut l = lines(f);
                let d = l[1].clone();
                l.insert(2, d);
                put(f, &l);
            }),
            ("add a field", |_, f| {
                let mut l = lines(f);
                l[1] = l[1].replacen('{', "{\"x\":1,", 1);
                put(f, &l);
            }),
            ("cut the last line", |_, f| {
                let s = fs::read_to_string(f).unwrap();
                fs::write(f, &s[..s.len() - 5]).unwrap();
            }),
            ("move a record to another day", |h, f| {
                let mut l = lines(f);
                let last = l.pop().unwrap();
                put(f, &l);
                fs::write(h.join("audit").join("2999-01-01.jsonl"), last + "\n").unwrap();
            }),
            ("whitespace inside a record", |_, f| {
                let mut l = lines(f);
                l[1] = l[1].replacen(',', ", ", 1);
                put(f, &l);
            }),
        ];
        for (name, tamper) in cases {
            let (h, file) = write_log(5);
            verify(&h, &[]).unwrap();
            tamper(&h, &file);
            assert!(verify(&h, &[]).is_err(), "not detected: {name}");
            // The broker refuses to append to a log whose end no longer matches (where the end
            // was touched).
            if name.contains("last") || name.contains("whole") || name.contains("head") {
                assert!(open(&h).is_err(), "opened after: {name}");
            }
        }
    }

    #[test]
    fn a_tampered_tail_is_never_laundered_by_a_broker_start() {
        type Tamper = fn(&Path, &Path);
        let cases: Vec<(&str, Tamper)> = vec![
            // The red team's case: edit the newest record, append one chained to the edit.
            (
                "edit the newest record and chain a record to the edit",
                |_, f| {
                    let mut l = lines(f);
                    l[4] = l[4].replace("\"ok\"", "\"failed\"");
                    let next = forged(&l[4], 5, &hash(&l[4]));
                    l.push(next);
                    put(f, &l);
                },
            ),
            (
                "edit the newest record and chain a record to the head",
                |_, f| {
                    let mut l = lines(f);
                    let head = hash(&l[4]);
                    l[4] = l[4].replace("\"ok\"", "\"failed\"");
                    let next = forged(&l[4], 5, &head);
                    l.push(next);
                    put(f, &l);
                },
            ),
            ("edit the record before the newest", |_, f| {
                let mut l = lines(f);
                l[3] = l[3].replace("\"ok\"", "\"failed\"");
                put(f, &l);
            }),
            ("append a record chained to nothing", |_, f| {
                let mut l = lines(f);
                let next = forged(&l[4], 5, GENESIS);
                l.push(next);
                put(f, &l);
            }),
            ("append a record with the wrong sequence number", |_, f| {
                let mut l = lines(f);
                let next = forged(&l[4], 7, &hash(&l[4]));
                l.push(next);
                put(f, &l);
            }),
        ];
        for (name, tamper) in &cases {
            let (h, file) = write_log(5);
            tamper(&h, &file);
            let before = fs::read(&file).unwrap();
            let why = broken(open(&h));
            assert!(!why.contains('\n'), "{why}");
            // Nothing was appended, so nothing was laundered: the tampering stays evident.
            assert_eq!(fs::read(&file).unwrap(), before, "{name}");
            assert!(verify(&h, &[]).is_err(), "verify passed after: {name}");
        }
        crate::test_report::record(
            "P11",
            "broker/src/audit.rs::a_tampered_tail_is_never_laundered_by_a_broker_start",
            json!({"cases": cases.len()}),
        );
    }

    #[test]
    fn a_record_appended_without_its_head_is_reported_and_its_adoption_recorded() {
        let (h, file) = write_log(3);
        let head = h.join("audit").join(HEAD);
        assert_eq!(parse_head(&fs::read(&head).unwrap()).unwrap().0, 2);
        // A record chained correctly but never confirmed by the head: what a kill between the
        // record and its head leaves, and what someone else appending a record leaves.
        let mut l = lines(&file);
        let one = forged(&l[2], 3, &hash(&l[2]));
        l.push(one.clone());
        put(&file, &l);
        let t = verify(&h, &[]).unwrap_err();
        assert!(
            t.why.contains("record (3) is not confirmed by the head"),
            "{t}"
        );
        // Two are never a crash: the broker refuses them as well.
        let mut two = l.clone();
        two.push(forged(&one, 4, &hash(&one)));
        put(&file, &two);
        let t = verify(&h, &[]).unwrap_err();
        assert!(t.why.contains("newest 2 records are not confirmed"), "{t}");
        assert!(broken(open(&h)).contains("does not match the head"));
        // One is adopted at a start, and the adoption is a record of its own, reported forever.
        put(&file, &l);
        let log = open(&h).unwrap();
        let written = lines(&file);
        assert_eq!(written.len(), 5);
        let adoption: Value = serde_json::from_str(&written[4]).unwrap();
        assert_eq!(adoption["kind"], ADOPTED_KIND);
        assert_eq!(adoption["prev"], hash(&one));
        assert!(adoption["detail"].as_str().unwrap().contains("record 3"));
        log.append(&event(7)).unwrap();
        let v = verify(&h, &[]).unwrap();
        assert_eq!((v.records, v.adopted.clone()), (6, vec![3]));
        drop(log);
        // While a broker holds the log, a record after the head is one it is still writing.
        let log = open(&h).unwrap();
        let mut l = lines(&file);
        let last = l.last().unwrap().clone();
        l.push(forged(&last, 6, &hash(&last)));
        put(&file, &l);
        assert_eq!(verify(&h, &[]).unwrap().being_written, 1);
        drop(log);
        assert!(verify(&h, &[]).is_err());
        crate::test_report::record(
            "P11",
            "broker/src/audit.rs::a_record_appended_without_its_head_is_reported_and_its_adoption_recorded",
            json!({"adopted": [3]}),
        );
    }

    #[test]
    fn a_removed_or_cut_log_is_evident_through_the_anchor_and_pins() {
        let (h, file) = write_log(4);
        // The anchor is written after a run's first record and moved to the newest at close.
        assert_eq!(parse_head(&fs::read(h.join(ANCHOR)).unwrap()).unwrap().0, 0);
        let log = open(&h).unwrap();
        log.append(&event(4)).unwrap();
        log.close();
        drop(log);
        let newest = verify(&h, &[]).unwrap().newest.unwrap();
        assert_eq!(newest.seq, 4);
        assert_eq!(
            parse_head(&fs::read(h.join(ANCHOR)).unwrap()).unwrap(),
            (newest.seq, newest.sha256.clone())
        );
        let v = verify(&h, std::slice::from_ref(&newest)).unwrap();
        assert_eq!((v.anchor, v.expected), (Some(newest.clone()), 1));
        // A pin parses from what the broker prints, and mismatches are named.
        assert_eq!(Pin::parse(&newest.to_string()).unwrap(), newest);
        for bad in ["", "5", "x:ab", "5:abc", &format!("-1:{}", newest.sha256)] {
            assert!(Pin::parse(bad).is_err(), "{bad}");
        }
        let wrong = Pin {
            seq: 2,
            sha256: GENESIS.into(),
        };
        let t = verify(&h, &[wrong]).unwrap_err();
        assert!(t.why.contains("record 2 does not match"), "{t}");
        let later = Pin {
            seq: 9,
            sha256: GENESIS.into(),
        };
        assert!(
            verify(&h, &[later])
                .unwrap_err()
                .why
                .contains("ends before record 9")
        );

        // Cut the newest records and rewrite the head to match: the anchor still names record 4.
        let saved = fs::read(&file).unwrap();
        let saved_head = fs::read(h.join("audit/head")).unwrap();
        let mut l = lines(&file);
        l.truncate(3);
        fs::write(h.join("audit/head"), head_bytes(2, &hash(&l[2]))).unwrap();
        put(&file, &l);
        assert!(
            verify(&h, &[])
                .unwrap_err()
                .why
                .contains("ends before record 4")
        );
        assert!(broken(open(&h)).contains("ends before record 4"));
        fs::write(&file, &saved).unwrap();
        fs::write(h.join("audit/head"), &saved_head).unwrap();
        verify(&h, &[]).unwrap();

        // Remove every day file and the head: not "0 records", and no new chain.
        fs::remove_file(&file).unwrap();
        fs::remove_file(h.join("audit/head")).unwrap();
        let t = verify(&h, &[]).unwrap_err();
        assert!(t.why.contains("audit-anchor names"), "{t}");
        let why = broken(open(&h));
        assert!(
            why.contains("missing or empty but audit-anchor names record 4"),
            "{why}"
        );
        assert!(
            day_files(&h.join("audit")).unwrap().is_empty(),
            "a new chain was started"
        );
        assert_eq!(inspect(&h).state, "failed");
        // Or the whole directory.
        fs::remove_dir_all(h.join("audit")).unwrap();
        assert!(verify(&h, &[]).is_err());
        assert_eq!(inspect(&h).state, "failed");
        // With the anchor gone too only a pin kept elsewhere shows it.
        fs::remove_file(h.join(ANCHOR)).unwrap();
        assert_eq!(verify(&h, &[]).unwrap().records, 0);
        assert!(
            verify(&h, &[newest])
                .unwrap_err()
                .why
                .contains("ends before record 4")
        );
        crate::test_report::record(
            "P11",
            "broker/src/audit.rs::a_removed_or_cut_log_is_evident_through_the_anchor_and_pins",
            json!({"anchor_seq": 4}),
        );
    }

    #[test]
    fn each_record_goes_to_the_journal_socket() {
        let h = home();
        let sock = h.join("journal.sock");
        let journal = UnixDatagram::bind(&sock).unwrap();
        journal
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let log = AuditLog::open_with(
            &h,
            &Options {
                journal: Some(sock.clone()),
            },
        )
        .unwrap();
        for i in 0..3 {
            log.append(&event(i)).unwrap();
        }
        let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
        let written = lines(&file);
        for (i, line) in written.iter().enumerate() {
            let mut buf = vec![0u8; 4096];
            let n = journal.recv(&mut buf).unwrap();
            let msg = &buf[..n];
            let text = String::from_utf8_lossy(msg);
            let want = format!("{i}:{}", hash(line));
            assert!(
                text.starts_with(&format!("MESSAGE=iteron audit record {want} (call_tool)\n")),
                "{text}"
            );
            assert!(
                text.contains(&format!("\nITERON_AUDIT_SEQ={i}\n")),
                "{text}"
            );
            assert!(
                text.contains(&format!("\nITERON_AUDIT_SHA256={}\n", hash(line))),
                "{text}"
            );
            assert!(
                text.contains("\nSYSLOG_IDENTIFIER=iteron-broker\n"),
                "{text}"
            );
            // The home in the length-prefixed form.
            let at = msg.windows(12).position(|w| w == b"ITERON_HOME\n").unwrap() + 12;
            let len = u64::from_le_bytes(msg[at..at + 8].try_into().unwrap()) as usize;
            assert_eq!(&msg[at + 8..at + 8 + len], h.as_os_str().as_bytes());
            assert_eq!(msg.len(), at + 8 + len + 1);
        }
        // A path that is not a socket: nothing is sent, and the log works.
        drop(log);
        let log = AuditLog::open_with(
            &h,
            &Options {
                journal: Some(file.clone()),
            },
        )
        .unwrap();
        assert!(log.journal.is_none());
        log.append(&event(3)).unwrap();
        crate::test_report::record(
            "P11",
            "broker/src/audit.rs::each_record_goes_to_the_journal_socket",
            json!({"records": written.len()}),
        );
    }

    #[test]
    fn verify_refuses_what_the_broker_refuses() {
        let (h, file) = write_log(2);
        let dir = h.join("audit");
        let mut checked = Vec::new();
        let mut refused = |name: &str, h: &Path| {
            let t = verify(h, &[]).unwrap_err();
            assert!(t.why.starts_with("refusing "), "{name}: {t}");
            assert!(open(h).is_err(), "{name}: the broker opened it");
            checked.push(name.to_owned());
        };
        // A symlinked audit/ directory.
        let real = h.join("elsewhere");
        fs::rename(&dir, &real).unwrap();
        std::os::unix::fs::symlink(&real, &dir).unwrap();
        refused("symlinked audit/", &h);
        fs::remove_file(&dir).unwrap();
        fs::rename(&real, &dir).unwrap();
        verify(&h, &[]).unwrap();
        // Loose modes on audit/ and on the home.
        for d in [&dir, &h] {
            fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
            refused("a loose mode", &h);
            fs::set_permissions(d, fs::Permissions::from_mode(0o700)).unwrap();
        }
        // A foreign owner (root can hand it to another uid).
        if nix::unistd::geteuid().is_root() {
            let nobody = Some(nix::unistd::Uid::from_raw(65534));
            nix::unistd::chown(&dir, nobody, None).unwrap();
            refused("a foreign audit/", &h);
            nix::unistd::chown(&dir, Some(nix::unistd::geteuid()), None).unwrap();
        }
        // A hard link to a day file, the head or the anchor.
        for f in [file.clone(), dir.join(HEAD), h.join(ANCHOR)] {
            let link = h.join("second-name");
            fs::hard_link(&f, &link).unwrap();
            refused("a hard-linked file", &h);
            assert!(verify(&h, &[]).unwrap_err().why.contains("2 hard links"));
            fs::remove_file(&link).unwrap();
        }
        verify(&h, &[]).unwrap();
        open(&h).unwrap();
        crate::test_report::record(
            "P11",
            "broker/src/audit.rs::verify_refuses_what_the_broker_refuses",
            json!({"cases": checked}),
        );
    }

    #[test]
    fn a_full_filesystem_never_leaves_a_torn_record() {
        let fs_ = match Tmpfs::mount("64k") {
            Ok(m) => m,
            Err(why) => {
                eprintln!("skipped: {why}");
                return;
            }
        };
        let h = fs_.0.join("home");
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new().mode(0o700).create(&h).unwrap();
        let log = open(&h).unwrap();
        log.append(&event(0)).unwrap();
        // Fill every free page: the day file can grow only within the page it has.
        let mut filler = fs::File::create(fs_.0.join("filler")).unwrap();
        while filler.write_all(&[0u8; 4096]).is_ok() {}
        drop(filler);
        let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
        let page = 4096u64;
        // A record without detail; one with the longest detail (200 bytes) is 200 + a few more.
        let plain = fs::metadata(&file).unwrap().len();
        let mut ok = 1u64;
        let failure = loop {
            let room = page - fs::metadata(&file).unwrap().len();
            // Short records while a long one would still fit (each leaves room > 0), then a
            // long one that does not fit: the write is cut mid-record.
            let mut e = event(ok);
            e.detail = Some("x".repeat(if room >= plain + 200 { 10 } else { 200 }));
            match log.append(&e) {
                Ok(()) => ok += 1,
                Err(e) => break e,
            }
            assert!(ok < 100, "the page never filled up");
        };
        assert!(log.failed());
        let why = failure.to_string();
        assert!(
            matches!(failure, AuditError::Append { restored: true, .. })
                && why.contains("bytes were written"),
            "not a short write: {why}"
        );
        // Nothing more is appended, and effects are refused.
        assert!(log.append(&event(0)).is_err());
        assert_eq!(log.effect_gate(), Err(Gate::Failed));
        assert_eq!(log.state_json()["state"], "failed");
        let bytes = fs::read(&file).unwrap();
        assert_eq!(bytes.last(), Some(&b'\n'), "the file ends in a torn record");
        drop(log);
        let v = verify(&h, &[]).unwrap();
        assert_eq!(v.records, ok);
        crate::test_report::record(
            "P11",
            "broker/src/audit.rs::a_full_filesystem_never_leaves_a_torn_record",
            json!({"records_before_full": ok, "failure": why}),
        );
    }

    #[test]
    fn under_the_space_reserve_effects_are_refused_and_agent_records_only_counted() {
        // The bound itself, at the limit and one under.
        assert!(!below_reserve(SPACE_RESERVE));
        assert!(below_reserve(SPACE_RESERVE - 1));
        assert!(below_reserve(0));
        let fs_ = match Tmpfs::mount("1m") {
            Ok(m) => m,
            Err(why) => {
                eprintln!("skipped: {why}");
                return;
            }
        };
        let h = fs_.0.join("home");
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new().mode(0o700).create(&h).unwrap();
        let log = open(&h).unwrap();
        let free = match log.effect_gate() {
            Err(Gate::LowSpace { free }) => free,
            other => panic!("{other:?}"),
        };
        assert!(free > 0 && below_reserve(free), "{free}");
        assert_eq!(log.state_json()["state"], "low_space");
        // An effect's record is refused with its reason; the operator's actions and agents'
        // effect records are still written; agents' other records are counted.
        assert_eq!(log.append_effect(&event(0)), Err(Gate::LowSpace { free }));
        log.append(&event(1)).unwrap();
        log.append(&Event {
            peer_uid: Some(1000),
            kind: "operator_cancel",
            decision: "allowed",
            outcome: "ok",
            ..Event::default()
        })
        .unwrap();
        for _ in 0..500 {
            log.append(&cheap(1000)).unwrap();
        }
        let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
        assert_eq!(lines(&file).len(), 2);
        assert_eq!(log.state_json()["suppressed_records"], 500);
        // At stop the count is written.
        log.close();
        let l = lines(&file);
        assert_eq!(l.len(), 3);
        let summary: Value = serde_json::from_str(&l[2]).unwrap();
        assert_eq!(summary["kind"], SUPPRESSED_KIND);
        assert!(
            summary["detail"]
                .as_str()
                .unwrap()
                .starts_with("500 records")
        );
        drop(log);
        verify(&h, &[]).unwrap();
        crate::test_report::record(
            "P11",
            "broker/src/audit.rs::under_the_space_reserve_effects_are_refused_and_agent_records_only_counted",
            json!({"reserve": SPACE_RESERVE, "free": free}),
        );
    }

    /// Sleep until just after the start of the next second, so a burst stays in one second.
    fn next_second() {
        let since = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap();
        std::thread::sleep(
            Duration::from_millis(1010)
                .saturating_sub(Duration::from_nanos(u64::from(since.subsec_nanos()))),
        );
    }

    #[test]
    fn agent_records_are_rate_limited_per_uid_at_the_limit_and_one_over() {
        // The step itself: the limit is written, one over is counted, a new second starts over.
        let mut w = Window::default();
        for _ in 0..MAX_AGENT_RECORDS_PER_SEC {
            assert!(rate_step(&mut w, 7));
        }
        assert!(!rate_step(&mut w, 7));
        assert_eq!(w.suppressed, 1);
        assert!(rate_step(&mut w, 8));
        assert_eq!((w.written, w.suppressed), (1, 1));
        // Effects, operator actions and refused peers are never counted instead of written.
        assert!(limitable(&cheap(1)));
        for e in [
            event(0),
            Event {
                outcome: "dispatching",
                decision: "approved",
                ..cheap(1)
            },
            Event {
                decision: "denied",
                ..cheap(1)
            },
            Event {
                kind: "operator_decide",
                ..cheap(1)
            },
            Event {
                kind: "connect_agent",
                decision: "refused",
                ..cheap(1)
            },
            Event {
                kind: "broker_start",
                peer_uid: None,
                ..cheap(1)
            },
        ] {
            assert!(!limitable(&e), "{e:?}");
        }
        // Through the log, within one second (retried if the machine stalled past it).
        let max = u64::from(MAX_AGENT_RECORDS_PER_SEC);
        let mut tries = 0;
        let (h, file) = loop {
            tries += 1;
            let h = home();
            let log = open(&h).unwrap();
            next_second();
            let second = unix_second();
            // uid 1000 one over, uid 1001 two over, then three effects of uid 1000.
            for _ in 0..=max {
                log.append(&cheap(1000)).unwrap();
            }
            for _ in 0..max + 2 {
                log.append(&cheap(1001)).unwrap();
            }
            for i in 0..3 {
                log.append(&event(i)).unwrap();
            }
            if unix_second() != second {
                assert!(tries < 3, "the machine is too slow for a one-second burst");
                continue;
            }
            let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
            let records = |file: &Path| -> Vec<Value> {
                lines(file)
                    .iter()
                    .map(|x| serde_json::from_str(x).unwrap())
                    .collect()
            };
            let count = |l: &[Value], uid: u32, kind: &str| {
                l.iter()
                    .filter(|v| v["peer_uid"] == uid && v["kind"] == kind)
                    .count() as u64
            };
            let l = records(&file);
            assert_eq!(count(&l, 1000, "list_tools"), max, "at the limit");
            assert_eq!(
                count(&l, 1001, "list_tools"),
                max,
                "each uid has its own budget"
            );
            assert_eq!(count(&l, 1000, "call_tool"), 3, "effects are all written");
            // The count comes first in the uid's next written record.
            let at = l.iter().position(|v| v["kind"] == SUPPRESSED_KIND).unwrap();
            assert_eq!(l[at]["peer_uid"], 1000);
            assert!(
                l[at]["detail"]
                    .as_str()
                    .unwrap()
                    .starts_with("1 records of this uid were counted"),
                "{}",
                l[at]
            );
            assert_eq!(l[at + 1]["kind"], "call_tool");
            assert_eq!(log.state_json()["suppressed_records"], 3);
            // What is still pending is written at stop.
            log.close();
            let l = records(&file);
            let last = l.last().unwrap();
            assert_eq!(
                (&last["kind"], &last["peer_uid"]),
                (&json!(SUPPRESSED_KIND), &json!(1001))
            );
            assert!(last["detail"].as_str().unwrap().starts_with("2 records"));
            break (h, file);
        };
        verify(&h, &[]).unwrap();
        assert!(lines(&file).len() as u64 <= 2 * max + 6);
        crate::test_report::record(
            "P11",
            "broker/src/audit.rs::agent_records_are_rate_limited_per_uid_at_the_limit_and_one_over",
            json!({"max_per_sec": MAX_AGENT_RECORDS_PER_SEC}),
        );
    }
}
