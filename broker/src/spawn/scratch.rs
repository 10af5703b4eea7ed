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

/// A directory made ahead of time, with the (device, inode) it had when made.
type Made = (PathBuf, (u64, u64));

/// Directories made ahead of time, and whether the pool was released (nothing is made after).
struct Pool(Mutex<(Vec<Made>, bool)>);

static POOL: Pool = Pool(Mutex::new((Vec::new(), false)));

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

/// The (device, inode) of `dir` if it is a directory (not a link) of this process's uid with
/// mode 0700.
fn private_id(dir: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(dir).ok().and_then(|m| {
        (m.file_type().is_dir()
            && m.uid() == nix::unistd::geteuid().as_raw()
            && m.mode() & 0o7777 == 0o700)
            .then(|| (m.dev(), m.ino()))
    })
}

/// Whether `dir`, made ahead of time as `id`, is still what was made: the same directory
/// (not another one renamed into its place, nor a link), private, and empty — nothing was
/// planted in it while it waited (a process of this uid allowed to write the temp directory
/// could have).
fn still_private(dir: &Path, id: (u64, u64)) -> bool {
    private_id(dir) == Some(id)
        && std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none())
        && private_id(dir) == Some(id)
}

impl Pool {
    fn ready(&self) -> std::sync::MutexGuard<'_, (Vec<Made>, bool)> {
        // A panic while holding the lock leaves a list that is still a list.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One made ahead of time if one is ready and unchanged (a changed one is removed), else a
    /// new one.
    fn take(&self) -> std::io::Result<PathBuf> {
        loop {
            let Some((dir, id)) = self.ready().0.pop() else {
                return make();
            };
            if still_private(&dir, id) {
                return Ok(dir);
            }
            // Not what was made: left alone if something else is in its place (a link, or a
            // directory renamed there), removed if it is still ours.
            if private_id(&dir) == Some(id) {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }

    /// Make one more, unless [`READY_SCRATCH`] are ready (best effort: a failure here is met
    /// again, and reported, by the start that needs one).
    fn refill(&self) {
        {
            let r = self.ready();
            if r.1 || r.0.len() >= READY_SCRATCH {
                return;
            }
        }
        let Ok(dir) = make() else { return };
        let Some(id) = private_id(&dir) else {
            let _ = std::fs::remove_dir(&dir);
            return;
        };
        let mut r = self.ready();
        if !r.1 && r.0.len() < READY_SCRATCH {
            r.0.push((dir, id));
        } else {
            drop(r);
            let _ = std::fs::remove_dir(dir);
        }
    }

    /// Remove what was made ahead of time, and make nothing more (a reaper that finishes
    /// after this, its command already exiting, leaves nothing behind).
    fn release(&self) {
        let dirs = {
            let mut r = self.ready();
            r.1 = true;
            std::mem::take(&mut r.0)
        };
        for (d, id) in dirs {
            if private_id(&d) == Some(id) {
                let _ = std::fs::remove_dir_all(d);
            }
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
        let pool = Pool(Mutex::new((Vec::new(), false)));
        for _ in 0..=READY_SCRATCH {
            pool.refill();
        }
        assert_eq!(pool.ready().0.len(), READY_SCRATCH, "the pool is bounded");
        let a = pool.take().unwrap();
        let b = pool.take().unwrap();
        assert_ne!(a, b);
        assert!(private_id(&a).is_some() && private_id(&b).is_some());
        // Both taken: the next is made on the spot, and differs from both.
        let c = pool.take().unwrap();
        assert!(c != a && c != b && private_id(&c).is_some());
        let next = |pool: &Pool| pool.ready().0[0].0.clone();
        // A ready directory whose mode was widened is not handed out, and is removed.
        pool.refill();
        let widened = next(&pool);
        std::fs::set_permissions(&widened, std::fs::Permissions::from_mode(0o777)).unwrap();
        let d = pool.take().unwrap();
        assert_ne!(d, widened);
        std::fs::remove_dir(&widened).unwrap();
        // One with something planted in it is not handed out either.
        pool.refill();
        let planted = next(&pool);
        std::fs::write(planted.join("x"), "planted").unwrap();
        let e = pool.take().unwrap();
        assert_ne!(e, planted);
        assert!(!planted.exists(), "ours, so removed");
        // Another directory renamed into its place (private, empty, same name): refused by its
        // inode, and left alone.
        pool.refill();
        let renamed = next(&pool);
        let aside = renamed.with_extension("aside");
        std::fs::rename(&renamed, &aside).unwrap();
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&renamed)
            .unwrap();
        let f = pool.take().unwrap();
        assert_ne!(f, renamed);
        assert!(renamed.exists(), "not the one made: left alone");
        std::fs::remove_dir(&renamed).unwrap();
        std::fs::remove_dir(&aside).unwrap();
        // One replaced by a link to another directory: not handed out, the link's target left
        // alone.
        pool.refill();
        let swapped = next(&pool);
        std::fs::remove_dir(&swapped).unwrap();
        std::os::unix::fs::symlink(&a, &swapped).unwrap();
        let g = pool.take().unwrap();
        assert!(g != swapped && g != a && private_id(&g).is_some());
        assert!(a.exists());
        std::fs::remove_file(&swapped).unwrap();
        // Release removes what was made ahead of time, and nothing is made after it.
        pool.refill();
        let held = next(&pool);
        pool.release();
        assert!(pool.ready().0.is_empty() && !held.exists());
        pool.refill();
        assert!(pool.ready().0.is_empty(), "nothing is made after release");
        for dir in [a, b, c, d, e, f, g] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
