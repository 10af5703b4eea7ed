//! A `web_egress` server's only way out is the broker's egress path, judged by the zone rules
//! (issue 15). The test builds its own network: a namespace holding test hosts at a private
//! address (10.231.77.2), a link-local one (169.254.77.2) and one the zone rules call public
//! (11.231.77.2: a public-looking address routed, for the test's lifetime, only into that
//! namespace), joined to the host by a veth pair; a DNS responder on loopback with a name
//! answering public, one private (named by `sandbox.egress`), one private (not named) and one
//! answering a mixed public/private set; and a listener on the host's loopback.
//!
//! A probe (a confined stdio child admitted `web_egress`) tries each through its proxy: the
//! loopback, private, link-local, unnamed and mixed destinations are refused (403), their
//! listeners see nothing, and each refusal is counted and audited with host and port only; the
//! public host (by address and by name, by CONNECT and by plain HTTP) and the allow-listed name
//! are reached; a direct connection has no route. The same probe with `sandbox.network: "host"`
//! reaches every listener directly, so the refusals come from the confinement.
//!
//! Needs root (a network namespace, a veth pair and host routes); skipped, saying so, without.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
mod support;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iteron_broker::audit::Event;
use iteron_broker::confine::{
    DEFAULT_DATA_BYTES, DEFAULT_OPEN_FILES, EgressRule, RunAs, SandboxNetwork, Spec,
};
use iteron_broker::egress::{AuditSink, Observer, Route};
use iteron_broker::spawn::{ChildSpec, child_env};
use serde_json::Value;
use support::DnsServer;

#[path = "support/child.rs"]
mod child;
use child::stdout_of;

const PRIVATE: &str = "10.231.77.2";
const HOST_SIDE: &str = "10.231.77.1";
const LINK_LOCAL: &str = "169.254.77.2";
const PUBLIC: &str = "11.231.77.2";
/// The port every refused destination is tried on; the allow-listed name uses the second.
const PORT: u16 = 18_080;
const NAMED_PORT: u16 = 18_081;

/// Accepts on both ports, records `local-address:port` of each connection (one line, flushed),
/// and greets with one line naming it.
const LISTENER: &str = r#"
import socket, sys, threading
log = open(sys.argv[1], "a", buffering=1)
def serve(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        host, p = c.getsockname()
        log.write(f"{host}:{p}\n")
        try:
            c.sendall(f"hello {host}:{p}\n".encode())
        finally:
            c.close()
for p in sys.argv[2:]:
    threading.Thread(target=serve, args=(int(p),), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"#;

/// For each `mode|target` argument: `proxy` (CONNECT through HTTPS_PROXY), `plain` (an
/// absolute-form GET through HTTP_PROXY) or `direct` (a plain connection, `host=ip` mapping
/// names for the unconfined run). Prints one JSON object: target → outcome.
const PROBE: &str = r#"
import json, os, socket, sys
out = {}
def first_line(s):
    data = b""
    while b"\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n")[0].decode(errors="replace").strip()
def via_proxy(target, plain):
    proxy = os.environ["HTTPS_PROXY" if not plain else "HTTP_PROXY"]
    host, port = proxy.rsplit("/", 1)[1].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    if plain:
        s.sendall(f"GET http://{target}/x HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        line = first_line(s)
        return ["ok", line] if line.startswith("hello") else ["refused", line]
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        if not chunk:
            break
        head += chunk
    status = head.split(b"\r\n")[0].decode()
    if " 200 " not in status + " ":
        body = s.recv(4096).decode(errors="replace").strip()
        return ["refused", status, body]
    return ["ok", first_line(s)]
def direct(target, names):
    host, port = target.rsplit(":", 1)
    s = socket.create_connection((names.get(host, host), int(port)), timeout=5)
    s.settimeout(1)
    try:
        return ["ok", first_line(s)]
    except socket.timeout:
        return ["ok", "connected"]
names = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and "|" not in a)
for arg in sys.argv[1:]:
    if "|" not in arg:
        continue
    mode, target = arg.split("|", 1)
    try:
        if mode == "direct":
            out[arg] = direct(target, names)
        else:
            out[arg] = via_proxy(target, mode == "plain")
    except Exception as e:
        out[arg] = ["error", type(e).__name__, getattr(e, "errno", None)]
print(json.dumps(out))
"#;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn sh(args: &[&str]) {
    let st = Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .status()
        .expect("ip (iproute2; tests/netns/setup installs it)");
    assert!(st.success(), "ip {}", args.join(" "));
}

/// The test network: a namespace with the three hosts, the veth pair, the host routes, and
/// the listener inside. Removed on drop.
struct TestNet {
    ns: String,
    veth: String,
    listener: std::process::Child,
    log: PathBuf,
}

impl TestNet {
    fn new(dir: &Path) -> TestNet {
        let id = std::process::id() % 100_000;
        let ns = format!("iteron-eg-{id}");
        let veth = format!("iteg{id}");
        let peer = format!("itep{id}");
        let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        let _ = Command::new("ip").args(["link", "del", &veth]).status();
        sh(&["netns", "add", &ns]);
        sh(&[
            "link", "add", &veth, "type", "veth", "peer", "name", &peer, "netns", &ns,
        ]);
        sh(&["addr", "add", &format!("{HOST_SIDE}/24"), "dev", &veth]);
        sh(&["link", "set", &veth, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", ns.as_str(), "ip"];
            all.extend_from_slice(args);
            sh(&all);
        };
        inside(&["link", "set", "lo", "up"]);
        inside(&["addr", "add", &format!("{PRIVATE}/24"), "dev", &peer]);
        inside(&["addr", "add", &format!("{LINK_LOCAL}/32"), "dev", &peer]);
        inside(&["addr", "add", &format!("{PUBLIC}/32"), "dev", &peer]);
        inside(&["link", "set", &peer, "up"]);
        inside(&["route", "add", "default", "via", HOST_SIDE]);
        for host in [LINK_LOCAL, PUBLIC] {
            sh(&[
                "route",
                "replace",
                &format!("{host}/32"),
                "via",
                PRIVATE,
                "dev",
                &veth,
            ]);
        }
        let log = dir.join("listener.log");
        std::fs::write(&log, "").unwrap();
        std::fs::write(dir.join("listener.py"), LISTENER).unwrap();
        let mut listener = Command::new("ip")
            .args(["netns", "exec", &ns, "/usr/bin/python3"])
            .arg(dir.join("listener.py"))
            .arg(&log)
            .args([PORT.to_string(), NAMED_PORT.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = [0u8; 6];
        std::io::Read::read_exact(listener.stdout.as_mut().unwrap(), &mut ready).unwrap();
        assert_eq!(&ready, b"ready\n");
        TestNet {
            ns,
            veth,
            listener,
            log,
        }
    }

    /// Every `address:port` the listener saw so far.
    fn seen(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        let _ = self.listener.kill();
        let _ = self.listener.wait();
        for host in [LINK_LOCAL, PUBLIC] {
            let _ = Command::new("ip")
                .args(["route", "del", &format!("{host}/32")])
                .status();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth])
            .status();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

fn spec(dir: &Path, mode: SandboxNetwork) -> Spec {
    Spec {
        deny: Vec::new(),
        readable: vec![dir.to_path_buf()],
        writable: Vec::new(),
        network: true,
        open_files: DEFAULT_OPEN_FILES,
        data_bytes: DEFAULT_DATA_BYTES,
        processes: None,
        run_as: RunAs::default(),
        net_mode: mode,
        egress: vec![EgressRule::parse("intranet.test").unwrap()],
    }
}

async fn probe(dir: &Path, confine: Spec, route: Route, targets: &[String]) -> Value {
    let (env, _) = child_env(&[], None, |_: &str| None);
    let mut args = vec![dir.join("probe.py").to_string_lossy().into_owned()];
    args.extend(targets.iter().cloned());
    let (out, child) = stdout_of(ChildSpec {
        command: "/usr/bin/python3".into(),
        args,
        env,
        confine: Some(confine),
        egress: Some(route),
    })
    .await;
    serde_json::from_str(out.trim())
        .unwrap_or_else(|_| panic!("probe output: {out:?}; stderr: {:?}", child.stderr_tail(10)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_egress_server_reaches_only_the_public_zone_and_what_sandbox_egress_names() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: building the test network needs root");
        return;
    }
    iteron_broker::sys::netns_support().expect("network namespaces (this machine has them)");
    let dir = std::env::temp_dir().join(format!("iteron-egress-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(dir.join("probe.py"), PROBE).unwrap();
    let net = TestNet::new(&dir);
    let host_lo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    host_lo.set_nonblocking(true).unwrap();
    let lo = format!("127.0.0.1:{}", host_lo.local_addr().unwrap().port());
    let dns = DnsServer::start().await;
    dns.answer("public.test", &[ip(PUBLIC)]);
    dns.answer("intranet.test", &[ip(PRIVATE)]);
    dns.answer("private.test", &[ip(PRIVATE)]);
    dns.answer("mixed.test", &[ip(PUBLIC), ip(PRIVATE)]);
    dns.answer("metadata.test", &[ip(LINK_LOCAL)]);
    let records = Arc::new(Mutex::new(Vec::<Event>::new()));
    let sink: AuditSink = {
        let r = Arc::clone(&records);
        Arc::new(move |e| r.lock().unwrap().push(e))
    };
    let observer = Arc::new(Observer::new("probe", Some(sink)));
    let route = Route {
        dns: dns.dns(),
        observer: Arc::clone(&observer),
    };
    let refused_targets = [
        lo.clone(),
        format!("{PRIVATE}:{PORT}"),
        format!("{LINK_LOCAL}:{PORT}"),
        format!("private.test:{PORT}"),
        format!("metadata.test:{PORT}"),
        format!("mixed.test:{PORT}"),
    ];
    let mut targets: Vec<String> = refused_targets
        .iter()
        .map(|t| format!("proxy|{t}"))
        .collect();
    targets.push(format!("plain|{PRIVATE}:{PORT}"));
    targets.push(format!("proxy|{PUBLIC}:{PORT}"));
    targets.push(format!("proxy|public.test:{PORT}"));
    targets.push(format!("plain|{PUBLIC}:{PORT}"));
    targets.push(format!("proxy|intranet.test:{NAMED_PORT}"));
    targets.push(format!("direct|{PUBLIC}:{PORT}"));

    let v = probe(
        &dir,
        spec(&dir, SandboxNetwork::Namespace),
        route.clone(),
        &targets,
    )
    .await;
    for t in &refused_targets {
        let got = &v[format!("proxy|{t}")];
        assert_eq!(got[0], "refused", "{t}: {v}");
        assert!(got[1].as_str().unwrap().contains(" 403 "), "{t}: {v}");
    }
    let why = |t: &str| v[format!("proxy|{t}")][2].as_str().unwrap().to_owned();
    assert!(why(&lo).contains("loopback"), "{v}");
    assert!(
        why(&format!("{LINK_LOCAL}:{PORT}")).contains("link_local"),
        "{v}"
    );
    assert!(
        why(&format!("mixed.test:{PORT}")).contains("different zones"),
        "{v}"
    );
    assert!(
        why(&format!("private.test:{PORT}")).contains("private"),
        "{v}"
    );
    assert_eq!(v[format!("plain|{PRIVATE}:{PORT}")][0], "refused", "{v}");
    assert!(
        v[format!("plain|{PRIVATE}:{PORT}")][1]
            .as_str()
            .unwrap()
            .contains(" 403 "),
        "{v}"
    );
    for (t, seen) in [
        (
            format!("proxy|{PUBLIC}:{PORT}"),
            format!("hello {PUBLIC}:{PORT}"),
        ),
        (
            format!("proxy|public.test:{PORT}"),
            format!("hello {PUBLIC}:{PORT}"),
        ),
        (
            format!("plain|{PUBLIC}:{PORT}"),
            format!("hello {PUBLIC}:{PORT}"),
        ),
        (
            format!("proxy|intranet.test:{NAMED_PORT}"),
            format!("hello {PRIVATE}:{NAMED_PORT}"),
        ),
    ] {
        assert_eq!(v[&t], serde_json::json!(["ok", seen]), "{t}: {v}");
    }
    // No route but the proxy: the namespace has no interface to the outside.
    assert_eq!(v[format!("direct|{PUBLIC}:{PORT}")][0], "error", "{v}");
    assert_eq!(
        v[format!("direct|{PUBLIC}:{PORT}")][2],
        nix::libc::ENETUNREACH,
        "{v}"
    );
    // The listeners saw exactly the admitted connections; the host's loopback nothing.
    let mut seen = net.seen();
    seen.sort();
    let mut want = vec![
        format!("{PUBLIC}:{PORT}"),
        format!("{PUBLIC}:{PORT}"),
        format!("{PUBLIC}:{PORT}"),
        format!("{PRIVATE}:{NAMED_PORT}"),
    ];
    want.sort();
    assert_eq!(seen, want);
    assert!(
        host_lo.accept().is_err(),
        "the host's loopback listener was reached"
    );
    // Each refusal counted and audited: the destination's host and port, nothing more.
    assert_eq!(observer.refused(), refused_targets.len() as u64 + 1);
    let recs = records.lock().unwrap().clone();
    assert_eq!(recs.len(), refused_targets.len() + 1);
    for r in &recs {
        assert_eq!(r.kind.as_str(), "egress_refused");
        assert_eq!(r.server.as_deref(), Some("probe"));
        let d = r.detail.as_deref().unwrap();
        assert!(!d.contains("/x") && !d.contains("Host:"), "{d}");
    }
    assert!(
        recs.iter()
            .any(|r| r.detail.as_deref().unwrap().starts_with(&format!("{lo}: "))),
        "{recs:?}"
    );

    // Started again (a root broker now joins a namespace its pool made ahead of time, with the
    // proxy listener already in it): the same judgments.
    let again = [
        format!("proxy|{PRIVATE}:{PORT}"),
        format!("proxy|{PUBLIC}:{PORT}"),
    ];
    let seen_before = net.seen().len();
    let v = probe(
        &dir,
        spec(&dir, SandboxNetwork::Namespace),
        route.clone(),
        &again,
    )
    .await;
    assert_eq!(v[&again[0]][0], "refused", "{v}");
    assert_eq!(
        v[&again[1]],
        serde_json::json!(["ok", format!("hello {PUBLIC}:{PORT}")]),
        "{v}"
    );
    assert_eq!(net.seen().len(), seen_before + 1);
    assert_eq!(observer.refused(), refused_targets.len() as u64 + 2);

    // The same probe with sandbox.network "host" (unconfined network): every listener is
    // reached directly, so each refusal above came from the confinement.
    let names = [
        format!("private.test={PRIVATE}"),
        format!("metadata.test={LINK_LOCAL}"),
        format!("mixed.test={PRIVATE}"),
    ];
    let mut direct: Vec<String> = refused_targets
        .iter()
        .map(|t| format!("direct|{t}"))
        .collect();
    direct.extend(names.iter().cloned());
    let before = net.seen().len();
    let v = probe(&dir, spec(&dir, SandboxNetwork::Host), route, &direct).await;
    for t in &refused_targets {
        assert_eq!(v[format!("direct|{t}")][0], "ok", "{t}: {v}");
    }
    assert_eq!(net.seen().len(), before + refused_targets.len() - 1);
    let mut reached = false;
    for _ in 0..50 {
        if host_lo.accept().is_ok() {
            reached = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        reached,
        "the unconfined probe did not reach the host's loopback"
    );
    drop(net);
    let _ = std::fs::remove_dir_all(&dir);
    iteron_test_support::record!(
        "P9",
        serde_json::json!({"refused": refused_targets.len() + 1}),
    );
    iteron_test_support::record!("P3", serde_json::json!({}),);
}
