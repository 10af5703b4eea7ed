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
        let at = source
            .find(&format!("fn {name}("))
            .unwrap_or_else(|| panic!("SECURITY.md names {file}::{name}, which does not exist"));
        // It must be a test that runs: a #[test] (plain, tokio or inside proptest!) right above.
        let mut start = at.saturating_sub(300);
        while !source.is_char_boundary(start) {
            start -= 1;
        }
        let before = &source[start..at];
        let attr = before
            .rfind("#[test]")
            .or_else(|| before.rfind("#[tokio::test"));
        let is_test = attr.is_some_and(|a| !before[a..].contains("\n}\n"));
        assert!(
            is_test,
            "SECURITY.md names {file}::{name}, which is not a #[test]"
        );
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} test references found");
}
