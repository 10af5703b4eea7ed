//! The refusals the agent sees for what a server, the registry or the operator decided: one
//! fixed text per cause, never a transport detail, host or secret.

use crate::approvals::{self, NotApproved};
use crate::ipc::proto::{Code, Refusal};
use crate::mcp::client::McpError;
use crate::registry::SlotError;
use crate::servers::KnownSecrets;
use iteron_policy::text;

/// The one message for every tool the agent may not see or that does not exist.
pub(super) const UNKNOWN_TOOL: &str = "unknown tool";

pub(super) fn unknown_tool() -> Refusal {
    Refusal::new(Code::UnknownTool, UNKNOWN_TOOL)
}

/// Resources and prompts: what a server offers beside tools. Listing them is like listing
/// tools; reading a resource or getting a prompt runs the server's code like a tool call, so it
/// goes the same way (exposure → `PreToolUse` → approval → `dispatching` record → effect →
/// outcome record → `PostToolUse`), the hooks seeing `resources/read` or `prompts/get` as the
/// tool.
pub(super) const UNKNOWN_SERVER: &str = "no such server";

pub(super) fn unknown_server() -> Refusal {
    Refusal::new(Code::UnknownTool, UNKNOWN_SERVER)
}

/// The audit outcome and the agent's refusal when a server cannot be reached.
pub(super) fn slot_refusal(e: &SlotError) -> (&'static str, Refusal) {
    match e {
        SlotError::StaleSession => (
            "stale_session",
            Refusal::new(Code::Refused, &SlotError::StaleSession.to_string()),
        ),
        SlotError::ShuttingDown => (
            "shutting_down",
            Refusal::new(Code::ShuttingDown, "the broker is shutting down"),
        ),
        _ => (
            "server_unavailable",
            Refusal::new(
                Code::Failed,
                "the server is unavailable; nothing was sent (the operator can see why in iteron broker status)",
            )
            .with_certainty("not_sent"),
        ),
    }
}

/// What the agent is told, and the audit outcome, when a call was not approved.
pub(super) fn not_approved(why: NotApproved) -> (Code, &'static str, String) {
    match why {
        NotApproved::Noninteractive => (
            Code::ApprovalRequired,
            "approval_required",
            "this call needs an operator's approval (no approval rule approves it), and this broker is noninteractive; nothing was sent".to_owned(),
        ),
        NotApproved::Denied => (
            Code::Refused,
            "denied",
            "the operator denied this call; nothing was sent".to_owned(),
        ),
        NotApproved::TimedOut => (
            Code::Refused,
            "approval_timed_out",
            "no operator approved this call in time; nothing was sent".to_owned(),
        ),
        NotApproved::Full => (
            Code::Busy,
            "approval_queue_full",
            format!(
                "{} calls are already waiting for approval; nothing was sent",
                approvals::MAX_PENDING
            ),
        ),
        NotApproved::ShuttingDown => (
            Code::ShuttingDown,
            "shutting_down",
            "the broker is shutting down; nothing was sent".to_owned(),
        ),
    }
}

/// What the agent is told when a call fails: the server's own error message (its answer to
/// the call), or a fixed description — never transport details such as host names, addresses
/// or zones, which stay in the audit record and `iteron broker status`.
pub(super) fn describe_failure(e: &McpError, secrets: &KnownSecrets) -> String {
    use crate::mcp::TransportErrorKind as K;
    match e {
        // Scrubbed before it is cut and escaped: a secret cut in half, or escaped, would no
        // longer be recognised.
        McpError::Rpc { error, .. } => format!(
            "the server answered with an error: {}",
            text::single_line_capped(&secrets.scrub(&error.message), 300)
        ),
        McpError::Transport(t) => match t.kind {
            K::Timeout => "the call did not complete in time".to_owned(),
            K::Unauthorized { .. } => "the server refused the broker's credentials".to_owned(),
            _ => "the connection to the server failed".to_owned(),
        },
        McpError::Protocol { .. } => "the server broke the protocol".to_owned(),
        McpError::Limit { what, max } => format!("a bound was exceeded: {what} (at most {max})"),
        McpError::InputRefused(why) => format!("the server needed input that was refused: {why}"),
        McpError::UnknownTool => "unknown tool".to_owned(),
        McpError::AfterInputRounds { rounds, error } => format!(
            "{} (after {rounds} input rounds had reached the server)",
            describe_failure(error, secrets)
        ),
        _ => "the tool call failed".to_owned(),
    }
}
