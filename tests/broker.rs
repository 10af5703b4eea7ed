//! End-to-end tests of `iteron broker serve` and its two sockets, with the real `iteron` binary
//! as broker, operator and agent, and real MCP servers as children: the official
//! `@modelcontextprotocol/server-everything` (installed from `tests/interop/package-lock.json`)
//! and the repository's scripted fixture where the test must see what the server received.
//!
//! Privilege tests run the hostile side as uid 65534 (the suite runs as root in CI, and root
//! bypasses file modes and a same-uid peer check, so nothing negative would be proven as root).

#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use iteron_broker::ipc::client::Connection;
use iteron_test_support::{self as support, is_root, node, text, wait_child};
use serde_json::{Value, json};

/// A one-thread runtime for a test's agent and operator side.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

const NOBODY: u32 = 65534;

fn iteron() -> &'static str {
    env!("CARGO_BIN_EXE_iteron")
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn everything_js() -> PathBuf {
    let p = repo()
        .join("tests/interop/node_modules/@modelcontextprotocol/server-everything/dist/index.js");
    assert!(
        p.exists(),
        "the official everything server is not installed: run tests/interop/setup (./scripts/test does)"
    );
    p
}

/// A private test area: `base` (0755, so uid 65534 can traverse where a test allows it) with
/// `home` (0700) inside.
struct Area {
    base: PathBuf,
}

impl Area {
    fn new(name: &str) -> Area {
        Area {
            base: support::private_area("iteron-broker", name),
        }
    }

    fn home(&self) -> PathBuf {
        self.base.join("home")
    }

    fn agent_socket(&self) -> PathBuf {
        self.base.join("run").join("agent.sock")
    }

    fn operator_socket(&self) -> PathBuf {
        self.home().join("run").join("operator.sock")
    }

    fn config(&self, servers: Value) {
        self.write_config(&json!({"schema_version": 2, "mcp_servers": servers}));
    }

    /// Write a whole configuration (0600).
    fn write_config(&self, config: &Value) {
        support::write_private_json(&self.home().join("config.json"), config);
    }

    fn everything(&self) {
        self.config(json!([{
            "name": "ev",
            "transport": "stdio",
            "command": node().to_str().unwrap(),
            "args": [everything_js().to_str().unwrap(), "stdio"],
            "env": ["ITERON_TEST_FORWARDED"],
            "tools": {"deny": ["trigger-sampling-request"]},
            "policy": {"tools": {"get-sum": []}}
        }]));
    }

    fn iteron(&self, args: &[&str]) -> Command {
        let mut c = Command::new(iteron());
        c.args(args)
            .env("ITERON_HOME", self.home())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.iteron(args).output().unwrap()
    }

    /// Start a broker; `extra` are more flags; `env` more variables for the broker.
    fn broker(&self, extra: &[&str], env: &[(&str, &str)]) -> Broker {
        let sock = self.agent_socket();
        let mut args = vec!["broker", "serve", "--socket", sock.to_str().unwrap()];
        args.extend_from_slice(extra);
        let mut cmd = self.iteron(&args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        let b = Broker {
            child,
            socket: self.operator_socket(),
        };
        if support::wait_listening(&[&sock, &self.operator_socket()], Duration::from_secs(15)) {
            return b;
        }
        panic!("the broker did not start: {}", b.finish().1);
    }

    fn agent(&self, args: &[&str]) -> Command {
        let sock = self.agent_socket();
        let mut full = vec!["agent", "--socket", sock.to_str().unwrap()];
        full.extend_from_slice(args);
        let mut c = Command::new(iteron());
        // The agent needs only the socket: no ITERON_HOME.
        c.args(&full)
            .env_remove("ITERON_HOME")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn pending(&self) -> Vec<Value> {
        let out = self.run(&["approvals", "list", "--format", "json"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["pending"].as_array().unwrap().clone()
    }

    fn wait_pending(&self, n: usize) -> Vec<Value> {
        support::wait_pending(n, Duration::from_secs(30), || self.pending())
    }

    /// Wait for one call to need approval, approve it, return its id.
    fn approve_next(&self) -> String {
        let p = self.wait_pending(1);
        let id = p[0]["id"].as_u64().unwrap().to_string();
        assert!(self.run(&["approvals", "approve", &id]).status.success());
        id
    }

    fn status(&self) -> Value {
        let out = self.run(&["broker", "status", "--format", "json"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    fn audit_records(&self) -> Vec<Value> {
        support::audit_records(&self.home())
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

struct Broker {
    child: Child,
    socket: PathBuf,
}

impl Broker {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGTERM, wait (bounded), and return the exit code and stderr.
    fn finish(self) -> (Option<i32>, String) {
        self.finish_with(nix::sys::signal::Signal::SIGTERM)
    }

    /// `signal`, wait (bounded), and return the exit code and stderr.
    fn finish_with(mut self, signal: nix::sys::signal::Signal) -> (Option<i32>, String) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), signal);
        let deadline = Instant::now() + Duration::from_secs(20);
        let code = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the broker did not stop within 20 s of {signal}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        (code, err)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = &self.socket;
    }
}

#[test]
fn a_noninteractive_broker_hides_unexposed_tools_and_refuses_every_call() {
    let area = Area::new("nonint");
    area.everything();
    let broker = area.broker(&["--noninteractive"], &[]);

    // Nothing starts before a request needs it.
    let st = area.status();
    assert_eq!(st["servers"][0]["phase"], "idle");
    assert_eq!(st["servers"][0]["generation"], 0);
    assert_eq!(st["interactive"], false);

    let out = area.agent(&["tools", "--format", "json"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let tools: Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = tools["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"echo"), "{names:?}");
    // Hidden by policy (admits nothing) and by the deny filter: invisible.
    assert!(!names.contains(&"get-sum"), "{names:?}");
    assert!(!names.contains(&"trigger-sampling-request"), "{names:?}");

    // An unexposed tool answers exactly like one that does not exist.
    let hidden = area
        .agent(&["call", "ev", "get-sum", "--json", r#"{"a":1,"b":2}"#])
        .output()
        .unwrap();
    let unknown = area
        .agent(&["call", "ev", "no-such-tool"])
        .output()
        .unwrap();
    let no_server = area.agent(&["call", "nope", "echo"]).output().unwrap();
    assert_eq!(hidden.status.code(), Some(9));
    assert_eq!(hidden.stderr, unknown.stderr);
    assert_eq!(hidden.stderr, no_server.stderr);
    assert_eq!(hidden.stdout, unknown.stdout);
    assert_eq!(
        text(&hidden.stderr).trim(),
        "iteron: error: broker: unknown_tool: unknown tool"
    );

    // An exposed tool needs approval, and a noninteractive broker refuses with a reason.
    let refused = area
        .agent(&["call", "ev", "echo", "--json", r#"{"message":"hi"}"#])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(9), "{}", text(&refused.stderr));
    let line = text(&refused.stderr);
    assert_eq!(line.lines().count(), 1);
    assert!(
        line.contains("approval_required") && line.contains("noninteractive"),
        "{line}"
    );
    assert!(line.contains("not_sent"), "{line}");

    let st = area.status();
    assert_eq!(st["servers"][0]["phase"], "ready");
    assert_eq!(st["servers"][0]["generation"], 1);
    // Issue 14.20: the vocabulary of every JSON output (`protocol_version`, `tool_count` and
    // `tools` names, `schema_version` on the top-level object); `version` is kept.
    assert_eq!(st["schema_version"], 2);
    let count = st["servers"][0]["tool_count"].as_u64().unwrap();
    assert!(count >= 10);
    let names = st["servers"][0]["tools"].as_array().unwrap();
    assert_eq!(names.len() as u64, count);
    assert!(names.iter().any(|n| n == "echo"), "{st}");
    assert_eq!(st["servers"][0]["protocol_version"], "2025-11-25");
    assert_eq!(st["servers"][0]["version"], "2025-11-25");

    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    let records = area.audit_records();
    let outcomes: Vec<&str> = records
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert!(outcomes.contains(&"approval_required"), "{outcomes:?}");
    assert_eq!(outcomes.iter().filter(|o| **o == "unknown_tool").count(), 3);
    // Arguments never appear, only their digest.
    let raw = std::fs::read_dir(area.home().join("audit"))
        .unwrap()
        .flatten()
        .fold(String::new(), |mut acc, e| {
            acc.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
            acc
        });
    assert!(!raw.contains("\"message\""));
    let verify = area.run(&["audit", "verify"]);
    assert!(verify.status.success(), "{}", text(&verify.stderr));

    // Any edit is caught by the command, with the file and line named.
    let day = std::fs::read_dir(area.home().join("audit"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .unwrap();
    let log = std::fs::read_to_string(&day).unwrap();
    std::fs::write(&day, log.replacen("\"approval_required\"", "\"ok\"", 1)).unwrap();
    let verify = area.run(&["audit", "verify"]);
    assert_eq!(verify.status.code(), Some(10));
    let line = text(&verify.stderr);
    assert!(
        line.contains("audit log verification failed") && line.contains(".jsonl line"),
        "{line}"
    );
}

#[test]
fn the_operator_approves_or_denies_each_call_and_secrets_stay_out_of_results() {
    let area = Area::new("approve");
    area.everything();
    let canary_env = "iteron-canary-not-for-the-agent-7d1f";
    let forwarded = "iteron-forwarded-canary-0b3e";
    let broker = area.broker(
        &[],
        &[
            ("ITERON_TEST_UNNAMED_SECRET", canary_env),
            ("ITERON_TEST_FORWARDED", forwarded),
        ],
    );

    let call = area
        .agent(&[
            "call",
            "ev",
            "echo",
            "--json",
            r#"{"message":"approved hello"}"#,
        ])
        .spawn()
        .unwrap();
    let p = area.wait_pending(1);
    assert_eq!(p[0]["kind"], "call");
    assert_eq!(p[0]["server"], "ev");
    assert_eq!(p[0]["tool"], "echo");
    assert!(
        p[0]["arguments"]
            .as_str()
            .unwrap()
            .contains("approved hello")
    );
    let id = p[0]["id"].as_u64().unwrap().to_string();
    // Nothing reached the server before approval: the agent is still waiting.
    assert!(area.run(&["approvals", "approve", &id]).status.success());
    let out = wait_child(call);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "Echo: approved hello");
    // Approving twice finds nothing.
    assert_eq!(
        area.run(&["approvals", "approve", &id]).status.code(),
        Some(4)
    );

    let call = area
        .agent(&["call", "ev", "echo", "--json", r#"{"message":"no"}"#])
        .spawn()
        .unwrap();
    let p = area.wait_pending(1);
    let id = p[0]["id"].as_u64().unwrap().to_string();
    assert!(area.run(&["approvals", "deny", &id]).status.success());
    let out = wait_child(call);
    assert_eq!(out.status.code(), Some(9));
    assert!(
        text(&out.stderr).contains("denied"),
        "{}",
        text(&out.stderr)
    );

    // The child's environment: the unnamed secret never reaches it; the forwarded one does
    // (the operator named it) but is scrubbed from what the agent gets back.
    let call = area
        .agent(&["call", "ev", "get-env", "--format", "json"])
        .spawn()
        .unwrap();
    area.approve_next();
    let out = wait_child(call);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(shown.contains("ITERON_TEST_FORWARDED"), "{shown}");
    assert!(!shown.contains(forwarded), "{shown}");
    assert!(!shown.contains(canary_env), "{shown}");
    assert!(!shown.contains("ITERON_TEST_UNNAMED_SECRET"), "{shown}");

    let (code, err) = broker.finish();
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains(canary_env) && !err.contains(forwarded));
    let records = area.audit_records();
    let decided: Vec<(&str, &str)> = records
        .iter()
        .filter(|r| r["kind"] == "call_tool" && r["outcome"] != "dispatching")
        .map(|r| {
            (
                r["decision"].as_str().unwrap(),
                r["outcome"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        decided,
        vec![("approved", "ok"), ("denied", "denied"), ("approved", "ok")]
    );
    // Each approved effect was audited before it was sent.
    let dispatched = records
        .iter()
        .filter(|r| r["kind"] == "call_tool" && r["outcome"] == "dispatching")
        .count();
    assert_eq!(dispatched, 2);
    let all = serde_json::to_string(&records).unwrap();
    assert!(
        !all.contains(canary_env) && !all.contains(forwarded) && !all.contains("approved hello")
    );
    assert!(area.run(&["audit", "verify"]).status.success());
}

/// The official server asks for a form in the middle of a call (`elicitation/create`): it
/// reaches the operator through the operator socket, an answer that does not fit the schema is
/// refused, a fitting one reaches the server; a noninteractive broker offers no forms at all.
#[test]
fn forms_reach_the_operator_and_only_the_operator() {
    let area = Area::new("forms");
    area.everything();
    let broker = area.broker(&[], &[]);
    let call = area
        .agent(&["call", "ev", "trigger-elicitation-request"])
        .spawn()
        .unwrap();
    let p = area.wait_pending(1);
    assert_eq!(p[0]["kind"], "call");
    let id = p[0]["id"].as_u64().unwrap().to_string();
    assert!(area.run(&["approvals", "approve", &id]).status.success());
    let p = area.wait_pending(1);
    assert_eq!(p[0]["kind"], "form");
    assert_eq!(p[0]["server"], "ev");
    assert_eq!(p[0]["schema"]["required"], json!(["name"]));
    let id = p[0]["id"].as_u64().unwrap().to_string();
    let wrong = area.run(&["approvals", "answer", &id, "--json", r#"{"name": 5}"#]);
    assert_eq!(wrong.status.code(), Some(9), "{}", text(&wrong.stderr));
    assert!(text(&wrong.stderr).contains("does not fit the form"));
    assert_eq!(
        area.pending().len(),
        1,
        "a refused answer must leave the form waiting"
    );
    let right = area.run(&[
        "approvals",
        "answer",
        &id,
        "--json",
        r#"{"name": "Op Erator"}"#,
    ]);
    assert!(right.status.success(), "{}", text(&right.stderr));
    let out = wait_child(call);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("Op Erator"),
        "{}",
        text(&out.stdout)
    );
    drop(broker);

    // Noninteractive: the client advertises no form support, so the server does not even
    // offer the tool.
    let broker = area.broker(&["--noninteractive"], &[]);
    let out = area.agent(&["tools"]).output().unwrap();
    assert!(out.status.success());
    assert!(!text(&out.stdout).contains("trigger-elicitation-request"));
    drop(broker);
}

/// A 2026-07-28 server asks for input inside a tool call (MRTR `input_required`): the form
/// reaches the operator, and the answer goes back to the server with its request state.
#[test]
fn mrtr_input_requests_reach_the_operator() {
    let area = Area::new("mrtr");
    area.config(json!([{
        "name": "m",
        "transport": "stdio",
        "command": "/usr/bin/python3",
        "args": [repo().join("fixtures/stdio/scripted_server.py").to_str().unwrap(), "mrtr"],
    }]));
    let broker = area.broker(&[], &[]);
    let call = area
        .agent(&["call", "m", "echo", "--format", "json"])
        .spawn()
        .unwrap();
    area.approve_next();
    let p = area.wait_pending(1);
    assert_eq!(p[0]["kind"], "form");
    assert_eq!(p[0]["message"], "Confirm?");
    let id = p[0]["id"].as_u64().unwrap().to_string();
    assert!(
        area.run(&["approvals", "answer", &id, "--json", r#"{"ok": false}"#])
            .status
            .success()
    );
    let out = wait_child(call);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    let v: Value = serde_json::from_str(answer["text"].as_str().unwrap()).unwrap();
    assert_eq!(v["inputResponses"]["confirm"]["action"], "accept");
    assert_eq!(v["inputResponses"]["confirm"]["content"]["ok"], false);
    assert_eq!(v["requestState"], "opaque-\u{e9}-state");
    drop(broker);
}

/// Several waiting calls can be decided in one command; each is still decided and audited on
/// its own, and an id that is not waiting is named.
#[test]
fn several_calls_are_approved_in_one_command_and_each_is_audited() {
    let area = Area::new("batch");
    area.everything();
    let broker = area.broker(&[], &[]);
    let calls: Vec<_> = (0..2)
        .map(|i| {
            area.agent(&[
                "call",
                "ev",
                "echo",
                "--json",
                &format!(r#"{{"message":"m{i}"}}"#),
            ])
            .spawn()
            .unwrap()
        })
        .collect();
    let p = area.wait_pending(2);
    let ids: Vec<String> = p
        .iter()
        .map(|i| i["id"].as_u64().unwrap().to_string())
        .collect();
    let out = area.run(&["approvals", "approve", &ids[0], &ids[1]]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).lines().count(), 2);
    for c in calls {
        assert!(wait_child(c).status.success());
    }
    let out = area.run(&["approvals", "deny", &ids[0], "999999"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(
        text(&out.stderr).contains("not waiting"),
        "{}",
        text(&out.stderr)
    );
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    let decisions = area
        .audit_records()
        .iter()
        .filter(|r| r["kind"] == "operator_decide")
        .count();
    assert_eq!(
        decisions, 4,
        "two approvals and two failed denials, one record each"
    );
}

#[test]
fn live_control_cancels_restarts_and_stops_that_exact_server() {
    let area = Area::new("control");
    area.everything();
    let broker = area.broker(&[], &[]);

    // A long call, approved, then cancelled by the operator.
    let call = area
        .agent(&[
            "call",
            "ev",
            "trigger-long-running-operation",
            "--json",
            r#"{"duration":30,"steps":30}"#,
        ])
        .spawn()
        .unwrap();
    area.approve_next();
    let deadline = Instant::now() + Duration::from_secs(20);
    while area.status()["servers"][0]["in_flight"] != 1 {
        assert!(Instant::now() < deadline, "the call never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let cancelled = area.run(&["broker", "cancel", "ev"]);
    assert!(cancelled.status.success(), "{}", text(&cancelled.stderr));
    assert_eq!(
        text(&cancelled.stdout).trim(),
        "cancelled 1 call(s) in flight"
    );
    let out = wait_child(call);
    assert_eq!(out.status.code(), Some(9));
    let line = text(&out.stderr);
    assert!(
        line.contains("cancelled") && line.contains("maybe_applied"),
        "{line}"
    );

    let st = area.status()["servers"][0].clone();
    assert_eq!(
        (st["phase"].as_str(), st["generation"].as_u64()),
        (Some("ready"), Some(1))
    );

    // Restart: back to idle, catalog cleared; the next request reconnects (generation 2).
    assert!(area.run(&["broker", "restart", "ev"]).status.success());
    let st = area.status()["servers"][0].clone();
    assert_eq!(st["phase"], "idle");
    assert_eq!(st["tools"], Value::Null);
    assert!(area.agent(&["tools"]).output().unwrap().status.success());
    let st = area.status()["servers"][0].clone();
    assert_eq!(
        (st["phase"].as_str(), st["generation"].as_u64()),
        (Some("ready"), Some(2))
    );

    // Stop: the server stays down, the agent gets a clear refusal, nothing is sent.
    assert!(area.run(&["broker", "stop", "ev"]).status.success());
    assert_eq!(area.status()["servers"][0]["phase"], "stopped");
    let out = area
        .agent(&["call", "ev", "echo", "--json", r#"{"message":"x"}"#])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(8));
    assert!(
        text(&out.stderr).contains("not_sent"),
        "{}",
        text(&out.stderr)
    );
    let listed = area.agent(&["tools", "--format", "json"]).output().unwrap();
    let v: Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(v["unavailable"], json!(["ev"]));

    // Unknown servers are reported as such; status of one server works.
    assert_eq!(
        area.run(&["broker", "restart", "nope"]).status.code(),
        Some(4)
    );
    let one = area.run(&["broker", "status", "ev"]);
    assert!(
        text(&one.stdout).contains("phase=stopped"),
        "{}",
        text(&one.stdout)
    );

    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    let kinds: Vec<String> = area
        .audit_records()
        .iter()
        .map(|r| r["kind"].as_str().unwrap().to_owned())
        .collect();
    for k in ["operator_cancel", "operator_restart", "operator_stop"] {
        assert!(kinds.iter().any(|x| x == k), "{k} not audited: {kinds:?}");
    }
}

fn scripted_area(name: &str) -> (Area, PathBuf, String) {
    let area = Area::new(name);
    // The server is confined: it may write only to its scratch directory and what the
    // operator grants, here the log directory.
    let logs = area.base.join("logs");
    std::fs::create_dir(&logs).unwrap();
    support::give_to_children(&logs);
    let log = logs.join("server.log");
    let marker = format!("marker-{name}-{}", std::process::id());
    area.config(json!([{
        "name": "hang",
        "transport": "stdio",
        "command": "/usr/bin/python3",
        "args": [repo().join("fixtures/stdio/scripted_server.py").to_str().unwrap(), "hang", marker],
        "env": ["SCRIPT_LOG"],
        "sandbox": {"writable": [logs.to_str().unwrap()]},
    }]));
    (area, log, marker)
}

/// Wait until the scripted server has logged a message containing `needle`.
fn wait_for_log(log: &std::path::Path, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(log)
        .unwrap_or_default()
        .contains(needle)
    {
        assert!(
            Instant::now() < deadline,
            "the server never received {needle}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn processes_with(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(marker))
                .unwrap_or(false)
        })
        .count()
}

#[test]
fn an_agent_that_disconnects_cancels_its_approval_and_its_call() {
    let (area, log, _) = scripted_area("disconnect");
    let broker = area.broker(&[], &[("SCRIPT_LOG", log.to_str().unwrap())]);

    // Waiting for approval, the agent goes away: the item disappears from the operator's list.
    let mut call = area.agent(&["call", "hang", "echo"]).spawn().unwrap();
    area.wait_pending(1);
    call.kill().unwrap();
    call.wait().unwrap();
    area.wait_pending(0);

    // Approved and in flight at the server, the agent goes away: the server is told.
    let mut call = area
        .agent(&["call", "hang", "echo", "--json", r#"{"text":"x"}"#])
        .spawn()
        .unwrap();
    area.approve_next();
    wait_for_log(&log, "tools/call");
    call.kill().unwrap();
    call.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let seen = std::fs::read_to_string(&log).unwrap_or_default();
        if seen.contains("notifications/cancelled") {
            assert!(seen.contains("the caller went away"), "{seen}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no cancellation reached the server: {seen}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    let outcomes: Vec<(String, String)> = area
        .audit_records()
        .iter()
        .filter(|r| r["kind"] == "call_tool" && r["outcome"] != "dispatching")
        .map(|r| {
            (
                r["decision"].as_str().unwrap().into(),
                r["outcome"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        vec![
            (
                "awaiting_approval".to_owned(),
                "cancelled_by_disconnect".to_owned()
            ),
            ("approved".to_owned(), "cancelled_by_disconnect".to_owned())
        ]
    );
}

#[test]
fn sigterm_answers_in_flight_calls_and_reaps_every_child() {
    let (area, log, marker) = scripted_area("sigterm");
    let broker = area.broker(&[], &[("SCRIPT_LOG", log.to_str().unwrap())]);
    let call = area.agent(&["call", "hang", "echo"]).spawn().unwrap();
    area.approve_next();
    wait_for_log(&log, "tools/call");
    assert_eq!(processes_with(&marker), 1);
    let (code, err) = broker.finish();
    assert_eq!(code, Some(0), "{err}");
    let out = wait_child(call);
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    let line = text(&out.stderr);
    assert!(line.contains("shutting_down"), "{line}");
    assert_eq!(
        processes_with(&marker),
        0,
        "a server process outlived the broker"
    );
    assert!(!area.agent_socket().exists() && !area.operator_socket().exists());
    let records = area.audit_records();
    assert_eq!(records.last().unwrap()["kind"], "broker_stop");
    assert!(area.run(&["audit", "verify"]).status.success());
}

/// Issue 14.18: SIGHUP (the terminal the broker ran in closed) stops it like SIGTERM: exit 0,
/// a `broker_stop` record, both sockets removed, a log that verifies.
#[test]
fn sighup_stops_the_broker_cleanly() {
    let area = Area::new("sighup");
    area.config(json!([]));
    let broker = area.broker(&["--noninteractive"], &[]);
    let (code, err) = broker.finish_with(nix::sys::signal::Signal::SIGHUP);
    assert_eq!(code, Some(0), "{err}");
    assert!(!area.agent_socket().exists() && !area.operator_socket().exists());
    let records = area.audit_records();
    assert_eq!(
        records.last().unwrap()["kind"],
        "broker_stop",
        "{records:?}"
    );
    assert!(area.run(&["audit", "verify"]).status.success());
}

#[test]
fn a_second_broker_on_the_same_home_or_socket_is_refused() {
    let area = Area::new("twice");
    area.config(json!([]));
    let first = area.broker(&["--noninteractive"], &[]);
    let second = area.run(&[
        "broker",
        "serve",
        "--noninteractive",
        "--socket",
        area.agent_socket().to_str().unwrap(),
    ]);
    assert_eq!(second.status.code(), Some(1));
    let all = text(&second.stderr);
    // The first line (if any) names ignored environment variables; the error is one line.
    let errors: Vec<&str> = all
        .lines()
        .filter(|l| l.starts_with("iteron: error"))
        .collect();
    assert_eq!(errors.len(), 1, "{all}");
    let line = errors[0];
    assert!(
        line.contains("another running broker") || line.contains("another broker"),
        "{line}"
    );
    drop(first);
}

#[test]
fn protocol_violations_get_one_error_frame_and_the_connection_closes() {
    let area = Area::new("frames");
    area.config(json!([]));
    let broker = area.broker(&["--noninteractive"], &[]);
    let rt = runtime();
    let sock = area.agent_socket();
    rt.block_on(async {
        // Out of state: a call before hello.
        let mut c = Connection::connect(&sock).await.unwrap();
        let err = c
            .request("call_tool", json!({"server": "s", "tool": "t"}))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("before hello"), "{err}");
        assert_eq!(c.read_value().await.unwrap(), None);

        // A second hello is out of state too.
        let mut c = Connection::connect(&sock).await.unwrap();
        c.hello("t").await.unwrap();
        let err = c.hello("t").await.unwrap_err();
        assert!(err.to_string().starts_with("protocol"), "{err}");
        assert_eq!(c.read_value().await.unwrap(), None);

        // Wrong protocol version.
        let mut c = Connection::connect(&sock).await.unwrap();
        let err = c
            .request("hello", json!({"protocol": 2}))
            .await
            .unwrap_err();
        assert!(err.to_string().starts_with("version"), "{err}");

        // Operator requests on the agent socket are unknown.
        let mut c = Connection::connect(&sock).await.unwrap();
        c.hello("t").await.unwrap();
        let err = c.request("pending", json!({})).await.unwrap_err();
        assert!(err.to_string().contains("unknown request"), "{err}");

        // One byte over the frame bound: refused from the header alone.
        let mut raw = tokio::net::UnixStream::connect(&sock).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let over = u32::try_from(iteron_broker::ipc::frame::MAX_FRAME + 1).unwrap();
        raw.write_all(&over.to_be_bytes()).await.unwrap();
        let mut len = [0u8; 4];
        raw.read_exact(&mut len).await.unwrap();
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        raw.read_exact(&mut body).await.unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "protocol");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("over the maximum")
        );
        let mut rest = Vec::new();
        raw.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    });
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    let protocol_errors = area
        .audit_records()
        .iter()
        .filter(|r| r["kind"] == "protocol_error")
        .count();
    assert_eq!(protocol_errors, 5);
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

/// Send `n` `pending` long-polls that hold their slot for up to 30 s (nothing is waiting for
/// approval), without reading the answers.
async fn hold(c: &mut Connection, first_id: usize, n: usize) {
    for i in 0..n {
        let f = json!({"id": first_id + i, "method": "pending", "params": {"wait_ms": 30000}});
        c.send_raw(f.to_string().as_bytes()).await.unwrap();
    }
}

/// Resources and prompts over IPC: lists like `list_tools`; a read or a prompt goes through
/// exposure, per-call approval and the audit like a tool call; a server whose policy does not
/// admit what an MCP request carries answers exactly like an unknown one and is never started.
#[test]
fn resources_and_prompts_are_listed_approved_per_read_and_audited() {
    let area = Area::new("reads");
    let ev = |name: &str, policy: Value| {
        json!({"name": name, "transport": "stdio", "command": node().to_str().unwrap(),
               "args": [everything_js().to_str().unwrap(), "stdio"], "policy": policy,
               "env": ["ITERON_TEST_FORWARDED"]})
    };
    // The tool hooks run around every effect: tool calls, resource reads, prompts.
    let logs = area.base.join("hook-logs");
    std::fs::create_dir(&logs).unwrap();
    support::give_to_children(&logs);
    let log = logs.join("hooks.log");
    let logger = hook_script(
        &area,
        "log.sh",
        &format!("cat >> {}\necho >> {}", log.display(), log.display()),
    );
    let config = json!({"schema_version": 2,
        "hooks_writable": [logs.to_str().unwrap()],
        "hooks": {"PreToolUse": [logger], "PostToolUse": [logger]},
        "mcp_servers": [ev("ev", json!({})), ev("bounded", json!({"capabilities": ["read_only"]}))]});
    area.write_config(&config);
    let canary = "iteron-canary-reads-8d31f6";
    let broker = area.broker(&[], &[("ITERON_TEST_FORWARDED", canary)]);
    let uri = "demo://resource/static/document/architecture.md";

    let out = area
        .agent(&["resources", "ev", "--format", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["uri"] == uri),
        "{v}"
    );
    let out = area.agent(&["prompts", "ev"]).output().unwrap();
    assert!(
        text(&out.stdout).contains("args-prompt"),
        "{}",
        text(&out.stdout)
    );

    // Not offered, or not there: the same answer, and the bounded server never starts.
    let hidden = area.agent(&["resources", "bounded"]).output().unwrap();
    let unknown = area.agent(&["resources", "nosuch"]).output().unwrap();
    assert!(!hidden.status.success());
    assert_eq!(hidden.status.code(), unknown.status.code());
    assert_eq!(text(&hidden.stderr), text(&unknown.stderr));
    assert!(
        text(&hidden.stderr).contains("no such server"),
        "{}",
        text(&hidden.stderr)
    );
    let read_hidden = area
        .agent(&["read-resource", "bounded", uri])
        .output()
        .unwrap();
    assert!(text(&read_hidden.stderr).contains("no such server"));
    assert!(area.pending().is_empty());

    // A read waits for the operator; what it would read is shown to them.
    let read = area.agent(&["read-resource", "ev", uri]).spawn().unwrap();
    let p = area.wait_pending(1);
    assert_eq!(p[0]["server"], "ev");
    assert_eq!(p[0]["tool"], "resources/read");
    assert!(p[0]["arguments"].as_str().unwrap().contains(uri));
    let id = p[0]["id"].as_u64().unwrap().to_string();
    assert!(area.run(&["approvals", "approve", &id]).status.success());
    let out = wait_child(read);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("# Everything Server"),
        "{}",
        text(&out.stdout)
    );

    // A prompt, approved; and one denied. The server echoes the arguments into its answer:
    // the configured secret among them comes back scrubbed.
    let args = json!({"city": "Lyon-7c2a", "state": canary}).to_string();
    let get = area
        .agent(&["get-prompt", "ev", "args-prompt", "--json", &args])
        .spawn()
        .unwrap();
    area.approve_next();
    let out = wait_child(get);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(
        shown.contains("Lyon-7c2a") && shown.contains("[REDACTED]"),
        "{shown}"
    );
    assert!(!shown.contains(canary), "{shown}");
    let get = area
        .agent(&["get-prompt", "ev", "simple-prompt"])
        .spawn()
        .unwrap();
    let p = area.wait_pending(1);
    let id = p[0]["id"].as_u64().unwrap().to_string();
    assert!(area.run(&["approvals", "deny", &id]).status.success());
    let out = wait_child(get);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("denied"),
        "{}",
        text(&out.stderr)
    );
    // Request bounds: checked before anything reaches the operator; the longest URI allowed
    // reaches the operator (and is denied here), one byte more does not.
    let longest = format!("demo://{}", "x".repeat(2048 - 7));
    let over = format!("{longest}x");
    let out = area
        .agent(&["read-resource", "ev", &over])
        .output()
        .unwrap();
    assert!(
        text(&out.stderr).contains("over 2048 bytes"),
        "{}",
        text(&out.stderr)
    );
    assert!(area.pending().is_empty());
    let read = area
        .agent(&["read-resource", "ev", &longest])
        .spawn()
        .unwrap();
    let p = area.wait_pending(1);
    let id = p[0]["id"].as_u64().unwrap().to_string();
    assert!(area.run(&["approvals", "deny", &id]).status.success());
    assert!(!wait_child(read).status.success());

    // And a tool call, approved.
    let call = area
        .agent(&["call", "ev", "echo", "--json", r#"{"message":"hooked"}"#])
        .spawn()
        .unwrap();
    area.approve_next();
    assert!(wait_child(call).status.success());
    let events: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let saw = |event: &str, tool: &str| {
        events
            .iter()
            .any(|e| e["event"] == event && e["tool"] == tool && e["server"] == "ev")
    };
    for tool in ["resources/read", "prompts/get", "echo"] {
        assert!(
            saw("PreToolUse", tool),
            "no PreToolUse for {tool}: {events:?}"
        );
        assert!(
            saw("PostToolUse", tool),
            "no PostToolUse for {tool}: {events:?}"
        );
    }
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "PostToolUse" && e["tool"] == "echo" && e["outcome"] == "ok"),
        "{events:?}"
    );

    let status = area.status();
    let bounded = status["servers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "bounded")
        .unwrap()
        .clone();
    assert_eq!(bounded["phase"], "idle", "{status}");
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));

    let records = area.audit_records();
    let of = |kind: &str| -> Vec<&Value> { records.iter().filter(|r| r["kind"] == kind).collect() };
    let reads = of("read_resource");
    assert!(reads.iter().any(|r| r["outcome"] == "dispatching"));
    assert!(
        reads
            .iter()
            .any(|r| r["outcome"] == "ok" && r["server"] == "ev")
    );
    assert!(reads.iter().any(|r| r["outcome"] == "unknown_server"));
    assert!(reads.iter().any(|r| r["outcome"] == "bad_request"));
    let prompts = of("get_prompt");
    assert!(prompts.iter().any(|r| r["outcome"] == "ok"));
    assert!(prompts.iter().any(|r| r["decision"] == "denied"));
    assert!(of("list_resources").iter().any(|r| r["outcome"] == "ok"));
    // Digests only: neither the uri nor the prompt's arguments are in the log.
    let log = records.iter().map(Value::to_string).collect::<String>();
    assert!(!log.contains("Lyon-7c2a") && !log.contains("architecture.md"));
    assert!(!log.contains(canary));
    iteron_test_support::record!("P1", json!({}),);
}

/// `$CREDENTIALS_DIRECTORY` (systemd's `LoadCredential=`): a credential named like a forwarded
/// variable supplies it (over the broker's environment), the directory itself is denied to every
/// child (servers and hooks) and never named in a child's environment, and an unsafe directory
/// stops the start with one line that quotes no value.
#[test]
fn the_credentials_directory_supplies_forwarded_variables_and_no_child_reads_it() {
    let area = Area::new("unitcreds");
    let creds = area.base.join("creds");
    std::fs::create_dir(&creds).unwrap();
    let forwarded = "iteron-canary-unit-5b2e90";
    let other = "iteron-canary-other-c41d77";
    for (name, value) in [
        ("ITERON_TEST_FORWARDED", forwarded),
        ("OTHER_SECRET", other),
    ] {
        let p = creds.join(name);
        std::fs::write(&p, format!("{value}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).unwrap();
    }
    std::fs::set_permissions(&creds, std::fs::Permissions::from_mode(0o500)).unwrap();
    let logs = area.base.join("hook-logs");
    std::fs::create_dir(&logs).unwrap();
    support::give_to_children(&logs);
    let probe = hook_script(
        &area,
        "probe.sh",
        &format!(
            "env > {logs}/env\ncat {creds}/OTHER_SECRET > {logs}/read 2> {logs}/read-error\necho $? > {logs}/read-status",
            logs = logs.display(),
            creds = creds.display()
        ),
    );
    let config = json!({"schema_version": 2,
        "hooks_writable": [logs.to_str().unwrap()],
        "hooks": {"SessionStart": [probe]},
        "mcp_servers": [{"name": "ev", "transport": "stdio", "command": node().to_str().unwrap(),
                         "args": [everything_js().to_str().unwrap(), "stdio"],
                         "env": ["ITERON_TEST_FORWARDED"],
                         "sandbox": {"readable": [area.base.to_str().unwrap()]}}]});
    area.write_config(&config);
    let broker = area.broker(
        &[],
        &[
            ("CREDENTIALS_DIRECTORY", creds.to_str().unwrap()),
            // The credential wins over the broker's own environment.
            ("ITERON_TEST_FORWARDED", "from-the-environment"),
        ],
    );
    // The server sees the credential's value (scrubbed from what the agent gets back).
    let call = area
        .agent(&["call", "ev", "get-env", "--json", "{}"])
        .spawn()
        .unwrap();
    area.approve_next();
    let out = wait_child(call);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(shown.contains("ITERON_TEST_FORWARDED"), "{shown}");
    assert!(!shown.contains("from-the-environment"), "{shown}");
    assert!(
        !shown.contains(forwarded) && !shown.contains(other),
        "{shown}"
    );
    assert!(!shown.contains("CREDENTIALS_DIRECTORY"), "{shown}");
    // The hook (which reads everything but the home) could not read the directory.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !logs.join("read-status").exists() {
        assert!(Instant::now() < deadline, "the SessionStart hook never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = std::fs::read_to_string(logs.join("read-status")).unwrap();
    assert_ne!(status.trim(), "0", "a hook read the credentials directory");
    assert!(
        std::fs::read_to_string(logs.join("read"))
            .unwrap()
            .is_empty()
    );
    let err = std::fs::read_to_string(logs.join("read-error")).unwrap();
    assert!(err.contains("Permission denied"), "{err}");
    let env = std::fs::read_to_string(logs.join("env")).unwrap();
    assert!(!env.contains("CREDENTIALS_DIRECTORY"), "{env}");
    let (code, stderr) = broker.finish();
    assert_eq!(code, Some(0));
    assert!(
        stderr.contains(
            "credentials directory supplies 2 variable(s): ITERON_TEST_FORWARDED, OTHER_SECRET"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains(forwarded) && !stderr.contains(other));

    // An unsafe directory stops the start, naming the file and never its content.
    let bad = creds.join("OTHER_SECRET");
    std::fs::set_permissions(&creds, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o620)).unwrap();
    let out = area
        .iteron(&["broker", "serve", "--noninteractive"])
        .env("CREDENTIALS_DIRECTORY", &creds)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("credentials directory: writable by group or others: ")
            && err.trim_end().ends_with("/creds/OTHER_SECRET"),
        "{err}"
    );
    assert!(!err.contains(other), "{err}");
    iteron_test_support::record!("P1", json!({}),);
}

/// `iteron skills` and `iteron agents` show a running broker's snapshot — what its sessions get,
/// discovered when it started — not a fresh scan: an edit made since is not shown until the
/// broker restarts. Without a broker (or for another repository) they discover now.
#[test]
fn skills_and_agents_show_the_running_brokers_snapshot() {
    let area = Area::new("snapshot");
    support::copy_tree(
        &repo().join("fixtures/hostile-home"),
        &area.home(),
        0o700,
        0o600,
    );
    area.config(json!([]));
    let fixture = repo().join("fixtures/hostile-repo");
    let broker = area.broker(
        &["--noninteractive", "--repo", fixture.to_str().unwrap()],
        &[],
    );
    let skill = area.home().join("skills/deploy/SKILL.md");
    let before = std::fs::read_to_string(&skill).unwrap();
    std::fs::write(
        &skill,
        before.replace(
            "How the operator deploys (trusted).",
            "Edited after the start.",
        ),
    )
    .unwrap();
    let view = |args: &[&str]| -> Value {
        let out = area.run(args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let description = |v: &Value| {
        v["skills"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == "deploy")
            .map(|s| s["description"].as_str().unwrap().to_owned())
            .unwrap()
    };
    let v = view(&["skills", "--format", "json"]);
    assert_eq!(v["source"], "broker", "{v}");
    assert_eq!(description(&v), "How the operator deploys (trusted).");
    // The broker's repository tier is part of its snapshot.
    assert!(
        v["skills"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["tier"] == "repository"),
        "{v}"
    );
    let same_repo = view(&[
        "skills",
        "--repo",
        fixture.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert_eq!(same_repo["source"], "broker");
    let agents = view(&["agents", "--format", "json"]);
    assert_eq!(agents["source"], "broker");
    assert!(!agents["agents"].as_array().unwrap().is_empty());
    // Another repository: discovered now, with the edit.
    let other = area.base.join("other-repo");
    std::fs::create_dir(&other).unwrap();
    let v = view(&[
        "skills",
        "--repo",
        other.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert_eq!(v["source"], "discovery");
    assert_eq!(description(&v), "Edited after the start.");
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    // No broker: discovered now.
    let v = view(&["skills", "--format", "json"]);
    assert_eq!(v["source"], "discovery");
    assert_eq!(description(&v), "Edited after the start.");
}

/// A child session's turn and wall-clock budgets: the turn after the last allowed one and any
/// request after the wall-clock budget are refused with nothing sent; the budget is the
/// session's, so a new child session starts afresh.
#[test]
fn child_turn_and_wall_clock_budgets_are_enforced() {
    let area = Area::new("budgets");
    area.config(json!([]));
    let agents = area.home().join("agents");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&agents)
        .unwrap();
    for (name, budget) in [
        ("Short", "maxTurns: 2\nmaxConsecutiveToolErrors: 3"),
        ("Brief", "maxWallSecs: 2"),
    ] {
        let f = agents.join(format!("{name}.md"));
        std::fs::write(
            &f,
            format!("---\nname: {name}\ndescription: A budgeted child.\ntools: [read_file]\n{budget}\n---\nWork.\n"),
        )
        .unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let broker = area.broker(&["--noninteractive"], &[]);
    let rt = runtime();
    let sock = area.agent_socket();
    rt.block_on(async {
        let child = |agent_type: &'static str| {
            let sock = sock.clone();
            async move {
                let mut c = Connection::connect(&sock).await.unwrap();
                let hello = c
                    .request("hello", json!({"protocol": 1, "agent_type": agent_type}))
                    .await
                    .unwrap();
                assert_eq!(hello["agent"]["name"], agent_type);
                c
            }
        };
        let call = json!({"server": "none", "tool": "read_file", "arguments": {}});
        // Two turns (each a tool error: a child sees no MCP tool), then the budget is spent
        // before the consecutive-error limit of three is reached.
        let mut c = child("Short").await;
        for _ in 0..2 {
            let e = c.request("call_tool", call.clone()).await.unwrap_err();
            assert!(e.to_string().starts_with("unknown_tool"), "{e}");
        }
        let e = c.request("call_tool", call.clone()).await.unwrap_err();
        assert!(e.to_string().contains("turn budget is spent"), "{e}");
        assert!(e.to_string().contains("not_sent"), "{e}");
        // A new child session has its own budget.
        let mut fresh = child("Short").await;
        let e = fresh.request("call_tool", call.clone()).await.unwrap_err();
        assert!(e.to_string().starts_with("unknown_tool"), "{e}");

        // Two seconds of wall clock: within them requests are served, after them none is.
        let mut c = child("Brief").await;
        c.request("list_skills", json!({})).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2300)).await;
        for (method, params) in [
            ("list_skills", json!({})),
            ("call_tool", call.clone()),
            ("list_tools", json!({})),
        ] {
            let e = c.request(method, params).await.unwrap_err();
            assert!(
                e.to_string().contains("wall-clock budget is spent"),
                "{method}: {e}"
            );
        }
        c.request("end_session", json!({})).await.unwrap();
    });
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
}

/// Read one answer frame from a raw stream, or `None` at end of stream.
async fn raw_frame(s: &mut tokio::net::UnixStream) -> Option<Value> {
    use tokio::io::AsyncReadExt;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).await.ok()?;
    serde_json::from_slice(&body).ok()
}

/// The agent socket's bounds, each at the limit and one over: the client label, the prompt,
/// requests in flight on one connection, open connections, and the deadlines for the first
/// frame and for the rest of a started frame.
#[test]
fn agent_socket_bounds_hold_at_the_limit_and_one_over() {
    use iteron_broker::daemon::{
        FRAME_DEADLINE, HELLO_DEADLINE, MAX_CLIENT_LABEL, MAX_CONNECTIONS_PER_UID, MAX_IN_FLIGHT,
    };
    use iteron_broker::ipc::proto::MAX_PROMPT;
    use tokio::io::AsyncWriteExt;
    let area = Area::new("bounds");
    area.config(json!([]));
    let broker = area.broker(&["--noninteractive"], &[]);
    let sock = area.agent_socket();
    let op = area.operator_socket();
    let rt = runtime();
    rt.block_on(async {
        // Client label: 64 bytes open a session, 65 are refused.
        let mut c = Connection::connect(&sock).await.unwrap();
        c.hello(&"l".repeat(MAX_CLIENT_LABEL)).await.unwrap();
        // Prompt: 262,144 bytes are taken, one more is refused.
        c.request("submit_prompt", json!({"prompt": "p".repeat(MAX_PROMPT)}))
            .await
            .unwrap();
        let e = c
            .request(
                "submit_prompt",
                json!({"prompt": "p".repeat(MAX_PROMPT + 1)}),
            )
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("the prompt is over 262144 bytes"),
            "{e}"
        );
        drop(c);
        let mut c = Connection::connect(&sock).await.unwrap();
        let e = c
            .hello(&"l".repeat(MAX_CLIENT_LABEL + 1))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("at most 64 bytes"), "{e}");
        drop(c);

        // Requests in flight on one connection (operator long-polls, 1.5 s each): with 15
        // waiting a 16th request is answered at once; with 16 waiting the 17th is not even
        // read until one of them is answered.
        for (waiting, served_at_once) in [(MAX_IN_FLIGHT - 1, true), (MAX_IN_FLIGHT, false)] {
            let mut o = Connection::connect(&op).await.unwrap();
            o.hello("bounds").await.unwrap();
            for i in 0..waiting {
                let f = json!({"id": 100 + i, "method": "pending", "params": {"wait_ms": 1500}});
                o.send_raw(f.to_string().as_bytes()).await.unwrap();
            }
            let f = json!({"id": 7, "method": "status", "params": {}});
            o.send_raw(f.to_string().as_bytes()).await.unwrap();
            let first = tokio::time::timeout(Duration::from_secs(10), o.read_value())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!(
                first["id"] == 7,
                served_at_once,
                "{waiting} waiting: {first}"
            );
        }

        // Open connections of one uid: 64 are held, the next one gets `busy` and is closed
        // (the socket's bound of 256 over several uids is tested below).
        let mut open = Vec::new();
        for _ in 0..MAX_CONNECTIONS_PER_UID {
            open.push(tokio::net::UnixStream::connect(&sock).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut over = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let busy = tokio::time::timeout(Duration::from_secs(5), raw_frame(&mut over))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(busy["error"]["code"], "busy", "{busy}");
        assert!(
            busy["error"]["message"]
                .as_str()
                .unwrap()
                .contains("this uid has 64 connections"),
            "{busy}"
        );
        assert_eq!(raw_frame(&mut over).await, None);
        // The 64th was accepted: it is served.
        let last = open.last_mut().unwrap();
        let hello = json!({"id": 1, "method": "hello", "params": {"protocol": 1}}).to_string();
        last.write_all(&(hello.len() as u32).to_be_bytes())
            .await
            .unwrap();
        last.write_all(hello.as_bytes()).await.unwrap();
        let answer = raw_frame(last).await.unwrap();
        assert!(answer.get("result").is_some(), "{answer}");
        drop(open);

        tokio::time::sleep(Duration::from_millis(300)).await;

        // Deadlines, both at once: a connection that says nothing is closed at the hello
        // deadline; one that opened its session and then starts a frame it never finishes is
        // closed at the frame deadline, counted from the stall. Each gets one error frame.
        let t0 = Instant::now();
        let mut silent = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let mut stalled = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let hello = json!({"id": 1, "method": "hello", "params": {"protocol": 1}}).to_string();
        stalled
            .write_all(&(hello.len() as u32).to_be_bytes())
            .await
            .unwrap();
        stalled.write_all(hello.as_bytes()).await.unwrap();
        let opened = raw_frame(&mut stalled).await.unwrap();
        assert!(opened.get("result").is_some(), "{opened}");
        let t1 = Instant::now();
        stalled.write_all(&[0, 0, 0, 100, b'{']).await.unwrap();
        let (first, second) = tokio::join!(
            async {
                let f = raw_frame(&mut silent).await;
                (f, t0.elapsed())
            },
            async {
                let f = raw_frame(&mut stalled).await;
                (f, t1.elapsed())
            }
        );
        let (first, silent_after) = first;
        let first = first.unwrap();
        assert_eq!(first["error"]["code"], "protocol", "{first}");
        assert!(silent_after >= HELLO_DEADLINE, "{silent_after:?}");
        assert!(silent_after < HELLO_DEADLINE * 3, "{silent_after:?}");
        let (second, stalled_after) = second;
        let second = second.unwrap();
        assert_eq!(second["error"]["code"], "protocol", "{second}");
        assert!(stalled_after >= FRAME_DEADLINE, "{stalled_after:?}");
        assert!(stalled_after < FRAME_DEADLINE * 3, "{stalled_after:?}");
    });
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    iteron_test_support::record!(
        "P5",
        json!({"client_label": MAX_CLIENT_LABEL, "prompt": MAX_PROMPT, "in_flight": MAX_IN_FLIGHT,
               "connections_per_uid": MAX_CONNECTIONS_PER_UID, "hello_deadline_s": HELLO_DEADLINE.as_secs(),
               "frame_deadline_s": FRAME_DEADLINE.as_secs()}),
    );
}

/// The broker hardens itself before anything else: umask 077, no core dumps, not dumpable, and
/// the loader, proxy and TLS variables gone (named on stderr, never their values).
#[test]
fn the_broker_hardens_itself_first() {
    let area = Area::new("harden");
    area.config(json!([]));
    // Started loose on purpose: umask 022 and core dumps allowed (as far as the hard limit
    // lets), so that what the broker shows is its own doing.
    let wrapper = "umask 022; ulimit -S -c \"$(ulimit -H -c)\"; exec \"$0\" \"$@\"";
    let loose = Command::new("/bin/sh")
        .args([
            "-c",
            "umask 022; ulimit -S -c \"$(ulimit -H -c)\"; umask; ulimit -S -c",
        ])
        .output()
        .unwrap();
    let loose = text(&loose.stdout);
    assert!(loose.starts_with("0022"), "{loose}");
    let core_was_loose = loose.lines().nth(1).is_some_and(|c| c.trim() != "0");
    let sock = area.agent_socket();
    let child = Command::new("/bin/sh")
        .args([
            "-c",
            wrapper,
            iteron(),
            "broker",
            "serve",
            "--noninteractive",
            "--socket",
        ])
        .arg(&sock)
        .env("ITERON_HOME", area.home())
        .env("HTTPS_PROXY", "http://127.0.0.1:9/proxy-canary-1a2b")
        .env("LD_LIBRARY_PATH", "/nonexistent/ld-canary-3c4d")
        .env("SSL_CERT_FILE", "/nonexistent/tls-canary-5e6f")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let broker = Broker {
        child,
        socket: area.operator_socket(),
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(Instant::now() < deadline, "the broker did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = broker.pid();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(field("Umask:"), "0077", "{status}");
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let core = limits
        .lines()
        .find(|l| l.starts_with("Max core file size"))
        .unwrap();
    let soft_hard: Vec<&str> = core.split_whitespace().skip(4).take(2).collect();
    assert_eq!(soft_hard, ["0", "0"], "{core}");
    if !core_was_loose {
        eprintln!("note: the hard core limit here is 0, so the core check is weaker");
    }
    let (code, stderr) = broker.finish();
    assert_eq!(code, Some(0));
    let ignored = stderr
        .lines()
        .find_map(|l| l.strip_prefix("iteron broker: ignoring environment variables: "))
        .unwrap_or_default();
    for name in ["HTTPS_PROXY", "LD_LIBRARY_PATH", "SSL_CERT_FILE"] {
        assert!(ignored.split(", ").any(|n| n == name), "{stderr}");
    }
    assert!(!stderr.contains("canary"), "{stderr}");
    iteron_test_support::record!("P2", json!({"umask": "0077", "core_limit": 0}),);
}

/// The socket-wide bound on requests in flight: with every slot of the operator socket held by
/// long-polls, a new connection's `hello` is not even read until one frees; one slot under the
/// bound, it is. The agent socket has its own slots, so a full operator socket does not block
/// agents (and, the same pool logic, agents cannot block the operator).
/// (A connection with fewer than 16 requests in flight that waits for its next frame has
/// already reserved the slot that frame will use; one with 16 reserves nothing.)
#[test]
fn requests_in_flight_are_bounded_per_socket_at_the_limit_and_one_over() {
    use iteron_broker::daemon::{MAX_BROKER_IN_FLIGHT, MAX_IN_FLIGHT};
    let area = Area::new("inflight");
    area.config(json!([]));
    let broker = area.broker(&[], &[]);
    let rt = runtime();
    let op = area.operator_socket();
    let full = MAX_BROKER_IN_FLIGHT / MAX_IN_FLIGHT - 1;
    rt.block_on(async {
        let settle = || tokio::time::sleep(Duration::from_millis(1000));
        let mut held = Vec::new();
        for _ in 0..full {
            let mut c = Connection::connect(&op).await.unwrap();
            c.hello("hold").await.unwrap();
            hold(&mut c, 100, MAX_IN_FLIGHT).await;
            held.push(c);
        }
        // The last holder: MAX_IN_FLIGHT - 2 requests and its reservation for the next frame,
        // so exactly one slot is left.
        let mut last = Connection::connect(&op).await.unwrap();
        last.hello("hold").await.unwrap();
        hold(&mut last, 100, MAX_IN_FLIGHT - 2).await;
        settle().await;
        // One under the bound: a new connection is served.
        let mut under = Connection::connect(&op).await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), under.hello("under"))
            .await
            .expect("one slot under the bound, hello was not answered")
            .unwrap();
        drop(under);
        settle().await;
        // At the bound: the last holder's 15th and 16th requests take the two remaining slots
        // (and with 16 in flight it reserves nothing more): every slot is held, whatever the
        // order in which the broker read these frames.
        hold(&mut last, 200, 2).await;
        settle().await;
        let mut over = Connection::connect(&op).await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(1500), over.hello("over")).await;
        assert!(waiting.is_err(), "hello was answered with every slot held");
        // Meanwhile the agent's socket has its own slots.
        let mut agent = Connection::connect(&area.agent_socket()).await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), agent.hello("agent"))
            .await
            .expect("the agent socket shares the operator's pool")
            .unwrap();
        // A connection that goes away frees its slots, and the waiting request proceeds.
        drop(held.remove(0));
        let answered = tokio::time::timeout(Duration::from_secs(5), over.read_value())
            .await
            .expect("hello was not answered after slots were freed")
            .unwrap()
            .unwrap();
        assert!(answered.get("result").is_some(), "{answered}");
        drop(held);
    });
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    iteron_test_support::record!(
        "P5",
        json!({"max_in_flight_per_socket": MAX_BROKER_IN_FLIGHT, "per_connection": MAX_IN_FLIGHT}),
    );
}

/// Every frame the agent receives during a full session — listing, unknown and hidden tools, a
/// refused call, approved calls including one that dumps the server's environment, a cancelled
/// call — is scanned for the secrets the broker holds (a forwarded variable, an unnamed one).
#[test]
fn no_frame_sent_to_the_agent_carries_a_secret() {
    let area = Area::new("canary");
    area.everything();
    let forwarded = "iteron-canary-forwarded-4a8e1c";
    let unnamed = "iteron-canary-unnamed-93bd07";
    let broker = area.broker(
        &[],
        &[
            ("ITERON_TEST_FORWARDED", forwarded),
            ("ITERON_TEST_UNNAMED_SECRET", unnamed),
        ],
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Everything the operator's commands print is kept and scanned too (they run with the
    // secrets in their own environment, as an operator's shell would have them).
    let operator_out = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let run_operator = {
        let home = area.home();
        let operator_out = std::sync::Arc::clone(&operator_out);
        move |args: &[&str]| -> Output {
            let out = Command::new(iteron())
                .args(args)
                .env("ITERON_HOME", &home)
                .env("ITERON_TEST_FORWARDED", forwarded)
                .env("ITERON_TEST_UNNAMED_SECRET", unnamed)
                .output()
                .unwrap();
            operator_out.lock().unwrap().push(format!(
                "{}{}",
                text(&out.stdout),
                text(&out.stderr)
            ));
            out
        }
    };
    let approver = {
        let stop = std::sync::Arc::clone(&stop);
        let run_operator = run_operator.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let out = run_operator(&["approvals", "list", "--format", "json"]);
                let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
                for item in v["pending"].as_array().cloned().unwrap_or_default() {
                    let id = item["id"].as_u64().unwrap().to_string();
                    let deny = item["tool"] == "get-annotated-message";
                    run_operator(&["approvals", if deny { "deny" } else { "approve" }, &id]);
                }
                std::thread::sleep(Duration::from_millis(30));
            }
        })
    };
    let rt = runtime();
    let mut frames: Vec<String> = Vec::new();
    rt.block_on(async {
        let mut c = Connection::connect(&area.agent_socket()).await.unwrap();
        let mut keep = |r: Result<Value, iteron_broker::ipc::client::ClientError>| match r {
            Ok(v) => frames.push(v.to_string()),
            Err(e) => frames.push(e.to_string()),
        };
        keep(c.hello("canary-agent").await);
        keep(c.request("list_tools", json!({})).await);
        for (tool, args) in [
            ("echo", json!({"message": "plain"})),
            ("get-env", json!({})),
            ("get-sum", json!({"a": 1, "b": 2})),
            ("no-such-tool", json!({})),
            ("get-annotated-message", json!({"messageType": "error"})),
            ("get-structured-content", json!({"location": "New York"})),
            ("echo", json!({"wrong": 1})),
        ] {
            keep(
                c.request(
                    "call_tool",
                    json!({"server": "ev", "tool": tool, "arguments": args}),
                )
                .await,
            );
        }
        keep(c.request("end_session", json!({})).await);
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    approver.join().unwrap();
    for args in [
        &["approvals", "list"][..],
        &["broker", "status"],
        &["broker", "status", "--format", "json"],
        &["broker", "status", "ev", "--format", "json"],
        &["mcp", "list", "--format", "json"],
        &["mcp", "get", "ev"],
        &["mcp", "get", "ev", "--format", "json"],
        &["mcp", "status"],
        &["skills", "--format", "json"],
        &["agents", "--format", "json"],
        &["audit", "verify", "--format", "json"],
    ] {
        let out = run_operator(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    }
    let printed = operator_out.lock().unwrap().join("\n");
    assert!(printed.contains("\"ev\""), "{printed}");
    for secret in [forwarded, unnamed] {
        assert!(
            !printed.contains(secret),
            "a secret reached an operator command's output"
        );
    }
    let all = frames.join("\n");
    assert!(
        all.contains("ITERON_TEST_FORWARDED"),
        "get-env did not run: {all}"
    );
    assert!(all.contains("the operator denied this call"), "{all}");
    for secret in [forwarded, unnamed] {
        assert!(!all.contains(secret), "a secret reached the agent");
    }
    let (code, err) = broker.finish();
    assert_eq!(code, Some(0));
    assert!(!err.contains(forwarded) && !err.contains(unnamed));
    let audit = serde_json::to_string(&area.audit_records()).unwrap();
    assert!(!audit.contains(forwarded) && !audit.contains(unnamed));
    iteron_test_support::record!(
        "P1",
        serde_json::json!({"frames": frames.len(), "operator_outputs": operator_out.lock().unwrap().len()}),
    );
}

/// A hostile server plants forwarded secrets — one inside another, with quotes, backslashes and
/// non-ASCII — in every field it sends, encoded every common way and placed where the client
/// cuts: none of them, nor any 8-byte piece of one, reaches the agent or the operator.
#[test]
fn every_encoding_of_a_forwarded_secret_is_scrubbed_from_every_field() {
    let area = Area::new("leaky");
    let inner = "k7Qv2-inner-9XzL";
    let outer = format!("o\"ut\\er/é+&? {inner}-tail-Wm5q");
    let fixture = repo().join("fixtures/stdio/scripted_server.py");
    area.config(json!([
        {"name": "lk", "transport": "stdio", "command": "/usr/bin/python3",
         "args": [fixture.to_str().unwrap(), "leaky"],
         "env": ["ITERON_LEAK_INNER", "ITERON_LEAK_OUTER"]},
        {"name": "die", "transport": "stdio", "command": "/usr/bin/python3",
         "args": [fixture.to_str().unwrap(), "leaky-die"],
         "env": ["ITERON_LEAK_OUTER"]}
    ]));
    let env = [
        ("ITERON_LEAK_INNER", inner),
        ("ITERON_LEAK_OUTER", outer.as_str()),
    ];
    let broker = area.broker(&[], &env);
    let mut shown: Vec<String> = Vec::new();
    let out = area.agent(&["tools", "--format", "json"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let tools: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        tool_names(&tools),
        ["lk/leak", "lk/structured", "lk/fail"],
        "{tools}"
    );
    assert_eq!(tools["unavailable"], json!(["die"]));
    shown.push(text(&out.stdout));
    for tool in ["leak", "structured", "fail"] {
        let call = area
            .agent(&["call", "lk", tool, "--format", "json"])
            .spawn()
            .unwrap();
        let pending = area.run(&["approvals", "list", "--format", "json"]);
        shown.push(text(&pending.stdout));
        area.approve_next();
        let out = wait_child(call);
        shown.push(format!("{}{}", text(&out.stdout), text(&out.stderr)));
    }
    for args in [
        &["broker", "status", "--format", "json"][..],
        &["broker", "status"],
        &["mcp", "status"],
        &["audit", "verify", "--format", "json"],
    ] {
        let out = area.run(args);
        shown.push(format!("{}{}", text(&out.stdout), text(&out.stderr)));
    }
    let all = shown.join("\n");
    assert!(all.contains("[REDACTED]"), "{all}");
    // The failed start's stderr reached the operator, scrubbed.
    assert!(all.contains("sss"), "{all}");
    let (_, err) = broker.finish();
    let audit = serde_json::to_string(&area.audit_records()).unwrap();
    for (what, haystack) in [("output", &all), ("broker stderr", &err), ("audit", &audit)] {
        for secret in [inner, outer.as_str()] {
            for form in iteron_broker::scrub::forms(secret) {
                assert!(
                    !haystack.contains(form.as_str()),
                    "a form of a secret in the {what}"
                );
            }
            let escaped = serde_json::to_string(secret).unwrap();
            for piece in [secret.as_bytes(), escaped.as_bytes()] {
                for w in piece.windows(8) {
                    let w = String::from_utf8_lossy(w);
                    assert!(
                        !haystack.contains(w.as_ref()),
                        "a piece of a secret in the {what}: {w:?}"
                    );
                }
            }
        }
    }
    iteron_test_support::record!("P1", serde_json::json!({"outputs": shown.len()}),);
}

/// The agent socket's 256 connections are shared by uids 64 at a time: four uids fill it and a
/// fifth is told `busy`; and a session left idle is closed at the idle deadline (and audited),
/// while one waiting for an answer is not.
#[test]
fn connections_are_bounded_per_uid_and_idle_sessions_time_out() {
    use iteron_broker::daemon::{MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID};
    if !is_root() {
        eprintln!("skipped: connecting as four other uids needs root (CI runs as root)");
        return;
    }
    let area = Area::new("peruid");
    area.everything();
    let uids = [65534u32, 65533, 65532, 65531, 65530];
    let mut args = vec!["--idle-timeout", "2"];
    let strs: Vec<String> = uids.iter().map(u32::to_string).collect();
    for u in &strs {
        args.push("--allow-uid");
        args.push(u);
    }
    let own = nix::unistd::geteuid().as_raw().to_string();
    args.push("--allow-uid");
    args.push(&own);
    let broker = area.broker(&args, &[]);
    let sock = area.agent_socket();
    // Each holder connects `n` times as its uid, says how many it got (and the first refusal,
    // if any), then keeps them open until its stdin closes.
    let holder = |uid: u32, n: usize| {
        let script = r#"
import socket, struct, sys, json, time
path, n = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    socks.append(s)
time.sleep(1.5)
held, refusal = [], None
for s in socks:
    s.setblocking(False)
    try:
        head = s.recv(4)
        s.setblocking(True)
        refusal = json.loads(s.recv(struct.unpack(">I", head)[0]))["error"]["message"]
    except BlockingIOError:
        held.append(s)
print(json.dumps({"held": len(held), "refusal": refusal}), flush=True)
sys.stdin.read()
"#;
        Command::new("/usr/bin/python3")
            .args(["-c", script, sock.to_str().unwrap(), &n.to_string()])
            .uid(uid)
            .gid(uid)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let read_line = |c: &mut Child| -> Value {
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(c.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let per_socket = MAX_CONNECTIONS / MAX_CONNECTIONS_PER_UID;
    let mut holders = Vec::new();
    for uid in &uids[..per_socket] {
        let mut h = holder(*uid, MAX_CONNECTIONS_PER_UID + 1);
        let got = read_line(&mut h);
        assert_eq!(got["held"], MAX_CONNECTIONS_PER_UID, "{got}");
        assert!(
            got["refusal"].as_str().unwrap().contains("this uid has"),
            "{got}"
        );
        holders.push(h);
    }
    // The socket is full: a fifth uid gets `busy` at once.
    let mut fifth = holder(uids[per_socket], 1);
    let got = read_line(&mut fifth);
    assert_eq!(got["held"], 0, "{got}");
    assert!(
        got["refusal"]
            .as_str()
            .unwrap()
            .contains("too many open connections"),
        "{got}"
    );
    drop(fifth);
    for mut h in holders {
        drop(h.stdin.take());
        let _ = h.wait();
    }
    std::thread::sleep(Duration::from_millis(300));
    // Idle: a session with nothing in flight is closed at the deadline; one waiting for an
    // approval is not.
    let rt = runtime();
    rt.block_on(async {
        let mut idle = Connection::connect(&sock).await.unwrap();
        idle.hello("idle").await.unwrap();
        let t = Instant::now();
        let r = idle.request("list_skills", json!({})).await;
        assert!(r.is_ok(), "{r:?}");
        tokio::time::sleep(Duration::from_millis(2600)).await;
        let r = idle.request("list_skills", json!({})).await;
        assert!(
            r.is_err(),
            "an idle session was still open after {:?}",
            t.elapsed()
        );
        let mut busy = Connection::connect(&sock).await.unwrap();
        busy.hello("waiting").await.unwrap();
        let call = busy.request(
            "call_tool",
            json!({"server": "ev", "tool": "echo", "arguments": {"message": "m"}}),
        );
        let deny = async {
            tokio::time::sleep(Duration::from_millis(3000)).await;
            let p = area.wait_pending(1);
            let id = p[0]["id"].as_u64().unwrap().to_string();
            assert!(area.run(&["approvals", "deny", &id]).status.success());
        };
        let (r, ()) = tokio::join!(call, deny);
        // Answered (denied), not cut by the idle deadline while it waited.
        match r {
            Err(iteron_broker::ipc::client::ClientError::Refused { message, .. }) => {
                assert!(message.contains("denied"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    });
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    assert!(
        area.audit_records()
            .iter()
            .any(|r| r["kind"] == "idle_close"),
        "the idle close is audited"
    );
    iteron_test_support::record!(
        "P5",
        json!({"per_uid": MAX_CONNECTIONS_PER_UID, "per_socket": MAX_CONNECTIONS}),
    );
}

fn scripted(name: &str, mode: &str) -> Value {
    json!({"name": name, "transport": "stdio", "command": "/usr/bin/python3",
           "args": [repo().join("fixtures/stdio/scripted_server.py").to_str().unwrap(), mode]})
}

fn everything_server() -> Value {
    json!({"name": "ev", "transport": "stdio", "command": node().to_str().unwrap(),
           "args": [everything_js().to_str().unwrap(), "stdio"]})
}

fn tool_names(v: &Value) -> Vec<String> {
    v["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            format!(
                "{}/{}",
                t["server"].as_str().unwrap(),
                t["name"].as_str().unwrap()
            )
        })
        .collect()
}

fn server_status(area: &Area, name: &str) -> Value {
    area.status()["servers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

/// An open session follows the operator's configuration: a tool denied after it opened is
/// gone, a server removed is gone and is stopped by the broker; a server whose policy can
/// expose no tool is never started and never named to the agent.
#[test]
fn configuration_changes_reach_open_sessions_and_removed_servers_stop() {
    let area = Area::new("reconfig");
    let mut hidden = scripted("hidden", "legacy");
    hidden["policy"] = json!({"capabilities": ["read_only"]});
    let servers = |extra: Value| {
        let mut ev = everything_server();
        if !extra.is_null() {
            ev["tools"] = extra;
        }
        json!([ev, hidden.clone()])
    };
    area.config(servers(Value::Null));
    let broker = area.broker(&[], &[]);
    let rt = runtime();
    rt.block_on(async {
        let mut c = Connection::connect(&area.agent_socket()).await.unwrap();
        c.hello("reconfig").await.unwrap();
        let listed = c.request("list_tools", json!({})).await.unwrap();
        let names = tool_names(&listed);
        assert!(names.contains(&"ev/echo".to_owned()), "{names:?}");
        assert!(!listed.to_string().contains("hidden"), "{listed}");
        assert_eq!(server_status(&area, "hidden")["phase"], "idle");
        // The operator denies echo: the open session no longer lists or calls it.
        area.config(servers(json!({"deny": ["echo"]})));
        let listed = c.request("list_tools", json!({})).await.unwrap();
        assert!(!tool_names(&listed).contains(&"ev/echo".to_owned()));
        let r = c
            .request("call_tool", json!({"server": "ev", "tool": "echo", "arguments": {"message": "m"}}))
            .await;
        match r {
            Err(iteron_broker::ipc::client::ClientError::Refused { code, .. }) => {
                assert_eq!(code, "unknown_tool")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(server_status(&area, "ev")["phase"], "ready");
        // The operator removes the server: gone for the session, stopped by the broker.
        let mut only_hidden = servers(Value::Null);
        only_hidden.as_array_mut().unwrap().remove(0);
        area.config(only_hidden);
        let r = c
            .request("call_tool", json!({"server": "ev", "tool": "get-sum", "arguments": {"a": 1, "b": 2}}))
            .await;
        assert!(
            matches!(&r, Err(iteron_broker::ipc::client::ClientError::Refused { code, .. }) if code == "unknown_tool"),
            "{r:?}"
        );
        let listed = c.request("list_tools", json!({})).await.unwrap();
        assert_eq!(listed["tools"], json!([]));
        assert_eq!(listed["unavailable"], json!([]));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let st = server_status(&area, "ev");
            if st["phase"] == "removed" && st["in_flight"] == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "{st}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    assert_eq!(
        server_status(&area, "hidden")["phase"],
        "idle",
        "never started"
    );
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    iteron_test_support::record!("P13", json!({}),);
}

/// Issue 14.9: a server removed from the configuration is stopped by the running broker on
/// its own, with no agent asking anything (the configuration is looked at on a timer), and
/// `broker status` shows it removed.
#[test]
fn a_removed_server_is_stopped_without_any_agent_traffic() {
    let area = Area::new("reconfig-idle");
    let marker = format!("iteron-removed-{}", std::process::id());
    let mut gone = scripted("gone", "legacy");
    gone["args"].as_array_mut().unwrap().push(json!(marker));
    let stays = scripted("stays", "legacy");
    area.config(json!([gone, stays.clone()]));
    let broker = area.broker(&[], &[]);
    let rt = runtime();
    rt.block_on(async {
        let mut c = Connection::connect(&area.agent_socket()).await.unwrap();
        c.hello("reconfig-idle").await.unwrap();
        c.request("list_tools", json!({})).await.unwrap();
    });
    assert_eq!(processes_with(&marker), 1, "the server was started");
    area.config(json!([stays]));
    // No request of any kind now: the broker's own look at the file stops the server.
    let deadline =
        Instant::now() + iteron_broker::daemon::CONFIG_WATCH_INTERVAL + Duration::from_secs(5);
    while processes_with(&marker) > 0 {
        assert!(
            Instant::now() < deadline,
            "a removed server still runs without agent traffic"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let st = server_status(&area, "gone");
    assert_eq!(st["phase"], "removed", "{st}");
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    iteron_test_support::record!(
        "P13",
        json!({"watch_interval_s": iteron_broker::daemon::CONFIG_WATCH_INTERVAL.as_secs()}),
    );
}

/// A server removed from the configuration while it is starting is not brought back: when
/// its start completes, the new process is closed and the server stays `removed`.
#[test]
fn a_server_removed_while_it_starts_stays_removed() {
    let area = Area::new("reconfig-starting");
    let marker = format!("iteron-removed-starting-{}", std::process::id());
    let mut slow = scripted("slow", "slow-start");
    slow["args"].as_array_mut().unwrap().push(json!("3"));
    slow["args"].as_array_mut().unwrap().push(json!(marker));
    let stays = scripted("stays", "legacy");
    area.config(json!([slow, stays.clone()]));
    let broker = area.broker(&[], &[]);
    let socket = area.agent_socket();
    let lister = std::thread::spawn(move || {
        runtime().block_on(async {
            let mut c = Connection::connect(&socket).await.unwrap();
            c.hello("reconfig-starting").await.unwrap();
            c.request("list_tools", json!({})).await.unwrap()
        })
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while processes_with(&marker) == 0 {
        assert!(Instant::now() < deadline, "the slow server never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(server_status(&area, "slow")["phase"], "starting");
    // Removed while it starts: broker status looks at the file and marks it removed.
    area.config(json!([stays]));
    assert_eq!(server_status(&area, "slow")["phase"], "removed");
    let listed = lister.join().unwrap();
    assert!(
        !tool_names(&listed).iter().any(|t| t.starts_with("slow/")),
        "{listed}"
    );
    // Its start completed after the removal: the process is closed, the phase stays removed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while processes_with(&marker) > 0 {
        assert!(
            Instant::now() < deadline,
            "a removed server's new process still runs"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(server_status(&area, "slow")["phase"], "removed");
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    iteron_test_support::record!("P13", json!({"removed_while_starting": "stays removed"}),);
}

fn zombies_of(pid: i32) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some(rest) = stat.rsplit_once(") ").map(|(_, r)| r) else {
            continue;
        };
        let mut f = rest.split(' ');
        let state = f.next().unwrap_or("");
        let ppid: i32 = f.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        if ppid == pid && state == "Z" {
            n += 1;
        }
    }
    n
}

/// A stdio server whose process ends starts a new generation on the next request; a call
/// approved for the generation that died is never sent to the next one; after its restart
/// budget the server stays `failed` with the reason; no zombie is left behind.
#[test]
fn a_crashed_server_starts_a_new_generation_and_an_approved_call_never_crosses_to_it() {
    let area = Area::new("crash");
    let logs = area.base.join("logs");
    std::fs::create_dir(&logs).unwrap();
    support::give_to_children(&logs);
    let log = logs.join("script.log");
    let mut server = scripted("c", "crash-on-call");
    server["env"] = json!(["SCRIPT_LOG"]);
    server["sandbox"] = json!({"writable": [logs.to_str().unwrap()]});
    area.config(json!([server]));
    let broker = area.broker(&[], &[("SCRIPT_LOG", log.to_str().unwrap())]);
    let calls_logged = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("tools/call"))
            .count()
    };
    let call = |n: u32| {
        area.agent(&[
            "call",
            "c",
            "echo",
            "--json",
            &format!(r#"{{"text":"c{n}"}}"#),
        ])
        .spawn()
        .unwrap()
    };
    // Two calls wait for approval on generation 1.
    let a = call(1);
    area.wait_pending(1);
    let b = call(2);
    let mut p = area.wait_pending(2);
    p.sort_by_key(|i| i["id"].as_u64());
    let ids: Vec<String> = p
        .iter()
        .map(|i| i["id"].as_u64().unwrap().to_string())
        .collect();
    assert_eq!(server_status(&area, "c")["generation"], 1);
    // The first approved call crashes the server (its fate is unknown).
    assert!(
        area.run(&["approvals", "approve", &ids[0]])
            .status
            .success()
    );
    let first = wait_child(a);
    assert!(
        text(&first.stderr).contains("may"),
        "{}",
        text(&first.stderr)
    );
    // The second, approved for the generation that died, is never sent anywhere.
    assert!(
        area.run(&["approvals", "approve", &ids[1]])
            .status
            .success()
    );
    let second = wait_child(b);
    assert!(!second.status.success());
    assert!(
        text(&second.stderr).contains("nothing was sent"),
        "{}",
        text(&second.stderr)
    );
    assert_eq!(calls_logged(), 1, "only the first call reached a process");
    assert_eq!(server_status(&area, "c")["phase"], "exited");
    // Each next call starts a new generation; after the budget the server stays failed.
    let mut generation = 1;
    for n in 0..iteron_broker::registry::MAX_CRASH_RESTARTS {
        let c = call(10 + n);
        area.approve_next();
        let _ = wait_child(c);
        let st = server_status(&area, "c");
        assert!(st["generation"].as_u64().unwrap() > generation, "{st}");
        generation = st["generation"].as_u64().unwrap();
    }
    let last = wait_child(call(99));
    assert!(!last.status.success());
    let st = server_status(&area, "c");
    assert_eq!(st["phase"], "failed", "{st}");
    assert!(
        st["error"].as_str().unwrap().contains("not started again"),
        "{st}"
    );
    assert_eq!(zombies_of(broker.pid()), 0);
    // The operator's restart gives it a fresh budget.
    assert!(area.run(&["broker", "restart", "c"]).status.success());
    assert_eq!(server_status(&area, "c")["phase"], "idle");
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    iteron_test_support::record!(
        "P4",
        json!({"restarts": iteron_broker::registry::MAX_CRASH_RESTARTS}),
    );
}

/// `list_tools` asks the servers at once (fewer than its bound), each within its deadline: two
/// hung servers cost one deadline, not two, for each of two agents asking at the same time; a catalog too big
/// for the answer is left out for its server only, with a note, and the answer is `ok`.
#[test]
fn one_bad_server_does_not_break_or_serialize_discovery() {
    use iteron_broker::daemon::LIST_SERVER_DEADLINE;
    let area = Area::new("listing");
    area.config(json!([
        everything_server(),
        scripted("hung1", "hang-list"),
        scripted("hung2", "hang-list"),
        scripted("big", "big-catalog"),
    ]));
    let broker = area.broker(&[], &[]);
    let t = Instant::now();
    let agents: Vec<_> = (0..2)
        .map(|_| area.agent(&["tools", "--format", "json"]).spawn().unwrap())
        .collect();
    let outs: Vec<Output> = agents.into_iter().map(wait_child).collect();
    let took = t.elapsed();
    for out in &outs {
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let names = tool_names(&v);
        assert!(names.contains(&"ev/echo".to_owned()), "{names:?}");
        assert!(!names.iter().any(|n| n.starts_with("big/")));
        let mut unavailable: Vec<String> =
            serde_json::from_value(v["unavailable"].clone()).unwrap();
        unavailable.sort();
        assert_eq!(unavailable, ["hung1", "hung2"]);
        assert!(
            v["notes"].to_string().contains("catalog of server big"),
            "{}",
            v["notes"]
        );
    }
    // Two deadlines would be the serial cost; allow for a loaded machine below that.
    assert!(took < LIST_SERVER_DEADLINE * 2, "{took:?}");
    drop(broker);
    iteron_test_support::record!(
        "P5",
        json!({"deadline_s": LIST_SERVER_DEADLINE.as_secs(), "took_ms": took.as_millis() as u64}),
    );
}

/// Issue 14.16 in the broker: a stdio server that never gets through its start is stopped at
/// the broker's start deadline, which ends inside `list_tools`' own deadline for it, so
/// `broker status` gives the reason with the server's last stderr lines and the confinement
/// hint. A server whose start the listing gives up on (an HTTP server that accepts and never
/// answers has no start deadline of its own) is `failed` with the reason, never left
/// `starting`. The agent only learns that both are unavailable.
#[test]
fn a_server_that_times_out_at_start_in_the_broker_is_reported_with_its_stderr_and_the_hint() {
    use iteron_broker::daemon::LIST_SERVER_DEADLINE;
    use iteron_broker::registry::START_DEADLINE;
    let area = Area::new("start-timeout");
    // Accepted by the kernel, never read: the connection opens and no answer ever comes.
    let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://127.0.0.1:{}/mcp", mute.local_addr().unwrap().port());
    area.config(json!([
        {"name": "stuck", "transport": "stdio", "command": "/bin/sh",
         "args": ["-c", "echo 'waiting for the license server' >&2; exec sleep 60"]},
        {"name": "mute", "transport": "http", "url": url},
    ]));
    let broker = area.broker(&[], &[]);
    let t = Instant::now();
    let out = wait_child(area.agent(&["tools", "--format", "json"]).spawn().unwrap());
    let took = t.elapsed();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut unavailable: Vec<String> = serde_json::from_value(v["unavailable"].clone()).unwrap();
    unavailable.sort();
    assert_eq!(unavailable, ["mute", "stuck"]);
    assert!(took < LIST_SERVER_DEADLINE * 2, "{took:?}");
    // The reason is the operator's: nothing of it reaches the agent.
    for shown in [text(&out.stdout), text(&out.stderr)] {
        assert!(!shown.contains("license"), "{shown}");
    }

    let stuck = server_status(&area, "stuck");
    assert_eq!(stuck["phase"], "failed", "{stuck}");
    let why = stuck["error"].as_str().unwrap_or_default();
    assert!(
        why.contains(&format!(
            "no answer within {} s of starting",
            START_DEADLINE.as_secs()
        )),
        "{stuck}"
    );
    assert!(
        why.contains("its stderr ends: waiting for the license server"),
        "{stuck}"
    );
    assert!(why.contains("the server runs confined"), "{stuck}");
    let mute_status = server_status(&area, "mute");
    assert_eq!(mute_status["phase"], "failed", "{mute_status}");
    assert!(
        mute_status["error"]
            .as_str()
            .unwrap_or_default()
            .contains("its start was given up after"),
        "{mute_status}"
    );
    drop(mute);
    drop(broker);
}

/// Issue 14.11 in the broker: `list_tools` starts at most `MAX_LIST_PARALLEL` servers at once.
/// With one hanging server more than that, the listing costs two start deadlines (the last
/// one waits for a place), not one per server, and at no moment do more than the bound of
/// them run.
#[test]
fn list_tools_starts_at_most_its_bound_of_servers_at_once() {
    use iteron_broker::daemon::{LIST_SERVER_DEADLINE, MAX_LIST_PARALLEL};
    use iteron_broker::registry::START_DEADLINE;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    let area = Area::new("bounded-listing");
    // Each server is one process (it never forks) with the marker in its command line; a
    // zombie's command line is empty, so a stopped one no longer counts.
    let marker = format!("listed-server-marker-{}", std::process::id());
    let n = MAX_LIST_PARALLEL + 1;
    let servers: Vec<Value> = (0..n)
        .map(|i| {
            json!({"name": format!("hang{i}"), "transport": "stdio", "command": "/usr/bin/python3",
                   "args": ["-c", "import time; time.sleep(60)", &marker]})
        })
        .collect();
    area.config(Value::Array(servers));
    let broker = area.broker(&[], &[]);
    let (stop, most) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let watcher = {
        let (stop, most, marker) = (Arc::clone(&stop), Arc::clone(&most), marker.clone());
        std::thread::spawn(move || {
            while !stop.load(SeqCst) {
                most.fetch_max(processes_with(&marker), SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let t = Instant::now();
    let out = wait_child(area.agent(&["tools", "--format", "json"]).spawn().unwrap());
    let took = t.elapsed();
    stop.store(true, SeqCst);
    watcher.join().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["unavailable"].as_array().unwrap().len(), n, "{v}");
    let most = most.load(SeqCst);
    assert_eq!(most, MAX_LIST_PARALLEL, "servers started at once");
    // Two rounds of start deadlines: the ninth had to wait; far below one per server.
    assert!(took >= START_DEADLINE * 2, "{took:?}");
    assert!(took < LIST_SERVER_DEADLINE * 3, "{took:?}");
    let gone = Instant::now() + Duration::from_secs(5);
    while processes_with(&marker) > 0 {
        assert!(Instant::now() < gone, "a started server was left running");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(broker);
    iteron_test_support::record!(
        "P5",
        json!({"servers": n, "at_once": most, "start_deadline_s": START_DEADLINE.as_secs(), "took_ms": took.as_millis() as u64}),
    );
}

/// Issue 14.20: docs/cli.md's table of JSON shapes names every key that `mcp doctor` (its
/// approval rules included) and `broker status` (each server's egress included) print, at
/// every depth.
#[test]
fn every_key_of_doctor_and_broker_status_is_in_the_documented_shapes() {
    let area = Area::new("shapes");
    area.write_config(&json!({
        "schema_version": 2,
        "mcp_servers": [scripted("s", "legacy")],
        "approvals": {"rules": [
            {"id": "gone-echo", "effect": "allow", "server": "gone", "tool": "echo"}
        ]}
    }));
    let doctor = area.run(&["mcp", "doctor", "--format", "json"]);
    let v: Value = serde_json::from_slice(&doctor.stdout).unwrap();
    assert_eq!(
        v["approval_rules"][0]["findings"][0]["code"], "unknown_server",
        "{v}"
    );
    assert_eq!(
        support::undocumented_json_keys("mcp doctor", &v),
        Vec::<String>::new()
    );
    let broker = area.broker(&[], &[]);
    let out = wait_child(area.agent(&["tools"]).spawn().unwrap());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let status = area.status();
    assert_eq!(status["servers"][0]["phase"], "ready", "{status}");
    assert!(status["servers"][0]["egress"].is_object(), "{status}");
    assert_eq!(
        support::undocumented_json_keys("broker status", &status),
        Vec::<String>::new()
    );
    drop(broker);
}

fn vm_rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// 64 agents each send a call whose arguments are the costliest a frame may carry (as many
/// empty objects as the node bound allows): calls in flight keep bytes, not trees, and their weight is
/// bounded per uid, so the broker's memory stays small and the calls beyond the bound are
/// refused `busy` with nothing sent.
#[test]
fn calls_in_flight_keep_bytes_and_their_weight_is_bounded_per_uid() {
    let area = Area::new("memory");
    area.everything();
    let broker = area.broker(&[], &[]);
    let before = vm_rss_kib(broker.pid());
    // As many nodes as a frame may carry (the decoder refuses more before building anything).
    let pad = vec![json!({}); iteron_broker::ipc::proto::MAX_NODES - 16];
    let args = json!({"message": "m", "pad": pad});
    let rt = runtime();
    // One after the other (a debug build decodes such a frame slowly, and the frames of the
    // others must not miss their deadline meanwhile); every call stays open until the end.
    let (busy, answered) = rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        let mut busy = 0usize;
        let mut answered = 0usize;
        let mut keep = Vec::new();
        for i in 0..64 {
            let sock = area.agent_socket();
            let args = args.clone();
            tasks.spawn(async move {
                let mut c = Connection::connect(&sock).await.unwrap();
                c.hello(&format!("heavy-{i}")).await.unwrap();
                let r = c
                    .request(
                        "call_tool",
                        json!({"server": "ev", "tool": "echo", "arguments": args}),
                    )
                    .await;
                (r, c)
            });
            let deadline = Instant::now() + Duration::from_secs(60);
            while answered + area.pending().len() < i + 1 {
                assert!(Instant::now() < deadline, "call {i} did not settle");
                tokio::time::sleep(Duration::from_millis(20)).await;
                while let Some(done) = tasks.try_join_next() {
                    let (r, c) = done.unwrap();
                    answered += 1;
                    match r {
                        Err(iteron_broker::ipc::client::ClientError::Refused {
                            code,
                            certainty,
                            ..
                        }) if code == "busy" => {
                            assert_eq!(certainty.as_deref(), Some("not_sent"));
                            busy += 1;
                        }
                        other => panic!("unexpected answer: {other:?}"),
                    }
                    keep.push(c);
                }
            }
        }
        (busy, answered)
    });
    let after = vm_rss_kib(broker.pid());
    let waiting = area.pending().len();
    assert!(waiting >= 1, "no call is waiting");
    assert!(busy >= 32, "{busy} refused of 64");
    assert_eq!(busy, answered);
    // Before calls kept bytes, 64 such calls took the broker past 3 GB.
    assert!(
        after < before + 256 * 1024,
        "RSS grew from {before} KiB to {after} KiB"
    );
    let records = area.audit_records();
    assert!(
        records
            .iter()
            .any(|r| r["outcome"] == "arguments_budget_full")
    );
    drop(broker);
    iteron_test_support::record!(
        "P5",
        serde_json::json!({"rss_before_kib": before, "rss_after_kib": after, "waiting": waiting, "refused_busy": busy}),
    );
}

fn hook_script(area: &Area, name: &str, body: &str) -> String {
    let p = area.base.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p.to_str().unwrap().to_owned()
}

/// Skills, agent definitions, hooks and child sessions through the broker, with the hostile
/// repository fixture as the workspace and the official everything server as the MCP server.
#[test]
fn skills_agents_hooks_and_child_sessions_through_the_broker() {
    let area = Area::new("catalog");
    support::copy_tree(
        &repo().join("fixtures/hostile-home"),
        &area.home(),
        0o700,
        0o600,
    );
    // Hooks read the operator's filesystem except the home and write only where the
    // configuration says (hooks_writable).
    let logs = area.base.join("hook-logs");
    std::fs::create_dir(&logs).unwrap();
    support::give_to_children(&logs);
    let log = logs.join("hooks.log");
    let logger = hook_script(
        &area,
        "log.sh",
        &format!("cat >> {}\necho >> {}", log.display(), log.display()),
    );
    let blocker = hook_script(
        &area,
        "block.sh",
        &format!(
            "input=$(cat)\necho \"$input\" >> {}\necho >> {}\ncase \"$input\" in *get-tiny-image*) echo 'images are not allowed here' >&2; exit 2;; esac\nexit 0",
            log.display(),
            log.display()
        ),
    );
    let config = json!({"schema_version": 2,
        "hooks_writable": [logs.to_str().unwrap()],
        "hooks": {"SessionStart": [logger], "UserPromptSubmit": [logger], "PostToolUse": [logger],
                  "Stop": [logger], "PreToolUse": [blocker]},
        "mcp_servers": [{"name": "ev", "transport": "stdio", "command": node().to_str().unwrap(),
                         "args": [everything_js().to_str().unwrap(), "stdio"]}]});
    area.write_config(&config);
    let fixture = repo().join("fixtures/hostile-repo");
    let broker = area.broker(
        &["--noninteractive", "--repo", fixture.to_str().unwrap()],
        &[],
    );

    // Skills: the index, a body on demand, an unknown name.
    let out = area
        .agent(&["skills", "--format", "json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = v["skills"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["deploy", "lint"]);
    let out = area.agent(&["use-skill", "deploy"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "Do the thing carefully.");
    let out = area.agent(&["use-skill", "zwj"]).output().unwrap();
    assert_eq!(out.status.code(), Some(4));

    // Agent definitions: exact names only; a refusal never quotes what was asked.
    let out = area
        .agent(&["resolve-agent", "reviewer", "--format", "json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["agent"]["tier"], "user");
    let identity = v["agent"]["identity"].as_str().unwrap().to_owned();
    let out = area.agent(&["resolve-agent", "reviewer"]).output().unwrap();
    assert_eq!(
        text(&out.stdout).trim(),
        format!("reviewer (user tier) identity {identity}")
    );
    for (asked, why) in [
        ("Reviewer", "no agent definition with that name"),
        ("rev/iewer", "the agent type must be"),
        ("router", "only the parent's model (inherit)"),
    ] {
        let out = area.agent(&["resolve-agent", asked]).output().unwrap();
        assert_eq!(out.status.code(), Some(9));
        let line = text(&out.stderr);
        assert!(line.contains(why), "{line}");
        if asked != "router" {
            assert!(
                !line.contains(asked),
                "the refusal quotes the caller: {line}"
            );
        }
    }
    let out = area
        .agent(&["resolve-agent", "reviewer", "--model", "another-route"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(9));
    assert!(!text(&out.stderr).contains("another-route"));

    // A PreToolUse hook blocks before approval is even asked; others pass to the approval gate.
    let out = area
        .agent(&["call", "ev", "get-tiny-image"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(9));
    assert!(
        text(&out.stderr).contains("blocked by an operator hook: images are not allowed here"),
        "{}",
        text(&out.stderr)
    );
    let out = area
        .agent(&["call", "ev", "echo", "--json", r#"{"message":"x"}"#])
        .output()
        .unwrap();
    assert!(
        text(&out.stderr).contains("approval_required"),
        "{}",
        text(&out.stderr)
    );

    let rt = runtime();
    rt.block_on(async {
        // A parent session: the prompt reaches the UserPromptSubmit hook, end_session Stop.
        let mut c = Connection::connect(&area.agent_socket()).await.unwrap();
        c.hello("parent").await.unwrap();
        c.request("submit_prompt", json!({"prompt": "please review src/"}))
            .await
            .unwrap();
        c.request("end_session", json!({})).await.unwrap();

        // A child session bound to the Planner definition (three consecutive tool errors at
        // most): a read-only ceiling hides every MCP tool, no hook runs, the budget is enforced.
        let mut c = Connection::connect(&area.agent_socket()).await.unwrap();
        let hello = c
            .request(
                "hello",
                json!({"protocol": 1, "client": "child", "agent_type": "Planner"}),
            )
            .await
            .unwrap();
        assert_eq!(hello["agent"]["name"], "Planner");
        let tools = c.request("list_tools", json!({})).await.unwrap();
        assert_eq!(tools["tools"], json!([]));
        for _ in 0..3 {
            let e = c
                .request(
                    "call_tool",
                    json!({"server": "ev", "tool": "echo", "arguments": {"message": "x"}}),
                )
                .await
                .unwrap_err();
            assert!(e.to_string().starts_with("unknown_tool"), "{e}");
        }
        let e = c
            .request(
                "call_tool",
                json!({"server": "ev", "tool": "echo", "arguments": {}}),
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("consecutive tool errors"), "{e}");
        c.request("submit_prompt", json!({"prompt": "child prompt"}))
            .await
            .unwrap();
        c.request("end_session", json!({})).await.unwrap();

        // An unknown definition: hello is refused and the connection closed.
        let mut c = Connection::connect(&area.agent_socket()).await.unwrap();
        let e = c
            .request("hello", json!({"protocol": 1, "agent_type": "planner"}))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no agent definition"), "{e}");
    });

    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
    let hook_log = std::fs::read_to_string(&log).unwrap();
    let events: Vec<Value> = hook_log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert!(
        kinds.contains(&"SessionStart") && kinds.contains(&"Stop") && kinds.contains(&"PreToolUse")
    );
    let prompts: Vec<&Value> = events
        .iter()
        .filter(|e| e["event"] == "UserPromptSubmit")
        .collect();
    assert_eq!(
        prompts.len(),
        1,
        "the child's prompt ran no hook: {hook_log}"
    );
    assert_eq!(prompts[0]["prompt"], "please review src/");
    assert!(!hook_log.contains("child prompt"));

    let records = area.audit_records();
    let child_hello = records
        .iter()
        .find(|r| {
            r["kind"] == "hello" && r["detail"].as_str().unwrap_or("").contains("child session")
        })
        .unwrap();
    assert!(child_hello["detail"].as_str().unwrap().contains("Planner"));
    // The definition's identity, whole (not redacted), in the session's first record.
    let planner_identity = child_hello["identity"].as_str().unwrap();
    assert_eq!(planner_identity.len(), 64);
    assert_ne!(
        planner_identity, identity,
        "that was the reviewer's identity"
    );
    let hooks: Vec<&Value> = records.iter().filter(|r| r["kind"] == "hook").collect();
    assert!(hooks.iter().any(|r| r["decision"] == "blocked"));
    assert!(hooks.iter().all(|r| r["session"] != child_hello["session"]));
    assert!(area.run(&["audit", "verify"]).status.success());
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    const CANARY: &str = "iteron-fuzz-canary-5c2a9e";

    #[derive(Debug, Clone)]
    enum Input {
        Raw(Vec<u8>),
        Truncated(Vec<u8>, usize),
        Oversized(u32),
        Frames(Vec<Vec<u8>>),
    }

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    fn json_frames() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            Just(br#"{"id":1,"method":"hello","params":{"protocol":1}}"#.to_vec()),
            Just(br#"{"id":2,"method":"list_tools"}"#.to_vec()),
            Just(br#"{"id":3,"method":"call_tool","params":{"server":"s","tool":"t"}}"#.to_vec()),
            Just(br#"{"id":4,"method":"status"}"#.to_vec()),
            Just(br#"{"id":5,"method":"end_session"}"#.to_vec()),
            "[ -~]{0,40}".prop_map(|s| format!(r#"{{"id":9,"method":"{s}"}}"#).into_bytes()),
            prop::collection::vec(any::<u8>(), 1..64),
        ]
    }

    fn inputs() -> impl Strategy<Value = Input> {
        prop_oneof![
            prop::collection::vec(any::<u8>(), 1..200).prop_map(Input::Raw),
            (json_frames(), 0usize..40).prop_map(|(b, cut)| Input::Truncated(frame(&b), cut)),
            ((iteron_broker::ipc::frame::MAX_FRAME as u32 + 1)..=u32::MAX)
                .prop_map(Input::Oversized),
            prop::collection::vec(json_frames(), 1..5).prop_map(Input::Frames),
        ]
    }

    #[test]
    fn random_truncated_oversized_and_out_of_state_frames_never_crash_or_leak() {
        let area = Area::new("fuzz");
        area.config(json!([{
            "name": "s",
            "transport": "stdio",
            "command": "/usr/bin/python3",
            "args": [repo().join("fixtures/stdio/echo_server.py").to_str().unwrap()],
            "env": ["ITERON_FUZZ_SECRET"],
        }]));
        let broker = area.broker(&["--noninteractive"], &[("ITERON_FUZZ_SECRET", CANARY)]);
        let sock = area.agent_socket();
        let rt = runtime();
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 300,
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let executed = std::sync::atomic::AtomicUsize::new(0);
        runner
            .run(&inputs(), |input| {
                executed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                rt.block_on(async {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut s = tokio::net::UnixStream::connect(&sock).await.unwrap();
                    let bytes = match &input {
                        Input::Raw(b) => b.clone(),
                        Input::Truncated(f, cut) => f[..(*cut).min(f.len())].to_vec(),
                        Input::Oversized(n) => n.to_be_bytes().to_vec(),
                        Input::Frames(fs) => fs.iter().flat_map(|f| frame(f)).collect(),
                    };
                    let _ = s.write_all(&bytes).await;
                    // Half-close: a truncated frame then ends; the broker must close.
                    let _ = s.shutdown().await;
                    let mut got = Vec::new();
                    let read =
                        tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got))
                            .await;
                    prop_assert!(
                        read.is_ok(),
                        "the broker kept the connection open: {input:?}"
                    );
                    prop_assert!(!String::from_utf8_lossy(&got).contains(CANARY));
                    // Every answer is a well-formed frame.
                    let mut rest = &got[..];
                    while !rest.is_empty() {
                        prop_assert!(rest.len() >= 4);
                        let n = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                        prop_assert!(rest.len() >= 4 + n);
                        let v: Value = serde_json::from_slice(&rest[4..4 + n]).unwrap();
                        prop_assert!(v.get("result").is_some() || v.get("error").is_some());
                        if let Some(m) = v["error"]["message"].as_str() {
                            prop_assert!(m.len() <= 512 && !m.contains('\n'));
                        }
                        rest = &rest[4 + n..];
                    }
                    Ok(())
                })
            })
            .unwrap();
        // Still alive and serving.
        let out = area.agent(&["tools"]).output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let (code, err) = broker.finish();
        assert_eq!(code, Some(0), "{err}");
        assert!(!err.contains(CANARY));
        let audit = serde_json::to_string(&area.audit_records()).unwrap();
        assert!(!audit.contains(CANARY));
        let n = executed.load(std::sync::atomic::Ordering::SeqCst);
        eprintln!("fuzz: {n} inputs against the live broker, 0 crashes");
        iteron_test_support::record!("P10", json!({"executions": n, "crashes": 0}));
        // Every answer was checked: one line, at most 512 bytes, no canary.
        iteron_test_support::record!("P8", json!({"executions": n}));
    }
}

mod privilege {
    use super::*;

    fn as_nobody(cmd: &mut Command) -> &mut Command {
        cmd.uid(NOBODY).gid(NOBODY).env_remove("ITERON_HOME")
    }

    /// The operator's commands talk only to a broker of their own uid: a socket served by
    /// another user (here uid 65534, at the path the operator names) is refused before anything
    /// is sent, and what it would have answered is never shown.
    #[test]
    fn operator_commands_refuse_a_socket_served_by_another_uid() {
        if !is_root() {
            eprintln!("skipped: serving a socket as uid 65534 needs root (CI runs as root)");
            return;
        }
        let area = Area::new("wrongpeer");
        area.config(json!([]));
        let dir = area.base.join("theirs");
        std::fs::create_dir(&dir).unwrap();
        let uid = nix::unistd::Uid::from_raw(NOBODY);
        let gid = nix::unistd::Gid::from_raw(NOBODY);
        nix::unistd::chown(&dir, Some(uid), Some(gid)).unwrap();
        let sock = dir.join("operator.sock");
        let script = "import socket, sys, time\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(8)\nprint('ready', flush=True)\nwhile True:\n    c, _ = s.accept()\n    try:\n        c.recv(65536)\n        body = b'{\"id\":1,\"result\":{\"protocol\":1,\"x\":\"forged\"}}'\n        c.sendall(len(body).to_bytes(4, 'big') + body)\n    except OSError:\n        pass\n    c.close()\n";
        let mut server = as_nobody(
            Command::new("/usr/bin/python3")
                .args(["-c", script])
                .arg(&sock)
                .stdout(Stdio::piped()),
        )
        .spawn()
        .unwrap();
        let mut ready = [0u8; 6];
        server
            .stdout
            .take()
            .unwrap()
            .read_exact(&mut ready)
            .unwrap();
        for args in [
            &["broker", "status"][..],
            &["approvals", "list"],
            &["broker", "stop", "s"],
        ] {
            let mut full = args.to_vec();
            full.extend(["--operator-socket", sock.to_str().unwrap()]);
            let out = area.run(&full);
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(11), "{args:?}: {err}");
            assert!(
                err.contains("is served by uid 65534, not by this user"),
                "{args:?}: {err}"
            );
            assert!(!text(&out.stdout).contains("forged"));
        }
        let _ = server.kill();
        let _ = server.wait();
        iteron_test_support::record!("P2", json!({}),);
    }

    #[test]
    fn uid_65534_is_refused_unless_allowed_and_never_reaches_the_operator_or_the_home() {
        if !is_root() {
            eprintln!("skipped: dropping to uid 65534 needs root (CI runs as root)");
            return;
        }
        let area = Area::new("nobody");
        area.config(json!([{
            "name": "s",
            "transport": "stdio",
            "command": "/usr/bin/python3",
            "args": [repo().join("fixtures/stdio/echo_server.py").to_str().unwrap()],
        }]));

        // Not on the allowlist (another uid is): the socket is reachable by modes (0711 dir,
        // 0666 socket), so the refusal comes from the peer-credential check.
        let broker = area.broker(&["--noninteractive", "--allow-uid", "12345"], &[]);
        let dir_mode = std::fs::metadata(area.agent_socket().parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        let sock_mode = std::fs::metadata(area.agent_socket())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!((dir_mode, sock_mode), (0o711, 0o666));
        let out = as_nobody(&mut area.agent(&["tools"])).output().unwrap();
        assert_eq!(out.status.code(), Some(9), "{}", text(&out.stderr));
        assert!(text(&out.stderr).contains("this uid may not use this socket"));
        drop(broker);
        let refused: Vec<Value> = area
            .audit_records()
            .into_iter()
            .filter(|r| r["outcome"] == "peer_uid_not_allowed" && r["peer_uid"] == NOBODY)
            .collect();
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0]["peer_uid"], NOBODY);

        // On the allowlist: it works, with nothing but the socket path.
        let broker = area.broker(&["--noninteractive", "--allow-uid", "65534"], &[]);
        let out = as_nobody(&mut area.agent(&["tools"])).output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(text(&out.stdout).contains("s/echo"));
        let out = as_nobody(&mut area.agent(&["call", "s", "echo"]))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(9));
        assert!(text(&out.stderr).contains("approval_required"));

        // The operator socket refuses uid 65534 even when its modes would let it in.
        std::fs::set_permissions(area.home(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(
            area.operator_socket().parent().unwrap(),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        std::fs::set_permissions(
            area.operator_socket(),
            std::fs::Permissions::from_mode(0o777),
        )
        .unwrap();
        let op = area.operator_socket();
        // A plain client (the agent's, which connects to any broker) sent by uid 65534: the
        // broker itself refuses it (one frame, `refused`).
        let mut raw = Command::new(iteron());
        raw.args(["agent", "--socket", op.to_str().unwrap(), "tools"])
            .stdin(Stdio::null());
        let out = as_nobody(&mut raw).output().unwrap();
        assert_eq!(out.status.code(), Some(9), "{}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("this uid may not use this socket"),
            "{}",
            text(&out.stderr)
        );
        // The operator's own commands, run by uid 65534, refuse the root broker before sending
        // anything (it is not theirs).
        for args in [&["broker", "status"][..], &["approvals", "list"]] {
            let mut full = args.to_vec();
            full.extend(["--operator-socket", op.to_str().unwrap()]);
            let out = as_nobody(&mut area.iteron(&full)).output().unwrap();
            assert_eq!(out.status.code(), Some(11), "{}", text(&out.stderr));
        }
        std::fs::set_permissions(area.home(), std::fs::Permissions::from_mode(0o700)).unwrap();

        // The home stays unreadable to the agent uid.
        let cat = as_nobody(Command::new("/bin/cat").arg(area.home().join("config.json")))
            .output()
            .unwrap();
        assert!(!cat.status.success());
        assert!(
            text(&cat.stderr).contains("Permission denied"),
            "{}",
            text(&cat.stderr)
        );
        let ls = as_nobody(Command::new("/bin/ls").arg(area.home().join("audit")))
            .output()
            .unwrap();
        assert!(!ls.status.success());
        drop(broker);
        iteron_test_support::record!("P2", serde_json::json!({}),);
    }

    /// The broker is not dumpable: a same-uid ptrace attach fails with EPERM, while the same
    /// attach to an ordinary process of that uid succeeds (so the test can fail). The tracer is
    /// the parent of both targets, so Yama's "descendants only" rule allows both attaches.
    #[test]
    fn ptrace_attach_to_the_broker_is_refused() {
        if !is_root() {
            eprintln!("skipped: dropping to uid 65534 needs root (CI runs as root)");
            return;
        }
        let area = Area::new("ptrace");
        area.config(json!([]));
        let uid = nix::unistd::Uid::from_raw(NOBODY);
        let gid = nix::unistd::Gid::from_raw(NOBODY);
        nix::unistd::chown(&area.home(), Some(uid), Some(gid)).unwrap();
        nix::unistd::chown(&area.home().join("config.json"), Some(uid), Some(gid)).unwrap();
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(area.base.join("run"))
            .unwrap();
        nix::unistd::chown(&area.base.join("run"), Some(uid), Some(gid)).unwrap();
        let script = r#"
import ctypes, os, subprocess, sys, time
libc = ctypes.CDLL(None, use_errno=True)
def attach(pid):
    r = libc.ptrace(16, pid, None, None)
    e = ctypes.get_errno()
    if r == 0:
        os.waitpid(pid, 0)
        libc.ptrace(17, pid, None, None)
    return r, e
broker = subprocess.Popen(sys.argv[1:], stderr=subprocess.PIPE)
sock = sys.argv[sys.argv.index("--socket") + 1]
for _ in range(500):
    if os.path.exists(sock):
        break
    time.sleep(0.02)
time.sleep(0.2)
plain = subprocess.Popen(["/bin/sleep", "30"])
print("broker", *attach(broker.pid))
print("plain", *attach(plain.pid))
plain.kill(); broker.terminate(); broker.wait()
"#;
        let sock = area.agent_socket();
        let out = Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(script)
            .args([
                iteron(),
                "broker",
                "serve",
                "--noninteractive",
                "--socket",
                sock.to_str().unwrap(),
            ])
            .env("ITERON_HOME", area.home())
            .uid(NOBODY)
            .gid(NOBODY)
            .output()
            .unwrap();
        let shown = text(&out.stdout);
        assert!(
            shown.contains(&format!("broker -1 {}", nix::libc::EPERM)),
            "{shown} {}",
            text(&out.stderr)
        );
        assert!(
            shown.contains("plain 0"),
            "the control attach failed, so this test proves nothing: {shown}"
        );
        iteron_test_support::record!("P2", serde_json::json!({}),);
    }
}

/// The audit log under attack: laundering, removal, flooding and a full disk.
mod audit_log {
    use super::*;
    use iteron_broker::audit::MAX_AGENT_RECORDS_PER_SEC;

    /// Start a broker from `cmd` (any wrapper around `iteron broker serve`) and wait for both
    /// sockets.
    fn start(area: &Area, mut cmd: Command) -> Broker {
        cmd.env("ITERON_HOME", area.home())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let b = Broker {
            child: cmd.spawn().unwrap(),
            socket: area.operator_socket(),
        };
        let sockets = [area.agent_socket(), area.operator_socket()];
        if support::wait_listening(&[&sockets[0], &sockets[1]], Duration::from_secs(15)) {
            return b;
        }
        panic!("the broker did not start: {}", b.finish().1);
    }

    /// A broker start that must be refused: its stderr.
    fn refused_start(area: &Area) -> String {
        let sock = area.agent_socket();
        let mut child = area
            .iteron(&[
                "broker",
                "serve",
                "--noninteractive",
                "--socket",
                sock.to_str().unwrap(),
            ])
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the broker started on a log it should have refused");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success());
        text(&out.stderr)
    }

    fn day_file(area: &Area) -> PathBuf {
        std::fs::read_dir(area.home().join("audit"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .unwrap()
    }

    fn sha256(s: &str) -> String {
        iteron_broker::audit::sha256_hex(s.as_bytes())
    }

    /// The leading count of an `audit_suppressed` record.
    fn suppressed(records: &[Value]) -> u64 {
        records
            .iter()
            .filter(|r| r["kind"] == "audit_suppressed")
            .map(|r| {
                let d = r["detail"].as_str().unwrap();
                d.split(' ').next().unwrap().parse::<u64>().unwrap()
            })
            .sum()
    }

    /// Issues 18.2 and 18.3: the broker never launders an edited tail (edit the newest record,
    /// chain one more to it) and never starts a new chain where a log was removed; `audit
    /// verify` names both, and the newest record printed at stop pins the log from outside.
    #[test]
    fn a_laundered_or_removed_log_stops_the_broker_and_verify_names_it() {
        let area = Area::new("launder");
        area.config(json!([]));
        let (code, err) = area.broker(&["--noninteractive"], &[]).finish();
        assert_eq!(code, Some(0), "{err}");
        let pin = err
            .lines()
            .find_map(|l| l.strip_prefix("iteron broker: stopped; newest audit record "))
            .and_then(|r| r.split(' ').next())
            .unwrap_or_else(|| panic!("no stop line: {err}"))
            .to_owned();
        assert!(
            err.contains(&format!("iteron audit verify --expect {pin}")),
            "{err}"
        );
        let out = area.run(&["audit", "verify", "--format", "json"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            (&v["pin"], &v["anchor"], &v["head_seq"]),
            (&json!(pin), &json!(pin), &json!(1))
        );
        let out = area.run(&["audit", "verify", "--expect", &pin]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(text(&out.stdout).contains("expected: 1 records match"));

        // Edit the newest record and chain one more to the edit: refused, and still evident.
        let day = day_file(&area);
        let original = std::fs::read_to_string(&day).unwrap();
        let mut lines: Vec<String> = original.lines().map(str::to_owned).collect();
        lines[1] = lines[1].replace("\"outcome\":\"ok\"", "\"outcome\":\"failed\"");
        let mut next: Value = serde_json::from_str(&lines[1]).unwrap();
        next["seq"] = json!(2);
        next["prev"] = json!(sha256(&lines[1]));
        lines.push(next.to_string());
        std::fs::write(&day, lines.join("\n") + "\n").unwrap();
        let err = refused_start(&area);
        assert!(err.contains("audit log is inconsistent"), "{err}");
        let out = area.run(&["audit", "verify"]);
        assert_eq!(out.status.code(), Some(10), "{}", text(&out.stdout));

        // Remove every day file and the head: the anchor outside audit/ names what is missing.
        std::fs::write(&day, &original).unwrap();
        assert!(area.run(&["audit", "verify"]).status.success());
        std::fs::remove_file(&day).unwrap();
        std::fs::remove_file(area.home().join("audit/head")).unwrap();
        let err = refused_start(&area);
        assert!(
            err.contains("audit-anchor names record 1: it was removed"),
            "{err}"
        );
        assert!(
            !area.home().join("audit/head").exists(),
            "a new chain was started"
        );
        let out = area.run(&["audit", "verify"]);
        assert_eq!(out.status.code(), Some(10));
        assert!(
            text(&out.stderr).contains("audit-anchor names"),
            "{}",
            text(&out.stderr)
        );
        // Removed with its anchor, the log is gone as far as the home can tell; the pin is not.
        std::fs::remove_file(area.home().join("audit-anchor")).unwrap();
        assert!(area.run(&["audit", "verify"]).status.success());
        let out = area.run(&["audit", "verify", "--expect", &pin]);
        assert_eq!(out.status.code(), Some(10));
        assert!(
            text(&out.stderr).contains("ends before record 1"),
            "{}",
            text(&out.stderr)
        );
        iteron_test_support::record!("P11", json!({"pin": pin}),);
    }

    /// Issue 17.2: an agent pipelining cheap requests (resolve_agent, refused calls, list_tools)
    /// gets at most MAX_AGENT_RECORDS_PER_SEC records a second; the rest are counted in
    /// `audit_suppressed` records, so the count stays exact.
    #[test]
    fn pipelined_cheap_requests_cannot_flood_the_audit_log() {
        const N: u64 = 1500;
        let area = Area::new("flood");
        area.config(json!([]));
        let broker = area.broker(&["--noninteractive"], &[]);
        let rt = runtime();
        rt.block_on(async {
            let mut c = Connection::connect(&area.agent_socket()).await.unwrap();
            c.hello("flood").await.unwrap();
            for i in 0..N {
                let (method, params) = match i % 3 {
                    0 => ("resolve_agent", json!({"agent_type": "Nope"})),
                    1 => (
                        "call_tool",
                        json!({"server": "none", "tool": "x", "arguments": {}}),
                    ),
                    _ => ("list_tools", json!({})),
                };
                let _ = c.request(method, params).await;
            }
        });
        let status = area.status();
        assert_eq!(status["audit"]["state"], "ok", "{status}");
        assert!(status["audit"]["suppressed_records"].as_u64().unwrap() > 0);
        let (code, _) = broker.finish();
        assert_eq!(code, Some(0));
        let records = area.audit_records();
        let own = nix::unistd::geteuid().as_raw();
        let agent: Vec<&Value> = records
            .iter()
            .filter(|r| {
                r["peer_uid"] == own
                    && ["hello", "resolve_agent", "call_tool", "list_tools"]
                        .contains(&r["kind"].as_str().unwrap())
            })
            .collect();
        let counted = suppressed(&records);
        assert!(counted > 0);
        assert_eq!(
            agent.len() as u64 + counted,
            N + 1,
            "a request went unaccounted"
        );
        let mut per_second: std::collections::HashMap<&str, u32> = Default::default();
        for r in &agent {
            *per_second
                .entry(&r["time"].as_str().unwrap()[..19])
                .or_default() += 1;
        }
        assert!(
            per_second.values().all(|n| *n <= MAX_AGENT_RECORDS_PER_SEC),
            "{per_second:?}"
        );
        assert!(area.run(&["audit", "verify"]).status.success());
        iteron_test_support::record!(
            "P11",
            json!({"requests": N + 1, "written": agent.len(), "counted": counted}),
        );
    }

    /// Issues 18.11 and 17.2: a write that fails mid-record (the broker's file-size limit,
    /// with SIGXFSZ ignored, behaves like a full disk) leaves whole records only; the failure
    /// is on the broker's stderr, in `status` and in `mcp doctor`, and every effect is refused.
    #[test]
    fn an_audit_failure_is_loud_refuses_every_effect_and_leaves_whole_records() {
        let area = Area::new("auditfail");
        area.config(json!([{"name": "srv", "transport": "stdio", "command": "/bin/true"}]));
        let sock = area.agent_socket();
        let mut cmd = Command::new("/bin/sh");
        cmd.args([
            "-c",
            "ulimit -f 64 && trap '' XFSZ && exec \"$0\" \"$@\"",
            iteron(),
        ])
        .args([
            "broker",
            "serve",
            "--noninteractive",
            "--socket",
            sock.to_str().unwrap(),
        ]);
        let broker = start(&area, cmd);
        let rt = runtime();
        let cancels = rt.block_on(async {
            let mut c = Connection::connect(&area.operator_socket()).await.unwrap();
            c.hello("filler").await.unwrap();
            for i in 1..=5000u32 {
                c.request("cancel", json!({"server": "srv"})).await.unwrap();
                if i % 20 == 0 {
                    let s = c.request("status", json!({})).await.unwrap();
                    if s["audit"]["state"] == "failed" {
                        return i;
                    }
                }
            }
            panic!("the audit log never hit the file-size limit");
        });
        // Every effect is refused, with the reason.
        let out = area
            .agent(&["call", "srv", "x", "--json", "{}"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(9), "{}", text(&out.stderr));
        assert!(text(&out.stderr).contains("cannot write its audit log"));
        let status = area.status();
        assert_eq!(status["audit"]["state"], "failed");
        let detail = status["audit"]["detail"].as_str().unwrap();
        assert!(
            detail.contains("the file still ends in a whole record"),
            "{detail}"
        );
        let shown = text(&area.run(&["broker", "status"]).stdout);
        assert!(
            shown.contains("audit: FAILED (audit log: cannot append"),
            "{shown}"
        );
        let doctor = area.run(&["mcp", "doctor", "--format", "json"]);
        assert!(!doctor.status.success());
        let d: Value = serde_json::from_slice(&doctor.stdout).unwrap();
        assert_eq!(
            (&d["audit"]["state"], &d["ok"]),
            (&json!("failed"), &json!(false))
        );
        let (code, err) = broker.finish();
        assert_eq!(code, Some(0), "{err}");
        assert!(
            err.contains("iteron broker: AUDIT LOG FAILED: audit log: cannot append to "),
            "{err}"
        );
        assert!(err.contains("stopped; newest audit record "), "{err}");
        // Whole records only, consistent with the head: it verifies, and a broker continues it.
        let raw = std::fs::read(day_file(&area)).unwrap();
        assert_eq!(raw.last(), Some(&b'\n'));
        let out = area.run(&["audit", "verify"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let (code, err) = area.broker(&["--noninteractive"], &[]).finish();
        assert_eq!(code, Some(0), "{err}");
        assert!(area.run(&["audit", "verify"]).status.success());
        iteron_test_support::record!(
            "P11",
            json!({"operator_actions_before_failure": cancels, "log_bytes": raw.len()}),
        );
    }

    /// Unmounts at drop.
    struct Mounted(PathBuf);

    impl Drop for Mounted {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }

    /// Issue 17.2: under the space reserve effects are refused with their reason, and the
    /// state is in `status`, `mcp doctor` and on the broker's stderr.
    #[test]
    fn under_the_space_reserve_effects_are_refused_and_the_operator_is_told() {
        if !is_root() {
            eprintln!("skipped: not root, cannot mount a tmpfs");
            return;
        }
        let area = Area::new("lowspace");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs"])
            .arg(area.home())
            .output()
            .unwrap();
        if !out.status.success() {
            eprintln!(
                "skipped: mount -t tmpfs failed: {}",
                text(&out.stderr).trim()
            );
            return;
        }
        let _mounted = Mounted(area.home());
        area.config(json!([{"name": "srv", "transport": "stdio", "command": "/bin/true"}]));
        let broker = area.broker(&["--noninteractive"], &[]);
        let out = area
            .agent(&["call", "srv", "x", "--json", "{}"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(9), "{}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("nearly full"),
            "{}",
            text(&out.stderr)
        );
        let status = area.status();
        assert_eq!(status["audit"]["state"], "low_space", "{status}");
        let shown = text(&area.run(&["broker", "status"]).stdout);
        assert!(shown.contains("audit: LOW_SPACE ("), "{shown}");
        let doctor = area.run(&["mcp", "doctor", "--format", "json"]);
        let d: Value = serde_json::from_slice(&doctor.stdout).unwrap();
        assert_eq!(d["audit"]["state"], "low_space");
        assert!(!doctor.status.success());
        let (code, err) = broker.finish();
        assert_eq!(code, Some(0), "{err}");
        assert!(err.contains("under the reserve of 16777216"), "{err}");
        assert!(area.run(&["audit", "verify"]).status.success());
        // Without a broker, doctor measures it itself.
        let d: Value =
            serde_json::from_slice(&area.run(&["mcp", "doctor", "--format", "json"]).stdout)
                .unwrap();
        assert_eq!(d["audit"]["state"], "low_space");
        iteron_test_support::record!("P11", json!({"tmpfs": "2m"}),);
    }
}

/// Under a root broker the stdio servers run as uid 65534 and cannot read `/etc/shadow`; each
/// leaves a double-forked grandchild in a session of its own. `iteron broker stop` of one ends
/// its grandchild (killed and reaped, not a zombie of the broker) and leaves the other's; the
/// broker's shutdown ends the other's.
#[test]
fn a_root_brokers_servers_run_as_nobody_and_leave_no_descendant_behind() {
    let area = Area::new("descendants");
    let logs = area.base.join("logs");
    std::fs::create_dir(&logs).unwrap();
    support::give_to_children(&logs);
    let fixtures = repo().join("fixtures/stdio").canonicalize().unwrap();
    let server = |tag: &str| {
        let script = format!(
            "{{ id -u; head -c 1 /etc/shadow >/dev/null 2>&1 && echo shadow-read || echo shadow-denied; }} > {logs}/{tag}.id; \
             (setsid sh -c 'echo $$ > {logs}/{tag}.tmp; mv {logs}/{tag}.tmp {logs}/{tag}.pid; exec sleep 300' </dev/null >/dev/null 2>&1 &); \
             while [ ! -s {logs}/{tag}.pid ]; do sleep 0.05; done; \
             exec /usr/bin/python3 {fixture}",
            logs = logs.display(),
            fixture = fixtures.join("echo_server.py").display(),
        );
        json!({"name": tag, "transport": "stdio", "command": "/bin/sh", "args": ["-c", script],
               "sandbox": {"writable": [logs.to_str().unwrap()],
                           "readable": [fixtures.to_str().unwrap()]}})
    };
    area.config(json!([server("a"), server("b")]));
    let broker = area.broker(&["--noninteractive"], &[]);
    let out = area.agent(&["tools", "--format", "json"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let pid_of = |tag: &str| -> i32 {
        let p = logs.join(format!("{tag}.pid"));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(s) = std::fs::read_to_string(&p)
                && let Ok(pid) = s.trim().parse()
            {
                return pid;
            }
            assert!(
                Instant::now() < deadline,
                "{tag} never started its grandchild"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let (a, b) = (pid_of("a"), pid_of("b"));
    assert!(support::process_exists(a) && support::process_exists(b));
    for tag in ["a", "b"] {
        let id = std::fs::read_to_string(logs.join(format!("{tag}.id"))).unwrap();
        let uid = if is_root() {
            support::CHILD_UID
        } else {
            nix::unistd::geteuid().as_raw()
        };
        assert_eq!(id, format!("{uid}\nshadow-denied\n"), "{tag}");
    }
    // Stopping one server ends its grandchild, and only its.
    assert!(area.run(&["broker", "stop", "a"]).status.success());
    assert!(
        !support::process_exists(a),
        "server a's grandchild {a} outlived its stop"
    );
    assert!(
        support::process_exists(b),
        "server b's grandchild went with a's"
    );
    // The broker's shutdown ends the other.
    let (code, err) = broker.finish();
    assert_eq!(code, Some(0), "{err}");
    assert!(
        !support::process_exists(b),
        "server b's grandchild {b} outlived the broker"
    );
    iteron_test_support::record!("P9", json!({"root": is_root(), "grandchildren": 2}),);
}

/// A `web_egress` server that tries the host's loopback and the cloud metadata address through
/// its egress path: both refused, the loopback listener sees nothing, `iteron broker status`
/// counts the refusals and names the last one, and the audit log records each with its host
/// and port only.
#[test]
fn a_web_egress_servers_refused_destinations_are_counted_in_status_and_audited() {
    if iteron_broker::sys::netns_support().is_err() {
        eprintln!("skipped: this system offers no network namespace");
        return;
    }
    let area = Area::new("egress");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let lo = format!("127.0.0.1:{}", listener.local_addr().unwrap().port());
    let probe = area.base.join("probe.py");
    std::fs::write(
        &probe,
        "import os, socket, sys\n\
         host, port = os.environ['HTTPS_PROXY'].rsplit('/', 1)[1].rsplit(':', 1)\n\
         for t in sys.argv[1:]:\n\
         \x20   s = socket.create_connection((host, int(port)), timeout=10)\n\
         \x20   s.sendall(f'CONNECT {t} HTTP/1.1\\r\\nHost: {t}\\r\\n\\r\\n'.encode())\n\
         \x20   print(s.recv(4096).split(b'\\r\\n')[0].decode(), file=sys.stderr)\n",
    )
    .unwrap();
    let fixtures = repo().join("fixtures/stdio").canonicalize().unwrap();
    let script = format!(
        "/usr/bin/python3 {probe} {lo} 169.254.169.254:80 && exec /usr/bin/python3 {fixture}",
        probe = probe.display(),
        fixture = fixtures.join("echo_server.py").display(),
    );
    area.write_config(&json!({
        "schema_version": 2,
        "host_ceiling": ["read_only", "irreversible_external", "web_egress"],
        "mcp_servers": [{"name": "fetcher", "transport": "stdio", "command": "/bin/sh",
                         "args": ["-c", script],
                         "sandbox": {"readable": [fixtures.to_str().unwrap(),
                                                  area.base.to_str().unwrap()]}}]
    }));
    let broker = area.broker(&["--noninteractive"], &[]);
    let out = area.agent(&["tools", "--format", "json"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let status = area.status();
    let fetcher = status["servers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "fetcher")
        .unwrap()
        .clone();
    assert_eq!(fetcher["phase"], "ready", "{status}");
    assert_eq!(fetcher["egress"]["refused"], 2, "{status}");
    let last = fetcher["egress"]["last_refused"].as_str().unwrap();
    assert!(
        last.starts_with("169.254.169.254:80: ") && last.contains("link_local"),
        "{last}"
    );
    assert!(
        listener.accept().is_err(),
        "the loopback listener was reached"
    );
    let (code, err) = broker.finish();
    assert_eq!(code, Some(0), "{err}");
    let refused: Vec<Value> = area
        .audit_records()
        .into_iter()
        .filter(|r| r["kind"] == "egress_refused")
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    for (r, target) in refused.iter().zip([lo.as_str(), "169.254.169.254:80"]) {
        assert_eq!(r["server"], "fetcher");
        assert_eq!(r["decision"], "refused");
        let d = r["detail"].as_str().unwrap();
        assert!(d.starts_with(&format!("{target}: refused: ")), "{d}");
        assert!(!d.contains("Host:") && !d.contains("CONNECT"), "{d}");
    }
    iteron_test_support::record!("P9", json!({"refused": 2}),);
    iteron_test_support::record!("P3", json!({}),);
}

/// The golden exchanges of `fixtures/ipc/exchanges.json`, replayed against a real broker: each
/// request frame sent as written, each answer compared whole with the golden one (values at
/// the entry's `volatile` pointers only need to be present). With `ITERON_WRITE_GOLDEN=1` the
/// run writes the answers it received back into the file instead (review the diff).
#[test]
fn golden_ipc_exchanges_are_what_the_broker_answers() {
    let path = repo().join("fixtures/ipc/exchanges.json");
    let mut doc: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let write = std::env::var_os("ITERON_WRITE_GOLDEN").is_some();
    let area = Area::new("golden");
    area.config(json!([scripted("s", "legacy")]));
    let broker = area.broker(&["--noninteractive"], &[]);
    let rt = runtime();
    let exchanges = doc["exchanges"].as_array_mut().unwrap();
    rt.block_on(async {
        let mut open: Option<(String, Connection)> = None;
        for (n, e) in exchanges.iter_mut().enumerate() {
            let label = e["connection"].as_str().unwrap().to_owned();
            if open.as_ref().is_none_or(|(l, _)| *l != label) {
                let socket = match e["socket"].as_str().unwrap() {
                    "agent" => area.agent_socket(),
                    _ => area.operator_socket(),
                };
                open = Some((label.clone(), Connection::connect(&socket).await.unwrap()));
            }
            let (_, c) = open.as_mut().unwrap();
            c.send_raw(&serde_json::to_vec(&e["request"]).unwrap())
                .await
                .unwrap();
            let got = c
                .read_value()
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("exchange {n}: the broker closed without answering"));
            if write {
                e["answer"] = got;
                continue;
            }
            let mut want = e["answer"].clone();
            let mut seen = got.clone();
            for p in e["volatile"].as_array().into_iter().flatten() {
                let p = p.as_str().unwrap();
                for v in [&mut want, &mut seen] {
                    let slot = v
                        .pointer_mut(p)
                        .unwrap_or_else(|| panic!("exchange {n}: no {p} in {got}"));
                    *slot = Value::Null;
                }
            }
            assert_eq!(seen, want, "exchange {n} ({label}): {}", e["request"]);
        }
    });
    if write {
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap() + "\n").unwrap();
    }
    let (code, _) = broker.finish();
    assert_eq!(code, Some(0));
}
