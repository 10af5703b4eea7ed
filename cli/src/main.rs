//! The `iteron` command.
#![forbid(unsafe_code)]

mod args;
mod demo;
mod error;
mod mcp;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use clap::error::ErrorKind;
use iteron_broker::store::Home;
use iteron_policy::text;

use crate::args::{Cli, Top};
use crate::error::{CliError, Exit};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_exit(&e),
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let result = match cli.command {
        Top::Mcp(cmd) => Home::from_env(|k| std::env::var_os(k))
            .map_err(CliError::from)
            .and_then(|home| mcp::run(cmd, &home, &mut out)),
        Top::Demo => demo::run(&mut out),
    };
    let flushed = out.flush();
    match result {
        Ok(()) if flushed.is_ok() => Exit::Ok.into(),
        Ok(()) => fail(&CliError::Output(
            flushed
                .err()
                .unwrap_or_else(|| std::io::Error::other("flush failed")),
        )),
        Err(e) => fail(&e),
    }
}

fn fail(e: &CliError) -> ExitCode {
    let _ = writeln!(std::io::stderr(), "{}", e.line());
    e.exit().into()
}

/// Help and version go to stdout with exit 0; any other parse error becomes one redacted line on
/// stderr with exit 2 (clap's own rendering spans several lines and may quote the bad value).
fn clap_exit(e: &clap::Error) -> ExitCode {
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return Exit::Ok.into();
    }
    let rendered = e.render().to_string();
    let first = rendered
        .lines()
        .next()
        .unwrap_or("invalid command line")
        .trim_start_matches("error: ");
    let line = text::single_line(&format!("iteron: error: {first} (see: iteron --help)"));
    let _ = writeln!(std::io::stderr(), "{line}");
    Exit::Usage.into()
}
