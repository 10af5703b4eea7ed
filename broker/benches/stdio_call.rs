//! Benchmark: one `tools/call` round trip over stdio, Iteron's client against the official
//! TypeScript SDK client (`@modelcontextprotocol/sdk` 1.32.2 from `tests/interop`), both
//! talking to the same small Rust fixture server in the same run. Reported as medians and a
//! ratio.
//!
//! The fixture server is this benchmark binary itself, re-executed with `--serve`: a minimal
//! stdio MCP server (stateful 2025-11-25 handshake, one `echo` tool) with no dependencies
//! beyond serde_json, so the figure measures the clients, not the server.
//!
//! Run: `cargo bench -p iteron-broker --bench stdio_call` (`-- --write-docs` regenerates the
//! table in docs/benchmarks.md). Needs `tests/interop/setup` to have installed the SDK.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark harness: any failure should abort loudly"
)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use iteron_broker::mcp::client::{Client, Options};
use iteron_broker::spawn::{ChildSpec, child_env};
use serde_json::json;

const CALLS: usize = 2000;
const START: &str = "<!-- bench:stdio_call:start -->";
const END: &str = "<!-- bench:stdio_call:end -->";

#[path = "common/echo_fixture.rs"]
mod echo_fixture;
use echo_fixture::serve;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn ours(me: &str) -> f64 {
    let (env, _) = child_env(&[], None, |_| None);
    let spec = ChildSpec {
        command: me.to_owned(),
        args: vec!["--serve".into()],
        env,
        confine: None,
        egress: None,
    };
    let c = Client::connect_stdio(spec, Options::default())
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
        let r = c.call_tool("echo", args.clone()).await.unwrap();
        t.push(s.elapsed().as_secs_f64() * 1e6);
        assert_eq!(r.text, "hello");
    }
    c.close().await;
    median(t)
}

fn typescript(me: &str) -> f64 {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/interop");
    let script = root.join("peers/ts_client_bench.mjs");
    let out = Command::new("node")
        .arg(&script)
        .arg(me)
        .arg("--serve")
        .env("CALLS", CALLS.to_string())
        .current_dir(&root)
        .output()
        .expect("node runs the TypeScript SDK client (run tests/interop/setup first)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("MEDIAN_US "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the SDK client prints MEDIAN_US")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--serve") {
        serve();
        return;
    }
    let me = std::env::current_exe()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let m_ours = rt.block_on(ours(&me));
    let m_ts = typescript(&me);
    let table = format!(
        "{CALLS} sequential calls per client after 200 warm-up calls, one server process each.\n\n\
         | client | median `tools/call` round trip |\n|---|---|\n\
         | Iteron (`Client::call_tool`, stdio) | {m_ours:.1} µs |\n\
         | official TypeScript SDK 1.32.2 (`Client.callTool`, `StdioClientTransport`) | {m_ts:.1} µs |\n\
         | ratio Iteron / TypeScript SDK | {:.2}× |\n",
        m_ours / m_ts
    );
    println!("{table}");
    if args.iter().any(|a| a == "--write-docs") {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/benchmarks.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let doc = if doc.contains(START) {
            doc
        } else {
            format!(
                "{doc}\n## stdio `tools/call` round trip\n\nReproduce (and regenerate this table):\n\n```\ncargo bench -p iteron-broker --bench stdio_call -- --write-docs\n```\n\n{START}\n{END}\n"
            )
        };
        let (a, b) = (doc.find(START).unwrap(), doc.find(END).unwrap());
        std::fs::write(&path, format!("{}{START}\n{table}{}", &doc[..a], &doc[b..])).unwrap();
    }
}
