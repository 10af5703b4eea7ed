//! Benchmark: the cost of the egress path (issue 15), both halves in one run, alternating so
//! that drift hits every side alike.
//!
//! 1. **Start latency** (spawn + MCP `initialize` + first `tools/list`, then close) of the
//!    minimal stdio fixture: unconfined; confined without `web_egress` (its own network
//!    namespace, loopback down); confined with `web_egress` (namespace, loopback up, the proxy
//!    listener handed to the broker and served).
//! 2. **Connect + first byte**, measured inside a confined `web_egress` child (this binary
//!    re-executed with `--probe`): `CONNECT 127.0.0.1:PORT` through its egress path (judged:
//!    `127.0.0.1` named by `sandbox.egress`) until the target's first byte, against the same
//!    child with `sandbox.network: "host"` connecting directly. The target is a listener in
//!    this process that writes one byte on accept.
//!
//! Run: `cargo bench -p iteron-broker --bench egress` (`-- --write-docs` regenerates the table
//! in docs/benchmarks.md).
//!
//! Before each measured start (of every side alike) the benchmark waits until the broker's
//! pool of ready namespaces is full again ([`iteron_broker::sys::ready_namespaces_full`]), as
//! it is when a broker starts a server that is not the latest of a burst; one more row
//! measures starts back to back, the pool refilling under the starts that follow. The four
//! starts are measured a second time, each [`PAUSE`] after the pool is full: in the first set,
//! a start that follows one with a network namespace of its own shares the two cores with the
//! kernel's teardown of that namespace (which begins when its child ends); after the pause it
//! does not, on every side alike.
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

const SPAWNS: usize = 40;
const CONNECTS: usize = 400;
/// The pause before each start of the "after a pause" rows: long enough for the kernel to have
/// torn down the network namespace of the start before (it does so after the child ends).
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

/// Wait (at most 2 s) until the pool of ready namespaces is full.
async fn settle() {
    let until = Instant::now() + std::time::Duration::from_secs(2);
    while !iteron_broker::sys::ready_namespaces_full() && Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
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

/// In the child: `CONNECTS` connections to `target`, through the proxy (`HTTPS_PROXY`) or
/// directly, each timed from `connect` to the target's first byte; prints the median in µs.
fn probe(target: &str, via_proxy: bool) {
    let mut times = Vec::with_capacity(CONNECTS);
    let proxy = std::env::var("HTTPS_PROXY").ok();
    for _ in 0..CONNECTS + 50 {
        let t = Instant::now();
        let mut byte = [0u8; 1];
        if via_proxy {
            let p = proxy.as_deref().unwrap().trim_start_matches("http://");
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

async fn connect_median(me: &str, target: &str, spec: Spec, via_proxy: bool) -> f64 {
    let mode = if via_proxy { "proxy" } else { "direct" };
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
        Some("--probe") => return probe(&argv[2], argv[3] == "proxy"),
        _ => {}
    }
    let write_docs = argv.iter().any(|a| a == "--write-docs");
    iteron_broker::sys::netns_support().expect("this benchmark needs network namespaces");
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
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (mut plain, mut own_ns, mut with_proxy) = (Vec::new(), Vec::new(), Vec::new());
    let mut no_ns = Vec::new();
    let (mut plain_p, mut own_ns_p, mut with_proxy_p, mut no_ns_p) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut plain_b2b, mut own_ns_b2b) = (Vec::new(), Vec::new());
    let (mut direct, mut proxied) = (Vec::new(), Vec::new());
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
            settle().await;
            plain.push(start_once(&me, None).await);
            settle().await;
            own_ns.push(start_once(&me, Some(isolated.clone())).await);
            settle().await;
            with_proxy.push(start_once(&me, Some(egress.clone())).await);
            settle().await;
            no_ns.push(start_once(&me, Some(host.clone())).await);
        }
        // The same four, each after a pause once the pool is full: the start before (a
        // namespace of its own, when it had one) is torn down by then.
        for _ in 0..SPAWNS {
            for (v, spec) in [
                (&mut plain_p, None),
                (&mut own_ns_p, Some(isolated.clone())),
                (&mut with_proxy_p, Some(egress.clone())),
                (&mut no_ns_p, Some(host.clone())),
            ] {
                settle().await;
                tokio::time::sleep(PAUSE).await;
                v.push(start_once(&me, spec).await);
            }
        }
        // Back to back: more starts than the pool holds, so it refills under the starts.
        for _ in 0..SPAWNS {
            plain_b2b.push(start_once(&me, None).await);
            own_ns_b2b.push(start_once(&me, Some(isolated.clone())).await);
        }
        for _ in 0..3 {
            direct.push(connect_median(&me, &addr, host.clone(), false).await);
            proxied.push(connect_median(&me, &addr, egress.clone(), true).await);
            direct_slow.push(connect_median(&me, &slow, host.clone(), false).await);
            proxied_slow.push(connect_median(&me, &slow, egress.clone(), true).await);
            direct_far.push(connect_median(&me, &far, host.clone(), false).await);
            proxied_far.push(connect_median(&me, &far, egress.clone(), true).await);
        }
    });
    let _ = std::fs::remove_dir_all(&home);
    let (sp, sn, se) = (median(plain), median(own_ns), median(with_proxy));
    let sh = median(no_ns);
    let (pp, pn, pe, ph) = (
        median(plain_p),
        median(own_ns_p),
        median(with_proxy_p),
        median(no_ns_p),
    );
    let pause = PAUSE.as_millis();
    let (bp, bn) = (median(plain_b2b), median(own_ns_b2b));
    let (cd, cp) = (median(direct), median(proxied));
    let (sd, spx) = (median(direct_slow), median(proxied_slow));
    let (fd, fpx) = (median(direct_far), median(proxied_far));
    let table = format!(
        "{SPAWNS} starts per side, each with the namespace pool full unless said (the rows with a pause: every side alike); {CONNECTS} connections per run, 3 runs per side (median of \
         the run medians); loopback target.\n\n\
         | what | unconfined | confined | ratio |\n|---|---|---|---|\n\
         | start, `web_egress` with `sandbox.network: \"host\"` (every other confinement, no namespace) | {sp:.2} ms | {sh:.2} ms | {:.2}× |\n\
         | start, no `web_egress` (own network namespace, loopback down) | {sp:.2} ms | {sn:.2} ms | {:.2}× |\n\
         | start, `web_egress` (namespace, loopback up, proxy listener handed over and served) | {sp:.2} ms | {se:.2} ms | {:.2}× |\n\
         | start, `web_egress` with `sandbox.network: \"host\"`, {pause} ms after the pool is full | {pp:.2} ms | {ph:.2} ms | {:.2}× |\n\
         | start, no `web_egress`, {pause} ms after the pool is full | {pp:.2} ms | {pn:.2} ms | {:.2}× |\n\
         | start, `web_egress`, {pause} ms after the pool is full | {pp:.2} ms | {pe:.2} ms | {:.2}× |\n\
         | start, no `web_egress`, back to back (the pool refilling under the starts that follow) | {bp:.2} ms | {bn:.2} ms | {:.2}× |\n\
         | connect + first byte, loopback target: direct (`sandbox.network: \"host\"`) vs through the egress path (`CONNECT`, judged) | {cd:.1} µs | {cp:.1} µs | {:.2}× (+{:.1} µs) |\n\
         | connect + first byte, a target answering after 1 ms: direct vs through the egress path | {sd:.1} µs | {spx:.1} µs | {:.2}× (+{:.1} µs) |\n\
         | connect + first byte, a target answering after 5 ms (a nearby public host): direct vs through the egress path | {fd:.1} µs | {fpx:.1} µs | {:.2}× (+{:.1} µs) |\n\n\
         Targets: start ≤ 1.2×; connect + first byte ≤ 1.2×.",
        sh / sp,
        sn / sp,
        se / sp,
        ph / pp,
        pn / pp,
        pe / pp,
        bn / bp,
        cp / cd,
        cp - cd,
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
