//! A confined child's attempts, for real: reading a credential file in the operator home,
//! writing outside the granted directory, a TCP connection to a loopback listener (which must
//! see nothing), a Unix-socket connection, exec of a setuid binary, the kernel keyrings,
//! root-only files under a root broker, and a `setsid` grandchild that would outlive it. Each
//! is denied or ended; the same script unconfined (or with `run_as: "root"`) succeeds where
//! the system allows it, so the test can fail.
//!
//! The directories a child may write are owned by uid 65534 when the tests run as root (the
//! child's uid then), and so is the one it must not write: its denial comes from Landlock.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use iteron_broker::confine::{RunAs, Spec};
use iteron_broker::spawn::{ChildSpec, child_env, spawn};
use iteron_test_support::{give_to_children, is_root};
use serde_json::Value;

#[path = "support/child.rs"]
mod child;
use child::stdout_of;

const PROBE: &str = r#"
import json, os, socket, subprocess, sys, tempfile
home, granted, outside, port, unix_path, setuid = sys.argv[1:7]
out = {}
def attempt(name, f):
    try:
        out[name] = ["ok", f()]
    except Exception as e:
        out[name] = ["denied", type(e).__name__, getattr(e, "errno", None)]
attempt("read_credential", lambda: open(os.path.join(home, "mcp-credentials", "server")).read())
attempt("list_home", lambda: os.listdir(home))
def write(path):
    with open(path, "w") as f:
        f.write("x")
    return path
attempt("write_granted", lambda: write(os.path.join(granted, "ok.txt")))
attempt("write_outside", lambda: write(os.path.join(outside, "escape.txt")))
attempt("write_tmpdir", lambda: write(os.path.join(os.environ["TMPDIR"], "scratch.txt")))
def tcp():
    s = socket.create_connection(("127.0.0.1", int(port)), timeout=2)
    s.close()
    return "connected"
attempt("tcp_loopback", tcp)
def unix():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(unix_path)
    return "connected"
attempt("unix_socket", unix)
attempt("chmod_home", lambda: os.chmod(home, 0o777))
attempt("mknod", lambda: os.mknod(os.path.join(granted, "disk"), 0o600 | 0o060000, os.makedev(8, 0)))
out["cap_eff"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
if setuid:
    attempt("setuid_exec", lambda: subprocess.run([setuid, "-u"], capture_output=True, text=True).stdout.strip())
out["tmpdir"] = os.environ.get("TMPDIR")
import resource
out["limits"] = {name: list(resource.getrlimit(getattr(resource, "RLIMIT_" + name)))
                 for name in ["NOFILE", "DATA", "NPROC", "CORE"]}
out["fds"] = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
print(json.dumps(out))
"#;

struct Fixture {
    base: PathBuf,
}

impl Fixture {
    fn new(name: &str) -> Fixture {
        let base =
            std::env::temp_dir().join(format!("iteron-confine-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        for d in ["home/mcp-credentials", "granted", "outside", "bin"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        for d in ["granted", "outside", "bin"] {
            give_to_children(&base.join(d));
        }
        std::fs::write(
            base.join("home/mcp-credentials/server"),
            "refresh-token-canary",
        )
        .unwrap();
        std::fs::write(base.join("probe.py"), PROBE).unwrap();
        Fixture { base }
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.base.join(rel)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// The uid a confined child runs as by default: 65534 under a root test run, else ours.
fn child_uid() -> u32 {
    if is_root() {
        65534
    } else {
        nix::unistd::geteuid().as_raw()
    }
}

/// The uid a setuid binary of the tests switches to: neither root nor the child's uid, so a
/// gain through exec would show.
const SETUID_TARGET: u32 = 1;

/// A copy of `id` that is setuid to [`SETUID_TARGET`] (only root can make one).
fn setuid_id(dir: &Path) -> Option<PathBuf> {
    if !is_root() {
        return None;
    }
    let dst = dir.join("id-setuid");
    std::fs::copy("/usr/bin/id", &dst).ok()?;
    nix::unistd::chown(&dst, Some(nix::unistd::Uid::from_raw(SETUID_TARGET)), None).ok()?;
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o4755)).ok()?;
    Some(dst)
}

fn run(
    fx: &Fixture,
    confine: Option<Spec>,
    port: u16,
    unix: &Path,
    setuid: Option<&Path>,
) -> Value {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (env, _) = child_env(&[], None, |_: &str| None);
        let args = vec![
            fx.p("probe.py").to_string_lossy().into_owned(),
            fx.p("home").to_string_lossy().into_owned(),
            fx.p("granted").to_string_lossy().into_owned(),
            fx.p("outside").to_string_lossy().into_owned(),
            port.to_string(),
            unix.to_string_lossy().into_owned(),
            setuid
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
        ];
        let (out, child) = stdout_of(ChildSpec {
            command: "/usr/bin/python3".into(),
            args,
            env,
            confine,
            egress: None,
        })
        .await;
        serde_json::from_str(out.trim()).unwrap_or_else(|_| {
            panic!("probe output: {out:?}; stderr: {:?}", child.stderr_tail(10))
        })
    })
}

fn spec(fx: &Fixture) -> Spec {
    Spec {
        deny: vec![fx.p("home")],
        // The probe script lives in the fixture directory, which also holds the home: the
        // grant is expanded to the home's siblings.
        readable: vec![fx.base.clone()],
        writable: vec![fx.p("granted"), fx.p("bin")],
        network: false,
        open_files: 256,
        data_bytes: 1 << 30,
        processes: Some(4096),
        run_as: RunAs::default(),
        net_mode: Default::default(),
        egress: Vec::new(),
    }
}

#[test]
fn a_confined_child_is_denied_the_home_the_network_unix_sockets_and_setuid() {
    let fx = Fixture::new("deny");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let unix_path = fx.p("broker.sock");
    let unix_listener = std::os::unix::net::UnixListener::bind(&unix_path).unwrap();
    unix_listener.set_nonblocking(true).unwrap();
    let setuid = setuid_id(&fx.p("bin"));

    let v = run(&fx, Some(spec(&fx)), port, &unix_path, setuid.as_deref());
    let denied = |k: &str| v[k][0] == "denied";
    assert!(denied("read_credential"), "{v}");
    assert!(denied("list_home"), "{v}");
    assert_eq!(v["write_granted"][0], "ok", "{v}");
    assert!(denied("write_outside"), "{v}");
    assert!(!fx.p("outside/escape.txt").exists());
    assert_eq!(v["write_tmpdir"][0], "ok", "{v}");
    assert!(denied("tcp_loopback"), "{v}");
    assert_eq!(v["tcp_loopback"][2], nix::libc::EPERM, "{v}");
    assert!(denied("unix_socket"), "{v}");
    // Landlock does not mediate chmod: seccomp refuses it, and the home keeps its mode.
    assert!(denied("chmod_home"), "{v}");
    assert_ne!(
        std::fs::metadata(fx.p("home"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o777
    );
    assert!(denied("mknod"), "{v}");
    // No capability survives, even when the broker is root.
    assert_eq!(v["cap_eff"], "0000000000000000", "{v}");
    // Neither listener saw anything.
    assert!(listener.accept().is_err());
    assert!(unix_listener.accept().is_err());
    if setuid.is_some() {
        // no_new_privs: the setuid bit is ignored, the effective uid stays the child's.
        assert_eq!(v["setuid_exec"][1], child_uid().to_string(), "{v}");
    }
    // The resource limits of the spec, and no descriptor but stdin, stdout and stderr (the
    // fourth is the one listing /proc/self/fd).
    assert_eq!(v["limits"]["NOFILE"], serde_json::json!([256, 256]), "{v}");
    assert_eq!(
        v["limits"]["DATA"],
        serde_json::json!([1u64 << 30, 1u64 << 30]),
        "{v}"
    );
    // Never above the broker's own hard limit (it could not be set).
    let (_, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NPROC).unwrap();
    let nproc = 4096.min(hard);
    assert_eq!(
        v["limits"]["NPROC"],
        serde_json::json!([nproc, nproc]),
        "{v}"
    );
    assert_eq!(v["limits"]["CORE"], serde_json::json!([0, 0]), "{v}");
    assert_eq!(v["fds"], serde_json::json!([0, 1, 2, 3]), "{v}");
    // The scratch directory is gone once the child is.
    let tmpdir = PathBuf::from(v["tmpdir"].as_str().unwrap());
    std::thread::sleep(Duration::from_millis(200));
    assert!(!tmpdir.exists(), "the scratch directory outlived the child");

    // The same probe unconfined: the home is readable and the listeners are reached, so the
    // denials above come from the confinement.
    let v = run(&fx, None, port, &unix_path, setuid.as_deref());
    assert_eq!(
        v["read_credential"],
        serde_json::json!(["ok", "refresh-token-canary"]),
        "{v}"
    );
    assert_eq!(v["tcp_loopback"][0], "ok", "{v}");
    assert_eq!(v["write_outside"][0], "ok", "{v}");
    // Every child the broker starts has no_new_privs, confined or not; the control for the
    // setuid binary is a plain exec, which does gain its uid.
    if let Some(id) = &setuid {
        assert_eq!(
            v["setuid_exec"][1],
            nix::unistd::geteuid().as_raw().to_string()
        );
        let plain = std::process::Command::new(id).arg("-u").output().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&plain.stdout).trim(),
            SETUID_TARGET.to_string()
        );
    }
    let mut accepted = 0;
    for _ in 0..50 {
        if listener.accept().is_ok() {
            accepted += 1;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(accepted, 1);
    iteron_test_support::record!("P9", serde_json::json!({}),);
}

/// A `web_egress` child opens TCP sockets in a network namespace of its own: the host's
/// loopback listener is out of its reach (its `127.0.0.1` is another loopback), and Unix
/// sockets stay refused. With `sandbox.network: "host"` the same probe reaches the listener,
/// so the refusal comes from the namespace.
#[test]
fn web_egress_gets_its_own_network_namespace_and_never_unix_sockets() {
    let fx = Fixture::new("egress");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let unix_path = fx.p("broker.sock");
    let _unix = std::os::unix::net::UnixListener::bind(&unix_path).unwrap();
    let mut s = spec(&fx);
    s.network = true;
    if iteron_broker::sys::netns_support().is_ok() {
        let v = run(&fx, Some(s.clone()), port, &unix_path, None);
        assert_eq!(v["tcp_loopback"][0], "denied", "{v}");
        assert_eq!(v["tcp_loopback"][2], nix::libc::ECONNREFUSED, "{v}");
        assert_eq!(v["unix_socket"][0], "denied", "{v}");
        assert_eq!(v["read_credential"][0], "denied", "{v}");
        assert!(listener.accept().is_err(), "the host listener was reached");
    }
    s.net_mode = iteron_broker::confine::SandboxNetwork::Host;
    let v = run(&fx, Some(s), port, &unix_path, None);
    assert_eq!(v["tcp_loopback"][0], "ok", "{v}");
    assert_eq!(v["unix_socket"][0], "denied", "{v}");
    assert_eq!(v["read_credential"][0], "denied", "{v}");
    listener.set_nonblocking(false).unwrap();
    let mut buf = [0u8; 1];
    let (mut conn, _) = listener.accept().unwrap();
    let _ = conn.read(&mut buf);
    iteron_test_support::record!(
        "P9",
        serde_json::json!({"namespace": iteron_broker::sys::netns_support().is_ok()}),
    );
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn keyring_probe() -> String {
    repo()
        .join("fixtures/probes/keyring.py")
        .canonicalize()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// Run `keyring.py` unconfined, as the test's own uid (the operator's side of the test).
fn keyring(args: &[&str]) -> String {
    let out = std::process::Command::new("/usr/bin/python3")
        .arg(keyring_probe())
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "keyring.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Removes the test's keys when dropped (a failed run included): from the test's own user
/// keyring and, under root, from uid 65534's, where a confined child would have planted one.
struct KeyCleanup(Vec<String>);

impl Drop for KeyCleanup {
    fn drop(&mut self) {
        use std::os::unix::process::CommandExt;
        for desc in &self.0 {
            let _ = std::process::Command::new("/usr/bin/python3")
                .args([keyring_probe().as_str(), "drop", desc])
                .output();
            if is_root() {
                let _ = std::process::Command::new("/usr/bin/python3")
                    .args([keyring_probe().as_str(), "drop", desc])
                    .uid(65534)
                    .gid(65534)
                    .output();
            }
        }
    }
}

/// Start `command args` as a child (confined by `confine`, or not), read its whole stdout and
/// stop it.
fn output_of(command: &str, args: Vec<String>, confine: Option<Spec>) -> String {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (env, _) = child_env(&[], None, |_: &str| None);
        let (out, child) = stdout_of(ChildSpec {
            command: command.into(),
            args,
            env,
            confine,
            egress: None,
        })
        .await;
        if out.trim().is_empty() {
            panic!("no output; stderr: {:?}", child.stderr_tail(10));
        }
        out
    })
}

/// What a child did with the keyrings (see `fixtures/probes/keyring.py probe`).
fn keyring_attempt(desc: &str, planted: &str, confine: Option<Spec>) -> Value {
    let out = output_of(
        "/usr/bin/python3",
        vec![keyring_probe(), "probe".into(), desc.into(), planted.into()],
        confine,
    );
    serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("probe output: {out:?}"))
}

#[test]
fn the_kernel_keyrings_are_out_of_every_confined_childs_reach() {
    let fx = Fixture::new("keyring");
    let desc = format!("iteron-canary-{}", std::process::id());
    let planted = format!("iteron-planted-{}", std::process::id());
    let canary = "keyring-canary-value-7c1e";
    let _cleanup = KeyCleanup(vec![desc.clone(), planted.clone()]);
    keyring(&["add", &desc, canary]);
    let eperm = serde_json::json!(nix::libc::EPERM);
    // Servers with and without web_egress, as `nobody` and as root (run_as "root", so only
    // the seccomp filter stands between the child and the broker's own user keyring).
    let mut seen = Vec::new();
    for (network, run_as) in [
        (false, RunAs::Nobody),
        (true, RunAs::Nobody),
        (false, RunAs::Root),
        (true, RunAs::Root),
    ] {
        let mut s = spec(&fx);
        s.network = network;
        s.run_as = run_as;
        let v = keyring_attempt(&desc, &planted, Some(s));
        for step in ["user_keyring", "link", "search", "request", "add"] {
            assert_eq!(v[step][1], eperm, "{step} with {network}/{run_as:?}: {v}");
        }
        assert!(v.get("value").is_none(), "{v}");
        assert_eq!(keyring(&["find", &planted]), "0", "a key was planted: {v}");
        seen.push(v);
    }
    // The same probe unconfined reads the operator's key and plants one: the denials above come
    // from the confinement.
    let v = keyring_attempt(&desc, &planted, None);
    assert_eq!(v["value"], canary, "{v}");
    assert_ne!(keyring(&["find", &planted]), "0", "{v}");
    iteron_test_support::record!(
        "P9",
        serde_json::json!({"denied_with": "EPERM", "children": seen.len()}),
    );
}

const IDENTITY_PROBE: &str = r#"
import json, os, sys
shadow, root_only = sys.argv[1:3]
out = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "egid": os.getegid(),
       "groups": os.getgroups()}
def attempt(name, f):
    try:
        out[name] = ["ok", f()]
    except Exception as e:
        out[name] = ["denied", type(e).__name__, getattr(e, "errno", None)]
attempt("shadow", lambda: len(open(shadow).read()))
attempt("root_only", lambda: open(root_only).read())
def reopen_stderr():
    with open("/dev/stderr", "w") as f:
        f.write("reopened\n")
    return "ok"
attempt("reopen_stderr", reopen_stderr)
def tmp():
    with open(os.path.join(os.environ["TMPDIR"], "x"), "w") as f:
        f.write("x")
    return "ok"
attempt("tmpdir", tmp)
out["caps"] = {l.split(":")[0]: l.split()[1] for l in open("/proc/self/status") if l.startswith("Cap")}
print(json.dumps(out))
"#;

#[test]
fn a_root_brokers_child_runs_as_nobody_and_cannot_read_root_only_files() {
    if !is_root() {
        // A broker that is not root cannot change uid (identity_for's unit test covers it).
        eprintln!("skipped: needs root to run children as another uid");
        return;
    }
    let fx = Fixture::new("identity");
    std::fs::write(fx.p("identity.py"), IDENTITY_PROBE).unwrap();
    let root_only = fx.p("granted/root-only");
    std::fs::write(&root_only, "root-only-canary").unwrap();
    std::fs::set_permissions(&root_only, std::fs::Permissions::from_mode(0o600)).unwrap();
    nix::unistd::chown(&root_only, Some(nix::unistd::Uid::from_raw(0)), None).unwrap();
    let run = |confine: Option<Spec>| -> Value {
        let args = vec![
            fx.p("identity.py").to_string_lossy().into_owned(),
            "/etc/shadow".into(),
            root_only.to_string_lossy().into_owned(),
        ];
        let out = output_of("/usr/bin/python3", args, confine);
        serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("probe output: {out:?}"))
    };
    // The default: uid and gid 65534, no supplementary groups, no capability in any set.
    let v = run(Some(spec(&fx)));
    for k in ["uid", "euid", "gid", "egid"] {
        assert_eq!(v[k], 65534, "{k}: {v}");
    }
    assert_eq!(v["groups"], serde_json::json!([]), "{v}");
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(v["caps"][set], "0000000000000000", "{set}: {v}");
    }
    assert_eq!(v["shadow"][0], "denied", "{v}");
    assert_eq!(v["root_only"][0], "denied", "{v}");
    assert_eq!(v["root_only"][2], nix::libc::EACCES, "{v}");
    // What it needs still works for that uid: its scratch directory, its own stdio by path.
    assert_eq!(v["tmpdir"][0], "ok", "{v}");
    assert_eq!(v["reopen_stderr"][0], "ok", "{v}");
    // run_as "root": the root-only file is readable again (so the denial above is the uid's),
    // but /etc/shadow still is not (Landlock: the secrets of /etc are never granted).
    let mut as_root = spec(&fx);
    as_root.run_as = RunAs::Root;
    let r = run(Some(as_root));
    assert_eq!(r["uid"], 0, "{r}");
    assert_eq!(r["caps"]["CapEff"], "0000000000000000", "{r}");
    assert_eq!(
        r["root_only"],
        serde_json::json!(["ok", "root-only-canary"]),
        "{r}"
    );
    assert_eq!(r["shadow"][0], "denied", "{r}");
    // A dedicated uid:gid.
    let mut dedicated = spec(&fx);
    dedicated.run_as = RunAs::Ids {
        uid: 4242,
        gid: 4343,
    };
    let d = run(Some(dedicated));
    assert_eq!(
        (d["uid"].clone(), d["gid"].clone()),
        (4242.into(), 4343.into()),
        "{d}"
    );
    assert_eq!(d["groups"], serde_json::json!([]), "{d}");
    // Unconfined, the same probe reads /etc/shadow: the file is there and readable to root.
    let u = run(None);
    assert_eq!(u["shadow"][0], "ok", "{u}");
    iteron_test_support::record!(
        "P9",
        serde_json::json!({"uid": 65534, "run_as_root_reads_shadow": false}),
    );
}

/// The parent pid of `pid`, if it is alive (a zombie counts: its `/proc` entry remains).
fn ppid_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Whether `pid` is a running `sleep` in a session of its own (the grandchild we started).
fn is_setsid_sleeper(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some((head, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    head.ends_with("(sleep") && f.get(3) == Some(&pid.to_string().as_str()) && f[0] != "Z"
}

#[test]
fn no_setsid_grandchild_outlives_its_stdio_server() {
    let fx = Fixture::new("grandchild");
    // Two escapes: a direct child that setsids, and a double fork (its parent exits at once).
    let script = "setsid sleep 300 </dev/null >/dev/null 2>&1 &\n\
                  direct=$!\n\
                  (setsid sleep 301 </dev/null >/dev/null 2>&1 & echo $! > \"$TMPDIR/df\")\n\
                  echo \"$direct $(cat \"$TMPDIR/df\")\"\n\
                  exec cat";
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (server, pids) = rt.block_on(async {
        use tokio::io::AsyncBufReadExt;
        let (env, _) = child_env(&[], None, |_: &str| None);
        let mut child = spawn(ChildSpec {
            command: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env,
            confine: Some(spec(&fx)),
            egress: None,
        })
        .await
        .unwrap();
        let mut line = String::new();
        tokio::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .await
            .unwrap();
        let pids: Vec<i32> = line
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        assert_eq!(pids.len(), 2, "{line:?}; stderr {:?}", child.stderr_tail(5));
        let server = child.pid();
        // Both are running in sessions of their own, out of reach of a group kill; the
        // orphaned one was re-parented to the server (a subreaper), not to init.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !pids.iter().all(|p| is_setsid_sleeper(*p)) {
            assert!(std::time::Instant::now() < deadline, "{pids:?} never ran");
            std::thread::sleep(Duration::from_millis(20));
        }
        for p in &pids {
            assert_eq!(ppid_of(*p), Some(server), "parent of {p}");
        }
        child.shutdown(Duration::from_millis(500)).await;
        (server, pids)
    });
    // Once the stop returns, both are gone — killed and reaped, not left as zombies.
    for p in &pids {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists(),
            "grandchild {p} of server {server} outlived it (ppid {:?})",
            ppid_of(*p)
        );
    }
    iteron_test_support::record!("P9", serde_json::json!({"grandchildren": pids.len()}),);
}

/// The `Seccomp` and `Seccomp_filters` lines of a child's `/proc/self/status`.
fn seccomp_of(confine: Option<Spec>) -> (String, String) {
    let out = output_of("cat", vec!["/proc/self/status".into()], confine);
    let field = |name: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
            .unwrap_or_default()
    };
    (field("Seccomp:"), field("Seccomp_filters:"))
}

/// Each confined child is under exactly one seccomp filter — inherited from the thread that
/// forks it, not installed again over it — whether or not it may open internet sockets, and a
/// child started without confinement is under none (the forking threads' filters stay theirs).
#[test]
fn a_confined_child_has_exactly_one_seccomp_filter_and_an_unconfined_one_none() {
    let fx = Fixture::new("seccomp-count");
    let mut s = spec(&fx);
    s.net_mode = iteron_broker::confine::SandboxNetwork::Host;
    for network in [false, true, false] {
        s.network = network;
        assert_eq!(
            seccomp_of(Some(s.clone())),
            ("2".to_owned(), "1".to_owned()),
            "network {network}"
        );
    }
    assert_eq!(seccomp_of(None), ("0".to_owned(), "0".to_owned()));
    iteron_test_support::record!("P9", serde_json::json!({"seccomp_filters": 1}));
}
