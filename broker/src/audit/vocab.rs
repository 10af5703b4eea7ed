//! The audit log's vocabulary: what a record is about (`kind`), how far the request got
//! (`decision`) and how it ended (`outcome`). Closed sets, written as the words docs/broker.md
//! uses; a refusal's outcome is the same word as the reason the agent is given.

use crate::ipc::proto::Reason;

/// What a record is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `broker_start`.
    BrokerStart,
    /// `broker_stop`.
    BrokerStop,
    /// `connect_agent`.
    ConnectAgent,
    /// `connect_operator`.
    ConnectOperator,
    /// `hello`.
    Hello,
    /// `end_session`.
    EndSession,
    /// `protocol_error`.
    ProtocolError,
    /// `idle_close`.
    IdleClose,
    /// `list_tools`.
    ListTools,
    /// `list_resources`.
    ListResources,
    /// `list_prompts`.
    ListPrompts,
    /// `call_tool`.
    CallTool,
    /// `read_resource`.
    ReadResource,
    /// `get_prompt`.
    GetPrompt,
    /// `use_skill`.
    UseSkill,
    /// `resolve_agent`.
    ResolveAgent,
    /// `hook`.
    Hook,
    /// `egress_refused`.
    EgressRefused,
    /// `operator_decide`.
    OperatorDecide,
    /// `operator_answer`.
    OperatorAnswer,
    /// `operator_cancel`.
    OperatorCancel,
    /// `operator_restart`.
    OperatorRestart,
    /// `operator_stop`.
    OperatorStop,
    /// `operator_logout`.
    OperatorLogout,
    /// `audit_suppressed`.
    AuditSuppressed,
    /// `audit_tail_adopted`.
    AuditTailAdopted,
}

impl Kind {
    /// The word in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::BrokerStart => "broker_start",
            Kind::BrokerStop => "broker_stop",
            Kind::ConnectAgent => "connect_agent",
            Kind::ConnectOperator => "connect_operator",
            Kind::Hello => "hello",
            Kind::EndSession => "end_session",
            Kind::ProtocolError => "protocol_error",
            Kind::IdleClose => "idle_close",
            Kind::ListTools => "list_tools",
            Kind::ListResources => "list_resources",
            Kind::ListPrompts => "list_prompts",
            Kind::CallTool => "call_tool",
            Kind::ReadResource => "read_resource",
            Kind::GetPrompt => "get_prompt",
            Kind::UseSkill => "use_skill",
            Kind::ResolveAgent => "resolve_agent",
            Kind::Hook => "hook",
            Kind::EgressRefused => "egress_refused",
            Kind::OperatorDecide => "operator_decide",
            Kind::OperatorAnswer => "operator_answer",
            Kind::OperatorCancel => "operator_cancel",
            Kind::OperatorRestart => "operator_restart",
            Kind::OperatorStop => "operator_stop",
            Kind::OperatorLogout => "operator_logout",
            Kind::AuditSuppressed => "audit_suppressed",
            Kind::AuditTailAdopted => "audit_tail_adopted",
        }
    }
}

/// How far the request got: allowed, refused before approval, blocked, denied, approved (by
/// the operator or by a rule of theirs), or still waiting when it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// `allowed`.
    Allowed,
    /// `refused`.
    Refused,
    /// `awaiting_approval`.
    AwaitingApproval,
    /// `approved`.
    Approved,
    /// `approved_by_rule`.
    ApprovedByRule,
    /// `denied`.
    Denied,
    /// `denied_by_rule`.
    DeniedByRule,
    /// `blocked_by_hook`.
    BlockedByHook,
    /// `abandoned`.
    Abandoned,
    /// `accepted`.
    Accepted,
    /// `declined`.
    Declined,
    /// `cancelled`.
    Cancelled,
    /// `blocked`.
    Blocked,
    /// `no_opinion`.
    NoOpinion,
}

impl Decision {
    /// The word in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Allowed => "allowed",
            Decision::Refused => "refused",
            Decision::AwaitingApproval => "awaiting_approval",
            Decision::Approved => "approved",
            Decision::ApprovedByRule => "approved_by_rule",
            Decision::Denied => "denied",
            Decision::DeniedByRule => "denied_by_rule",
            Decision::BlockedByHook => "blocked_by_hook",
            Decision::Abandoned => "abandoned",
            Decision::Accepted => "accepted",
            Decision::Declined => "declined",
            Decision::Cancelled => "cancelled",
            Decision::Blocked => "blocked",
            Decision::NoOpinion => "no_opinion",
        }
    }
}

/// How the request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// `ok`.
    Ok,
    /// `tool_error`.
    ToolError,
    /// `dispatching`.
    Dispatching,
    /// `refused`.
    Refused,
    /// `denied`.
    Denied,
    /// `failed`.
    Failed,
    /// `connection_closed`.
    ConnectionClosed,
    /// `counted`.
    Counted,
    /// `unconfirmed_record`.
    UnconfirmedRecord,
    /// `cancelled_by_budget`.
    CancelledByBudget,
    /// `cancelled_by_shutdown`.
    CancelledByShutdown,
    /// `cancelled_by_disconnect`.
    CancelledByDisconnect,
    /// `not_found`.
    NotFound,
    /// `digest_required`.
    DigestRequired,
    /// `digest_mismatch`.
    DigestMismatch,
    /// `exited`.
    Exited,
    /// `blocked`.
    Blocked,
    /// `signalled`.
    Signalled,
    /// `timed_out`.
    TimedOut,
    /// `spawn_failed`.
    SpawnFailed,
    /// A refusal or a failure, as the reason the agent is given (`unknown_tool`, `approval_required`, …).
    Because(Reason),
}

impl Outcome {
    /// The word in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::ToolError => "tool_error",
            Outcome::Dispatching => "dispatching",
            Outcome::Refused => "refused",
            Outcome::Denied => "denied",
            Outcome::Failed => "failed",
            Outcome::ConnectionClosed => "connection_closed",
            Outcome::Counted => "counted",
            Outcome::UnconfirmedRecord => "unconfirmed_record",
            Outcome::CancelledByBudget => "cancelled_by_budget",
            Outcome::CancelledByShutdown => "cancelled_by_shutdown",
            Outcome::CancelledByDisconnect => "cancelled_by_disconnect",
            Outcome::NotFound => "not_found",
            Outcome::DigestRequired => "digest_required",
            Outcome::DigestMismatch => "digest_mismatch",
            Outcome::Exited => "exited",
            Outcome::Blocked => "blocked",
            Outcome::Signalled => "signalled",
            Outcome::TimedOut => "timed_out",
            Outcome::SpawnFailed => "spawn_failed",
            Outcome::Because(r) => r.as_str(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reader_and_the_writer_spell_the_log_s_own_records_alike() {
        assert_eq!(Kind::AuditTailAdopted.as_str(), crate::audit::ADOPTED_KIND);
        assert_eq!(
            Kind::AuditSuppressed.as_str(),
            crate::audit::SUPPRESSED_KIND
        );
        // A refusal's outcome is the reason the agent is given, word for word.
        for r in Reason::ALL {
            assert_eq!(Outcome::Because(r).as_str(), r.as_str());
        }
    }
}
