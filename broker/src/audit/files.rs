//! The log's files and values: hex SHA-256 and canonical JSON, UTC dates, the day files, the
//! head, private reads and writes, the anchor, and free space.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::{ANCHOR, ANCHOR_TEMP, AuditError, SPACE_RESERVE};
use crate::private_fs::{self, FsError};

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
pub(super) fn civil(days: i64) -> (i64, u32, u32) {
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

pub(super) fn unix_second() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Longest line the log prints on the broker's stderr.
const MAX_NOTICE: usize = 1024;

/// One line on the broker's stderr: terminal-safe, but not redacted (it carries record hashes,
/// which look like tokens to the redactor, and never a secret).
pub(super) fn notice(line: &str) {
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
pub(super) fn day_files(dir: &Path) -> Result<Vec<PathBuf>, FsError> {
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

pub(super) const HEAD: &str = "head";
const HEAD_LEN: usize = 20 + 1 + 64 + 1;

pub(super) fn head_bytes(seq: u64, hash: &str) -> Vec<u8> {
    format!("{seq:020} {hash}\n").into_bytes()
}

pub(super) fn is_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

pub(super) fn parse_head(bytes: &[u8]) -> Option<(u64, String)> {
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
pub(super) fn open_private_for_write(path: &Path, append: bool) -> Result<File, AuditError> {
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

pub(super) fn read_private(path: &Path, max: u64) -> Result<Option<Vec<u8>>, FsError> {
    let Some((file, _)) = private_fs::open_private(path)? else {
        return Ok(None);
    };
    let mut out = Vec::new();
    io::Read::read_to_end(&mut io::Read::take(&file, max), &mut out)
        .map_err(private_fs::io_err("read", path))?;
    Ok(Some(out))
}

/// A head-format file (`audit/head`, `audit-anchor`): `None` if missing.
pub(super) fn read_pointer(path: &Path, what: &str) -> Result<Option<(u64, String)>, AuditError> {
    match read_private(path, HEAD_LEN as u64 + 1)? {
        None => Ok(None),
        Some(b) => parse_head(&b)
            .map(Some)
            .ok_or_else(|| AuditError::Broken(format!("{what} is unreadable"))),
    }
}

/// The home and `audit/` must be private directories of ours (as the broker requires); `false`
/// when `audit/` does not exist.
pub(super) fn check_dirs(home: &Path, dir: &Path) -> Result<bool, FsError> {
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
pub(super) fn write_anchor(home: &Path, seq: u64, hash: &str) -> Result<(), FsError> {
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
pub(super) fn free_bytes(dir: &Path) -> u64 {
    nix::sys::statvfs::statvfs(dir).map_or(0, |s| {
        u64::from(s.blocks_available()).saturating_mul(u64::from(s.fragment_size()))
    })
}

/// Whether `free` bytes are below [`SPACE_RESERVE`] (exactly the reserve is enough).
pub fn below_reserve(free: u64) -> bool {
    free < SPACE_RESERVE
}
