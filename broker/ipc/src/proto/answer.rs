//! Answers: the closed set of error codes, the refusal every error frame carries, what is
//! known about an effect, and the client's typed view of an answer frame.

use std::fmt;

use serde_json::{Value, json};

use iteron_policy::text;

/// Error codes on the wire (a closed set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// Malformed, oversized, unknown or out-of-state: the connection is closed.
    Protocol,
    /// The `hello` named a protocol version this broker does not speak.
    Version,
    /// No such (exposed) tool or server.
    UnknownTool,
    /// Refused by policy, a hook or the operator.
    Refused,
    /// The call needs operator approval and none can be given (noninteractive broker).
    ApprovalRequired,
    /// The effect failed; `certainty` says whether it may have been applied.
    Failed,
    /// A bound on concurrent work was reached; nothing was attempted.
    Busy,
    /// The broker is stopping.
    ShuttingDown,
    /// No such server or pending item (operator).
    NotFound,
    /// The call was cancelled (by the operator, or a restart/stop of its server).
    Cancelled,
}

impl Code {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Protocol => "protocol",
            Code::Version => "version",
            Code::UnknownTool => "unknown_tool",
            Code::Refused => "refused",
            Code::ApprovalRequired => "approval_required",
            Code::Failed => "failed",
            Code::Busy => "busy",
            Code::ShuttingDown => "shutting_down",
            Code::NotFound => "not_found",
            Code::Cancelled => "cancelled",
        }
    }

    /// Parse a wire name.
    pub fn parse(s: &str) -> Option<Code> {
        [
            Code::Protocol,
            Code::Version,
            Code::UnknownTool,
            Code::Refused,
            Code::ApprovalRequired,
            Code::Failed,
            Code::Busy,
            Code::ShuttingDown,
            Code::NotFound,
            Code::Cancelled,
        ]
        .into_iter()
        .find(|c| c.as_str() == s)
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The longest reason text on the wire (DESIGN §4: single line, ≤ 512 bytes).
pub const MAX_REASON: usize = text::MAX_LINE_BYTES;

/// An error answer: code plus a one-line, redacted, terminal-safe reason of at most
/// [`MAX_REASON`] bytes. Both constructors apply those rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The code.
    pub code: Code,
    message: String,
    /// For failed effects: whether the effect may have happened.
    pub certainty: Option<Certainty>,
    /// Why, in a fixed machine-readable vocabulary (docs/ipc.md), next to the code: it tells a
    /// denial from a timeout or a failure of the server.
    pub reason: Option<Reason>,
}

impl Refusal {
    /// Build one; `message` is made single-line, redacted and capped.
    pub fn new(code: Code, message: &str) -> Refusal {
        Refusal {
            code,
            message: text::single_line_capped(message, MAX_REASON),
            certainty: None,
            reason: None,
        }
    }

    /// Build one from a message that is already rendered (escaped once by
    /// [`text::single_line_capped`], like a hook's block reason, joined with fixed text): it is
    /// capped and redacted but not escaped again, so its backslashes are not doubled; anything
    /// unsafe in it is still escaped ([`text::cap_rendered`]).
    pub fn rendered(code: Code, message: &str) -> Refusal {
        Refusal {
            code,
            message: text::cap_rendered(message, MAX_REASON),
            certainty: None,
            reason: None,
        }
    }

    /// With the certainty of a failed effect.
    pub fn with_certainty(mut self, certainty: Certainty) -> Refusal {
        self.certainty = Some(certainty);
        self
    }

    /// With the machine-readable reason.
    pub fn with_reason(mut self, reason: Reason) -> Refusal {
        self.reason = Some(reason);
        self
    }

    /// The reason.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The `error` object.
    pub fn to_value(&self) -> Value {
        let mut v = json!({"code": self.code.as_str(), "message": self.message});
        if let Some(obj) = v.as_object_mut() {
            if let Some(r) = self.reason {
                obj.insert("reason".into(), r.as_str().into());
            }
            if let Some(c) = self.certainty {
                obj.insert("certainty".into(), c.as_str().into());
            }
        }
        v
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

/// What is known about whether a request's effect happened. No layer ever retries a request
/// whose certainty is [`Certainty::MaybeApplied`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Certainty {
    /// Nothing was sent, or the server refused the request before acting on it.
    NotSent,
    /// Bytes may have reached the server and no answer says what happened.
    MaybeApplied,
    /// The server answered.
    Applied,
}

impl Certainty {
    /// The spelling on the wire and in diagnostics.
    pub fn as_str(self) -> &'static str {
        match self {
            Certainty::NotSent => "not_sent",
            Certainty::MaybeApplied => "maybe_applied",
            Certainty::Applied => "applied",
        }
    }
}

/// Why a request was refused or failed, in the machine-readable vocabulary of the `reason`
/// field next to `code` (docs/ipc.md lists each): it tells a denial from a timeout or a failure
/// of the server. A closed set; the audit log records the same words as outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// `peer_uid_not_allowed`.
    PeerUidNotAllowed,
    /// `uid_connections_full`.
    UidConnectionsFull,
    /// `connections_full`.
    ConnectionsFull,
    /// `version`.
    Version,
    /// `bad_client_label`.
    BadClientLabel,
    /// `agent_fields_on_operator`.
    AgentFieldsOnOperator,
    /// `model_without_agent_type`.
    ModelWithoutAgentType,
    /// `config_unreadable`.
    ConfigUnreadable,
    /// `agent_type_refused`.
    AgentTypeRefused,
    /// `not_allowed_here`.
    NotAllowedHere,
    /// `shutting_down`.
    ShuttingDown,
    /// `answer_too_large`.
    AnswerTooLarge,
    /// `unknown_tool`.
    UnknownTool,
    /// `unknown_server`.
    UnknownServer,
    /// `unknown_skill`.
    UnknownSkill,
    /// `changed_since_discovery`.
    ChangedSinceDiscovery,
    /// `prompt_too_long`.
    PromptTooLong,
    /// `list_failed`.
    ListFailed,
    /// `turn_budget_spent`.
    TurnBudgetSpent,
    /// `error_budget_spent`.
    ErrorBudgetSpent,
    /// `wall_budget_spent`.
    WallBudgetSpent,
    /// `cancelled_by_budget`.
    CancelledByBudget,
    /// `arguments_budget_full`.
    ArgumentsBudgetFull,
    /// `arguments_not_utf8`.
    ArgumentsNotUtf8,
    /// `bad_request`.
    BadRequest,
    /// `audit_unavailable`.
    AuditUnavailable,
    /// `audit_low_space`.
    AuditLowSpace,
    /// `stale_session`.
    StaleSession,
    /// `server_unavailable`.
    ServerUnavailable,
    /// `server_restarted`.
    ServerRestarted,
    /// `blocked_by_hook`.
    BlockedByHook,
    /// `denied_by_rule`.
    DeniedByRule,
    /// `approval_required`.
    ApprovalRequired,
    /// `denied`.
    Denied,
    /// `approval_timed_out`.
    ApprovalTimedOut,
    /// `approval_queue_full`.
    ApprovalQueueFull,
    /// `cancelled_by_operator`.
    CancelledByOperator,
    /// `server_error`.
    ServerError,
    /// `timed_out`.
    TimedOut,
    /// `unauthorized`.
    Unauthorized,
    /// `connection_failed`.
    ConnectionFailed,
    /// `protocol_violation`.
    ProtocolViolation,
    /// `limit_exceeded`.
    LimitExceeded,
    /// `input_refused`.
    InputRefused,
    /// `failed`.
    Failed,
    /// `not_waiting`.
    NotWaiting,
    /// `digest_needs_one_id`.
    DigestNeedsOneId,
    /// `digest_required`.
    DigestRequired,
    /// `digest_mismatch`.
    DigestMismatch,
    /// `answer_invalid`.
    AnswerInvalid,
    /// `bad_offset`.
    BadOffset,
    /// `logout_failed`.
    LogoutFailed,
}

impl Reason {
    /// Every reason, once.
    pub const ALL: [Reason; 52] = [
        Reason::PeerUidNotAllowed,
        Reason::UidConnectionsFull,
        Reason::ConnectionsFull,
        Reason::Version,
        Reason::BadClientLabel,
        Reason::AgentFieldsOnOperator,
        Reason::ModelWithoutAgentType,
        Reason::ConfigUnreadable,
        Reason::AgentTypeRefused,
        Reason::NotAllowedHere,
        Reason::ShuttingDown,
        Reason::AnswerTooLarge,
        Reason::UnknownTool,
        Reason::UnknownServer,
        Reason::UnknownSkill,
        Reason::ChangedSinceDiscovery,
        Reason::PromptTooLong,
        Reason::ListFailed,
        Reason::TurnBudgetSpent,
        Reason::ErrorBudgetSpent,
        Reason::WallBudgetSpent,
        Reason::CancelledByBudget,
        Reason::ArgumentsBudgetFull,
        Reason::ArgumentsNotUtf8,
        Reason::BadRequest,
        Reason::AuditUnavailable,
        Reason::AuditLowSpace,
        Reason::StaleSession,
        Reason::ServerUnavailable,
        Reason::ServerRestarted,
        Reason::BlockedByHook,
        Reason::DeniedByRule,
        Reason::ApprovalRequired,
        Reason::Denied,
        Reason::ApprovalTimedOut,
        Reason::ApprovalQueueFull,
        Reason::CancelledByOperator,
        Reason::ServerError,
        Reason::TimedOut,
        Reason::Unauthorized,
        Reason::ConnectionFailed,
        Reason::ProtocolViolation,
        Reason::LimitExceeded,
        Reason::InputRefused,
        Reason::Failed,
        Reason::NotWaiting,
        Reason::DigestNeedsOneId,
        Reason::DigestRequired,
        Reason::DigestMismatch,
        Reason::AnswerInvalid,
        Reason::BadOffset,
        Reason::LogoutFailed,
    ];

    /// The word on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::PeerUidNotAllowed => "peer_uid_not_allowed",
            Reason::UidConnectionsFull => "uid_connections_full",
            Reason::ConnectionsFull => "connections_full",
            Reason::Version => "version",
            Reason::BadClientLabel => "bad_client_label",
            Reason::AgentFieldsOnOperator => "agent_fields_on_operator",
            Reason::ModelWithoutAgentType => "model_without_agent_type",
            Reason::ConfigUnreadable => "config_unreadable",
            Reason::AgentTypeRefused => "agent_type_refused",
            Reason::NotAllowedHere => "not_allowed_here",
            Reason::ShuttingDown => "shutting_down",
            Reason::AnswerTooLarge => "answer_too_large",
            Reason::UnknownTool => "unknown_tool",
            Reason::UnknownServer => "unknown_server",
            Reason::UnknownSkill => "unknown_skill",
            Reason::ChangedSinceDiscovery => "changed_since_discovery",
            Reason::PromptTooLong => "prompt_too_long",
            Reason::ListFailed => "list_failed",
            Reason::TurnBudgetSpent => "turn_budget_spent",
            Reason::ErrorBudgetSpent => "error_budget_spent",
            Reason::WallBudgetSpent => "wall_budget_spent",
            Reason::CancelledByBudget => "cancelled_by_budget",
            Reason::ArgumentsBudgetFull => "arguments_budget_full",
            Reason::ArgumentsNotUtf8 => "arguments_not_utf8",
            Reason::BadRequest => "bad_request",
            Reason::AuditUnavailable => "audit_unavailable",
            Reason::AuditLowSpace => "audit_low_space",
            Reason::StaleSession => "stale_session",
            Reason::ServerUnavailable => "server_unavailable",
            Reason::ServerRestarted => "server_restarted",
            Reason::BlockedByHook => "blocked_by_hook",
            Reason::DeniedByRule => "denied_by_rule",
            Reason::ApprovalRequired => "approval_required",
            Reason::Denied => "denied",
            Reason::ApprovalTimedOut => "approval_timed_out",
            Reason::ApprovalQueueFull => "approval_queue_full",
            Reason::CancelledByOperator => "cancelled_by_operator",
            Reason::ServerError => "server_error",
            Reason::TimedOut => "timed_out",
            Reason::Unauthorized => "unauthorized",
            Reason::ConnectionFailed => "connection_failed",
            Reason::ProtocolViolation => "protocol_violation",
            Reason::LimitExceeded => "limit_exceeded",
            Reason::InputRefused => "input_refused",
            Reason::Failed => "failed",
            Reason::NotWaiting => "not_waiting",
            Reason::DigestNeedsOneId => "digest_needs_one_id",
            Reason::DigestRequired => "digest_required",
            Reason::DigestMismatch => "digest_mismatch",
            Reason::AnswerInvalid => "answer_invalid",
            Reason::BadOffset => "bad_offset",
            Reason::LogoutFailed => "logout_failed",
        }
    }
}

/// A request that cannot be served: the error frame to send before closing. `id` is `None`
/// when the frame's id could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fatal {
    /// The request id, if it could be read.
    pub id: Option<u64>,
    /// What to send.
    pub refusal: Refusal,
}

/// The longest code, reason or certainty word a client accepts in an error answer.
pub const MAX_WORD: usize = 32;

/// A word of the error vocabulary as it arrives (a code, a reason or a certainty): 1 to
/// [`MAX_WORD`] bytes of ASCII lowercase letters and `_`. A newer broker may send words this
/// client does not know; they are kept as sent because they are plain.
fn plain_word(v: &Value) -> Option<String> {
    let s = v.as_str()?;
    (!s.is_empty() && s.len() <= MAX_WORD && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        .then(|| s.to_owned())
}

/// An `error` object as a client reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    /// The code (one of [`Code`] from this broker; kept as sent).
    pub code: String,
    /// The reason text, as sent (a client caps and checks it again before showing it).
    pub message: String,
    /// The machine-readable reason (docs/ipc.md), when the broker gives one.
    pub reason: Option<String>,
    /// For failed effects: whether the effect may have happened.
    pub certainty: Option<String>,
}

/// An answer frame as a client reads it: `{"id": n, "result": {...}}` or
/// `{"id": n | null, "error": {...}}`, nothing else.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The request it answers (`None`: a fatal error sent before the id could be read).
    pub id: Option<u64>,
    /// The result object, or the error.
    pub outcome: Result<Value, WireError>,
}

impl Reply {
    /// Read an answer frame strictly: an unknown key, a missing or non-integer id on a result,
    /// a result that is not an object, an error without a plain code or a string message is
    /// `None` (not a valid answer).
    pub fn parse(v: &Value) -> Option<Reply> {
        let frame = v.as_object()?;
        let id = match frame.get("id")? {
            Value::Null => None,
            n => Some(n.as_u64()?),
        };
        if frame.len() != 2 {
            return None;
        }
        if let Some(result) = frame.get("result") {
            return (id.is_some() && result.is_object()).then(|| Reply {
                id,
                outcome: Ok(result.clone()),
            });
        }
        let error = frame.get("error")?.as_object()?;
        if error
            .keys()
            .any(|k| !matches!(k.as_str(), "code" | "message" | "reason" | "certainty"))
        {
            return None;
        }
        let word = |k: &str| match error.get(k) {
            None => Some(None),
            Some(w) => plain_word(w).map(Some),
        };
        Some(Reply {
            id,
            outcome: Err(WireError {
                code: plain_word(error.get("code")?)?,
                message: error.get("message")?.as_str()?.to_owned(),
                reason: word("reason")?,
                certainty: word("certainty")?,
            }),
        })
    }

    /// The frame again, as the broker writes it.
    pub fn to_value(&self) -> Value {
        match &self.outcome {
            Ok(result) => json!({"id": self.id, "result": result}),
            Err(e) => {
                let mut error = serde_json::Map::new();
                error.insert("code".into(), e.code.clone().into());
                error.insert("message".into(), e.message.clone().into());
                if let Some(r) = &e.reason {
                    error.insert("reason".into(), r.clone().into());
                }
                if let Some(c) = &e.certainty {
                    error.insert("certainty".into(), c.clone().into());
                }
                json!({"id": self.id, "error": error})
            }
        }
    }
}
