//! Private files under `~/.iteron`: the checks and the write discipline shared by the
//! configuration store and the credential store.
//!
//! Every file is written whole to a fresh temporary file (`O_CREAT|O_EXCL|O_NOFOLLOW`, 0600),
//! fsynced, renamed over the target and the directory fsynced; writers serialise on an `flock`
//! with a bounded wait. Anything that is not a plain file or directory owned by the effective
//! uid with no group/other bits is refused, never repaired; so is a file with more than one
//! hard link (another name for it may sit where others can reach it, or outlive a rename).
#![forbid(unsafe_code)]

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a writer waits for another writer's lock before giving up.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a waiting writer retries the lock.
const LOCK_POLL: Duration = Duration::from_millis(5);

/// Why a private file or directory could not be used. Each store maps this into its own error.
#[derive(Debug)]
pub enum FsError {
    /// A system call failed.
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// A symlink or something else where a real directory or regular file must be.
    NotPlain {
        /// The path.
        path: PathBuf,
        /// What it was expected to be.
        expected: &'static str,
    },
    /// Owned by another uid.
    WrongOwner {
        path: PathBuf,
        owner: u32,
        euid: u32,
    },
    /// Group or other permission bits are set.
    OpenMode {
        /// The path.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// The mode it must have.
        want: u32,
    },
    /// A file with more than one hard link.
    HardLinked {
        /// The path.
        path: PathBuf,
        /// Its link count.
        links: u64,
    },
    /// Another writer held the lock for longer than [`LOCK_TIMEOUT`].
    LockTimeout(PathBuf),
}

impl fmt::Display for FsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FsError::Io { op, path, source } => {
                write!(f, "cannot {op} {}: {source}", path.display())
            }
            FsError::NotPlain { path, expected } => write!(
                f,
                "refusing {}: it must be a {expected}, not a symlink or special file",
                path.display()
            ),
            FsError::WrongOwner { path, owner, euid } => write!(
                f,
                "refusing {}: owned by uid {owner}, not by uid {euid} running iteron",
                path.display()
            ),
            FsError::OpenMode { path, mode, want } => write!(
                f,
                "refusing {}: mode {mode:04o} gives group/other access; inspect it, then run: chmod {want:o} {}",
                path.display(),
                path.display()
            ),
            FsError::HardLinked { path, links } => write!(
                f,
                "refusing {}: it has {links} hard links; a private file must have only one (inspect the other names, then copy it to a fresh file)",
                path.display()
            ),
            FsError::LockTimeout(p) => write!(
                f,
                "another iteron process has held {} for over {} s; nothing was written",
                p.display(),
                LOCK_TIMEOUT.as_secs()
            ),
        }
    }
}

impl std::error::Error for FsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FsError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

pub(crate) fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> FsError + use<> {
    let path = path.to_path_buf();
    move |source| FsError::Io { op, path, source }
}

/// Refuse anything that is not a plain directory/file owned by us with no group/other bits, and
/// a file with more than one hard link.
pub(crate) fn check_private(path: &Path, meta: &fs::Metadata, dir: bool) -> Result<(), FsError> {
    let plain = if dir {
        meta.file_type().is_dir()
    } else {
        meta.file_type().is_file()
    };
    if !plain {
        return Err(FsError::NotPlain {
            path: path.to_path_buf(),
            expected: if dir { "directory" } else { "regular file" },
        });
    }
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid {
        return Err(FsError::WrongOwner {
            path: path.to_path_buf(),
            owner: meta.uid(),
            euid,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(FsError::OpenMode {
            path: path.to_path_buf(),
            mode,
            want: if dir { 0o700 } else { 0o600 },
        });
    }
    // 0 is a file replaced (renamed over) after it was opened: what was opened is whole.
    if !dir && meta.nlink() > 1 {
        return Err(FsError::HardLinked {
            path: path.to_path_buf(),
            links: meta.nlink(),
        });
    }
    Ok(())
}

/// A temporary name unique within this process and among live processes.
pub(crate) fn temp_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{}-{n}", std::process::id())
}

/// Create `path` (which must not exist, and is never followed if a symlink), write and fsync.
pub(crate) fn write_new_file(path: &Path, bytes: &[u8]) -> Result<(), FsError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)
        .map_err(io_err("create", path))?;
    file.write_all(bytes).map_err(io_err("write", path))?;
    file.sync_all().map_err(io_err("fsync", path))
}

/// Replace `target`, a file in `dir`, by `bytes`: written whole to a new private file beside
/// it (named with `prefix`, [`write_new_file`]), renamed over it, the directory synced. A
/// failure before the rename leaves `target` as it was and removes the new file. After the
/// rename the change is visible and cannot be taken back, so reporting a failure then would
/// make the caller retry (or abandon) an applied change: a failed directory sync is not
/// reported (there is nothing better to do than carry on).
pub(crate) fn replace_file(
    dir: &Path,
    prefix: &str,
    target: &Path,
    bytes: &[u8],
) -> Result<(), FsError> {
    let temp = dir.join(temp_name(prefix));
    let written = write_new_file(&temp, bytes)
        .and_then(|()| fs::rename(&temp, target).map_err(io_err("replace", target)));
    if let Err(e) = written {
        let _ = fs::remove_file(&temp);
        return Err(e);
    }
    let _ = sync_dir(dir);
    Ok(())
}

/// Open a private file for reading, with its metadata: never through a symbolic link, never
/// blocking on a FIFO planted in its place (`O_NONBLOCK`; it is then refused by the type
/// check), and only a plain file of ours ([`check_private`]). `None` when it does not exist.
pub(crate) fn open_private(path: &Path) -> Result<Option<(File, fs::Metadata)>, FsError> {
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
        Err(e) => return Err(io_err("open", path)(e)),
    };
    let meta = file.metadata().map_err(io_err("inspect", path))?;
    check_private(path, &meta, false)?;
    Ok(Some((file, meta)))
}

/// Create `dir` 0700 if missing (making the creation durable), then check it is a private
/// directory of ours.
pub(crate) fn ensure_private_dir(dir: &Path) -> Result<(), FsError> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {
            if let Some(parent) = dir.parent() {
                let _ = sync_dir(parent);
            }
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err("create directory", dir)(e)),
    }
    let meta = fs::symlink_metadata(dir).map_err(io_err("inspect", dir))?;
    check_private(dir, &meta, true)
}

/// Make a rename in `dir` durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), FsError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync directory", dir))
}

/// Remove temp files a dead writer left behind. Call only while holding the lock: then no live
/// writer can own one.
pub(crate) fn remove_stale_temps(dir: &Path, prefix: &str) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// An exclusive `flock` on the lock file, released on drop (closing the descriptor, or the
/// process dying).
pub(crate) struct Lock {
    _file: File,
}

/// Take the exclusive lock on `path` now, or `Ok(None)` if another process holds it.
pub(crate) fn try_lock(path: &Path) -> Result<Option<Lock>, FsError> {
    let file = open_lock_file(path)?;
    match file.try_lock() {
        Ok(()) => Ok(Some(Lock { _file: file })),
        Err(fs::TryLockError::WouldBlock) => Ok(None),
        Err(fs::TryLockError::Error(e)) => Err(io_err("lock", path)(e)),
    }
}

fn open_lock_file(path: &Path) -> Result<File, FsError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags((nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK).bits())
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(nix::libc::ELOOP) {
                FsError::NotPlain {
                    path: path.to_path_buf(),
                    expected: "regular file",
                }
            } else {
                io_err("open", path)(e)
            }
        })?;
    let meta = file.metadata().map_err(io_err("inspect", path))?;
    check_private(path, &meta, false)?;
    Ok(file)
}

/// Take the exclusive lock on `path` (created 0600 if missing), waiting at most [`LOCK_TIMEOUT`].
pub(crate) fn acquire_lock(path: &Path) -> Result<Lock, FsError> {
    let file = open_lock_file(path)?;
    let deadline = Instant::now() + LOCK_TIMEOUT;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(Lock { _file: file }),
            Err(fs::TryLockError::WouldBlock) => {
                if Instant::now() >= deadline {
                    return Err(FsError::LockTimeout(path.to_path_buf()));
                }
                std::thread::sleep(LOCK_POLL);
            }
            Err(fs::TryLockError::Error(e)) => return Err(io_err("lock", path)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn area(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("iteron-private-fs-{name}-{}", temp_name("t")));
        fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        dir
    }

    #[test]
    fn a_hard_linked_private_file_is_refused_like_a_symlink() {
        let dir = area("links");
        let file = dir.join("config.json");
        write_new_file(&file, b"{}").unwrap();
        let meta = fs::symlink_metadata(&file).unwrap();
        check_private(&file, &meta, false).unwrap();
        // A second name for the same inode: refused, whichever name is used.
        let other = dir.join("elsewhere");
        fs::hard_link(&file, &other).unwrap();
        for path in [&file, &other] {
            let meta = fs::symlink_metadata(path).unwrap();
            let e = check_private(path, &meta, false).unwrap_err();
            assert!(matches!(e, FsError::HardLinked { links: 2, .. }), "{e:?}");
            let line = e.to_string();
            assert!(
                line.contains("2 hard links") && !line.contains('\n'),
                "{line}"
            );
        }
        // Removing the other name makes it private again; directories are not affected.
        fs::remove_file(&other).unwrap();
        check_private(&file, &fs::symlink_metadata(&file).unwrap(), false).unwrap();
        check_private(&dir, &fs::symlink_metadata(&dir).unwrap(), true).unwrap();
        // The lock files go through the same check.
        let lock = dir.join(".lock");
        drop(try_lock(&lock).unwrap().unwrap());
        fs::hard_link(&lock, dir.join("lock2")).unwrap();
        assert!(matches!(try_lock(&lock), Err(FsError::HardLinked { .. })));
        fs::remove_dir_all(&dir).unwrap();
        iteron_test_support::record!("P11", serde_json::json!({"links": 2}),);
    }
}
