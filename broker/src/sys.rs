//! The only module of the broker allowed to contain `unsafe` code: the pre-exec hardening of
//! child processes. Every block carries a `// SAFETY:` comment.
//!
//! What runs between `fork` and `exec` may only make async-signal-safe calls and must not
//! allocate; every call below is a plain system call through nix or libc.

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
/// 3. `PR_SET_NO_NEW_PRIVS`: no setuid/file-capability gain through exec;
/// 4. `RLIMIT_CORE = 0`: no core dump of the child's memory;
/// 5. every descriptor ≥ 3 marked close-on-exec (`close_range` with `CLOSE_RANGE_CLOEXEC`), so
///    nothing the broker holds (sockets, credential files) leaks into the child. Descriptors are
///    marked, not closed: std's exec-error pipe must survive until exec.
pub(crate) fn harden_pre_exec(cmd: &mut Command, parent_pid: i32, confine: Option<Prepared>) {
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
        if let Some(c) = &confine {
            for (resource, limit) in &c.rlimits {
                setrlimit(*resource, *limit, *limit).map_err(std::io::Error::from)?;
            }
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
            if let Some(prog) = &c.seccomp {
                let fprog = nix::libc::sock_fprog {
                    len: prog.len() as u16,
                    filter: prog.as_ptr().cast_mut(),
                };
                // SAFETY: prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog) reads the filter
                // program, which was built before the fork and lives in this (copied) address
                // space until exec; no_new_privs is set, so an unprivileged process may install
                // it. Nothing is allocated here.
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
}

/// Landlock access rights on files and directories (Linux `landlock.h`), by ABI version.
pub(crate) mod landlock {
    pub(crate) const EXECUTE: u64 = 1 << 0;
    pub(crate) const WRITE_FILE: u64 = 1 << 1;
    pub(crate) const READ_FILE: u64 = 1 << 2;
    pub(crate) const READ_DIR: u64 = 1 << 3;
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
}

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
    };
    // ABI 1-3 know only the first field; from 4 on, both.
    let size = if abi >= 4 {
        std::mem::size_of::<RulesetAttr>()
    } else {
        std::mem::size_of::<u64>()
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
pub(crate) fn landlock_allow(ruleset: &OwnedFd, path: &Path, access: u64) -> std::io::Result<()> {
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags_path()
        .open(path)?;
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

trait PathOpen {
    fn custom_flags_path(&mut self) -> &mut Self;
}

impl PathOpen for std::fs::OpenOptions {
    fn custom_flags_path(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(nix::libc::O_PATH | nix::libc::O_CLOEXEC)
    }
}

/// The seccomp filter of a confined child: on a foreign architecture or an x32 system call,
/// stop; `io_uring_setup` (which could create sockets behind the filter) fails with `EPERM`;
/// `socket` fails with `EPERM` unless `allow_inet` and the family is `AF_INET`, `AF_INET6` or
/// `AF_NETLINK` (name resolution). Unix-domain sockets are never allowed, so a child cannot
/// connect to the broker's own sockets; `socketpair` stays available.
pub(crate) fn seccomp_socket_filter(allow_inet: bool) -> Vec<nix::libc::sock_filter> {
    use nix::libc::{AF_INET, AF_INET6, AF_NETLINK, EPERM, sock_filter};
    const LD_W_ABS: u16 = 0x20;
    const JEQ: u16 = 0x15;
    const JGE: u16 = 0x35;
    const RET: u16 = 0x06;
    const ALLOW: u32 = 0x7fff_0000;
    const KILL_PROCESS: u32 = 0x8000_0000;
    const ERRNO: u32 = 0x0005_0000 | EPERM as u32;
    #[cfg(target_arch = "x86_64")]
    const ARCH: u32 = 0xc000_003e;
    #[cfg(target_arch = "aarch64")]
    const ARCH: u32 = 0xc000_00b7;
    const X32_BIT: u32 = 0x4000_0000;
    let op = |code: u16, jt: u8, jf: u8, k: u32| sock_filter { code, jt, jf, k };
    let mut p = vec![
        op(LD_W_ABS, 0, 0, 4),                               // 0: arch
        op(JEQ, 1, 0, ARCH),                                 // 1: native → 3
        op(RET, 0, 0, KILL_PROCESS),                         // 2
        op(LD_W_ABS, 0, 0, 0),                               // 3: nr
        op(JGE, 0, 1, X32_BIT),                              // 4: x32 → 5, else 6
        op(RET, 0, 0, ERRNO),                                // 5
        op(JEQ, 0, 1, nix::libc::SYS_io_uring_setup as u32), // 6: → 7, else 8
        op(RET, 0, 0, ERRNO),                                // 7
        op(JEQ, 1, 0, nix::libc::SYS_socket as u32),         // 8: socket → 10
        op(RET, 0, 0, ALLOW),                                // 9
        op(LD_W_ABS, 0, 0, 16),                              // 10: args[0], low 32 bits
    ];
    if allow_inet {
        p.extend([
            op(JEQ, 3, 0, AF_INET as u32),    // 11 → 15
            op(JEQ, 2, 0, AF_INET6 as u32),   // 12 → 15
            op(JEQ, 1, 0, AF_NETLINK as u32), // 13 → 15
            op(RET, 0, 0, ERRNO),             // 14
            op(RET, 0, 0, ALLOW),             // 15
        ]);
    } else {
        p.push(op(RET, 0, 0, ERRNO)); // 11
    }
    p
}
