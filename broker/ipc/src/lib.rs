//! The narrow channel between the agent (and the operator) and the broker: frames, the
//! request vocabulary with its dispatch table, and the client library the agent links.
//!
//! This crate is the agent's whole side of the privilege separation. It holds no credential,
//! configuration, network or process code, and depends on nothing that does
//! (`scripts/check-agent-client` checks its dependency graph and its sources): all it can do is
//! send the requests of [`proto`] over a Unix socket and read the answers. The broker
//! (`iteron-broker`) uses the same types to decode and dispatch, and re-exports the crate as
//! `iteron_broker::ipc`.
#![forbid(unsafe_code)]

pub mod client;
pub mod frame;
pub mod proto;
