//! Benchmark: an agent's `call_tool` through the real broker (`iteron broker serve`, release
//! build) to a stdio fixture and back, against a direct in-process call from Iteron's MCP
//! client to the same fixture, in the same run. Every brokered call goes the product's whole
//! way: frame decode, session and exposure checks, the hook seam, an operator approval over the
//! operator socket (this harness plays the operator, long-polling `pending` and approving each
//! call), the effect, the audit record, the answer frame.
//!
//! Reports p50/p99 latency with 1 agent, calls/s and p50/p99 with 64 concurrent agents (each
//! its own connection and session), and the broker's RSS idle and with 64 open sessions.
//!
//! The same run also measures calls an operator's approval rule approves (`approvals.rules`
//! in the benchmark's configuration: `echo` with `text` equal to `r`): no operator round trip,
//! the rule's decision, the `dispatching` and outcome records, the effect.
//!
//! The fixture is this binary re-executed with `--serve` (a minimal stdio MCP server with one
//! `echo` tool), so the figures measure the broker, not a server.
//!
//! Run: `cargo bench -p iteron --bench broker` (`-- --write-docs` regenerates the table in
//! docs/benchmarks.md).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark harness: any failure should abort loudly"
)]

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use iteron_broker::ipc::client::Connection;
use iteron_broker::mcp::client::{Client, Options};
use iteron_broker::spawn::{ChildSpec, child_env};
use serde_json::{Map, Value, json};

#[path = "../../broker/benches/common/docs.rs"]
mod docs;

const SEQUENTIAL: usize = 2000;
const AGENTS: usize = 64;
const PER_AGENT: usize = 1000;
/// Interleaved rounds of the one-agent paths, and calls per path per round.
const ROUNDS: usize = 9;
const PER_ROUND: usize = 300;
const START: &str = "<!-- bench:broker:start -->";
const END: &str = "<!-- bench:broker:end -->";

#[path = "../../broker/benches/common/echo_fixture.rs"]
mod echo_fixture;
use echo_fixture::serve;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// A `/proc/PID/status` figure in KiB (`VmRSS:`, `VmHWM:` for the peak).
fn status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// The worst legal load: `AGENTS` agents each send one call whose arguments hold as many JSON
/// nodes as a frame may carry, and nobody approves. Returns how many were refused `busy` (the
/// argument budget) once all have been answered or are waiting; the connections stay open
/// until the returned handles are dropped.
async fn heavy_calls(socket: &Path) -> (usize, Vec<tokio::task::JoinHandle<()>>) {
    let pad = vec![json!({}); iteron_broker::ipc::proto::MAX_NODES - 16];
    let args = json!({"text": "x", "pad": pad});
    let busy = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut held = Vec::new();
    for _ in 0..AGENTS {
        let s = socket.to_path_buf();
        let args = args.clone();
        let busy = Arc::clone(&busy);
        // One after the other, as in the end-to-end test: each frame is decoded before the next.
        let (sent_tx, sent_rx) = tokio::sync::oneshot::channel();
        held.push(tokio::spawn(async move {
            let mut c = Connection::connect(&s).await.unwrap();
            c.hello("bench-heavy").await.unwrap();
            let call = c.request(
                "call_tool",
                json!({"server": "bench", "tool": "echo", "arguments": args}),
            );
            tokio::pin!(call);
            let answered = tokio::time::timeout(Duration::from_millis(500), &mut call).await;
            let _ = sent_tx.send(());
            match answered {
                Ok(Err(iteron_broker::ipc::client::ClientError::Refused { code, .. }))
                    if code == "busy" =>
                {
                    busy.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                Ok(other) => panic!("unexpected answer: {other:?}"),
                // Waiting for an approval that never comes: hold it open.
                Err(_) => {
                    let _ = call.await;
                }
            }
        }));
        let _ = sent_rx.await;
    }
    (busy.load(std::sync::atomic::Ordering::SeqCst), held)
}

fn args(text: &str) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("text".into(), text.into());
    m
}

struct Stats {
    p50: Duration,
    p99: Duration,
    per_sec: f64,
}

fn stats(mut lat: Vec<Duration>, wall: Duration) -> Stats {
    lat.sort();
    Stats {
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        per_sec: lat.len() as f64 / wall.as_secs_f64(),
    }
}

async fn direct(exe: &Path) -> (Stats, Stats) {
    let (env, _) = child_env(&[], None, |_: &str| None);
    let spec = ChildSpec {
        command: exe.to_string_lossy().into_owned(),
        args: vec!["--serve".into()],
        env,
        confine: None,
        egress: None,
    };
    let client = Arc::new(
        Client::connect_stdio(spec, Options::default())
            .await
            .unwrap(),
    );
    client.list_tools().await.unwrap();
    for _ in 0..200 {
        client.call_tool("echo", args("warm")).await.unwrap();
    }
    let mut lat = Vec::with_capacity(SEQUENTIAL);
    let t0 = Instant::now();
    for _ in 0..SEQUENTIAL {
        let t = Instant::now();
        let r = client.call_tool("echo", args("x")).await.unwrap();
        assert_eq!(r.text, "x");
        lat.push(t.elapsed());
    }
    let one = stats(lat, t0.elapsed());
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..AGENTS {
        let c = Arc::clone(&client);
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(PER_AGENT);
            for _ in 0..PER_AGENT {
                let t = Instant::now();
                c.call_tool("echo", args("y")).await.unwrap();
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let many = stats(all, t0.elapsed());
    client.close().await;
    (one, many)
}

/// The operator: long-poll `pending`, approve everything that arrives.
async fn operator(socket: PathBuf, stop: Arc<std::sync::atomic::AtomicBool>) {
    let mut c = Connection::connect(&socket).await.unwrap();
    c.hello("bench-operator").await.unwrap();
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let v = c.request("pending", json!({"wait_ms": 200})).await.unwrap();
        let ids: Vec<u64> = v["pending"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|i| i["id"].as_u64())
            .collect();
        // Everything listed is approved in one request (each call is still decided and audited
        // on its own); a call that vanished meanwhile is simply reported not found.
        if !ids.is_empty() {
            let _ = c
                .request("decide", json!({"ids": ids, "approve": true}))
                .await;
        }
    }
}

async fn agent_calls(socket: &Path, n: usize) -> Vec<Duration> {
    calls_with(socket, n, "z").await
}

/// Calls the benchmark's approval rule approves (`text` = `r`): no operator round trip.
async fn ruled_calls(socket: &Path, n: usize) -> Vec<Duration> {
    calls_with(socket, n, "r").await
}

async fn calls_with(socket: &Path, n: usize, text: &str) -> Vec<Duration> {
    let mut c = Connection::connect(socket).await.unwrap();
    c.hello("bench-agent").await.unwrap();
    let mut lat = Vec::with_capacity(n);
    let params = json!({"server": "bench", "tool": "echo", "arguments": {"text": text}});
    for _ in 0..n {
        let t = Instant::now();
        let v = c.request("call_tool", params.clone()).await.unwrap();
        assert_eq!(v["text"], text);
        lat.push(t.elapsed());
    }
    lat
}

/// The broker's own cost per request without an effect or an approval: a call to a tool that
/// does not exist (frame, session, exposure check, audit record, refusal frame).
async fn refused_calls(socket: &Path, n: usize) -> Vec<Duration> {
    let mut c = Connection::connect(socket).await.unwrap();
    c.hello("bench-agent").await.unwrap();
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let e = c
            .request(
                "call_tool",
                json!({"server": "bench", "tool": "nope", "arguments": {}}),
            )
            .await
            .unwrap_err();
        assert!(e.to_string().starts_with("unknown_tool"));
        lat.push(t.elapsed());
    }
    lat
}

/// The floor: a process that answers every frame (4-byte length + body) with the same frame,
/// on a one-thread runtime like the broker's. No JSON, no checks, no audit.
fn pong(path: &Path) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::UnixListener::bind(path).unwrap();
        let (mut s, _) = listener.accept().await.unwrap();
        let mut len = [0u8; 4];
        let mut body = Vec::new();
        while s.read_exact(&mut len).await.is_ok() {
            body.resize(u32::from_be_bytes(len) as usize, 0);
            s.read_exact(&mut body).await.unwrap();
            let mut frame = len.to_vec();
            frame.extend_from_slice(&body);
            s.write_all(&frame).await.unwrap();
        }
    });
}

/// Round trips of a frame the size of a `call_tool` request through [`pong`] in another process.
async fn pong_connect(path: &Path) -> tokio::net::UnixStream {
    loop {
        match tokio::net::UnixStream::connect(path).await {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

async fn floor_round_trips(s: &mut tokio::net::UnixStream, n: usize) -> Vec<Duration> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = json!({"id": 7, "method": "call_tool",
        "params": {"server": "bench", "tool": "echo", "arguments": {"text": "z"}}})
    .to_string();
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(body.as_bytes());
    let mut back = vec![0u8; frame.len()];
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(&frame).await.unwrap();
        s.read_exact(&mut back).await.unwrap();
        lat.push(t.elapsed());
    }
    lat
}

/// One round of the interleaved one-agent paths: p50s in µs.
struct Round {
    direct: f64,
    brokered: f64,
    ruled: f64,
    bare: f64,
}

/// Rounds of the four one-agent paths, interleaved so that each round sees the same machine
/// state: direct, brokered (operator approval), rule-approved and bare round-trip p50s.
async fn interleaved(
    exe: &Path,
    agent_socket: &Path,
    pong: &mut tokio::net::UnixStream,
) -> Vec<Round> {
    let (env, _) = child_env(&[], None, |_: &str| None);
    let client = Client::connect_stdio(
        ChildSpec {
            command: exe.to_string_lossy().into_owned(),
            args: vec!["--serve".into()],
            env,
            confine: None,
            egress: None,
        },
        Options::default(),
    )
    .await
    .unwrap();
    client.list_tools().await.unwrap();
    let mut agent = Connection::connect(agent_socket).await.unwrap();
    agent.hello("bench-rounds").await.unwrap();
    // Warm both up like the other phases.
    for _ in 0..200 {
        client.call_tool("echo", args("warm")).await.unwrap();
        agent
            .request(
                "call_tool",
                json!({"server": "bench", "tool": "echo", "arguments": {"text": "w"}}),
            )
            .await
            .unwrap();
    }
    let p50 = |mut v: Vec<Duration>| {
        v.sort();
        us(percentile(&v, 0.5))
    };
    let mut rounds = Vec::new();
    for _ in 0..ROUNDS {
        let mut direct = Vec::with_capacity(PER_ROUND);
        for _ in 0..PER_ROUND {
            let t = Instant::now();
            client.call_tool("echo", args("x")).await.unwrap();
            direct.push(t.elapsed());
        }
        let mut brokered = Vec::with_capacity(PER_ROUND);
        for _ in 0..PER_ROUND {
            let t = Instant::now();
            agent
                .request(
                    "call_tool",
                    json!({"server": "bench", "tool": "echo", "arguments": {"text": "z"}}),
                )
                .await
                .unwrap();
            brokered.push(t.elapsed());
        }
        let mut ruled = Vec::with_capacity(PER_ROUND);
        for _ in 0..PER_ROUND {
            let t = Instant::now();
            agent
                .request(
                    "call_tool",
                    json!({"server": "bench", "tool": "echo", "arguments": {"text": "r"}}),
                )
                .await
                .unwrap();
            ruled.push(t.elapsed());
        }
        let bare = floor_round_trips(pong, PER_ROUND).await;
        rounds.push(Round {
            direct: p50(direct),
            brokered: p50(brokered),
            ruled: p50(ruled),
            bare: p50(bare),
        });
    }
    client.close().await;
    rounds
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--serve") {
        serve();
        return;
    }
    if argv.get(1).map(String::as_str) == Some("--pong") {
        pong(Path::new(&argv[2]));
        return;
    }
    let write_docs = argv.iter().any(|a| a == "--write-docs");
    let exe = std::env::current_exe().unwrap();
    let base = std::env::temp_dir().join(format!("iteron-bench-broker-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&base)
        .unwrap();
    let home = base.join("home");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&home)
        .unwrap();
    let config = json!({"schema_version": 2, "mcp_servers": [{
        "name": "bench", "transport": "stdio",
        "command": exe.to_str().unwrap(), "args": ["--serve"]}],
        "approvals": {"rules": [{"id": "bench-r", "effect": "allow", "server": "bench",
            "tool": "echo", "arguments": {"text": {"equals": "r"}}}]}});
    std::fs::write(home.join("config.json"), config.to_string()).unwrap();
    std::fs::set_permissions(
        home.join("config.json"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let agent_socket = base.join("run").join("agent.sock");
    let operator_socket = home.join("run").join("operator.sock");
    let mut broker = Command::new(env!("CARGO_BIN_EXE_iteron"))
        .args([
            "broker",
            "serve",
            "--socket",
            agent_socket.to_str().unwrap(),
        ])
        .env("ITERON_HOME", &home)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&operator_socket).is_err() {
        assert!(Instant::now() < deadline, "the broker did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    let rss_idle = rss_kib(broker.id());

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (direct_one, direct_many) = rt.block_on(direct(&exe));
    let pong_path = base.join("pong.sock");
    let mut ponger = Command::new(&exe)
        .arg("--pong")
        .arg(&pong_path)
        .spawn()
        .unwrap();
    let mut pong = rt.block_on(pong_connect(&pong_path));
    rt.block_on(floor_round_trips(&mut pong, 200));
    let floor = stats(
        rt.block_on(floor_round_trips(&mut pong, SEQUENTIAL)),
        Duration::from_secs(1),
    );

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let op = rt.spawn(operator(operator_socket.clone(), Arc::clone(&stop)));
    let (refused_one, refused_many) = rt.block_on(async {
        refused_calls(&agent_socket, 200).await;
        let t0 = Instant::now();
        let one = stats(refused_calls(&agent_socket, SEQUENTIAL).await, t0.elapsed());
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..AGENTS {
            let s = agent_socket.clone();
            tasks.push(tokio::spawn(
                async move { refused_calls(&s, PER_AGENT).await },
            ));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        (one, stats(all, t0.elapsed()))
    });
    let (broker_one, broker_many, ruled_one, ruled_many, rss_sessions, rounds) =
        rt.block_on(async {
            // Warm-up: the first call starts the server.
            agent_calls(&agent_socket, 200).await;
            let t0 = Instant::now();
            let lat = agent_calls(&agent_socket, SEQUENTIAL).await;
            let one = stats(lat, t0.elapsed());
            let t0 = Instant::now();
            let mut tasks = Vec::new();
            for _ in 0..AGENTS {
                let s = agent_socket.clone();
                tasks.push(tokio::spawn(
                    async move { agent_calls(&s, PER_AGENT).await },
                ));
            }
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.unwrap());
            }
            let many = stats(all, t0.elapsed());
            // Rule-approved calls: the operator task stays up but is never asked.
            ruled_calls(&agent_socket, 200).await;
            let t0 = Instant::now();
            let ruled_one = stats(ruled_calls(&agent_socket, SEQUENTIAL).await, t0.elapsed());
            let t0 = Instant::now();
            let mut tasks = Vec::new();
            for _ in 0..AGENTS {
                let s = agent_socket.clone();
                tasks.push(tokio::spawn(
                    async move { ruled_calls(&s, PER_AGENT).await },
                ));
            }
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.unwrap());
            }
            let ruled_many = stats(all, t0.elapsed());
            let rounds = interleaved(&exe, &agent_socket, &mut pong).await;
            // 64 open sessions, idle.
            let mut conns = Vec::new();
            for _ in 0..AGENTS {
                let mut c = Connection::connect(&agent_socket).await.unwrap();
                c.hello("bench-idle").await.unwrap();
                c.request("list_tools", json!({})).await.unwrap();
                conns.push(c);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            let rss = rss_kib(broker.id());
            drop(conns);
            (one, many, ruled_one, ruled_many, rss, rounds)
        });
    let _ = ponger.kill();
    let _ = ponger.wait();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    rt.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(2), op).await;
    });
    // Nobody approves from here on: the worst legal load waits.
    let rss_before_heavy = rss_kib(broker.id());
    let (heavy_busy, heavy_rss, heavy_peak) = rt.block_on(async {
        let (busy, held) = heavy_calls(&agent_socket).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let rss = rss_kib(broker.id());
        let peak = status_kib(broker.id(), "VmHWM:");
        for h in held {
            h.abort();
        }
        (busy, rss, peak)
    });
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(broker.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = broker.wait();
    let _ = std::fs::remove_dir_all(&base);

    let added = us(broker_one.p50) - us(direct_one.p50);
    let ruled_added = us(ruled_one.p50) - us(direct_one.p50);
    let spread = |f: &dyn Fn(&Round) -> f64| {
        let v: Vec<f64> = rounds.iter().map(f).collect();
        (
            median(v.clone()),
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        )
    };
    let (added_med, added_min, added_max) = spread(&|r| r.brokered - r.direct);
    let (ruled_med, ruled_min, ruled_max) = spread(&|r| r.ruled - r.direct);
    let (bare_med, _, _) = spread(&|r| r.bare);
    let row = |path: &str, agents: usize, s: &Stats| {
        format!(
            "| {path} | {agents} | {:.1} | {:.1} | {:.0} |\n",
            us(s.p50),
            us(s.p99),
            s.per_sec
        )
    };
    let mut table =
        String::from("| path | agents | p50 (µs) | p99 (µs) | calls/s |\n|---|---|---|---|---|\n");
    table.push_str(&row(
        "direct in-process `Client::call_tool`",
        1,
        &direct_one,
    ));
    table.push_str(&row(
        "agent → broker (approval, audit) → fixture",
        1,
        &broker_one,
    ));
    table.push_str(&row(
        "agent → broker (approved by a rule, audit) → fixture",
        1,
        &ruled_one,
    ));
    table.push_str(&row(
        "direct in-process, 64 concurrent tasks",
        64,
        &direct_many,
    ));
    table.push_str(&row(
        "agent → broker → fixture, 64 agents",
        64,
        &broker_many,
    ));
    table.push_str(&row(
        "agent → broker (approved by a rule) → fixture, 64 agents",
        64,
        &ruled_many,
    ));
    table.push_str(&row(
        "agent → broker, refused (unknown tool; no approval, no effect)",
        1,
        &refused_one,
    ));
    table.push_str(&row(
        "agent → broker, refused, 64 agents",
        64,
        &refused_many,
    ));
    table.push_str(&format!(
        "| floor: bare frame round trip to another process (no JSON, no checks) | 1 | {:.1} | {:.1} | – |\n\n",
        us(floor.p50),
        us(floor.p99)
    ));
    table.push_str(&format!(
        "Added by the broker at p50 with one agent: **{added:.1} µs** (target ≤ 50 µs). \
         A brokered call makes two more process round trips than the direct call (agent ↔ broker, \
         broker ↔ operator for the per-call approval), so on this machine the floor for what any \
         broker of this shape adds is about **{:.1} µs** (2 × the bare round trip), before any \
         checking, approval bookkeeping or audit. \
         Interleaved, {ROUNDS} rounds of {PER_ROUND} calls per path: added at p50 **{added_med:.1} µs** \
         (median of the rounds; range {added_min:.1}–{added_max:.1}), against a floor of \
         **{:.1} µs** (2 × the bare round trip, median). \
         With 64 agents: **{:.0} calls/s** (target ≥ 20,000). \
         Broker RSS: **{:.1} MiB idle**, **{:.1} MiB with 64 open sessions** (target ≤ 10 MiB idle).\n\n",
        2.0 * us(floor.p50),
        2.0 * bare_med,
        broker_many.per_sec,
        rss_idle as f64 / 1024.0,
        rss_sessions as f64 / 1024.0,
    ));
    table.push_str(&format!(
        "Approved by a rule (no operator round trip, one more process round trip than the direct \
         call): added at p50 with one agent **{ruled_added:.1} µs**, **{:.2} ×** the bare round \
         trip of {:.1} µs (target ≤ 1.5 ×); interleaved, **{ruled_med:.1} µs** (median of the \
         rounds; range {ruled_min:.1}–{ruled_max:.1}), **{:.2} ×** the median bare round trip of \
         {bare_med:.1} µs. With 64 agents: **{:.0} calls/s** (target ≥ 50,000).\n\n",
        ruled_added / us(floor.p50),
        us(floor.p50),
        ruled_med / bare_med,
        ruled_many.per_sec,
    ));
    table.push_str(&format!(
        "Worst legal load: 64 agents each send one call whose arguments hold {} JSON nodes (the \
         bound), and nobody approves: {} wait, {} are refused `busy` by the argument budget \
         (32 MiB per uid, 96 MiB in all). Broker RSS **{:.1} MiB** with them waiting (from \
         {:.1} MiB just before), peak over the whole run **{:.1} MiB** (target: under 128 MiB; \
         before calls kept bytes instead of trees, 64 such 1 MiB calls took it to 3.2 GB).",
        iteron_broker::ipc::proto::MAX_NODES - 16 + 3,
        AGENTS - heavy_busy,
        heavy_busy,
        heavy_rss as f64 / 1024.0,
        rss_before_heavy as f64 / 1024.0,
        heavy_peak as f64 / 1024.0,
    ));
    println!("{table}");
    if write_docs {
        docs::write_table(START, END, &table);
    }
}
