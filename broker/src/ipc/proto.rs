//! The request vocabulary of both sockets, and the one dispatch table.
//!
//! A frame body is `{"id": <u64>, "method": "<name>", "params": {...}}` (`params` may be
//! omitted when a request takes none). Each socket has a closed set of methods; the table below
//! says, per method, which socket accepts it, which capability class it exercises and in which
//! session states it is allowed. Anything else — malformed JSON, an unknown or duplicate key,
//! an unknown method, a method of the other socket, a method out of state — is a protocol error:
//! the broker answers with one error frame and closes the connection.
//!
//! Answers are `{"id": n, "result": {...}}` or `{"id": n, "error": {"code", "message"}}`; a
//! fatal error before the id could be read carries `"id": null`.

use std::fmt;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use iteron_policy::capability::Capability;
use iteron_policy::text;

/// The protocol version this broker speaks (the `hello` request must name it).
pub const PROTOCOL_VERSION: u32 = 1;

/// Which socket a connection came in on. Each has its own closed set of requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The unprivileged agent.
    Agent,
    /// The operator (approvals, live server control).
    Operator,
}

/// Where a connection's session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Connected; only `hello` is allowed.
    AwaitingHello,
    /// After a successful `hello`.
    Open,
}

/// What a request is (one per table row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Open the session.
    Hello,
    /// The exposed tools.
    ListTools,
    /// Call one exposed tool (an effect).
    CallTool,
    /// End the session.
    EndSession,
    /// The skill index.
    ListSkills,
    /// One skill's body.
    UseSkill,
    /// Look up an agent definition.
    ResolveAgent,
    /// A user prompt (runs the `UserPromptSubmit` hooks).
    SubmitPrompt,
    /// One server's resources.
    ListResources,
    /// Read one resource (an effect, approved per call).
    ReadResource,
    /// One server's prompts.
    ListPrompts,
    /// Get one prompt (an effect, approved per call).
    GetPrompt,
    /// Server phases (operator).
    Status,
    /// Cancel a server's in-flight calls (operator).
    Cancel,
    /// Restart a server (operator).
    Restart,
    /// Stop a server (operator).
    Stop,
    /// Revoke and forget a server's externally managed token (operator).
    Logout,
    /// Pending approvals and forms (operator).
    Pending,
    /// Approve or deny one pending call (operator).
    Decide,
    /// Answer one pending form (operator).
    Answer,
    /// One pending call with its whole arguments (operator).
    Show,
    /// The skills and agent definitions the broker discovered at start (operator).
    Catalog,
}

/// One row of the dispatch table.
#[derive(Debug)]
pub struct Entry {
    /// The method name on the wire.
    pub method: &'static str,
    /// The socket that accepts it.
    pub role: Role,
    /// The request kind.
    pub kind: Kind,
    /// The capability class it exercises (`None`: session control or operator control).
    pub class: Option<Capability>,
    /// The states in which it is allowed.
    pub states: &'static [State],
}

const OPEN: &[State] = &[State::Open];
const NEW: &[State] = &[State::AwaitingHello];

/// The dispatch table: every request either socket accepts, and nothing else.
pub const TABLE: &[Entry] = &[
    Entry {
        method: "hello",
        role: Role::Agent,
        kind: Kind::Hello,
        class: None,
        states: NEW,
    },
    Entry {
        method: "list_tools",
        role: Role::Agent,
        kind: Kind::ListTools,
        class: Some(Capability::ReadOnly),
        states: OPEN,
    },
    Entry {
        method: "call_tool",
        role: Role::Agent,
        kind: Kind::CallTool,
        class: Some(Capability::IrreversibleExternal),
        states: OPEN,
    },
    Entry {
        method: "end_session",
        role: Role::Agent,
        kind: Kind::EndSession,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "list_skills",
        role: Role::Agent,
        kind: Kind::ListSkills,
        class: Some(Capability::ReadOnly),
        states: OPEN,
    },
    Entry {
        method: "use_skill",
        role: Role::Agent,
        kind: Kind::UseSkill,
        class: Some(Capability::ReadOnly),
        states: OPEN,
    },
    Entry {
        method: "resolve_agent",
        role: Role::Agent,
        kind: Kind::ResolveAgent,
        class: Some(Capability::ReadOnly),
        states: OPEN,
    },
    Entry {
        method: "submit_prompt",
        role: Role::Agent,
        kind: Kind::SubmitPrompt,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "list_resources",
        role: Role::Agent,
        kind: Kind::ListResources,
        class: Some(Capability::ReadOnly),
        states: OPEN,
    },
    Entry {
        method: "read_resource",
        role: Role::Agent,
        kind: Kind::ReadResource,
        class: Some(Capability::IrreversibleExternal),
        states: OPEN,
    },
    Entry {
        method: "list_prompts",
        role: Role::Agent,
        kind: Kind::ListPrompts,
        class: Some(Capability::ReadOnly),
        states: OPEN,
    },
    Entry {
        method: "get_prompt",
        role: Role::Agent,
        kind: Kind::GetPrompt,
        class: Some(Capability::IrreversibleExternal),
        states: OPEN,
    },
    Entry {
        method: "hello",
        role: Role::Operator,
        kind: Kind::Hello,
        class: None,
        states: NEW,
    },
    Entry {
        method: "status",
        role: Role::Operator,
        kind: Kind::Status,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "cancel",
        role: Role::Operator,
        kind: Kind::Cancel,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "restart",
        role: Role::Operator,
        kind: Kind::Restart,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "stop",
        role: Role::Operator,
        kind: Kind::Stop,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "logout",
        role: Role::Operator,
        kind: Kind::Logout,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "pending",
        role: Role::Operator,
        kind: Kind::Pending,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "decide",
        role: Role::Operator,
        kind: Kind::Decide,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "answer",
        role: Role::Operator,
        kind: Kind::Answer,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "show",
        role: Role::Operator,
        kind: Kind::Show,
        class: None,
        states: OPEN,
    },
    Entry {
        method: "catalog",
        role: Role::Operator,
        kind: Kind::Catalog,
        class: None,
        states: OPEN,
    },
];

/// Find a method's row for a socket.
pub fn lookup(role: Role, method: &str) -> Option<&'static Entry> {
    TABLE.iter().find(|e| e.role == role && e.method == method)
}

/// `hello` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// The protocol version the client speaks.
    pub protocol: u32,
    /// A label for the client (shown to the operator and audited; at most 64 bytes).
    #[serde(default)]
    pub client: String,
    /// Open a child session bound to this agent definition (exact, case-sensitive name).
    #[serde(default)]
    pub agent_type: Option<String>,
    /// A model override for the child (only `inherit` is accepted by this broker).
    #[serde(default)]
    pub model: Option<String>,
}

/// `use_skill` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UseSkill {
    /// The skill's name.
    pub name: String,
}

/// `resolve_agent` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolveAgent {
    /// The requested `agentType`.
    pub agent_type: String,
    /// A model override.
    #[serde(default)]
    pub model: Option<String>,
}

/// `submit_prompt` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitPrompt {
    /// The prompt text (at most [`MAX_PROMPT`] bytes).
    pub prompt: String,
}

/// Longest prompt in `submit_prompt`.
pub const MAX_PROMPT: usize = 256 * 1024;

/// `call_tool` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallTool {
    /// The server's configured name.
    pub server: String,
    /// The tool's name.
    pub tool: String,
    /// The arguments (an object).
    #[serde(default)]
    pub arguments: Map<String, Value>,
}

/// `read_resource` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadResource {
    /// The server's configured name.
    pub server: String,
    /// The resource's URI (at most [`MAX_RESOURCE_URI`] bytes, no control characters).
    pub uri: String,
}

/// Longest resource URI a request may name.
pub const MAX_RESOURCE_URI: usize = 2048;

/// `get_prompt` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GetPrompt {
    /// The server's configured name.
    pub server: String,
    /// The prompt's name.
    pub name: String,
    /// The prompt's arguments (string values, as MCP defines them).
    #[serde(default)]
    pub arguments: std::collections::BTreeMap<String, String>,
}

/// A request naming one server (operator control, and the agent's resource and prompt lists).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerArg {
    /// The server's configured name.
    pub server: String,
}

/// `status` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StatusArg {
    /// One server, or all.
    #[serde(default)]
    pub server: Option<String>,
}

/// The longest `pending` long-poll.
pub const MAX_PENDING_WAIT_MS: u64 = 30_000;

/// `pending` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PendingArg {
    /// When nothing is waiting, wait up to this long for something to arrive (at most
    /// [`MAX_PENDING_WAIT_MS`], more is a protocol error; default 0: answer at once).
    #[serde(default)]
    pub wait_ms: u64,
}

/// `decide` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decide {
    /// The pending call's id …
    #[serde(default)]
    pub id: Option<u64>,
    /// … or several, each decided alike (at most [`MAX_DECIDE_IDS`]; exactly one of `id` and
    /// `ids` is given).
    #[serde(default)]
    pub ids: Vec<u64>,
    /// Approve (true) or deny (false).
    pub approve: bool,
    /// The call's argument digest (with `id` only): when given, a call whose digest differs is
    /// not decided; a call parked by a noninteractive broker (deferred approval) is approved
    /// only with it.
    #[serde(default)]
    pub args_sha256: Option<String>,
}

/// Most ids in one `decide`.
pub const MAX_DECIDE_IDS: usize = 64;

impl Decide {
    /// The ids decided, in order.
    pub fn all(&self) -> Vec<u64> {
        self.id
            .into_iter()
            .chain(self.ids.iter().copied())
            .collect()
    }
}

/// What the operator does with a form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FormAction {
    /// Submit the content.
    Accept,
    /// Decline the request.
    Decline,
    /// Dismiss it.
    Cancel,
}

/// `answer` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Answer {
    /// The pending form's id.
    pub id: u64,
    /// What to do.
    pub action: FormAction,
    /// The answers (for `accept`).
    #[serde(default)]
    pub content: Map<String, Value>,
}

/// `show` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Show {
    /// The pending call's id.
    pub id: u64,
    /// Where in the call's canonical arguments the answer starts (a byte offset on a character
    /// boundary; default 0). Arguments longer than one answer carries come in several.
    #[serde(default)]
    pub offset: usize,
}

/// A decoded request.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// `hello`.
    Hello(Hello),
    /// `list_tools`.
    ListTools,
    /// `call_tool`.
    CallTool(CallTool),
    /// `end_session`.
    EndSession,
    /// `list_skills`.
    ListSkills,
    /// `use_skill`.
    UseSkill(UseSkill),
    /// `resolve_agent`.
    ResolveAgent(ResolveAgent),
    /// `submit_prompt`.
    SubmitPrompt(SubmitPrompt),
    /// `list_resources`.
    ListResources(ServerArg),
    /// `read_resource`.
    ReadResource(ReadResource),
    /// `list_prompts`.
    ListPrompts(ServerArg),
    /// `get_prompt`.
    GetPrompt(GetPrompt),
    /// `status`.
    Status(StatusArg),
    /// `cancel`.
    Cancel(ServerArg),
    /// `restart`.
    Restart(ServerArg),
    /// `stop`.
    Stop(ServerArg),
    /// `logout` (operator).
    Logout(ServerArg),
    /// `pending`.
    Pending(PendingArg),
    /// `decide`.
    Decide(Decide),
    /// `answer`.
    Answer(Answer),
    /// `show`.
    Show(Show),
    /// `catalog` (operator).
    Catalog,
}

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
    pub reason: Option<&'static str>,
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
    pub fn with_reason(mut self, reason: &'static str) -> Refusal {
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
                obj.insert("reason".into(), r.into());
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

/// A request that cannot be served: the error frame to send before closing. `id` is `None`
/// when the frame's id could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fatal {
    /// The request id, if it could be read.
    pub id: Option<u64>,
    /// What to send.
    pub refusal: Refusal,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    id: u64,
    method: String,
    /// Kept raw so that the typed parameter structs see every key (a duplicate key is an
    /// error there; a `Value` would silently keep the last one).
    #[serde(default)]
    params: Option<Box<serde_json::value::RawValue>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParams {}

fn params<T: DeserializeOwned>(
    p: Option<Box<serde_json::value::RawValue>>,
    id: u64,
    method: &str,
) -> Result<T, Fatal> {
    let raw = p.as_deref().map_or("{}", serde_json::value::RawValue::get);
    serde_json::from_str(raw).map_err(|e| Fatal {
        id: Some(id),
        refusal: Refusal::new(
            Code::Protocol,
            &format!("invalid parameters for {method}: {}", serde_detail(&e)),
        ),
    })
}

/// serde's message, without the caller's text: "unknown field `x`" and "invalid type: string
/// \"x\"" quote what the caller sent, so those parts are dropped; field names of our own
/// (missing or duplicate fields) and JSON syntax positions are kept.
fn serde_detail(e: &serde_json::Error) -> String {
    let s = e.to_string();
    let out = if s.starts_with("unknown field") {
        "unknown field".to_owned()
    } else if s.starts_with("unknown variant") {
        "unknown value".to_owned()
    } else if s.starts_with("invalid ") {
        let head = s.split(':').next().unwrap_or("invalid value");
        match s.find(", expected") {
            Some(i) => format!("{head}{}", &s[i..]),
            None => head.to_owned(),
        }
    } else {
        s
    };
    text::single_line_capped(&out, 160)
}

/// Most JSON nodes in one request's `params`. A node is an object, an array, a string (an
/// object's keys included), a number, `true`, `false` or `null`: what decoding allocates for.
/// Bytes alone do not bound memory: a 1 MiB frame of empty objects (`[{},{},…]`) decodes to
/// about 48 MB of tree. The envelope around `params` has a fixed shape (`id`, `method`).
pub const MAX_NODES: usize = 65_536;

/// How many JSON nodes (see [`MAX_NODES`]) the text `json` holds, counting no further than
/// `stop_after + 1`. A scan of the bytes that builds nothing, run before the text is decoded.
/// For valid JSON the count is exact; for anything else it is some number, and decoding
/// refuses that text anyway.
fn count_nodes(json: &[u8], stop_after: usize) -> usize {
    let mut nodes = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut in_scalar = false;
    for &b in json {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => {
                nodes += 1;
                in_string = true;
                in_scalar = false;
            }
            b'{' | b'[' => {
                nodes += 1;
                in_scalar = false;
            }
            // Numbers and the literals: one node per run of their characters.
            b'-' | b'+' | b'.' | b'0'..=b'9' | b'a'..=b'z' | b'A'..=b'Z' => {
                if !in_scalar {
                    nodes += 1;
                    in_scalar = true;
                }
            }
            _ => in_scalar = false,
        }
        if nodes > stop_after {
            break;
        }
    }
    nodes
}

/// Decode one frame body arriving on `role`'s socket in `state`. Every failure is fatal for
/// the connection.
pub fn decode(
    role: Role,
    state: State,
    body: &[u8],
) -> Result<(u64, &'static Entry, Request), Fatal> {
    decode_bounded(role, state, body, MAX_NODES)
}

fn decode_bounded(
    role: Role,
    state: State,
    body: &[u8],
    max_nodes: usize,
) -> Result<(u64, &'static Entry, Request), Fatal> {
    // The envelope keeps `params` as raw text (checked, not built): nothing is allocated for
    // its nodes until they have been counted.
    let env: Envelope = serde_json::from_slice(body).map_err(|e| Fatal {
        id: None,
        refusal: Refusal::new(
            Code::Protocol,
            &format!("malformed frame: {}", serde_detail(&e)),
        ),
    })?;
    let id = env.id;
    if let Some(p) = env.params.as_deref()
        && count_nodes(p.get().as_bytes(), max_nodes) > max_nodes
    {
        return Err(Fatal {
            id: Some(id),
            refusal: Refusal::new(
                Code::Protocol,
                &format!("params hold more than {max_nodes} JSON nodes"),
            ),
        });
    }
    let Some(entry) = lookup(role, &env.method) else {
        return Err(Fatal {
            id: Some(id),
            refusal: Refusal::new(Code::Protocol, "unknown request"),
        });
    };
    if !entry.states.contains(&state) {
        let why = match state {
            State::AwaitingHello => format!("{} before hello", entry.method),
            State::Open => format!("{} is not allowed in an open session", entry.method),
        };
        return Err(Fatal {
            id: Some(id),
            refusal: Refusal::new(Code::Protocol, &why),
        });
    }
    let m = entry.method;
    let req = match entry.kind {
        Kind::Hello => Request::Hello(params(env.params, id, m)?),
        Kind::ListTools => {
            params::<NoParams>(env.params, id, m)?;
            Request::ListTools
        }
        Kind::CallTool => Request::CallTool(params(env.params, id, m)?),
        Kind::EndSession => {
            params::<NoParams>(env.params, id, m)?;
            Request::EndSession
        }
        Kind::ListSkills => {
            params::<NoParams>(env.params, id, m)?;
            Request::ListSkills
        }
        Kind::UseSkill => Request::UseSkill(params(env.params, id, m)?),
        Kind::ResolveAgent => Request::ResolveAgent(params(env.params, id, m)?),
        Kind::SubmitPrompt => Request::SubmitPrompt(params(env.params, id, m)?),
        Kind::ListResources => Request::ListResources(params(env.params, id, m)?),
        Kind::ReadResource => Request::ReadResource(params(env.params, id, m)?),
        Kind::ListPrompts => Request::ListPrompts(params(env.params, id, m)?),
        Kind::GetPrompt => Request::GetPrompt(params(env.params, id, m)?),
        Kind::Status => Request::Status(params(env.params, id, m)?),
        Kind::Cancel => Request::Cancel(params(env.params, id, m)?),
        Kind::Restart => Request::Restart(params(env.params, id, m)?),
        Kind::Stop => Request::Stop(params(env.params, id, m)?),
        Kind::Logout => Request::Logout(params(env.params, id, m)?),
        Kind::Pending => {
            let p: PendingArg = params(env.params, id, m)?;
            if p.wait_ms > MAX_PENDING_WAIT_MS {
                return Err(Fatal {
                    id: Some(id),
                    refusal: Refusal::new(
                        Code::Protocol,
                        &format!("pending takes wait_ms 0-{MAX_PENDING_WAIT_MS}"),
                    ),
                });
            }
            Request::Pending(p)
        }
        Kind::Decide => {
            let d: Decide = params(env.params, id, m)?;
            if d.id.is_some() != d.ids.is_empty() || d.ids.len() > MAX_DECIDE_IDS {
                return Err(Fatal {
                    id: Some(id),
                    refusal: Refusal::new(
                        Code::Protocol,
                        &format!("decide takes id, or ids (1-{MAX_DECIDE_IDS}), not both"),
                    ),
                });
            }
            Request::Decide(d)
        }
        Kind::Answer => Request::Answer(params(env.params, id, m)?),
        Kind::Show => Request::Show(params(env.params, id, m)?),
        Kind::Catalog => {
            params::<NoParams>(env.params, id, m)?;
            Request::Catalog
        }
    };
    Ok((id, entry, req))
}

/// A success answer.
pub fn ok_frame(id: u64, result: Value) -> Value {
    json!({"id": id, "result": result})
}

/// An error answer.
pub fn error_frame(id: Option<u64>, refusal: &Refusal) -> Value {
    json!({"id": id, "error": refusal.to_value()})
}

/// Encode a request (client side).
pub fn request_frame(id: u64, method: &str, params: Value) -> Value {
    json!({"id": id, "method": method, "params": params})
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn agent_open(body: &str) -> Result<(u64, &'static Entry, Request), Fatal> {
        decode(Role::Agent, State::Open, body.as_bytes())
    }

    #[test]
    fn every_method_has_exactly_one_row_per_socket() {
        for e in TABLE {
            let same: Vec<_> = TABLE
                .iter()
                .filter(|x| x.role == e.role && x.method == e.method)
                .collect();
            assert_eq!(same.len(), 1, "{}", e.method);
        }
        // Operator control is not reachable from the agent socket, and the reverse.
        for m in [
            "status", "cancel", "restart", "stop", "logout", "pending", "decide", "answer", "show",
        ] {
            assert!(lookup(Role::Agent, m).is_none(), "{m}");
        }
        for m in [
            "list_tools",
            "call_tool",
            "end_session",
            "list_skills",
            "use_skill",
            "resolve_agent",
            "submit_prompt",
        ] {
            assert!(lookup(Role::Operator, m).is_none(), "{m}");
        }
        // The only effect is classified irreversible_external.
        assert_eq!(
            lookup(Role::Agent, "call_tool").unwrap().class,
            Some(Capability::IrreversibleExternal)
        );
    }

    #[test]
    fn requests_decode_strictly() {
        let (id, e, r) = agent_open(
            r#"{"id":7,"method":"call_tool","params":{"server":"s","tool":"t","arguments":{"a":1}}}"#,
        )
        .unwrap();
        assert_eq!((id, e.kind), (7, Kind::CallTool));
        assert!(matches!(r, Request::CallTool(c) if c.server == "s" && c.arguments["a"] == 1));
        assert_eq!(
            agent_open(r#"{"id":1,"method":"list_tools"}"#).unwrap().2,
            Request::ListTools
        );
        for bad in [
            r#"{"id":1,"method":"list_tools","params":{"x":1}}"#,
            r#"{"id":1,"method":"list_tools","extra":1}"#,
            r#"{"id":1,"id":2,"method":"list_tools"}"#,
            r#"{"id":1,"method":"call_tool","params":{"server":"s","server":"t","tool":"x"}}"#,
            r#"{"id":1,"method":"call_tool","params":{"server":"s"}}"#,
            r#"{"id":1,"method":"call_tool","params":{"server":"s","tool":"t","arguments":[]}}"#,
            r#"{"id":-1,"method":"list_tools"}"#,
            r#"{"id":1,"method":"status"}"#,
            r#"{"id":1,"method":"hello","params":{"protocol":1}}"#,
            r#"{"method":"list_tools"}"#,
            r#"[1,2]"#,
            "\u{feff}{}",
            "",
        ] {
            let err = agent_open(bad).unwrap_err();
            assert_eq!(err.refusal.code, Code::Protocol, "{bad}");
        }
        let early = decode(
            Role::Agent,
            State::AwaitingHello,
            br#"{"id":3,"method":"call_tool","params":{"server":"s","tool":"t"}}"#,
        )
        .unwrap_err();
        assert_eq!(early.id, Some(3));
        assert!(early.refusal.message().contains("before hello"));
    }

    #[test]
    fn decide_takes_one_id_or_a_bounded_list() {
        let op = |params: &str| {
            decode(
                Role::Operator,
                State::Open,
                format!(r#"{{"id":1,"method":"decide","params":{params}}}"#).as_bytes(),
            )
        };
        assert!(op(r#"{"id":3,"approve":true}"#).is_ok());
        assert!(op(r#"{"ids":[3,4],"approve":false}"#).is_ok());
        let max: Vec<String> = (0..MAX_DECIDE_IDS).map(|i| i.to_string()).collect();
        assert!(op(&format!(r#"{{"ids":[{}],"approve":true}}"#, max.join(","))).is_ok());
        let over: Vec<String> = (0..=MAX_DECIDE_IDS).map(|i| i.to_string()).collect();
        for bad in [
            format!(r#"{{"ids":[{}],"approve":true}}"#, over.join(",")),
            r#"{"id":3,"ids":[4],"approve":true}"#.to_owned(),
            r#"{"approve":true}"#.to_owned(),
            r#"{"ids":[],"approve":true}"#.to_owned(),
        ] {
            assert_eq!(op(&bad).unwrap_err().refusal.code, Code::Protocol, "{bad}");
        }
    }

    #[test]
    fn show_takes_one_id_and_an_optional_offset() {
        let op = |params: &str| {
            decode(
                Role::Operator,
                State::Open,
                format!(r#"{{"id":1,"method":"show","params":{params}}}"#).as_bytes(),
            )
        };
        assert_eq!(
            op(r#"{"id":3}"#).unwrap().2,
            Request::Show(Show { id: 3, offset: 0 })
        );
        assert_eq!(
            op(r#"{"id":3,"offset":262144}"#).unwrap().2,
            Request::Show(Show {
                id: 3,
                offset: 262_144
            })
        );
        for bad in [
            "{}",
            r#"{"ids":[3]}"#,
            r#"{"id":3,"offset":-1}"#,
            r#"{"id":3,"x":1}"#,
        ] {
            assert_eq!(op(bad).unwrap_err().refusal.code, Code::Protocol, "{bad}");
        }
        assert!(lookup(Role::Agent, "show").is_none());
    }

    #[test]
    fn resource_and_prompt_requests_are_strict() {
        let agent = |method: &str, params: &str| {
            agent_open(&format!(
                r#"{{"id":1,"method":"{method}","params":{params}}}"#
            ))
        };
        assert!(agent("list_resources", r#"{"server":"s"}"#).is_ok());
        assert!(agent("list_prompts", r#"{"server":"s"}"#).is_ok());
        assert!(agent("read_resource", r#"{"server":"s","uri":"file:///x"}"#).is_ok());
        assert!(agent("get_prompt", r#"{"server":"s","name":"p"}"#).is_ok());
        assert!(
            agent(
                "get_prompt",
                r#"{"server":"s","name":"p","arguments":{"a":"b"}}"#
            )
            .is_ok()
        );
        for (method, bad) in [
            ("list_resources", r#"{}"#),
            ("list_resources", r#"{"server":"s","cursor":"c"}"#),
            ("read_resource", r#"{"server":"s"}"#),
            ("read_resource", r#"{"server":"s","uri":7}"#),
            (
                "get_prompt",
                r#"{"server":"s","name":"p","arguments":{"a":1}}"#,
            ),
            ("get_prompt", r#"{"server":"s","name":"p","arguments":[]}"#),
        ] {
            let e = agent(method, bad).unwrap_err();
            assert_eq!(e.refusal.code, Code::Protocol, "{method} {bad}");
        }
        // Reads are effects in the table, lists are not.
        let class = |m: &str| lookup(Role::Agent, m).unwrap().class;
        assert_eq!(
            class("read_resource"),
            Some(Capability::IrreversibleExternal)
        );
        assert_eq!(class("get_prompt"), Some(Capability::IrreversibleExternal));
        assert_eq!(class("list_resources"), Some(Capability::ReadOnly));
        assert!(lookup(Role::Operator, "read_resource").is_none());
    }

    #[test]
    fn pending_waits_at_most_thirty_seconds() {
        let op = |params: String| {
            decode(
                Role::Operator,
                State::Open,
                format!(r#"{{"id":1,"method":"pending","params":{params}}}"#).as_bytes(),
            )
        };
        assert!(op("{}".into()).is_ok());
        assert!(op(format!(r#"{{"wait_ms":{MAX_PENDING_WAIT_MS}}}"#)).is_ok());
        let over = op(format!(r#"{{"wait_ms":{}}}"#, MAX_PENDING_WAIT_MS + 1)).unwrap_err();
        assert_eq!(over.refusal.code, Code::Protocol);
        assert_eq!(over.refusal.message(), "pending takes wait_ms 0-30000");
        assert!(op(r#"{"wait_ms":-1}"#.into()).is_err());
        crate::test_report::record(
            "P5",
            "broker/src/ipc/proto.rs::pending_waits_at_most_thirty_seconds",
            json!({"max_wait_ms": MAX_PENDING_WAIT_MS}),
        );
    }

    #[test]
    fn refusals_are_single_line_capped_and_redacted() {
        let r = Refusal::new(
            Code::Refused,
            &format!(
                "line one\nline two Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123456789 {}",
                "x".repeat(900)
            ),
        );
        assert!(!r.message().contains('\n'));
        assert!(r.message().len() <= MAX_REASON);
        assert!(!r.message().contains("abcdefghijklmnop"));
    }

    #[test]
    fn protocol_errors_never_quote_the_callers_text() {
        for bad in [
            r#"{"id":1,"method":"list_tools","params":{"CANARY_KEY":1}}"#,
            r#"{"id":1,"method":"call_tool","params":{"server":"s","tool":"CANARY_VALUE_not_ok"}}"#,
            r#"{"id":1,"method":"call_tool","params":{"server":["CANARY_VALUE"],"tool":"t"}}"#,
            r#"{"id":1,"method":"hello","params":{"protocol":"CANARY_VALUE"}}"#,
            r#"{"id":1,"method":"CANARY_METHOD"}"#,
            r#"{"id":"CANARY_ID","method":"list_tools"}"#,
        ] {
            let msg = match decode(Role::Agent, State::Open, bad.as_bytes()) {
                Err(f) => f.refusal.message().to_owned(),
                Ok(_) => continue,
            };
            assert!(!msg.contains("CANARY"), "{msg}");
        }
    }

    /// The nodes decoding builds for `v` (see [`MAX_NODES`]).
    fn nodes(v: &Value) -> usize {
        match v {
            Value::Object(m) => 1 + m.values().map(|x| 1 + nodes(x)).sum::<usize>(),
            Value::Array(a) => 1 + a.iter().map(nodes).sum::<usize>(),
            _ => 1,
        }
    }

    fn call_frame(arguments: &str) -> String {
        format!(
            r#"{{"id":5,"method":"call_tool","params":{{"server":"s","tool":"t","arguments":{arguments}}}}}"#
        )
    }

    #[test]
    fn params_are_bounded_in_nodes_at_the_limit_and_one_over() {
        // params = {"server":"s","tool":"t","arguments":{"a":[…]}} is 9 nodes around the list.
        let empties = |k: usize| call_frame(&format!(r#"{{"a":[{}]}}"#, vec!["{}"; k].join(",")));
        let at = empties(MAX_NODES - 9);
        let Request::CallTool(c) = agent_open(&at).unwrap().2 else {
            panic!("not a call");
        };
        let decoded = json!({"server": c.server, "tool": c.tool, "arguments": c.arguments});
        assert_eq!(nodes(&decoded), MAX_NODES);
        let Err(over) = agent_open(&empties(MAX_NODES - 8)) else {
            panic!("one node over the bound was decoded");
        };
        assert_eq!(over.id, Some(5));
        assert_eq!(over.refusal.code, Code::Protocol);
        assert_eq!(
            over.refusal.message(),
            "params hold more than 65536 JSON nodes"
        );
        // The red team's frame: 1 MiB of empty objects, about 48 MB once decoded.
        let k = (super::super::frame::MAX_FRAME - empties(0).len()) / 3;
        let big = empties(k);
        assert!(big.len() <= super::super::frame::MAX_FRAME && k > 300_000);
        assert!(matches!(agent_open(&big), Err(f) if f.refusal.code == Code::Protocol));
        // Keys, strings, numbers and literals count as well as containers; one node over the
        // bound is refused whatever the nodes are.
        for unit in ["null", "1", "-2.5e3", "true", r#""x""#, r#""\"\\""#, "[]"] {
            let list = |k: usize| call_frame(&format!(r#"{{"a":[{}]}}"#, vec![unit; k].join(",")));
            assert!(agent_open(&list(MAX_NODES - 9)).is_ok(), "{unit}");
            assert!(agent_open(&list(MAX_NODES - 8)).is_err(), "{unit}");
        }
        let keys = |k: usize| {
            let members: Vec<String> = (0..k).map(|i| format!(r#""k{i}":0"#)).collect();
            call_frame(&format!("{{{}}}", members.join(",")))
        };
        // 7 nodes around the object, 2 per member.
        assert!(agent_open(&keys((MAX_NODES - 7) / 2)).is_ok());
        assert!(agent_open(&keys((MAX_NODES - 7) / 2 + 1)).is_err());
        // The operator's frames are decoded under the same bound (a form's content).
        let answer = |k: usize| {
            format!(
                r#"{{"id":2,"method":"answer","params":{{"id":1,"action":"accept","content":{{"a":[{}]}}}}}}"#,
                vec!["0"; k].join(",")
            )
        };
        // {"id":1,"action":"accept","content":{"a":[…]}}: 9 nodes around the list.
        let op = |b: String| {
            decode(Role::Operator, State::Open, b.as_bytes())
                .err()
                .map(|f| f.refusal.message().to_owned())
        };
        assert_eq!(op(answer(MAX_NODES - 9)), None);
        assert_eq!(
            op(answer(MAX_NODES - 8)).as_deref(),
            Some("params hold more than 65536 JSON nodes")
        );
        crate::test_report::record(
            "P5",
            "broker/src/ipc/proto.rs::params_are_bounded_in_nodes_at_the_limit_and_one_over",
            json!({"max_nodes": MAX_NODES, "red_team_frame_bytes": big.len()}),
        );
    }

    fn any_json() -> impl Strategy<Value = Value> {
        let text = prop_oneof![
            any::<String>(),
            "[a-z\"\\\\{}\\[\\],: \u{e9}\u{202e}\u{7f}\n]{0,12}",
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            text.clone().prop_map(Value::from),
        ];
        leaf.prop_recursive(5, 120, 10, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..10).prop_map(Value::from),
                prop::collection::vec((text.clone(), inner), 0..10)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]
        #[test]
        fn the_node_scan_counts_exactly_what_decoding_builds(v in any_json()) {
            let compact = serde_json::to_string(&v).unwrap();
            let pretty = serde_json::to_string_pretty(&v).unwrap();
            prop_assert_eq!(count_nodes(compact.as_bytes(), usize::MAX), nodes(&v));
            prop_assert_eq!(count_nodes(pretty.as_bytes(), usize::MAX), nodes(&v));
        }

        #[test]
        fn decoded_frames_never_exceed_the_node_bound(v in any_json(), max in 0usize..160) {
            let arguments = json!({"x": v});
            let body = call_frame(&serde_json::to_string(&arguments).unwrap());
            let sent = nodes(&json!({"server": "s", "tool": "t", "arguments": arguments}));
            match decode_bounded(Role::Agent, State::Open, body.as_bytes(), max) {
                Ok((_, _, Request::CallTool(c))) => {
                    let decoded = json!({"server": c.server, "tool": c.tool, "arguments": c.arguments});
                    prop_assert!(nodes(&decoded) <= max);
                    prop_assert_eq!(nodes(&decoded), sent);
                }
                Ok(_) => prop_assert!(false, "decoded as another request"),
                Err(f) => {
                    prop_assert!(sent > max, "refused within the bound: {}", f.refusal);
                    prop_assert_eq!(f.refusal.message(), format!("params hold more than {max} JSON nodes"));
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        #[test]
        fn arbitrary_bodies_never_panic_and_errors_are_bounded(body in prop::collection::vec(any::<u8>(), 0..300), open in any::<bool>(), agent in any::<bool>()) {
            let role = if agent { Role::Agent } else { Role::Operator };
            let state = if open { State::Open } else { State::AwaitingHello };
            if let Err(f) = decode(role, state, &body) {
                prop_assert_eq!(f.refusal.code, Code::Protocol);
                prop_assert!(f.refusal.message().len() <= MAX_REASON);
                prop_assert!(!f.refusal.message().contains('\n'));
            }
        }

        #[test]
        fn structured_garbage_is_refused_not_accepted(method in "[a-z_]{0,12}", key in "[a-z]{1,8}", v in any::<i64>()) {
            let body = format!(r#"{{"id":1,"method":"{method}","params":{{"{key}":{v}}}}}"#);
            if let Ok((_, e, _)) = decode(Role::Agent, State::Open, body.as_bytes()) {
                // Only a real method with a real parameter name can pass.
                prop_assert!(e.method == method);
                prop_assert!(key == "server" || key == "tool" || key == "arguments");
            }
        }
    }
}
