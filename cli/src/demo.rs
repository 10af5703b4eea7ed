//! `iteron demo`: the whole story, run for real, in a throwaway home under the system temp
//! directory. Part 1 is the configuration flow through the same command code; part 2 starts
//! the real `iteron broker serve` (this binary) with a fixture stdio server (built into the
//! binary and written into the throwaway directory, so an installed binary runs it too),
//! talks to it as the agent with `iteron agent` (as uid 65534 when the demo runs as root, so the agent really is
//! another user), shows an unexposed tool, a refusal by a noninteractive broker, an operator
//! approval, and `iteron audit verify`. It never reads or writes `~/.iteron` and removes its
//! home when done.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use iteron_broker::ipc::proto::{OperatorRequest, PendingArg};
use iteron_broker::store::Home;

use crate::args::{Cli, Top};
use crate::error::CliError;
use crate::mcp;

/// The fixture server the demo registers (a small stdio MCP server), built into the binary so
/// that an installed `iteron` needs no source tree.
const FIXTURE_SERVER: &str = include_str!("../../fixtures/stdio/demo_server.py");

/// Write the fixture server into the throwaway directory (`fixture/demo_server.py`, readable by
/// every uid: under a root demo the server runs as `nobody`) and return its path.
fn fixture_server(dir: &Path) -> Result<PathBuf, CliError> {
    let fixture = dir.join("fixture");
    fs::DirBuilder::new()
        .mode(0o755)
        .create(&fixture)
        .map_err(CliError::Output)?;
    fs::set_permissions(&fixture, fs::Permissions::from_mode(0o755)).map_err(CliError::Output)?;
    let path = fixture.join("demo_server.py");
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&path)
        .map_err(CliError::Output)?;
    file.write_all(FIXTURE_SERVER.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(CliError::Output)?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).map_err(CliError::Output)?;
    Ok(path)
}

fn throwaway_home() -> Result<PathBuf, CliError> {
    let base = std::env::temp_dir();
    for attempt in 0..16u32 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = base.join(format!(
            "iteron-demo-{}-{nanos:x}-{attempt}",
            std::process::id()
        ));
        // 0711: another uid (the demo's agent) may traverse to the agent socket below, but
        // cannot list the directory; the home inside it is 0700.
        match fs::DirBuilder::new().mode(0o711).create(&dir) {
            Ok(()) => {
                fs::set_permissions(&dir, fs::Permissions::from_mode(0o711))
                    .map_err(CliError::Output)?;
                return Ok(dir);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(CliError::Output(e)),
        }
    }
    Err(CliError::Output(std::io::Error::other(
        "could not create a demo directory",
    )))
}

/// One step: echo the command line, run it through the real parser and command code, show the
/// result (including a refusal, which is part of the story).
fn step(home: &Home, out: &mut dyn Write, argv: &[&str]) -> Result<(), CliError> {
    // The echoed command line goes through the same redaction as every other output line.
    let shown = iteron_policy::text::single_line(&format!("$ iteron {}", argv.join(" ")));
    writeln!(out, "\n{shown}").map_err(CliError::Output)?;
    let cli = Cli::try_parse_from(std::iter::once("iteron").chain(argv.iter().copied()))
        .map_err(|e| CliError::Usage(e.kind().to_string()))?;
    let Top::Mcp(cmd) = cli.command else {
        return Err(CliError::Usage("demo steps are mcp commands".into()));
    };
    let mut warnings = Vec::new();
    let result = mcp::run(cmd, home, out, &mut warnings);
    out.write_all(&warnings).map_err(CliError::Output)?;
    match result {
        Ok(()) => Ok(()),
        Err(e @ CliError::Usage(_)) => {
            writeln!(out, "{}   [exit {}]", e.line(), e.exit() as u8).map_err(CliError::Output)
        }
        Err(e) => Err(e),
    }
}

pub(crate) fn run(out: &mut dyn Write) -> Result<(), CliError> {
    let dir = throwaway_home()?;
    let result = walk(&dir, out);
    let cleaned = fs::remove_dir_all(&dir);
    result?;
    cleaned.map_err(CliError::Output)?;
    writeln!(
        out,
        "\nremoved the demo home {}; ~/.iteron was not touched",
        dir.display()
    )
    .map_err(CliError::Output)
}

fn walk(dir: &std::path::Path, out: &mut dyn Write) -> Result<(), CliError> {
    let home = Home::at(dir.join("home"))?;
    writeln!(
        out,
        "Iteron demo: the configuration flow in a throwaway ITERON_HOME={}",
        home.dir().display()
    )
    .map_err(CliError::Output)?;
    let fixture = fixture_server(dir)?;
    let fixture = fixture.to_string_lossy();
    let steps: &[&[&str]] = &[
        &[
            "mcp",
            "add",
            "demo-echo",
            "--stdio",
            "/usr/bin/python3",
            "--env",
            "DEMO_API_TOKEN",
            "--",
            &fixture,
        ],
        &[
            "mcp",
            "add",
            "demo-remote",
            "--url",
            "https://mcp.example.com/mcp",
            "--oauth-scopes",
            "read,write",
        ],
        &["mcp", "list"],
        &["mcp", "get", "demo-echo"],
        &["mcp", "get", "demo-echo", "--format", "json"],
        // Refused: a value where only a variable name belongs. The value is not echoed.
        &[
            "mcp",
            "add",
            "leaky",
            "--stdio",
            "/usr/bin/python3",
            "--env",
            "DEMO_API_TOKEN=sk-demo-not-a-real-token-000000",
        ],
        // Refused: plain http to a host that is not loopback.
        &["mcp", "add", "plain", "--url", "http://mcp.example.com/mcp"],
        &["mcp", "remove", "demo-remote"],
        &["mcp", "list", "--format", "json"],
    ];
    for argv in steps {
        step(&home, out, argv)?;
    }
    broker_story(dir, &home, out)
}

const NOBODY: u32 = 65534;
/// What the demo's broker passes to the fixture as `DEMO_API_TOKEN` (a made-up value: the
/// story shows that it never reaches the agent).
const DEMO_TOKEN: &str = "sk-demo-forwarded-token-never-shown-1f2e";

fn say(out: &mut dyn Write, line: &str) -> Result<(), CliError> {
    writeln!(out, "{line}").map_err(CliError::Output)
}

/// Run this binary with `args`, show the command line and its output (one line each, made
/// terminal-safe), and return the exit code. `agent` runs it as the agent: no ITERON_HOME, and
/// as uid 65534 when the demo runs as root.
fn shown_run(
    home: &Home,
    out: &mut dyn Write,
    args: &[&str],
    agent: bool,
) -> Result<Option<i32>, CliError> {
    let exe = std::env::current_exe().map_err(CliError::Output)?;
    let who = if agent && nix::unistd::geteuid().is_root() {
        "(agent, uid 65534) "
    } else if agent {
        "(agent) "
    } else {
        "(operator) "
    };
    say(out, "")?;
    say(
        out,
        &iteron_policy::text::single_line(&format!("{who}$ iteron {}", args.join(" "))),
    )?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .env_remove("ITERON_HOME");
    if agent {
        if nix::unistd::geteuid().is_root() {
            use std::os::unix::process::CommandExt;
            cmd.uid(NOBODY).gid(NOBODY);
        }
    } else {
        cmd.env("ITERON_HOME", home.dir());
    }
    let result = cmd.output().map_err(CliError::Output)?;
    for stream in [&result.stdout, &result.stderr] {
        for line in String::from_utf8_lossy(stream).lines() {
            say(out, &iteron_policy::text::single_line(line))?;
        }
    }
    let code = result.status.code();
    if code != Some(0) {
        say(out, &format!("   [exit {}]", code.unwrap_or(-1)))?;
    }
    Ok(code)
}

struct DemoBroker(std::process::Child);

impl DemoBroker {
    fn start(home: &Home, agent_socket: &Path, interactive: bool) -> Result<DemoBroker, CliError> {
        let exe = std::env::current_exe().map_err(CliError::Output)?;
        let mut args = vec![
            "broker".to_owned(),
            "serve".to_owned(),
            "--socket".to_owned(),
            agent_socket.to_string_lossy().into_owned(),
        ];
        if !interactive {
            args.push("--noninteractive".into());
        }
        if nix::unistd::geteuid().is_root() {
            args.push("--allow-uid".into());
            args.push(NOBODY.to_string());
        }
        let child = std::process::Command::new(exe)
            .args(&args)
            .env("ITERON_HOME", home.dir())
            .env("DEMO_API_TOKEN", DEMO_TOKEN)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(CliError::Output)?;
        let broker = DemoBroker(child);
        let operator = home.dir().join("run").join("operator.sock");
        for _ in 0..500 {
            if std::os::unix::net::UnixStream::connect(agent_socket).is_ok()
                && std::os::unix::net::UnixStream::connect(&operator).is_ok()
            {
                return Ok(broker);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(CliError::Serve("the demo broker did not start".into()))
    }

    fn stop(mut self) -> Result<(), CliError> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).unwrap_or(i32::MAX));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        for _ in 0..1000 {
            if self.0.try_wait().map_err(CliError::Output)?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(CliError::Serve("the demo broker did not stop".into()))
    }
}

impl Drop for DemoBroker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `iteron agent --socket <sock> <args>`, run as the agent and shown.
fn agent_step(
    home: &Home,
    out: &mut dyn Write,
    sock: &str,
    args: &[&str],
) -> Result<Option<i32>, CliError> {
    let mut full = vec!["agent", "--socket", sock];
    full.extend_from_slice(args);
    shown_run(home, out, &full, true)
}

fn broker_story(dir: &Path, home: &Home, out: &mut dyn Write) -> Result<(), CliError> {
    say(out, "\n== Part 2: the broker and an unprivileged agent")?;
    say(
        out,
        "\n(operator) deny the fixture's dangerous tool in config.json: \"tools\": {\"deny\": [\"delete_all\"]}",
    )?;
    home.update(|c| {
        for s in &mut c.mcp_servers {
            if s.name.as_str() == "demo-echo" {
                let deny = iteron_policy::names::ToolName::parse("delete_all")
                    .map_err(|e| CliError::Usage(e.to_string()))?;
                s.tools.deny = vec![deny];
            }
        }
        Ok::<(), CliError>(())
    })?;
    let socket = dir.join("run").join("agent.sock");
    let sock = socket.to_string_lossy().into_owned();

    say(
        out,
        &format!(
            "\n(operator) $ iteron broker serve --noninteractive --socket {sock}{}",
            if nix::unistd::geteuid().is_root() {
                " --allow-uid 65534"
            } else {
                ""
            }
        ),
    )?;
    let broker = DemoBroker::start(home, &socket, false)?;
    shown_run(home, out, &["broker", "status"], false)?;
    agent_step(home, out, &sock, &["tools"])?;
    // Unexposed: answered exactly like a tool that does not exist.
    agent_step(home, out, &sock, &["call", "demo-echo", "delete_all"])?;
    agent_step(home, out, &sock, &["call", "demo-echo", "no_such_tool"])?;
    // Every MCP tool call needs approval; a noninteractive broker refuses.
    agent_step(
        home,
        out,
        &sock,
        &["call", "demo-echo", "echo", "--json", r#"{"text":"hello"}"#],
    )?;
    broker.stop()?;

    say(
        out,
        &format!("\n(operator) $ iteron broker serve --socket {sock} (interactive)"),
    )?;
    let broker = DemoBroker::start(home, &socket, true)?;
    let exe = std::env::current_exe().map_err(CliError::Output)?;
    let mut agent = std::process::Command::new(exe);
    agent
        .args([
            "agent",
            "--socket",
            &sock,
            "call",
            "demo-echo",
            "echo",
            "--json",
            r#"{"text":"hello, approved"}"#,
        ])
        .env_remove("ITERON_HOME")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if nix::unistd::geteuid().is_root() {
        use std::os::unix::process::CommandExt;
        agent.uid(NOBODY).gid(NOBODY);
    }
    say(
        out,
        &format!(
            "\n{} $ iteron agent --socket {sock} call demo-echo echo --json '{{\"text\":\"hello, approved\"}}'   (waits for the operator)",
            if nix::unistd::geteuid().is_root() {
                "(agent, uid 65534)"
            } else {
                "(agent)"
            }
        ),
    )?;
    let child = agent.spawn().map_err(CliError::Output)?;
    let pending = wait_for_pending(home)?;
    shown_run(home, out, &["approvals", "list"], false)?;
    shown_run(
        home,
        out,
        &["approvals", "approve", &pending.to_string()],
        false,
    )?;
    let answer = child.wait_with_output().map_err(CliError::Output)?;
    say(out, "\n(agent) the call returns:")?;
    for stream in [&answer.stdout, &answer.stderr] {
        for line in String::from_utf8_lossy(stream).lines() {
            say(out, &iteron_policy::text::single_line(line))?;
        }
    }
    shown_run(home, out, &["broker", "status"], false)?;
    broker.stop()?;
    let verified = shown_run(home, out, &["audit", "verify"], false)?;
    if verified != Some(0) {
        return Err(CliError::Serve(
            "the demo's audit log did not verify".into(),
        ));
    }
    if answer.status.code() != Some(0) {
        return Err(CliError::Serve("the approved call did not succeed".into()));
    }
    Ok(())
}

fn wait_for_pending(home: &Home) -> Result<u64, CliError> {
    let socket = home.dir().join("run").join("operator.sock");
    let rt = crate::rt::current_thread()?;
    rt.block_on(async {
        let mut c = iteron_broker::ipc::client::Connection::connect_as(
            &socket,
            nix::unistd::geteuid().as_raw(),
        )
        .await
        .map_err(CliError::Broker)?;
        c.hello("iteron-demo").await.map_err(CliError::Broker)?;
        for _ in 0..1500 {
            let v = c
                .send(OperatorRequest::Pending(PendingArg::default()))
                .await
                .map_err(CliError::Broker)?;
            if let Some(id) = v["pending"][0]["id"].as_u64() {
                return Ok(id);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(CliError::Serve(
            "the agent's call never reached the operator".into(),
        ))
    })
}
