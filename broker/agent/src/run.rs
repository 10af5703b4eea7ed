//! The agent's commands: one request each through the agent socket, printed as text or JSON.

use std::io::Write;
use std::path::{Path, PathBuf};

use iteron_ipc::client::{ClientError, Connection};
use iteron_ipc::proto::{
    AgentRequest, CallTool, GetPrompt, Hello, PROTOCOL_VERSION, ReadResource, ResolveAgent,
    ServerArg, UseSkill,
};
use iteron_policy::text;
use serde_json::{Map, Value};

use crate::args::{Agent, AgentArgs, Format};
use crate::error::AgentError;

fn out_line(out: &mut dyn Write, line: &str) -> Result<(), AgentError> {
    writeln!(out, "{line}").map_err(AgentError::Output)
}

fn json_out(out: &mut dyn Write, v: &Value) -> Result<(), AgentError> {
    crate::output::json(out, v).map_err(AgentError::Output)
}

/// Untrusted text (a tool's result, a server's contents, a skill's body), terminal-safe, one
/// output line for each of its lines.
fn untrusted_lines(out: &mut dyn Write, t: &str) -> Result<(), AgentError> {
    for line in t.lines() {
        out_line(out, &text::single_line_capped(line, usize::MAX))?;
    }
    Ok(())
}

/// A JSON object given on the command line.
pub fn parse_object(raw: &str) -> Option<Map<String, Value>> {
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Object(m)) => Some(m),
        _ => None,
    }
}

/// A broker error as an operator or an agent reads it: a socket that cannot be reached is
/// named, with what to do about it; anything else is the broker's own answer.
pub fn broker_error(socket: &Path, e: ClientError) -> AgentError {
    match e {
        ClientError::Connect(kind) => AgentError::NoBroker {
            socket: socket.to_path_buf(),
            kind,
        },
        other => AgentError::Broker(other),
    }
}

fn via(socket: &Path) -> impl Fn(ClientError) -> AgentError + '_ {
    move |e| broker_error(socket, e)
}

/// Connect and open the session (a child session with `--agent-type`).
async fn agent_session(socket: &Path, agent_type: Option<&str>) -> Result<Connection, ClientError> {
    let mut c = Connection::connect(socket).await?;
    c.send(AgentRequest::Hello(Hello {
        protocol: PROTOCOL_VERSION,
        client: "iteron-agent".into(),
        agent_type: agent_type.map(str::to_owned),
        model: None,
    }))
    .await?;
    Ok(c)
}

fn agent_socket(args: &AgentArgs) -> Result<PathBuf, AgentError> {
    args.socket
        .clone()
        .or_else(|| std::env::var_os("ITERON_AGENT_SOCKET").map(PathBuf::from))
        .ok_or_else(|| AgentError::Usage("give --socket PATH (or set ITERON_AGENT_SOCKET)".into()))
}

/// Run one agent command (`iteron-agent …` or `iteron agent …`): it needs only the socket.
pub fn run(args: AgentArgs, out: &mut dyn Write) -> Result<(), AgentError> {
    let socket = agent_socket(&args)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(AgentError::Output)?;
    let child = args.agent_type.as_deref();
    let one = |request: AgentRequest| -> Result<Value, AgentError> {
        rt.block_on(async {
            let mut c = agent_session(&socket, child).await?;
            c.send(request).await
        })
        .map_err(via(&socket))
    };
    let prompts = matches!(args.action, Agent::Prompts(_));
    match args.action {
        Agent::Skills(f) => {
            let v = one(AgentRequest::ListSkills)?;
            match f.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    for s in items(&v, "skills") {
                        let g = |k: &str| s.get(k).and_then(Value::as_str).unwrap_or("");
                        out_line(
                            out,
                            &text::single_line(&format!(
                                "{}  ({})  {}",
                                g("name"),
                                g("tier"),
                                g("description")
                            )),
                        )?;
                    }
                    Ok(())
                }
            }
        }
        Agent::UseSkill(a) => {
            let v = one(AgentRequest::UseSkill(UseSkill { name: a.name }))?;
            let body = v.get("body").and_then(Value::as_str).unwrap_or("");
            untrusted_lines(out, body)?;
            Ok(())
        }
        Agent::ResolveAgent(r) => {
            let v = one(AgentRequest::ResolveAgent(ResolveAgent {
                agent_type: r.agent_type,
                model: r.model,
            }))?;
            if let Format::Json = r.format {
                json_out(out, &v)?;
            }
            match v.get("agent") {
                Some(a) if a.is_object() => {
                    if let Format::Text = r.format {
                        let g = |k: &str| a.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
                        // The identity is a digest the broker computed: shown whole (redaction
                        // would take a 64-hex string for a secret); the rest is made safe.
                        let identity = g("identity");
                        let identity = if identity.len() == 64
                            && identity.bytes().all(|b| b.is_ascii_hexdigit())
                        {
                            identity
                        } else {
                            "-".to_owned()
                        };
                        out_line(
                            out,
                            &format!(
                                "{} identity {identity}",
                                text::single_line(&format!("{} ({} tier)", g("name"), g("tier")))
                            ),
                        )?;
                    }
                    Ok(())
                }
                _ => Err(AgentError::Broker(ClientError::Refused {
                    code: "refused".into(),
                    message: text::single_line(
                        v.get("reason")
                            .and_then(Value::as_str)
                            .unwrap_or("not resolved"),
                    ),
                    certainty: None,
                })),
            }
        }
        Agent::Resources(a) | Agent::Prompts(a) => {
            let server = ServerArg { server: a.server };
            let (request, key) = if prompts {
                (AgentRequest::ListPrompts(server), "prompts")
            } else {
                (AgentRequest::ListResources(server), "resources")
            };
            let v = one(request)?;
            match a.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    for r in items(&v, key) {
                        let g = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("");
                        let line = if prompts {
                            format!("{}  {}", g("name"), g("description"))
                        } else {
                            format!("{}  {}  {}", g("uri"), g("name"), g("description"))
                        };
                        out_line(out, &text::single_line(&line))?;
                    }
                    notes_out(out, &v)
                }
            }
        }
        Agent::ReadResource(r) => {
            let v = one(AgentRequest::ReadResource(ReadResource {
                server: r.server,
                uri: r.uri,
            }))?;
            match r.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    for c in items(&v, "contents") {
                        let t = c.get("text").and_then(Value::as_str).unwrap_or("");
                        untrusted_lines(out, t)?;
                    }
                    notes_out(out, &v)
                }
            }
        }
        Agent::GetPrompt(g) => {
            let arguments = parse_object(&g.json)
                .and_then(|m| {
                    m.into_iter()
                        .map(|(k, v)| match v {
                            Value::String(s) => Some((k, s)),
                            _ => None,
                        })
                        .collect::<Option<_>>()
                })
                .ok_or_else(|| {
                    AgentError::Usage("--json must be a JSON object of strings".into())
                })?;
            let v = one(AgentRequest::GetPrompt(GetPrompt {
                server: g.server,
                name: g.name,
                arguments,
            }))?;
            match g.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    for m in items(&v, "messages") {
                        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
                        out_line(out, &format!("[{}]", text::single_line(role)))?;
                        let t = m.get("text").and_then(Value::as_str).unwrap_or("");
                        untrusted_lines(out, t)?;
                    }
                    notes_out(out, &v)
                }
            }
        }
        Agent::Tools(f) => {
            let v = rt.block_on(async {
                let mut c = agent_session(&socket, child).await?;
                c.send(AgentRequest::ListTools).await
            });
            let v = v.map_err(via(&socket))?;
            match f.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    for t in items(&v, "tools") {
                        let s = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or("");
                        // Whether calls can be approved: rule, operator, deferred,
                        // denied_by_rule or refused_noninteractive.
                        let approval = match s("approval") {
                            "" => String::new(),
                            a => format!("  [{a}]"),
                        };
                        out_line(
                            out,
                            &text::single_line(&format!(
                                "{}/{}{approval}  {}",
                                s("server"),
                                s("name"),
                                s("description")
                            )),
                        )?;
                    }
                    for u in items(&v, "unavailable") {
                        out_line(
                            out,
                            &text::single_line(&format!(
                                "{}: unavailable",
                                u.as_str().unwrap_or("")
                            )),
                        )?;
                    }
                    notes_out(out, &v)
                }
            }
        }
        Agent::Call(c) => {
            let arguments = parse_object(&c.json)
                .ok_or_else(|| AgentError::Usage("--json must be a JSON object".into()))?;
            let v = rt
                .block_on(async {
                    let mut conn = agent_session(&socket, child).await?;
                    conn.send(AgentRequest::CallTool(CallTool {
                        server: c.server,
                        tool: c.tool,
                        arguments,
                    }))
                    .await
                })
                .map_err(via(&socket))?;
            let is_error = v.get("is_error").and_then(Value::as_bool) == Some(true);
            match c.format {
                Format::Json => json_out(out, &v)?,
                Format::Text => {
                    let t = v.get("text").and_then(Value::as_str).unwrap_or("");
                    untrusted_lines(out, t)?;
                }
            }
            if is_error {
                return Err(AgentError::ToolReportedError);
            }
            Ok(())
        }
    }
}

/// A result's notes (what was left out or cut), one line each, marked as notes.
fn notes_out(out: &mut dyn Write, v: &Value) -> Result<(), AgentError> {
    for n in items(v, "notes") {
        out_line(
            out,
            &text::single_line(&format!("note: {}", n.as_str().unwrap_or(""))),
        )?;
    }
    Ok(())
}

/// The elements of the array `v[key]` (none when it is missing or not an array).
fn items<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    v.get(key).and_then(Value::as_array).into_iter().flatten()
}
