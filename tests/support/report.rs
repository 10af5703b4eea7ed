//! The security report: a test that proves a promise of SECURITY.md appends one JSON line
//! (`{"promise", "test", "evidence"}`) to the report once its assertions have passed, so a line
//! in the report means "this ran and held". `./scripts/test` clears the report before the run
//! and `scripts/check-security-report` checks SECURITY.md's promise table against it after.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;

/// Where the report goes: `$ITERON_SECURITY_REPORT`, else `target/iteron-security-report.jsonl`
/// of the workspace.
pub(crate) fn report_path() -> PathBuf {
    if let Some(p) = std::env::var_os("ITERON_SECURITY_REPORT") {
        return PathBuf::from(p);
    }
    // The workspace root is the nearest directory above the crate that holds Cargo.lock.
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let root = manifest
        .ancestors()
        .find(|d| d.join("Cargo.lock").exists())
        .unwrap_or(&manifest)
        .to_path_buf();
    root.join("target").join("iteron-security-report.jsonl")
}

/// Record that `test` proved `promise`, with what it measured.
pub(crate) fn record(promise: &str, test: &str, evidence: serde_json::Value) {
    let line = serde_json::json!({"promise": promise, "test": test, "evidence": evidence});
    let path = report_path();
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    // One write per line with O_APPEND: lines from concurrent test binaries stay whole.
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(format!("{line}\n").as_bytes()).unwrap();
}
