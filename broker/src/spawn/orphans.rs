//! Which children are the broker's own, and the sweep that ends and reaps descendants
//! re-parented to it (see the module documentation of `spawn`).
#![forbid(unsafe_code)]

use super::*;

/// The pids of the children [`spawn`] started that are not reaped yet. Each is also the id of
/// the child's session, which its descendants keep unless they `setsid`. Locked around every
/// fork (so a sweep never mistakes a child being started for an orphan) and every sweep round.
pub(super) fn owners() -> &'static Mutex<std::collections::BTreeSet<i32>> {
    static OWNERS: OnceLock<Mutex<std::collections::BTreeSet<i32>>> = OnceLock::new();
    OWNERS.get_or_init(|| Mutex::new(std::collections::BTreeSet::new()))
}

pub(super) fn lock_owners() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<i32>> {
    // A panic while holding the lock leaves a set that is still a set: keep using it.
    owners()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reaper threads still running (a child not yet stopped, reaped and swept), for [`settle`].
pub(super) fn reapers() -> &'static (Mutex<usize>, std::sync::Condvar) {
    static REAPERS: OnceLock<(Mutex<usize>, std::sync::Condvar)> = OnceLock::new();
    REAPERS.get_or_init(|| (Mutex::new(0), std::sync::Condvar::new()))
}

pub(super) fn reaper_count(delta: isize) {
    let (m, cv) = reapers();
    let mut n = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    *n = n.saturating_add_signed(delta);
    cv.notify_all();
}

/// Wait, at most `within`, until every child started so far has been stopped, reaped and
/// swept ([`sweep`]) — a child whose handle was dropped is killed by its reaper in the
/// background. A command calls this before exiting, so no adopted descendant is left to init.
/// `true` when nothing is left.
/// The scratch directories made ahead of time are removed then too.
pub fn settle(within: Duration) -> bool {
    let (m, cv) = reapers();
    let n = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let done = match cv.wait_timeout_while(n, within, |n| *n > 0) {
        Ok((n, _)) => *n == 0,
        Err(_) => false,
    };
    super::scratch::release();
    done
}

/// The processes whose parent is this process, with their session ids: every process's
/// `stat` read (`full`), or only those of the children each of this process's threads lists
/// (`/proc/self/task/*/children`; a process re-parented to this one, a child subreaper,
/// becomes the child of one of its threads): a read per thread and one `stat` per child
/// instead of one per process on the machine. Each candidate's parent is read from its
/// `stat`. Where the kernel offers no such lists (built without `CONFIG_PROC_CHILDREN`),
/// every process is read.
pub(super) fn adopted(full: bool) -> Vec<(i32, i32)> {
    let candidates = if full {
        all_pids()
    } else {
        thread_children().unwrap_or_else(all_pids)
    };
    parents_are_me(candidates)
}

/// Those of `pids` whose parent is this process now, with their session ids.
fn parents_are_me(pids: Vec<i32>) -> Vec<(i32, i32)> {
    let me = std::process::id() as i32;
    pids.into_iter()
        .filter_map(|pid| match parent_and_session(pid) {
            Some((ppid, sid)) if ppid == me => Some((pid, sid)),
            _ => None,
        })
        .collect()
}

/// The pids listed in the `children` file of every thread of this process; `None` when a
/// thread that is still there has no readable list (the kernel offers none).
pub(super) fn thread_children() -> Option<Vec<i32>> {
    let rd = std::fs::read_dir("/proc/self/task").ok()?;
    let mut out = Vec::new();
    for e in rd.flatten() {
        match std::fs::read_to_string(e.path().join("children")) {
            Ok(list) => out.extend(
                list.split_ascii_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            ),
            // The thread ended after its directory was listed.
            Err(_) if !e.path().exists() => {}
            Err(_) => return None,
        }
    }
    Some(out)
}

/// Every pid in `/proc`.
pub(super) fn all_pids() -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .collect()
}

/// The parent and session id of `pid`, from `/proc/PID/stat`.
pub(super) fn parent_and_session(pid: i32) -> Option<(i32, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp session …": comm may hold spaces and parentheses, so the
    // fields are counted after the last ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut f = rest.split_whitespace();
    let ppid = f.nth(1)?.parse::<i32>().ok()?;
    let sid = f.nth(1)?.parse::<i32>().ok()?;
    Some((ppid, sid))
}

/// Held while a sweep runs: one at a time, so no two wait for the same pid.
pub(super) static SWEEPING: Mutex<()> = Mutex::new(());

/// End and reap every process this process adopted from its children: a process whose parent
/// is now this process, that is not a supervised child, whose session is not a supervised
/// child's (a descendant of a child that is still being supervised waits for that child's
/// own stop) and not this process's own (this process did not start it through [`spawn`]).
/// Repeats until a round finds none, at most [`MAX_SWEEP_ROUNDS`] rounds (a deeper tree is
/// finished by the next sweep). Returns how many were ended, and whether a round found none.
pub fn sweep() -> (usize, bool) {
    let _one = SWEEPING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let own_session = nix::unistd::getsid(None).map_or(-1, Pid::as_raw);
    rounds_until_none(MAX_SWEEP_ROUNDS, || {
        match end_adopted(adopted(false), own_session) {
            // A `children` list may leave out a live child while another one exits (proc(5)):
            // a round that found none there is confirmed by reading every process — outside
            // the lock every fork takes, which the children lists were brought in to spare.
            0 => end_adopted(adopted(true), own_session),
            n => n,
        }
    })
}

/// End and reap those of `found` (read without the lock) that are still this process's
/// children, not supervised, not in a supervised child's session and not in this process's
/// own; how many. Each is checked again under the lock every fork takes: while it is held no
/// supervised child is reaped and no new child is started, and an orphan, once re-parented
/// here, is reaped only by this (serialized) sweep, so a pid checked here cannot have been
/// reused by another process.
fn end_adopted(found: Vec<(i32, i32)>, own_session: i32) -> usize {
    let victims: Vec<i32> = {
        let owners = lock_owners();
        let v: Vec<i32> = parents_are_me(found.into_iter().map(|(pid, _)| pid).collect())
            .into_iter()
            .filter(|(pid, sid)| {
                !owners.contains(pid) && !owners.contains(sid) && *sid != own_session
            })
            .map(|(pid, _)| pid)
            .collect();
        for p in &v {
            let _ = nix::sys::signal::kill(Pid::from_raw(*p), Signal::SIGKILL);
        }
        v
    };
    for p in &victims {
        while let Err(nix::errno::Errno::EINTR) = nix::sys::wait::waitpid(Pid::from_raw(*p), None) {
        }
    }
    victims.len()
}

/// Run `round` (which ends what it finds and says how many) until it finds none, at most `max`
/// times: the total ended, and whether the last round found none.
pub(super) fn rounds_until_none(max: usize, mut round: impl FnMut() -> usize) -> (usize, bool) {
    let mut ended = 0;
    for _ in 0..max {
        match round() {
            0 => return (ended, true),
            n => ended += n,
        }
    }
    (ended, false)
}
