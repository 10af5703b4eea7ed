//! End-to-end tests of approval rules: a noninteractive broker (the real `iteron broker serve`)
//! runs exactly the calls the operator's own rules in `$ITERON_HOME/config.json` approve, and
//! refuses every other one with `not_sent` and a one-line reason naming the rule; the audit log
//! names the rule (id and digest) of each. The servers are real: the official
//! `@modelcontextprotocol/server-everything` over stdio and the TypeScript SDK's Streamable HTTP
//! peer from the interop farm (`tests/interop/peers/ts_v1_http.mjs`); the agent runs as uid
//! 65534 where the test is about another uid (the suite runs as root in CI; as anyone else those
//! tests say they are skipped and record nothing, so the security report flags them).

#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use iteron_broker::ipc::client::{ClientError, Connection};
use iteron_test_support::{self as support, is_root, node, text};
use serde_json::{Value, json};

const AGENT_UID: u32 = 65534;

fn iteron() -> &'static str {
    env!("CARGO_BIN_EXE_iteron")
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn interop(rel: &str) -> PathBuf {
    let p = workspace().join("tests/interop").join(rel);
    assert!(
        p.exists(),
        "{} is missing: run tests/interop/setup (./scripts/test does)",
        p.display()
    );
    p
}

/// A test's own directory: `base` (0755, so the agent uid can reach the socket directory the
/// broker makes in it) holding the operator's `home` (0700).
struct Site {
    base: PathBuf,
}

impl Site {
    fn new(name: &str) -> Site {
        Site {
            base: support::private_area("iteron-rules", name),
        }
    }

    fn home(&self) -> PathBuf {
        self.base.join("home")
    }

    fn socket(&self) -> PathBuf {
        self.base.join("run").join("agent.sock")
    }

    fn configure(&self, servers: Value, approvals: Value) {
        let config = json!({"schema_version": 2, "mcp_servers": servers, "approvals": approvals});
        support::write_private_json(&self.home().join("config.json"), &config);
    }

    /// The operator's `iteron` (as this test's uid, with the home).
    fn operator(&self, args: &[&str]) -> Output {
        Command::new(iteron())
            .args(args)
            .env("ITERON_HOME", self.home())
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn operator_json(&self, args: &[&str]) -> Value {
        let out = self.operator(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Start a noninteractive broker that admits uids 0 and 65534 on its agent socket.
    fn broker(&self, extra: &[&str]) -> Broker {
        let sock = self.socket();
        let mut child = Command::new(iteron())
            .args([
                "broker",
                "serve",
                "--noninteractive",
                "--socket",
                sock.to_str().unwrap(),
                "--allow-uid",
                "0",
                "--allow-uid",
                &AGENT_UID.to_string(),
            ])
            .args(extra)
            .env("ITERON_HOME", self.home())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let operator = self.home().join("run").join("operator.sock");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if std::os::unix::net::UnixStream::connect(&sock).is_ok()
                && std::os::unix::net::UnixStream::connect(&operator).is_ok()
            {
                return Broker { child };
            }
            if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
                let _ = child.kill();
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("the broker did not start: {err}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `iteron agent …` with nothing but the socket (no home), as `uid`.
    fn agent(&self, uid: u32, args: &[&str]) -> Command {
        let sock = self.socket();
        let mut c = Command::new(iteron());
        c.args(["agent", "--socket", sock.to_str().unwrap()])
            .args(args)
            .env_remove("ITERON_HOME")
            .current_dir(&self.base)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if uid != 0 {
            c.uid(uid).gid(uid);
        }
        c
    }

    fn call(&self, uid: u32, server: &str, tool: &str, args: Value) -> Output {
        self.agent(
            uid,
            &[
                "call",
                server,
                tool,
                "--json",
                &args.to_string(),
                "--format",
                "json",
            ],
        )
        .output()
        .unwrap()
    }

    fn records(&self) -> Vec<Value> {
        support::audit_records(&self.home())
    }

    /// Each rule's digest, as `approvals rules list` shows it.
    fn digests(&self) -> std::collections::BTreeMap<String, String> {
        self.operator_json(&["approvals", "rules", "list", "--format", "json"])["rules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["id"].as_str().unwrap().to_owned(),
                    r["digest"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

struct Broker {
    child: Child,
}

impl Broker {
    /// SIGTERM, wait (bounded), and return the exit code and everything it wrote on stderr.
    fn stop(mut self) -> (Option<i32>, String) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        let code = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s.code();
            }
            assert!(Instant::now() < deadline, "the broker ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
        (code, err)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn everything() -> Value {
    json!({
        "name": "ev",
        "transport": "stdio",
        "command": node().to_str().unwrap(),
        "args": [interop("node_modules/@modelcontextprotocol/server-everything/dist/index.js")
            .to_str().unwrap(), "stdio"],
        "tools": {"deny": ["trigger-sampling-request"]}
    })
}

/// A refused call: exit 9, one line on stderr, nothing sent; returns the line.
fn refused(out: &Output, code: &str) -> String {
    let line = text(&out.stderr);
    assert_eq!(out.status.code(), Some(9), "{line}");
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(line.contains(&format!("broker: {code}: ")), "{line}");
    assert!(line.trim_end().ends_with("(effect: not_sent)"), "{line}");
    assert!(line.len() <= 512 + 64, "{line}");
    line
}

/// The records of the call_tool request(s) of one session.
fn call_records<'a>(records: &'a [Value], session: &str) -> Vec<&'a Value> {
    records
        .iter()
        .filter(|r| r["kind"] == "call_tool" && r["session"] == session)
        .collect()
}

/// The session ids of call_tool records, in order, one per call.
fn sessions_of_calls(records: &[Value]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in records.iter().filter(|r| r["kind"] == "call_tool") {
        let s = r["session"].as_str().unwrap().to_owned();
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

#[test]
fn a_noninteractive_broker_runs_only_what_the_operators_rules_approve() {
    if !is_root() {
        eprintln!("skipped: running the agent as uid 65534 needs root (CI runs as root)");
        return;
    }
    let site = Site::new("stdio");
    // A hook that blocks one argument value: hooks run first, and a block wins over a rule.
    let hook = site.base.join("block.sh");
    std::fs::write(
        &hook,
        "#!/bin/sh\ncase \"$(cat)\" in *ci-blocked*) echo 'not this one' >&2; exit 2;; esac\nexit 0\n",
    )
    .unwrap();
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut ev = everything();
    ev["tools"] = json!({"deny": ["trigger-sampling-request"]});
    let config = json!({"schema_version": 2, "mcp_servers": [ev],
    "hooks": {"PreToolUse": [hook.to_str().unwrap()]},
    "approvals": {"rules": [
        {"id": "ci-echo", "effect": "allow", "server": "ev", "tool": "echo",
         "arguments": {"message": {"prefix": "ci-"}},
         "agent_uids": [AGENT_UID], "max_calls_per_run": 3},
        {"id": "ci-sum", "effect": "allow", "server": "ev", "tool": "get-sum",
         "expires": "2020-01-01T00:00:00Z"},
        {"id": "no-env", "effect": "deny", "server": "ev", "tool": "get-env"},
        {"id": "also-env", "effect": "allow", "server": "ev", "tool": "get-env"},
        {"id": "hidden", "effect": "allow", "server": "ev", "tool": "trigger-sampling-request"}
    ]}});
    support::write_private_json(&site.home().join("config.json"), &config);
    let digests = site.digests();
    let broker = site.broker(&[]);

    // The agent sees, per tool, whether its calls can be approved; a hidden tool stays hidden.
    let out = site
        .agent(AGENT_UID, &["tools", "--format", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let approval = |name: &str| -> Option<String> {
        listed["tools"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .map(|t| t["approval"].as_str().unwrap().to_owned())
    };
    assert_eq!(approval("echo").as_deref(), Some("rule"));
    assert_eq!(approval("get-env").as_deref(), Some("denied_by_rule"));
    assert_eq!(
        approval("get-sum").as_deref(),
        Some("refused_noninteractive")
    );
    assert_eq!(
        approval("get-tiny-image").as_deref(),
        Some("refused_noninteractive")
    );
    assert_eq!(approval("trigger-sampling-request"), None);
    let root_view = site.agent(0, &["tools"]).output().unwrap();
    assert!(
        text(&root_view.stdout).contains("ev/echo  [refused_noninteractive]"),
        "{}",
        text(&root_view.stdout)
    );

    // 1. A call the rule approves runs, with no operator anywhere.
    let ok = site.call(AGENT_UID, "ev", "echo", json!({"message": "ci-hello"}));
    assert!(ok.status.success(), "{}", text(&ok.stderr));
    let v: Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert!(v["text"].as_str().unwrap().contains("ci-hello"), "{v}");

    // 2. The same tool with an argument outside the constraint.
    let line = refused(
        &site.call(AGENT_UID, "ev", "echo", json!({"message": "prod-deploy"})),
        "approval_required",
    );
    assert!(
        line.contains("rule ci-echo (digest ")
            && line.contains("argument \"message\" is outside the rule's prefix"),
        "{line}"
    );
    assert!(!line.contains("prod-deploy"), "{line}");
    // … and an argument the rule does not name.
    let line = refused(
        &site.call(
            AGENT_UID,
            "ev",
            "echo",
            json!({"message": "ci-x", "extra": 1}),
        ),
        "approval_required",
    );
    assert!(
        line.contains("an argument the rule does not name is present"),
        "{line}"
    );

    // 3. Another uid.
    let line = refused(
        &site.call(0, "ev", "echo", json!({"message": "ci-root"})),
        "approval_required",
    );
    assert!(
        line.contains("the agent's uid is not one the rule allows"),
        "{line}"
    );

    // 4. A hook block wins over the rule (and takes no count).
    let line = refused(
        &site.call(AGENT_UID, "ev", "echo", json!({"message": "ci-blocked"})),
        "refused",
    );
    assert!(
        line.contains("blocked by an operator hook: not this one"),
        "{line}"
    );

    // 5. An exhausted count: two more approved, then the fourth is refused.
    for m in ["ci-2", "ci-3"] {
        let out = site.call(AGENT_UID, "ev", "echo", json!({"message": m}));
        assert!(out.status.success(), "{m}: {}", text(&out.stderr));
    }
    let line = refused(
        &site.call(AGENT_UID, "ev", "echo", json!({"message": "ci-4"})),
        "approval_required",
    );
    assert!(
        line.contains("its 3 calls per broker run are spent"),
        "{line}"
    );

    // 6. An expired rule.
    let line = refused(
        &site.call(AGENT_UID, "ev", "get-sum", json!({"a": 1, "b": 2})),
        "approval_required",
    );
    assert!(
        line.contains("rule ci-sum (digest ") && line.contains("the rule has expired"),
        "{line}"
    );

    // 7. A deny rule, which wins over the allow rule for the same tool.
    let line = refused(&site.call(AGENT_UID, "ev", "get-env", json!({})), "refused");
    assert!(
        line.contains("the operator's rule no-env refuses this call"),
        "{line}"
    );

    // A hidden tool is unknown, whatever a rule says.
    let out = site.call(AGENT_UID, "ev", "trigger-sampling-request", json!({}));
    assert_eq!(out.status.code(), Some(9));
    assert!(text(&out.stderr).contains("unknown_tool: unknown tool"));

    let (code, err) = broker.stop();
    assert_eq!(code, Some(0), "{err}");
    // The rules that can never match were said at start.
    assert!(
        err.contains("approval rule ci-sum can never match: the rule has expired")
            && err.contains("approval rule hidden can never match: the tool is hidden by policy")
            && err.contains("approval rule also-env can never match: deny rule no-env refuses"),
        "{err}"
    );

    // The audit: the rule (id and digest) of each decision; every approved effect has its
    // dispatching record before its outcome; refused calls have none; no operator decided.
    let records = site.records();
    assert!(!records.iter().any(|r| r["kind"] == "operator_decide"));
    let detail_of = |id: &str| format!("rule {id} (digest {})", digests[id]);
    let sessions = sessions_of_calls(&records);
    // The calls, in order: approved, outside, other argument, other uid, hook, approved,
    // approved, spent, expired, deny, hidden.
    assert_eq!(sessions.len(), 11, "{sessions:?}");
    let approved = [0usize, 5, 6];
    for (i, s) in sessions.iter().enumerate() {
        let calls = call_records(&records, s);
        let last = calls.last().unwrap();
        if approved.contains(&i) {
            assert_eq!(calls.len(), 2, "{calls:?}");
            assert_eq!(calls[0]["outcome"], "dispatching");
            for r in &calls {
                assert_eq!(r["decision"], "approved_by_rule", "{r}");
                assert_eq!(r["detail"], detail_of("ci-echo"), "{r}");
            }
            assert_eq!(last["outcome"], "ok");
        } else {
            assert_eq!(
                calls.len(),
                1,
                "a refused call has no dispatching record: {calls:?}"
            );
        }
    }
    let d = |i: usize| {
        call_records(&records, &sessions[i])[0]["detail"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };
    for i in [1, 2, 3, 7] {
        let r = call_records(&records, &sessions[i])[0];
        assert_eq!(r["outcome"], "approval_required", "{r}");
        assert!(
            d(i).starts_with(&format!("{} did not approve: ", detail_of("ci-echo"))),
            "{}",
            d(i)
        );
    }
    let hooked = call_records(&records, &sessions[4])[0];
    assert_eq!(hooked["decision"], "blocked_by_hook");
    assert!(d(8).starts_with(&format!(
        "{} did not approve: the rule has expired",
        detail_of("ci-sum")
    )));
    let denied = call_records(&records, &sessions[9])[0];
    assert_eq!(denied["decision"], "denied_by_rule");
    assert_eq!(denied["detail"], detail_of("no-env"));
    assert_eq!(
        call_records(&records, &sessions[10])[0]["outcome"],
        "unknown_tool"
    );

    // `iteron audit rules` counts each rule's decisions from the verified log.
    let counts = site.operator_json(&["audit", "rules", "--format", "json"]);
    let count = |id: &str, k: &str| {
        counts["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["id"] == id)
            .map(|r| r[k].as_u64().unwrap())
            .unwrap()
    };
    assert_eq!(count("ci-echo", "approved"), 3);
    assert_eq!(count("ci-echo", "approved_this_run"), 3);
    assert_eq!(count("ci-echo", "unmatched"), 4);
    assert_eq!(count("no-env", "denied"), 1);
    assert_eq!(count("ci-sum", "unmatched"), 1);
    assert_eq!(count("hidden", "approved"), 0);
    let verify = site.operator(&["audit", "verify"]);
    assert!(verify.status.success(), "{}", text(&verify.stderr));
    iteron_test_support::record!(
        "P15",
        json!({"approved": 3, "refused": ["argument", "other_argument", "uid", "hook", "count", "expired", "deny"]}),
    );
}

/// Start the interop farm's TypeScript SDK Streamable HTTP server; returns it and its URL.
fn http_peer() -> (Child, String) {
    let mut child = Command::new(node())
        .arg(interop("peers/ts_v1_http.mjs"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line
        .strip_prefix("LISTENING ")
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("the HTTP peer did not say where it listens: {line:?}"));
    (child, format!("http://127.0.0.1:{port}/mcp"))
}

async fn session(socket: &std::path::Path) -> Connection {
    let mut c = Connection::connect(socket).await.unwrap();
    c.hello("rules-test").await.unwrap();
    c
}

fn call_params(text: &str) -> Value {
    json!({"server": "web", "tool": "echo", "arguments": {"text": text}})
}

#[test]
fn rules_hold_the_same_for_an_http_server_and_count_per_session() {
    if !is_root() {
        eprintln!("skipped: running the agent as uid 65534 needs root (CI runs as root)");
        return;
    }
    let (mut peer, url) = http_peer();
    let site = Site::new("http");
    site.configure(
        json!([{"name": "web", "transport": "http", "url": url}]),
        json!({"rules": [
            {"id": "web-echo", "effect": "allow", "server": "web", "tool": "echo",
             "arguments": {"text": {"one_of": ["ci-a", "ci-b"]}},
             "agent_uids": [0, AGENT_UID], "max_calls_per_session": 1},
            {"id": "until-soon", "effect": "allow", "server": "web", "tool": "echo",
             "arguments": {"text": {"equals": "late"}}, "expires": "2021-06-30T12:00:00Z"}
        ]}),
    );
    let digests = site.digests();
    let broker = site.broker(&[]);
    // As the agent uid, through the CLI: approved, then refused outside the constraint.
    let ok = site.call(AGENT_UID, "web", "echo", json!({"text": "ci-a"}));
    assert!(ok.status.success(), "{}", text(&ok.stderr));
    assert_eq!(
        serde_json::from_slice::<Value>(&ok.stdout).unwrap()["text"],
        "ci-a"
    );
    let line = refused(
        &site.call(AGENT_UID, "web", "echo", json!({"text": "ci-c"})),
        "approval_required",
    );
    assert!(
        line.contains("argument \"text\" is outside the rule's one_of"),
        "{line}"
    );
    let line = refused(
        &site.call(AGENT_UID, "web", "echo", json!({"text": "late"})),
        "approval_required",
    );
    assert!(line.contains("rule web-echo (digest "), "{line}");

    // One session: its one call is approved, its second refused; a new session has its own.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut s1 = session(&site.socket()).await;
        let v = s1.request("call_tool", call_params("ci-b")).await.unwrap();
        assert_eq!(v["text"], "ci-b");
        match s1.request("call_tool", call_params("ci-b")).await {
            Err(ClientError::Refused {
                code,
                message,
                certainty,
            }) => {
                assert_eq!(code, "approval_required");
                assert_eq!(certainty.as_deref(), Some("not_sent"));
                assert!(
                    message.contains("its 1 calls per session are spent"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        let mut s2 = session(&site.socket()).await;
        let v = s2.request("call_tool", call_params("ci-a")).await.unwrap();
        assert_eq!(v["text"], "ci-a");
        // The agent cannot hand the broker a rule: the request has no such field.
        let mut params = call_params("ci-a");
        params["approval_rule"] = json!({"id": "mine", "effect": "allow"});
        match s2.request("call_tool", params).await {
            Err(ClientError::Refused { code, .. }) => assert_eq!(code, "protocol"),
            other => panic!("{other:?}"),
        }
    });
    let (code, err) = broker.stop();
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("approval rule until-soon can never match: the rule has expired"),
        "{err}"
    );
    let records = site.records();
    let approved: Vec<&Value> = records
        .iter()
        .filter(|r| r["kind"] == "call_tool" && r["outcome"] == "dispatching")
        .collect();
    assert_eq!(approved.len(), 3);
    for r in &approved {
        assert_eq!(r["decision"], "approved_by_rule");
        assert_eq!(r["server"], "web");
        assert_eq!(
            r["detail"],
            format!("rule web-echo (digest {})", digests["web-echo"])
        );
    }
    let spent = records
        .iter()
        .filter(|r| {
            r["kind"] == "call_tool"
                && r["outcome"] == "approval_required"
                && r["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("did not approve: its 1 calls per session are spent; 1 more rule did not either"))
        })
        .count();
    assert_eq!(spent, 1);
    let _ = peer.kill();
    let _ = peer.wait();
    iteron_test_support::record!("P15", json!({"approved": 3, "per_session": 1}),);
}

#[test]
fn a_rule_placed_in_the_repository_is_never_read() {
    if !is_root() {
        eprintln!("skipped: running the agent as uid 65534 needs root (CI runs as root)");
        return;
    }
    let site = Site::new("repo");
    site.configure(json!([everything()]), json!({}));
    // The repository carries an operator-looking configuration with a rule that would approve
    // the call: the broker reads rules from its home only.
    let repo = site.base.join("repo");
    std::fs::create_dir_all(repo.join(".iteron")).unwrap();
    let planted = json!({"schema_version": 2, "mcp_servers": [everything()],
        "approvals": {"rules": [{"id": "planted", "effect": "allow", "server": "ev", "tool": "echo"}]}});
    std::fs::write(
        repo.join(".iteron/config.json"),
        serde_json::to_vec(&planted).unwrap(),
    )
    .unwrap();
    std::fs::set_permissions(&repo, std::fs::Permissions::from_mode(0o755)).unwrap();
    let broker = site.broker(&["--repo", repo.to_str().unwrap()]);
    let mut c = site.agent(
        AGENT_UID,
        &["call", "ev", "echo", "--json", r#"{"message":"hi"}"#],
    );
    c.current_dir(&repo);
    let line = refused(&c.output().unwrap(), "approval_required");
    assert!(line.contains("no approval rule approves it"), "{line}");
    assert!(
        !line.contains("planted") && !line.contains("(rule "),
        "{line}"
    );
    let listed = site
        .agent(AGENT_UID, &["tools", "--format", "json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&listed.stdout).unwrap();
    let echo = v["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "echo")
        .unwrap();
    assert_eq!(echo["approval"], "refused_noninteractive");
    let (code, err) = broker.stop();
    assert_eq!(code, Some(0), "{err}");
    let records = site.records();
    let call = records.iter().find(|r| r["kind"] == "call_tool").unwrap();
    assert_eq!(call["outcome"], "approval_required");
    assert_eq!(call["detail"], Value::Null);
    assert!(!records.iter().any(|r| r["outcome"] == "dispatching"));
    // Nor does the operator's tooling read it, run from inside the repository.
    let out = Command::new(iteron())
        .args(["approvals", "rules", "list", "--format", "json"])
        .env("ITERON_HOME", site.home())
        .current_dir(&repo)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["rules"], json!([]));
    iteron_test_support::record!("P15", json!({}),);
}

/// Wait until the operator socket lists `n` waiting items; returns them.
fn wait_pending(site: &Site, n: usize) -> Vec<Value> {
    support::wait_pending(n, Duration::from_secs(20), || {
        let v = site.operator_json(&["approvals", "list", "--format", "json"]);
        v["pending"].as_array().unwrap().clone()
    })
}

#[test]
fn deferred_approval_parks_a_call_until_it_is_approved_by_id_and_digest() {
    if !is_root() {
        eprintln!("skipped: running the agent as uid 65534 needs root (CI runs as root)");
        return;
    }
    let site = Site::new("deferred");
    site.configure(json!([everything()]), json!({"deferred_secs": 4}));
    let broker = site.broker(&[]);
    let listed = site
        .agent(AGENT_UID, &["tools", "--format", "json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert!(
        v["tools"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["approval"] == "deferred"),
        "{v}"
    );
    let args = json!({"message": "parked"});
    let waiting = site
        .agent(
            AGENT_UID,
            &[
                "call",
                "ev",
                "echo",
                "--json",
                &args.to_string(),
                "--format",
                "json",
            ],
        )
        .spawn()
        .unwrap();
    let items = wait_pending(&site, 1);
    assert_eq!(items[0]["deferred"], true);
    assert_eq!(items[0]["peer_uid"], AGENT_UID);
    let id = items[0]["id"].as_u64().unwrap().to_string();
    let digest = items[0]["args_sha256"].as_str().unwrap().to_owned();
    let canonical = iteron_broker::audit::canonical_json(&args);
    assert_eq!(digest, iteron_broker::audit::sha256_hex(&canonical));
    // By id alone: refused, the call stays parked.
    let out = site.operator(&["approvals", "approve", &id]);
    assert_eq!(out.status.code(), Some(9), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("approve it with its args_sha256"));
    // With another digest: refused, the call stays parked.
    let wrong = "0".repeat(64);
    let out = site.operator(&["approvals", "approve", &id, "--sha256", &wrong]);
    assert_eq!(out.status.code(), Some(9), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("not that of the waiting call"));
    assert_eq!(
        wait_pending(&site, 1)[0]["id"]
            .as_u64()
            .unwrap()
            .to_string(),
        id
    );
    let out = site.operator(&["approvals", "approve", &id, "--sha256", &digest]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let done = waiting.wait_with_output().unwrap();
    assert!(done.status.success(), "{}", text(&done.stderr));
    assert!(text(&done.stdout).contains("parked"));

    // Parked for a bounded time: nobody approves, it is refused when the time is up.
    let started = Instant::now();
    let out = site.call(AGENT_UID, "ev", "echo", json!({"message": "forgotten"}));
    let line = refused(&out, "refused");
    assert!(
        line.contains("no operator approved this call in time"),
        "{line}"
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(15),
        "{waited:?}"
    );
    let (code, err) = broker.stop();
    assert_eq!(code, Some(0), "{err}");
    let records = site.records();
    let decides: Vec<&str> = records
        .iter()
        .filter(|r| r["kind"] == "operator_decide")
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(decides, ["digest_required", "digest_mismatch", "ok"]);
    assert!(records.iter().any(|r| r["kind"] == "call_tool"
        && r["decision"] == "approved"
        && r["outcome"] == "dispatching"
        && r["args_sha256"] == digest.as_str()));
    assert!(
        records
            .iter()
            .any(|r| r["kind"] == "call_tool" && r["outcome"] == "approval_timed_out")
    );
    iteron_test_support::record!("P15", json!({"deferred_secs": 4}),);
}

#[test]
fn doctor_and_rules_check_report_every_rule_that_can_never_match() {
    let site = Site::new("check");
    site.configure(
        json!([everything()]),
        json!({"rules": [
            {"id": "good", "effect": "allow", "server": "ev", "tool": "echo",
             "arguments": {"message": {"any": true}}},
            {"id": "typo-arg", "effect": "allow", "server": "ev", "tool": "echo",
             "arguments": {"mesage": {"any": true}}},
            {"id": "typo-tool", "effect": "allow", "server": "ev", "tool": "ecko"},
            {"id": "no-server", "effect": "allow", "server": "gone", "tool": "echo"},
            {"id": "filtered", "effect": "allow", "server": "ev", "tool": "trigger-sampling-request"},
            {"id": "expired", "effect": "allow", "server": "ev", "tool": "echo",
             "expires": "2001-02-03T04:05:06Z"}
        ]}),
    );
    let codes = |v: &Value| -> Vec<(String, Vec<String>)> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["id"].as_str().unwrap().to_owned(),
                    r["findings"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|f| f["code"].as_str().unwrap().to_owned())
                        .collect(),
                )
            })
            .collect()
    };
    let want_static = vec![
        ("good".to_owned(), vec![]),
        ("typo-arg".to_owned(), vec![]),
        ("typo-tool".to_owned(), vec![]),
        ("no-server".to_owned(), vec!["unknown_server".to_owned()]),
        ("filtered".to_owned(), vec!["hidden_by_policy".to_owned()]),
        ("expired".to_owned(), vec!["expired".to_owned()]),
    ];
    // Without connecting: what the configuration alone shows.
    let out = site.operator(&["approvals", "rules", "check", "--format", "json"]);
    assert_eq!(out.status.code(), Some(8), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(codes(&v["rules"]), want_static);
    // Connected: the catalog finds the typos too.
    let mut want = want_static.clone();
    want[1].1 = vec!["no_such_argument".to_owned()];
    want[2].1 = vec!["not_listed".to_owned()];
    let out = site.operator(&[
        "approvals",
        "rules",
        "check",
        "--connect",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(8), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(codes(&v["rules"]), want);
    let out = site.operator(&["mcp", "doctor", "--connect", "--format", "json"]);
    assert_eq!(out.status.code(), Some(8), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(codes(&v["approval_rules"]), want);
    // The text forms name each rule and why, one line each.
    let out = site.operator(&["approvals", "rules", "check", "--connect"]);
    let shown = text(&out.stdout);
    assert!(shown.contains("ok   good (allow ev/echo)"), "{shown}");
    assert!(
        shown.contains("FAIL typo-arg (allow ev/echo): can never match: the tool's input schema has no argument \"mesage\""),
        "{shown}"
    );
    assert!(
        shown.contains(
            "FAIL typo-tool (allow ev/ecko): can never match: the server does not list this tool"
        ),
        "{shown}"
    );
    let out = site.operator(&["mcp", "doctor"]);
    assert!(
        text(&out.stdout).contains("FAIL no-server (allow gone/echo): can never match: no server of that name is configured"),
        "{}",
        text(&out.stdout)
    );
    // With only good rules, both are clean.
    site.configure(
        json!([everything()]),
        json!({"rules": [{"id": "good", "effect": "allow", "server": "ev", "tool": "echo",
                          "arguments": {"message": {"prefix": "ci-"}}}]}),
    );
    let out = site.operator(&["approvals", "rules", "check", "--connect"]);
    assert!(out.status.success(), "{}", text(&out.stdout));

    // `explain` says which rule would decide, and why, without making the call.
    let explain = |args: &str, uid: &str| {
        site.operator_json(&[
            "approvals",
            "rules",
            "explain",
            "ev",
            "echo",
            "--json",
            args,
            "--uid",
            uid,
            "--format",
            "json",
        ])
    };
    let v = explain(r#"{"message":"ci-1"}"#, "65534");
    assert_eq!(v["decision"], "approved_by_rule");
    assert_eq!(v["rule"]["id"], "good");
    let v = explain(r#"{"message":"nope"}"#, "65534");
    assert_eq!(v["decision"], "no_rule");
    assert_eq!(
        v["rules"][0]["why"],
        "argument \"message\" is outside the rule's prefix"
    );
    // Nothing was called: explain starts no server and writes no audit record.
    assert!(!site.home().join("audit").exists());
    iteron_test_support::record!(
        "P15",
        json!({"findings": ["unknown_server", "hidden_by_policy", "expired", "not_listed", "no_such_argument"]}),
    );
}

#[test]
fn the_ci_example_in_the_docs_runs_as_written() {
    if !is_root() {
        eprintln!("skipped: the example runs the agent as uid 65534, which needs root");
        return;
    }
    let doc = std::fs::read_to_string(workspace().join("docs/broker.md")).unwrap();
    let start = doc
        .find("```sh\n#!/bin/sh\n# CI job")
        .expect("the CI example in docs/broker.md")
        + "```sh\n".len();
    let script = &doc[start..start + doc[start..].find("\n```").unwrap()];
    let site = Site::new("ci-doc");
    let runner = site.base.join("runner");
    std::fs::DirBuilder::new()
        .mode(0o755)
        .create(&runner)
        .unwrap();
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(script)
        .env("RUNNER_TEMP", &runner)
        .env("ITERON", iteron())
        .env(
            "EVERYTHING",
            interop("node_modules/@modelcontextprotocol/server-everything/dist/index.js"),
        )
        .env_remove("ITERON_HOME")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let shown = text(&out.stdout);
    assert!(out.status.success(), "{shown}\n{}", text(&out.stderr));
    for line in [
        "ev/echo  [rule]",
        "ev/get-env  [denied_by_rule]",
        "Echo: build-42",
        "The sum of 2 and 40 is 42.",
        "expected: 1 records match",
        "approved 1 (1 in the newest run), denied 0, not matched 0",
        "approved 0 (0 in the newest run), denied 1, not matched 0",
    ] {
        assert!(shown.contains(line), "{line:?} not in:\n{shown}");
    }
    assert!(text(&out.stderr).contains("the operator's rule no-env refuses this call"));
    iteron_test_support::record!("P15", json!({}),);
}

/// The agent program (`iteron-agent`, built from `broker/agent` on the IPC crate alone, with no
/// credential, configuration, network or process code) does what `iteron agent` does, as
/// another uid against the official everything server: the same tool list byte for byte, a
/// rule-approved call that runs, a refusal with the same reason, exit code and certainty, and
/// an audit log that names the rule and the agent's uid.
#[test]
fn the_agent_program_alone_does_what_iteron_agent_does_as_another_uid() {
    if !is_root() {
        eprintln!("skipped: running the agent as uid 65534 needs root (CI runs as root)");
        return;
    }
    let program = std::path::Path::new(iteron()).with_file_name("iteron-agent");
    assert!(
        program.exists(),
        "{} is not built: cargo build -p iteron-agent (./scripts/test does)",
        program.display()
    );
    let site = Site::new("agent-program");
    site.configure(
        json!([everything()]),
        json!({"rules": [{"id": "ci-echo", "effect": "allow", "server": "ev", "tool": "echo",
                          "arguments": {"message": {"prefix": "ci-"}},
                          "agent_uids": [AGENT_UID]}]}),
    );
    let broker = site.broker(&[]);
    let sock = site.socket();
    let alone = |args: &[&str]| -> Output {
        Command::new(&program)
            .args(["--socket", sock.to_str().unwrap()])
            .args(args)
            .env_clear()
            .current_dir(&site.base)
            .stdin(Stdio::null())
            .uid(AGENT_UID)
            .gid(AGENT_UID)
            .output()
            .unwrap()
    };
    let both = |args: &[&str]| -> (Output, Output) {
        (alone(args), site.agent(AGENT_UID, args).output().unwrap())
    };

    let (mine, theirs) = both(&["tools", "--format", "json"]);
    assert!(mine.status.success(), "{}", text(&mine.stderr));
    assert_eq!(text(&mine.stdout), text(&theirs.stdout));
    let listed: Value = serde_json::from_slice(&mine.stdout).unwrap();
    let echo = listed["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "echo")
        .unwrap();
    assert_eq!(echo["approval"], "rule", "{echo}");

    let call = |message: &str| {
        let json = json!({"message": message}).to_string();
        alone(&["call", "ev", "echo", "--json", &json, "--format", "json"])
    };
    let ok = call("ci-from-the-agent-program");
    assert!(ok.status.success(), "{}", text(&ok.stderr));
    let v: Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert!(
        v["text"]
            .as_str()
            .unwrap()
            .contains("ci-from-the-agent-program"),
        "{v}"
    );

    let no = call("prod");
    let line = refused(&no, "approval_required");
    assert!(
        line.starts_with("iteron-agent: error: broker: approval_required: "),
        "{line}"
    );
    let same = site.call(AGENT_UID, "ev", "echo", json!({"message": "prod"}));
    assert_eq!(
        line.trim_start_matches("iteron-agent"),
        text(&same.stderr).trim_start_matches("iteron"),
        "the two programs say the same"
    );

    // A command-line mistake is one line that does not quote what was typed.
    let bad = alone(&["call", "ev", "echo", "--format", "sekrit-value"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        !text(&bad.stderr).contains("sekrit"),
        "{}",
        text(&bad.stderr)
    );

    let (code, err) = broker.stop();
    assert_eq!(code, Some(0), "{err}");
    let records = site.records();
    let approved: Vec<&Value> = records
        .iter()
        .filter(|r| r["kind"] == "call_tool" && r["decision"] == "approved_by_rule")
        .collect();
    assert_eq!(approved.len(), 2, "dispatching and outcome: {approved:?}");
    for r in &approved {
        assert_eq!(r["peer_uid"], AGENT_UID, "{r}");
        assert!(
            r["detail"]
                .as_str()
                .unwrap()
                .starts_with("rule ci-echo (digest "),
            "{r}"
        );
    }
    let verify = site.operator(&["audit", "verify"]);
    assert!(verify.status.success(), "{}", text(&verify.stderr));
    iteron_test_support::record!(
        "P17",
        json!({"program": "iteron-agent", "uid": AGENT_UID, "approved": 1, "refused": 1}),
    );
}
