//! The private scratch directory of each confined child (its `TMPDIR`, the one place it may
//! write unless the operator grants more), and a few made ahead of time: making a directory
//! costs a confined start some 50–75 µs of file-system work on an ext4 `/tmp` (measured), so
//! the reaper of an ended child makes the next one after removing the old.
#![forbid(unsafe_code)]

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Scratch directories kept made, at most.
pub(crate) const READY_SCRATCH: usize = 2;

/// Directories made ahead of time.
struct Pool(Mutex<Vec<PathBuf>>);

static POOL: Pool = Pool(Mutex::new(Vec::new()));

/// A new private directory (0700, under the system temp directory), never made before.
fn make() -> std::io::Result<PathBuf> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut salt = [0u8; 4];
    let _ = getrandom::fill(&mut salt);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "iteron-scratch-{}-{n}-{:02x}{:02x}{:02x}{:02x}",
        std::process::id(),
        salt[0],
        salt[1],
        salt[2],
        salt[3]
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    Ok(dir)
}

/// Whether `dir`, made ahead of time, is still what was made: a directory (not a link) of
/// this process's uid with mode 0700, so nobody else can have written into it.
fn still_private(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir).is_ok_and(|m| {
        m.file_type().is_dir()
            && m.uid() == nix::unistd::geteuid().as_raw()
            && m.mode() & 0o7777 == 0o700
    })
}

impl Pool {
    fn ready(&self) -> std::sync::MutexGuard<'_, Vec<PathBuf>> {
        // A panic while holding the lock leaves a list that is still a list.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One made ahead of time if one is ready and unchanged (a changed one is removed), else a
    /// new one.
    fn take(&self) -> std::io::Result<PathBuf> {
        loop {
            let Some(dir) = self.ready().pop() else {
                return make();
            };
            if still_private(&dir) {
                return Ok(dir);
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// Make one more, unless [`READY_SCRATCH`] are ready (best effort: a failure here is met
    /// again, and reported, by the start that needs one).
    fn refill(&self) {
        if self.ready().len() >= READY_SCRATCH {
            return;
        }
        if let Ok(dir) = make() {
            let mut r = self.ready();
            if r.len() < READY_SCRATCH {
                r.push(dir);
            } else {
                drop(r);
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }

    fn release(&self) {
        let dirs = std::mem::take(&mut *self.ready());
        for d in dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// A scratch directory for one child, private to it.
pub(crate) fn scratch_dir() -> std::io::Result<PathBuf> {
    POOL.take()
}

/// Make the next child's directory ahead of time (called by a reaper, after it removed one).
pub(crate) fn refill() {
    POOL.refill();
}

/// Remove the directories made ahead of time (before this process exits).
pub(crate) fn release() {
    POOL.release();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_ready_directory_is_handed_out_once_and_one_that_changed_is_discarded() {
        let pool = Pool(Mutex::new(Vec::new()));
        for _ in 0..=READY_SCRATCH {
            pool.refill();
        }
        assert_eq!(pool.ready().len(), READY_SCRATCH, "the pool is bounded");
        let a = pool.take().unwrap();
        let b = pool.take().unwrap();
        assert_ne!(a, b);
        assert!(still_private(&a) && still_private(&b));
        // Both taken: the next is made on the spot, and differs from both.
        let c = pool.take().unwrap();
        assert!(c != a && c != b && still_private(&c));
        // A ready directory whose mode was widened is not handed out, and is removed.
        pool.refill();
        let widened = pool.ready()[0].clone();
        std::fs::set_permissions(&widened, std::fs::Permissions::from_mode(0o777)).unwrap();
        let d = pool.take().unwrap();
        assert_ne!(d, widened);
        assert!(!widened.exists());
        // One replaced by a link to another directory is not handed out either.
        pool.refill();
        let swapped = pool.ready()[0].clone();
        std::fs::remove_dir(&swapped).unwrap();
        std::os::unix::fs::symlink(&a, &swapped).unwrap();
        let e = pool.take().unwrap();
        assert!(e != swapped && e != a && still_private(&e));
        assert!(a.exists(), "the link's target is left alone");
        let _ = std::fs::remove_file(&swapped);
        // Release removes what was made ahead of time.
        pool.refill();
        let held = pool.ready()[0].clone();
        pool.release();
        assert!(pool.ready().is_empty() && !held.exists());
        for dir in [a, b, c, d, e] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
