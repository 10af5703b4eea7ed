//! End-to-end tests of what the operator sees before approving, with the real `iteron` binary
//! as broker, operator and agent, and the repository's scripted stdio server: previews that
//! say when and how much they leave out, `iteron approvals show` printing arguments whole,
//! `iteron approvals watch` taking no answer typed before its item was on the screen (on a
//! pseudo-terminal), and JSON outputs that carry bidi controls, C1 controls and DEL only as
//! `\u` escapes.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::io::{Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use iteron_test_support::{self as support, text, wait_child};
use serde_json::{Value, json};

fn iteron() -> &'static str {
    env!("CARGO_BIN_EXE_iteron")
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A private test area (`base` with `home`, 0700, inside) whose configuration has one scripted
/// server `s` in the given mode.
struct Area {
    base: PathBuf,
}

impl Area {
    fn new(name: &str, mode: &str) -> Area {
        let base =
            std::env::temp_dir().join(format!("iteron-approvals-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(base.join("home"))
            .unwrap();
        let area = Area { base };
        let config = json!({"schema_version": 2, "mcp_servers": [{
            "name": "s",
            "transport": "stdio",
            "command": "/usr/bin/python3",
            "args": [repo().join("fixtures/stdio/scripted_server.py").to_str().unwrap(), mode],
        }]});
        support::write_private_json(&area.home().join("config.json"), &config);
        area
    }

    fn home(&self) -> PathBuf {
        self.base.join("home")
    }

    /// Replace the configuration with the official everything server as `ev` (it asks for a
    /// form with constrained fields in `trigger-elicitation-request`).
    fn everything(&self) {
        let js = repo().join(
            "tests/interop/node_modules/@modelcontextprotocol/server-everything/dist/index.js",
        );
        assert!(
            js.exists(),
            "the official everything server is not installed: run tests/interop/setup (./scripts/test does)"
        );
        let config = json!({"schema_version": 2, "mcp_servers": [{
            "name": "ev",
            "transport": "stdio",
            "command": support::node().to_str().unwrap(),
            "args": [js.to_str().unwrap(), "stdio"],
        }]});
        support::write_private_json(&self.home().join("config.json"), &config);
    }

    fn agent_socket(&self) -> PathBuf {
        self.base.join("run").join("agent.sock")
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

    fn broker(&self) -> Broker {
        let sock = self.agent_socket();
        let child = self
            .iteron(&["broker", "serve", "--socket", sock.to_str().unwrap()])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let operator = self.home().join("run").join("operator.sock");
        let b = Broker(child);
        assert!(
            support::wait_listening(&[&sock, &operator], Duration::from_secs(15)),
            "the broker did not start"
        );
        b
    }

    /// `iteron agent call s echo --json ARGS` in the background.
    fn call(&self, arguments: &Value, format: &str) -> Child {
        let sock = self.agent_socket();
        Command::new(iteron())
            .args([
                "agent",
                "--socket",
                sock.to_str().unwrap(),
                "call",
                "s",
                "echo",
                "--json",
                &arguments.to_string(),
                "--format",
                format,
            ])
            .env_remove("ITERON_HOME")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
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
}

impl Drop for Area {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

struct Broker(Child);

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.0.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Characters a terminal acts on that `serde_json` would leave raw.
fn raw_hostile(s: &str) -> Option<char> {
    s.chars()
        .find(|c| matches!(u32::from(*c), 0x7f..=0x9f | 0x202a..=0x202e | 0x2066..=0x2069))
}

/// 17.4: the preview is cut by what escaping made of the arguments, and says so with the
/// number of bytes it leaves out and the command that shows them; the CLI's own line keeps
/// that notice whatever the preview holds, and shows the broker's escapes as they are.
#[test]
fn a_cut_preview_says_how_many_bytes_it_hides_and_how_to_see_them() {
    let area = Area::new("cut", "legacy");
    let _broker = area.broker();

    // 600 RLOs: 1,800 bytes raw, 4,800 escaped. Keys are sorted, so "pad" hides "path".
    let hidden =
        json!({"text": "x", "pad": "\u{202e}".repeat(600), "path": "/home/op/.ssh/id_ed25519"});
    let call = area.call(&hidden, "text");
    let p = area.wait_pending(1);
    let id = p[0]["id"].as_u64().unwrap();
    assert!(p[0]["arguments_bytes"].as_u64().unwrap() < 4096);
    assert!(!p[0]["arguments"].as_str().unwrap().contains("id_ed25519"));
    assert_eq!(p[0]["arguments_cut"], true, "{}", p[0]);
    let omitted = p[0]["arguments_omitted"].as_u64().unwrap();
    assert!(omitted > "/home/op/.ssh/id_ed25519".len() as u64);
    let out = area.run(&["approvals", "list"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let line = text(&out.stdout);
    let notice = format!("({omitted} bytes not shown; iteron approvals show {id})");
    assert!(line.trim_end().ends_with(&notice), "{line}");
    // The broker's escapes are shown as they are, not escaped a second time.
    assert!(line.contains(r#""pad":"\u{202e}\u{202e}"#), "{line}");
    // `watch` asks about the call with the same notice, the last thing before its prompt.
    let (mut watch, screen, mut keys) = watch_on_pty(&area);
    screen.wait_for("approve? [y/N] ", 1);
    let shown = screen.text();
    let asked = shown
        .lines()
        .find(|l| l.starts_with(&format!("[{id}] call s/echo")))
        .unwrap_or_else(|| panic!("the call is not shown: {shown}"));
    assert!(asked.trim_end().ends_with(&notice), "{shown}");
    assert!(!asked.contains("id_ed25519"), "{shown}");
    std::thread::sleep(Duration::from_millis(300));
    keys.write_all(b"n\n").unwrap();
    assert_eq!(wait_child(call).status.code(), Some(9));
    let _ = watch.kill();
    let _ = watch.wait();

    // Backslashes double in the preview; the CLI's line used to double them again and then
    // cut its own line, notice and all.
    let slashes = json!({"text": "\\".repeat(3000), "z": "end"});
    let call = area.call(&slashes, "text");
    let p = area.wait_pending(1);
    let id = p[0]["id"].as_u64().unwrap();
    let omitted = p[0]["arguments_omitted"].as_u64().unwrap();
    assert!(omitted > 0);
    let line = text(&area.run(&["approvals", "list"]).stdout);
    assert!(
        line.trim_end().ends_with(&format!(
            "({omitted} bytes not shown; iteron approvals show {id})"
        )),
        "{line}"
    );
    assert!(
        area.run(&["approvals", "deny", &id.to_string()])
            .status
            .success()
    );
    assert_eq!(wait_child(call).status.code(), Some(9));

    // A whole preview has no notice.
    let call = area.call(&json!({"text": "short"}), "text");
    let p = area.wait_pending(1);
    assert_eq!(p[0]["arguments_cut"], false);
    assert_eq!(p[0]["arguments_omitted"], 0);
    let line = text(&area.run(&["approvals", "list"]).stdout);
    assert!(!line.contains("not shown"), "{line}");
    let id = p[0]["id"].as_u64().unwrap().to_string();
    assert!(area.run(&["approvals", "approve", &id]).status.success());
    assert!(wait_child(call).status.success());
    iteron_test_support::record!("P14", json!({"hidden_bytes_shown_as_omitted": true}),);
}

/// A stand-in operator socket that answers `hello` and then `show` with `answers` in turn (the
/// broker's side of `show` is tested in `broker/src/approvals.rs`; this proves what the command
/// does with what it is given). Returns the socket path and the requests it received.
fn fake_operator(
    area: &Area,
    answers: Vec<Value>,
) -> (PathBuf, std::thread::JoinHandle<Vec<Value>>) {
    let path = area.base.join("fake-operator.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut seen = Vec::new();
        let mut answers = answers.into_iter();
        loop {
            let mut len = [0u8; 4];
            if s.read_exact(&mut len).is_err() {
                return seen;
            }
            let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
            s.read_exact(&mut body).unwrap();
            let req: Value = serde_json::from_slice(&body).unwrap();
            let result = if req["method"] == "hello" {
                json!({"protocol": 1, "broker": "test", "interactive": true})
            } else {
                seen.push(req["params"].clone());
                match answers.next() {
                    Some(a) => a,
                    None => return seen,
                }
            };
            let answer = serde_json::to_vec(&json!({"id": req["id"], "result": result})).unwrap();
            s.write_all(&(answer.len() as u32).to_be_bytes()).unwrap();
            s.write_all(&answer).unwrap();
        }
    });
    (path, t)
}

/// `iteron approvals show ID` puts the whole arguments together from as many answers as they
/// take, checks them against the audited digest, and prints them complete, unredacted, with
/// everything a terminal would act on escaped; a digest that does not match is an error.
#[test]
fn approvals_show_prints_the_whole_arguments_checked_against_their_digest() {
    let area = Area::new("show", "legacy");
    let arguments = json!({
        "path": "/home/op/.ssh/id_ed25519",
        "token": "ghp_0123456789abcdefghijklmnopqrstuvwxyz",
        "trick": "a\u{202e}b\u{85}c\u{7f}d\u{1b}[2J",
        "pad": "y".repeat(5000),
    });
    let full = String::from_utf8(iteron_broker::audit::canonical_json(&arguments)).unwrap();
    let digest = iteron_broker::audit::sha256_hex(full.as_bytes());
    let part = |offset: usize, end: usize, next: Option<usize>| {
        json!({
            "id": 7, "kind": "call", "age_secs": 1, "session": "s1-abc", "peer_uid": 1000,
            "peer_pid": 4242, "server": "files", "tool": "write", "args_sha256": digest,
            "arguments_bytes": full.len(), "offset": offset,
            "arguments": &full[offset..end], "next_offset": next,
        })
    };
    let (sock, seen) = fake_operator(
        &area,
        vec![part(0, 2000, Some(2000)), part(2000, full.len(), None)],
    );
    let out = area.run(&[
        "approvals",
        "show",
        "7",
        "--operator-socket",
        sock.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert_eq!(
        seen.join().unwrap(),
        vec![
            json!({"id": 7, "offset": 0}),
            json!({"id": 7, "offset": 2000})
        ]
    );
    for want in [
        "[7] call files/write",
        "from uid 1000 pid 4242 (session s1-abc)",
        &format!("args_sha256 {digest} (checked"),
        &format!("{} bytes of canonical JSON", full.len()),
        "\"path\": \"/home/op/.ssh/id_ed25519\"",
        // Not redacted: what is approved is what is shown.
        "ghp_0123456789abcdefghijklmnopqrstuvwxyz",
        r#""trick": "a\u202eb\u0085c\u007fd\u001b[2J""#,
        &"y".repeat(5000),
    ] {
        assert!(shown.contains(want), "{want} missing from {shown}");
    }
    assert_eq!(raw_hostile(&shown), None);
    assert!(!shown.contains('\u{1b}'));
    // The JSON lines are the arguments, whole.
    let body: String = shown.lines().skip(4).collect::<Vec<_>>().join("\n");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), arguments);
    std::fs::remove_file(&sock).unwrap();

    // Arguments that are not what was audited are refused, not shown.
    let mut forged = part(0, full.len(), None);
    forged["arguments"] = json!(full.replace("id_ed25519", "id_rsa_xxx"));
    let (sock, seen) = fake_operator(&area, vec![forged]);
    let out = area.run(&[
        "approvals",
        "show",
        "7",
        "--operator-socket",
        sock.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(8), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("do not match their audited SHA-256"));
    assert!(!text(&out.stdout).contains("id_rsa_xxx"));
    seen.join().unwrap();
    std::fs::remove_file(&sock).unwrap();

    // An answer that does not continue where the last one ended is refused.
    let (sock, seen) = fake_operator(
        &area,
        vec![part(0, 2000, Some(2000)), part(2100, full.len(), None)],
    );
    let out = area.run(&[
        "approvals",
        "show",
        "7",
        "--operator-socket",
        sock.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(11), "{}", text(&out.stderr));
    seen.join().unwrap();
    iteron_test_support::record!("P14", json!({"arguments_bytes": full.len(), "answers": 2}),);
}

/// The same against the real broker (its operator socket answers `show`).
#[test]
fn approvals_show_prints_what_the_broker_holds_whole() {
    let area = Area::new("show-live", "legacy");
    let _broker = area.broker();
    // Over two `show` answers, and too big for one argv string: sent over the socket.
    let arguments = json!({"text": "\u{202e}".repeat(600), "path": "/home/op/.ssh/id_ed25519", "big": "z".repeat(600_000)});
    let sock = area.agent_socket();
    let sent = arguments.clone();
    let call = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut c = iteron_broker::ipc::client::Connection::connect(&sock)
                .await
                .unwrap();
            c.hello("test").await.unwrap();
            c.request(
                "call_tool",
                json!({"server": "s", "tool": "echo", "arguments": sent}),
            )
            .await
        })
    });
    let p = area.wait_pending(1);
    let id = p[0]["id"].as_u64().unwrap().to_string();
    let out = area.run(&["approvals", "show", &id]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(
        shown.contains("\"path\": \"/home/op/.ssh/id_ed25519\""),
        "{shown}"
    );
    assert!(shown.contains(&"\\u202e".repeat(600)));
    assert!(shown.contains(&"z".repeat(600_000)));
    assert!(shown.contains(p[0]["args_sha256"].as_str().unwrap()));
    let body: String = shown.lines().skip(4).collect::<Vec<_>>().join("\n");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), arguments);
    let json_out = area.run(&["approvals", "show", &id, "--format", "json"]);
    let v: Value = serde_json::from_slice(&json_out.stdout).unwrap();
    assert_eq!(v["arguments"], arguments);
    assert_eq!(v["server"], "s");
    assert!(area.run(&["approvals", "deny", &id]).status.success());
    assert!(call.join().unwrap().is_err());
    assert_eq!(
        area.run(&["approvals", "show", &id]).status.code(),
        Some(4),
        "a decided call is not found"
    );
    iteron_test_support::record!("P14", serde_json::json!({"argument_bytes": 600_000}),);
}

/// Everything the terminal sends to the master side of a pseudo-terminal, collected.
struct Screen {
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Screen {
    fn new(master: std::fs::File) -> Screen {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = Arc::clone(&seen);
        std::thread::spawn(move || {
            let mut master = master;
            let mut buf = [0u8; 4096];
            // Ends with EIO once every slave descriptor is closed.
            while let Ok(n) = master.read(&mut buf) {
                if n == 0 {
                    break;
                }
                s2.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Screen { seen }
    }

    fn text(&self) -> String {
        text(&self.seen.lock().unwrap())
    }

    /// Wait until `needle` has appeared `n` times.
    fn wait_for(&self, needle: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.text().matches(needle).count() < n {
            assert!(
                Instant::now() < deadline,
                "{needle} not shown {n} times: {}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// 17.5: `watch` on a pseudo-terminal. A "y" typed while nothing was waiting does not approve
/// the call that appears next; the answer typed after its prompt decides it. Input that is not
/// a terminal is refused.
#[test]
fn watch_discards_type_ahead_and_takes_answers_only_after_the_prompt() {
    let area = Area::new("watch", "legacy");
    let _broker = area.broker();
    let out = area.run(&["approvals", "watch"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("stdin is not one"),
        "{}",
        text(&out.stderr)
    );

    let pty = nix::pty::openpty(
        None::<&nix::pty::Winsize>,
        None::<&nix::sys::termios::Termios>,
    )
    .unwrap();
    let slave = std::fs::File::from(pty.slave);
    let mut watch = area
        .iteron(&["approvals", "watch"])
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave))
        .spawn()
        .unwrap();
    let master = std::fs::File::from(pty.master);
    let mut keys = master.try_clone().unwrap();
    let screen = Screen::new(master);
    screen.wait_for("waiting for calls and forms", 1);

    // Typed ahead, before anything is waiting.
    keys.write_all(b"y\n").unwrap();
    let call = area.call(&json!({"text": "typed ahead"}), "text");
    screen.wait_for("approve? [y/N] ", 1);
    // Had the type-ahead been taken, the call would have been approved at once.
    std::thread::sleep(Duration::from_millis(1500));
    let p = area.pending();
    assert_eq!(p.len(), 1, "{}", screen.text());
    assert!(!screen.text().contains("sent"), "{}", screen.text());
    // An answer typed after the prompt decides it.
    keys.write_all(b"n\n").unwrap();
    let out = wait_child(call);
    assert_eq!(out.status.code(), Some(9), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("denied"),
        "{}",
        text(&out.stderr)
    );
    screen.wait_for("sent", 1);

    // Several lines typed ahead are all dropped; the one after the prompt approves.
    keys.write_all(b"y\nyes\nY\n").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let call = area.call(&json!({"text": "second"}), "text");
    screen.wait_for("approve? [y/N] ", 2);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(area.pending().len(), 1, "{}", screen.text());
    keys.write_all(b"y\n").unwrap();
    let out = wait_child(call);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "second");
    screen.wait_for("sent", 2);

    let _ = watch.kill();
    let _ = watch.wait();
    iteron_test_support::record!("P14", json!({"type_ahead_lines_dropped": 4}),);
}

/// `iteron approvals watch` on a fresh pseudo-terminal: the child, what it shows, and the keys.
fn watch_on_pty(area: &Area) -> (Child, Screen, std::fs::File) {
    let pty = nix::pty::openpty(
        None::<&nix::pty::Winsize>,
        None::<&nix::sys::termios::Termios>,
    )
    .unwrap();
    let slave = std::fs::File::from(pty.slave);
    let watch = area
        .iteron(&["approvals", "watch"])
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave))
        .spawn()
        .unwrap();
    let master = std::fs::File::from(pty.master);
    let keys = master.try_clone().unwrap();
    (watch, Screen::new(master), keys)
}

/// Wait (at most `within`) for a child to exit; its exit code.
fn exits_within(c: &mut Child, within: Duration) -> Option<i32> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = c.try_wait().unwrap() {
            return s.code();
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            panic!("still running {within:?} after the end of input");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 14.13: `watch` ends promptly at the end of input (Ctrl-D on an empty line) whether or
/// not anything is being asked, and decides nothing on the way out: the call it was asking
/// about stays waiting, whole, and is named.
#[test]
fn watch_ends_promptly_at_end_of_input_and_leaves_nothing_half_decided() {
    const EOT: &[u8] = b"\x04";
    let area = Area::new("watch-eof", "legacy");
    let _broker = area.broker();

    // Nothing waits: the end of input is noticed without an item to ask about.
    let (mut watch, screen, mut keys) = watch_on_pty(&area);
    screen.wait_for("waiting for calls and forms", 1);
    let asked = Instant::now();
    keys.write_all(EOT).unwrap();
    assert_eq!(exits_within(&mut watch, Duration::from_secs(5)), Some(0));
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(3), "{took:?}");
    screen.wait_for("end of input: stopped; nothing was left half-decided", 1);

    // At a prompt: nothing is sent, the call stays waiting and is named.
    let (mut watch, screen, mut keys) = watch_on_pty(&area);
    screen.wait_for("waiting for calls and forms", 1);
    let call = area.call(&json!({"text": "left waiting"}), "text");
    screen.wait_for("approve? [y/N] ", 1);
    let id = area.pending()[0]["id"].as_u64().unwrap();
    keys.write_all(EOT).unwrap();
    assert_eq!(exits_within(&mut watch, Duration::from_secs(5)), Some(0));
    screen.wait_for(&format!("left waiting, undecided: {id}"), 1);
    assert!(!screen.text().contains("sent"), "{}", screen.text());
    let p = area.pending();
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0]["id"].as_u64(), Some(id));
    assert!(
        area.run(&["approvals", "deny", &id.to_string()])
            .status
            .success()
    );
    assert_eq!(wait_child(call).status.code(), Some(9));
}

/// Issue 14.5: `watch` holds a form answer to the whole form, as `approvals answer` does: an
/// answer that breaks one of its constraints is not sent, the field is named, and the same
/// form is asked again; the fitting answer typed then reaches the server.
#[test]
fn watch_names_the_field_of_a_refused_form_answer_and_asks_again() {
    const FORM_PROMPT: &str = "answer with a JSON object, or an empty line to decline: ";
    let area = Area::new("watch-form", "legacy");
    area.everything();
    let _broker = area.broker();
    let (mut watch, screen, mut keys) = watch_on_pty(&area);
    screen.wait_for("waiting for calls and forms", 1);
    let sock = area.agent_socket();
    let call = Command::new(iteron())
        .args(["agent", "--socket", sock.to_str().unwrap()])
        .args(["call", "ev", "trigger-elicitation-request"])
        .env_remove("ITERON_HOME")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Each answer is typed a moment after its prompt is on the screen: what arrives before
    // `watch` has discarded the type-ahead would be dropped.
    let settle = || std::thread::sleep(Duration::from_millis(300));
    screen.wait_for("approve? [y/N] ", 1);
    settle();
    keys.write_all(b"y\n").unwrap();
    screen.wait_for(FORM_PROMPT, 1);
    let form = area.pending();
    assert_eq!(form.len(), 1, "{form:?}");
    assert_eq!(form[0]["kind"], "form");
    assert_eq!(form[0]["schema"]["properties"]["integer"]["maximum"], 100);
    let id = form[0]["id"].as_u64().unwrap();

    // 500 is above the field's maximum: refused, named, asked again.
    settle();
    keys.write_all(b"{\"name\": \"Op Erator\", \"integer\": 500}\n")
        .unwrap();
    screen.wait_for("field integer: above the maximum 100", 1);
    screen.wait_for(FORM_PROMPT, 2);
    let shown = screen.text();
    let refusal = shown
        .lines()
        .find(|l| l.contains("field integer"))
        .unwrap_or_default();
    assert!(refusal.starts_with("not sent: "), "{shown}");
    assert!(refusal.contains("does not fit the form"), "{shown}");
    let still = area.pending();
    assert_eq!(still.len(), 1, "the form keeps waiting: {still:?}");
    assert_eq!(still[0]["id"].as_u64(), Some(id));

    // The fitting answer is sent and reaches the server.
    settle();
    keys.write_all(b"{\"name\": \"Op Erator\", \"integer\": 7}\n")
        .unwrap();
    let out = wait_child(call);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let result = text(&out.stdout);
    assert!(result.contains("Name: Op Erator"), "{result}");
    assert!(result.contains("Favorite Integer: 7"), "{result}");
    assert!(!result.contains("500"), "{result}");
    // "sent" for the call, "not sent" for the refused answer, "sent" for the fitting one.
    screen.wait_for("sent", 3);
    assert_eq!(screen.text().matches(FORM_PROMPT).count(), 2);
    assert!(area.pending().is_empty());
    let _ = watch.kill();
    let _ = watch.wait();
}

/// 17.10: a server's bidi controls, C1 controls and DEL reach `--format json` outputs only as
/// `\u` escapes (they parse back to the very characters), whether they came in a tool's
/// description, its schema, a name the broker dropped, or a call's result.
#[test]
fn json_outputs_carry_bidi_c1_and_del_only_as_escapes() {
    let area = Area::new("json", "hostile-text");
    let _broker = area.broker();
    let sock = area.agent_socket();
    let out = Command::new(iteron())
        .args([
            "agent",
            "--socket",
            sock.to_str().unwrap(),
            "tools",
            "--format",
            "json",
        ])
        .env_remove("ITERON_HOME")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert_eq!(raw_hostile(&shown), None, "{shown}");
    assert!(
        shown.contains(r#""description": "the \u202etext\u0085\u009b\u007f""#),
        "{shown}"
    );
    let v: Value = serde_json::from_str(&shown).unwrap();
    let tools = v["tools"].as_array().unwrap();
    assert_eq!(
        tools.len(),
        1,
        "the tool with a bidi control in its name is dropped"
    );
    assert_eq!(
        tools[0]["input_schema"]["properties"]["text"]["description"],
        "the \u{202e}text\u{85}\u{9b}\u{7f}"
    );

    // The operator's own probe of the server (catalog, dropped names).
    let out = area.run(&["mcp", "test", "s", "--format", "json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        raw_hostile(&text(&out.stdout)),
        None,
        "{}",
        text(&out.stdout)
    );

    // A result that carries them, and the approval list while the call waits.
    let call = area.call(&json!({"text": "r\u{202e}esult\u{85}\u{9f}\u{7f}"}), "json");
    let p = area.wait_pending(1);
    let listed = area.run(&["approvals", "list", "--format", "json"]);
    assert_eq!(raw_hostile(&text(&listed.stdout)), None);
    let id = p[0]["id"].as_u64().unwrap().to_string();
    assert!(area.run(&["approvals", "approve", &id]).status.success());
    let out = wait_child(call);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert_eq!(raw_hostile(&shown), None, "{shown}");
    assert!(
        shown.contains(r#"r\u202eesult\u0085\u009f\u007f"#),
        "{shown}"
    );
    let v: Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(v["text"], "r\u{202e}esult\u{85}\u{9f}\u{7f}");
    iteron_test_support::record!(
        "P8",
        json!({"outputs": ["agent tools", "mcp test", "approvals list", "agent call"]}),
    );
}
