//! Iteron's privileged side: everything with effects lives here (files, and in later layers the
//! network, processes and the IPC server). Decisions come from `iteron-policy`; this crate only
//! carries them out.
//!
//! Unsafe code is denied crate-wide; the single `sys` module that will need FFI opts in
//! explicitly, with a `// SAFETY:` comment on every block.
#![deny(unsafe_code)]

pub mod approvals;
pub mod audit;
pub mod catalog;
pub mod confine;
pub mod credentials;
pub mod daemon;
pub mod hooks;
pub mod ipc;
pub mod keyring;
pub mod mcp;
pub mod net;
pub mod oauth;
pub mod private_fs;
pub mod registry;
pub mod servers;
pub mod spawn;
pub mod store;
#[allow(
    unsafe_code,
    reason = "the one module with FFI; every block has a SAFETY comment"
)]
pub mod sys;

/// The security report (test builds only): tests that prove a SECURITY.md promise record it.
#[cfg(test)]
#[path = "../../tests/support/report.rs"]
mod test_report;
