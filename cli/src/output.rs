//! The one writer of the CLI's `--format json` output.
//!
//! What the CLI prints as JSON carries text from elsewhere (servers' tool names and results,
//! agents' arguments, forms): `serde_json` leaves bidirectional controls, C1 controls and DEL
//! raw, and a terminal acts on them. Every JSON output goes through [`json`], which writes those
//! characters — everything the text views escape — as `\uXXXX`: the same JSON value, visible.

use std::io::Write;

use iteron_policy::text;
use serde_json::Value;

use crate::error::CliError;

/// Print `v` as indented, terminal-safe JSON and a line feed.
pub(crate) fn json(out: &mut dyn Write, v: &Value) -> Result<(), CliError> {
    writeln!(out, "{}", text::terminal_safe_json(v, true)).map_err(CliError::Output)
}
