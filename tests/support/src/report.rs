//! The security report: a test that proves a promise of SECURITY.md appends one JSON line
//! (`{"promise", "test", "evidence"}`) to the report once its assertions have passed, so a line
//! in the report means "this ran and held". `./scripts/test` clears the report before the run
//! and `scripts/check-security-report` checks SECURITY.md's promise table against it after.
//!
//! A test records with [`record!`](crate::record), which names the test itself: the file it is
//! written in (from the workspace root, as SECURITY.md names it) and the test function around
//! the call, as `<file>::<test>`.

use std::io::Write;
use std::path::{Component, Path, PathBuf};

/// Record that the test around this call proved `promise`, with what it measured (a
/// `serde_json::Value`), under the id `<file>::<test>`: the file from the workspace root, the
/// test the enclosing function (a closure or async block inside it names it too).
///
/// `record!(promise, name = test, evidence)` names the test function explicitly (the file is
/// still this one): for a helper that records for the test that called it.
#[macro_export]
macro_rules! record {
    ($promise:expr, name = $name:expr, $evidence:expr $(,)?) => {
        $crate::record_as($promise, &$crate::test_id!(name = $name), $evidence)
    };
    ($promise:expr, $evidence:expr $(,)?) => {
        $crate::record_as($promise, &$crate::test_id!(), $evidence)
    };
}

/// The id the security report gives the test around this call: `<file>::<test>` (see
/// [`record!`](crate::record)); `test_id!(name = test)` takes the function name as given.
#[macro_export]
macro_rules! test_id {
    () => {
        $crate::test_id_from(file!(), {
            fn here() {}
            ::std::any::type_name_of_val(&here)
        })
    };
    (name = $name:expr) => {
        $crate::test_id_from(file!(), $name)
    };
}

/// The report's id for a test: `file` (as `file!()` gives it) from the workspace root, then
/// `::` and the test's name. `function` is either the name itself or the type name of an item
/// inside the test (`krate::module::test::{{closure}}::here`): then the last path segment that
/// is not the item's own and not a closure's.
pub fn test_id_from(file: &str, function: &str) -> String {
    let name = match function.strip_suffix("::here") {
        Some(path) => path
            .rsplit("::")
            .find(|segment| !segment.starts_with("{{"))
            .unwrap_or(path),
        None => function,
    };
    format!("{}::{name}", from_root(Path::new(file)))
}

/// `file` relative to the workspace root, with `.` and `..` resolved: cargo passes the
/// workspace's own sources relative to the root (`broker/src/net.rs`), and a target outside its
/// package as written (`cli/../tests/broker.rs`, which is `tests/broker.rs`).
fn from_root(file: &Path) -> String {
    let root = workspace_root();
    let file = file.strip_prefix(&root).unwrap_or(file);
    let mut parts: Vec<String> = Vec::new();
    for c in file.components() {
        match c {
            Component::ParentDir => {
                parts.pop();
            }
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    let joined = parts.join("/");
    if file.is_absolute() {
        format!("/{joined}")
    } else {
        joined
    }
}

/// The workspace root: the nearest directory above this crate that holds Cargo.lock.
fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|d| d.join("Cargo.lock").exists())
        .unwrap_or(&manifest)
        .to_path_buf()
}

/// Where the report goes: `$ITERON_SECURITY_REPORT`, else `target/iteron-security-report.jsonl`
/// of the workspace.
pub fn report_path() -> PathBuf {
    match std::env::var_os("ITERON_SECURITY_REPORT") {
        Some(p) => PathBuf::from(p),
        None => default_report_path(),
    }
}

/// `target/iteron-security-report.jsonl` of the workspace.
fn default_report_path() -> PathBuf {
    workspace_root()
        .join("target")
        .join("iteron-security-report.jsonl")
}

/// Record that `test` (a whole id, `<file>::<test>`) proved `promise`, with what it measured.
/// Tests use [`record!`](crate::record), which derives the id.
pub fn record_as(promise: &str, test: &str, evidence: serde_json::Value) {
    append(&report_path(), promise, test, evidence);
}

/// Append the report line to `path`, creating the file and its directory.
fn append(path: &Path, promise: &str, test: &str, evidence: serde_json::Value) {
    let line = serde_json::json!({"promise": promise, "test": test, "evidence": evidence});
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    // One write per line with O_APPEND: lines from concurrent test binaries stay whole.
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    f.write_all(format!("{line}\n").as_bytes()).unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    const HERE: &str = "tests/support/src/report.rs";

    #[test]
    fn a_test_is_named_by_its_file_from_the_workspace_root_and_its_function() {
        assert_eq!(
            crate::test_id!(),
            format!("{HERE}::a_test_is_named_by_its_file_from_the_workspace_root_and_its_function")
        );
    }

    #[test]
    fn a_closure_or_async_block_inside_a_test_still_names_the_test() {
        let want = format!("{HERE}::a_closure_or_async_block_inside_a_test_still_names_the_test");
        let outer = || {
            let inner = || crate::test_id!();
            inner()
        };
        assert_eq!(outer(), want);
        // As `#[tokio::test]` runs a test's body: inside an async block.
        let mut body = std::pin::pin!(async { crate::test_id!() });
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match body.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(id) => assert_eq!(id, want),
            std::task::Poll::Pending => panic!("the block awaits nothing"),
        }
    }

    #[test]
    fn a_helper_names_the_test_it_records_for() {
        fn helper(test: &str) -> String {
            crate::test_id!(name = test)
        }
        assert_eq!(helper("sse_streams"), format!("{HERE}::sse_streams"));
        // Without a name the helper would be named: the explicit form is for exactly this.
        fn unnamed() -> String {
            crate::test_id!()
        }
        assert_eq!(unnamed(), format!("{HERE}::unnamed"));
    }

    #[test]
    fn files_outside_their_package_and_absolute_paths_are_named_from_the_root() {
        // The `iteron` package's end-to-end tests are `path = "../tests/<x>.rs"`.
        assert_eq!(
            test_id_from("cli/../tests/broker.rs", "t"),
            "tests/broker.rs::t"
        );
        assert_eq!(
            test_id_from("broker/ipc/src/./proto/tests.rs", "t"),
            "broker/ipc/src/proto/tests.rs::t"
        );
        let abs = workspace_root().join("broker/tests/net.rs");
        assert_eq!(
            test_id_from(abs.to_str().unwrap(), "t"),
            "broker/tests/net.rs::t"
        );
        assert_eq!(
            test_id_from(
                "policy/src/url.rs",
                "iteron_policy::url::tests::t::{{closure}}::{{closure}}::here"
            ),
            "policy/src/url.rs::t"
        );
    }

    #[test]
    fn the_report_is_one_json_line_per_record_in_the_workspace_target() {
        assert!(workspace_root().join("Cargo.lock").is_file());
        assert_eq!(
            default_report_path(),
            workspace_root().join("target/iteron-security-report.jsonl")
        );
        let dir = std::env::temp_dir().join(format!("iteron-report-{}", std::process::id()));
        let path = dir.join("sub").join("report.jsonl");
        append(&path, "P1", "a.rs::t", serde_json::json!({"n": 1}));
        append(&path, "P2", "b.rs::u", serde_json::json!({}));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            concat!(
                r#"{"promise":"P1","test":"a.rs::t","evidence":{"n":1}}"#,
                "\n",
                r#"{"promise":"P2","test":"b.rs::u","evidence":{}}"#,
                "\n"
            )
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
