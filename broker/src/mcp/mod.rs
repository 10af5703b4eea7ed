//! Iteron's own MCP client: bounded everywhere, and never retrying a call that may already have
//! been applied.
pub mod jsonrpc;
pub mod sse;
pub mod version;
