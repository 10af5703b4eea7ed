//! The narrow channel between the agent (and the operator) and the broker: frames, the
//! request vocabulary with its dispatch table, and the client library the agent links.
//!
//! The client library contains no credential, configuration or network code: all it can do is
//! send the requests of [`proto`] over a Unix socket and read the answers.

pub mod client;
pub mod frame;
pub mod proto;
