//! `iteron mcp test|status|doctor` end to end: the built binary, a temporary ITERON_HOME, the
//! stdio fixtures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Output};

use iteron_test_support as support;

const CANARY: &str = "CANARYprobe9c1e";

struct Home(PathBuf);

impl Home {
    fn new(tag: &str) -> Home {
        let p = std::env::temp_dir().join(format!("iteron-probe-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        Home(p)
    }

    fn run(&self, args: &[&str]) -> Output {
        self.run_env(args, &[])
    }

    /// [`Home::run`] with more variables.
    fn run_env(&self, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Output {
        let out = Command::new(env!("CARGO_BIN_EXE_iteron"))
            .args(args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("ITERON_HOME", self.0.join("home"))
            .env("PROBE_SECRET", CANARY)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        for s in [&out.stdout, &out.stderr] {
            assert!(
                !String::from_utf8_lossy(s).contains("CANARY"),
                "{args:?} leaked"
            );
        }
        out
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/stdio")
        .join(name)
        .canonicalize()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn test_negotiates_and_lists_tools_in_json() {
    let h = Home::new("json");
    let echo = fixture("echo_server.py");
    assert!(
        h.run(&[
            "mcp",
            "add",
            "echo",
            "--stdio",
            "/usr/bin/python3",
            "--env",
            "PROBE_SECRET",
            "--",
            &echo
        ])
        .status
        .success()
    );
    let out = h.run(&["mcp", "test", "echo", "--format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["name"], "echo");
    assert_eq!(v["transport"], "stdio");
    assert_eq!(v["protocol_version"], "2025-11-25");
    assert_eq!(v["tool_count"], 1);
    assert_eq!(v["tools"], serde_json::json!(["echo"]));
    let text = String::from_utf8(h.run(&["mcp", "test", "echo"]).stdout).unwrap();
    assert!(
        text.starts_with("echo: connected (stdio), protocol 2025-11-25, 1 tools"),
        "{text}"
    );
}

#[test]
fn a_failing_server_exits_8_with_one_line() {
    let h = Home::new("fail");
    assert!(
        h.run(&["mcp", "add", "bad", "--stdio", "/bin/false"])
            .status
            .success()
    );
    let out = h.run(&["mcp", "test", "bad"]);
    assert_eq!(out.status.code(), Some(8));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("iteron: error: "), "{err}");
    let out = h.run(&[
        "mcp",
        "add",
        "old",
        "--stdio",
        "/usr/bin/python3",
        "--",
        &fixture("scripted_server.py"),
        "old-version",
    ]);
    assert!(out.status.success());
    let out = h.run(&["mcp", "test", "old"]);
    assert_eq!(out.status.code(), Some(8));
    assert!(String::from_utf8_lossy(&out.stderr).contains("2025-03-26"));
    assert_eq!(h.run(&["mcp", "test", "nope"]).status.code(), Some(4));
}

#[test]
fn status_without_connect_starts_nothing_and_doctor_shows_names_not_values() {
    let h = Home::new("status");
    // The server is confined: it writes only where the operator grants (a directory beside
    // the home, not containing it).
    let out_dir = h.0.join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    support::give_to_children(&out_dir);
    let marker = out_dir.join("started");
    let script = format!("touch {}", marker.display());
    assert!(
        h.run(&[
            "mcp",
            "add",
            "marker",
            "--stdio",
            "/bin/sh",
            "--env",
            "PROBE_SECRET",
            "--env",
            "NOT_SET_ANYWHERE",
            "--sandbox-writable",
            out_dir.to_str().unwrap(),
            "--",
            "-c",
            &script
        ])
        .status
        .success()
    );
    let out = h.run(&["mcp", "status", "--format", "json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["servers"][0]["state"], "not_probed");
    let out = h.run(&["mcp", "doctor", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        !marker.exists(),
        "status and doctor without --connect start nothing"
    );
    let checks = v["servers"][0]["checks"].as_array().unwrap();
    let by = |name: &str| checks.iter().find(|c| c["check"] == name).unwrap().clone();
    assert_eq!(by("command")["ok"], true);
    assert_eq!(by("env PROBE_SECRET")["ok"], true);
    assert_eq!(by("env NOT_SET_ANYWHERE")["ok"], false);
    assert_eq!(out.status.code(), Some(8), "a failed check fails doctor");
    // --connect does start it (and the marker proves the difference is real).
    let _ = h.run(&["mcp", "status", "marker", "--connect"]);
    assert!(marker.exists());
}

/// A server that fails because of its confinement is reported with the denied operation (its
/// own last stderr lines) and a hint, and what it tried to read stays unread.
#[test]
fn a_server_denied_by_its_confinement_is_reported_with_the_denied_operation() {
    let h = Home::new("denied");
    let config = h.0.join("home").join("config.json");
    let script = format!("cat {} ; exit 3", config.display());
    assert!(
        h.run(&[
            "mcp", "add", "nosy", "--stdio", "/bin/sh", "--", "-c", &script
        ])
        .status
        .success()
    );
    let out = h.run(&["mcp", "test", "nosy"]);
    assert_eq!(out.status.code(), Some(8));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("Permission denied"), "{err}");
    assert!(err.contains("config.json"), "{err}");
    assert!(err.contains("the server runs confined"), "{err}");
    // The configuration's text never reached the output.
    assert!(!err.contains("schema_version"), "{err}");
    // get shows the effective confinement: the home denied, no network for a server without
    // web_egress.
    let out = h.run(&["mcp", "get", "nosy"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("confinement"))
        .unwrap_or_default();
    assert!(
        line.contains("network denied") && line.contains("no_new_privs"),
        "{text}"
    );
    let out = h.run(&["mcp", "get", "nosy", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["confinement"]["network"]
            .as_str()
            .unwrap()
            .starts_with("denied"),
        "{v}"
    );
    // Who it runs as: uid 65534 under a root broker, the operator's own uid otherwise.
    let uid = nix::unistd::geteuid().as_raw();
    let runs_as = if uid == 0 {
        "uid 65534, gid 65534, no supplementary groups".to_owned()
    } else {
        format!("uid {uid}, gid {}", nix::unistd::getegid().as_raw())
    };
    assert!(
        text.lines()
            .any(|l| l.starts_with("runs as") && l.contains(&runs_as)),
        "{text}"
    );
    assert!(
        v["confinement"]["runs_as"]
            .as_str()
            .unwrap()
            .starts_with(&runs_as),
        "{v}"
    );
    let home = std::fs::canonicalize(h.0.join("home")).unwrap();
    let denied: Vec<&str> = v["confinement"]["denied"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d.as_str())
        .collect();
    assert!(denied.contains(&home.to_str().unwrap()), "{v}");
    // doctor names the confinement it would apply.
    let out = h.run(&["mcp", "doctor"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("confinement: filesystem confined (landlock ABI")
            || text.contains("confinement: filesystem NOT confined"),
        "{text}"
    );
}

/// `iteron mcp test` of a server that leaves a `setsid` grandchild behind (a double fork: its
/// parent exits at once, and it is in a session of its own): when the command returns, the
/// grandchild is gone.
#[test]
fn mcp_test_leaves_no_setsid_grandchild_behind() {
    let h = Home::new("grandchild");
    let out_dir = h.0.join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    support::give_to_children(&out_dir);
    let pid_file = out_dir.join("grandchild.pid");
    // The grandchild writes its own pid (so it surely ran) and sleeps; the server itself is
    // the echo fixture.
    let script = format!(
        "(setsid sh -c 'echo $$ > {pid}.tmp; mv {pid}.tmp {pid}; exec sleep 300' </dev/null >/dev/null 2>&1 &); \
         while [ ! -s {pid} ]; do sleep 0.05; done; \
         exec /usr/bin/python3 {server}",
        pid = pid_file.display(),
        server = fixture("echo_server.py"),
    );
    assert!(
        h.run(&[
            "mcp",
            "add",
            "daemonizing",
            "--stdio",
            "/bin/sh",
            "--sandbox-writable",
            out_dir.to_str().unwrap(),
            "--sandbox-readable",
            std::path::Path::new(&fixture("echo_server.py"))
                .parent()
                .unwrap()
                .to_str()
                .unwrap(),
            "--",
            "-c",
            &script
        ])
        .status
        .success()
    );
    let out = h.run(&["mcp", "test", "daemonizing", "--format", "json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pid: i32 = fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        !support::process_exists(pid),
        "the grandchild {pid} outlived iteron mcp test"
    );
    iteron_test_support::record!("P9", serde_json::json!({"grandchild_gone": true}),);
}

/// Under a root broker a server runs as uid 65534: a command that uid cannot reach fails
/// `doctor` with the path and the remedy, and `--sandbox-run-as root` is the explicit way out.
#[test]
fn doctor_fails_a_command_out_of_the_childs_uid_reach() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: only a root broker changes its children's uid");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let h = Home::new("reach");
    let private = h.0.join("private");
    fs::create_dir_all(&private).unwrap();
    fs::set_permissions(&private, fs::Permissions::from_mode(0o700)).unwrap();
    let server = private.join("server");
    fs::write(&server, "#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&server, fs::Permissions::from_mode(0o755)).unwrap();
    let cmd = server.to_str().unwrap();
    assert!(
        h.run(&["mcp", "add", "hidden", "--stdio", cmd])
            .status
            .success()
    );
    assert!(
        h.run(&[
            "mcp",
            "add",
            "asroot",
            "--stdio",
            cmd,
            "--sandbox-run-as",
            "root"
        ])
        .status
        .success()
    );
    let out = h.run(&["mcp", "doctor", "--format", "json"]);
    assert_eq!(out.status.code(), Some(8));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = |i: usize| {
        v["servers"][i]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "confinement")
            .unwrap()
            .clone()
    };
    let hidden = check(0);
    assert_eq!(hidden["ok"], false, "{hidden}");
    let detail = hidden["detail"].as_str().unwrap();
    assert!(detail.contains("runs as uid 65534"), "{detail}");
    assert!(
        detail.contains(cmd) && detail.contains("sandbox.run_as"),
        "{detail}"
    );
    let asroot = check(1);
    assert_eq!(asroot["ok"], true, "{asroot}");
    assert!(
        asroot["detail"].as_str().unwrap().contains("runs as uid 0"),
        "{asroot}"
    );
}

/// `mcp get` and `doctor` say where a `web_egress` server's network leads: through the
/// broker's egress path in a namespace of its own by default (with what `sandbox.egress`
/// names), UNCONFINED with `--sandbox-network host`; `mcp add` refuses a bad egress entry.
#[test]
fn get_and_doctor_show_a_web_egress_servers_egress_path_or_that_it_is_unconfined() {
    let h = Home::new("egress-shown");
    let add = |name: &str, extra: &[&str]| {
        let mut args = vec!["mcp", "add", name, "--stdio", "/bin/cat"];
        args.extend_from_slice(extra);
        let out = h.run(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    add(
        "fenced",
        &[
            "--sandbox-egress",
            "10.0.0.0/8",
            "--sandbox-egress",
            "*.corp.example",
        ],
    );
    add("open", &["--sandbox-network", "host"]);
    let bad = h.run(&[
        "mcp",
        "add",
        "bad",
        "--stdio",
        "/bin/cat",
        "--sandbox-egress",
        "*.com",
    ]);
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("--sandbox-egress") && err.lines().count() == 1,
        "{err}"
    );
    // The default ceiling has no web_egress: no sockets at all.
    let out = h.run(&["mcp", "get", "fenced", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["confinement"]["network"]
            .as_str()
            .unwrap()
            .starts_with("denied"),
        "{v}"
    );
    assert_eq!(
        v["sandbox"]["egress"],
        serde_json::json!(["10.0.0.0/8", "*.corp.example"])
    );
    // Admit web_egress on this host.
    let path = h.0.join("home").join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["host_ceiling"] = serde_json::json!(["read_only", "web_egress"]);
    std::fs::write(&path, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    let namespaces = iteron_broker::sys::netns_support().is_ok();
    let out = h.run(&["mcp", "get", "fenced"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("confinement")).unwrap();
    if namespaces {
        assert!(
            line.contains("network only through the broker's egress path")
                && line.contains("2 destination(s) sandbox.egress names"),
            "{line}"
        );
    } else {
        assert!(line.contains("CANNOT START"), "{line}");
    }
    let out = h.run(&["mcp", "get", "fenced", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["confinement"]["network_namespace"], namespaces, "{v}");
    assert_eq!(
        v["confinement"]["egress"],
        serde_json::json!(["10.0.0.0/8", "*.corp.example"])
    );
    let out = h.run(&["mcp", "get", "open"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("network UNCONFINED (sandbox.network \"host\""),
        "{text}"
    );
    let out = h.run(&["mcp", "doctor", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = |name: &str| {
        v["servers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name)
            .unwrap()["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "confinement")
            .unwrap()
            .clone()
    };
    assert!(
        check("open")["detail"]
            .as_str()
            .unwrap()
            .contains("UNCONFINED"),
        "{v}"
    );
    assert!(
        check("fenced")["detail"]
            .as_str()
            .unwrap()
            .contains(if namespaces {
                "egress path"
            } else {
                "CANNOT START"
            }),
        "{v}"
    );
    if !namespaces {
        assert_eq!(check("fenced")["ok"], false, "{v}");
    }
    iteron_test_support::record!("P9", serde_json::json!({"namespaces": namespaces}),);
}

/// A broker that is not root (here `iteron mcp test` as uid 65534) gives a `web_egress`
/// server a user namespace that owns its network namespace (its uid mapped to itself) and the
/// same egress path: a private destination through the proxy is refused.
#[test]
fn an_unprivileged_brokers_web_egress_server_gets_a_user_and_network_namespace() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: switching the test to uid 65534 needs root");
        return;
    }
    let h = Home::new("unprivileged-egress");
    fs::set_permissions(&h.0, fs::Permissions::from_mode(0o755)).unwrap();
    let (home, out_dir) = (h.0.join("home"), h.0.join("out"));
    for d in [&home, &out_dir] {
        fs::create_dir_all(d).unwrap();
        support::give_to_children(d);
    }
    fs::set_permissions(&home, fs::Permissions::from_mode(0o700)).unwrap();
    let probe = h.0.join("probe.py");
    fs::write(
        &probe,
        format!(
            "import os, socket\n\
             s = socket.create_connection(('127.0.0.1', 3128), timeout=5)\n\
             s.sendall(b'CONNECT 10.1.2.3:80 HTTP/1.1\\r\\n\\r\\n')\n\
             status = s.recv(200).split(b'\\r\\n')[0].decode()\n\
             uid_map = ' '.join(open('/proc/self/uid_map').read().split())\n\
             open('{}', 'w').write(f'{{status}}|{{os.getuid()}}|{{uid_map}}')\n",
            out_dir.join("r.txt").display()
        ),
    )
    .unwrap();
    let echo = fixture("echo_server.py");
    let script = format!(
        "/usr/bin/python3 {} && exec /usr/bin/python3 {echo}",
        probe.display()
    );
    let config = serde_json::json!({
        "schema_version": 2,
        "host_ceiling": ["read_only", "web_egress"],
        "mcp_servers": [{"name": "f", "command": "/bin/sh", "args": ["-c", script],
            "sandbox": {"readable": [h.0.to_str().unwrap(),
                                     std::path::Path::new(&echo).parent().unwrap().to_str().unwrap()],
                        "writable": [out_dir.to_str().unwrap()]}}]
    });
    let path = home.join("config.json");
    fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    support::give_to_children(&path);
    let out = Command::new(env!("CARGO_BIN_EXE_iteron"))
        .args(["mcp", "test", "f"])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("ITERON_HOME", &home)
        .uid(support::CHILD_UID)
        .gid(support::CHILD_UID)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let got = fs::read_to_string(out_dir.join("r.txt")).unwrap();
    assert_eq!(got, "HTTP/1.1 403 Forbidden|65534|65534 65534 1", "{got}");
    iteron_test_support::record!("P9", serde_json::json!({}),);
}

/// Issue 14.19: a `--repo` that names no directory is a usage error (it used to offer nothing,
/// silently), and a broker socket nothing answers on is named, with the remedy.
#[test]
fn a_missing_repo_is_an_error_and_socket_errors_name_the_path_and_the_remedy() {
    let h = Home::new("repo");
    let missing = h.0.join("no-such-repo");
    let file = h.0.join("a-file");
    fs::write(&file, "not a directory").unwrap();
    for args in [
        vec!["skills", "--repo", missing.to_str().unwrap()],
        vec!["agents", "--repo", file.to_str().unwrap()],
        vec!["broker", "serve", "--repo", missing.to_str().unwrap()],
    ] {
        let out = h.run(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("--repo names no directory"), "{args:?}: {err}");
    }
    assert!(!h.0.join("home").join("run").exists(), "no broker started");
    // The repository that exists is still fine.
    assert!(
        h.run(&["skills", "--repo", h.0.to_str().unwrap()])
            .status
            .success()
    );
    let operator = h.0.join("home").join("run").join("operator.sock");
    let agent = h.0.join("agent.sock");
    for (args, socket) in [
        (vec!["broker", "status"], operator.clone()),
        (vec!["approvals", "list"], operator.clone()),
        (
            vec![
                "approvals",
                "list",
                "--operator-socket",
                agent.to_str().unwrap(),
            ],
            agent.clone(),
        ),
        (
            vec!["agent", "--socket", agent.to_str().unwrap(), "tools"],
            agent.clone(),
        ),
    ] {
        let out = h.run(&args);
        assert_eq!(out.status.code(), Some(11), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!("no broker answers on {}", socket.display())),
            "{args:?}: {err}"
        );
        assert!(err.contains("start it with iteron broker serve"), "{err}");
    }
}

/// Issue 14.17: `audit verify` on a home where no broker has run says there is no log yet and
/// exits 0 (text and JSON); a failure under `--format json` is a JSON object too (with the one
/// line on stderr and exit 10).
#[test]
fn audit_verify_says_when_there_is_no_log_yet_and_fails_in_json() {
    use std::os::unix::fs::PermissionsExt;
    let h = Home::new("audit");
    for prepared in [false, true] {
        if prepared {
            // A home with its configuration, still without a log.
            assert!(
                h.run(&["mcp", "add", "x", "--stdio", "/bin/true"])
                    .status
                    .success()
            );
        }
        let out = h.run(&["audit", "verify"]);
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.starts_with("no audit log yet:"), "{text}");
        assert_eq!(text.lines().count(), 1, "{text}");
        let out = h.run(&["audit", "verify", "--format", "json"]);
        assert!(out.status.success());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["ok"], true);
        assert_eq!(v["log"], "none", "{v}");
        assert_eq!(v["records"], 0);
    }
    // A record the log must hold is not "no log": it is missing.
    let pin = format!("0:{}", "a".repeat(64));
    let out = h.run(&["audit", "verify", "--expect", &pin, "--format", "json"]);
    assert_eq!(out.status.code(), Some(10));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    // A log directory others can read is refused, as JSON under --format json.
    let audit = h.0.join("home").join("audit");
    fs::create_dir(&audit).unwrap();
    fs::set_permissions(&audit, fs::Permissions::from_mode(0o755)).unwrap();
    let out = h.run(&["audit", "verify", "--format", "json"]);
    assert_eq!(out.status.code(), Some(10));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], false, "{v}");
    assert_eq!(String::from_utf8_lossy(&out.stderr).lines().count(), 1);
    let out = h.run(&["audit", "verify"]);
    assert_eq!(out.status.code(), Some(10));
    assert!(out.stdout.is_empty());
}

/// Issue 14.12: a hook that cannot run is visible: `doctor` checks every hook command (exists,
/// a regular executable file, outside the home hooks are denied, reachable by their uid) and
/// fails on a broken one; the broker names it in a warning at start.
#[test]
fn a_broken_hook_fails_doctor_and_the_broker_warns_at_start() {
    use std::io::BufRead;
    use std::os::unix::fs::PermissionsExt;
    let h = Home::new("hooks");
    assert!(
        h.run(&["mcp", "add", "x", "--stdio", "/bin/true"])
            .status
            .success()
    );
    let missing = h.0.join("no-such-hook");
    let plain = h.0.join("not-executable");
    fs::write(&plain, "#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&plain, fs::Permissions::from_mode(0o644)).unwrap();
    let inside = h.0.join("home").join("hook.sh");
    fs::write(&inside, "#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&inside, fs::Permissions::from_mode(0o700)).unwrap();
    let config_path = h.0.join("home").join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&fs::read(&config_path).unwrap()).unwrap();
    config["hooks"] = serde_json::json!({
        "PreToolUse": [missing.to_str().unwrap(), "/bin/true"],
        "Stop": [plain.to_str().unwrap(), inside.to_str().unwrap()],
    });
    fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();

    let out = h.run(&["mcp", "doctor", "--format", "json"]);
    assert_eq!(out.status.code(), Some(8), "a broken hook fails doctor");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let hooks = v["hooks"].as_array().unwrap();
    let by = |cmd: &str| hooks.iter().find(|x| x["command"] == cmd).unwrap().clone();
    let m = by(missing.to_str().unwrap());
    assert_eq!(
        (m["event"].as_str(), m["ok"].as_bool()),
        (Some("PreToolUse"), Some(false))
    );
    assert_eq!(m["detail"], "it does not exist");
    assert_eq!(by("/bin/true")["ok"], true);
    assert_eq!(
        by(plain.to_str().unwrap())["detail"],
        "it is not executable (no x bit)"
    );
    assert_eq!(
        by(inside.to_str().unwrap())["detail"],
        "it lies inside $ITERON_HOME, which hooks are denied"
    );
    assert_eq!(v["ok"], false);
    let text = String::from_utf8(h.run(&["mcp", "doctor"]).stdout).unwrap();
    assert!(
        text.contains(&format!(
            "hook        FAIL PreToolUse {}: it does not exist",
            missing.display()
        )),
        "{text}"
    );

    // The broker warns at start, one line per broken hook, and runs.
    let mut broker = Command::new(env!("CARGO_BIN_EXE_iteron"))
        .args(["broker", "serve", "--noninteractive"])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("ITERON_HOME", h.0.join("home"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    let mut err = std::io::BufReader::new(broker.stderr.take().unwrap());
    loop {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 || line.contains("ready;") {
            lines.push(line);
            break;
        }
        lines.push(line);
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(broker.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    assert!(broker.wait().unwrap().success());
    let warnings: Vec<&String> = lines.iter().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 3, "{lines:?}");
    assert!(
        warnings[0].starts_with(&format!(
            "iteron broker: warning: the PreToolUse hook {} cannot run: it does not exist",
            missing.display()
        )),
        "{warnings:?}"
    );
    assert!(lines.last().unwrap().contains("ready;"), "{lines:?}");
}

/// Issue 14.15: `mcp test` and `doctor` read `$CREDENTIALS_DIRECTORY` as the broker does: a
/// credential named like a forwarded variable supplies it (and wins over the environment), its
/// value is never shown, and a directory the broker would refuse is refused here too.
#[test]
fn mcp_test_and_doctor_read_the_credentials_directory_like_the_broker() {
    use std::os::unix::fs::PermissionsExt;
    let h = Home::new("creds");
    let creds = h.0.join("creds");
    fs::create_dir(&creds).unwrap();
    fs::set_permissions(&creds, fs::Permissions::from_mode(0o700)).unwrap();
    let value = h.0.join("creds").join("PROBE_CRED");
    fs::write(&value, format!("{CANARY}-from-the-directory\n")).unwrap();
    fs::set_permissions(&value, fs::Permissions::from_mode(0o400)).unwrap();
    // The server starts only when it received the variable, and proves it got the directory's
    // value (not the environment's) without printing it.
    let echo = fixture("echo_server.py");
    let script = format!(
        "case \"$PROBE_CRED\" in *-from-the-directory) exec /usr/bin/python3 {echo} ;; esac; \
         echo 'PROBE_CRED missing or from the environment' >&2; exit 7"
    );
    let fixtures = std::path::Path::new(&echo)
        .parent()
        .unwrap()
        .to_str()
        .unwrap();
    assert!(
        h.run(&[
            "mcp",
            "add",
            "cred",
            "--stdio",
            "/bin/sh",
            "--env",
            "PROBE_CRED",
            "--sandbox-readable",
            fixtures,
            "--",
            "-c",
            &script
        ])
        .status
        .success()
    );
    let dir = [("CREDENTIALS_DIRECTORY", creds.as_os_str())];
    let env_too = [
        ("CREDENTIALS_DIRECTORY", creds.as_os_str()),
        ("PROBE_CRED", std::ffi::OsStr::new("CANARY-from-env")),
    ];
    let out = h.run_env(&["mcp", "test", "cred", "--format", "json"], &env_too);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tool_count"], 1, "{v}");
    // Without the directory the variable is missing: the same server fails.
    let out = h.run(&["mcp", "test", "cred"]);
    assert_eq!(out.status.code(), Some(8));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("PROBE_CRED missing"), "{err}");
    // doctor says where the variable comes from, never its value.
    let out = h.run_env(&["mcp", "doctor", "--format", "json"], &dir);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = v["servers"][0]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "env PROBE_CRED")
        .unwrap()
        .clone();
    assert_eq!(check["ok"], true, "{check}");
    assert_eq!(
        check["detail"],
        "set by the credentials directory (value not shown)"
    );
    assert_eq!(v["credentials_directory"]["ok"], true, "{v}");
    assert!(
        v["credentials_directory"]["detail"]
            .as_str()
            .unwrap()
            .ends_with("supplies PROBE_CRED"),
        "{v}"
    );
    // A directory the broker would refuse is refused by test and failed by doctor.
    fs::set_permissions(&value, fs::Permissions::from_mode(0o620)).unwrap();
    let out = h.run_env(&["mcp", "test", "cred"], &dir);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("credentials directory: writable by group or others"),
        "{err}"
    );
    let out = h.run_env(&["mcp", "doctor", "--format", "json"], &dir);
    assert_eq!(out.status.code(), Some(8));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["credentials_directory"]["ok"], false, "{v}");
}

/// Issue 14.16: a server that exits as it starts is reported at once with its last words —
/// never as a server that did not answer in time (its stdout could end between the client's
/// check and the registration of its first request, which then waited out the deadline).
#[test]
fn a_server_that_exits_at_start_is_reported_at_once_every_time() {
    let h = Home::new("exits");
    assert!(
        h.run(&[
            "mcp",
            "add",
            "gone",
            "--stdio",
            "/bin/sh",
            "--",
            "-c",
            "echo 'license file missing' >&2; exit 7"
        ])
        .status
        .success()
    );
    for round in 0..20 {
        let started = std::time::Instant::now();
        let out = h.run(&["mcp", "test", "gone"]);
        let took = started.elapsed();
        assert_eq!(out.status.code(), Some(8), "round {round}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("license file missing"), "round {round}: {err}");
        assert!(
            took < std::time::Duration::from_secs(10),
            "round {round}: {took:?} {err}"
        );
    }
}

/// Issue 14.16: a server that never gets through its start is stopped at the start's deadline
/// and reported with its last stderr lines and the confinement hint (an outer deadline used to
/// lose both: "no answer within 30 s").
#[test]
fn a_server_that_hangs_at_start_is_reported_with_its_stderr_and_the_hint() {
    let h = Home::new("hangs");
    assert!(
        h.run(&[
            "mcp",
            "add",
            "stuck",
            "--stdio",
            "/bin/sh",
            "--",
            "-c",
            "echo 'waiting for the license server' >&2; exec sleep 60"
        ])
        .status
        .success()
    );
    let started = std::time::Instant::now();
    let out = h.run(&["mcp", "test", "stuck", "--timeout", "3"]);
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(8));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no answer within 2.5 s of starting"), "{err}");
    assert!(
        err.contains("its stderr ends: waiting for the license server"),
        "{err}"
    );
    assert!(err.contains("the server runs confined"), "{err}");
    assert!(took < std::time::Duration::from_secs(8), "{took:?}");
    // The bound of --timeout is checked: 2 to 300 s.
    for bad in ["1", "301"] {
        assert_eq!(
            h.run(&["mcp", "test", "stuck", "--timeout", bad])
                .status
                .code(),
            Some(2)
        );
    }
}

/// Issue 14.11: `status --connect` and `doctor --connect` probe the servers at once, at most
/// eight at a time (at the limit: one timeout for eight hanging servers; one over: the ninth
/// waits for a slot), within a bound on the whole run; text shows each result as it arrives,
/// a progress line appears only on a terminal, and any failed server makes the command exit 8.
#[test]
fn probes_run_in_parallel_bounded_per_run_and_fail_the_command() {
    use std::time::{Duration, Instant};
    let h = Home::new("parallel");
    let echo = fixture("echo_server.py");
    let add_hang = |name: &str| {
        assert!(
            h.run(&["mcp", "add", name, "--stdio", "/bin/sleep", "--", "60"])
                .status
                .success()
        );
    };
    add_hang("hang0");
    assert!(
        h.run(&[
            "mcp",
            "add",
            "echo",
            "--stdio",
            "/usr/bin/python3",
            "--",
            &echo
        ])
        .status
        .success()
    );
    // Each result as it arrives: the quick server before the one configured first.
    let out = h.run(&["mcp", "status", "--connect", "--timeout", "3"]);
    assert_eq!(
        out.status.code(),
        Some(8),
        "a failed server fails the command"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].starts_with("echo  stdio  reachable"), "{text}");
    assert!(lines[1].starts_with("hang0  stdio  failed"), "{text}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("probing"),
        "no progress line off a terminal: {err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("1 of 2 server(s) failed"), "{err}");
    // All reachable: exit 0.
    let out = h.run(&["mcp", "status", "echo", "--connect"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // On a terminal, a progress line on stderr.
    let pty = nix::pty::openpty(
        None::<&nix::pty::Winsize>,
        None::<&nix::sys::termios::Termios>,
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_iteron"))
        .args(["mcp", "status", "--connect", "--timeout", "2"])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("ITERON_HOME", h.0.join("home"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::from(std::fs::File::from(pty.slave)))
        .spawn()
        .unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(8));
    let mut master = std::fs::File::from(pty.master);
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    // Everything the child wrote is buffered in the terminal; the read ends with EIO.
    while let Ok(n) = std::io::Read::read(&mut master, &mut buf) {
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
    }
    let seen = String::from_utf8_lossy(&seen);
    assert!(seen.contains("probing: 0/2 done"), "{seen:?}");
    assert!(seen.contains("probing: 1/2 done"), "{seen:?}");

    // At the limit: eight hanging servers cost one timeout, not eight. (A probe of 2 s gives
    // the start 1.5 s: a hanging stdio server is reported then.)
    let _ = h.run(&["mcp", "remove", "echo"]);
    for i in 1..8 {
        add_hang(&format!("hang{i}"));
    }
    let started = Instant::now();
    let out = h.run(&[
        "mcp",
        "status",
        "--connect",
        "--timeout",
        "2",
        "--format",
        "json",
    ]);
    let eight = started.elapsed();
    assert_eq!(out.status.code(), Some(8));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["servers"].as_array().unwrap().len(), 8);
    assert!(eight < Duration::from_millis(2900), "{eight:?}");
    // One over: the ninth waits for a slot, so the run takes two start timeouts.
    add_hang("hang8");
    let started = Instant::now();
    let out = h.run(&[
        "mcp",
        "doctor",
        "--connect",
        "--timeout",
        "2",
        "--format",
        "json",
    ]);
    let nine = started.elapsed();
    assert_eq!(out.status.code(), Some(8));
    assert!(nine >= Duration::from_secs(3), "{nine:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let connect = |i: usize| {
        v["servers"][i]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "connect")
            .unwrap()
            .clone()
    };
    assert_eq!(connect(8)["ok"], false);
    // The whole run is bounded: the ninth is cut at the run's bound and named.
    let started = Instant::now();
    let out = h.run(&[
        "mcp",
        "status",
        "--connect",
        "--timeout",
        "2",
        "--run-timeout",
        "2",
        "--format",
        "json",
    ]);
    let bounded = started.elapsed();
    assert_eq!(out.status.code(), Some(8));
    assert!(bounded < Duration::from_millis(2900), "{bounded:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cut: Vec<&serde_json::Value> = v["servers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["error"]
                .as_str()
                .is_some_and(|e| e.contains("not finished within the run's bound of 2 s"))
        })
        .collect();
    assert_eq!(cut.len(), 1, "{v}");
    iteron_test_support::record!(
        "P5",
        serde_json::json!({
            "max_parallel_probes": 8,
            "eight_hanging_ms": eight.as_millis() as u64,
            "nine_hanging_ms": nine.as_millis() as u64,
            "run_bound_ms": bounded.as_millis() as u64,
        }),
    );
}

/// Issue 14.20: every `--format json` output is a top-level object carrying `schema_version`,
/// and the probes speak one vocabulary: `protocol_version`, `phase`, `tool_count` with the
/// `tools` names (`state` is kept beside `phase` in `mcp status`).
#[test]
fn every_json_output_carries_schema_version_and_one_vocabulary() {
    let h = Home::new("vocabulary");
    let echo = fixture("echo_server.py");
    assert!(
        h.run(&[
            "mcp",
            "add",
            "echo",
            "--stdio",
            "/usr/bin/python3",
            "--",
            &echo
        ])
        .status
        .success()
    );
    assert!(
        h.run(&["mcp", "add", "web", "--url", "https://mcp.example/mcp"])
            .status
            .success()
    );
    let outputs: &[&[&str]] = &[
        &["mcp", "list"],
        &["mcp", "get", "echo"],
        &["mcp", "test", "echo"],
        &["mcp", "status"],
        &["mcp", "status", "echo", "--connect"],
        &["mcp", "doctor"],
        &["mcp", "auth", "status", "web"],
        &["audit", "verify"],
        &["skills"],
        &["agents"],
    ];
    let mut seen = Vec::new();
    for args in outputs {
        let mut full = args.to_vec();
        full.extend(["--format", "json"]);
        let out = h.run(&full);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{full:?}: {}", String::from_utf8_lossy(&out.stdout)));
        assert_eq!(v["schema_version"], 2, "{full:?}: {v}");
        seen.push(v);
    }
    let test = &seen[2];
    assert_eq!(test["protocol_version"], "2025-11-25");
    assert_eq!(test["tool_count"], 1);
    assert_eq!(test["tools"], serde_json::json!(["echo"]));
    let listed = &seen[3]["servers"];
    assert_eq!(listed[0]["phase"], "not_probed", "{listed}");
    let probed = &seen[4]["servers"][0];
    assert_eq!(probed["phase"], "reachable", "{probed}");
    assert_eq!(probed["state"], "reachable");
    assert_eq!(probed["protocol_version"], "2025-11-25");
    assert_eq!(probed["tool_count"], 1);
    assert_eq!(probed["tools"], serde_json::json!(["echo"]));
}
