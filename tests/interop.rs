//! Interop farm: real MCP servers, installed from lock files by `tests/interop/setup`, run on
//! loopback against Iteron's own client.
//!
//! Every case does what an operator and the broker would do: `iteron mcp add` in a private
//! ITERON_HOME, `iteron mcp test --format json` (negotiated version and tool names), then the
//! library connects to the same configured server and makes one `tools/call`, asserting the
//! returned text. A few cases pin a 2025 version in the library instead (`mode` names the pin):
//! the CLI always negotiates, so those skip `mcp test` and take version and tools from the
//! library; they cover the legacy era of servers that would otherwise negotiate 2026-07-28.
//!
//! The peers are installed, never downloaded here: when `tests/interop/node_modules` or
//! `tests/interop/.venv` is missing or stale every case FAILS and names the setup command.
//! HTTP peers listen on an OS-chosen loopback port and print `LISTENING <port>`; the only
//! exception is server-everything, which takes `PORT` from its environment and binds every
//! interface (acceptable on a sealed test box; the port is probed free first and the start is
//! retried if another process wins the race).
//!
//! With `ITERON_INTEROP_REPORT=<path>` each case appends one JSON line
//! `{"peer","transport","mode","expected_version","negotiated_version","tools","call"}`, which
//! feeds the interop matrix in `docs/mcp-compatibility.md`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use iteron_broker::mcp::client::{Options, Projected};
use iteron_broker::mcp::version::{Version, VersionPolicy};
use serde_json::{Map, Value, json};

const LEGACY: &str = "2025-11-25";
const MODERN: &str = "2026-07-28";

/// How long a peer may take to announce it is listening.
const READY_DEADLINE: Duration = Duration::from_secs(30);
/// How long one `iteron` invocation may take (its own probe deadline is 30 s).
const CLI_DEADLINE: Duration = Duration::from_secs(45);
/// How long the library connect + list + call + close may take.
const CALL_DEADLINE: Duration = Duration::from_secs(40);
/// Bytes of a process's output kept for failure messages.
const LOG_KEEP: usize = 4096;

const SETUP_COMMAND: &str = "tests/interop/setup";

/// Every npm package the farm pins, with the version the lock file resolves.
const NPM_PINS: &[(&str, &str)] = &[
    ("@modelcontextprotocol/server-everything", "2026.8.31"),
    ("@modelcontextprotocol/sdk", "1.32.2"),
    ("@modelcontextprotocol/server", "2.4.0"),
    ("@modelcontextprotocol/node", "2.1.2"),
    ("express", "5.3.0"),
    ("zod", "4.6.7"),
];
/// The PyPI distributions the farm pins (their dist-info directories in the venv).
const PY_PINS: &[&str] = &["mcp-2.3.0", "mcp_server_fetch-2026.10.24"];

// ---------------------------------------------------------------------------------------------
// Locations and installation check

fn farm() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/interop")
        .canonicalize()
        .expect("tests/interop exists")
}

fn not_installed(what: &str) -> ! {
    panic!(
        "interop peers are not installed ({what}); run `{SETUP_COMMAND}` from the workspace \
         root first (it needs the npm registry and PyPI once)"
    )
}

/// Fail (never skip) when the farm is missing or does not match the pins.
fn require_setup() {
    let dir = farm();
    let modules = dir.join("node_modules");
    if !modules.is_dir() {
        not_installed("tests/interop/node_modules is missing");
    }
    for (package, version) in NPM_PINS {
        let manifest = modules.join(package).join("package.json");
        let Ok(text) = fs::read_to_string(&manifest) else {
            not_installed(&format!("{package} is missing from node_modules"));
        };
        let found: Value = serde_json::from_str(&text).expect("package.json is JSON");
        if found["version"].as_str() != Some(version) {
            not_installed(&format!(
                "node_modules has {package} {}, the lock pins {version}",
                found["version"]
            ));
        }
    }
    let venv = dir.join(".venv");
    if !venv.join("bin/python").exists() {
        not_installed("tests/interop/.venv is missing");
    }
    let site = venv.join("lib/python3.11/site-packages");
    for dist in PY_PINS {
        if !site.join(format!("{dist}.dist-info")).is_dir() {
            not_installed(&format!(".venv lacks {dist}"));
        }
    }
}

/// `node` from the test's PATH, as an absolute path (the broker gives children a fixed PATH).
fn node() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("node"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("node is not on PATH (the interop farm needs node >= 20)"))
}

fn venv_bin(name: &str) -> PathBuf {
    farm().join(".venv/bin").join(name)
}

fn everything_js() -> PathBuf {
    farm().join("node_modules/@modelcontextprotocol/server-everything/dist/index.js")
}

fn peer_script(name: &str) -> PathBuf {
    farm().join("peers").join(name)
}

fn s(p: &Path) -> String {
    p.to_str().expect("UTF-8 path").to_owned()
}

// ---------------------------------------------------------------------------------------------
// Child processes: bounded logs, line channel, deadlines, kill on drop

type Log = Arc<Mutex<VecDeque<u8>>>;

fn keep(log: &Log, bytes: &[u8]) {
    let mut l = log.lock().unwrap();
    l.extend(bytes);
    while l.len() > LOG_KEEP {
        l.pop_front();
    }
}

fn shown(log: &Log) -> String {
    let l = log.lock().unwrap();
    let bytes: Vec<u8> = l.iter().copied().collect();
    String::from_utf8_lossy(&bytes).trim().replace('\n', " | ")
}

/// Read a stream line by line into a bounded log and, optionally, a channel.
fn pump(stream: impl Read + Send + 'static, log: Log, lines: Option<Sender<String>>) {
    thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    keep(&log, &line);
                    if let Some(tx) = &lines {
                        let _ = tx.send(String::from_utf8_lossy(&line).trim_end().to_owned());
                    }
                }
            }
        }
    });
}

/// A long-running peer process, killed when dropped.
struct Peer {
    label: String,
    child: Child,
    out: Log,
    err: Log,
    lines: Receiver<String>,
}

impl Peer {
    fn spawn(label: &str, mut cmd: Command) -> Result<Peer, String> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("{label}: cannot start: {e}"))?;
        let (tx, rx) = mpsc::channel();
        let out: Log = Arc::default();
        let err: Log = Arc::default();
        pump(child.stdout.take().unwrap(), out.clone(), Some(tx.clone()));
        pump(child.stderr.take().unwrap(), err.clone(), Some(tx));
        Ok(Peer {
            label: label.to_owned(),
            child,
            out,
            err,
            lines: rx,
        })
    }

    fn logs(&self) -> String {
        format!(
            "stdout: [{}] stderr: [{}]",
            shown(&self.out),
            shown(&self.err)
        )
    }

    /// Wait until a line (stdout or stderr) yields a port, the process exits, or time runs out.
    fn wait_port(&mut self, find: impl Fn(&str) -> Option<u16>) -> Result<u16, Exit> {
        let end = Instant::now() + READY_DEADLINE;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Exit::Timeout(format!(
                    "{}: not listening after {} s; {}",
                    self.label,
                    READY_DEADLINE.as_secs(),
                    self.logs()
                )));
            }
            match self
                .lines
                .recv_timeout(left.min(Duration::from_millis(200)))
            {
                Ok(line) => {
                    if let Some(port) = find(&line) {
                        return Ok(port);
                    }
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                    if let Ok(Some(status)) = self.child.try_wait() {
                        // Let the pumps drain what the process wrote before it died.
                        thread::sleep(Duration::from_millis(100));
                        return Err(Exit::Exited(format!(
                            "{}: exited ({status}) before listening; {}",
                            self.label,
                            self.logs()
                        )));
                    }
                    if self.lines.try_recv().is_err() {
                        thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

enum Exit {
    Timeout(String),
    Exited(String),
}

impl Exit {
    fn message(self) -> String {
        match self {
            Exit::Timeout(m) | Exit::Exited(m) => m,
        }
    }
}

fn listening_line(line: &str) -> Option<u16> {
    line.strip_prefix("LISTENING ")?.trim().parse().ok()
}

/// Start one of our peer scripts and read its `LISTENING <port>`.
fn start_http_peer(label: &str, cmd: Command) -> Result<(Peer, String), String> {
    let mut peer = Peer::spawn(label, cmd)?;
    let port = peer.wait_port(listening_line).map_err(Exit::message)?;
    Ok((peer, format!("http://127.0.0.1:{port}/mcp")))
}

/// A port that was free a moment ago (only for server-everything, which cannot pick one).
fn probably_free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// server-everything over Streamable HTTP. It binds every interface on `PORT`; if another
/// process took the port between the probe and the start, it exits and we try another.
fn start_everything_http() -> Result<(Peer, String), String> {
    let mut last = String::new();
    for _ in 0..3 {
        let port = probably_free_port();
        let mut cmd = Command::new(node());
        cmd.arg(everything_js())
            .arg("streamableHttp")
            .env("PORT", port.to_string());
        let mut peer = Peer::spawn("server-everything (streamableHttp)", cmd)?;
        let want = format!("listening on port {port}");
        match peer.wait_port(|l| l.contains(&want).then_some(port)) {
            Ok(p) => return Ok((peer, format!("http://127.0.0.1:{p}/mcp"))),
            Err(Exit::Exited(m)) => last = m,
            Err(Exit::Timeout(m)) => return Err(m),
        }
    }
    Err(last)
}

/// Run a command to completion within a deadline, capturing its output.
fn run_bounded(
    mut cmd: Command,
    deadline: Duration,
) -> Result<(ExitStatus, String, String), String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stdout.read_to_end(&mut v);
        v
    });
    let err = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stderr.read_to_end(&mut v);
        v
    });
    let end = Instant::now() + deadline;
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            break st;
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "{cmd:?} did not finish within {} s",
                deadline.as_secs()
            ));
        }
        thread::sleep(Duration::from_millis(20));
    };
    let out = String::from_utf8_lossy(&out.join().unwrap()).into_owned();
    let err = String::from_utf8_lossy(&err.join().unwrap()).into_owned();
    Ok((status, out, err))
}

// ---------------------------------------------------------------------------------------------
// A private ITERON_HOME per case

struct Sandbox {
    root: PathBuf,
}

impl Sandbox {
    fn new(label: &str) -> Sandbox {
        static N: AtomicU64 = AtomicU64::new(0);
        let root = std::env::temp_dir().join(format!(
            "iteron-interop-{}-{}-{label}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("user")).unwrap();
        Sandbox { root }
    }

    fn home(&self) -> PathBuf {
        self.root.join("iteron-home")
    }

    fn iteron(&self, args: &[String]) -> Result<(ExitStatus, String, String), String> {
        let mut c = Command::new(env!("CARGO_BIN_EXE_iteron"));
        c.args(args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", self.root.join("user"))
            .env("ITERON_HOME", self.home());
        run_bounded(c, CLI_DEADLINE)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

// ---------------------------------------------------------------------------------------------
// Cases

/// How the server is reached.
enum Target {
    Stdio { program: PathBuf, args: Vec<String> },
    Http { url: String },
}

struct Case {
    peer: &'static str,
    transport: &'static str,
    mode: &'static str,
    expected_version: &'static str,
    /// Pin this version in the library instead of negotiating (the CLI cannot pin, so a
    /// pinned case skips `mcp test` and takes version and tools from the library).
    pin: Option<&'static str>,
    /// The server's name and version as `mcp test` reports them.
    server: (&'static str, &'static str),
    /// Tool names that must be listed.
    tools: &'static [&'static str],
    /// The exact tool count, when the peer's catalog is fixed.
    tool_count: Option<usize>,
    call_tool: &'static str,
    call_args: Value,
    /// The projected text must equal this…
    text_equals: Option<String>,
    /// …or contain this.
    text_contains: Option<String>,
    /// The peer needs the network: the host ceiling admits `web_egress` (a confined stdio
    /// server gets no sockets otherwise).
    web_egress: bool,
}

fn echo_case(
    peer: &'static str,
    transport: &'static str,
    mode: &'static str,
    expected_version: &'static str,
) -> Case {
    // Our own peer scripts name themselves after the SDK they run on.
    let server = match peer {
        "ts-sdk-v1" => ("iteron-interop-ts-v1", "1.32.2"),
        "ts-sdk-v2" => ("iteron-interop-ts-v2", "2.4.0"),
        "python-mcp" => ("iteron-interop-python", "2.3.0"),
        other => panic!("no echo peer {other}"),
    };
    Case {
        peer,
        transport,
        mode,
        expected_version,
        pin: None,
        server,
        tools: &["echo"],
        tool_count: Some(1),
        call_tool: "echo",
        call_args: json!({"text": "hi from iteron"}),
        text_equals: Some("hi from iteron".into()),
        text_contains: None,
        web_egress: false,
    }
}

fn everything_case(transport: &'static str, mode: &'static str) -> Case {
    Case {
        peer: "server-everything",
        transport,
        mode,
        expected_version: LEGACY,
        pin: None,
        server: ("mcp-servers/everything", "2.0.0"),
        tools: &["echo", "get-sum"],
        // No sampling, elicitation or roots declared: the 13-tool catalog (peers.md §2).
        tool_count: Some(13),
        call_tool: "echo",
        call_args: json!({"message": "hi"}),
        text_equals: Some("Echo: hi".into()),
        text_contains: None,
        web_egress: false,
    }
}

/// What a case observed; also the report line.
#[derive(Default)]
struct Observed {
    negotiated: Option<String>,
    tools: Option<usize>,
    call_passed: bool,
    failures: Vec<String>,
}

fn report(case: &Case, seen: &Observed) {
    let Some(path) = std::env::var_os("ITERON_INTEROP_REPORT") else {
        return;
    };
    static LOCK: Mutex<()> = Mutex::new(());
    let line = json!({
        "peer": case.peer,
        "transport": case.transport,
        "mode": case.mode,
        "expected_version": case.expected_version,
        "negotiated_version": seen.negotiated,
        "tools": seen.tools,
        "call": if seen.call_passed { "pass" } else { "fail" },
    });
    let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let mut f = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("cannot open ITERON_INTEROP_REPORT {path:?}: {e}"));
    // One write per line: O_APPEND keeps lines from concurrent test binaries whole.
    f.write_all(format!("{line}\n").as_bytes()).unwrap();
}

/// Whether a stdio peer must keep root's uid under a root test run: its program, or the `#!`
/// interpreter of a script, lies where uid 65534 (the default `sandbox.run_as` of a root
/// broker) cannot reach by file mode — a venv built from a pyenv Python under the 0700 `/root`
/// does. The operator's answer is the same: `--sandbox-run-as root` (said on stderr).
fn needs_root_uid(program: &Path) -> bool {
    use iteron_broker::confine::{NOBODY_ID, reachable_by};
    if !nix::unistd::geteuid().is_root() {
        return false;
    }
    let interpreter = fs::read(program).ok().and_then(|head| {
        let line = head
            .strip_prefix(b"#!")?
            .split(|b| *b == b'\n')
            .next()?
            .to_vec();
        let text = String::from_utf8(line).ok()?;
        text.split_whitespace().next().map(PathBuf::from)
    });
    std::iter::once(program.to_path_buf())
        .chain(interpreter)
        .any(|p| !reachable_by(&p, NOBODY_ID, NOBODY_ID, false))
}

/// `iteron mcp add peer …`.
fn cli_add(sb: &Sandbox, target: &Target) -> Result<(), String> {
    let mut add: Vec<String> = ["mcp", "add", "peer"].map(String::from).to_vec();
    match target {
        Target::Stdio { program, args } => {
            add.extend(["--stdio".to_owned(), s(program)]);
            if needs_root_uid(program) {
                eprintln!(
                    "interop: {} is out of uid 65534's reach: the peer runs with --sandbox-run-as root",
                    program.display()
                );
                add.extend(["--sandbox-run-as".to_owned(), "root".to_owned()]);
            }
            add.push("--".to_owned());
            add.extend(args.iter().cloned());
        }
        Target::Http { url } => add.extend(["--url".to_owned(), url.clone()]),
    }
    let (st, out, err) = sb.iteron(&add)?;
    if !st.success() {
        return Err(format!(
            "`iteron {}` failed ({st}): {out} {err}",
            add.join(" ")
        ));
    }
    Ok(())
}

/// Add `web_egress` to the host ceiling (what an operator does for a server that fetches), and
/// name the loopback address in each stdio server's `sandbox.egress`: the pages the farm's
/// fetch server reads are served on 127.0.0.1, and a `web_egress` server reaches nothing above
/// the public zone through its egress path unless the operator names it. (The server runs in
/// a network namespace of its own: its own 127.0.0.1 is another loopback, so a page it reads
/// came through the broker's egress path.)
fn admit_web_egress(sb: &Sandbox, needed: bool) -> Result<(), String> {
    if !needed {
        return Ok(());
    }
    let path = sb.home().join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
    let mut v: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    v["host_ceiling"] = serde_json::json!([
        "read_only",
        "workspace_write",
        "irreversible_external",
        "web_egress"
    ]);
    if let Some(servers) = v["mcp_servers"].as_array_mut() {
        for s in servers.iter_mut().filter(|s| s.get("command").is_some()) {
            s["sandbox"]["egress"] = serde_json::json!(["127.0.0.1"]);
        }
    }
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).map_err(|e| e.to_string())
}

/// `iteron mcp test peer --format json`: the probe's JSON or a failure message.
fn cli_test(sb: &Sandbox) -> Result<Value, String> {
    let test = ["mcp", "test", "peer", "--format", "json"].map(String::from);
    let (st, out, err) = sb.iteron(&test)?;
    if !st.success() {
        return Err(format!(
            "`iteron mcp test` failed ({st}); stderr: {} stdout: {}",
            err.trim(),
            out.trim()
        ));
    }
    serde_json::from_str(&out)
        .map_err(|e| format!("`iteron mcp test` printed no JSON ({e}): {out}"))
}

fn check_probe(case: &Case, probe: &Value, seen: &mut Observed) {
    seen.negotiated = probe["protocol_version"].as_str().map(str::to_owned);
    seen.tools = probe["tool_count"].as_u64().map(|n| n as usize);
    if seen.negotiated.as_deref() != Some(case.expected_version) {
        seen.failures.push(format!(
            "mcp test negotiated {:?}, expected {}; probe: {probe}",
            seen.negotiated, case.expected_version
        ));
    }
    let want_server = json!({"name": case.server.0, "version": case.server.1});
    if probe["server"] != want_server {
        seen.failures.push(format!(
            "mcp test reported server {}, expected {want_server}",
            probe["server"]
        ));
    }
    let names: Vec<String> = probe["tools"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    if seen.tools != Some(names.len()) {
        seen.failures.push(format!(
            "tool_count {:?} disagrees with {} listed names",
            seen.tools,
            names.len()
        ));
    }
    check_tools(case, &names, seen);
    if probe["dropped_tools"]
        .as_array()
        .is_some_and(|d| !d.is_empty())
    {
        seen.failures
            .push(format!("tools were dropped: {}", probe["dropped_tools"]));
    }
}

/// The expected tool names are listed, and the count is exact where the catalog is fixed.
fn check_tools(case: &Case, names: &[String], seen: &mut Observed) {
    for want in case.tools {
        if !names.iter().any(|n| n == want) {
            seen.failures
                .push(format!("tool {want:?} was not listed; listed {names:?}"));
        }
    }
    if let Some(n) = case.tool_count
        && names.len() != n
    {
        seen.failures.push(format!(
            "expected {n} tools, {} were listed: {names:?}",
            names.len()
        ));
    }
}

/// Connect through the library with the configuration the CLI wrote, list, call, close.
fn library_call(case: &Case, sb: &Sandbox, seen: &mut Observed) {
    let loaded = iteron_broker::store::Home::at(sb.home())
        .and_then(|home| home.load())
        .map_err(|e| format!("cannot load the configuration `mcp add` wrote: {e}"));
    let config = match loaded {
        Ok(c) => c,
        Err(e) => return seen.failures.push(e),
    };
    let Some(server) = config.server("peer").cloned() else {
        return seen
            .failures
            .push("the configuration has no server `peer`".into());
    };
    let network = config.network.clone();
    let args = case.call_args.as_object().cloned().unwrap_or_else(Map::new);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let outcome: Result<(String, Vec<String>, Projected), String> = rt.block_on(async {
        let work = async {
            let lookup = |_: &str| -> Option<OsString> { None };
            let mut opts = Options::default();
            if let Some(pin) = case.pin {
                let v = Version::parse(pin).unwrap_or_else(|| panic!("bad pin {pin}"));
                opts.version = VersionPolicy::Pin(v);
            }
            // The same confinement the broker applies.
            let ctx = iteron_broker::servers::SpawnContext {
                home: sb.home(),
                ceiling: config.ceiling(),
                egress: None,
            };
            let client = iteron_broker::servers::connect(&server, &network, &lookup, opts, &ctx)
                .await
                .map_err(|e| format!("library connect failed: {e}"))?;
            let version = client.era().version().as_str().to_owned();
            let called = match client.list_tools().await {
                Ok(tools) => {
                    let names: Vec<String> = tools.into_iter().map(|t| t.name).collect();
                    client
                        .call_tool(case.call_tool, args)
                        .await
                        .map(|p| (names, p))
                        .map_err(|e| format!("tools/call {} failed: {e}", case.call_tool))
                }
                Err(e) => Err(format!("library tools/list failed: {e}")),
            };
            let tail = client.stderr_tail(5).await;
            client.close().await;
            called
                .map(|(names, p)| (version, names, p))
                .map_err(|e| format!("{e} (server stderr: {})", tail.join(" | ")))
        };
        match tokio::time::timeout(CALL_DEADLINE, work).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "library connect/list/call/close did not finish within {} s",
                CALL_DEADLINE.as_secs()
            )),
        }
    });
    // Stop stray tasks (listeners, reapers) rather than wait for them.
    rt.shutdown_timeout(Duration::from_secs(2));
    let (version, names, result) = match outcome {
        Ok(x) => x,
        Err(e) => {
            seen.failures.push(e);
            return;
        }
    };
    if case.pin.is_some() {
        seen.negotiated = Some(version.clone());
        seen.tools = Some(names.len());
        check_tools(case, &names, seen);
    }
    let mut ok = true;
    if version != case.expected_version {
        ok = false;
        seen.failures.push(format!(
            "library negotiated {version}, expected {}",
            case.expected_version
        ));
    }
    if result.is_error {
        ok = false;
        seen.failures
            .push(format!("tools/call returned isError: {}", result.raw));
    }
    if let Some(want) = &case.text_equals
        && &result.text != want
    {
        ok = false;
        seen.failures.push(format!(
            "tools/call text {:?}, expected {want:?}; raw result: {}",
            result.text, result.raw
        ));
    }
    if let Some(want) = &case.text_contains
        && !result.text.contains(want.as_str())
    {
        ok = false;
        seen.failures.push(format!(
            "tools/call text does not contain {want:?}: {:?}",
            result.text
        ));
    }
    seen.call_passed = ok;
}

/// Run one case: the peers in `keep_alive` live until the end.
fn run_case(case: Case, start: impl FnOnce() -> Result<(Target, Vec<Peer>), String>) {
    require_setup();
    let label = format!("{}-{}-{}", case.peer, case.transport, case.mode);
    let sb = Sandbox::new(&label);
    let mut seen = Observed::default();
    let started = start();
    let mut peers = Vec::new();
    match started {
        Err(e) => seen.failures.push(format!("peer did not start: {e}")),
        Ok((target, p)) => {
            peers = p;
            let probed = cli_add(&sb, &target)
                .and_then(|()| admit_web_egress(&sb, case.web_egress))
                .and_then(|()| match case.pin {
                    Some(_) => Ok(None),
                    None => cli_test(&sb).map(Some),
                });
            match probed {
                Err(e) => seen.failures.push(e),
                Ok(probe) => {
                    if let Some(probe) = probe {
                        check_probe(&case, &probe, &mut seen);
                    }
                    library_call(&case, &sb, &mut seen);
                }
            }
        }
    }
    report(&case, &seen);
    let logs: Vec<String> = peers
        .iter()
        .map(|p| format!("{}: {}", p.label, p.logs()))
        .collect();
    drop(peers);
    assert!(
        seen.failures.is_empty(),
        "interop {} over {} ({}, expecting {}): {}{}",
        case.peer,
        case.transport,
        case.mode,
        case.expected_version,
        seen.failures.join("; "),
        if logs.is_empty() {
            String::new()
        } else {
            format!("\npeer output: {}", logs.join("\n"))
        }
    );
}

fn stdio(program: PathBuf, args: &[String]) -> Result<(Target, Vec<Peer>), String> {
    Ok((
        Target::Stdio {
            program,
            args: args.to_vec(),
        },
        Vec::new(),
    ))
}

fn http(started: Result<(Peer, String), String>) -> Result<(Target, Vec<Peer>), String> {
    let (peer, url) = started?;
    Ok((Target::Http { url }, vec![peer]))
}

fn ts_v1_http(stateful: bool, json_response: bool) -> Result<(Target, Vec<Peer>), String> {
    let mut cmd = Command::new(node());
    cmd.arg(peer_script("ts_v1_http.mjs"));
    if stateful {
        cmd.env("STATEFUL", "1");
    }
    if json_response {
        cmd.env("JSON_RESPONSE", "1");
    }
    http(start_http_peer("ts_v1_http.mjs", cmd))
}

fn py_http(flags: &[&str]) -> Result<(Target, Vec<Peer>), String> {
    let mut cmd = Command::new(venv_bin("python"));
    cmd.arg(peer_script("py_server.py")).arg("http").args(flags);
    http(start_http_peer("py_server.py", cmd))
}

// --- server-everything 2026.8.31 (sdk 1.32.2): legacy only ----------------------------------

#[test]
fn everything_stdio() {
    // With capabilities declared it ignores stdin EOF; the client's stop ladder reaps it.
    run_case(everything_case("stdio", "default"), || {
        stdio(node(), &[s(&everything_js()), "stdio".into()])
    });
}

#[test]
fn everything_http() {
    run_case(everything_case("http", "stateful-sse"), || {
        http(start_everything_http())
    });
}

/// 2025-06-18 through the library pin: SSE without the priming event.
#[test]
fn everything_http_pinned_2025_06_18() {
    let mut case = everything_case("http", "stateful-sse-pinned-2025-06-18");
    case.pin = Some("2025-06-18");
    case.expected_version = "2025-06-18";
    run_case(case, || http(start_everything_http()));
}

// --- TS SDK v1 1.32.2: tops out at 2025-11-25 ------------------------------------------------

#[test]
fn ts_v1_stdio() {
    run_case(echo_case("ts-sdk-v1", "stdio", "default", LEGACY), || {
        stdio(node(), &[s(&peer_script("ts_v1_stdio.mjs"))])
    });
}

#[test]
fn ts_v1_http_stateful_sse() {
    run_case(
        echo_case("ts-sdk-v1", "http", "stateful-sse", LEGACY),
        || ts_v1_http(true, false),
    );
}

#[test]
fn ts_v1_http_stateful_json() {
    run_case(
        echo_case("ts-sdk-v1", "http", "stateful-json", LEGACY),
        || ts_v1_http(true, true),
    );
}

#[test]
fn ts_v1_http_stateless_json() {
    run_case(
        echo_case("ts-sdk-v1", "http", "stateless-json", LEGACY),
        || ts_v1_http(false, true),
    );
}

// --- TS SDK v2 2.4.0: 2026-07-28 through server/discover --------------------------------------

#[test]
fn ts_v2_http() {
    run_case(echo_case("ts-sdk-v2", "http", "auto", MODERN), || {
        let mut cmd = Command::new(node());
        cmd.arg(peer_script("ts_v2_http.mjs"));
        http(start_http_peer("ts_v2_http.mjs", cmd))
    });
}

/// The 2025 leg of createMcpHandler (stateless SSE; GET answered 405), through the library pin.
#[test]
fn ts_v2_http_pinned_legacy() {
    let mut case = echo_case("ts-sdk-v2", "http", "pinned-2025-11-25", LEGACY);
    case.pin = Some(LEGACY);
    run_case(case, || {
        let mut cmd = Command::new(node());
        cmd.arg(peer_script("ts_v2_http.mjs"));
        http(start_http_peer("ts_v2_http.mjs", cmd))
    });
}

// --- Python mcp 2.3.0: 2026-07-28 on stdio and HTTP -------------------------------------------

#[test]
fn python_stdio() {
    run_case(echo_case("python-mcp", "stdio", "default", MODERN), || {
        stdio(
            venv_bin("python"),
            &[s(&peer_script("py_server.py")), "stdio".into()],
        )
    });
}

#[test]
fn python_http_default() {
    // Server defaults (stateful, SSE); under 2026-07-28 it answers JSON without sessions.
    run_case(echo_case("python-mcp", "http", "default", MODERN), || {
        py_http(&[])
    });
}

#[test]
fn python_http_json_response() {
    run_case(
        echo_case("python-mcp", "http", "json-response", MODERN),
        || py_http(&["--json-response"]),
    );
}

#[test]
fn python_http_stateless() {
    run_case(echo_case("python-mcp", "http", "stateless", MODERN), || {
        py_http(&["--stateless"])
    });
}

/// Python's legacy era (initialize), through the library pin.
#[test]
fn python_stdio_pinned_legacy() {
    let mut case = echo_case("python-mcp", "stdio", "pinned-2025-11-25", LEGACY);
    case.pin = Some(LEGACY);
    run_case(case, || {
        stdio(
            venv_bin("python"),
            &[s(&peer_script("py_server.py")), "stdio".into()],
        )
    });
}

/// Python over stdio pinned to 2025-06-18: the oldest supported version, end to end.
#[test]
fn python_stdio_pinned_2025_06_18() {
    let mut case = echo_case("python-mcp", "stdio", "pinned-2025-06-18", "2025-06-18");
    case.pin = Some("2025-06-18");
    run_case(case, || {
        stdio(
            venv_bin("python"),
            &[s(&peer_script("py_server.py")), "stdio".into()],
        )
    });
}

/// Python's legacy era over stateful HTTP: SSE responses and an Mcp-Session-Id.
#[test]
fn python_http_pinned_legacy() {
    let mut case = echo_case(
        "python-mcp",
        "http",
        "stateful-sse-pinned-2025-11-25",
        LEGACY,
    );
    case.pin = Some(LEGACY);
    run_case(case, || py_http(&[]));
}

// --- mcp-server-fetch 2026.10.24 (on mcp 2.3.0): stdio, 2026-07-28 ----------------------------

/// A loopback `python3 -m http.server` serving one page; the fetch server reads it (with
/// `--allow-private-ips --ignore-robots-txt`), so nothing leaves the machine.
fn page_server(dir: &Path) -> Result<(Peer, u16), String> {
    fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    fs::write(
        dir.join("page.html"),
        "<!doctype html><html><head><title>Iteron interop</title></head><body>\
         <h1>Iteron interop page</h1><p>The marker is interop-marker-5e2f.</p></body></html>\n",
    )
    .map_err(|e| e.to_string())?;
    let mut cmd = Command::new(venv_bin("python"));
    cmd.args([
        "-u",
        "-m",
        "http.server",
        "0",
        "--bind",
        "127.0.0.1",
        "--directory",
    ])
    .arg(dir);
    let mut peer = Peer::spawn("http.server", cmd)?;
    // "Serving HTTP on 127.0.0.1 port 41234 (http://127.0.0.1:41234/) ..."
    let port = peer
        .wait_port(|l| {
            let rest = l.strip_prefix("Serving HTTP on ")?;
            rest.split_once(" port ")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .map_err(Exit::message)?;
    Ok((peer, port))
}

#[test]
fn fetch_stdio() {
    let pages = std::env::temp_dir().join(format!("iteron-interop-pages-{}", std::process::id()));
    let started = page_server(&pages);
    let url = started
        .as_ref()
        .map(|(_, port)| format!("http://127.0.0.1:{port}/page.html"))
        .unwrap_or_default();
    let case = Case {
        peer: "mcp-server-fetch",
        transport: "stdio",
        mode: "default",
        expected_version: MODERN,
        pin: None,
        server: ("mcp-fetch", "2026.10.24"),
        tools: &["fetch"],
        tool_count: Some(1),
        call_tool: "fetch",
        call_args: json!({"url": url, "max_length": 5000}),
        text_equals: None,
        text_contains: Some("interop-marker-5e2f".into()),
        web_egress: true,
    };
    run_case(case, || {
        let (page_peer, _) = started?;
        let (target, _) = stdio(
            venv_bin("mcp-server-fetch"),
            &["--allow-private-ips".into(), "--ignore-robots-txt".into()],
        )?;
        Ok((target, vec![page_peer]))
    });
    let _ = fs::remove_dir_all(&pages);
}
