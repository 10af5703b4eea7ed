//! The CLI's `--format json` output: the agent crate's writer ([`iteron_agent::output`]), one
//! for every command, with the CLI's error type.

use std::io::Write;

use serde_json::Value;

use crate::error::CliError;

/// Print `v` as indented, terminal-safe JSON carrying `schema_version`.
pub(crate) fn json(out: &mut dyn Write, v: &Value) -> Result<(), CliError> {
    iteron_agent::output::json(out, v).map_err(CliError::Output)
}
