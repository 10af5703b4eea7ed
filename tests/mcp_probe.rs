//! `iteron mcp test|status|doctor` end to end: the built binary, a temporary ITERON_HOME, the
//! stdio fixtures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Output};

#[path = "support/mod.rs"]
mod support;

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
        let out = Command::new(env!("CARGO_BIN_EXE_iteron"))
            .args(args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("ITERON_HOME", self.0.join("home"))
            .env("PROBE_SECRET", CANARY)
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
    support::report::record(
        "P9",
        "tests/mcp_probe.rs::mcp_test_leaves_no_setsid_grandchild_behind",
        serde_json::json!({"grandchild_gone": true}),
    );
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
    support::report::record(
        "P9",
        "tests/mcp_probe.rs::get_and_doctor_show_a_web_egress_servers_egress_path_or_that_it_is_unconfined",
        serde_json::json!({"namespaces": namespaces}),
    );
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
    support::report::record(
        "P9",
        "tests/mcp_probe.rs::an_unprivileged_brokers_web_egress_server_gets_a_user_and_network_namespace",
        serde_json::json!({}),
    );
}
