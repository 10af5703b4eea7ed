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
const CALLS: usize = 4000;
/// Rounds of fresh fixtures the calls are spread over.
const CALL_ROUNDS: usize = 20;
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

/// `tools/call` round trips on an unconfined and a confined fixture, both running, the calls
/// alternating between them (one at a time), in [`CALL_ROUNDS`] rounds of fresh fixtures. The
/// medians over the rounds of each round's median, unconfined and confined. Run pinned to one
/// CPU (`--calls`).
async fn calls(me: &str, confined: Spec) -> (f64, f64) {
    let args = json!({"text": "hello"}).as_object().unwrap().clone();
    let mut rounds = [Vec::new(), Vec::new()];
    for _ in 0..CALL_ROUNDS {
        let mut clients = Vec::new();
        for confine in [None, Some(confined.clone())] {
            let c = Client::connect_stdio(spec(me, confine), Options::default())
                .await
                .unwrap();
            c.list_tools().await.unwrap();
            clients.push(c);
        }
        for _ in 0..50 {
            for c in &clients {
                c.call_tool("echo", args.clone()).await.unwrap();
            }
        }
        let mut t = [Vec::new(), Vec::new()];
        for _ in 0..CALLS / CALL_ROUNDS {
            for (c, times) in clients.iter().zip(t.iter_mut()) {
                let s = Instant::now();
                c.call_tool("echo", args.clone()).await.unwrap();
                times.push(s.elapsed().as_secs_f64() * 1e6);
            }
        }
        for c in clients {
            c.close().await;
        }
        for (round, times) in rounds.iter_mut().zip(t) {
            round.push(median(times));
        }
    }
    let [plain, boxed] = rounds;
    (median(plain), median(boxed))
}

/// The confinement measured: what the broker applies to a stdio server, with `home` denied.
fn confined_spec(home: &std::path::Path) -> Spec {
    Spec {
        deny: vec![home.to_path_buf()],
        readable: Vec::new(),
        writable: Vec::new(),
        network: false,
        open_files: DEFAULT_OPEN_FILES,
        data_bytes: DEFAULT_DATA_BYTES,
        processes: None,
        run_as: RunAs::default(),
        net_mode: Default::default(),
        egress: Vec::new(),
    }
}

/// One thread, as the broker runs (`iteron broker serve`).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let me = std::env::current_exe()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    match argv.get(1).map(String::as_str) {
        Some("--serve") => return serve(),
        // The call half, in a process pinned to one CPU (see `calls`): prints both medians.
        Some("--calls") => {
            let (p, b) = runtime().block_on(calls(&me, confined_spec(argv[2].as_ref())));
            println!("{p} {b}");
            return;
        }
        _ => {}
    }
    let write_docs = argv.iter().any(|a| a == "--write-docs");
    let home =
        std::env::temp_dir().join(format!("iteron-bench-confine-home-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let confined = confined_spec(&home);
    let rt = runtime();
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
    // Pinned to one CPU (the benchmark, its threads and both fixtures): across the two, where
    // the scheduler puts each process moves one round trip between about 20 and 90 µs here,
    // far more than confinement could.
    let pinned = std::process::Command::new("taskset")
        .args(["-c", "0", &me, "--calls"])
        .arg(&home)
        .output()
        .expect("taskset (util-linux) runs the call half on one CPU");
    assert!(pinned.status.success(), "{pinned:?}");
    let text = String::from_utf8_lossy(&pinned.stdout);
    let mut medians = text.split_whitespace().map(|v| v.parse::<f64>().unwrap());
    let (cp, cb) = (medians.next().unwrap(), medians.next().unwrap());
    let _ = std::fs::remove_dir_all(&home);
    let abi = {
        let e = iteron_broker::confine::plan(&confined);
        e.landlock_abi.map_or("none".to_owned(), |a| a.to_string())
    };
    let table = format!(
        "{SPAWNS} starts per side (each {} ms after the namespace pool is full), medians; {CALLS} calls per side alternating, in {CALL_ROUNDS} rounds of fresh fixtures, on one CPU, median of the rounds' medians; Landlock ABI {abi}.\n\n\
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
