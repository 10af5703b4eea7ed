//! Reading the log back: the records, the tail a start checks, what `doctor` inspects, and
//! `verify` against the operator's pins.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::files::{
    HEAD, below_reserve, check_dirs, day_files, free_bytes, is_hash, read_pointer, read_private,
    sha256_hex,
};
use super::{ADOPTED_KIND, ANCHOR, AuditError, GENESIS, KEYS, MAX_RECORD, SPACE_RESERVE};

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
pub(super) struct Tail {
    pub(super) next_seq: u64,
    pub(super) prev: String,
    /// The newest record, which the head did not confirm (it is adopted, and that recorded).
    pub(super) adopted: Option<u64>,
}

/// The broker's check of the log's end before it appends: the newest record must be the one
/// the head names, or its successor chained to it (a broker killed between the two writes); the
/// record the anchor names must be in the log with its hash.
pub(super) fn check_tail(home: &Path, dir: &Path) -> Result<Tail, AuditError> {
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

/// What a broker starting now would find: the same checks as [`AuditLog::open`](super::AuditLog::open) (without the
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
