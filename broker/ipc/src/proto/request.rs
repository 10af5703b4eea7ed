//! The parameters of every request, and the typed requests of each socket: what the broker
//! decodes and what a client encodes (one type for both directions).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{AgentMethod, Kind, OperatorMethod};

/// `hello` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// The protocol version the client speaks.
    pub protocol: u32,
    /// A label for the client (shown to the operator and audited; at most 64 bytes).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub client: String,
    /// Open a child session bound to this agent definition (exact, case-sensitive name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_type: Option<String>,
    /// A model override for the child (only `inherit` is accepted by this broker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// `use_skill` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UseSkill {
    /// The skill's name.
    pub name: String,
}

/// `resolve_agent` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResolveAgent {
    /// The requested `agentType`.
    pub agent_type: String,
    /// A model override.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// `submit_prompt` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitPrompt {
    /// The prompt text (at most [`MAX_PROMPT`] bytes).
    pub prompt: String,
}

/// Longest prompt in `submit_prompt`.
pub const MAX_PROMPT: usize = 256 * 1024;

/// `call_tool` parameters.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerArg {
    /// The server's configured name.
    pub server: String,
}

/// `status` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StatusArg {
    /// One server, or all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
}

/// The longest `pending` long-poll.
pub const MAX_PENDING_WAIT_MS: u64 = 30_000;

/// `pending` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PendingArg {
    /// When nothing is waiting, wait up to this long for something to arrive (at most
    /// [`MAX_PENDING_WAIT_MS`], more is a protocol error; default 0: answer at once).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub wait_ms: u64,
}

/// `decide` parameters.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Decide {
    /// The pending call's id …
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
    /// … or several, each decided alike (at most [`MAX_DECIDE_IDS`]; exactly one of `id` and
    /// `ids` is given).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ids: Vec<u64>,
    /// Approve (true) or deny (false).
    pub approve: bool,
    /// The call's argument digest (with `id` only): when given, a call whose digest differs is
    /// not decided; a call parked by a noninteractive broker (deferred approval) is approved
    /// only with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Show {
    /// The pending call's id.
    pub id: u64,
    /// Where in the call's canonical arguments the answer starts (a byte offset on a character
    /// boundary; default 0). Arguments longer than one answer carries come in several.
    #[serde(default)]
    pub offset: usize,
}

/// A request on the agent socket: the closed set the table admits there.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentRequest {
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
}

impl AgentRequest {
    /// Its method.
    pub fn method(&self) -> AgentMethod {
        match self {
            AgentRequest::Hello(_) => AgentMethod::Hello,
            AgentRequest::ListTools => AgentMethod::ListTools,
            AgentRequest::CallTool(_) => AgentMethod::CallTool,
            AgentRequest::EndSession => AgentMethod::EndSession,
            AgentRequest::ListSkills => AgentMethod::ListSkills,
            AgentRequest::UseSkill(_) => AgentMethod::UseSkill,
            AgentRequest::ResolveAgent(_) => AgentMethod::ResolveAgent,
            AgentRequest::SubmitPrompt(_) => AgentMethod::SubmitPrompt,
            AgentRequest::ListResources(_) => AgentMethod::ListResources,
            AgentRequest::ReadResource(_) => AgentMethod::ReadResource,
            AgentRequest::ListPrompts(_) => AgentMethod::ListPrompts,
            AgentRequest::GetPrompt(_) => AgentMethod::GetPrompt,
        }
    }

    fn params(&self) -> Result<Value, serde_json::Error> {
        match self {
            AgentRequest::Hello(p) => serde_json::to_value(p),
            AgentRequest::CallTool(p) => serde_json::to_value(p),
            AgentRequest::UseSkill(p) => serde_json::to_value(p),
            AgentRequest::ResolveAgent(p) => serde_json::to_value(p),
            AgentRequest::SubmitPrompt(p) => serde_json::to_value(p),
            AgentRequest::ListResources(p) | AgentRequest::ListPrompts(p) => {
                serde_json::to_value(p)
            }
            AgentRequest::ReadResource(p) => serde_json::to_value(p),
            AgentRequest::GetPrompt(p) => serde_json::to_value(p),
            AgentRequest::ListTools | AgentRequest::EndSession | AgentRequest::ListSkills => {
                Ok(Value::Object(Map::new()))
            }
        }
    }
}

/// A request on the operator socket: the closed set the table admits there.
#[derive(Debug, Clone, PartialEq)]
pub enum OperatorRequest {
    /// `hello`.
    Hello(Hello),
    /// `status`.
    Status(StatusArg),
    /// `cancel`.
    Cancel(ServerArg),
    /// `restart`.
    Restart(ServerArg),
    /// `stop`.
    Stop(ServerArg),
    /// `logout`.
    Logout(ServerArg),
    /// `pending`.
    Pending(PendingArg),
    /// `decide`.
    Decide(Decide),
    /// `answer`.
    Answer(Answer),
    /// `show`.
    Show(Show),
    /// `catalog`.
    Catalog,
}

impl OperatorRequest {
    /// Its method.
    pub fn method(&self) -> OperatorMethod {
        match self {
            OperatorRequest::Hello(_) => OperatorMethod::Hello,
            OperatorRequest::Status(_) => OperatorMethod::Status,
            OperatorRequest::Cancel(_) => OperatorMethod::Cancel,
            OperatorRequest::Restart(_) => OperatorMethod::Restart,
            OperatorRequest::Stop(_) => OperatorMethod::Stop,
            OperatorRequest::Logout(_) => OperatorMethod::Logout,
            OperatorRequest::Pending(_) => OperatorMethod::Pending,
            OperatorRequest::Decide(_) => OperatorMethod::Decide,
            OperatorRequest::Answer(_) => OperatorMethod::Answer,
            OperatorRequest::Show(_) => OperatorMethod::Show,
            OperatorRequest::Catalog => OperatorMethod::Catalog,
        }
    }

    fn params(&self) -> Result<Value, serde_json::Error> {
        match self {
            OperatorRequest::Hello(p) => serde_json::to_value(p),
            OperatorRequest::Status(p) => serde_json::to_value(p),
            OperatorRequest::Cancel(p)
            | OperatorRequest::Restart(p)
            | OperatorRequest::Stop(p)
            | OperatorRequest::Logout(p) => serde_json::to_value(p),
            OperatorRequest::Pending(p) => serde_json::to_value(p),
            OperatorRequest::Decide(p) => serde_json::to_value(p),
            OperatorRequest::Answer(p) => serde_json::to_value(p),
            OperatorRequest::Show(p) => serde_json::to_value(p),
            OperatorRequest::Catalog => Ok(Value::Object(Map::new())),
        }
    }
}

/// A decoded request: one socket's typed request.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// From the agent socket.
    Agent(AgentRequest),
    /// From the operator socket.
    Operator(OperatorRequest),
}

impl Request {
    /// Its table kind (method and socket).
    pub fn kind(&self) -> Kind {
        match self {
            Request::Agent(r) => Kind::Agent(r.method()),
            Request::Operator(r) => Kind::Operator(r.method()),
        }
    }

    /// The whole request frame with `id` (client side). Every parameter type serializes to a
    /// JSON object; the error is serde's, for completeness of the signature.
    pub fn frame(&self, id: u64) -> Result<Value, serde_json::Error> {
        let params = match self {
            Request::Agent(r) => r.params()?,
            Request::Operator(r) => r.params()?,
        };
        Ok(super::request_frame(id, self.kind().name(), params))
    }
}

impl From<AgentRequest> for Request {
    fn from(r: AgentRequest) -> Request {
        Request::Agent(r)
    }
}

impl From<OperatorRequest> for Request {
    fn from(r: OperatorRequest) -> Request {
        Request::Operator(r)
    }
}

fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}
