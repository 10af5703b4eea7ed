//! The agent's side of Iteron as a program: `iteron-agent` (and `iteron agent`, the same code)
//! asks a broker for effects through its agent socket, one request per command, and prints the
//! answer as terminal-safe text or JSON.
//!
//! It links only the IPC crate (`iteron-ipc`: frames, typed requests, the client) and policy's
//! text checks: no credential, configuration, network or process code is in this program
//! (`scripts/check-agent-client` checks its dependency graph), so an agent that runs it never
//! runs a binary that holds credential code.
#![forbid(unsafe_code)]

pub mod args;
mod error;
pub mod output;
mod parse;
mod run;

pub use error::{AgentError, Exit, broker_exit, error_line, no_broker};
pub use parse::describe_parse_error;
pub use run::{broker_error, parse_object, run};
