//! SECURITY.md names, for each promise, the tests that prove it. This test fails when a named
//! test no longer exists, so the document cannot keep claiming a proof that was deleted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

#[test]
fn every_test_named_in_security_md_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("SECURITY.md")).unwrap();
    let mut checked = 0;
    for (i, piece) in doc.split('`').enumerate() {
        // Odd pieces are inside backticks.
        if i % 2 == 0 || !piece.contains(".rs::") {
            continue;
        }
        let (file, name) = piece.rsplit_once("::").unwrap();
        let source = std::fs::read_to_string(root.join(file))
            .unwrap_or_else(|e| panic!("SECURITY.md names {file}, which cannot be read: {e}"));
        assert!(
            source.contains(&format!("fn {name}(")),
            "SECURITY.md names {file}::{name}, which does not exist"
        );
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} test references found");
}
