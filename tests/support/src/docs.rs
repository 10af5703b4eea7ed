//! The documented JSON shapes of the CLI (`docs/cli.md`, section "JSON outputs"), for tests that
//! hold a command's real output against them.

use std::collections::BTreeSet;

use serde_json::Value;

/// The JSON keys docs/cli.md's table of shapes names for `command` (its row's first cell, e.g.
/// `broker status`): every double-quoted word of that row.
pub fn documented_json_keys(command: &str) -> BTreeSet<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/cli.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let section = doc
        .split("## JSON outputs")
        .nth(1)
        .expect("docs/cli.md has a JSON outputs section");
    let row = section
        .lines()
        .take_while(|l| !l.starts_with("## "))
        .find(|l| l.starts_with(&format!("| `{command}` |")))
        .unwrap_or_else(|| panic!("docs/cli.md shows no JSON shape for {command}"));
    row.split('"')
        .skip(1)
        .step_by(2)
        .filter(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        .map(str::to_owned)
        .collect()
}

/// The keys of `output` (at every depth, as dotted paths; `schema_version` is the table's
/// own) that docs/cli.md does not name for `command`.
pub fn undocumented_json_keys(command: &str, output: &Value) -> Vec<String> {
    fn walk(v: &Value, at: &str, known: &BTreeSet<String>, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                for (k, x) in map {
                    let path = if at.is_empty() {
                        k.clone()
                    } else {
                        format!("{at}.{k}")
                    };
                    let table_own = at.is_empty() && k == "schema_version";
                    if !table_own && !known.contains(k) {
                        out.push(path.clone());
                    }
                    walk(x, &path, known, out);
                }
            }
            Value::Array(items) => {
                for x in items {
                    walk(x, &format!("{at}[]"), known, out);
                }
            }
            _ => {}
        }
    }
    let known = documented_json_keys(command);
    let mut out = Vec::new();
    walk(output, "", &known, &mut out);
    out.sort();
    out.dedup();
    out
}
