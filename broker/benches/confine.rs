//! Benchmark: the cost of confinement. Spawn latency (spawn + MCP `initialize` + first
//! `tools/list`, then close) of a confined stdio server against the same server unconfined, and
//! `tools/call` round trips once running, both in the same run, alternating so that drift hits
//! both sides alike. The server is this binary re-executed with `--serve` (a minimal echo
//! fixture). The confinement is what the broker applies: Landlock rules for the system
//! directories and the install tree with a denied home, the seccomp socket filter, rlimits.
//!
//! Run: `cargo bench -p iteron-broker --bench confine` (`-- --write-docs` regenerates the table
//! in docs/benchmarks.md).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark harness: any failure should abort loudly"
)]

use std::time::Instant;

use iteron_broker::confine::{DEFAULT_DATA_BYTES, DEFAULT_OPEN_FILES, RunAs, Spec};
use iteron_broker::mcp::client::{Client, Options};
use iteron_broker::spawn::{ChildSpec, child_env};
use serde_json::json;

#[path = "common/echo_fixture.rs"]
mod echo_fixture;
use echo_fixture::serve;

#[path = "common/docs.rs"]
mod docs;

const SPAWNS: usize = 60;
/// The pause before each measured start, once the namespace pool is full.
const PAUSE: std::time::Duration = std::time::Duration::from_millis(15);
const CALLS: usize = 2000;
const START: &str = "<!-- bench:confine:start -->";
const END: &str = "<!-- bench:confine:end -->";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spec(me: &str, confine: Option<Spec>) -> ChildSpec {
    let (env, _) = child_env(&[], None, |_: &str| None);
    ChildSpec {
        command: me.to_owned(),
        args: vec!["--serve".into()],
        env,
        confine,
        egress: None,
    }
}

/// Wait (at most 2 s) until the broker's pool of ready namespaces is full, then [`PAUSE`] (as
/// in the egress benchmark: a start begun the moment the pool made its last namespace runs
/// beside the kernel's remaining work for it, whichever side it is).
async fn settle() {
    let until = Instant::now() + std::time::Duration::from_secs(2);
    while !iteron_broker::sys::ready_namespaces_full() && Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    tokio::time::sleep(PAUSE).await;
}

async fn start_once(me: &str, confine: Option<Spec>) -> f64 {
    let t = Instant::now();
    let c = Client::connect_stdio(spec(me, confine), Options::default())
        .await
        .unwrap();
    c.list_tools().await.unwrap();
    let took = t.elapsed().as_secs_f64() * 1e3;
    c.close().await;
    took
}

async fn calls(me: &str, confine: Option<Spec>) -> f64 {
    let c = Client::connect_stdio(spec(me, confine), Options::default())
        .await
        .unwrap();
    c.list_tools().await.unwrap();
    let args = json!({"text": "hello"}).as_object().unwrap().clone();
    for _ in 0..200 {
        c.call_tool("echo", args.clone()).await.unwrap();
    }
    let mut t = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let s = Instant::now();
        c.call_tool("echo", args.clone()).await.unwrap();
        t.push(s.elapsed().as_secs_f64() * 1e6);
    }
    c.close().await;
    median(t)
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--serve") {
        serve();
        return;
    }
    let write_docs = argv.iter().any(|a| a == "--write-docs");
    let me = std::env::current_exe()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let home =
        std::env::temp_dir().join(format!("iteron-bench-confine-home-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let confined = Spec {
        deny: vec![home.clone()],
        readable: Vec::new(),
        writable: Vec::new(),
        network: false,
        open_files: DEFAULT_OPEN_FILES,
        data_bytes: DEFAULT_DATA_BYTES,
        processes: None,
        run_as: RunAs::default(),
        net_mode: Default::default(),
        egress: Vec::new(),
    };
    // One thread, as the broker runs (`iteron broker serve`).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut plain, mut boxed) = (Vec::new(), Vec::new());
    rt.block_on(async {
        for _ in 0..5 {
            start_once(&me, None).await;
            start_once(&me, Some(confined.clone())).await;
        }
        for _ in 0..SPAWNS {
            // As in the egress benchmark: each start with the namespace pool full, after a pause.
            settle().await;
            plain.push(start_once(&me, None).await);
            settle().await;
            boxed.push(start_once(&me, Some(confined.clone())).await);
        }
    });
    let (sp, sb) = (median(plain), median(boxed));
    let (cp, cb) = rt.block_on(async {
        let p = calls(&me, None).await;
        let b = calls(&me, Some(confined.clone())).await;
        (p, b)
    });
    let _ = std::fs::remove_dir_all(&home);
    let abi = {
        let e = iteron_broker::confine::plan(&confined);
        e.landlock_abi.map_or("none".to_owned(), |a| a.to_string())
    };
    let table = format!(
        "{SPAWNS} starts per side (each {} ms after the namespace pool is full) and {CALLS} calls per side, medians, Landlock ABI {abi}.\n\n\
         | what | unconfined | confined | ratio |\n|---|---|---|---|\n\
         | start (spawn + initialize + tools/list) | {sp:.2} ms | {sb:.2} ms | {:.2}× |\n\
         | `tools/call` round trip | {cp:.1} µs | {cb:.1} µs | {:.2}× |\n\n\
         Targets: start ≤ 1.2×; calls: no measurable difference.",
        PAUSE.as_millis(),
        sb / sp,
        cb / cp
    );
    println!("{table}");
    if write_docs {
        docs::write_table(START, END, &table);
    }
}
