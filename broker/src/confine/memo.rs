//! One snapshot of the file system's answers for the length of one confinement plan.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

/// The file system's answers for the length of one plan, so that a path asked about twice (by
/// the grants, the denials, the mode checks and the rules) costs one lookup: a plan asks about
/// the same few dozen paths again and again, and every lookup is a system call (about 1.5 µs
/// here; a canonical path one per component). Only inside [`memoized`], which ends with the
/// plan; everywhere else each call asks the kernel. The ruleset is still built from
/// descriptors opened afterwards ([`crate::sys::landlock_allow`] checks each one itself).
#[derive(Default)]
struct Memo {
    real: std::collections::HashMap<PathBuf, Option<PathBuf>>,
    meta: std::collections::HashMap<PathBuf, Option<std::fs::Metadata>>,
    lmeta: std::collections::HashMap<PathBuf, Option<std::fs::Metadata>>,
}

thread_local! {
    static MEMO: std::cell::RefCell<Option<Memo>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` with the file system's answers remembered ([`Memo`]) until it returns.
pub(crate) fn memoized<T>(f: impl FnOnce() -> T) -> T {
    /// Forgets the answers when the outermost scope ends, panics included.
    struct Forget(bool);
    impl Drop for Forget {
        fn drop(&mut self) {
            if self.0 {
                MEMO.with(|m| *m.borrow_mut() = None);
            }
        }
    }
    let outermost = MEMO.with(|m| {
        let mut m = m.borrow_mut();
        let fresh = m.is_none();
        if fresh {
            *m = Some(Memo::default());
        }
        fresh
    });
    let _forget = Forget(outermost);
    f()
}

fn memo_active() -> bool {
    MEMO.with(|m| m.borrow().is_some())
}

type Table<T> = std::collections::HashMap<PathBuf, Option<T>>;

/// The remembered answer for `p` in `table`, else `ask`'s (remembered when `keep` says so).
fn remembered<T: Clone>(
    p: &Path,
    table: impl Fn(&mut Memo) -> &mut Table<T>,
    ask: impl FnOnce() -> Option<T>,
    keep: impl FnOnce(&Option<T>) -> bool,
) -> Option<T> {
    if let Some(hit) = MEMO.with(|m| {
        m.borrow_mut()
            .as_mut()
            .and_then(|m| table(m).get(p).cloned())
    }) {
        return hit;
    }
    let answer = ask();
    if keep(&answer) {
        MEMO.with(|m| {
            if let Some(m) = m.borrow_mut().as_mut() {
                table(m).insert(p.to_path_buf(), answer.clone());
            }
        });
    }
    answer
}

/// `p` with every symbolic link, `.` and `..` resolved, as `realpath(3)` answers (`None`: it
/// does not exist). Inside [`memoized`], resolved one component at a time so that the paths a
/// plan asks about share the lookups of their common prefixes.
pub(super) fn canonical(p: &Path) -> Option<PathBuf> {
    if !p.is_absolute() || !memo_active() {
        return std::fs::canonicalize(p).ok();
    }
    resolve(p, 0)
}

/// Symbolic links followed in one resolution before it fails (as the kernel's `ELOOP`).
const MAX_LINKS: u32 = 40;

fn resolve(p: &Path, links: u32) -> Option<PathBuf> {
    // A failure deep in a chain of links may be the bound's, not the path's: not remembered.
    remembered(
        p,
        |m| &mut m.real,
        || resolve_components(p, links),
        |r| links == 0 || r.is_some(),
    )
}

fn resolve_components(p: &Path, links: u32) -> Option<PathBuf> {
    use std::path::Component;
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            // `out` is already resolved: its parent is the real parent.
            Component::ParentDir => {
                out.pop();
            }
            Component::Prefix(_) => return None,
            Component::Normal(name) => {
                let next = out.join(name);
                let m = lmeta(&next)?;
                if m.file_type().is_symlink() {
                    if links >= MAX_LINKS {
                        return None;
                    }
                    let target = std::fs::read_link(&next).ok()?;
                    out = resolve(&out.join(target), links + 1)?;
                } else {
                    out = next;
                }
            }
        }
    }
    Some(out)
}

/// `p`'s own metadata (a symbolic link is not followed).
pub(super) fn lmeta(p: &Path) -> Option<std::fs::Metadata> {
    remembered(
        p,
        |m| &mut m.lmeta,
        || std::fs::symlink_metadata(p).ok(),
        |_| true,
    )
}

/// `p`'s metadata, symbolic links followed.
pub(super) fn meta(p: &Path) -> Option<std::fs::Metadata> {
    // What is not a link has the same metadata either way.
    let known = MEMO.with(|m| {
        m.borrow()
            .as_ref()
            .and_then(|m| m.lmeta.get(p).cloned().flatten())
    });
    if let Some(m) = known.filter(|m| !m.file_type().is_symlink()) {
        return Some(m);
    }
    remembered(p, |m| &mut m.meta, || std::fs::metadata(p).ok(), |_| true)
}

pub(super) fn exists(p: &Path) -> bool {
    meta(p).is_some()
}

pub(super) fn is_dir(p: &Path) -> bool {
    meta(p).is_some_and(|m| m.is_dir())
}

pub(super) fn is_file(p: &Path) -> bool {
    meta(p).is_some_and(|m| m.is_file())
}
