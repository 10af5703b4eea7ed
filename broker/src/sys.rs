//! The only module of the broker allowed to contain `unsafe` code: the pre-exec hardening of
//! child processes. Every block carries a `// SAFETY:` comment.
//!
//! What runs between `fork` and `exec` may only make async-signal-safe calls and must not
//! allocate; every call below is a plain system call through nix or libc.

use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::sys::resource::{Resource, setrlimit};
use nix::sys::signal::Signal;

/// Arrange for `cmd`'s child to be hardened just before `exec`:
/// 1. `setsid()`: a new session and process group with no controlling terminal, so the whole
///    group can be signalled and the child cannot read the operator's terminal;
/// 2. `PR_SET_PDEATHSIG(SIGKILL)`, then a check that the parent is still `parent_pid` (if the
///    parent died before the signal was armed, fail rather than run orphaned). The signal fires
///    when the *thread* that forked exits, so callers spawn from one long-lived thread;
/// 3. `PR_SET_NO_NEW_PRIVS`: no setuid/file-capability gain through exec;
/// 4. `RLIMIT_CORE = 0`: no core dump of the child's memory;
/// 5. every descriptor ≥ 3 marked close-on-exec (`close_range` with `CLOSE_RANGE_CLOEXEC`), so
///    nothing the broker holds (sockets, credential files) leaks into the child. Descriptors are
///    marked, not closed: std's exec-error pipe must survive until exec.
pub(crate) fn harden_pre_exec(cmd: &mut Command, parent_pid: i32) {
    let hook = move || -> std::io::Result<()> {
        nix::unistd::setsid().map_err(std::io::Error::from)?;
        nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
        if nix::unistd::getppid().as_raw() != parent_pid {
            return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
        }
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
        Ok(())
    };
    // SAFETY: the hook runs in the forked child before exec. It makes only async-signal-safe
    // system calls (setsid, prctl, getppid, setrlimit, close_range), allocates nothing (the
    // error values are plain integers), and touches no lock the parent could hold.
    unsafe {
        cmd.pre_exec(hook);
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
