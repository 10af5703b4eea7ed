//! Benchmark: the cost of the egress path (issue 15), both halves in one run, alternating so
//! that drift hits every side alike.
//!
//! 1. **Start latency** (spawn + MCP `initialize` + first `tools/list`, then close) of the
//!    minimal stdio fixture: unconfined; confined with `sandbox.network: "host"`; confined
//!    without `web_egress` (its own network namespace, loopback down); confined with
//!    `web_egress` (namespace, loopback up, the proxy listener handed to the broker and served).
//! 2. The same for a real `web_egress` server, `mcp-server-fetch` from the interop farm
//!    (`tests/interop/setup` installs it), and its `fetch` tool call of a page served here,
//!    through the egress path against the same server on the host's network.
//! 3. **Connect + first byte**, measured inside a confined `web_egress` child (this binary
//!    re-executed with `--probe`): `CONNECT 127.0.0.1:PORT` through its egress path (judged:
//!    `127.0.0.1` named by `sandbox.egress`) until the target's first byte, against the same
//!    child with `sandbox.network: "host"` connecting directly. The target is a listener in
//!    this process that writes one byte on accept.
//!
//! Run: `cargo bench -p iteron-broker --bench egress` (`-- --write-docs` regenerates the table
//! in docs/benchmarks.md, and needs the interop farm).
//!
//! Every measured start (of every side alike) waits until the broker's pool of ready
//! namespaces is full again ([`iteron_broker::sys::ready_namespaces_full`]) and then [`PAUSE`]:
//! the pool makes its next namespace once starts have paused, and a start begun the moment
//! that finished runs beside the kernel's remaining work for it (measured: any start, an
//! unconfined one too, then took 0.3–0.6 ms longer), so starting exactly then would charge
//! that to whichever side came next. One row measures starts back to back, the pool refilling
//! under the starts that follow.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark harness: any failure should abort loudly"
)]

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use iteron_broker::confine::{
    DEFAULT_DATA_BYTES, DEFAULT_OPEN_FILES, EgressRule, RunAs, SandboxNetwork, Spec,
};
use iteron_broker::egress::{Observer, Route};
use iteron_broker::mcp::client::{Client, Options};
use iteron_broker::net::Dns;
use iteron_broker::spawn::{ChildSpec, child_env, spawn};
use tokio::io::AsyncReadExt;

#[path = "common/echo_fixture.rs"]
mod echo_fixture;
use echo_fixture::serve;

#[path = "common/docs.rs"]
mod docs;

const SPAWNS: usize = 80;
/// Starts per side of the real server (a Python program: each start takes a few hundred ms).
const FETCH_SPAWNS: usize = 20;
/// `fetch` calls per side.
const FETCH_CALLS: usize = 200;
const CONNECTS: usize = 400;
/// The pause before each measured start, once the pool is full: long enough for the kernel to
/// have finished with the namespace the pool made last.
const PAUSE: std::time::Duration = std::time::Duration::from_millis(15);
const START: &str = "<!-- bench:egress:start -->";
const END: &str = "<!-- bench:egress:end -->";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn confined(home: &std::path::Path, network: bool, mode: SandboxNetwork) -> Spec {
    Spec {
        deny: vec![home.to_path_buf()],
        readable: Vec::new(),
        writable: Vec::new(),
        network,
        open_files: DEFAULT_OPEN_FILES,
        data_bytes: DEFAULT_DATA_BYTES,
        processes: None,
        run_as: RunAs::default(),
        net_mode: mode,
        egress: vec![EgressRule::parse("127.0.0.1").unwrap()],
    }
}

fn route() -> Route {
    Route {
        dns: Dns::System,
        observer: Arc::new(Observer::new("bench", None)),
    }
}

fn child(me: &str, args: Vec<String>, confine: Option<Spec>) -> ChildSpec {
    let (env, _) = child_env(&[], None, |_: &str| None);
    let mut all = vec![];
    all.extend(args);
    ChildSpec {
        command: me.to_owned(),
        args: all,
        env,
        confine,
        egress: Some(route()),
    }
}

/// Wait (at most 2 s) until the pool of ready namespaces is full, then [`PAUSE`].
async fn settle() {
    let until = Instant::now() + std::time::Duration::from_secs(2);
    while !iteron_broker::sys::ready_namespaces_full() && Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    tokio::time::sleep(PAUSE).await;
}

/// The interop farm's `mcp-server-fetch`, if installed.
fn fetch_server() -> Option<String> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/interop/.venv/bin/mcp-server-fetch");
    p.exists().then(|| {
        std::fs::canonicalize(&p)
            .unwrap()
            .to_string_lossy()
            .into_owned()
    })
}

/// A request head from `c`: the bytes up to the blank line (and whatever came with them), or
/// what arrived before the connection ended.
fn read_head(c: &mut std::net::TcpStream) -> Vec<u8> {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    head
}

/// A plain HTTP server on loopback answering every request with one small page.
fn page_server() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let body = "<!doctype html><html><head><title>bench</title></head><body><h1>Bench page</h1>\
                    <p>egress-bench-marker</p></body></html>";
        for mut c in l.incoming().flatten() {
            read_head(&mut c);
            // One write: a response in pieces would meet Nagle's algorithm and delayed ACKs.
            let _ = c.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
        }
    });
    addr
}

/// Whether uid 65534 (a root broker's default `sandbox.run_as`) can reach the fetch server's
/// interpreter by file mode; if not (a pyenv Python under the 0700 `/root`), its confined
/// starts keep root's uid, as the operator would set with `--sandbox-run-as root`.
fn nobody_reaches(program: &str) -> bool {
    use iteron_broker::confine::{NOBODY_ID, reachable_by};
    let python = std::path::Path::new(program).with_file_name("python");
    let python = std::fs::canonicalize(python).unwrap();
    !nix::unistd::geteuid().is_root() || reachable_by(&python, NOBODY_ID, NOBODY_ID, false)
}

async fn start_fetch(program: &str, confine: Option<Spec>) -> (f64, Client) {
    let confine = confine.map(|mut s| {
        if !nobody_reaches(program) {
            s.run_as = RunAs::Root;
        }
        s
    });
    let t = Instant::now();
    let args = vec!["--allow-private-ips".into(), "--ignore-robots-txt".into()];
    let c = Client::connect_stdio(child(program, args, confine), Options::default())
        .await
        .unwrap();
    c.list_tools().await.unwrap();
    (t.elapsed().as_secs_f64() * 1e3, c)
}

/// What constructing one `httpx.AsyncClient` costs the fetch server's Python (median of 30, in
/// ms), with the egress path's proxy variables ([`iteron_broker::egress::proxy_env`]) set or
/// not: the fetch server makes one client per `fetch`, and httpx makes one more transport,
/// with its own TLS context, for each proxy variable.
fn httpx_client_ms(program: &str, with_proxy: bool) -> f64 {
    let python = std::path::Path::new(program).with_file_name("python");
    let script = "import time, httpx\n\
                  t = []\n\
                  for _ in range(30):\n    \
                  a = time.perf_counter(); httpx.AsyncClient(); t.append(time.perf_counter() - a)\n\
                  t.sort(); print(t[15] * 1e3)\n";
    let mut cmd = std::process::Command::new(python);
    cmd.args(["-c", script]).env_clear();
    if with_proxy {
        cmd.envs(iteron_broker::egress::proxy_env());
    }
    let out = cmd.output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("httpx timing: {out:?}"))
}

/// One `fetch` of `url`, timed to its answer (which must hold the page).
async fn fetch_once(c: &Client, url: &str) -> f64 {
    let mut args = serde_json::Map::new();
    args.insert("url".into(), url.into());
    // The page as fetched: without `raw` the server runs a Node.js readability pass per call
    // (hundreds of ms), which would hide what the path costs.
    args.insert("raw".into(), true.into());
    let t = Instant::now();
    let r = c.call_tool("fetch", args).await.unwrap();
    let took = t.elapsed().as_secs_f64() * 1e3;
    assert!(
        !r.is_error && r.text.contains("egress-bench-marker"),
        "fetch answered {:?}",
        r.text
    );
    took
}

async fn start_once(me: &str, confine: Option<Spec>) -> f64 {
    let t = Instant::now();
    let c = Client::connect_stdio(
        child(me, vec!["--serve".into()], confine),
        Options::default(),
    )
    .await
    .unwrap();
    c.list_tools().await.unwrap();
    let took = t.elapsed().as_secs_f64() * 1e3;
    c.close().await;
    took
}

/// The floor for any proxy that makes a second connection: a minimal `CONNECT` relay on this
/// process's loopback, one blocking thread, one connection at a time (the probe's are
/// sequential), no judging, no limits, no runtime. Its address.
fn floor_proxy() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        for mut c in l.incoming().flatten() {
            let head = read_head(&mut c);
            let text = String::from_utf8_lossy(&head);
            let Some(target) = text.split(' ').nth(1) else {
                continue;
            };
            let Ok(mut up) = std::net::TcpStream::connect(target) else {
                continue;
            };
            let _ = (c.set_nodelay(true), up.set_nodelay(true));
            let _ = c.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n");
            // Upstream to client until the target closes (it writes one byte, then closes).
            while let Ok(n) = up.read(&mut buf) {
                if n == 0 || c.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    });
    addr
}

/// In the child: `CONNECTS` connections to `target` — `direct`ly, through the egress path
/// (`proxy`: the `HTTPS_PROXY` the broker set) or through the proxy at `via=ADDR` — each timed
/// from `connect` to the target's first byte; prints the median in µs.
fn probe(target: &str, mode: &str) {
    let mut times = Vec::with_capacity(CONNECTS);
    let proxy = match mode {
        "direct" => None,
        "proxy" => Some(std::env::var("HTTPS_PROXY").unwrap()),
        other => Some(other.strip_prefix("via=").unwrap().to_owned()),
    };
    for _ in 0..CONNECTS + 50 {
        let t = Instant::now();
        let mut byte = [0u8; 1];
        if let Some(proxy) = &proxy {
            let p = proxy.trim_start_matches("http://");
            let mut s = std::net::TcpStream::connect(p).unwrap();
            s.set_nodelay(true).unwrap();
            write!(s, "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").unwrap();
            // The status line and the blank line (as a client reads them: whole reads), then
            // the tunnel's first byte (which may have come in the same read).
            let mut head = Vec::new();
            let mut buf = [0u8; 256];
            let end = loop {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "the proxy closed");
                head.extend_from_slice(&buf[..n]);
                if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
            };
            assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
            if head.len() == end {
                s.read_exact(&mut byte).unwrap();
            }
        } else {
            let mut s = std::net::TcpStream::connect(target).unwrap();
            s.read_exact(&mut byte).unwrap();
        }
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    println!("{:.1}", median(times.split_off(50)));
}

async fn connect_median(me: &str, target: &str, spec: Spec, mode: &str) -> f64 {
    let mut c = spawn(child(
        me,
        vec!["--probe".into(), target.to_owned(), mode.into()],
        Some(spec),
    ))
    .await
    .unwrap();
    drop(c.stdin.take());
    let mut out = String::new();
    c.stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    c.shutdown(std::time::Duration::from_secs(1)).await;
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("probe printed {out:?}: {:?}", c.stderr_tail(5)))
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    match argv.get(1).map(String::as_str) {
        Some("--serve") => return serve(),
        Some("--probe") => return probe(&argv[2], &argv[3]),
        _ => {}
    }
    let write_docs = argv.iter().any(|a| a == "--write-docs");
    iteron_broker::sys::netns_support().expect("this benchmark needs network namespaces");
    let fetch = fetch_server();
    assert!(
        fetch.is_some() || !write_docs,
        "--write-docs needs the interop farm's mcp-server-fetch: run tests/interop/setup"
    );
    let me = std::env::current_exe()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let home =
        std::env::temp_dir().join(format!("iteron-bench-egress-home-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let isolated = confined(&home, false, SandboxNetwork::Namespace);
    let egress = confined(&home, true, SandboxNetwork::Namespace);
    let host = confined(&home, true, SandboxNetwork::Host);
    // The targets: one byte on every accepted connection, at once or after 1 or 5 ms (a stand-in
    // for a destination that is not on this machine).
    let target = |delay: Option<std::time::Duration>| {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for mut c in l.incoming().flatten() {
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                let _ = c.write_all(b"x");
            }
        });
        addr
    };
    let addr = target(None);
    let slow = target(Some(std::time::Duration::from_millis(1)));
    let far = target(Some(std::time::Duration::from_millis(5)));
    let page = format!("http://{}/page.html", page_server());
    // One thread, as the broker runs (`iteron broker serve`).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut plain, mut no_ns, mut own_ns, mut with_proxy) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut plain_b2b, mut own_ns_b2b) = (Vec::new(), Vec::new());
    let (mut fetch_plain, mut fetch_egress) = (Vec::new(), Vec::new());
    let (mut call_host, mut call_egress) = (Vec::new(), Vec::new());
    let (mut client_plain, mut client_proxy) = (Vec::new(), Vec::new());
    let (mut direct, mut proxied, mut floored) = (Vec::new(), Vec::new(), Vec::new());
    let (mut direct_slow, mut proxied_slow) = (Vec::new(), Vec::new());
    let (mut direct_far, mut proxied_far) = (Vec::new(), Vec::new());
    rt.block_on(async {
        for _ in 0..5 {
            start_once(&me, None).await;
            start_once(&me, Some(isolated.clone())).await;
            start_once(&me, Some(egress.clone())).await;
            start_once(&me, Some(host.clone())).await;
        }
        for _ in 0..SPAWNS {
            for (v, spec) in [
                (&mut plain, None),
                (&mut no_ns, Some(host.clone())),
                (&mut own_ns, Some(isolated.clone())),
                (&mut with_proxy, Some(egress.clone())),
            ] {
                settle().await;
                v.push(start_once(&me, spec).await);
            }
        }
        // Back to back: more starts than the pool holds, so it refills under the starts.
        for _ in 0..SPAWNS {
            plain_b2b.push(start_once(&me, None).await);
            own_ns_b2b.push(start_once(&me, Some(isolated.clone())).await);
        }
        if let Some(program) = &fetch {
            // One start of each first: Python's bytecode caches are written by then.
            for spec in [None, Some(egress.clone())] {
                start_fetch(program, spec).await.1.close().await;
            }
            for _ in 0..FETCH_SPAWNS {
                for (v, spec) in [
                    (&mut fetch_plain, None),
                    (&mut fetch_egress, Some(egress.clone())),
                ] {
                    settle().await;
                    let (took, c) = start_fetch(program, spec).await;
                    v.push(took);
                    c.close().await;
                }
            }
            // The tool call: one server of each kind, calls alternating between them.
            let (_, on_host) = start_fetch(program, Some(host.clone())).await;
            let (_, through) = start_fetch(program, Some(egress.clone())).await;
            for _ in 0..5 {
                fetch_once(&on_host, &page).await;
                fetch_once(&through, &page).await;
            }
            for _ in 0..FETCH_CALLS {
                call_host.push(fetch_once(&on_host, &page).await);
                call_egress.push(fetch_once(&through, &page).await);
            }
            on_host.close().await;
            through.close().await;
            for _ in 0..3 {
                client_plain.push(httpx_client_ms(program, false));
                client_proxy.push(httpx_client_ms(program, true));
            }
        }
        let floor = format!("via={}", floor_proxy());
        for _ in 0..3 {
            direct.push(connect_median(&me, &addr, host.clone(), "direct").await);
            proxied.push(connect_median(&me, &addr, egress.clone(), "proxy").await);
            floored.push(connect_median(&me, &addr, host.clone(), &floor).await);
            direct_slow.push(connect_median(&me, &slow, host.clone(), "direct").await);
            proxied_slow.push(connect_median(&me, &slow, egress.clone(), "proxy").await);
            direct_far.push(connect_median(&me, &far, host.clone(), "direct").await);
            proxied_far.push(connect_median(&me, &far, egress.clone(), "proxy").await);
        }
    });
    let _ = std::fs::remove_dir_all(&home);
    let (sp, sh, sn, se) = (
        median(plain),
        median(no_ns),
        median(own_ns),
        median(with_proxy),
    );
    let pause = PAUSE.as_millis();
    let (bp, bn) = (median(plain_b2b), median(own_ns_b2b));
    let (cd, cp, cf) = (median(direct), median(proxied), median(floored));
    let (sd, spx) = (median(direct_slow), median(proxied_slow));
    let (fd, fpx) = (median(direct_far), median(proxied_far));
    let fetch_rows = if fetch.is_some() {
        let (fp, fe) = (median(fetch_plain), median(fetch_egress));
        let (ch, ce) = (median(call_host), median(call_egress));
        let (kp, kx) = (median(client_plain), median(client_proxy));
        format!(
            "| start of `mcp-server-fetch` (Python, the interop farm's), `web_egress` | {fp:.1} ms | {fe:.1} ms | {:.2}× |\n\
             | its `fetch` tool call of a page on loopback: `sandbox.network: \"host\"` vs through the egress path (forwarded `GET`, judged) | {ch:.2} ms | {ce:.2} ms | {:.2}× (+{:.2} ms) |\n\
             | of which, in the server's own Python: one `httpx.AsyncClient()` (one per `fetch`) without vs with the egress path's proxy variables | {kp:.2} ms | {kx:.2} ms | +{:.2} ms |\n",
            fe / fp,
            ce / ch,
            ce - ch,
            kx - kp,
        )
    } else {
        "| `mcp-server-fetch` rows | not measured: the interop farm is not installed (`tests/interop/setup`) | | |\n".to_owned()
    };
    let table = format!(
        "Minimal fixture: {SPAWNS} starts per side, each {pause} ms after the namespace pool is full (every side alike) unless said; `mcp-server-fetch`: {FETCH_SPAWNS} starts \
         per side the same way and {FETCH_CALLS} calls per side; {CONNECTS} connections per run, 3 runs per side (median of the run medians). Medians throughout.\n\n\
         | what | unconfined | confined | ratio |\n|---|---|---|---|\n\
         | start, minimal fixture, `web_egress` with `sandbox.network: \"host\"` (every other confinement, no namespace) | {sp:.2} ms | {sh:.2} ms | {:.2}× |\n\
         | start, minimal fixture, no `web_egress` (own network namespace, loopback down) | {sp:.2} ms | {sn:.2} ms | {:.2}× |\n\
         | start, minimal fixture, `web_egress` (namespace, loopback up, proxy listener handed over and served) | {sp:.2} ms | {se:.2} ms | {:.2}× |\n\
         | start, minimal fixture, no `web_egress`, back to back (the pool refilling under the starts that follow) | {bp:.2} ms | {bn:.2} ms | {:.2}× |\n\
         {fetch_rows}\
         | connect + first byte, loopback target: direct (`sandbox.network: \"host\"`) vs through the egress path (`CONNECT`, judged) | {cd:.1} µs | {cp:.1} µs | {:.2}× (+{:.1} µs) |\n\
         | connect + first byte, loopback target: direct vs through a bare `CONNECT` relay in another process (one blocking thread, no judging: the floor for any proxy) | {cd:.1} µs | {cf:.1} µs | {:.2}× (+{:.1} µs) |\n\
         | connect + first byte, a target answering after 1 ms: direct vs through the egress path | {sd:.1} µs | {spx:.1} µs | {:.2}× (+{:.1} µs) |\n\
         | connect + first byte, a target answering after 5 ms (a nearby public host): direct vs through the egress path | {fd:.1} µs | {fpx:.1} µs | {:.2}× (+{:.1} µs) |\n\n\
         Targets: start ≤ 1.2×; connect + first byte ≤ 1.2×.",
        sh / sp,
        sn / sp,
        se / sp,
        bn / bp,
        cp / cd,
        cp - cd,
        cf / cd,
        cf - cd,
        spx / sd,
        spx - sd,
        fpx / fd,
        fpx - fd,
    );
    println!("{table}");
    if write_docs {
        docs::write_table(START, END, &table);
    }
}
