//! `iteron demo`: the configuration flow, run for real through the same command code, in a
//! throwaway home under the system temp directory. It never reads or writes `~/.iteron` and
//! removes its home when done.

use std::fs;
use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;

use clap::Parser;
use iteron_broker::store::Home;

use crate::args::{Cli, Top};
use crate::error::CliError;
use crate::mcp;

/// The fixture server registered by the demo (a small stdio MCP server kept in the repository).
fn fixture_server() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("fixtures")
        .join("stdio")
        .join("echo_server.py");
    fs::canonicalize(&path).unwrap_or(path)
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
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
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
    let fixture = fixture_server();
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
        &["mcp", "remove", "demo-echo"],
        &["mcp", "list", "--format", "json"],
    ];
    for argv in steps {
        step(&home, out, argv)?;
    }
    Ok(())
}
