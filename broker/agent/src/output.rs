//! The one writer of `--format json` output, for the agent's commands and every other
//! `iteron` command.
//!
//! What is printed as JSON carries text from elsewhere (servers' tool names and results,
//! agents' arguments, forms): `serde_json` leaves bidirectional controls, C1 controls and DEL
//! raw, and a terminal acts on them. Every JSON output goes through [`json`], which writes those
//! characters — everything the text views escape — as `\uXXXX`: the same JSON value, visible.

use std::io::Write;

use iteron_policy::text;
use serde_json::Value;

/// The version of the shapes of every `--format json` output (docs/cli.md, "JSON outputs"):
/// each top-level object carries it as `schema_version`. It equals the configuration's schema
/// version today (`mcp list` prints configuration entries) and moves with any breaking change.
pub const SCHEMA_VERSION: u64 = 2;

/// Print `v` as indented, terminal-safe JSON and a line feed; a top-level object gets
/// `schema_version` first when it does not carry one.
pub fn json(out: &mut dyn Write, v: &Value) -> std::io::Result<()> {
    let shown = match v {
        Value::Object(m) if !m.contains_key("schema_version") => {
            let mut with = serde_json::Map::with_capacity(m.len() + 1);
            with.insert("schema_version".into(), Value::from(SCHEMA_VERSION));
            with.extend(m.iter().map(|(k, x)| (k.clone(), x.clone())));
            Value::Object(with)
        }
        other => other.clone(),
    };
    writeln!(out, "{}", text::terminal_safe_json(&shown, true))
}
