//! The audit log: `<home>/audit/<YYYY-MM-DD>.jsonl` (UTC dates), append-only, one JSON object
//! per line, hash-chained.
//!
//! Every record carries a sequence number that continues across files and `prev`, the SHA-256
//! (hex) of the previous record's line (64 zeros for the first record ever). `<home>/audit/head`
//! holds the sequence number and hash of the newest record; it is updated after each append.
//! `verify` walks every file in date order and detects an edited, reordered, inserted or
//! removed record (including removal at the end, through the head, and of a whole older file,
//! through the sequence numbers). A broker killed between appending a record and updating the
//! head leaves the head exactly one record behind; `verify` reports that separately and accepts
//! it.
//!
//! The chain is unkeyed: it makes accidental and partial edits evident and gives a reviewer a
//! single value (the head) to copy elsewhere; someone holding the operator's uid can rewrite
//! the whole log consistently. Records never contain arguments, results or secrets: arguments
//! appear only as the SHA-256 of their canonical JSON.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::private_fs::{self, FsError, Lock};

/// `prev` of the first record.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The largest record line the log writes or accepts (a record holds ids, names and digests only).
pub const MAX_RECORD: usize = 16 * 1024;

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
    /// The log on disk does not match its head; the broker refuses to append to it.
    Broken(String),
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
        }
    }
}

impl std::error::Error for AuditError {}

impl From<FsError> for AuditError {
    fn from(e: FsError) -> Self {
        AuditError::Fs(e)
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

struct Chain {
    /// Set after any failed write: a torn line or a stale head would break the chain, so
    /// nothing more is appended until the operator looks.
    failed: bool,
    seq: u64,
    prev: String,
    day: String,
    file: Option<File>,
    head: Option<File>,
}

/// The open log of one broker (it holds `audit/.lock` for its lifetime).
pub struct AuditLog {
    dir: PathBuf,
    chain: Mutex<Chain>,
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

fn parse_head(bytes: &[u8]) -> Option<(u64, String)> {
    let s = std::str::from_utf8(bytes).ok()?;
    let s = s.strip_suffix('\n')?;
    let (seq, hash) = s.split_once(' ')?;
    if seq.len() != 20 || hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some((seq.parse().ok()?, hash.to_owned()))
}

fn read_private(path: &Path, max: u64) -> Result<Option<Vec<u8>>, FsError> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
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

impl AuditLog {
    /// Open (creating if needed) the log under `home`, take its lock, and continue its chain.
    /// Refuses a log whose newest record does not match its head.
    pub fn open(home: &Path) -> Result<AuditLog, AuditError> {
        private_fs::ensure_private_dir(home)?;
        let dir = home.join("audit");
        private_fs::ensure_private_dir(&dir)?;
        let lock_path = dir.join(".lock");
        let lock = private_fs::try_lock(&lock_path)?.ok_or(AuditError::Busy(dir.clone()))?;
        let head = match read_private(&dir.join(HEAD), HEAD_LEN as u64 + 1)? {
            None => None,
            Some(b) => Some(
                parse_head(&b)
                    .ok_or_else(|| AuditError::Broken("the head is unreadable".into()))?,
            ),
        };
        let last = match day_files(&dir)?.last() {
            None => None,
            Some(path) => last_record(path)?,
        };
        let (seq, prev) = match (head, last) {
            (None, None) => (0, GENESIS.to_owned()),
            (Some(_), None) => return Err(AuditError::Broken("records are missing".into())),
            (None, Some(_)) => return Err(AuditError::Broken("the head is missing".into())),
            (Some((hseq, hhash)), Some((lseq, lhash))) => {
                if (hseq, &hhash) == (lseq, &lhash) || hseq + 1 == lseq {
                    (lseq + 1, lhash)
                } else {
                    return Err(AuditError::Broken(
                        "the newest record does not match the head".into(),
                    ));
                }
            }
        };
        Ok(AuditLog {
            dir,
            chain: Mutex::new(Chain {
                failed: false,
                seq,
                prev,
                day: String::new(),
                file: None,
                head: None,
            }),
            _lock: lock,
        })
    }

    /// The directory of the log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Append one record. The line is written with a single `write` on an `O_APPEND` file, then
    /// the head is updated.
    pub fn append(&self, event: &Event) -> Result<(), AuditError> {
        let mut chain = match self.chain.lock() {
            Ok(c) => c,
            Err(p) => p.into_inner(),
        };
        if chain.failed {
            return Err(AuditError::Broken(
                "an earlier write failed; nothing more is appended".into(),
            ));
        }
        let result = Self::append_locked(&self.dir, &mut chain, event);
        if result.is_err() {
            chain.failed = true;
        }
        result
    }

    fn append_locked(dir: &Path, chain: &mut Chain, event: &Event) -> Result<(), AuditError> {
        let (time, day) = utc(SystemTime::now());
        if chain.day != day || chain.file.is_none() {
            let path = dir.join(format!("{day}.jsonl"));
            let file = OpenOptions::new()
                .append(true)
                .create(true)
                .mode(0o600)
                .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
                .open(&path)
                .map_err(private_fs::io_err("open", &path))?;
            let meta = file
                .metadata()
                .map_err(private_fs::io_err("inspect", &path))?;
            private_fs::check_private(&path, &meta, false)?;
            chain.file = Some(file);
            chain.day = day;
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
        if let Some(f) = chain.file.as_mut() {
            f.write_all(&line)
                .map_err(private_fs::io_err("append", &path))?;
        }
        let head = dir.join(HEAD);
        if chain.head.is_none() {
            let hf = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
                .open(&head)
                .map_err(private_fs::io_err("open", &head))?;
            chain.head = Some(hf);
        }
        if let Some(hf) = chain.head.as_ref() {
            hf.write_all_at(&head_bytes(chain.seq, &hash), 0)
                .map_err(private_fs::io_err("write", &head))?;
        }
        chain.seq += 1;
        chain.prev = hash;
        Ok(())
    }

    /// Flush the newest day file and the head to disk (called at shutdown).
    pub fn sync(&self) {
        if let Ok(c) = self.chain.lock()
            && let Some(f) = c.file.as_ref()
        {
            let _ = f.sync_all();
        }
        if let Ok(c) = self.chain.lock()
            && let Some(h) = c.head.as_ref()
        {
            let _ = h.sync_all();
        }
    }
}

/// The sequence number and hash of a file's last record.
fn last_record(path: &Path) -> Result<Option<(u64, String)>, AuditError> {
    let bytes = read_private(path, u64::MAX)?.unwrap_or_default();
    if bytes.is_empty() {
        return Ok(None);
    }
    if bytes.last() != Some(&b'\n') {
        return Err(AuditError::Broken(format!(
            "{} ends in a partial record",
            file_name(path)
        )));
    }
    let body = &bytes[..bytes.len() - 1];
    let line = body.rsplit(|b| *b == b'\n').next().unwrap_or(body);
    let v: Value = serde_json::from_slice(line).map_err(|_| {
        AuditError::Broken(format!("{} ends in a malformed record", file_name(path)))
    })?;
    let seq = v
        .get("seq")
        .and_then(Value::as_u64)
        .ok_or_else(|| AuditError::Broken("a record has no sequence number".into()))?;
    Ok(Some((seq, sha256_hex(line))))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The result of a successful verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Records checked.
    pub records: u64,
    /// Day files checked.
    pub files: usize,
    /// The newest record's hash (the value to copy elsewhere).
    pub head: String,
    /// The head was one record behind (a broker stopped between append and head update).
    pub head_lagging: bool,
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

/// Verify the whole log under `home`. Reads only; never needs the lock.
pub fn verify(home: &Path) -> Result<Verified, Tampered> {
    let fail = |file: Option<&Path>, line: Option<usize>, why: &str| Tampered {
        file: file.map(file_name),
        line,
        why: why.to_owned(),
    };
    let dir = home.join("audit");
    let files = day_files(&dir).map_err(|e| fail(None, None, &e.to_string()))?;
    let head = read_private(&dir.join(HEAD), HEAD_LEN as u64 + 1)
        .map_err(|e| fail(None, None, &e.to_string()))?;
    let mut expect_seq = 0u64;
    let mut prev = GENESIS.to_owned();
    let mut prev_hash_before = None;
    for path in &files {
        let p = Some(path.as_path());
        let bytes = read_private(path, u64::MAX)
            .map_err(|e| fail(p, None, &e.to_string()))?
            .unwrap_or_default();
        if !bytes.is_empty() && bytes.last() != Some(&b'\n') {
            return Err(fail(p, None, "the file ends in a partial record"));
        }
        let day = file_name(path);
        let day = &day[..10];
        let Some(body) = bytes.strip_suffix(b"\n") else {
            continue;
        };
        for (i, line) in body.split(|b| *b == b'\n').enumerate() {
            let n = Some(i + 1);
            if line.is_empty() {
                return Err(fail(p, n, "empty line"));
            }
            if line.len() > MAX_RECORD {
                return Err(fail(p, n, "record over the size bound"));
            }
            let v: Value =
                serde_json::from_slice(line).map_err(|_| fail(p, n, "not a JSON record"))?;
            let obj = v
                .as_object()
                .ok_or_else(|| fail(p, n, "not a JSON object"))?;
            if obj.len() != KEYS.len() || !KEYS.iter().all(|k| obj.contains_key(*k)) {
                return Err(fail(p, n, "the record's fields were changed"));
            }
            if obj.get("prev").and_then(Value::as_str) != Some(prev.as_str()) {
                return Err(fail(
                    p,
                    n,
                    "the chain is broken (a record before this one was edited, removed or moved)",
                ));
            }
            if obj.get("seq").and_then(Value::as_u64) != Some(expect_seq) {
                return Err(fail(p, n, "the sequence number is out of order"));
            }
            let time = obj.get("time").and_then(Value::as_str).unwrap_or("");
            if !time.starts_with(day) {
                return Err(fail(p, n, "the record's date does not match its file"));
            }
            prev_hash_before = Some(prev.clone());
            prev = sha256_hex(line);
            expect_seq += 1;
        }
    }
    let records = expect_seq;
    match (head.as_deref().map(parse_head), records) {
        (None, 0) => Ok(Verified {
            records,
            files: files.len(),
            head: prev,
            head_lagging: false,
        }),
        (None, _) => Err(fail(None, None, "the head file is missing")),
        (Some(None), _) => Err(fail(None, None, "the head file is unreadable")),
        (Some(Some(_)), 0) => Err(fail(
            None,
            None,
            "records are missing (the log is empty but has a head)",
        )),
        (Some(Some((hseq, hhash))), _) => {
            let last = records - 1;
            if hseq == last && hhash == prev {
                Ok(Verified {
                    records,
                    files: files.len(),
                    head: prev,
                    head_lagging: false,
                })
            } else if hseq + 1 == last && Some(&hhash) == prev_hash_before.as_ref() {
                Ok(Verified {
                    records,
                    files: files.len(),
                    head: prev,
                    head_lagging: true,
                })
            } else if hseq > last {
                Err(fail(
                    None,
                    None,
                    "records at the end were removed (the head names a later record)",
                ))
            } else {
                Err(fail(
                    None,
                    None,
                    "the newest record does not match the head",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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

    fn write_log(n: u64) -> (PathBuf, PathBuf) {
        let h = home();
        let log = AuditLog::open(&h).unwrap();
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
        let v = verify(&h).unwrap();
        assert_eq!((v.records, v.files, v.head_lagging), (5, 1, false));
        let log = AuditLog::open(&h).unwrap();
        log.append(&event(9)).unwrap();
        assert_eq!(verify(&h).unwrap().records, 6);
        assert!(lines(&file)[5].contains("\"seq\":5"));
        // No argument values, only their digest.
        assert!(!fs::read_to_string(&file).unwrap().contains("\"i\""));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn a_second_broker_cannot_open_the_same_log() {
        let h = home();
        let _first = AuditLog::open(&h).unwrap();
        assert!(matches!(AuditLog::open(&h), Err(AuditError::Busy(_))));
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
            verify(&h).unwrap();
            tamper(&h, &file);
            assert!(verify(&h).is_err(), "not detected: {name}");
            // The broker refuses to append to a log whose end no longer matches (where the end
            // was touched).
            if name.contains("last") || name.contains("whole") || name.contains("head") {
                assert!(AuditLog::open(&h).is_err(), "opened after: {name}");
            }
        }
    }

    #[test]
    fn a_head_one_record_behind_is_a_crash_not_tampering() {
        let (h, _) = write_log(3);
        let head = h.join("audit").join(HEAD);
        let (seq, _) = parse_head(&fs::read(&head).unwrap()).unwrap();
        assert_eq!(seq, 2);
        // Rewind the head by one record: what a kill between append and head update leaves.
        let f = day_files(&h.join("audit")).unwrap().pop().unwrap();
        let second = lines(&f)[1].clone();
        fs::write(&head, head_bytes(1, &sha256_hex(second.as_bytes()))).unwrap();
        let v = verify(&h).unwrap();
        assert!(v.head_lagging);
        let log = AuditLog::open(&h).unwrap();
        log.append(&event(7)).unwrap();
        let v = verify(&h).unwrap();
        assert_eq!((v.records, v.head_lagging), (4, false));
    }
}
