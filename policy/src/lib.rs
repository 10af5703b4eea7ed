//! Iteron's pure decisions. Nothing in this crate performs I/O, spawns, or touches the network:
//! every function maps inputs to a decision, so each can be tested and fuzzed in isolation.
#![forbid(unsafe_code)]

pub mod agentdef;
pub mod calendar;
pub mod capability;
pub mod config;
pub mod egress;
pub mod frontmatter;
pub mod json;
pub mod names;
pub mod rules;
pub mod skill;
pub mod text;
pub mod url;
pub mod zone;
