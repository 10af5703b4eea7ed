//! Iteron's privileged side: everything with effects lives here (files, and in later layers the
//! network, processes and the IPC server). Decisions come from `iteron-policy`; this crate only
//! carries them out.
//!
//! The start-up order of `iteron broker serve` (harden, check the options, read the
//! configuration, discover the catalog, build the hooks, then audit, sockets, registry and
//! serving) lives in the `start` module, so a test can run a whole broker.
//!
//! Unsafe code is denied crate-wide; the single `sys` module that will need FFI opts in
//! explicitly, with a `// SAFETY:` comment on every block.
#![deny(unsafe_code)]

#[cfg(feature = "broker")]
pub mod approvals;
#[cfg(feature = "broker")]
pub mod audit;
#[cfg(feature = "broker")]
pub mod catalog;
#[cfg(feature = "broker")]
pub mod confine;
#[cfg(feature = "broker")]
pub mod credentials;
#[cfg(feature = "broker")]
pub mod daemon;
#[cfg(feature = "broker")]
pub mod egress;
#[cfg(feature = "broker")]
pub mod hooks;
pub mod ipc;
#[cfg(feature = "broker")]
pub mod keyring;
#[cfg(feature = "broker")]
pub mod mcp;
#[cfg(feature = "broker")]
pub mod net;
#[cfg(feature = "broker")]
pub mod oauth;
#[cfg(feature = "broker")]
pub mod private_fs;
#[cfg(feature = "broker")]
pub mod registry;
#[cfg(feature = "broker")]
pub mod rules;
#[cfg(feature = "broker")]
pub mod scrub;
#[cfg(feature = "broker")]
pub mod servers;
#[cfg(feature = "broker")]
pub mod spawn;
#[cfg(feature = "broker")]
pub mod start;
#[cfg(feature = "broker")]
pub mod store;
#[cfg(feature = "broker")]
#[allow(
    unsafe_code,
    reason = "the one module with FFI; every block has a SAFETY comment"
)]
pub mod sys;
#[cfg(feature = "broker")]
pub mod unit_secrets;

/// The security report (test builds only): tests that prove a SECURITY.md promise record it.
#[cfg(test)]
#[path = "../../tests/support/report.rs"]
mod test_report;
