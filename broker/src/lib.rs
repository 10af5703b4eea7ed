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

/// The IPC channel (frames, the typed requests, the client): the `iteron-ipc` crate, the
/// agent's whole side, used here to decode and dispatch.
pub use iteron_ipc as ipc;

pub mod approvals;
pub mod audit;
pub mod catalog;
pub mod confine;
pub mod credentials;
pub mod daemon;
pub mod egress;
pub mod hooks;
pub mod keyring;
pub mod mcp;
pub mod net;
pub mod oauth;
pub mod private_fs;
pub mod registry;
pub mod rules;
pub mod scrub;
pub mod servers;
pub mod spawn;
pub mod start;
pub mod store;
#[allow(
    unsafe_code,
    reason = "the one module with FFI; every block has a SAFETY comment"
)]
pub mod sys;
pub mod unit_secrets;
