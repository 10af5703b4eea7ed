//! The `iteron` command.
#![forbid(unsafe_code)]

mod approvals;
mod args;
mod auth;
mod broker;
mod demo;
mod error;
mod import;
mod mcp;
mod output;
mod probe;
mod reference;
mod rt;
mod rules;
mod views;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use clap::error::ErrorKind;
use iteron_broker::store::Home;
use iteron_policy::text;

use crate::args::{Cli, Top};
use crate::error::{CliError, Exit};

/// How long the command waits, before exiting, for its children to be reaped.
const SETTLE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_exit(&e),
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut warn = std::io::stderr();
    let result = match cli.command {
        Top::Mcp(cmd) => Home::from_env(|k| std::env::var_os(k))
            .map_err(CliError::from)
            .and_then(|home| mcp::run(cmd, &home, &mut out, &mut warn)),
        Top::Demo => demo::run(&mut out),
        Top::Broker(cmd) => broker::run_broker(cmd, &mut out),
        Top::Approvals(args) => approvals::run_approvals(args, &mut out),
        Top::Agent(args) => iteron_agent::run(args, &mut out).map_err(CliError::from),
        Top::Audit(cmd) => views::run_audit(cmd, &mut out),
        Top::Skills(args) => views::run_skills(args, &mut out),
        Top::Agents(args) => views::run_agents(args, &mut out),
        Top::Completions(a) => reference::completions(a.shell, &mut out),
        Top::Man(a) => reference::man(&a.command, &mut out),
    };
    // Children the command started and dropped are killed in the background; wait for that,
    // so no descendant of theirs is left behind to init when this process exits.
    iteron_broker::spawn::settle(SETTLE_DEADLINE);
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

/// Help and version go to stdout with exit 0; any other parse error becomes one line on stderr
/// with exit 2. The line is built from the error's kind and the *names* of our own arguments —
/// never from the text the operator typed (clap's own rendering quotes refused values, and a
/// refused value is often a pasted secret).
fn clap_exit(e: &clap::Error) -> ExitCode {
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return Exit::Ok.into();
    }
    let line = text::single_line(&format!(
        "iteron: error: {} (see: iteron --help)",
        iteron_agent::describe_parse_error(e)
    ));
    let _ = writeln!(std::io::stderr(), "{line}");
    Exit::Usage.into()
}
