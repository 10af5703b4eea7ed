//! Iteron's privileged side: everything with effects lives here. Decisions come from
//! `iteron-policy` (pure, no I/O); this crate carries them out, and it is the only code that
//! holds a credential, reads the operator's configuration, reaches the network or starts a
//! process.
//!
//! The map, from the agent inwards (DESIGN §3–§5):
//! - [`ipc`] — the agent's side: frames, the typed requests of both sockets, the client. It is
//!   the separate crate `iteron-ipc`, with no credential, network or process code, so that an
//!   agent links it (and runs `iteron-agent`) without any of this crate.
//! - [`daemon`] — `iteron broker serve`: the two sockets and their peer gate, the connection
//!   loop, the sessions, exposure and listings, the effect pipeline (hooks → approval by a rule
//!   or the operator → the `dispatching` record → the effect, once → the outcome record), the
//!   one mapping from internal causes to what the agent sees (`daemon::denial`), and the
//!   operator's requests. [`start`] is the start-up order a test can call.
//! - [`approvals`] (the operator's queue and forms), [`rules`] (the operator's approval rules),
//!   [`hooks`] (operator hooks and the hook seam), [`audit`] (the hash-chained log, which also
//!   owns the flag that refuses every effect once a write failed).
//! - [`registry`] (one slot per configured server: start, generation, cancel), [`servers`]
//!   (how a server is reached: a confined child or an HTTP endpoint with its credential, and
//!   the scrubber of the secrets it was given), [`mcp`] (our MCP client: stdio, Streamable HTTP,
//!   JSON-RPC; an effect is never retried), [`spawn`], [`confine`] and [`egress`] (confined
//!   children, and the zone-judged path out of their network namespace).
//! - [`net`] (the broker's own HTTP: pinned DNS, zones), [`oauth`] (discovery, login, grants,
//!   DPoP), [`credentials`] and [`keyring`] (where tokens live), [`store`] and [`private_fs`]
//!   (the operator's files: 0600, atomic, locked), [`unit_secrets`] (systemd credentials),
//!   [`catalog`] (skills and agent definitions), [`scrub`] (environments for children).
//! - [`sys`] — the system-call wrappers: the only module with `unsafe` (each block has a
//!   `// SAFETY:` comment). Every other module carries `#![forbid(unsafe_code)]` (checked by a
//!   test below).
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

#[cfg(test)]
mod tests {
    /// Unsafe code is narrowed to `sys`: every other module of this crate forbids it, at the top
    /// of its own file, and this crate's list of modules is what is checked.
    #[test]
    fn every_module_but_sys_forbids_unsafe_code() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
        let mut checked = 0;
        for name in lib.lines().filter_map(|l| l.strip_prefix("pub mod")) {
            let name = name.trim().trim_end_matches(';');
            let file = [
                src.join(format!("{name}.rs")),
                src.join(name).join("mod.rs"),
            ]
            .into_iter()
            .find(|p| p.exists())
            .unwrap();
            let text = std::fs::read_to_string(&file).unwrap();
            let forbids = text.lines().any(|l| l == "#![forbid(unsafe_code)]");
            assert_eq!(forbids, name != "sys", "{}", file.display());
            checked += 1;
        }
        assert!(checked > 20, "{checked} modules");
    }
}
