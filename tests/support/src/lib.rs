//! What Iteron's tests share, in one place: the security report ([`record!`]) and the small
//! filesystem and process helpers of the end-to-end tests.
//!
//! Every crate of the workspace takes this one as a dev-dependency (it depends on none of them):
//! the library test modules of policy, ipc and broker, the broker's integration tests and the
//! end-to-end tests under `tests/` (compiled as the `iteron` package's).
// Test support: a helper that cannot do its job fails the test that called it.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![forbid(unsafe_code)]

mod report;

pub use report::{record_as, report_path, test_id_from};

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Copy a directory tree (regular files and directories only); directories become `dir_mode`,
/// files `file_mode`.
pub fn copy_tree(from: &Path, to: &Path, dir_mode: u32, file_mode: u32) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(dir_mode)).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &t, dir_mode, file_mode);
        } else {
            std::fs::copy(e.path(), &t).unwrap();
            std::fs::set_permissions(&t, std::fs::Permissions::from_mode(file_mode)).unwrap();
        }
    }
}

/// The uid a confined child of a root broker runs as by default (`sandbox.run_as`).
pub const CHILD_UID: u32 = 65534;

/// Under a root test run, hand `p` to uid 65534: confined children (servers and hooks) run as
/// that uid, so a directory they must write is theirs (Landlock still decides where they may).
pub fn give_to_children(p: &Path) {
    if nix::unistd::geteuid().is_root() {
        std::os::unix::fs::chown(p, Some(CHILD_UID), Some(CHILD_UID)).unwrap();
    }
}

/// Whether process `pid` exists at all (a zombie does: its `/proc` entry stays until reaped).
pub fn process_exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}
