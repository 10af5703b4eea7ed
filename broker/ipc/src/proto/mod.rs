//! The request vocabulary of both sockets, and the one dispatch table.
//!
//! A frame body is `{"id": <u64>, "method": "<name>", "params": {...}}` (`params` may be
//! omitted when a request takes none). Each socket has a closed set of methods; the table below
//! says, per method, which socket accepts it and in which session states it is allowed; each
//! socket's requests are one typed enum ([`AgentRequest`], [`OperatorRequest`]), used both to
//! decode (the broker) and to encode (a client). Anything else — malformed JSON, an unknown or duplicate key,
//! an unknown method, a method of the other socket, a method out of state — is a protocol error:
//! the broker answers with one error frame and closes the connection.
//!
//! Answers are `{"id": n, "result": {...}}` or `{"id": n, "error": {"code", "message"}}`; a
//! fatal error before the id could be read carries `"id": null`.

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use iteron_policy::text;

mod answer;
mod request;
#[cfg(test)]
mod tests;

pub use answer::*;
pub use request::*;

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

/// A method of the agent socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentMethod {
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
}

impl AgentMethod {
    /// The method name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            AgentMethod::Hello => "hello",
            AgentMethod::ListTools => "list_tools",
            AgentMethod::CallTool => "call_tool",
            AgentMethod::EndSession => "end_session",
            AgentMethod::ListSkills => "list_skills",
            AgentMethod::UseSkill => "use_skill",
            AgentMethod::ResolveAgent => "resolve_agent",
            AgentMethod::SubmitPrompt => "submit_prompt",
            AgentMethod::ListResources => "list_resources",
            AgentMethod::ReadResource => "read_resource",
            AgentMethod::ListPrompts => "list_prompts",
            AgentMethod::GetPrompt => "get_prompt",
        }
    }
}

/// A method of the operator socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperatorMethod {
    /// Open the session.
    Hello,
    /// Server phases.
    Status,
    /// Cancel a server's in-flight calls.
    Cancel,
    /// Restart a server.
    Restart,
    /// Stop a server.
    Stop,
    /// Revoke and forget a server's externally managed token.
    Logout,
    /// Pending approvals and forms.
    Pending,
    /// Approve or deny one pending call (or several).
    Decide,
    /// Answer one pending form.
    Answer,
    /// One pending call with its whole arguments.
    Show,
    /// The skills and agent definitions the broker discovered at start.
    Catalog,
}

impl OperatorMethod {
    /// The method name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            OperatorMethod::Hello => "hello",
            OperatorMethod::Status => "status",
            OperatorMethod::Cancel => "cancel",
            OperatorMethod::Restart => "restart",
            OperatorMethod::Stop => "stop",
            OperatorMethod::Logout => "logout",
            OperatorMethod::Pending => "pending",
            OperatorMethod::Decide => "decide",
            OperatorMethod::Answer => "answer",
            OperatorMethod::Show => "show",
            OperatorMethod::Catalog => "catalog",
        }
    }
}

/// What a table row is: a method of one socket (the socket is part of the kind, so a row can
/// never pair one socket with the other's method).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A method of the agent socket.
    Agent(AgentMethod),
    /// A method of the operator socket.
    Operator(OperatorMethod),
}

impl Kind {
    /// The socket that accepts it.
    pub fn role(self) -> Role {
        match self {
            Kind::Agent(_) => Role::Agent,
            Kind::Operator(_) => Role::Operator,
        }
    }

    /// The method name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Agent(m) => m.name(),
            Kind::Operator(m) => m.name(),
        }
    }
}

/// One row of the dispatch table.
#[derive(Debug)]
pub struct Entry {
    /// The method (and with it, the socket).
    pub kind: Kind,
    /// The session states in which it is allowed.
    pub states: &'static [State],
}

impl Entry {
    /// The method name on the wire.
    pub fn method(&self) -> &'static str {
        self.kind.name()
    }
}

const OPEN: &[State] = &[State::Open];
const NEW: &[State] = &[State::AwaitingHello];

const fn agent(m: AgentMethod, states: &'static [State]) -> Entry {
    Entry {
        kind: Kind::Agent(m),
        states,
    }
}

const fn operator(m: OperatorMethod, states: &'static [State]) -> Entry {
    Entry {
        kind: Kind::Operator(m),
        states,
    }
}

/// The dispatch table: every request either socket accepts, and nothing else. Decoding finds a
/// frame's row here by socket and method name, checks the row's states, and builds the typed
/// request of that row's kind.
pub const TABLE: &[Entry] = &[
    agent(AgentMethod::Hello, NEW),
    agent(AgentMethod::ListTools, OPEN),
    agent(AgentMethod::CallTool, OPEN),
    agent(AgentMethod::EndSession, OPEN),
    agent(AgentMethod::ListSkills, OPEN),
    agent(AgentMethod::UseSkill, OPEN),
    agent(AgentMethod::ResolveAgent, OPEN),
    agent(AgentMethod::SubmitPrompt, OPEN),
    agent(AgentMethod::ListResources, OPEN),
    agent(AgentMethod::ReadResource, OPEN),
    agent(AgentMethod::ListPrompts, OPEN),
    agent(AgentMethod::GetPrompt, OPEN),
    operator(OperatorMethod::Hello, NEW),
    operator(OperatorMethod::Status, OPEN),
    operator(OperatorMethod::Cancel, OPEN),
    operator(OperatorMethod::Restart, OPEN),
    operator(OperatorMethod::Stop, OPEN),
    operator(OperatorMethod::Logout, OPEN),
    operator(OperatorMethod::Pending, OPEN),
    operator(OperatorMethod::Decide, OPEN),
    operator(OperatorMethod::Answer, OPEN),
    operator(OperatorMethod::Show, OPEN),
    operator(OperatorMethod::Catalog, OPEN),
];

/// Find a method's row for a socket.
pub fn lookup(role: Role, method: &str) -> Option<&'static Entry> {
    TABLE
        .iter()
        .find(|e| e.kind.role() == role && e.method() == method)
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

fn params<T: DeserializeOwned>(p: RawParams, id: u64, method: &str) -> Result<T, Fatal> {
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
            State::AwaitingHello => format!("{} before hello", entry.method()),
            State::Open => format!("{} is not allowed in an open session", entry.method()),
        };
        return Err(Fatal {
            id: Some(id),
            refusal: Refusal::new(Code::Protocol, &why),
        });
    }
    let req = match entry.kind {
        Kind::Agent(m) => Request::Agent(agent_request(m, env.params, id)?),
        Kind::Operator(m) => Request::Operator(operator_request(m, env.params, id)?),
    };
    Ok((id, entry, req))
}

type RawParams = Option<Box<serde_json::value::RawValue>>;

/// A protocol error for request `id`.
fn protocol(id: u64, why: &str) -> Fatal {
    Fatal {
        id: Some(id),
        refusal: Refusal::new(Code::Protocol, why),
    }
}

fn agent_request(m: AgentMethod, p: RawParams, id: u64) -> Result<AgentRequest, Fatal> {
    let name = m.name();
    Ok(match m {
        AgentMethod::Hello => AgentRequest::Hello(params(p, id, name)?),
        AgentMethod::ListTools => {
            params::<NoParams>(p, id, name)?;
            AgentRequest::ListTools
        }
        AgentMethod::CallTool => AgentRequest::CallTool(params(p, id, name)?),
        AgentMethod::EndSession => {
            params::<NoParams>(p, id, name)?;
            AgentRequest::EndSession
        }
        AgentMethod::ListSkills => {
            params::<NoParams>(p, id, name)?;
            AgentRequest::ListSkills
        }
        AgentMethod::UseSkill => AgentRequest::UseSkill(params(p, id, name)?),
        AgentMethod::ResolveAgent => AgentRequest::ResolveAgent(params(p, id, name)?),
        AgentMethod::SubmitPrompt => AgentRequest::SubmitPrompt(params(p, id, name)?),
        AgentMethod::ListResources => AgentRequest::ListResources(params(p, id, name)?),
        AgentMethod::ReadResource => AgentRequest::ReadResource(params(p, id, name)?),
        AgentMethod::ListPrompts => AgentRequest::ListPrompts(params(p, id, name)?),
        AgentMethod::GetPrompt => AgentRequest::GetPrompt(params(p, id, name)?),
    })
}

fn operator_request(m: OperatorMethod, p: RawParams, id: u64) -> Result<OperatorRequest, Fatal> {
    let name = m.name();
    Ok(match m {
        OperatorMethod::Hello => OperatorRequest::Hello(params(p, id, name)?),
        OperatorMethod::Status => OperatorRequest::Status(params(p, id, name)?),
        OperatorMethod::Cancel => OperatorRequest::Cancel(params(p, id, name)?),
        OperatorMethod::Restart => OperatorRequest::Restart(params(p, id, name)?),
        OperatorMethod::Stop => OperatorRequest::Stop(params(p, id, name)?),
        OperatorMethod::Logout => OperatorRequest::Logout(params(p, id, name)?),
        OperatorMethod::Pending => {
            let a: PendingArg = params(p, id, name)?;
            if a.wait_ms > MAX_PENDING_WAIT_MS {
                return Err(protocol(
                    id,
                    &format!("pending takes wait_ms 0-{MAX_PENDING_WAIT_MS}"),
                ));
            }
            OperatorRequest::Pending(a)
        }
        OperatorMethod::Decide => {
            let d: Decide = params(p, id, name)?;
            if d.id.is_some() != d.ids.is_empty() || d.ids.len() > MAX_DECIDE_IDS {
                return Err(protocol(
                    id,
                    &format!("decide takes id, or ids (1-{MAX_DECIDE_IDS}), not both"),
                ));
            }
            OperatorRequest::Decide(d)
        }
        OperatorMethod::Answer => OperatorRequest::Answer(params(p, id, name)?),
        OperatorMethod::Show => OperatorRequest::Show(params(p, id, name)?),
        OperatorMethod::Catalog => {
            params::<NoParams>(p, id, name)?;
            OperatorRequest::Catalog
        }
    })
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
