//! `iteron completions SHELL` and `iteron man [COMMAND…]`: generated from the clap definitions
//! in [`crate::args`], so they can never disagree with what the parser accepts.

use std::io::Write;

use clap::CommandFactory;

use crate::args::Cli;
use crate::error::CliError;

/// Print the completion script of `shell` for the whole command tree.
pub(crate) fn completions(
    shell: clap_complete::Shell,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut cmd = Cli::command();
    let mut buf = Vec::new();
    clap_complete::generate(shell, &mut cmd, "iteron", &mut buf);
    out.write_all(&buf).map_err(CliError::Output)
}

/// Print the man page of `iteron`, or of the command `path` names (`["mcp", "add"]` is the page
/// `iteron-mcp-add(1)`). An unknown command is a usage error that does not repeat the name.
pub(crate) fn man(path: &[String], out: &mut dyn Write) -> Result<(), CliError> {
    let mut cmd = Cli::command();
    cmd.build();
    let mut name = "iteron".to_owned();
    for part in path {
        let Some(sub) = cmd.find_subcommand(part).cloned() else {
            return Err(CliError::Usage(
                "man: no such command (see: iteron --help)".into(),
            ));
        };
        name = format!("{name}-{}", sub.get_name());
        cmd = sub;
    }
    let mut buf = Vec::new();
    clap_mangen::Man::new(cmd)
        .title(name)
        .render(&mut buf)
        .map_err(CliError::Output)?;
    out.write_all(&buf).map_err(CliError::Output)
}
