//! The hook runner with real scripts: exit 2 blocks a `PreToolUse` with its stderr as the
//! reason; exit 1, a timeout and a missing binary are "no opinion"; a flood of output is
//! bounded; the hook's environment is built from nothing; the event arrives on stdin; a root
//! broker's hooks run as `nobody`, cannot use the kernel keyrings and leave no `setsid`
//! grandchild behind.
//!
//! Under a root test run the directories hooks write are owned by uid 65534 (the hooks' uid).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use iteron_broker::confine::RunAs;
use iteron_broker::daemon::{ToolEvent, ToolHooks, Verdict};
use iteron_broker::hooks::{HookRunner, MAX_HOOK_OUTPUT, Outcome};
use iteron_policy::config::{AbsolutePath, HookEvent};
use iteron_test_support::{give_to_children, is_root};
use serde_json::{Map, Value, json};

/// A fresh test directory the hooks may write (see the module documentation).
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("iteron-hooks-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    give_to_children(&d);
    d
}

fn script(dir: &Path, name: &str, body: &str) -> AbsolutePath {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    AbsolutePath::parse(p.to_str().unwrap()).unwrap()
}

/// Hooks of `event`, allowed to write in the test directory `d` (hooks_writable).
fn runner(d: &Path, event: HookEvent, hooks: Vec<AbsolutePath>) -> HookRunner {
    let mut m = BTreeMap::new();
    m.insert(event, hooks);
    HookRunner::new(m).with_writable(&[AbsolutePath::parse(d.to_str().unwrap()).unwrap()])
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn event() -> ToolEvent {
    let mut arguments = Map::new();
    arguments.insert("path".into(), json!("src/main.rs"));
    ToolEvent {
        session: "s1-test".into(),
        server: "files".into(),
        tool: "write_file".into(),
        arguments: Value::Object(arguments).to_string().into(),
    }
}

#[test]
fn exit_2_blocks_with_its_reason_and_sees_the_event_on_stdin() {
    let d = dir("block");
    let seen = d.join("seen.json");
    let hook = script(
        &d,
        "block.sh",
        &format!(
            "cat > {}\necho 'writes to src/ need review\u{202e}' >&2\nexit 2",
            seen.display()
        ),
    );
    let later = script(
        &d,
        "later.sh",
        &format!("touch {}", d.join("later-ran").display()),
    );
    let r = runner(&d, HookEvent::PreToolUse, vec![hook, later]);
    let (verdict, reports) = rt().block_on(r.pre_tool_use(&event()));
    let Verdict::Block(reason) = verdict else {
        panic!("not blocked: {reports:?}")
    };
    assert!(reason.contains("writes to src/ need review"), "{reason}");
    assert!(
        !reason.contains('\u{202e}'),
        "the reason is made terminal-safe"
    );
    assert!(reason.len() <= 512 && !reason.contains('\n'));
    // The first block stops the run.
    assert_eq!(reports.len(), 1);
    assert!(!d.join("later-ran").exists());
    let v: Value = serde_json::from_slice(&std::fs::read(&seen).unwrap()).unwrap();
    assert_eq!(v["event"], "PreToolUse");
    assert_eq!(v["tool"], "write_file");
    assert_eq!(v["arguments"]["path"], "src/main.rs");
}

#[test]
fn other_exits_timeouts_and_missing_binaries_are_no_opinion() {
    let d = dir("noop");
    let one = script(&d, "one.sh", "echo 'nope' >&2\nexit 1");
    let sleepy = script(&d, "sleepy.sh", "sleep 30");
    let missing = AbsolutePath::parse(d.join("does-not-exist").to_str().unwrap()).unwrap();
    // Exit 2 from a hook of another event is not a block either.
    let r = runner(&d, HookEvent::PreToolUse, vec![one, sleepy, missing])
        .with_timeout(Duration::from_millis(500));
    let t = Instant::now();
    let (verdict, reports) = rt().block_on(r.pre_tool_use(&event()));
    assert_eq!(verdict, Verdict::NoOpinion);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the timeout was not enforced"
    );
    let outcomes: Vec<&Outcome> = reports.iter().map(|r| &r.outcome).collect();
    assert_eq!(outcomes[0], &Outcome::Exited(1));
    assert_eq!(outcomes[1], &Outcome::TimedOut);
    assert!(
        matches!(outcomes[2], Outcome::SpawnFailed(_)),
        "{outcomes:?}"
    );
    for r in &reports {
        assert!(r.detail().contains("no opinion"), "{}", r.detail());
    }

    let two = script(&d, "two.sh", "exit 2");
    let post = runner(&d, HookEvent::PostToolUse, vec![two]);
    let reports = rt().block_on(post.post_tool_use(&event(), "ok"));
    assert_eq!(reports[0].outcome, Outcome::Exited(2));
}

#[test]
fn a_flood_of_output_is_bounded() {
    let d = dir("flood");
    // 8 MiB on stdout and on stderr.
    let flood = script(
        &d,
        "flood.sh",
        "head -c 8388608 /dev/zero\nhead -c 8388608 /dev/zero >&2\nexit 0",
    );
    let r = runner(&d, HookEvent::PostToolUse, vec![flood]);
    let reports = rt().block_on(r.post_tool_use(&event(), "ok"));
    assert_eq!(reports[0].outcome, Outcome::Exited(0));
    assert_eq!(
        reports[0].discarded,
        8 * 1024 * 1024 - MAX_HOOK_OUTPUT as u64
    );
    // A blocking hook that floods stderr: it is drained (the hook finishes) and its reason is
    // still one bounded line.
    let loud = script(
        &d,
        "loud.sh",
        "head -c 8388608 /dev/zero | tr '\\0' 'x' >&2\necho >&2\necho 'the real reason' >&2\nexit 2",
    );
    let r = runner(&d, HookEvent::PreToolUse, vec![loud]);
    let (verdict, _) = rt().block_on(r.pre_tool_use(&event()));
    let Verdict::Block(reason) = verdict else {
        panic!("not blocked: {verdict:?}")
    };
    assert!(reason.len() <= 512, "{}", reason.len());
    assert!(!reason.contains('\n'));
    assert!(reason.contains("the real reason"), "{reason}");
    // Escaped once, not once per step: a backslash and a colour sequence as a terminal-safe
    // line shows them.
    let marked = script(
        &d,
        "marked.sh",
        "printf 'C:\\\\dir \\033[31mred\\n' >&2\nexit 2",
    );
    let r = runner(&d, HookEvent::PreToolUse, vec![marked]);
    let (verdict, _) = rt().block_on(r.pre_tool_use(&event()));
    let Verdict::Block(reason) = verdict else {
        panic!("not blocked: {verdict:?}")
    };
    assert_eq!(
        reason,
        iteron_policy::text::single_line_capped("C:\\dir \u{1b}[31mred", 300)
    );
}

#[test]
fn the_hook_environment_is_built_from_nothing() {
    let d = dir("env");
    let out = d.join("env.txt");
    let hook = script(&d, "env.sh", &format!("env > {}", out.display()));
    let r = runner(&d, HookEvent::SessionStart, vec![hook]);
    let reports =
        rt().block_on(r.lifecycle(HookEvent::SessionStart, json!({"event": "SessionStart"})));
    assert_eq!(reports[0].outcome, Outcome::Exited(0));
    let env = std::fs::read_to_string(&out).unwrap();
    let names: Vec<&str> = env.lines().filter_map(|l| l.split('=').next()).collect();
    // PATH and LANG from the broker, TMPDIR its private scratch directory; PWD, SHLVL and _
    // are the shell's own.
    for n in &names {
        assert!(
            ["PATH", "LANG", "TMPDIR", "PWD", "SHLVL", "_", "OLDPWD"].contains(n),
            "unexpected variable {n} in the hook's environment"
        );
    }
    // The test process has many variables (CARGO_*, HOME, …); none reached the hook.
    assert!(std::env::vars().count() > names.len());
}

#[test]
fn a_hook_reads_but_does_not_write_outside_its_grants_and_never_sees_the_home() {
    let d = dir("confined");
    let home = d.join("home");
    std::fs::create_dir_all(home.join("mcp-credentials")).unwrap();
    std::fs::write(home.join("mcp-credentials/x"), "secret").unwrap();
    let elsewhere = dir("confined-elsewhere");
    // Beside the home, not containing it: a directory that contains the home is granted only
    // as its existing siblings of the home (docs/confinement.md).
    std::fs::create_dir_all(d.join("out")).unwrap();
    give_to_children(&d.join("out"));
    let out = d.join("out/out.txt");
    let hook = script(
        &d,
        "probe.sh",
        &format!(
            "cat {home}/mcp-credentials/x >> {out} 2>&1 || echo home-denied >> {out}\n\
             echo x > {elsewhere}/planted 2>/dev/null || echo write-denied >> {out}\n\
             head -c 1 /etc/passwd > /dev/null && echo read-ok >> {out}",
            home = home.display(),
            out = out.display(),
            elsewhere = elsewhere.display()
        ),
    );
    let r = runner(&d, HookEvent::Stop, vec![hook]).with_home(&home);
    let reports = rt().block_on(r.lifecycle(HookEvent::Stop, json!({"event": "Stop"})));
    assert_eq!(reports[0].outcome, Outcome::Exited(0));
    let seen = std::fs::read_to_string(&out).unwrap();
    assert!(
        seen.contains("home-denied") && !seen.contains("secret"),
        "{seen}"
    );
    assert!(seen.contains("write-denied"), "{seen}");
    assert!(!elsewhere.join("planted").exists());
    assert!(seen.contains("read-ok"), "{seen}");
}

#[test]
fn at_most_eight_hooks_run_at_once_and_the_ninth_waits_its_turn() {
    use iteron_broker::hooks::MAX_RUNNING_HOOKS;
    let d = dir("bound");
    let runs = d.join("runs");
    std::fs::create_dir_all(&runs).unwrap();
    give_to_children(&runs);
    // Each run marks itself running, records how many runs it sees, holds its slot, then
    // leaves. A run that started while all slots were held would see one marker too many.
    let hook = script(
        &d,
        "hold.sh",
        &format!(
            "touch {runs}/$$\nls {runs} | wc -l >> {counts}\nsleep 2\nrm {runs}/$$",
            runs = runs.display(),
            counts = d.join("counts").display()
        ),
    );
    let r = std::sync::Arc::new(runner(&d, HookEvent::PreToolUse, vec![hook]));
    let t = Instant::now();
    let finished = rt().block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..=MAX_RUNNING_HOOKS {
            let r = std::sync::Arc::clone(&r);
            set.spawn(async move {
                let (verdict, reports) = r.pre_tool_use(&event()).await;
                assert_eq!(verdict, Verdict::NoOpinion);
                assert_eq!(reports[0].outcome, Outcome::Exited(0));
                t.elapsed()
            });
        }
        let mut finished = Vec::new();
        while let Some(done) = set.join_next().await {
            finished.push(done.unwrap());
        }
        finished.sort();
        finished
    });
    let counts: Vec<usize> = std::fs::read_to_string(d.join("counts"))
        .unwrap()
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(counts.len(), MAX_RUNNING_HOOKS + 1);
    let most = *counts.iter().max().unwrap();
    assert!(
        most <= MAX_RUNNING_HOOKS,
        "{most} hooks ran at once: {counts:?}"
    );
    // The ninth started only after a slot freed: it finished a whole hold after the first.
    assert!(
        finished[MAX_RUNNING_HOOKS] >= finished[0] + Duration::from_millis(1500),
        "{finished:?}"
    );
    iteron_test_support::record!(
        "P5",
        json!({"max_running_hooks": MAX_RUNNING_HOOKS, "most_seen_at_once": most}),
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_root_brokers_hooks_run_as_nobody_and_never_read_etc_shadow() {
    if !is_root() {
        eprintln!("skipped: needs root to run hooks as another uid");
        return;
    }
    let d = dir("identity");
    let root_only = d.join("root-only");
    std::fs::write(&root_only, "root-only-canary").unwrap();
    std::fs::set_permissions(&root_only, std::fs::Permissions::from_mode(0o600)).unwrap();
    // Each variant writes into a directory its own uid owns (a run_as "root" hook has no
    // capability, so it cannot write into one that uid 65534 owns).
    std::fs::create_dir(d.join("nobody")).unwrap();
    give_to_children(&d.join("nobody"));
    std::fs::create_dir(d.join("root")).unwrap();
    let probe = |tag: &str| {
        let out = d.join(tag).join("out.txt");
        let hook = script(
            &d,
            &format!("{tag}.sh"),
            &format!(
                "{{ id -u; id -G; \
                 head -c 1 /etc/shadow >/dev/null 2>&1 && echo shadow-read || echo shadow-denied; \
                 cat {root_only} 2>/dev/null || echo root-only-denied; }} > {out}",
                root_only = root_only.display(),
                out = out.display()
            ),
        );
        (hook, out)
    };
    // The default: uid 65534, no groups; neither /etc/shadow nor a root-only file is read.
    let (hook, out) = probe("nobody");
    let r = runner(&d, HookEvent::Stop, vec![hook]);
    let reports = rt().block_on(r.lifecycle(HookEvent::Stop, json!({"event": "Stop"})));
    assert_eq!(reports[0].outcome, Outcome::Exited(0), "{reports:?}");
    let seen = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<&str> = seen.lines().collect();
    assert_eq!(lines[..2], ["65534", "65534"], "{seen}");
    assert!(lines.contains(&"shadow-denied"), "{seen}");
    assert!(lines.contains(&"root-only-denied"), "{seen}");
    // hooks_run_as "root": the root-only file is read (so the denial above is the uid's), and
    // /etc/shadow still is not (the secrets of /etc are never granted).
    let (hook, out) = probe("root");
    let r = runner(&d, HookEvent::Stop, vec![hook]).with_run_as(RunAs::Root);
    let reports = rt().block_on(r.lifecycle(HookEvent::Stop, json!({"event": "Stop"})));
    assert_eq!(reports[0].outcome, Outcome::Exited(0), "{reports:?}");
    let seen = std::fs::read_to_string(&out).unwrap();
    assert!(seen.starts_with("0\n"), "{seen}");
    assert!(seen.contains("root-only-canary"), "{seen}");
    assert!(seen.contains("shadow-denied"), "{seen}");
    // The file is there and root reads it: the denials come from the confinement.
    assert!(std::fs::File::open("/etc/shadow").is_ok());
    iteron_test_support::record!("P9", json!({"uid": 65534}),);
}

#[test]
fn hooks_cannot_touch_the_kernel_keyrings() {
    let d = dir("keyring");
    let probe = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/probes/keyring.py")
        .canonicalize()
        .unwrap();
    let keyring = |args: &[&str]| -> String {
        let out = std::process::Command::new("/usr/bin/python3")
            .arg(&probe)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let desc = format!("iteron-hook-canary-{}", std::process::id());
    let planted = format!("iteron-hook-planted-{}", std::process::id());
    // Removed at the end, a failed run included: from our keyring and, under root, from uid
    // 65534's, where a hook would have planted one.
    struct Cleanup(PathBuf, Vec<String>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            use std::os::unix::process::CommandExt;
            for desc in &self.1 {
                let mut own = std::process::Command::new("/usr/bin/python3");
                let _ = own.arg(&self.0).args(["drop", desc]).output();
                if is_root() {
                    let mut other = std::process::Command::new("/usr/bin/python3");
                    other.arg(&self.0).args(["drop", desc]);
                    let _ = other.uid(65534).gid(65534).output();
                }
            }
        }
    }
    let _cleanup = Cleanup(probe.clone(), vec![desc.clone(), planted.clone()]);
    keyring(&["add", &desc, "hook-keyring-canary"]);
    for (run_as, tag) in [(RunAs::Nobody, "nobody"), (RunAs::Root, "root")] {
        // Written by a directory its uid owns (see the identity test).
        std::fs::create_dir(d.join(tag)).unwrap();
        if run_as == RunAs::Nobody {
            give_to_children(&d.join(tag));
        }
        let out = d.join(tag).join("probe.json");
        let hook = script(
            &d,
            &format!("keys-{tag}.sh"),
            &format!(
                "/usr/bin/python3 {} probe {desc} {planted} > {}",
                probe.display(),
                out.display()
            ),
        );
        let r = runner(&d, HookEvent::SessionStart, vec![hook]).with_run_as(run_as);
        let reports =
            rt().block_on(r.lifecycle(HookEvent::SessionStart, json!({"event": "SessionStart"})));
        assert_eq!(reports[0].outcome, Outcome::Exited(0), "{reports:?}");
        let v: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        for step in ["user_keyring", "link", "search", "request", "add"] {
            assert_eq!(v[step][1], nix::libc::EPERM, "{step} ({run_as:?}): {v}");
        }
        assert!(v.get("value").is_none(), "{v}");
        assert_eq!(keyring(&["find", &planted]), "0");
    }
    // The key is there for the operator.
    assert_ne!(keyring(&["find", &desc]), "0");
    iteron_test_support::record!("P9", json!({"denied_with": "EPERM"}),);
}

#[test]
fn no_setsid_grandchild_outlives_its_hook() {
    let d = dir("grandchild");
    let pids = d.join("pids");
    // The hook starts a session-leaving child and a double-forked one, then ends at once.
    let hook = script(
        &d,
        "daemonize.sh",
        &format!(
            "setsid sh -c 'echo $$ >> {pids}; exec sleep 300' </dev/null >/dev/null 2>&1 &\n\
             (setsid sh -c 'echo $$ >> {pids}; exec sleep 301' </dev/null >/dev/null 2>&1 &)\n\
             while [ \"$(cat {pids} 2>/dev/null | wc -l)\" -lt 2 ]; do sleep 0.05; done\n\
             exit 0",
            pids = pids.display()
        ),
    );
    let r = runner(&d, HookEvent::PostToolUse, vec![hook]);
    let reports = rt().block_on(r.post_tool_use(&event(), "ok"));
    assert_eq!(reports[0].outcome, Outcome::Exited(0), "{reports:?}");
    let started: Vec<i32> = std::fs::read_to_string(&pids)
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(started.len(), 2, "{started:?}");
    // When the run returns they are gone: killed and reaped (no /proc entry, not a zombie).
    for p in &started {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists(),
            "grandchild {p} outlived its hook"
        );
    }
    iteron_test_support::record!("P9", json!({"grandchildren": started.len()}),);
    let _ = std::fs::remove_dir_all(&d);
}
