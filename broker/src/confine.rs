//! Confinement of every child the broker spawns (stdio servers and hooks).
//!
//! - **Filesystem** (Landlock, an allow-list): read and execute beneath the system directories
//!   ([`SYSTEM_READ`]), the command's own install tree ([`install_tree`]) and what the operator
//!   granted; read and write beneath a private per-child scratch directory (exported as
//!   `TMPDIR`) and what the operator granted writable; a few device files. The operator home
//!   (`$ITERON_HOME`) is never granted: where a grant would contain it, the grant is replaced by
//!   grants on its siblings, level by level down to the home ([`expand`]), so the home and
//!   everything in it stay out of reach. A grant inside the home is dropped.
//! - **Network** (seccomp, plus Landlock TCP rules from ABI 4): no socket of any family unless
//!   the server's admitted classes include `web_egress` (then IPv4, IPv6 and netlink only).
//!   Unix-domain sockets are never allowed, so a child cannot reach the broker's sockets.
//!   Every child also runs in a **network namespace of its own** where the kernel allows it
//!   (under a broker that is not root, inside a user namespace that owns it): its only
//!   interface is loopback, down — except for a `web_egress` server, whose loopback is up and
//!   holds one listener, `127.0.0.1:`[`PROXY_PORT`], served by the broker ([`crate::egress`]):
//!   the server's only way out, every destination judged by the zone rules. Where namespaces
//!   are unavailable a `web_egress` server does not start, unless the operator set
//!   `sandbox.network: "host"` ([`NetState::Host`], shown as unconfined).
//! - **Identity**: under a root broker a child runs as uid and gid 65534 (`nobody`) with no
//!   supplementary groups, unless the operator's `run_as` says `root` or names a dedicated
//!   `UID:GID` ([`identity`]); so root-only files stay closed to it whatever Landlock grants.
//!   The secret files of `/etc` ([`ETC_SECRETS`]) are denied by Landlock to any child their
//!   modes would not keep out, so even a `run_as: "root"` child cannot read `/etc/shadow`.
//! - **Keyrings**: `add_key`, `request_key` and `keyctl` are refused (seccomp), and the child
//!   joins a fresh anonymous session keyring.
//! - **Resources**: open files and data size bounded by `setrlimit`; `no_new_privs` (no setuid
//!   gain through exec), no core dumps, no inherited descriptors, a new session — see
//!   [`crate::sys::harden_pre_exec`].
//!
//! Best effort where the kernel lacks a feature: without Landlock the filesystem is not
//! confined and [`Effective`] says so (shown by `iteron mcp get` and `doctor`).
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::sys::{self, Prepared, landlock};

mod memo;
pub(crate) use memo::memoized;
use memo::{canonical, exists, is_dir, is_file, lmeta, meta};

pub use crate::sys::PROXY_PORT;
pub use iteron_policy::config::{NOBODY_ID, RunAs, SandboxNetwork};
pub use iteron_policy::egress::EgressRule;

/// Directories a normal program reads (and executes from).
pub const SYSTEM_READ: &[&str] = &[
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/bin",
    "/sbin",
    "/etc",
    "/opt",
    "/proc",
    "/sys",
    // Where `/etc/resolv.conf` points on systemd-resolved and resolvconf systems.
    "/run/systemd/resolve",
    "/run/resolvconf",
];
/// Root-only secrets beneath the granted `/etc`: password and group shadow files (and their
/// backups), sudo policy, TLS and SSH host private keys, systemd credential stores. Landlock
/// denies them to every child that could otherwise open them — one that keeps uid 0
/// (`run_as: "root"`) or the broker's own uid and groups (a broker that is not root: its
/// groups may include `shadow` or `ssl-cert`); a child switched to `nobody` or a dedicated
/// uid, with no groups, is denied them by their modes (checked: if a mode would let its uid or
/// gid in, Landlock denies it too).
pub const ETC_SECRETS: &[&str] = &[
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/security/opasswd",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssl/private",
    "/etc/ssh/ssh_host_rsa_key",
    "/etc/ssh/ssh_host_ecdsa_key",
    "/etc/ssh/ssh_host_ed25519_key",
    "/etc/ssh/ssh_host_dsa_key",
    "/etc/credstore",
    "/etc/credstore.encrypted",
];
/// Device files a program may read.
pub const DEVICES_READ: &[&str] = &["/dev/zero", "/dev/urandom", "/dev/random", "/dev/full"];
/// Device files a program may read and write.
pub const DEVICES_RW: &[&str] = &["/dev/null"];
/// Default bound on open files.
pub const DEFAULT_OPEN_FILES: u64 = 4096;
/// Default bound on the data segment and private writable mappings (8 GiB).
pub const DEFAULT_DATA_BYTES: u64 = 8 << 30;

/// What one child may touch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spec {
    /// Never reachable (the operator home), whatever else is granted.
    pub deny: Vec<PathBuf>,
    /// Read and execute beneath these.
    pub readable: Vec<PathBuf>,
    /// Read and write beneath these.
    pub writable: Vec<PathBuf>,
    /// Sockets for IPv4/IPv6 allowed (the server is admitted `web_egress`).
    pub network: bool,
    /// `RLIMIT_NOFILE`.
    pub open_files: u64,
    /// `RLIMIT_DATA` in bytes.
    pub data_bytes: u64,
    /// `RLIMIT_NPROC` (every process of the uid counts), if the operator set one.
    pub processes: Option<u64>,
    /// Who the child runs as under a root broker (default: `nobody`).
    pub run_as: RunAs,
    /// Where its sockets lead when `network` is set (default: its own namespace, out only
    /// through the broker's egress path).
    pub net_mode: SandboxNetwork,
    /// Destinations above the public zone its egress path may reach (`sandbox.egress`).
    pub egress: Vec<EgressRule>,
}

/// The network a child gets, as planned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetState {
    /// No socket; its own network namespace, loopback down.
    Isolated,
    /// No socket (seccomp); this system offers no network namespace (the reason).
    NoNamespace(String),
    /// `web_egress`: its own network namespace, out only through the broker's egress path.
    Egress,
    /// `web_egress` with `sandbox.network: "host"`: the network as the host sees it.
    Host,
    /// `web_egress` needs a network namespace this system does not offer (the reason): the
    /// server is not started.
    Refused(String),
}

impl NetState {
    /// The plan for a child with (`network`) or without sockets in `mode`, on a system whose
    /// namespace support is `support`.
    pub fn plan(network: bool, mode: SandboxNetwork, support: Result<(), String>) -> NetState {
        match (network, mode, support) {
            (true, SandboxNetwork::Host, _) => NetState::Host,
            (true, SandboxNetwork::Namespace, Ok(())) => NetState::Egress,
            (true, SandboxNetwork::Namespace, Err(why)) => NetState::Refused(why),
            (false, _, Ok(())) => NetState::Isolated,
            (false, _, Err(why)) => NetState::NoNamespace(why),
        }
    }

    /// Whether the child enters a namespace of its own.
    pub fn own_namespace(&self) -> bool {
        matches!(self, NetState::Isolated | NetState::Egress)
    }
}

/// The uid and gid a child runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Whether the broker switches to them (then with no supplementary groups); `false`: the
    /// child keeps the broker's own uid, gid and groups.
    pub switched: bool,
}

/// Why a `run_as` cannot be honoured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityError {
    /// A `UID:GID` other than the broker's own, but the broker is not root.
    NeedsRoot,
}

impl std::fmt::Display for IdentityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IdentityError::NeedsRoot => f.write_str(
                "run_as names a uid:gid other than the broker's own, and only a root broker can change uid",
            ),
        }
    }
}

/// Who a child with this `run_as` runs as under a broker whose effective uid and gid are
/// `euid`/`egid`. A root broker switches to `nobody` (65534) unless told `root` (keep uid 0) or
/// a `UID:GID`; a broker that is not root cannot switch: its children keep its uid, and a
/// `UID:GID` other than its own is refused (fail closed, never silently ignored).
pub fn identity_for(run_as: RunAs, euid: u32, egid: u32) -> Result<Identity, IdentityError> {
    let keep = Identity {
        uid: euid,
        gid: egid,
        switched: false,
    };
    let to = |uid, gid| Identity {
        uid,
        gid,
        switched: true,
    };
    match (euid == 0, run_as) {
        (_, RunAs::Root) => Ok(keep),
        (true, RunAs::Nobody) => Ok(to(NOBODY_ID, NOBODY_ID)),
        (true, RunAs::Ids { uid, gid }) => Ok(to(uid, gid)),
        (false, RunAs::Nobody) => Ok(keep),
        (false, RunAs::Ids { uid, gid }) if uid == euid && gid == egid => Ok(keep),
        (false, RunAs::Ids { .. }) => Err(IdentityError::NeedsRoot),
    }
}

/// [`identity_for`] this process.
pub fn identity(run_as: RunAs) -> Result<Identity, IdentityError> {
    identity_for(
        run_as,
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    )
}

/// What was actually enforced, for diagnostics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effective {
    /// The Landlock ABI in force, or `None` (filesystem not confined: the kernel lacks it).
    pub landlock_abi: Option<u32>,
    /// Readable roots after expansion.
    pub readable: Vec<PathBuf>,
    /// Writable roots after expansion.
    pub writable: Vec<PathBuf>,
    /// Never reachable.
    pub denied: Vec<PathBuf>,
    /// Network allowed (sockets of IPv4, IPv6 and routing netlink).
    pub network: bool,
    /// Where its network leads.
    pub net: NetState,
    /// Destinations above the public zone its egress path may reach.
    pub egress: Vec<EgressRule>,
    /// Grants that were dropped (inside the home, or missing), with why.
    pub dropped: Vec<(PathBuf, &'static str)>,
    /// Who the child runs as, or why its `run_as` cannot be honoured (it is then not started).
    pub identity: Result<Identity, IdentityError>,
    /// Grants (and the command) the child's uid cannot reach by their file modes, with why:
    /// Landlock allows them, but the child will be refused (a path under `/root` for `nobody`).
    pub unreachable: Vec<(PathBuf, &'static str)>,
}

impl Effective {
    /// The JSON shown by `iteron mcp get` and `doctor`.
    pub fn to_json(&self) -> Value {
        let list = |v: &[PathBuf]| -> Vec<String> {
            v.iter()
                .map(|p| iteron_policy::text::single_line_capped(&p.to_string_lossy(), 300))
                .collect()
        };
        json!({
            "filesystem": match self.landlock_abi {
                Some(abi) => format!("landlock ABI {abi}: enforced"),
                None => "not confined: this kernel has no Landlock".to_owned(),
            },
            "network": self.network_words(),
            "network_namespace": self.net.own_namespace(),
            "egress": self.egress.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "runs_as": self.runs_as(),
            "readable": list(&self.readable),
            "writable": list(&self.writable),
            "denied": list(&self.denied),
            "unreachable": self.unreachable.iter().map(|(p, why)| json!({
                "path": iteron_policy::text::single_line_capped(&p.to_string_lossy(), 300),
                "why": why,
            })).collect::<Vec<_>>(),
        })
    }

    /// The network the child gets, in words (`iteron mcp get`, `doctor`).
    pub fn network_words(&self) -> String {
        let named = match self.egress.len() {
            0 => String::new(),
            n => format!(" and {n} destination(s) sandbox.egress names"),
        };
        match &self.net {
            NetState::Isolated => {
                "denied: no sockets (seccomp), no TCP (landlock), its own network namespace with loopback down".to_owned()
            }
            NetState::NoNamespace(why) => format!(
                "denied: no sockets (seccomp) and no TCP (landlock); no network namespace ({why})"
            ),
            NetState::Egress => format!(
                "egress only through the broker: its own network namespace, an HTTP CONNECT and \
                 plain-HTTP proxy at 127.0.0.1:{PROXY_PORT} (HTTP_PROXY, HTTPS_PROXY) \
                 reaching the public zone{named}; every destination judged by the zone rules"
            ),
            NetState::Host => "UNCONFINED (sandbox.network \"host\"): the network as the host sees it; IPv4, IPv6, netlink; no Unix-domain sockets".to_owned(),
            NetState::Refused(why) => format!(
                "cannot start: web_egress needs a network namespace and this system offers none ({why}); set sandbox.network \"host\" to run it unconfined"
            ),
        }
    }

    /// Who the child runs as, in words (`iteron mcp get`, `doctor`).
    pub fn runs_as(&self) -> String {
        match &self.identity {
            Ok(Identity {
                uid,
                gid,
                switched: true,
            }) => format!("uid {uid}, gid {gid}, no supplementary groups"),
            Ok(Identity { uid, gid, .. }) if *uid == 0 => {
                format!("uid 0, gid {gid} (root: run_as \"root\"), no capabilities")
            }
            Ok(Identity { uid, gid, .. }) => {
                format!("uid {uid}, gid {gid} (the broker's own: it is not root)")
            }
            Err(e) => format!("cannot start: {e}"),
        }
    }
}

/// Whether `uid`/`gid` (no supplementary groups) may reach `path` by its mode bits: search on
/// every directory above it, and read (and search, for a directory) or write on it. ACLs and
/// mandatory access control are not consulted: an answer of `false` is a warning, not a proof.
pub fn reachable_by(path: &Path, uid: u32, gid: u32, write: bool) -> bool {
    let want = if write { 0o2 } else { 0o4 };
    mode_walk(path, uid, gid, |m, allows| {
        allows(m, want) && (!m.is_dir() || allows(m, 0o1))
    })
}

/// Whether `uid`/`gid` (no supplementary groups) might open `path` or, for a directory,
/// something beneath it, by mode bits (search on the directory is enough: a name inside may be
/// known). Conservative: `true` also when a file beneath turns out unreadable.
fn exposed_to(path: &Path, uid: u32, gid: u32) -> bool {
    mode_walk(path, uid, gid, |m, allows| {
        if m.is_dir() {
            allows(m, 0o1)
        } else {
            allows(m, 0o4)
        }
    })
}

type Allows = dyn Fn(&std::fs::Metadata, u32) -> bool;

/// Search on every directory above `path` for `uid`/`gid`, then `last` on `path` itself.
fn mode_walk(
    path: &Path,
    uid: u32,
    gid: u32,
    last: impl Fn(&std::fs::Metadata, &Allows) -> bool,
) -> bool {
    use std::os::unix::fs::MetadataExt;
    if uid == 0 {
        return true;
    }
    let allows = move |m: &std::fs::Metadata, bit: u32| -> bool {
        let shift = if m.uid() == uid {
            6
        } else if m.gid() == gid {
            3
        } else {
            0
        };
        m.mode() & (bit << shift) != 0
    };
    let Some(real) = canonical(path) else {
        return false;
    };
    for dir in real.ancestors().skip(1) {
        match meta(dir) {
            Some(m) if allows(&m, 0o1) => {}
            _ => return false,
        }
    }
    meta(&real).is_some_and(|m| last(&m, &allows))
}

/// Replace `grant` by grants that cover everything beneath it except the `deny` paths: if a
/// denied path lies beneath `grant`, grant each sibling on the way down instead.
pub fn expand(grant: &Path, deny: &[PathBuf]) -> Vec<PathBuf> {
    if deny.iter().any(|d| grant.starts_with(d)) {
        return Vec::new();
    }
    if !deny.iter().any(|d| d.starts_with(grant)) {
        return vec![grant.to_path_buf()];
    }
    let Ok(rd) = std::fs::read_dir(grant) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    entries.sort();
    for e in entries {
        // Symlinks are not followed here: a link is granted as what it points to only if that
        // target is granted on its own.
        if std::fs::symlink_metadata(&e).is_ok_and(|m| m.file_type().is_symlink()) {
            continue;
        }
        out.extend(expand(&e, deny));
    }
    out
}

/// The install tree of a command: for every absolute path among the command and its
/// arguments that exists (symlinks resolved), its directory, and for a program in a `bin`
/// directory that directory's parent (the installation prefix, e.g. a pyenv or nvm version;
/// never `/` or `$HOME`); a Python virtual environment's root (a `bin` directory beside
/// `pyvenv.cfg`); and every `node_modules` directory in the ancestors of those directories
/// (where Node resolves packages from).
///
/// A directory that holds a path the child is denied (`deny`, and what is denied to every
/// child) is nobody's install tree — a program in `/tmp` beside the operator home, say: only
/// the file itself is granted there. Granting the directory would hand the child everything
/// else in it, and need one Landlock rule per entry to leave the denied path out.
pub fn install_tree(command: &Path, args: &[String], deny: &[PathBuf]) -> Vec<PathBuf> {
    let deny: Vec<PathBuf> = deny
        .iter()
        .chain(ALWAYS_DENIED.get().into_iter().flatten())
        .map(|d| canonical(d).unwrap_or_else(|| d.clone()))
        .collect();
    let holds_denied = |p: &Path| deny.iter().any(|d| d.starts_with(p));
    let mut out: Vec<PathBuf> = Vec::new();
    // A script's interpreter (`#!/path/to/python`) is part of what it runs.
    let interpreter = shebang(command).map(PathBuf::from);
    let candidates = std::iter::once(command.to_path_buf())
        .chain(interpreter)
        .chain(
            args.iter()
                .filter(|a| a.starts_with('/'))
                .map(PathBuf::from),
        );
    for c in candidates {
        let Some(real) = canonical(&c) else { continue };
        let dir = if is_dir(&real) {
            real.clone()
        } else {
            match real.parent() {
                Some(d) => d.to_path_buf(),
                None => continue,
            }
        };
        if dir == Path::new("/") {
            continue;
        }
        if is_home_or_above(&dir) || holds_denied(&dir) {
            // A file directly in the home (or above it), or beside a denied path: grant the
            // file, not the directory.
            if is_file(&real) {
                out.push(real.clone());
            }
            continue;
        }
        out.push(dir.clone());
        // A program in `<prefix>/bin` reads its own `<prefix>/lib`, `<prefix>/share`, …: the
        // prefix is its install tree (never `/` or the user's home directory itself).
        if dir.ends_with("bin")
            && let Some(prefix) = dir.parent()
            && prefix != Path::new("/")
            && !is_home_or_above(prefix)
            && !holds_denied(prefix)
        {
            out.push(prefix.to_path_buf());
        }
        // The unresolved command path too (a venv's bin/python is a symlink to the system's).
        if let Some(parent) = c.parent().filter(|p| *p != Path::new("/"))
            && parent.ends_with("bin")
            && let Some(venv) = parent.parent()
            && is_file(&venv.join("pyvenv.cfg"))
            && !holds_denied(venv)
        {
            out.push(venv.to_path_buf());
        }
        for a in dir.ancestors().skip(1) {
            let nm = a.join("node_modules");
            if is_dir(&nm) && !holds_denied(&nm) {
                out.push(nm);
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Whether `p` is the user's home directory or one of its ancestors (never an install tree:
/// granting it would open every dotfile). Without `$HOME`, every directory directly below `/`
/// and `/home/*` count.
fn is_home_or_above(p: &Path) -> bool {
    match std::env::var_os("HOME").and_then(|h| canonical(Path::new(&h))) {
        Some(home) => home.starts_with(p),
        None => p.parent() == Some(Path::new("/")) || p.parent() == Some(Path::new("/home")),
    }
}

/// The interpreter named by a script's `#!` line, if it is an absolute path.
fn shebang(command: &Path) -> Option<String> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(command).ok()?.read(&mut head).ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = line.split(|b| *b == b'\n').next()?;
    let text = std::str::from_utf8(line).ok()?.trim();
    let first = text.split_whitespace().next()?;
    first.starts_with('/').then(|| first.to_owned())
}

/// Paths denied to every child the process starts from now on, whatever its [`Spec`] says (the
/// broker's `$CREDENTIALS_DIRECTORY`). Set once, at start.
static ALWAYS_DENIED: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();

/// Deny `paths` to every child started from now on. Only the first call counts; `false` if the
/// set was already fixed.
pub fn deny_to_every_child(paths: Vec<PathBuf>) -> bool {
    ALWAYS_DENIED.set(paths).is_ok()
}

/// What a confinement would enforce, without enforcing anything (diagnostics, and the first
/// half of [`prepare`]).
pub fn plan(spec: &Spec) -> Effective {
    memoized(|| plan_with(spec, sys::netns_support()))
}

/// [`plan`] on a system whose network-namespace support is `netns`.
fn plan_with(spec: &Spec, netns: Result<(), String>) -> Effective {
    let identity = identity(spec.run_as);
    // The secrets of /etc (those present) are denied by Landlock to a child that could
    // otherwise open them: one that keeps uid 0 or the broker's groups. A child switched to
    // another uid with no groups is kept out by their modes already, and is spared the cost
    // of granting /etc entry by entry, unless a mode lets its uid or gid in.
    let etc: Vec<PathBuf> = ETC_SECRETS
        .iter()
        .map(PathBuf::from)
        .filter(|p| lmeta(p).is_some())
        .filter(|p| match identity {
            Ok(id) if id.switched && id.uid != 0 => exposed_to(p, id.uid, id.gid),
            _ => true,
        })
        .collect();
    let deny: Vec<PathBuf> = spec
        .deny
        .iter()
        .chain(ALWAYS_DENIED.get().into_iter().flatten())
        .chain(etc.iter())
        .map(|d| canonical(d).unwrap_or_else(|| d.clone()))
        .collect();
    let mut dropped = Vec::new();
    let mut roots = |grants: &[PathBuf]| -> Vec<PathBuf> {
        let mut out = Vec::new();
        for g in grants {
            let Some(real) = canonical(g) else {
                dropped.push((g.clone(), "does not exist"));
                continue;
            };
            if deny.iter().any(|d| real.starts_with(d)) {
                dropped.push((g.clone(), "inside a denied directory"));
                continue;
            }
            out.extend(expand(&real, &deny));
        }
        out.sort();
        out.dedup();
        out
    };
    // System directories a distribution does not have are simply not granted (not "dropped").
    // Asked as a canonical path (one `lstat` per component, remembered), which `roots` below
    // asks again: a separate `stat` for existence would cost one more call per directory.
    let system: Vec<PathBuf> = SYSTEM_READ
        .iter()
        .map(PathBuf::from)
        .filter(|p| canonical(p).is_some())
        .collect();
    let mut readable = roots(&[system, spec.readable.clone()].concat());
    readable.retain(|p| exists(p));
    let writable = roots(&spec.writable);
    let mut unreachable = Vec::new();
    if let Some(id) = identity.ok().filter(|id| id.switched) {
        for (grants, write, why) in [
            (&spec.readable, false, "not readable by the child's uid"),
            (&spec.writable, true, "not writable by the child's uid"),
        ] {
            for g in grants {
                if exists(g) && !reachable_by(g, id.uid, id.gid, write) {
                    unreachable.push((g.clone(), why));
                }
            }
        }
    }
    Effective {
        landlock_abi: sys::landlock_abi(),
        readable,
        writable,
        denied: deny,
        network: spec.network,
        net: NetState::plan(spec.network, spec.net_mode, netns),
        egress: spec.egress.clone(),
        dropped,
        identity,
        unreachable,
    }
}

/// The plan for a stdio server as it would start (its install tree added; the per-start
/// scratch directory is not shown).
pub fn describe(spec: &Spec, command: &Path, args: &[String]) -> Effective {
    memoized(|| describe_memoized(spec, command, args))
}

fn describe_memoized(spec: &Spec, command: &Path, args: &[String]) -> Effective {
    let mut s = spec.clone();
    s.readable.extend(install_tree(command, args, &spec.deny));
    let mut e = plan(&s);
    if let Some(id) = e.identity.ok().filter(|id| id.switched)
        && !reachable_by(command, id.uid, id.gid, false)
    {
        e.unreachable.insert(
            0,
            (
                command.to_path_buf(),
                "the command is not readable by the child's uid",
            ),
        );
    }
    e
}

/// Add a rule; a path that vanished since planning (another process removed it) simply gets
/// none — there is nothing left to grant.
fn allow_if_present(
    rs: &std::os::fd::OwnedFd,
    p: &Path,
    access: u64,
    forbidden: &[(u64, u64)],
) -> std::io::Result<()> {
    match sys::landlock_allow(rs, p, access, forbidden) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// The paths that need a Landlock rule of their own: a path beneath a directory granted as
/// much already needs none (a rule covers its whole tree), such as `/usr/bin` under `/usr`
/// where `/bin` led. Each rule skipped saves an open, a stat and a system call on every
/// confined start; the plan (what `mcp get` shows) keeps every path.
fn rule_paths<'a>(
    readable: &'a [PathBuf],
    writable: &'a [PathBuf],
) -> (Vec<&'a PathBuf>, Vec<&'a PathBuf>) {
    let covered = |p: &Path, by: &[PathBuf]| by.iter().any(|a| a != p && p.starts_with(a));
    (
        readable
            .iter()
            .filter(|p| !covered(p, readable) && !covered(p, writable))
            .collect(),
        writable.iter().filter(|p| !covered(p, writable)).collect(),
    )
}

/// Prepare the confinement of one child (in the parent: this allocates and opens files). For a
/// `web_egress` server in its own namespace, also the broker's end of the channel its proxy
/// listener arrives on ([`crate::sys::receive_proxy_listener`]).
pub(crate) fn prepare(
    spec: &Spec,
) -> std::io::Result<(Prepared, Effective, Option<sys::ProxyListener>)> {
    memoized(|| prepare_with(spec, sys::netns_support()))
}

/// [`prepare`] on a system whose network-namespace support is `netns`.
fn prepare_with(
    spec: &Spec,
    netns: Result<(), String>,
) -> std::io::Result<(Prepared, Effective, Option<sys::ProxyListener>)> {
    let effective = plan_with(spec, netns);
    let id = effective
        .identity
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string()))?;
    let mut give_back = None;
    let (netns, proxy) = match &effective.net {
        NetState::Refused(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                effective.network_words(),
            ));
        }
        // A namespace made ahead of time when one is ready (a root broker), else the child
        // makes its own before exec.
        NetState::Isolated => match sys::take_ready(false) {
            Some(r) => {
                give_back = r.ns.try_clone().ok();
                (Some(sys::NetNs::joining(r.ns)), None)
            }
            None => (Some(sys::NetNs::for_this_process(None)), None),
        },
        NetState::Egress => match sys::take_ready(true) {
            Some(sys::Ready {
                ns,
                listener: Some(l),
            }) => (
                Some(sys::NetNs::joining(ns)),
                Some(sys::ProxyListener::Ready(l)),
            ),
            _ => {
                let (broker_end, child_end) = sys::proxy_channel()?;
                (
                    Some(sys::NetNs::for_this_process(Some(child_end))),
                    Some(sys::ProxyListener::Arrives(broker_end)),
                )
            }
        },
        NetState::NoNamespace(_) | NetState::Host => (None, None),
    };
    let (readable, writable) = (&effective.readable, &effective.writable);
    let abi = effective.landlock_abi;
    let mut prepared = Prepared {
        identity: id.switched.then_some((id.uid, id.gid)),
        ruleset: None,
        seccomp: Some(sys::seccomp_socket_filter(
            spec.network,
            abi.is_none_or(|a| a < 3),
        )),
        rlimits: [
            Some((nix::sys::resource::Resource::RLIMIT_NOFILE, spec.open_files)),
            Some((nix::sys::resource::Resource::RLIMIT_DATA, spec.data_bytes)),
            spec.processes
                .map(|n| (nix::sys::resource::Resource::RLIMIT_NPROC, n)),
        ]
        .into_iter()
        .flatten()
        // A limit above the broker's own hard limit could not be set (EPERM) and would make
        // every start fail: never ask for more than the broker has.
        .map(|(r, n)| {
            let hard = nix::sys::resource::getrlimit(r).map_or(n, |(_, h)| h);
            (r, n.min(hard))
        })
        .collect(),
        netns,
        give_back,
    };
    if let Some(abi) = abi {
        let rs = sys::landlock_ruleset(abi, !spec.network)?;
        // The (device, inode) of each denied path and of every directory above it: no rule may
        // land on one of them, whatever path led there.
        let forbidden: Vec<(u64, u64)> = effective
            .denied
            .iter()
            .flat_map(|d| d.ancestors())
            .filter_map(|a| {
                use std::os::unix::fs::MetadataExt;
                meta(a).map(|m| (m.dev(), m.ino()))
            })
            .collect();
        // Writable grants never include making device nodes or device ioctls.
        let all = landlock::handled_fs(abi)
            & !(landlock::MAKE_CHAR | landlock::MAKE_BLOCK | landlock::IOCTL_DEV);
        let read = landlock::EXECUTE | landlock::READ_FILE | landlock::READ_DIR;
        let (readable, writable) = rule_paths(readable, writable);
        for p in readable {
            let access = if is_dir(p) {
                read
            } else {
                read & landlock::FILE_RIGHTS
            };
            allow_if_present(&rs, p, access, &forbidden)?;
        }
        for p in writable {
            let access = if is_dir(p) {
                all
            } else {
                all & landlock::FILE_RIGHTS
            };
            allow_if_present(&rs, p, access, &forbidden)?;
        }
        // A device this system lacks simply gets no rule (the open itself finds out).
        for d in DEVICES_READ {
            allow_if_present(&rs, Path::new(d), landlock::READ_FILE, &forbidden)?;
        }
        for d in DEVICES_RW {
            let rw = (landlock::READ_FILE | landlock::WRITE_FILE)
                | if abi >= 3 { landlock::TRUNCATE } else { 0 };
            allow_if_present(&rs, Path::new(d), rw, &forbidden)?;
        }
        prepared.ruleset = Some(rs);
    }
    // A namespace is given back for reuse only after a child that could change nothing in it:
    // one under Landlock (no write to `/proc/sys`) as a uid other than 0 (uid 0 writes a
    // network namespace's sysctls without any capability where Landlock does not stop it).
    if prepared.ruleset.is_none() || !id.switched || id.uid == 0 {
        prepared.give_back = None;
    }
    Ok((prepared, effective, proxy))
}

#[cfg(test)]
mod tests;
