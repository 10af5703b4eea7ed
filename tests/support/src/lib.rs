//! What Iteron's tests share, in one place: the security report ([`record!`]) and the small
//! filesystem and process helpers of the end-to-end tests.
//!
//! Every crate of the workspace takes this one as a dev-dependency (it depends on none of them):
//! the library test modules of policy, ipc and broker, the broker's integration tests and the
//! end-to-end tests under `tests/` (compiled as the `iteron` package's).
// Test support: a helper that cannot do its job fails the test that called it.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![forbid(unsafe_code)]

mod docs;
mod files;
mod procs;
mod report;

pub use docs::{documented_json_keys, undocumented_json_keys};
pub use files::{audit_records, copy_tree, give_to_children, private_area, write_private_json};
pub use procs::{
    CHILD_UID, is_root, node, process_exists, text, wait_child, wait_listening, wait_pending,
};
pub use report::{record_as, report_path, test_id_from};
