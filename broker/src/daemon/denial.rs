//! The one route from an internal cause to what the agent sees: [`Denial`]. Each cause has one
//! code, one certainty, one machine-readable reason, one audit decision and outcome, and one
//! fixed, redacted message — each an exhaustive match, so a new cause cannot be added without
//! deciding all five. Never a transport detail, host or secret.

use crate::audit::{Decision, Outcome};
use crate::ipc::proto::Reason;
use iteron_policy::text;

use crate::approvals::{self, NotApproved};
use crate::audit::Gate;
use crate::ipc::proto::{self, Certainty, Code, PROTOCOL_VERSION, Refusal};
use crate::mcp::TransportErrorKind;
use crate::mcp::client::McpError;
use crate::registry::SlotError;
use crate::rules::RuleMark;
use crate::servers::KnownSecrets;

use super::MAX_CLIENT_LABEL;

/// The one message for every tool the agent may not see or that does not exist.
pub(super) const UNKNOWN_TOOL: &str = "unknown tool";

/// The one message for every server whose resources and prompts the agent may not use or that
/// does not exist.
pub(super) const UNKNOWN_SERVER: &str = "no such server";

/// Why a request of the agent is not served (or its effect did not complete).
#[derive(Debug, Clone)]
pub(super) enum Denial {
    // --- the connection and its hello ---
    /// The peer's uid is not allowed on this socket.
    PeerNotAllowed,
    /// The uid has [`super::MAX_CONNECTIONS_PER_UID`] connections open.
    UidConnectionsFull,
    /// The socket has [`super::MAX_CONNECTIONS`] connections open.
    ConnectionsFull,
    /// `hello` named another protocol version.
    Version,
    /// `hello`'s client label is too long or not plain text.
    BadClientLabel,
    /// `agent_type` or `model` on the operator socket.
    AgentFieldsOnOperator,
    /// `model` without `agent_type`.
    ModelWithoutAgentType,
    /// The configuration could not be read while opening a session.
    HelloConfigUnreadable,
    /// The `agent_type` was refused (the fixed text of why).
    AgentTypeRefused(String),
    /// A request the session table does not admit here (unreachable by construction).
    NotAllowedHere,
    /// The broker stopped while the request was in flight.
    ShutdownDuringRequest,
    /// The answer would not fit in a frame.
    AnswerTooLarge,

    // --- what the session may see ---
    /// No such tool, or one this session may not see.
    UnknownTool,
    /// No such server, or one whose resources and prompts this session may not use.
    UnknownServer,
    /// No such skill.
    UnknownSkill,
    /// The skill's file changed since discovery.
    SkillChanged,
    /// The prompt of `submit_prompt` is over [`proto::MAX_PROMPT`].
    PromptTooLong,
    /// The configuration could not be read for this request.
    ConfigUnreadable,
    /// The server could not list its resources or prompts (the redacted description).
    ListFailed(String),

    // --- a child session's budgets ---
    /// The turn budget is spent.
    ChildTurnsSpent,
    /// The limit of consecutive tool errors is reached.
    ChildErrorLimit,
    /// The wall-clock budget is spent.
    ChildWallSpent,
    /// The wall-clock budget ran out while a call ran.
    ChildWallDuringCall,

    // --- an effect request, before it is sent ---
    /// The arguments of calls in flight are at their bound.
    ArgumentsBudgetFull,
    /// The arguments are not UTF-8 (cannot happen for decoded JSON; refused if it did).
    ArgumentsNotUtf8,
    /// The request's own bounds (a fixed text).
    BadRequest(&'static str),
    /// The audit log refuses effects (at the request's start).
    AuditUnwritable(Gate),
    /// The session was opened against a configuration the server no longer matches.
    StaleSession,
    /// The broker is shutting down.
    ShuttingDown,
    /// The server could not be reached or started.
    ServerUnavailable,
    /// A `PreToolUse` hook blocked the call (its reason, already rendered by the hook runner).
    BlockedByHook(String),
    /// A deny rule of the operator's refused the call.
    DeniedByRule(RuleMark),
    /// No approval (the note of the closest allow rule, if any).
    NotApproved(NotApproved, Option<String>),
    /// The server was restarted or stopped while the call waited.
    ServerRestarted,
    /// The operator cancelled calls on the server while this one waited.
    CancelledWhileWaiting,
    /// The `dispatching` record could not be written.
    DispatchNotRecorded(Gate),

    // --- an effect request, once sent ---
    /// The operator cancelled calls on the server while this one ran.
    CancelledDuringEffect,
    /// The effect failed (the redacted description for the agent, its certainty and reason).
    EffectFailed {
        /// What the agent is told.
        message: String,
        /// Whether it may have been applied.
        certainty: Certainty,
        /// The failure's kind ([`failure_reason`]).
        reason: Reason,
    },
}

impl Denial {
    /// The wire code.
    pub(super) fn code(&self) -> Code {
        use Denial as D;
        match self {
            D::Version => Code::Version,
            D::BadClientLabel
            | D::AgentFieldsOnOperator
            | D::ModelWithoutAgentType
            | D::NotAllowedHere
            | D::ArgumentsNotUtf8 => Code::Protocol,
            D::UnknownTool | D::UnknownServer => Code::UnknownTool,
            D::UnknownSkill => Code::NotFound,
            D::PeerNotAllowed
            | D::AgentTypeRefused(_)
            | D::SkillChanged
            | D::PromptTooLong
            | D::ChildTurnsSpent
            | D::ChildErrorLimit
            | D::ChildWallSpent
            | D::ChildWallDuringCall
            | D::BadRequest(_)
            | D::AuditUnwritable(_)
            | D::StaleSession
            | D::BlockedByHook(_)
            | D::DeniedByRule(_)
            | D::DispatchNotRecorded(_) => Code::Refused,
            D::UidConnectionsFull | D::ConnectionsFull | D::ArgumentsBudgetFull => Code::Busy,
            D::ShutdownDuringRequest | D::ShuttingDown => Code::ShuttingDown,
            D::HelloConfigUnreadable
            | D::AnswerTooLarge
            | D::ConfigUnreadable
            | D::ListFailed(_)
            | D::ServerUnavailable
            | D::ServerRestarted
            | D::EffectFailed { .. } => Code::Failed,
            D::CancelledWhileWaiting | D::CancelledDuringEffect => Code::Cancelled,
            D::NotApproved(why, _) => match why {
                NotApproved::Noninteractive => Code::ApprovalRequired,
                NotApproved::Denied | NotApproved::TimedOut => Code::Refused,
                NotApproved::Full => Code::Busy,
                NotApproved::ShuttingDown => Code::ShuttingDown,
            },
        }
    }

    /// Whether the effect may have happened; `None` where no effect was at stake.
    pub(super) fn certainty(&self) -> Option<Certainty> {
        use Denial as D;
        match self {
            D::PeerNotAllowed
            | D::UidConnectionsFull
            | D::ConnectionsFull
            | D::Version
            | D::BadClientLabel
            | D::AgentFieldsOnOperator
            | D::ModelWithoutAgentType
            | D::HelloConfigUnreadable
            | D::AgentTypeRefused(_)
            | D::NotAllowedHere
            | D::UnknownTool
            | D::UnknownServer
            | D::UnknownSkill
            | D::SkillChanged
            | D::PromptTooLong
            | D::ListFailed(_)
            | D::ArgumentsNotUtf8
            | D::AuditUnwritable(_)
            | D::StaleSession
            | D::ShuttingDown => None,
            D::ConfigUnreadable
            | D::ChildTurnsSpent
            | D::ChildErrorLimit
            | D::ChildWallSpent
            | D::ArgumentsBudgetFull
            | D::BadRequest(_)
            | D::ServerUnavailable
            | D::BlockedByHook(_)
            | D::DeniedByRule(_)
            | D::NotApproved(..)
            | D::ServerRestarted
            | D::CancelledWhileWaiting
            | D::DispatchNotRecorded(_) => Some(Certainty::NotSent),
            D::ShutdownDuringRequest
            | D::AnswerTooLarge
            | D::ChildWallDuringCall
            | D::CancelledDuringEffect => Some(Certainty::MaybeApplied),
            D::EffectFailed { certainty, .. } => Some(*certainty),
        }
    }

    /// The machine-readable reason sent next to the code (docs/ipc.md lists them): where the
    /// request has an audit record, the record's outcome says the same.
    pub(super) fn reason(&self) -> Reason {
        use Denial as D;
        match self {
            D::PeerNotAllowed => Reason::PeerUidNotAllowed,
            D::UidConnectionsFull => Reason::UidConnectionsFull,
            D::ConnectionsFull => Reason::ConnectionsFull,
            D::Version => Reason::Version,
            D::BadClientLabel => Reason::BadClientLabel,
            D::AgentFieldsOnOperator => Reason::AgentFieldsOnOperator,
            D::ModelWithoutAgentType => Reason::ModelWithoutAgentType,
            D::HelloConfigUnreadable | D::ConfigUnreadable => Reason::ConfigUnreadable,
            D::AgentTypeRefused(_) => Reason::AgentTypeRefused,
            D::NotAllowedHere => Reason::NotAllowedHere,
            D::ShutdownDuringRequest | D::ShuttingDown => Reason::ShuttingDown,
            D::AnswerTooLarge => Reason::AnswerTooLarge,
            D::UnknownTool => Reason::UnknownTool,
            D::UnknownServer => Reason::UnknownServer,
            D::UnknownSkill => Reason::UnknownSkill,
            D::SkillChanged => Reason::ChangedSinceDiscovery,
            D::PromptTooLong => Reason::PromptTooLong,
            D::ListFailed(_) => Reason::ListFailed,
            D::ChildTurnsSpent => Reason::TurnBudgetSpent,
            D::ChildErrorLimit => Reason::ErrorBudgetSpent,
            D::ChildWallSpent => Reason::WallBudgetSpent,
            D::ChildWallDuringCall => Reason::CancelledByBudget,
            D::ArgumentsBudgetFull => Reason::ArgumentsBudgetFull,
            D::ArgumentsNotUtf8 => Reason::ArgumentsNotUtf8,
            D::BadRequest(_) => Reason::BadRequest,
            D::AuditUnwritable(g) | D::DispatchNotRecorded(g) => g.reason(),
            D::StaleSession => Reason::StaleSession,
            D::ServerUnavailable => Reason::ServerUnavailable,
            D::BlockedByHook(_) => Reason::BlockedByHook,
            D::DeniedByRule(_) => Reason::DeniedByRule,
            D::NotApproved(why, _) => not_approved_reason(*why),
            D::ServerRestarted => Reason::ServerRestarted,
            D::CancelledWhileWaiting | D::CancelledDuringEffect => Reason::CancelledByOperator,
            D::EffectFailed { reason, .. } => *reason,
        }
    }

    /// The audit record's decision and outcome for an effect request refused this way (the
    /// decision says how far the request got: refused before approval, blocked, denied, or
    /// approved and then not sent or failed).
    pub(super) fn audit(&self) -> (Decision, Outcome) {
        use Denial as D;
        match self {
            D::BlockedByHook(_) => (Decision::BlockedByHook, Outcome::Refused),
            D::DeniedByRule(_) => (Decision::DeniedByRule, Outcome::Refused),
            D::NotApproved(NotApproved::Denied, _) => (Decision::Denied, Outcome::Denied),
            D::NotApproved(why, _) => (
                Decision::Refused,
                Outcome::Because(not_approved_reason(*why)),
            ),
            D::ServerRestarted
            | D::CancelledWhileWaiting
            | D::DispatchNotRecorded(_)
            | D::CancelledDuringEffect => (Decision::Approved, Outcome::Because(self.reason())),
            D::EffectFailed { .. } => (Decision::Approved, Outcome::Failed),
            // The listing was allowed; the server failed to answer it.
            D::ListFailed(_) => (Decision::Allowed, Outcome::Failed),
            D::PeerNotAllowed
            | D::UidConnectionsFull
            | D::ConnectionsFull
            | D::Version
            | D::BadClientLabel
            | D::AgentFieldsOnOperator
            | D::ModelWithoutAgentType
            | D::HelloConfigUnreadable
            | D::AgentTypeRefused(_)
            | D::NotAllowedHere
            | D::ShutdownDuringRequest
            | D::AnswerTooLarge
            | D::UnknownTool
            | D::UnknownServer
            | D::UnknownSkill
            | D::SkillChanged
            | D::PromptTooLong
            | D::ConfigUnreadable
            | D::ChildTurnsSpent
            | D::ChildErrorLimit
            | D::ChildWallSpent
            | D::ChildWallDuringCall
            | D::ArgumentsBudgetFull
            | D::ArgumentsNotUtf8
            | D::BadRequest(_)
            | D::AuditUnwritable(_)
            | D::StaleSession
            | D::ShuttingDown
            | D::ServerUnavailable => (Decision::Refused, Outcome::Because(self.reason())),
        }
    }

    /// What the agent is told (made single-line, redacted and capped by [`Refusal`]).
    fn message(&self) -> String {
        use Denial as D;
        let fixed = |s: &str| s.to_owned();
        match self {
            D::PeerNotAllowed => fixed("this uid may not use this socket"),
            D::UidConnectionsFull => format!(
                "this uid has {} connections open already; close one",
                super::MAX_CONNECTIONS_PER_UID
            ),
            D::ConnectionsFull => fixed("too many open connections; try again later"),
            D::Version => format!("this broker speaks IPC protocol {PROTOCOL_VERSION} only"),
            D::BadClientLabel => {
                format!("the client label must be at most {MAX_CLIENT_LABEL} bytes of plain text")
            }
            D::AgentFieldsOnOperator => fixed("agent_type and model belong to agent sessions"),
            D::ModelWithoutAgentType => fixed("model is only meaningful with agent_type"),
            D::HelloConfigUnreadable => {
                fixed("the broker's configuration cannot be read; ask the operator")
            }
            D::AgentTypeRefused(why) => why.clone(),
            D::NotAllowedHere => fixed("request not allowed here"),
            D::ShutdownDuringRequest => fixed(
                "the broker is shutting down; the request was cancelled (a tool call may or may not have been applied)",
            ),
            D::AnswerTooLarge => fixed("the answer is over the frame size bound and was not sent"),
            D::UnknownTool => fixed(UNKNOWN_TOOL),
            D::UnknownServer => fixed(UNKNOWN_SERVER),
            D::UnknownSkill => fixed("unknown skill"),
            D::SkillChanged => fixed(
                "the skill changed since it was discovered; it is available again after the broker restarts",
            ),
            D::PromptTooLong => format!("the prompt is over {} bytes", proto::MAX_PROMPT),
            D::ConfigUnreadable => fixed(
                "the broker's configuration cannot be read; nothing was sent; ask the operator",
            ),
            D::ListFailed(why) => why.clone(),
            D::ChildTurnsSpent => fixed("the child's turn budget is spent; nothing was sent"),
            D::ChildErrorLimit => {
                fixed("the child reached its limit of consecutive tool errors; nothing was sent")
            }
            D::ChildWallSpent => fixed("the child's wall-clock budget is spent; nothing was sent"),
            D::ChildWallDuringCall => fixed(
                "the child's wall-clock budget ran out during the call; it may or may not have been applied",
            ),
            D::ArgumentsBudgetFull => format!(
                "too many argument bytes are in calls in flight (at most {} MiB per agent uid, {} MiB in all); nothing was sent",
                super::MAX_ARGUMENT_WEIGHT_PER_UID >> 20,
                super::MAX_ARGUMENT_WEIGHT >> 20
            ),
            D::ArgumentsNotUtf8 => fixed("the arguments are not UTF-8"),
            D::BadRequest(why) => fixed(why),
            D::AuditUnwritable(g) | D::DispatchNotRecorded(g) => fixed(g.refusal()),
            D::StaleSession => SlotError::StaleSession.to_string(),
            D::ShuttingDown => fixed("the broker is shutting down"),
            D::ServerUnavailable => fixed(
                "the server is unavailable; nothing was sent (the operator can see why in iteron broker status)",
            ),
            D::BlockedByHook(reason) => crate::hooks::block_message(reason),
            D::DeniedByRule(mark) => format!(
                "the operator's rule {} refuses this call; nothing was sent",
                mark.id
            ),
            D::NotApproved(why, note) => {
                crate::rules::with_note(&not_approved_message(*why), note.as_deref())
            }
            D::ServerRestarted => fixed(
                "the server was restarted or stopped while the call waited for approval; nothing was sent",
            ),
            D::CancelledWhileWaiting => fixed(
                "the operator cancelled calls on this server while this one waited; nothing was sent",
            ),
            D::CancelledDuringEffect => fixed(
                "the operator cancelled calls on this server; the call may or may not have been applied",
            ),
            D::EffectFailed { message, .. } => message.clone(),
        }
    }

    /// The refusal sent to the agent: code, message, reason and certainty, all from here.
    pub(super) fn refusal(&self) -> Refusal {
        let message = self.message();
        // A hook's reason was escaped once by the hook runner: it is sent as rendered (escaping
        // it again would double its backslashes); every other message is escaped here.
        let r = match self {
            Denial::BlockedByHook(_) => Refusal::rendered(self.code(), &message),
            _ => Refusal::new(self.code(), &message),
        }
        .with_reason(self.reason());
        match self.certainty() {
            Some(c) => r.with_certainty(c),
            None => r,
        }
    }
}

impl From<Denial> for Refusal {
    fn from(d: Denial) -> Refusal {
        d.refusal()
    }
}

/// Why a request of the operator is not served: the operator socket's own causes, each with
/// one code, one reason and one fixed message (what varies is the broker's own words: an
/// offset, a form's complaint, the registry's redacted logout failure). Never an argument of a
/// call or a secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum OperatorDenial {
    /// No server of that name.
    UnknownServer,
    /// Logging out an operator-supplied token failed (the registry's redacted words).
    LogoutFailed(String),
    /// A digest given with `ids`, or without `id`.
    DigestNeedsOneId,
    /// A call parked by a noninteractive broker, approved without its digest.
    DigestRequired,
    /// The digest is not the waiting call's.
    DigestMismatch,
    /// No call of that id is waiting.
    NoCallWaiting,
    /// No form of that id is waiting.
    NoFormWaiting,
    /// A form answer that does not fit the form (the validator's words).
    AnswerInvalid(String),
    /// `show` at an offset that is not a character boundary of the arguments.
    BadOffset {
        /// The offset asked for.
        offset: usize,
        /// The arguments' length, in bytes.
        len: usize,
    },
    /// A `hello` that reached dispatch (the connection answers it itself).
    NotAllowedHere,
}

impl OperatorDenial {
    fn code(&self) -> Code {
        use OperatorDenial as D;
        match self {
            D::UnknownServer | D::NoCallWaiting | D::NoFormWaiting => Code::NotFound,
            D::LogoutFailed(_) => Code::Failed,
            D::DigestNeedsOneId
            | D::DigestRequired
            | D::DigestMismatch
            | D::AnswerInvalid(_)
            | D::BadOffset { .. } => Code::Refused,
            D::NotAllowedHere => Code::Protocol,
        }
    }

    fn reason(&self) -> Reason {
        use OperatorDenial as D;
        match self {
            D::UnknownServer => Reason::UnknownServer,
            D::LogoutFailed(_) => Reason::LogoutFailed,
            D::DigestNeedsOneId => Reason::DigestNeedsOneId,
            D::DigestRequired => Reason::DigestRequired,
            D::DigestMismatch => Reason::DigestMismatch,
            D::NoCallWaiting | D::NoFormWaiting => Reason::NotWaiting,
            D::AnswerInvalid(_) => Reason::AnswerInvalid,
            D::BadOffset { .. } => Reason::BadOffset,
            D::NotAllowedHere => Reason::NotAllowedHere,
        }
    }

    fn message(&self) -> String {
        use OperatorDenial as D;
        match self {
            D::UnknownServer => UNKNOWN_SERVER.into(),
            D::LogoutFailed(why) => why.clone(),
            D::DigestNeedsOneId => "a digest names one call: give it with id, not ids".into(),
            D::DigestRequired => "this call was parked by a noninteractive broker: approve it \
                                  with its args_sha256"
                .into(),
            D::DigestMismatch => {
                "the digest is not that of the waiting call; nothing was decided".into()
            }
            D::NoCallWaiting => "no such call is waiting".into(),
            D::NoFormWaiting => "no such form is waiting".into(),
            D::AnswerInvalid(why) => format!("the answer does not fit the form: {why}"),
            D::BadOffset { offset, len } => {
                format!("offset {offset} is not a character boundary of the {len}-byte arguments")
            }
            D::NotAllowedHere => "request not allowed here".into(),
        }
    }

    /// The refusal sent to the operator: code, message and reason, all from here.
    pub(super) fn refusal(&self) -> Refusal {
        Refusal::new(self.code(), &self.message()).with_reason(self.reason())
    }
}

impl From<OperatorDenial> for Refusal {
    fn from(d: OperatorDenial) -> Refusal {
        d.refusal()
    }
}

/// The denial when a server cannot be reached.
pub(super) fn slot_denial(e: &SlotError) -> Denial {
    match e {
        SlotError::StaleSession => Denial::StaleSession,
        SlotError::ShuttingDown => Denial::ShuttingDown,
        _ => Denial::ServerUnavailable,
    }
}

/// The audit outcome of a call that was not approved.
fn not_approved_reason(why: NotApproved) -> Reason {
    match why {
        NotApproved::Noninteractive => Reason::ApprovalRequired,
        NotApproved::Denied => Reason::Denied,
        NotApproved::TimedOut => Reason::ApprovalTimedOut,
        NotApproved::Full => Reason::ApprovalQueueFull,
        NotApproved::ShuttingDown => Reason::ShuttingDown,
    }
}

/// What the agent is told when a call was not approved.
fn not_approved_message(why: NotApproved) -> String {
    match why {
        NotApproved::Noninteractive => "this call needs an operator's approval (no approval rule approves it), and this broker is noninteractive; nothing was sent".to_owned(),
        NotApproved::Denied => "the operator denied this call; nothing was sent".to_owned(),
        NotApproved::TimedOut => "no operator approved this call in time; nothing was sent".to_owned(),
        NotApproved::Full => format!(
            "{} calls are already waiting for approval; nothing was sent",
            approvals::MAX_PENDING
        ),
        NotApproved::ShuttingDown => "the broker is shutting down; nothing was sent".to_owned(),
    }
}

/// The machine-readable kind of a failed effect: a server's own error answer, a timeout, a
/// refused credential, a broken connection or protocol, a bound, refused input.
pub(super) fn failure_reason(e: &McpError) -> Reason {
    match e {
        McpError::Rpc { .. } => Reason::ServerError,
        McpError::Transport(t) => match t.kind {
            TransportErrorKind::Timeout => Reason::TimedOut,
            TransportErrorKind::Unauthorized { .. } | TransportErrorKind::NoCredential(_) => {
                Reason::Unauthorized
            }
            _ => Reason::ConnectionFailed,
        },
        McpError::Protocol { .. } => Reason::ProtocolViolation,
        McpError::Limit { .. } => Reason::LimitExceeded,
        McpError::InputRefused(_) => Reason::InputRefused,
        McpError::UnknownTool => Reason::UnknownTool,
        McpError::AfterInputRounds { error, .. } => failure_reason(error),
        _ => Reason::Failed,
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
            K::NoCredential(_) => {
                "the broker holds no usable credential for the server; nothing was sent".to_owned()
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every cause the agent can meet, once.
    fn every_denial() -> Vec<Denial> {
        let mark = RuleMark {
            id: "r1".into(),
            digest: "d".into(),
        };
        let mut all = vec![
            Denial::PeerNotAllowed,
            Denial::UidConnectionsFull,
            Denial::ConnectionsFull,
            Denial::Version,
            Denial::BadClientLabel,
            Denial::AgentFieldsOnOperator,
            Denial::ModelWithoutAgentType,
            Denial::HelloConfigUnreadable,
            Denial::AgentTypeRefused("no agent definition with that name".into()),
            Denial::NotAllowedHere,
            Denial::ShutdownDuringRequest,
            Denial::AnswerTooLarge,
            Denial::UnknownTool,
            Denial::UnknownServer,
            Denial::UnknownSkill,
            Denial::SkillChanged,
            Denial::PromptTooLong,
            Denial::ConfigUnreadable,
            Denial::ListFailed("the server did not list its prompts".into()),
            Denial::ChildTurnsSpent,
            Denial::ChildErrorLimit,
            Denial::ChildWallSpent,
            Denial::ChildWallDuringCall,
            Denial::ArgumentsBudgetFull,
            Denial::ArgumentsNotUtf8,
            Denial::BadRequest("the uri is empty; nothing was sent"),
            Denial::AuditUnwritable(Gate::Failed),
            Denial::StaleSession,
            Denial::ShuttingDown,
            Denial::ServerUnavailable,
            Denial::BlockedByHook("no".into()),
            Denial::DeniedByRule(mark),
            Denial::ServerRestarted,
            Denial::CancelledWhileWaiting,
            Denial::DispatchNotRecorded(Gate::LowSpace { free: 1 }),
            Denial::CancelledDuringEffect,
            Denial::EffectFailed {
                message: "the call did not complete in time".into(),
                certainty: Certainty::MaybeApplied,
                reason: Reason::TimedOut,
            },
        ];
        for why in [
            NotApproved::Noninteractive,
            NotApproved::Denied,
            NotApproved::TimedOut,
            NotApproved::Full,
            NotApproved::ShuttingDown,
        ] {
            all.push(Denial::NotApproved(
                why,
                Some("rule r2 did not approve".into()),
            ));
        }
        all
    }

    #[test]
    fn every_denial_is_one_short_line_with_a_reason_and_says_what_was_sent() {
        for d in every_denial() {
            let v = d.refusal().to_value();
            let line = v.to_string();
            assert!(line.len() <= 512 + 64, "{line}");
            assert!(!v["message"].as_str().unwrap().contains('\n'), "{line}");
            let reason = v["reason"].as_str().unwrap();
            assert!(
                !reason.is_empty()
                    && reason
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{line}"
            );
            // A message that says nothing was sent carries not_sent, and one that says the
            // effect may have happened carries maybe_applied: text and certainty never disagree.
            let msg = v["message"].as_str().unwrap();
            if msg.contains("nothing was sent") {
                assert_eq!(v["certainty"], "not_sent", "{line}");
            }
            if msg.contains("may or may not have been applied") {
                assert_eq!(v["certainty"], "maybe_applied", "{line}");
            }
            // An effect request's audit record and the wire agree on why.
            let (decision, outcome) = d.audit();
            assert!(!decision.as_str().is_empty() && !outcome.as_str().is_empty());
        }
    }

    #[test]
    fn docs_ipc_lists_every_reason_the_broker_sends() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/ipc.md"))
            .unwrap();
        let table = &doc[doc.find("| reason | cause |").unwrap()..];
        let table = &table[..table.find("\n\n").unwrap_or(table.len())];
        // Both ways: every reason of the closed set is listed, and the table lists no other.
        for r in Reason::ALL {
            assert!(
                table.contains(&format!("`{}`", r.as_str())),
                "docs/ipc.md does not list {}",
                r.as_str()
            );
        }
        for row in table.lines().skip(2) {
            let words = row.split('|').nth(1).unwrap_or_default();
            for w in words.split('`').skip(1).step_by(2) {
                assert!(
                    Reason::ALL.iter().any(|r| r.as_str() == w),
                    "docs/ipc.md lists {w}, which is no reason the broker sends"
                );
            }
        }
        // And every denial gives one of them.
        for d in every_denial() {
            assert!(Reason::ALL.contains(&d.reason()), "{d:?}");
        }
    }

    #[test]
    fn every_operator_denial_has_its_code_reason_and_one_line() {
        use OperatorDenial as D;
        let all = [
            (D::UnknownServer, Code::NotFound, "unknown_server"),
            (
                D::LogoutFailed("revocation failed (HTTP 500)".into()),
                Code::Failed,
                "logout_failed",
            ),
            (D::DigestNeedsOneId, Code::Refused, "digest_needs_one_id"),
            (D::DigestRequired, Code::Refused, "digest_required"),
            (D::DigestMismatch, Code::Refused, "digest_mismatch"),
            (D::NoCallWaiting, Code::NotFound, "not_waiting"),
            (D::NoFormWaiting, Code::NotFound, "not_waiting"),
            (
                D::AnswerInvalid("\"age\" is below 0".into()),
                Code::Refused,
                "answer_invalid",
            ),
            (
                D::BadOffset { offset: 3, len: 9 },
                Code::Refused,
                "bad_offset",
            ),
            (D::NotAllowedHere, Code::Protocol, "not_allowed_here"),
        ];
        for (d, code, reason) in all {
            let wire = d.refusal().to_value();
            assert_eq!(wire["code"], code.as_str(), "{d:?}");
            assert_eq!(wire["reason"], reason, "{d:?}");
            assert!(Reason::ALL.contains(&d.reason()), "{d:?}");
            let m = wire["message"].as_str().unwrap();
            assert!(!m.is_empty() && !m.contains('\n'), "{d:?}: {m}");
        }
        assert_eq!(
            D::BadOffset { offset: 3, len: 9 }.refusal().to_value()["message"],
            "offset 3 is not a character boundary of the 9-byte arguments"
        );
    }

    #[test]
    fn failure_reasons_follow_the_mcp_error() {
        let t = |kind| {
            McpError::Transport(crate::mcp::TransportError {
                kind,
                certainty: Certainty::NotSent,
            })
        };
        assert_eq!(
            failure_reason(&t(TransportErrorKind::Timeout)),
            Reason::TimedOut
        );
        assert_eq!(
            failure_reason(&McpError::InputRefused("x".into())),
            Reason::InputRefused
        );
        assert_eq!(failure_reason(&McpError::UnknownTool), Reason::UnknownTool);
    }

    #[test]
    fn a_denial_is_told_apart_from_a_timeout_and_an_unknown_server_from_an_unknown_tool() {
        let tool = Denial::UnknownTool.refusal().to_value();
        let server = Denial::UnknownServer.refusal().to_value();
        assert_eq!(tool["code"], server["code"]);
        assert_eq!(tool["reason"], "unknown_tool");
        assert_eq!(server["reason"], "unknown_server");
        let denied = Denial::NotApproved(NotApproved::Denied, None)
            .refusal()
            .to_value();
        let timed_out = Denial::NotApproved(NotApproved::TimedOut, None)
            .refusal()
            .to_value();
        assert_eq!(denied["code"], timed_out["code"]);
        assert_ne!(denied["reason"], timed_out["reason"]);
        let rule = Denial::DeniedByRule(RuleMark {
            id: "d".into(),
            digest: "x".into(),
        })
        .refusal();
        assert_eq!(rule.code, Code::Refused);
        assert_eq!(rule.certainty, Some(Certainty::NotSent));
        assert!(rule.message().contains("rule d refuses"));
    }
}
