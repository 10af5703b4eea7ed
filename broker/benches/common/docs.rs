//! Writing a benchmark's table into docs/benchmarks.md, between its markers. Shared by the
//! benchmarks of both crates (included with `#[path]`).

use std::path::PathBuf;

/// Replace what stands between `start` and `end` in docs/benchmarks.md with `table`.
pub(crate) fn write_table(start: &str, end: &str, table: &str) {
    // Both crates sit one level below the workspace root.
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/benchmarks.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let (head, rest) = doc.split_once(start).expect("start marker");
    let (_, tail) = rest.split_once(end).expect("end marker");
    std::fs::write(&path, format!("{head}{start}\n{table}\n{end}{tail}")).unwrap();
    println!("wrote {}", path.display());
}
