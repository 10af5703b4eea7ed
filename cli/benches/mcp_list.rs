//! Benchmark: `iteron mcp list --format json` with 200 configured servers — median wall time and
//! peak resident memory of the whole process — against reference commands measured in the same
//! run on the same file:
//!
//! - `/bin/true`: the cost of starting any process on this machine (the floor);
//! - `cat config.json`: starting a process and reading the file;
//! - `python3 -c …`: the same listing (load the config, print the servers as JSON) in an
//!   interpreter, the way many agent CLIs are built.
//!
//! Run: `cargo bench -p iteron --bench mcp_list` (add `-- --write-docs` to regenerate the table
//! in docs/benchmarks.md). Peak memory is measured per process: the bench re-executes itself as
//! a tiny supervisor that spawns one command, waits, and reads `RUSAGE_CHILDREN.ru_maxrss`,
//! which then covers exactly that one child.

use std::error::Error;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use iteron_broker::store::Home;
use iteron_policy::config::{
    Command as ServerCommand, HttpServer, OAuthConfig, Scope, ServerConfig, StdioServer, Transport,
};
use iteron_policy::names::{EnvName, HeaderName, ServerName};
use iteron_policy::url::EndpointUrl;

type Res<T> = Result<T, Box<dyn Error>>;

const SERVERS: usize = 200;
const MEASURE_ENV: &str = "ITERON_BENCH_MEASURE_ONE";
const START: &str = "<!-- bench:mcp_list:start -->";
const END: &str = "<!-- bench:mcp_list:end -->";

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os(MEASURE_ENV).is_some() {
        return measure_one(&args);
    }
    let write_docs = args.iter().any(|a| a == "--write-docs");
    let runs = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(101), |s| s.parse::<usize>())?;

    let dir = std::env::temp_dir().join(format!("iteron-bench-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let result = run(&dir, runs, write_docs);
    let _ = fs::remove_dir_all(&dir);
    result
}

fn server(i: usize) -> Res<ServerConfig> {
    let name = ServerName::parse(&format!("server-{i:03}"))?;
    let transport = if i % 4 == 3 {
        Transport::Http(HttpServer {
            url: EndpointUrl::parse(&format!("https://mcp{i}.example.com/mcp"))?,
            header_env: [(HeaderName::parse("x-tenant")?, EnvName::parse("TENANT")?)].into(),
            oauth: Some(OAuthConfig {
                scopes: vec![Scope::parse("read")?, Scope::parse("write")?],
                client_secret_env: Some(EnvName::parse(&format!("SECRET_{i}"))?),
                ..OAuthConfig::default()
            }),
        })
    } else {
        Transport::Stdio(StdioServer {
            command: ServerCommand::parse("/usr/local/bin/mcp-server")?,
            args: vec![
                "--root".into(),
                format!("/srv/data/{i}"),
                "--log-level".into(),
                "info".into(),
            ],
            env: vec![
                EnvName::parse("API_TOKEN")?,
                EnvName::parse(&format!("EXTRA_{i}"))?,
            ],
            sandbox: Default::default(),
        })
    };
    Ok(ServerConfig {
        name,
        transport,
        tools: Default::default(),
        policy: Default::default(),
    })
}

struct Sample {
    wall_ms: f64,
    max_rss_kib: u64,
}

struct Row {
    label: String,
    command: String,
    median_ms: f64,
    p90_ms: f64,
    peak_rss_mib: f64,
}

fn run(dir: &Path, runs: usize, write_docs: bool) -> Res<()> {
    let home = Home::at(dir.join("home"))?;
    home.update(|c| -> Res<()> {
        for i in 0..SERVERS {
            c.add_server(server(i)?)?;
        }
        Ok(())
    })?;
    let config = home.config_path();
    let iteron = PathBuf::from(env!("CARGO_BIN_EXE_iteron"));
    let python = "import json,sys; d=json.load(open(sys.argv[1])); \
                  print(json.dumps({'schema_version': d['schema_version'], \
                  'servers': d.get('mcp_servers', [])}, indent=2))";
    let cfg = config.to_string_lossy().into_owned();
    let home_s = home.dir().to_string_lossy().into_owned();
    let cases: Vec<(&str, Vec<String>, String)> = vec![
        (
            "iteron mcp list --format json",
            vec![
                iteron.to_string_lossy().into_owned(),
                "mcp".into(),
                "list".into(),
                "--format".into(),
                "json".into(),
            ],
            "ITERON_HOME=<200 servers> iteron mcp list --format json".into(),
        ),
        (
            "/bin/true (process floor)",
            vec!["/bin/true".into()],
            "/bin/true".into(),
        ),
        (
            "cat config.json",
            vec!["/bin/cat".into(), cfg.clone()],
            "cat config.json".into(),
        ),
        (
            "python3 json listing",
            vec!["python3".into(), "-c".into(), python.into(), cfg.clone()],
            "python3 -c 'load config, print servers as JSON'".into(),
        ),
    ];
    let self_exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    for (label, argv, shown) in &cases {
        // Check once that the command works and, for iteron, lists every server.
        let probe = Command::new(&argv[0])
            .args(&argv[1..])
            .env("ITERON_HOME", &home_s)
            .output()?;
        if !probe.status.success() {
            return Err(
                format!("{label} failed: {}", String::from_utf8_lossy(&probe.stderr)).into(),
            );
        }
        if label.starts_with("iteron") {
            let v: serde_json::Value = serde_json::from_slice(&probe.stdout)?;
            let n = v["servers"].as_array().map_or(0, Vec::len);
            if n != SERVERS {
                return Err(format!("iteron listed {n} servers, expected {SERVERS}").into());
            }
        }
        let mut samples = Vec::with_capacity(runs);
        for i in 0..runs + 5 {
            let out = Command::new(&self_exe)
                .args(argv)
                .env(MEASURE_ENV, "1")
                .env("ITERON_HOME", &home_s)
                .stderr(Stdio::inherit())
                .output()?;
            let text = String::from_utf8(out.stdout)?;
            let mut parts = text.split_whitespace();
            let wall_ns: u64 = parts.next().ok_or("no measurement")?.parse()?;
            let max_rss_kib: u64 = parts.next().ok_or("no measurement")?.parse()?;
            if i >= 5 {
                samples.push(Sample {
                    wall_ms: wall_ns as f64 / 1e6,
                    max_rss_kib,
                });
            }
        }
        let mut walls: Vec<f64> = samples.iter().map(|s| s.wall_ms).collect();
        walls.sort_by(f64::total_cmp);
        let peak = samples.iter().map(|s| s.max_rss_kib).max().unwrap_or(0);
        rows.push(Row {
            label: (*label).into(),
            command: shown.clone(),
            median_ms: walls[walls.len() / 2],
            p90_ms: walls[(walls.len() * 9) / 10],
            peak_rss_mib: peak as f64 / 1024.0,
        });
    }
    let table = render(&rows, runs);
    println!("{table}");
    write_report(&rows, runs)?;
    if write_docs {
        update_docs(&table)?;
    }
    Ok(())
}

/// Supervisor mode: run one command with stdout discarded, print "wall_ns max_rss_kib".
fn measure_one(argv: &[String]) -> Res<()> {
    let argv: Vec<&String> = argv.iter().filter(|a| *a != "--bench").collect();
    let (program, rest) = argv.split_first().ok_or("nothing to measure")?;
    let start = Instant::now();
    let status = Command::new(program)
        .args(rest)
        .env_remove(MEASURE_ENV)
        .stdout(Stdio::null())
        .status()?;
    let wall = start.elapsed();
    if !status.success() {
        return Err(format!("{program} exited with {status}").into());
    }
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)?;
    println!("{} {}", wall.as_nanos(), usage.max_rss());
    Ok(())
}

fn render(rows: &[Row], runs: usize) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "{SERVERS} configured servers, {runs} measured runs per command after 5 warm-up runs, \
         stdout discarded.\n\n"
    ));
    t.push_str("| command | median wall | p90 wall | peak RSS |\n|---|---|---|---|\n");
    for r in rows {
        t.push_str(&format!(
            "| `{}` | {:.2} ms | {:.2} ms | {:.1} MiB |\n",
            r.command, r.median_ms, r.p90_ms, r.peak_rss_mib
        ));
    }
    t
}

fn write_report(rows: &[Row], runs: usize) -> Res<()> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-reports");
    fs::create_dir_all(&dir)?;
    let report = serde_json::json!({
        "benchmark": "mcp_list",
        "servers": SERVERS,
        "runs": runs,
        "results": rows.iter().map(|r| serde_json::json!({
            "label": r.label,
            "command": r.command,
            "median_ms": r.median_ms,
            "p90_ms": r.p90_ms,
            "peak_rss_mib": r.peak_rss_mib,
        })).collect::<Vec<_>>(),
    });
    fs::write(
        dir.join("mcp_list.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    Ok(())
}

fn update_docs(table: &str) -> Res<()> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/benchmarks.md");
    let doc = fs::read_to_string(&path)?;
    let (Some(a), Some(b)) = (doc.find(START), doc.find(END)) else {
        return Err("docs/benchmarks.md lacks the mcp_list markers".into());
    };
    let updated = format!("{}{START}\n{table}{}", &doc[..a], &doc[b..]);
    fs::write(&path, updated)?;
    Ok(())
}
