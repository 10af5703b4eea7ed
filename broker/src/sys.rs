//! The only module of the broker allowed to contain `unsafe` code: the pre-exec hardening of
//! child processes. Every block carries a `// SAFETY:` comment.
//!
//! What runs between `fork` and `exec` may only make async-signal-safe calls and must not
//! allocate; every call below is a plain system call through nix or libc.
//!
//! Longer than the other modules (about 1,100 lines without its tests) on purpose: every
//! `unsafe` block of the crate is here and nowhere else, so that one file is what a reviewer
//! of the unsafe code reads, whole.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use nix::sys::resource::{Resource, setrlimit};
use nix::sys::signal::Signal;

/// Arrange for `cmd`'s child to be hardened just before `exec`:
/// 1. `setsid()`: a new session and process group with no controlling terminal, so the whole
///    group can be signalled and the child cannot read the operator's terminal;
/// 2. `PR_SET_PDEATHSIG(SIGKILL)`, then a check that the parent is still `parent_pid` (if the
///    parent died before the signal was armed, fail rather than run orphaned). The signal fires
///    when the *thread* that forked exits, so callers spawn from one long-lived thread;
/// 3. `PR_SET_CHILD_SUBREAPER`: a descendant orphaned while the child lives (a double-forking
///    daemon) is re-parented to the child, not to init, so it stays in the child's tree until
///    the child ends and then comes to the broker (itself a subreaper, [`become_subreaper`]),
///    which ends it ([`crate::spawn`]);
/// 4. `PR_SET_NO_NEW_PRIVS`: no setuid/file-capability gain through exec;
/// 5. `RLIMIT_CORE = 0`: no core dump of the child's memory;
/// 6. every descriptor ≥ 3 marked close-on-exec (`close_range` with `CLOSE_RANGE_CLOEXEC`), so
///    nothing the broker holds (sockets, credential files) leaks into the child. Descriptors are
///    marked, not closed: std's exec-error pipe must survive until exec.
///
/// A confined child then, in this order: sets its resource limits; enters a network namespace
/// of its own when [`Prepared::netns`] says so (under a broker that is not root, with a user
/// namespace that owns it), bringing its loopback up and handing the broker a listener on it
/// for a `web_egress` server ([`PROXY_PORT`]); empties the capability bounding set (while it
/// may); switches to its uid and gid with no supplementary groups
/// when [`Prepared::identity`] says so (its stdio pipes are handed to that uid first, so
/// `/dev/stdin` and `/dev/stderr` still open) and arms the parent-death signal again (the
/// kernel clears it when the effective uid changes); empties every capability set; joins a new
/// anonymous session keyring (best effort: the broker's session keyring, and through it the
/// user keyring, leaves the child's search path); enforces its Landlock ruleset; and comes
/// under its seccomp filter (which also refuses every keyring call): inherited from the thread
/// that forked it ([`filter_spawner_thread`]), or, where that thread could not install it,
/// installed last.
pub(crate) fn harden_pre_exec(cmd: &mut Command, parent_pid: i32, confine: Option<Prepared>) {
    let hook = move || -> std::io::Result<()> {
        nix::unistd::setsid().map_err(std::io::Error::from)?;
        arm_parent_death(parent_pid)?;
        nix::sys::prctl::set_child_subreaper(true).map_err(std::io::Error::from)?;
        nix::sys::prctl::set_no_new_privs().map_err(std::io::Error::from)?;
        setrlimit(Resource::RLIMIT_CORE, 0, 0).map_err(std::io::Error::from)?;
        // SAFETY: close_range(2) takes three integers and touches no memory of ours; with
        // CLOSE_RANGE_CLOEXEC it only sets flags on descriptors, which is async-signal-safe.
        let rc = unsafe {
            nix::libc::syscall(
                nix::libc::SYS_close_range,
                3 as nix::libc::c_uint,
                nix::libc::c_uint::MAX,
                nix::libc::CLOSE_RANGE_CLOEXEC,
            )
        };
        if rc != 0 {
            // Older kernels (before 5.11) or a seccomp profile without close_range: mark each
            // descriptor up to the soft RLIMIT_NOFILE (bounded) close-on-exec one by one.
            let (soft, _) = nix::sys::resource::getrlimit(Resource::RLIMIT_NOFILE)
                .map_err(std::io::Error::from)?;
            let top = soft.min(65_536) as nix::libc::c_int;
            for fd in 3..top {
                // SAFETY: fcntl(F_SETFD) on an integer descriptor touches no memory; on a
                // descriptor that is not open it fails with EBADF, which is ignored.
                unsafe {
                    nix::libc::fcntl(fd, nix::libc::F_SETFD, nix::libc::FD_CLOEXEC);
                }
            }
        }
        if let Some(c) = &confine {
            for (resource, limit) in &c.rlimits {
                setrlimit(*resource, *limit, *limit).map_err(std::io::Error::from)?;
            }
            // Before anything is dropped: a root child needs CAP_SYS_ADMIN to unshare; an
            // unprivileged one gets its namespaces' capabilities here, dropped below.
            if let Some(ns) = &c.netns {
                enter_netns(ns)?;
            }
            // The bounding set needs CAP_SETPCAP, which the uid switch below takes away.
            drop_bounding_set();
            if let Some((uid, gid)) = c.identity {
                switch_identity(uid, gid)?;
                // commit_creds() cleared the parent-death signal with the effective uid.
                arm_parent_death(parent_pid)?;
            }
            drop_capabilities()?;
            // Best effort; refused (and not needed) under a filter inherited from the forking
            // thread, which joined one for all its children.
            let _ = join_new_session_keyring();
            if let Some(fd) = &c.ruleset {
                // SAFETY: landlock_restrict_self(2) takes a descriptor number and a flags word
                // and touches no memory of ours; no_new_privs is already set, as it requires.
                let rc = unsafe {
                    nix::libc::syscall(
                        nix::libc::SYS_landlock_restrict_self,
                        fd.as_raw_fd(),
                        0 as nix::libc::c_uint,
                    )
                };
                if rc != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Usually `None`: the thread that forks confined children installed the same
            // filter on itself, and a child inherits it ([`filter_spawner_thread`]).
            if let Some(prog) = &c.seccomp {
                install_seccomp(prog)?;
            }
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child before exec. It makes only async-signal-safe
    // system calls (setsid, prctl, getppid, setrlimit, close_range, unshare, open, write,
    // close, socket, ioctl, bind, listen, sendmsg, fstat, fchown, set*id, capset, keyctl,
    // landlock, seccomp), allocates nothing (the error values are plain
    // integers), and touches no lock the parent could hold.
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// Install `prog` as a seccomp filter on the calling thread. No allocation: a forked child
/// may call it. `no_new_privs` must be set already (or the thread privileged).
fn install_seccomp(prog: &[nix::libc::sock_filter]) -> std::io::Result<()> {
    let fprog = nix::libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr().cast_mut(),
    };
    // SAFETY: prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog) reads the filter program,
    // which lives in this address space for the call (in a forked child: it was built before
    // the fork, and the copy lives until exec). Nothing is allocated here.
    let rc = unsafe {
        nix::libc::prctl(
            nix::libc::PR_SET_SECCOMP,
            nix::libc::SECCOMP_MODE_FILTER as nix::libc::c_ulong,
            &fprog as *const nix::libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Put the calling thread — one that forks confined children and does nothing else — under
/// `prog`, the filter each of its children needs, so that every child inherits it at `fork`
/// instead of installing its own: installing one costs about 65 µs per child here (the kernel
/// translates and compiles the program and runs it once for every system call number to
/// build its cache; measured in the child), inheriting one nothing. First the thread joins a
/// new anonymous session keyring, since the filter refuses every keyring call, the children's
/// own attempt included: they share that keyring (empty, and out of their reach) instead of
/// the broker's. Then `no_new_privs` (on this thread; each child sets it too) and the filter.
/// `false` if either is not in place (the filter is then not installed here): each child then
/// joins its own keyring and installs its own filter, as it would without this.
pub(crate) fn filter_spawner_thread(prog: &[nix::libc::sock_filter]) -> bool {
    join_new_session_keyring()
        && nix::sys::prctl::set_no_new_privs().is_ok()
        && install_seccomp(prog).is_ok()
}

/// Whether two filter programs are the same, instruction for instruction.
pub(crate) fn same_filter(a: &[nix::libc::sock_filter], b: &[nix::libc::sock_filter]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x.code, x.jt, x.jf, x.k) == (y.code, y.jt, y.jf, y.k))
}

/// `PR_SET_PDEATHSIG(SIGKILL)`, then check the parent is still `parent_pid` (it may have died
/// before the signal was armed: then fail rather than run orphaned).
fn arm_parent_death(parent_pid: i32) -> std::io::Result<()> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
    if nix::unistd::getppid().as_raw() != parent_pid {
        return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
    }
    Ok(())
}

/// Become the child subreaper of this process's descendants: an orphan anywhere below it is
/// re-parented here instead of to init, so [`crate::spawn`] can end and reap it. Idempotent.
pub(crate) fn become_subreaper() -> std::io::Result<()> {
    nix::sys::prctl::set_child_subreaper(true).map_err(std::io::Error::from)
}

/// Hand the stdio pipes to `uid` (only pipes: a descriptor that is a file or a device is left
/// alone), then drop every supplementary group and set the real, effective and saved gid and
/// uid. Raw system calls: the forked child has one thread, so glibc's broadcast of set*id to
/// every thread is neither needed nor wanted here. Afterwards the process has no capability
/// left (the uid is not 0), and the result is checked, not assumed.
fn switch_identity(uid: u32, gid: u32) -> std::io::Result<()> {
    use nix::libc as c;
    for fd in 0..=2 {
        let mut st = std::mem::MaybeUninit::<c::stat>::uninit();
        // SAFETY: fstat(2) writes one `struct stat` into the live stack buffer it is given.
        let rc = unsafe { c::fstat(fd, st.as_mut_ptr()) };
        if rc != 0 {
            continue; // not open: nothing to hand over
        }
        // SAFETY: fstat succeeded, so the kernel filled the whole structure.
        let mode = unsafe { st.assume_init() }.st_mode;
        if mode & c::S_IFMT == c::S_IFIFO {
            // SAFETY: fchown(2) on an integer descriptor with two integers touches no memory.
            let rc = unsafe { c::fchown(fd, uid, gid) };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    // SAFETY: setgroups(2) with a count of 0 never reads the (null) list.
    let rc = unsafe {
        c::syscall(
            c::SYS_setgroups,
            0 as c::size_t,
            std::ptr::null::<c::gid_t>(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: setresgid(2) and setresuid(2) take three integers each and touch no memory.
    let rc = unsafe { c::syscall(c::SYS_setresgid, gid, gid, gid) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    let rc = unsafe { c::syscall(c::SYS_setresuid, uid, uid, uid) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (ruid, euid) = (nix::unistd::getuid(), nix::unistd::geteuid());
    let (rgid, egid) = (nix::unistd::getgid(), nix::unistd::getegid());
    if ruid.as_raw() != uid || euid.as_raw() != uid || rgid.as_raw() != gid || egid.as_raw() != gid
    {
        return Err(std::io::Error::from_raw_os_error(c::EPERM));
    }
    Ok(())
}

/// Join a new anonymous session keyring, so the broker's session keyring (and the user
/// keyring linked from it) is no longer in the keys the kernel searches on the child's behalf.
/// Best effort: a kernel without keys, a container profile that refuses `keyctl`, or a full
/// key quota leaves the inherited keyring — which the child still cannot use, because its
/// seccomp filter refuses `add_key`, `request_key` and `keyctl`.
fn join_new_session_keyring() -> bool {
    const KEYCTL_JOIN_SESSION_KEYRING: nix::libc::c_long = 1;
    // SAFETY: keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL) reads no memory (a null name asks for
    // an anonymous keyring).
    unsafe {
        nix::libc::syscall(
            nix::libc::SYS_keyctl,
            KEYCTL_JOIN_SESSION_KEYRING,
            std::ptr::null::<nix::libc::c_char>(),
        ) >= 0
    }
}

/// What [`harden_self`] did.
#[derive(Debug, Clone, Default)]
pub struct Hardened {
    /// Names (never values) of the environment variables removed.
    pub removed: Vec<String>,
}

/// Whether an environment variable may redirect the broker's loader, proxies or TLS roots.
pub fn is_dangerous_env(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    upper.starts_with("LD_")
        || upper.ends_with("_PROXY")
        || matches!(
            upper.as_str(),
            "SSL_CERT_FILE"
                | "SSL_CERT_DIR"
                | "SSLKEYLOGFILE"
                | "CURL_CA_BUNDLE"
                | "REQUESTS_CA_BUNDLE"
                | "NODE_EXTRA_CA_CERTS"
                | "NODE_OPTIONS"
                | "PYTHONPATH"
                | "PYTHONSTARTUP"
                | "RUSTLS_KEYLOG"
        )
}

fn threads_in_process() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(usize::MAX, Iterator::count)
}

/// Harden the broker process itself; call first thing, while the process has one thread:
/// 1. `PR_SET_DUMPABLE = 0`: no same-uid ptrace, no core dumps, `/proc/<pid>` owned by root;
/// 2. `RLIMIT_CORE = 0` (soft and hard);
/// 3. umask 077: everything the broker creates is private unless it sets a mode explicitly;
/// 4. the loader (`LD_*`), proxy and TLS-root variables are removed from the environment, so
///    no library and no child can be steered by them.
///
/// Fails (without touching the environment) if the process already has a second thread.
pub fn harden_self() -> std::io::Result<Hardened> {
    nix::sys::prctl::set_dumpable(false).map_err(std::io::Error::from)?;
    setrlimit(Resource::RLIMIT_CORE, 0, 0).map_err(std::io::Error::from)?;
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    if threads_in_process() != 1 {
        return Err(std::io::Error::other(
            "the broker must harden itself before starting any thread",
        ));
    }
    let mut removed = Vec::new();
    for (name, _) in std::env::vars_os() {
        let shown = name.to_string_lossy().into_owned();
        if is_dangerous_env(&shown) {
            // SAFETY: the process has exactly one thread (checked just above, and nothing in
            // this function starts one), so no other thread can read the environment while it
            // is modified — the condition `remove_var` requires.
            unsafe { std::env::remove_var(&name) };
            removed.push(shown);
        }
    }
    Ok(Hardened { removed })
}

/// Whether this process is dumpable (diagnostics and tests).
pub fn is_dumpable() -> bool {
    nix::sys::prctl::get_dumpable().unwrap_or(true)
}

/// Everything a confined child applies to itself between fork and exec, prepared in the parent
/// (building rules and programs allocates, which the child must not do).
#[derive(Debug, Default)]
pub(crate) struct Prepared {
    /// A Landlock ruleset to enforce (`None`: the kernel has no Landlock, or nothing to do).
    pub(crate) ruleset: Option<OwnedFd>,
    /// A seccomp filter program to install.
    pub(crate) seccomp: Option<Vec<nix::libc::sock_filter>>,
    /// Resource limits to set (soft = hard).
    pub(crate) rlimits: Vec<(Resource, u64)>,
    /// The uid and gid to switch to (`None`: keep the broker's).
    pub(crate) identity: Option<(u32, u32)>,
    /// A network namespace of its own to enter (`None`: the broker's, `sandbox.network:
    /// "host"`, or a system without network namespaces).
    pub(crate) netns: Option<NetNs>,
    /// The namespace joined, when it came from the pool without `web_egress` and the child
    /// runs under Landlock as a uid other than 0: for the spawner to take out before the fork
    /// and give back once the child ended ([`give_back_isolated`]). Never used by the child.
    pub(crate) give_back: Option<OwnedFd>,
}

/// The port of the egress proxy inside a child's own network namespace (nothing else listens
/// there: the namespace is new).
pub const PROXY_PORT: u16 = 3128;
/// Connections the proxy listener queues before the broker accepts them.
const PROXY_BACKLOG: nix::libc::c_int = 128;

/// How a child enters a network namespace of its own, prepared in the parent.
#[derive(Debug, Default)]
pub(crate) struct NetNs {
    /// A namespace made ahead of time for this child alone ([`take_ready`]): join it (`setns`)
    /// instead of making one; nothing else below applies.
    pub(crate) join: Option<OwnedFd>,
    /// For a broker that is not root: a user namespace too (only it lets an unprivileged
    /// process own a network namespace), with these `uid_map` and `gid_map` lines mapping the
    /// child's own uid and gid to themselves.
    pub(crate) user: Option<(Vec<u8>, Vec<u8>)>,
    /// For a `web_egress` server: bring loopback up, listen on `127.0.0.1:`[`PROXY_PORT`] and
    /// send that listener to the broker over this socket (the child's end of a pair).
    pub(crate) proxy: Option<OwnedFd>,
}

impl NetNs {
    /// What this process's children need: a user namespace unless the process is root.
    pub(crate) fn for_this_process(proxy: Option<OwnedFd>) -> NetNs {
        let (uid, gid) = (nix::unistd::geteuid(), nix::unistd::getegid());
        NetNs {
            join: None,
            user: (!uid.is_root()).then(|| {
                (
                    format!("{uid} {uid} 1\n").into_bytes(),
                    format!("{gid} {gid} 1\n").into_bytes(),
                )
            }),
            proxy,
        }
    }

    /// Join `ns`, a namespace made ahead of time for this child alone.
    pub(crate) fn joining(ns: OwnedFd) -> NetNs {
        NetNs {
            join: Some(ns),
            ..NetNs::default()
        }
    }
}

/// Where a `web_egress` server's proxy listener comes from.
#[derive(Debug)]
pub(crate) enum ProxyListener {
    /// Made with its namespace ahead of time ([`take_ready`]).
    Ready(std::net::TcpListener),
    /// Sent by the child before `exec`, over the broker's end of this pair.
    Arrives(OwnedFd),
}

impl ProxyListener {
    /// The listener (for [`ProxyListener::Arrives`], once the spawn returned).
    pub(crate) fn listener(self) -> std::io::Result<std::net::TcpListener> {
        match self {
            ProxyListener::Ready(l) => Ok(l),
            ProxyListener::Arrives(ch) => receive_proxy_listener(&ch),
        }
    }
}

/// A network namespace a root broker made ahead of time for one child: making one costs more
/// than a millisecond, joining one a system call, so a start does not wait for it.
#[derive(Debug)]
pub(crate) struct Ready {
    /// The namespace (`/proc/thread-self/ns/net` of the thread that made it).
    pub(crate) ns: OwnedFd,
    /// For a `web_egress` child: loopback up, and this listener on `127.0.0.1:`[`PROXY_PORT`].
    pub(crate) listener: Option<std::net::TcpListener>,
}

/// Namespaces kept ready, of each kind (without and with the proxy listener): enough for a
/// burst of starts (a broker starting its servers) without one making its own.
pub const READY_NAMESPACES: usize = 4;
/// How long after the last namespace was taken the pool waits before making the next (unless
/// none of that kind is left): making one costs about 1.5 ms of kernel time, which must not
/// land on the start that just took one (it measurably slowed that start on a two-core
/// machine) nor on the ones that follow it.
pub const REFILL_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

struct Pool {
    /// `[plain, egress]`, whether egress ones are wanted yet (after the first one taken), and
    /// when one was last taken.
    ready: std::sync::Mutex<([Vec<Ready>; 2], bool, Option<std::time::Instant>)>,
    /// Namespaces without `web_egress` given back by the reaper of the child that had one
    /// ([`give_back_isolated`]), to be checked before they are ready again.
    returned: std::sync::Mutex<Vec<OwnedFd>>,
    low: std::sync::Condvar,
}

fn make_ready(egress: bool) -> std::io::Result<Ready> {
    // SAFETY: unshare(2) takes a flags word; CLONE_NEWNET moves only the calling thread (the
    // pool's own, which does nothing else) into a new network namespace.
    if unsafe { nix::libc::unshare(nix::libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let ns = OwnedFd::from(std::fs::File::open("/proc/thread-self/ns/net")?);
    let listener = if egress {
        loopback_up()?;
        let l = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, PROXY_PORT))?;
        Some(l)
    } else {
        None
    };
    Ok(Ready { ns, listener })
}

/// The pool of a root broker (`None` otherwise, or when its thread cannot start); its thread
/// keeps [`READY_NAMESPACES`] of each kind made, and stops at the first failure (the children
/// then make their own, or report why they cannot).
fn pool() -> Option<&'static Pool> {
    static POOL: std::sync::OnceLock<Option<Pool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        if !nix::unistd::geteuid().is_root() {
            return None;
        }
        std::thread::Builder::new()
            .name("iteron-netns".into())
            .spawn(|| {
                let Some(p) = pool() else { return };
                loop {
                    let egress = {
                        let mut g = p
                            .ready
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        loop {
                            // A namespace given back is checked at once (a few system calls,
                            // none of them making anything) and, if it is as it was made,
                            // ready again: no new one needs making, nor the old one tearing
                            // down.
                            let back = p
                                .returned
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .pop();
                            if let Some(ns) = back {
                                drop(g);
                                let reuse = still_isolated(&ns);
                                g = p
                                    .ready
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                                if reuse && g.0[0].len() < READY_NAMESPACES {
                                    g.0[0].push(Ready { ns, listener: None });
                                    REUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                }
                                continue;
                            }
                            let (kinds, want_egress, taken) = &*g;
                            let want = if kinds[0].len() < READY_NAMESPACES {
                                Some(false)
                            } else if *want_egress && kinds[1].len() < READY_NAMESPACES {
                                Some(true)
                            } else {
                                None
                            };
                            // Not while starts are under way: wait until none was taken for
                            // REFILL_DELAY — unless that kind has none left (starts then
                            // make their own, which costs them more).
                            let empty = want.is_some_and(|e| kinds[usize::from(e)].is_empty());
                            let quiet_in = taken
                                .map(|t| REFILL_DELAY.saturating_sub(t.elapsed()))
                                .filter(|d| !d.is_zero() && !empty);
                            match (want, quiet_in) {
                                (Some(egress), None) => break egress,
                                (Some(_), Some(d)) => {
                                    g = p
                                        .low
                                        .wait_timeout(g, d)
                                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                                        .0;
                                }
                                (None, _) => {
                                    g = p
                                        .low
                                        .wait(g)
                                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                                }
                            }
                        }
                    };
                    let Ok(r) = make_ready(egress) else {
                        // No more namespaces from here: nothing is taken back either.
                        POOL_STOPPED.store(true, std::sync::atomic::Ordering::Relaxed);
                        p.returned
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .clear();
                        return;
                    };
                    p.ready
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0[usize::from(egress)]
                    .push(r);
                }
            })
            .ok()?;
        Some(Pool {
            ready: std::sync::Mutex::new(([Vec::new(), Vec::new()], false, None)),
            returned: std::sync::Mutex::new(Vec::new()),
            low: std::sync::Condvar::new(),
        })
    })
    .as_ref()
}

/// A namespace made ahead of time (with the proxy listener when `egress`), if one is ready;
/// the pool makes another in the background.
pub(crate) fn take_ready(egress: bool) -> Option<Ready> {
    let p = pool()?;
    let mut g = p
        .ready
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    g.1 |= egress;
    let r = g.0[usize::from(egress)].pop();
    if r.is_some() {
        g.2 = Some(std::time::Instant::now());
    }
    p.low.notify_one();
    r
}

/// Give back the namespace (without `web_egress`, taken with [`take_ready`]) of a child that
/// has ended, once it and every descendant were reaped: the pool checks it
/// ([`still_isolated`]) and, if it is as it was made, hands it to a later child instead of
/// making a new one (about 1.5 ms of kernel time, and as much again to tear the old one
/// down). Only a namespace whose child ran under Landlock as a uid other than 0 is given back
/// ([`Prepared::give_back`]): such a child had no socket but Unix-domain pairs (seccomp), no
/// capability, and no write to `/proc/sys`. Without a pool it is simply closed.
pub(crate) fn give_back_isolated(ns: OwnedFd) {
    let Some(p) = pool() else { return };
    if POOL_STOPPED.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    // Under the pool's own lock (then this list's, as its thread takes them), so that the
    // thread cannot miss the notice between looking at the list and waiting.
    let g = p
        .ready
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut r = p
        .returned
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // Bounded like the pool itself: beyond, the namespace is closed (and torn down).
    if r.len() < READY_NAMESPACES {
        r.push(ns);
    }
    drop(r);
    drop(g);
    p.low.notify_one();
}

/// Set when the pool's thread stopped (it could not make a namespace): nothing is given back
/// any more.
static POOL_STOPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Namespaces given back and made ready again, since this process started.
static REUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many namespaces given back ([`give_back_isolated`]) passed the pool's check and were
/// made ready again (for tests and benchmarks).
pub fn namespaces_reused() -> u64 {
    REUSED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether `ns` is still a namespace as the pool makes one without `web_egress`: its only
/// interface loopback, down, and no socket open in it in any table the kernel lists (Unix,
/// TCP, UDP, UDP-Lite, raw, ICMP, packet), so no process is left in it holding one. Enters
/// `ns` (on the pool's own thread, which makes its namespaces by entering them anyway).
fn still_isolated(ns: &OwnedFd) -> bool {
    // SAFETY: setns(2) takes a descriptor number and a flags word; this thread (the pool's,
    // which does nothing else) has CAP_SYS_ADMIN under a root broker.
    if unsafe { nix::libc::setns(ns.as_raw_fd(), nix::libc::CLONE_NEWNET) } != 0 {
        return false;
    }
    let read = |t: &str| std::fs::read_to_string(format!("/proc/thread-self/net/{t}")).ok();
    let Some(dev) = read("dev") else { return false };
    // Two header lines, then `name: counters` per interface.
    let names: Vec<&str> = dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    if names != ["lo"] || loopback_flags().is_none_or(|f| f & nix::libc::IFF_UP != 0) {
        return false;
    }
    // Each table: one header line, then a line per socket.
    [
        "unix", "tcp", "tcp6", "udp", "udp6", "udplite", "udplite6", "raw", "raw6", "icmp",
        "icmp6", "packet",
    ]
    .iter()
    .all(|t| read(t).is_some_and(|text| text.lines().count() <= 1))
}

/// The flags of the loopback interface of this thread's network namespace.
fn loopback_flags() -> Option<i32> {
    use nix::libc as c;
    // SAFETY: socket(2) takes integers only.
    let s = unsafe { c::socket(c::AF_INET, c::SOCK_DGRAM | c::SOCK_CLOEXEC, 0) };
    if s < 0 {
        return None;
    }
    // SAFETY: an all-zero ifreq is a valid value (a name of NULs, zero flags).
    let mut req: c::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo") {
        *dst = *src as c::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags of the live ifreq.
    let rc = unsafe { c::ioctl(s, c::SIOCGIFFLAGS, &mut req as *mut c::ifreq) };
    // SAFETY: the kernel wrote the flags member of the union (read only when rc is 0).
    let flags = (rc == 0).then(|| i32::from(unsafe { req.ifr_ifru.ifru_flags }));
    // SAFETY: close(2) on the socket just made.
    unsafe { c::close(s) };
    flags
}

/// How many namespaces the pool holds ready, without and with `web_egress` (for tests and
/// benchmarks; `(0, 0)` without a pool).
pub fn ready_namespaces() -> (usize, usize) {
    let Some(p) = pool() else { return (0, 0) };
    let g = p
        .ready
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    (g.0[0].len(), g.0[1].len())
}

/// Whether a root broker's pool holds all the namespaces it keeps (of the kinds asked for so
/// far): a start now joins one, and none is being made. Always `true` without a pool.
pub fn ready_namespaces_full() -> bool {
    let Some(p) = pool() else { return true };
    let g = p
        .ready
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    g.0[0].len() >= READY_NAMESPACES && (!g.1 || g.0[1].len() >= READY_NAMESPACES)
}

/// Write `bytes` to the file at `path` with plain system calls (async-signal-safe).
fn write_proc(path: &std::ffi::CStr, bytes: &[u8]) -> std::io::Result<()> {
    use nix::libc as c;
    // SAFETY: open(2) reads the NUL-terminated path, which lives for the call.
    let fd = unsafe { c::open(path.as_ptr(), c::O_WRONLY | c::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: write(2) reads `bytes.len()` bytes of a live slice.
    let n = unsafe { c::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    let err = std::io::Error::last_os_error();
    // SAFETY: close(2) on the descriptor just opened, owned by nobody else.
    unsafe { c::close(fd) };
    if usize::try_from(n).ok() != Some(bytes.len()) {
        return Err(err);
    }
    Ok(())
}

/// Bring the loopback interface of the current network namespace up.
fn loopback_up() -> std::io::Result<()> {
    use nix::libc as c;
    // SAFETY: socket(2) takes integers only.
    let s = unsafe { c::socket(c::AF_INET, c::SOCK_DGRAM | c::SOCK_CLOEXEC, 0) };
    if s < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: an all-zero ifreq is a valid value (a name of NULs, zero flags).
    let mut req: c::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo") {
        *dst = *src as c::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags of the live ifreq.
    let mut rc = unsafe { c::ioctl(s, c::SIOCGIFFLAGS, &mut req as *mut c::ifreq) };
    if rc == 0 {
        // SAFETY: the kernel just wrote the flags member of the union.
        unsafe { req.ifr_ifru.ifru_flags |= c::IFF_UP as c::c_short };
        // SAFETY: SIOCSIFFLAGS reads the live ifreq.
        rc = unsafe { c::ioctl(s, c::SIOCSIFFLAGS, &req as *const c::ifreq) };
    }
    let err = std::io::Error::last_os_error();
    // SAFETY: close(2) on the socket just made.
    unsafe { c::close(s) };
    if rc != 0 {
        return Err(err);
    }
    Ok(())
}

/// The control message that carries one descriptor (`CMSG_SPACE(sizeof(int))` bytes).
#[repr(C)]
struct OneFd {
    header: nix::libc::cmsghdr,
    fd: nix::libc::c_int,
    _pad: nix::libc::c_int,
}

/// Listen on `127.0.0.1:`[`PROXY_PORT`] in the current namespace and send the listener over
/// the stream or seqpacket socket `to`; the listener is closed here afterwards.
fn send_proxy_listener(to: nix::libc::c_int) -> std::io::Result<()> {
    use nix::libc as c;
    // SAFETY: socket(2) takes integers only.
    let l = unsafe { c::socket(c::AF_INET, c::SOCK_STREAM | c::SOCK_CLOEXEC, 0) };
    if l < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let addr = c::sockaddr_in {
        sin_family: c::AF_INET as c::sa_family_t,
        sin_port: PROXY_PORT.to_be(),
        sin_addr: c::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: bind(2) reads a live sockaddr_in of the size given.
    let mut rc = unsafe {
        c::bind(
            l,
            (&addr as *const c::sockaddr_in).cast(),
            std::mem::size_of::<c::sockaddr_in>() as c::socklen_t,
        )
    };
    if rc == 0 {
        // SAFETY: listen(2) takes integers only.
        rc = unsafe { c::listen(l, PROXY_BACKLOG) };
    }
    if rc == 0 {
        let mut byte = [b'L'];
        let mut iov = c::iovec {
            iov_base: byte.as_mut_ptr().cast(),
            iov_len: 1,
        };
        let mut control = OneFd {
            // SAFETY: an all-zero cmsghdr is a valid value; its fields are set below.
            header: unsafe { std::mem::zeroed() },
            fd: l,
            _pad: 0,
        };
        control.header.cmsg_len =
            std::mem::size_of::<c::cmsghdr>() + std::mem::size_of::<c::c_int>();
        control.header.cmsg_level = c::SOL_SOCKET;
        control.header.cmsg_type = c::SCM_RIGHTS;
        // SAFETY: an all-zero msghdr is a valid value; its fields are set below.
        let mut msg: c::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = (&mut control as *mut OneFd).cast();
        msg.msg_controllen = std::mem::size_of::<OneFd>();
        // SAFETY: sendmsg(2) reads the live message, its one-byte buffer and its control
        // message, all on this stack frame.
        let n = unsafe { c::sendmsg(to, &msg, c::MSG_NOSIGNAL) };
        rc = if n == 1 { 0 } else { -1 };
    }
    let err = std::io::Error::last_os_error();
    // SAFETY: close(2) on the listener made here (the broker has its own copy now).
    unsafe { c::close(l) };
    if rc != 0 {
        return Err(err);
    }
    Ok(())
}

/// Enter a new network namespace (and, for a broker that is not root, a user namespace that
/// owns it), as [`NetNs`] says. Only plain system calls on memory prepared before the fork.
fn enter_netns(ns: &NetNs) -> std::io::Result<()> {
    use nix::libc as c;
    if let Some(fd) = &ns.join {
        // SAFETY: setns(2) takes a descriptor number and a flags word; the child still has
        // CAP_SYS_ADMIN (a root broker's, dropped further on).
        if unsafe { c::setns(fd.as_raw_fd(), c::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        return Ok(());
    }
    let flags = c::CLONE_NEWNET
        | if ns.user.is_some() {
            c::CLONE_NEWUSER
        } else {
            0
        };
    // SAFETY: unshare(2) takes a flags word only.
    if unsafe { c::unshare(flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if let Some((uid_map, gid_map)) = &ns.user {
        write_proc(c"/proc/self/setgroups", b"deny")?;
        write_proc(c"/proc/self/uid_map", uid_map)?;
        write_proc(c"/proc/self/gid_map", gid_map)?;
    }
    if let Some(to) = &ns.proxy {
        loopback_up()?;
        send_proxy_listener(to.as_raw_fd())?;
    }
    Ok(())
}

/// Whether children can get a network namespace of their own here: tried once, in a forked
/// process that enters one (with a user namespace when this process is not root) and brings
/// its loopback up, as a `web_egress` server's would. `Err` holds the reason, for `doctor`
/// and `mcp get`. The answer is kept for the life of the process.
pub fn netns_support() -> Result<(), String> {
    static ANSWER: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    ANSWER
        .get_or_init(|| {
            let ns = NetNs::for_this_process(None);
            // SAFETY: the forked child only makes plain system calls on memory prepared before
            // the fork (enter_netns, loopback_up) and leaves with _exit; the parent waits for
            // exactly that pid.
            let pid = unsafe { nix::libc::fork() };
            if pid == 0 {
                let code = match enter_netns(&ns).and_then(|()| loopback_up()) {
                    Ok(()) => 0,
                    Err(e) => e.raw_os_error().unwrap_or(255).clamp(1, 255),
                };
                // SAFETY: _exit(2) ends the forked child without running any handler.
                unsafe { nix::libc::_exit(code) };
            }
            if pid < 0 {
                return Err(format!(
                    "cannot fork to try: {}",
                    std::io::Error::last_os_error()
                ));
            }
            let status = loop {
                match nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    other => break other,
                }
            };
            match status {
                Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(()),
                Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => Err(format!(
                    "{}: {}",
                    if ns.user.is_some() {
                        "no user and network namespace for an unprivileged broker"
                    } else {
                        "no network namespace"
                    },
                    std::io::Error::from_raw_os_error(code)
                )),
                _ => Err("the namespace probe did not exit".to_owned()),
            }
        })
        .clone()
}

/// A connected pair of seqpacket sockets, both close-on-exec: `(broker's end, child's end)`.
pub(crate) fn proxy_channel() -> std::io::Result<(OwnedFd, OwnedFd)> {
    use nix::libc as c;
    let mut fds = [-1 as c::c_int; 2];
    // SAFETY: socketpair(2) writes two descriptors into the live two-element array.
    let rc = unsafe {
        c::socketpair(
            c::AF_UNIX,
            c::SOCK_SEQPACKET | c::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned these two descriptors to us and nothing else owns them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Receive the proxy listener a child sent before `exec` ([`send_proxy_listener`]); it is
/// already there once the spawn returned, so this never waits. The descriptor must be a TCP
/// listener on `127.0.0.1:`[`PROXY_PORT`].
pub(crate) fn receive_proxy_listener(from: &OwnedFd) -> std::io::Result<std::net::TcpListener> {
    use nix::libc as c;
    let mut byte = [0u8; 1];
    let mut iov = c::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: an all-zero OneFd is a valid value (the kernel fills it).
    let mut control: OneFd = unsafe { std::mem::zeroed() };
    // SAFETY: an all-zero msghdr is a valid value; its fields are set below.
    let mut msg: c::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = (&mut control as *mut OneFd).cast();
    msg.msg_controllen = std::mem::size_of::<OneFd>();
    // SAFETY: recvmsg(2) writes at most one byte into the live buffer and at most
    // `msg_controllen` bytes into the live control structure.
    let n = unsafe {
        c::recvmsg(
            from.as_raw_fd(),
            &mut msg,
            c::MSG_DONTWAIT | c::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let whole = std::mem::size_of::<c::cmsghdr>() + std::mem::size_of::<c::c_int>();
    if n != 1
        || msg.msg_flags & c::MSG_CTRUNC != 0
        || msg.msg_controllen < whole
        || control.header.cmsg_level != c::SOL_SOCKET
        || control.header.cmsg_type != c::SCM_RIGHTS
        || control.header.cmsg_len != whole
        || control.fd < 0
    {
        return Err(std::io::Error::other(
            "the child did not send its proxy listener",
        ));
    }
    // SAFETY: SCM_RIGHTS just installed this descriptor in our table; nothing else owns it.
    let listener = std::net::TcpListener::from(unsafe { OwnedFd::from_raw_fd(control.fd) });
    let expected = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, PROXY_PORT));
    if listener.local_addr().ok() != Some(expected) {
        return Err(std::io::Error::other(
            "the descriptor the child sent is not its proxy listener",
        ));
    }
    Ok(listener)
}

/// Landlock access rights on files and directories (Linux `landlock.h`), by ABI version.
pub(crate) mod landlock {
    pub(crate) const EXECUTE: u64 = 1 << 0;
    pub(crate) const WRITE_FILE: u64 = 1 << 1;
    pub(crate) const READ_FILE: u64 = 1 << 2;
    pub(crate) const READ_DIR: u64 = 1 << 3;
    pub(crate) const MAKE_CHAR: u64 = 1 << 6;
    pub(crate) const MAKE_BLOCK: u64 = 1 << 11;
    /// Every right of ABI 1 (bits 0-12).
    pub(crate) const ABI1_ALL: u64 = (1 << 13) - 1;
    pub(crate) const REFER: u64 = 1 << 13;
    pub(crate) const TRUNCATE: u64 = 1 << 14;
    pub(crate) const IOCTL_DEV: u64 = 1 << 15;
    pub(crate) const NET_BIND_TCP: u64 = 1 << 0;
    pub(crate) const NET_CONNECT_TCP: u64 = 1 << 1;
    /// The rights that apply to a non-directory (a rule on a file may hold only these).
    pub(crate) const FILE_RIGHTS: u64 = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV;

    /// Every filesystem right this ABI knows.
    pub(crate) fn handled_fs(abi: u32) -> u64 {
        let mut all = ABI1_ALL;
        if abi >= 2 {
            all |= REFER;
        }
        if abi >= 3 {
            all |= TRUNCATE;
        }
        if abi >= 5 {
            all |= IOCTL_DEV;
        }
        all
    }
}

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

/// `LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL` (ABI 6): no connecting to
/// abstract Unix sockets and no signals to processes outside the sandbox (the broker).
const LANDLOCK_SCOPES: u64 = (1 << 0) | (1 << 1);

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
const LANDLOCK_RULE_PATH_BENEATH: u32 = 1;

/// The Landlock ABI version the kernel offers, or `None` when Landlock is absent or disabled.
pub(crate) fn landlock_abi() -> Option<u32> {
    // SAFETY: with a null attribute pointer, size 0 and the VERSION flag, the call only returns
    // the ABI version (or an error); no memory is read or written.
    let v = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    u32::try_from(v).ok().filter(|v| *v >= 1)
}

/// A new ruleset handling every filesystem right of `abi`, and (from ABI 4) TCP bind and
/// connect when `deny_tcp`.
pub(crate) fn landlock_ruleset(abi: u32, deny_tcp: bool) -> std::io::Result<OwnedFd> {
    let attr = RulesetAttr {
        handled_access_fs: landlock::handled_fs(abi),
        handled_access_net: if deny_tcp && abi >= 4 {
            landlock::NET_BIND_TCP | landlock::NET_CONNECT_TCP
        } else {
            0
        },
        scoped: if abi >= 6 { LANDLOCK_SCOPES } else { 0 },
    };
    // ABI 1-3 know the first field, 4-5 the first two, 6 and later all three.
    let size = match abi {
        0..=3 => std::mem::size_of::<u64>(),
        4 | 5 => 2 * std::mem::size_of::<u64>(),
        _ => std::mem::size_of::<RulesetAttr>(),
    };
    // SAFETY: `attr` is a live, properly laid out landlock_ruleset_attr of at least `size`
    // bytes; the kernel only reads it. On success the result is a new descriptor we own.
    let fd = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_landlock_create_ruleset,
            &attr as *const RulesetAttr,
            size,
            0u32,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| std::io::Error::other("descriptor out of range"))?;
    // SAFETY: the kernel just returned this descriptor to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Allow `access` beneath `path` (opened `O_PATH`, following symlinks: the rule applies to the
/// inode the operator named).
pub(crate) fn landlock_allow(
    ruleset: &OwnedFd,
    path: &Path,
    access: u64,
    forbidden: &[(u64, u64)],
) -> std::io::Result<()> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    use std::os::unix::fs::MetadataExt;
    // Every planned path is canonical (its links resolved when it was planned), so a link met
    // now on the way to it was swapped in since: the open fails (ELOOP) and nothing is
    // granted, wherever the link leads — below the operator home as well as to it.
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS);
    let dir = std::fs::File::from(
        nix::fcntl::openat2(nix::fcntl::AT_FDCWD, path, how).map_err(|e| match e {
            nix::errno::Errno::ELOOP => std::io::Error::other(format!(
                "{} holds a symbolic link that was not there when it was planned: not granted",
                iteron_policy::text::single_line_capped(&path.to_string_lossy(), 200)
            )),
            nix::errno::Errno::ENOSYS | nix::errno::Errno::EPERM => std::io::Error::other(
                "openat2 is refused here (a kernel older than 5.6, or a seccomp profile around \
                 the broker): confinement needs it to open each grant without following a link",
            ),
            other => std::io::Error::from(other),
        })?,
    );
    // What was opened is checked, not what was planned: if the path was swapped (by a rename,
    // not a link) for the operator home or one of its ancestors since planning, nothing is
    // granted.
    let m = dir.metadata()?;
    if forbidden.contains(&(m.dev(), m.ino())) {
        return Err(std::io::Error::other(
            "a grant now resolves to the operator home or above it",
        ));
    }
    let attr = PathBeneathAttr {
        allowed_access: access,
        parent_fd: dir.as_raw_fd(),
    };
    // SAFETY: `attr` is a live landlock_path_beneath_attr (packed, as the kernel defines it)
    // naming an open descriptor; the kernel only reads it.
    let rc = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_landlock_add_rule,
            ruleset.as_raw_fd(),
            LANDLOCK_RULE_PATH_BENEATH,
            &attr as *const PathBeneathAttr,
            0u32,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Empty the capability bounding set of the calling thread where allowed (it needs
/// `CAP_SETPCAP`, so a child does this before any uid switch). Only plain system calls on
/// integers, so a forked child may call it.
///
/// Each `PR_CAPBSET_DROP` makes new credentials (about 7 µs here, so about 0.3 ms for the
/// whole set), while reading is cheap: a capability already out of the set is not dropped
/// again. The thread that forks every confined child empties its own set once
/// ([`empty_spawner_bounding_set`]), so such a child inherits an empty set and only checks it.
fn drop_bounding_set() {
    const CAP_LAST: nix::libc::c_ulong = 63;
    for cap in 0..=CAP_LAST {
        // SAFETY: prctl(PR_CAPBSET_READ, cap) takes integers only: 1 if the capability is in
        // the set, 0 if not, and EINVAL for a capability the kernel does not know.
        let held = unsafe { nix::libc::prctl(nix::libc::PR_CAPBSET_READ, cap, 0, 0, 0) };
        if held < 0 {
            // Capabilities are numbered without gaps: the first one the kernel does not know
            // ends them.
            break;
        }
        if held == 0 {
            continue;
        }
        // SAFETY: prctl(PR_CAPBSET_DROP, cap) takes integers only; without CAP_SETPCAP (any
        // non-root broker) it fails with EPERM, which leaves nothing to drop, so the result is
        // ignored.
        unsafe {
            nix::libc::prctl(nix::libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
        }
    }
}

/// Empty the bounding set of the thread that forks every confined child ([`crate::spawn`]): it
/// keeps its own effective and permitted capabilities (the bounding set only limits what an
/// `exec` may gain), and every child it forks starts with an empty set. That thread never
/// calls `exec` itself.
pub(crate) fn empty_spawner_bounding_set() {
    drop_bounding_set();
}

/// Give up every capability (effective, permitted, inheritable and ambient; the bounding set
/// went first, [`drop_bounding_set`]): a child that keeps uid 0 (`run_as: "root"`) keeps it for
/// file ownership only and cannot load modules, make device nodes, read raw memory or override
/// file modes. Only plain system calls on stack values: async-signal-safe.
fn drop_capabilities() -> std::io::Result<()> {
    // SAFETY: clearing the ambient set takes integers only and cannot fail for lack of rights.
    unsafe {
        nix::libc::prctl(
            nix::libc::PR_CAP_AMBIENT,
            nix::libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
    }
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let header = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset(2) reads a version-3 header and two data words that live on this stack
    // frame; lowering every set to empty is always permitted.
    let rc = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_capset,
            &header as *const Header,
            data.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// System calls a confined child never makes successfully (`EPERM`): loading kernel code,
/// reading or writing other processes' memory, the kernel keyrings (`add_key`, `request_key`,
/// `keyctl`: a key the operator holds in `@u` is neither read nor joined, and no key is planted
/// to outlive the child), and the path-based changes of mode, owner and extended attributes
/// that Landlock does not mediate (a child must not open up the operator home by `chmod`);
/// plus, below Landlock ABI 3, path-based `truncate`.
fn denied_syscalls(truncate: bool) -> Vec<u32> {
    use nix::libc as c;
    let mut v = vec![
        c::SYS_init_module,
        c::SYS_finit_module,
        c::SYS_delete_module,
        c::SYS_kexec_load,
        c::SYS_kexec_file_load,
        c::SYS_bpf,
        c::SYS_perf_event_open,
        c::SYS_ptrace,
        c::SYS_process_vm_readv,
        c::SYS_process_vm_writev,
        c::SYS_pidfd_getfd,
        c::SYS_io_uring_setup,
        c::SYS_add_key,
        c::SYS_request_key,
        c::SYS_keyctl,
        c::SYS_fchmodat,
        c::SYS_fchownat,
        c::SYS_setxattr,
        c::SYS_lsetxattr,
        c::SYS_removexattr,
        c::SYS_lremovexattr,
        452, // fchmodat2
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([c::SYS_chmod, c::SYS_chown, c::SYS_lchown]);
    if truncate {
        v.push(c::SYS_truncate);
    }
    v.into_iter().map(|n| n as u32).collect()
}

/// The seccomp filter of a confined child: on a foreign architecture (i386 `int 0x80`
/// included), stop; an x32 system call fails; [`denied_syscalls`] fail with `EPERM`; `socket`
/// fails with `EPERM` unless `allow_inet` and the family is `AF_INET`, `AF_INET6` or
/// `AF_NETLINK` with `NETLINK_ROUTE` (name resolution). Unix-domain sockets are never allowed,
/// so a child cannot connect to the broker's own sockets; `socketpair` stays available for
/// Unix-domain stream and seqpacket pairs (a datagram pair could `sendto` a socket path).
///
/// The system call number is looked up by a balanced binary search over the numbers that are
/// not simply allowed, not a chain of comparisons: when a filter is installed the kernel runs
/// it once for every system call number to learn which ones it always allows (its action
/// cache), so the cost of installing it — paid by every confined start — grows with the
/// longest path through it. A chain of 30 comparisons cost about 175 µs to install here, the
/// search about 50 µs (a test bounds the longest path at 14 instructions).
pub(crate) fn seccomp_socket_filter(
    allow_inet: bool,
    deny_truncate: bool,
) -> Vec<nix::libc::sock_filter> {
    use nix::libc::{AF_INET, AF_INET6, AF_NETLINK, EPERM, sock_filter};
    const LD_W_ABS: u16 = 0x20;
    const JA: u16 = 0x05;
    const JEQ: u16 = 0x15;
    const JGE: u16 = 0x35;
    const RET: u16 = 0x06;
    const ALU_AND: u16 = 0x54;
    const ALLOW: u32 = 0x7fff_0000;
    const KILL_PROCESS: u32 = 0x8000_0000;
    const ERRNO: u32 = 0x0005_0000 | EPERM as u32;
    #[cfg(target_arch = "x86_64")]
    const ARCH: u32 = 0xc000_003e;
    #[cfg(target_arch = "aarch64")]
    const ARCH: u32 = 0xc000_00b7;
    const X32_BIT: u32 = 0x4000_0000;
    /// Where a jump leads: a block known only once the whole program is laid out.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum L {
        Deny,
        Allow,
        Pair,
        Socket,
        Netlink,
    }
    /// The program, and its jumps to blocks (index, the true branch?, block; a `JA` is
    /// recorded as a true branch).
    struct Prog {
        p: Vec<sock_filter>,
        jumps: Vec<(usize, bool, L)>,
    }
    impl Prog {
        fn op(&mut self, code: u16, k: u32) -> usize {
            self.p.push(sock_filter {
                code,
                jt: 0,
                jf: 0,
                k,
            });
            self.p.len() - 1
        }
        /// `nr == k`: to `then`, else the next instruction.
        fn jeq(&mut self, k: u32, then: L) {
            let i = self.op(JEQ, k);
            self.jumps.push((i, true, then));
        }
        /// The search over `special` (sorted by number): each number to its block, every
        /// other number to `Allow`. Ranges of up to three numbers are compared one by one.
        fn search(&mut self, special: &[(u32, L)]) {
            if special.len() <= 3 {
                for &(nr, to) in special {
                    self.jeq(nr, to);
                }
                let i = self.op(JA, 0);
                self.jumps.push((i, true, L::Allow));
                return;
            }
            let mid = special.len() / 2;
            let split = self.op(JGE, special[mid].0);
            self.search(&special[..mid]);
            // The upper half starts here; the program is far below 256 instructions.
            self.p[split].jt = u8::try_from(self.p.len() - split - 1).unwrap_or(u8::MAX);
            self.search(&special[mid..]);
        }
    }
    let mut g = Prog {
        p: Vec::new(),
        jumps: Vec::new(),
    };
    g.op(LD_W_ABS, 4); // arch
    let native = g.op(JEQ, ARCH);
    g.p[native].jt = 1; // native: skip the kill
    g.op(RET, KILL_PROCESS);
    g.op(LD_W_ABS, 0); // nr
    let x32 = g.op(JGE, X32_BIT);
    g.jumps.push((x32, true, L::Deny));
    let mut special: Vec<(u32, L)> = denied_syscalls(deny_truncate)
        .into_iter()
        .map(|nr| (nr, L::Deny))
        .chain([
            (nix::libc::SYS_socketpair as u32, L::Pair),
            (nix::libc::SYS_socket as u32, L::Socket),
        ])
        .collect();
    special.sort_by_key(|&(nr, _)| nr);
    special.dedup_by_key(|&mut (nr, _)| nr);
    g.search(&special);
    // socketpair: Unix-domain stream and seqpacket pairs only (a datagram pair could sendto a
    // path; another family, such as TIPC, would be a socket the namespace checks do not see).
    let pair = g.p.len();
    g.op(LD_W_ABS, 16); // args[0], low 32 bits: the family
    let i = g.op(JEQ, nix::libc::AF_UNIX as u32);
    g.jumps.push((i, false, L::Deny));
    g.op(LD_W_ABS, 24); // args[1], low 32 bits: type | flags
    g.op(ALU_AND, 0xf); // the type
    for t in [nix::libc::SOCK_STREAM, nix::libc::SOCK_SEQPACKET] {
        g.jeq(t as u32, L::Allow);
    }
    let i = g.op(JA, 0);
    g.jumps.push((i, true, L::Deny));
    // socket: by family.
    let socket = g.p.len();
    g.op(LD_W_ABS, 16); // args[0], low 32 bits
    if allow_inet {
        for family in [AF_INET, AF_INET6] {
            g.jeq(family as u32, L::Allow);
        }
        g.jeq(AF_NETLINK as u32, L::Netlink);
    }
    let i = g.op(JA, 0);
    g.jumps.push((i, true, L::Deny));
    // netlink: routing only (name resolution needs it; sock_diag and the rest it does not).
    let netlink = g.p.len();
    g.op(LD_W_ABS, 32); // args[2], low 32 bits: the protocol
    let i = g.op(JEQ, nix::libc::NETLINK_ROUTE as u32);
    g.jumps.push((i, true, L::Allow));
    g.jumps.push((i, false, L::Deny));
    let deny = g.op(RET, ERRNO);
    let allow = g.op(RET, ALLOW);
    let Prog { mut p, jumps } = g;
    for (i, jt, label) in jumps {
        let target = match label {
            L::Deny => deny,
            L::Allow => allow,
            L::Pair => pair,
            L::Socket => socket,
            L::Netlink => netlink,
        };
        // Every target lies ahead of its jump, and the program is far below 256 instructions.
        let off = target - i - 1;
        if p[i].code == JA {
            p[i].k = u32::try_from(off).unwrap_or(u32::MAX);
        } else if jt {
            p[i].jt = u8::try_from(off).unwrap_or(u8::MAX);
        } else {
            p[i].jf = u8::try_from(off).unwrap_or(u8::MAX);
        }
    }
    p
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_namespace_is_made_ready_again_only_as_it_was_made() {
        use super::*;
        if !nix::unistd::geteuid().is_root() || netns_support().is_err() {
            return; // the pool exists only under root, with network namespaces
        }
        // On a thread of its own: making and checking namespaces moves the calling thread.
        std::thread::spawn(|| {
            let plain = make_ready(false).unwrap();
            assert!(still_isolated(&plain.ns));
            // Loopback up and a listener (a web_egress namespace): not taken back.
            let egress = make_ready(true).unwrap();
            assert!(!still_isolated(&egress.ns));
            drop(egress.listener);
            assert!(!still_isolated(&egress.ns), "loopback is still up");
            // A socket still open in it (a process left behind would hold one): not taken
            // back until it is closed.
            let third = make_ready(false).unwrap();
            let held = std::os::unix::net::UnixDatagram::unbound().unwrap();
            assert!(!still_isolated(&third.ns));
            drop(held);
            assert!(still_isolated(&third.ns));
            let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
            assert!(!still_isolated(&third.ns), "a socket pair counts too");
            drop((a, b));
            assert!(still_isolated(&third.ns));
        })
        .join()
        .unwrap();
        iteron_test_support::record!("P9", serde_json::json!({"checked_before_reuse": true}));
    }

    use super::*;

    /// Run the filter on a system call the way the kernel would (the subset of classic BPF the
    /// filter uses).
    fn run(prog: &[nix::libc::sock_filter], arch: u32, nr: u32, arg0: u32) -> u32 {
        run_args(prog, arch, nr, [arg0, 0, 0])
    }

    fn run_args(prog: &[nix::libc::sock_filter], arch: u32, nr: u32, args: [u32; 3]) -> u32 {
        walk(prog, arch, nr, args).0
    }

    /// The filter's answer and how many instructions it ran to reach it.
    fn walk(prog: &[nix::libc::sock_filter], arch: u32, nr: u32, args: [u32; 3]) -> (u32, usize) {
        let mut pc = 0usize;
        let mut acc = 0u32;
        for steps in 1..=prog.len() {
            let i = prog[pc];
            match i.code {
                0x05 => pc += 1 + i.k as usize,
                0x20 => {
                    acc = match i.k {
                        0 => nr,
                        4 => arch,
                        16 => args[0],
                        24 => args[1],
                        32 => args[2],
                        other => panic!("load of offset {other}"),
                    };
                    pc += 1;
                }
                0x54 => {
                    acc &= i.k;
                    pc += 1;
                }
                0x15 | 0x35 => {
                    let hit = if i.code == 0x15 {
                        acc == i.k
                    } else {
                        acc >= i.k
                    };
                    pc += 1 + usize::from(if hit { i.jt } else { i.jf });
                }
                0x06 => return (i.k, steps),
                other => panic!("opcode {other:#x}"),
            }
        }
        panic!("the program did not return")
    }

    #[cfg(target_arch = "x86_64")]
    const NATIVE: u32 = 0xc000_003e;
    #[cfg(target_arch = "aarch64")]
    const NATIVE: u32 = 0xc000_00b7;
    const ALLOW: u32 = 0x7fff_0000;
    const EPERM: u32 = 0x0005_0000 | nix::libc::EPERM as u32;
    const X32_BIT_NR: u32 = 0x4000_0000;
    /// The longest path through the seccomp filter for a system call it decides by number
    /// alone (every one but `socket` and `socketpair`), in instructions: what the kernel's
    /// action cache walks for each number when the filter is installed.
    const MAX_SECCOMP_WALK: usize = 14;

    #[test]
    fn a_root_brokers_namespaces_made_ahead_are_fresh_and_hold_the_proxy_listener() {
        use std::os::unix::fs::MetadataExt;
        if !nix::unistd::geteuid().is_root() || netns_support().is_err() {
            return; // only a root broker keeps namespaces ready
        }
        let ours = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
        let mut seen = Vec::new();
        for egress in [false, true, true] {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let r = loop {
                if let Some(r) = take_ready(egress) {
                    break r;
                }
                assert!(std::time::Instant::now() < deadline, "none made");
                std::thread::sleep(std::time::Duration::from_millis(5));
            };
            // A namespace of its own, never handed out twice.
            let ino = std::fs::File::from(r.ns).metadata().unwrap().ino();
            assert_ne!(ino, ours);
            assert!(!seen.contains(&ino));
            seen.push(ino);
            match r.listener {
                Some(l) => {
                    assert!(egress);
                    assert_eq!(
                        l.local_addr().unwrap(),
                        std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, PROXY_PORT))
                    );
                }
                None => assert!(!egress),
            }
        }
    }

    #[test]
    fn the_seccomp_filter_decides_as_documented() {
        use nix::libc as c;
        for allow_inet in [false, true] {
            let p = seccomp_socket_filter(allow_inet, true);
            // A foreign architecture (i386 int 0x80) is killed; x32 numbers are refused.
            assert_eq!(run(&p, 0x4000_0003, c::SYS_read as u32, 0), 0x8000_0000);
            assert_eq!(run(&p, NATIVE, 0x4000_0000 | 41, 0), EPERM);
            // Ordinary calls pass.
            for nr in [c::SYS_read, c::SYS_write, c::SYS_openat, c::SYS_connect] {
                assert_eq!(run(&p, NATIVE, nr as u32, 0), ALLOW, "{nr}");
            }
            // socketpair: stream and seqpacket (with flags) only.
            let pair = c::SYS_socketpair as u32;
            let unix = c::AF_UNIX as u32;
            let cloexec = c::SOCK_CLOEXEC as u32;
            let stream = c::SOCK_STREAM as u32 | cloexec;
            assert_eq!(run_args(&p, NATIVE, pair, [unix, stream, 0]), ALLOW);
            let seqpacket = c::SOCK_SEQPACKET as u32;
            assert_eq!(run_args(&p, NATIVE, pair, [unix, seqpacket, 0]), ALLOW);
            let dgram = c::SOCK_DGRAM as u32;
            assert_eq!(run_args(&p, NATIVE, pair, [unix, dgram, 0]), EPERM);
            // Any other family: refused, whatever the type.
            for family in [c::AF_TIPC, c::AF_INET, c::AF_NETLINK] {
                assert_eq!(
                    run_args(&p, NATIVE, pair, [family as u32, stream, 0]),
                    EPERM
                );
            }
            for nr in denied_syscalls(true) {
                assert_eq!(run(&p, NATIVE, nr, 0), EPERM, "{nr}");
            }
            // The kernel keyrings, whatever the network policy.
            for nr in [c::SYS_add_key, c::SYS_request_key, c::SYS_keyctl] {
                assert_eq!(run(&p, NATIVE, nr as u32, 0), EPERM, "{nr}");
            }
            let socket = c::SYS_socket as u32;
            assert_eq!(run(&p, NATIVE, socket, c::AF_UNIX as u32), EPERM);
            assert_eq!(run(&p, NATIVE, socket, c::AF_PACKET as u32), EPERM);
            let inet = if allow_inet { ALLOW } else { EPERM };
            for family in [c::AF_INET, c::AF_INET6] {
                assert_eq!(run(&p, NATIVE, socket, family as u32), inet, "{family}");
            }
            let nl = c::AF_NETLINK as u32;
            let route = c::NETLINK_ROUTE as u32;
            assert_eq!(run_args(&p, NATIVE, socket, [nl, 3, route]), inet);
            assert_eq!(
                run_args(&p, NATIVE, socket, [nl, 3, c::NETLINK_SOCK_DIAG as u32]),
                EPERM
            );
        }
        // Every number, the documented decision; the path to it never longer than the bound
        // (only forward jumps: a program of n instructions runs at most n).
        for (allow_inet, truncate) in [(false, false), (false, true), (true, false), (true, true)] {
            let p = seccomp_socket_filter(allow_inet, truncate);
            let denied = denied_syscalls(truncate);
            let mut longest = 0;
            for nr in (0..1024).chain([X32_BIT_NR, X32_BIT_NR | 1, u32::MAX]) {
                let (got, steps) = walk(&p, NATIVE, nr, [0, 0, 0]);
                let by_args = nr == c::SYS_socket as u32 || nr == c::SYS_socketpair as u32;
                if !by_args {
                    let want = if nr >= X32_BIT_NR || denied.contains(&nr) {
                        EPERM
                    } else {
                        ALLOW
                    };
                    assert_eq!(got, want, "{nr}");
                    longest = longest.max(steps);
                }
            }
            assert!(longest <= MAX_SECCOMP_WALK, "{longest}");
        }
        // truncate is refused only when Landlock cannot mediate it.
        let with = seccomp_socket_filter(false, true);
        let without = seccomp_socket_filter(false, false);
        assert_eq!(run(&with, NATIVE, c::SYS_truncate as u32, 0), EPERM);
        assert_eq!(run(&without, NATIVE, c::SYS_truncate as u32, 0), ALLOW);
    }
}
