//! `iteron-agent`: the agent's commands alone, in a program with no credential code.
#![forbid(unsafe_code)]

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use clap::error::ErrorKind;
use iteron_agent::args::AgentArgs;
use iteron_agent::{AgentError, Exit};
use iteron_policy::text;

/// The agent's side of Iteron: ask a broker for effects through its agent socket (needs only
/// the socket path; the same commands as `iteron agent`).
#[derive(Debug, Parser)]
#[command(name = "iteron-agent", version, disable_help_subcommand = true)]
struct Cli {
    #[command(flatten)]
    args: AgentArgs,
}

const PROGRAM: &str = "iteron-agent";

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            let _ = e.print();
            return Exit::Ok.into();
        }
        Err(e) => {
            let line = text::single_line(&format!(
                "{PROGRAM}: error: {} (see: {PROGRAM} --help)",
                iteron_agent::describe_parse_error(&e)
            ));
            let _ = writeln!(std::io::stderr(), "{line}");
            return Exit::Usage.into();
        }
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let result = iteron_agent::run(cli.args, &mut out)
        .and_then(|()| out.flush().map_err(AgentError::Output));
    match result {
        Ok(()) => Exit::Ok.into(),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "{}", e.line(PROGRAM));
            e.exit().into()
        }
    }
}
