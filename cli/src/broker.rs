//! `iteron broker …`, `iteron approvals …`, `iteron agent …` and `iteron audit verify`.
//!
//! `broker serve` runs the daemon; the others are thin clients of its two sockets. The agent
//! commands need nothing but the agent socket's path: they never read `ITERON_HOME`.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iteron_broker::daemon::{self, ServeOptions};
use iteron_broker::ipc::client::{ClientError, Connection};
use iteron_broker::store::Home;
use iteron_policy::text;
use serde_json::{Map, Value, json};

use crate::args::{
    Agent, AgentArgs, Approvals, ApprovalsArgs, Audit, Broker, CatalogArgs, Format,
    OperatorSocketArg, ServeArgs,
};
use crate::error::CliError;

fn default_operator_socket(home: &Home) -> PathBuf {
    home.dir().join("run").join("operator.sock")
}

fn operator_socket(arg: &OperatorSocketArg) -> Result<PathBuf, CliError> {
    match &arg.operator_socket {
        Some(p) => Ok(p.clone()),
        None => Ok(default_operator_socket(&home()?)),
    }
}

fn home() -> Result<Home, CliError> {
    Home::from_env(|k| std::env::var_os(k)).map_err(CliError::from)
}

fn out_line(out: &mut dyn Write, line: &str) -> Result<(), CliError> {
    writeln!(out, "{line}").map_err(CliError::Output)
}

fn json_out(out: &mut dyn Write, v: &Value) -> Result<(), CliError> {
    let s = serde_json::to_string_pretty(v).unwrap_or_default();
    out_line(out, &s)
}

/// `iteron broker …`
pub(crate) fn run_broker(cmd: Broker, out: &mut dyn Write) -> Result<(), CliError> {
    match cmd {
        Broker::Serve(args) => serve(args),
        Broker::Status(a) => {
            let socket = operator_socket(&a.socket)?;
            let params = match &a.server {
                Some(s) => json!({"server": s}),
                None => json!({}),
            };
            let v = operator_request(&socket, "status", params)?;
            match a.format {
                Format::Json => json_out(out, &v),
                Format::Text => status_text(out, &v),
            }
        }
        Broker::Cancel(a) => {
            let v = operator_request(
                &operator_socket(&a.socket)?,
                "cancel",
                json!({"server": a.server}),
            )?;
            let n = v.get("cancelled").and_then(Value::as_u64).unwrap_or(0);
            out_line(out, &format!("cancelled {n} call(s) in flight"))
        }
        Broker::Restart(a) => {
            operator_request(
                &operator_socket(&a.socket)?,
                "restart",
                json!({"server": a.server}),
            )?;
            out_line(
                out,
                "restarted: the catalog is cleared; the server reconnects on the next request",
            )
        }
        Broker::Stop(a) => {
            operator_request(
                &operator_socket(&a.socket)?,
                "stop",
                json!({"server": a.server}),
            )?;
            out_line(out, "stopped: the server stays down until restarted")
        }
    }
}

fn status_text(out: &mut dyn Write, v: &Value) -> Result<(), CliError> {
    let mode = if v.get("interactive").and_then(Value::as_bool) == Some(true) {
        "interactive"
    } else {
        "noninteractive"
    };
    out_line(out, &format!("broker: {mode}"))?;
    let empty = Vec::new();
    let servers = v.get("servers").and_then(Value::as_array).unwrap_or(&empty);
    for s in servers {
        let field = |k: &str| match s.get(k) {
            Some(Value::String(x)) => text::single_line_capped(x, 200),
            Some(Value::Number(n)) => n.to_string(),
            _ => "-".into(),
        };
        let mut line = format!(
            "{}  {}  phase={}  generation={}  version={}  tools={}  in_flight={}",
            field("name"),
            field("transport"),
            field("phase"),
            field("generation"),
            field("version"),
            field("tools"),
            field("in_flight"),
        );
        if s.get("error").is_some_and(Value::is_string) {
            line.push_str(&format!("  error: {}", field("error")));
        }
        out_line(out, &line)?;
    }
    Ok(())
}

/// The operator's broker runs as the operator: a socket served by anyone else is refused before
/// anything is sent.
async fn operator_connect(socket: &Path) -> Result<Connection, ClientError> {
    Connection::connect_as(socket, nix::unistd::geteuid().as_raw()).await
}

fn operator_request(socket: &Path, method: &str, params: Value) -> Result<Value, CliError> {
    crate::rt::current_thread()?.block_on(async {
        let mut c = operator_connect(socket).await.map_err(CliError::Broker)?;
        c.hello("iteron-cli").await.map_err(CliError::Broker)?;
        c.request(method, params).await.map_err(CliError::Broker)
    })
}

fn serve(args: ServeArgs) -> Result<(), CliError> {
    // First, while the process still has one thread: no ptrace, no core, umask 077, no
    // loader/proxy/TLS variables.
    let hardened = iteron_broker::sys::harden_self()
        .map_err(|e| CliError::Serve(format!("cannot harden the broker process: {e}")))?;
    let home = home()?;
    let own = nix::unistd::geteuid().as_raw();
    let allow = if args.allow_uid.is_empty() {
        vec![own]
    } else {
        args.allow_uid.clone()
    };
    let agent_socket = match args.socket {
        Some(p) => p,
        None if allow.iter().all(|u| *u == own) => home.dir().join("run").join("agent.sock"),
        None => {
            return Err(CliError::Usage(
                "--socket is required when another uid is allowed: the default lies inside the private ITERON_HOME".into(),
            ));
        }
    };
    if agent_socket.starts_with(home.dir()) && allow.iter().any(|u| *u != own) {
        return Err(CliError::Usage(
            "the agent socket of another uid cannot be inside the private ITERON_HOME".into(),
        ));
    }
    let operator_socket = args
        .operator_socket
        .unwrap_or_else(|| default_operator_socket(&home));
    let interactive = !args.noninteractive;
    let config = home.load()?;
    // Secrets systemd hands the unit (LoadCredential=): read once, checked, and the directory
    // denied to every child from here on.
    let unit = iteron_broker::unit_secrets::UnitSecrets::from_env(|k| std::env::var_os(k))
        .map_err(|e| CliError::Serve(e.to_string()))?;
    if let Some(u) = &unit {
        iteron_broker::confine::deny_to_every_child(vec![u.dir().to_path_buf()]);
    }
    // Skills and agent definitions are discovered once, for the broker's whole run; hooks come
    // only from the operator's configuration.
    let catalog = Arc::new(iteron_broker::catalog::discover(
        home.dir(),
        args.repo.as_deref(),
    ));
    let hooks = Arc::new(
        iteron_broker::hooks::HookRunner::new(config.hooks.clone())
            .with_home(home.dir())
            .with_writable(&config.hooks_writable)
            .with_run_as(config.hooks_run_as.unwrap_or_default()),
    );
    let opts = ServeOptions {
        catalog,
        agent_socket,
        operator_socket,
        allow_uids: allow,
        interactive,
        approval_deadline: Duration::from_secs(args.approval_timeout),
    };
    let mut err = std::io::stderr();
    if let Some(u) = &unit {
        let names: Vec<&str> = u.names().collect();
        let _ = writeln!(
            err,
            "{}",
            text::single_line(&format!(
                "iteron broker: credentials directory supplies {} variable(s){}{}{}",
                names.len(),
                if names.is_empty() { "" } else { ": " },
                names.join(", "),
                if u.ignored().is_empty() {
                    String::new()
                } else {
                    format!("; ignored: {}", u.ignored().join(", "))
                }
            ))
        );
    }
    if !hardened.removed.is_empty() {
        let _ = writeln!(
            err,
            "{}",
            text::single_line(&format!(
                "iteron broker: ignoring environment variables: {}",
                hardened.removed.join(", ")
            ))
        );
    }
    // One thread: the broker's work is I/O-bound, and keeping a request's reader, handler and
    // writer on one thread saves a cross-thread wake-up per frame (measured: refused round trip
    // 86 → 73 µs at p50). Blocking work (keyring, credential files) goes to the blocking pool;
    // children are forked by the spawner's own thread.
    let rt = crate::rt::current_thread()?;
    rt.block_on(async move {
        use tokio::signal::unix::{SignalKind, signal};
        // Without signal handling the broker could not stop cleanly: refuse to run.
        let (mut term, mut int) = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(t), Ok(i)) => (t, i),
            _ => {
                return Err(CliError::Serve(
                    "cannot install the SIGTERM/SIGINT handlers".into(),
                ));
            }
        };
        let stop = async move {
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
        };
        daemon::serve(
            home,
            opts,
            hooks,
            Arc::new(move |k: &str| {
                unit.as_ref()
                    .and_then(|u| u.get(k))
                    .or_else(|| std::env::var_os(k))
            }),
            stop,
            |ready| {
                let _ = writeln!(
                    std::io::stderr(),
                    "{}",
                    text::single_line(&format!(
                        "iteron broker: ready; agent socket {}, operator socket {}, {}",
                        ready.agent_socket.display(),
                        ready.operator_socket.display(),
                        if interactive {
                            "interactive"
                        } else {
                            "noninteractive"
                        }
                    ))
                );
            },
        )
        .await
        .map_err(|e| CliError::Serve(e.to_string()))
    })
}

/// `iteron approvals …`
pub(crate) fn run_approvals(args: ApprovalsArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let socket = operator_socket(&args.socket)?;
    match args
        .action
        .unwrap_or(Approvals::List(crate::args::FormatArg {
            format: Format::Text,
        })) {
        Approvals::List(f) => {
            let v = operator_request(&socket, "pending", json!({}))?;
            match f.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    let empty = Vec::new();
                    let items = v.get("pending").and_then(Value::as_array).unwrap_or(&empty);
                    if items.is_empty() {
                        return out_line(out, "nothing is waiting");
                    }
                    for item in items {
                        out_line(out, &describe_item(item))?;
                    }
                    Ok(())
                }
            }
        }
        Approvals::Approve(a) => decide(&socket, &a.ids, true, out),
        Approvals::Deny(a) => decide(&socket, &a.ids, false, out),
        Approvals::Answer(a) => {
            let (action, content) = if a.decline {
                ("decline", Map::new())
            } else if a.cancel {
                ("cancel", Map::new())
            } else {
                let raw = a.json.ok_or_else(|| {
                    CliError::Usage("give --json OBJECT, --decline or --cancel".into())
                })?;
                (
                    "accept",
                    parse_object(&raw)
                        .ok_or_else(|| CliError::Usage("--json must be a JSON object".into()))?,
                )
            };
            operator_request(
                &socket,
                "answer",
                json!({"id": a.id, "action": action, "content": content}),
            )?;
            out_line(out, &format!("answered {}", a.id))
        }
        Approvals::Watch => watch(&socket, out),
    }
}

/// Approve or deny waiting calls by id. One id that is not waiting exits 4 (as it always has);
/// with several, those not waiting are named and the command exits 4 if any was missing.
fn decide(socket: &Path, ids: &[u64], approve: bool, out: &mut dyn Write) -> Result<(), CliError> {
    let word = if approve { "approved" } else { "denied" };
    let params = match ids {
        [one] => json!({"id": one, "approve": approve}),
        many => json!({"ids": many, "approve": approve}),
    };
    let v = operator_request(socket, "decide", params)?;
    let list = |k: &str| -> Vec<u64> {
        v.get(k)
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default()
    };
    for id in list("decided") {
        out_line(out, &format!("{word} {id}"))?;
    }
    let missing = list("not_found");
    if !missing.is_empty() {
        let shown: Vec<String> = missing.iter().map(u64::to_string).collect();
        return Err(CliError::Broker(
            iteron_broker::ipc::client::ClientError::Refused {
                code: "not_found".into(),
                message: format!("not waiting: {}", shown.join(", ")),
                certainty: None,
            },
        ));
    }
    Ok(())
}

fn parse_object(raw: &str) -> Option<Map<String, Value>> {
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Object(m)) => Some(m),
        _ => None,
    }
}

fn describe_item(item: &Value) -> String {
    let s = |k: &str| {
        item.get(k)
            .and_then(Value::as_str)
            .unwrap_or("-")
            .to_owned()
    };
    let id = item.get("id").and_then(Value::as_u64).unwrap_or(0);
    let line = if s("kind") == "call" {
        let cut = if item.get("arguments_cut").and_then(Value::as_bool) == Some(true) {
            format!(
                " (cut: {} bytes in all; see --format json for the digest)",
                item.get("arguments_bytes")
                    .and_then(Value::as_u64)
                    .unwrap_or(0)
            )
        } else {
            String::new()
        };
        format!(
            "[{id}] call {}/{} from uid {} (session {}) arguments {}{cut}",
            s("server"),
            s("tool"),
            item.get("peer_uid").and_then(Value::as_u64).unwrap_or(0),
            s("session"),
            s("arguments")
        )
    } else {
        format!(
            "[{id}] form from {}: {} (schema {})",
            s("server"),
            s("message"),
            item.get("schema").map(Value::to_string).unwrap_or_default()
        )
    };
    // Not redacted: the operator must see what is approved (the broker already made the
    // arguments terminal-safe; escaping again keeps the line safe whatever arrived).
    text::escape_capped(&line, 8192)
}

fn watch(socket: &Path, out: &mut dyn Write) -> Result<(), CliError> {
    let rt = crate::rt::current_thread()?;
    let mut conn = rt.block_on(async {
        let mut c = operator_connect(socket).await.map_err(CliError::Broker)?;
        c.hello("iteron-approvals")
            .await
            .map_err(CliError::Broker)?;
        Ok::<_, CliError>(c)
    })?;
    let mut asked = std::collections::HashSet::new();
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    out_line(out, "waiting for calls and forms (end input to stop)")?;
    loop {
        let v = rt
            .block_on(conn.request("pending", json!({"wait_ms": 1000})))
            .map_err(CliError::Broker)?;
        let empty = Vec::new();
        let items = v.get("pending").and_then(Value::as_array).unwrap_or(&empty);
        if items.iter().all(|i| {
            i.get("id")
                .and_then(Value::as_u64)
                .is_none_or(|id| asked.contains(&id))
        }) {
            // Nothing new (only items already answered or skipped): do not spin.
            std::thread::sleep(Duration::from_millis(250));
        }
        for item in items {
            let Some(id) = item.get("id").and_then(Value::as_u64) else {
                continue;
            };
            if !asked.insert(id) {
                continue;
            }
            out_line(out, &describe_item(item))?;
            let form = item.get("kind").and_then(Value::as_str) == Some("form");
            let prompt = if form {
                "answer with a JSON object, or an empty line to decline: "
            } else {
                "approve? [y/N] "
            };
            write!(out, "{prompt}").map_err(CliError::Output)?;
            out.flush().map_err(CliError::Output)?;
            let mut line = String::new();
            if input.read_line(&mut line).map_err(CliError::Output)? == 0 {
                return Ok(());
            }
            let line = line.trim();
            let (method, params) = if form {
                match parse_object(line) {
                    Some(content) if !line.is_empty() => (
                        "answer",
                        json!({"id": id, "action": "accept", "content": content}),
                    ),
                    _ => ("answer", json!({"id": id, "action": "decline"})),
                }
            } else {
                let yes = matches!(line, "y" | "Y" | "yes");
                ("decide", json!({"id": id, "approve": yes}))
            };
            match rt.block_on(conn.request(method, params)) {
                Ok(_) => out_line(out, "sent")?,
                Err(e) => out_line(out, &text::single_line(&format!("not sent: {e}")))?,
            }
        }
    }
}

/// Connect and open the session (a child session with `--agent-type`).
async fn agent_session(socket: &Path, agent_type: Option<&str>) -> Result<Connection, ClientError> {
    let mut c = Connection::connect(socket).await?;
    let mut params =
        json!({"protocol": iteron_broker::ipc::proto::PROTOCOL_VERSION, "client": "iteron-agent"});
    if let (Some(t), Some(obj)) = (agent_type, params.as_object_mut()) {
        obj.insert("agent_type".into(), t.into());
    }
    c.request("hello", params).await?;
    Ok(c)
}

fn agent_socket(args: &AgentArgs) -> Result<PathBuf, CliError> {
    args.socket
        .clone()
        .or_else(|| std::env::var_os("ITERON_AGENT_SOCKET").map(PathBuf::from))
        .ok_or_else(|| CliError::Usage("give --socket PATH (or set ITERON_AGENT_SOCKET)".into()))
}

/// `iteron agent …`: needs only the socket.
pub(crate) fn run_agent(args: AgentArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let socket = agent_socket(&args)?;
    let rt = crate::rt::current_thread()?;
    let child = args.agent_type.as_deref();
    let one = |method: &str, params: Value| -> Result<Value, CliError> {
        rt.block_on(async {
            let mut c = agent_session(&socket, child).await?;
            c.request(method, params).await
        })
        .map_err(CliError::Broker)
    };
    let prompts = matches!(args.action, Agent::Prompts(_));
    match args.action {
        Agent::Skills(f) => {
            let v = one("list_skills", json!({}))?;
            match f.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    let empty = Vec::new();
                    for s in v.get("skills").and_then(Value::as_array).unwrap_or(&empty) {
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
            let v = one("use_skill", json!({"name": a.name}))?;
            let body = v.get("body").and_then(Value::as_str).unwrap_or("");
            for line in body.lines() {
                out_line(out, &text::single_line_capped(line, usize::MAX))?;
            }
            Ok(())
        }
        Agent::ResolveAgent(r) => {
            let mut params = json!({"agent_type": r.agent_type});
            if let (Some(m), Some(obj)) = (&r.model, params.as_object_mut()) {
                obj.insert("model".into(), m.clone().into());
            }
            let v = one("resolve_agent", params)?;
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
                _ => Err(CliError::Broker(ClientError::Refused {
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
            let (method, key) = if prompts {
                ("list_prompts", "prompts")
            } else {
                ("list_resources", "resources")
            };
            let v = one(method, json!({"server": a.server}))?;
            match a.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    let empty = Vec::new();
                    for r in v.get(key).and_then(Value::as_array).unwrap_or(&empty) {
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
            let v = one("read_resource", json!({"server": r.server, "uri": r.uri}))?;
            match r.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    let empty = Vec::new();
                    for c in v
                        .get("contents")
                        .and_then(Value::as_array)
                        .unwrap_or(&empty)
                    {
                        let t = c.get("text").and_then(Value::as_str).unwrap_or("");
                        // Server output is untrusted: terminal-safe, keeping line breaks.
                        for line in t.lines() {
                            out_line(out, &text::single_line_capped(line, usize::MAX))?;
                        }
                    }
                    notes_out(out, &v)
                }
            }
        }
        Agent::GetPrompt(g) => {
            let arguments = parse_object(&g.json)
                .filter(|m| m.values().all(Value::is_string))
                .ok_or_else(|| CliError::Usage("--json must be a JSON object of strings".into()))?;
            let v = one(
                "get_prompt",
                json!({"server": g.server, "name": g.name, "arguments": arguments}),
            )?;
            match g.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    let empty = Vec::new();
                    for m in v
                        .get("messages")
                        .and_then(Value::as_array)
                        .unwrap_or(&empty)
                    {
                        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
                        out_line(out, &format!("[{}]", text::single_line(role)))?;
                        let t = m.get("text").and_then(Value::as_str).unwrap_or("");
                        for line in t.lines() {
                            out_line(out, &text::single_line_capped(line, usize::MAX))?;
                        }
                    }
                    notes_out(out, &v)
                }
            }
        }
        Agent::Tools(f) => {
            let v = rt.block_on(async {
                let mut c = agent_session(&socket, child).await?;
                c.request("list_tools", json!({})).await
            });
            let v = v.map_err(CliError::Broker)?;
            match f.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    let empty = Vec::new();
                    for t in v.get("tools").and_then(Value::as_array).unwrap_or(&empty) {
                        let s = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or("");
                        out_line(
                            out,
                            &text::single_line(&format!(
                                "{}/{}  {}",
                                s("server"),
                                s("name"),
                                s("description")
                            )),
                        )?;
                    }
                    for u in v
                        .get("unavailable")
                        .and_then(Value::as_array)
                        .unwrap_or(&empty)
                    {
                        out_line(
                            out,
                            &text::single_line(&format!(
                                "{}: unavailable",
                                u.as_str().unwrap_or("")
                            )),
                        )?;
                    }
                    Ok(())
                }
            }
        }
        Agent::Call(c) => {
            let arguments = parse_object(&c.json)
                .ok_or_else(|| CliError::Usage("--json must be a JSON object".into()))?;
            let v = rt
                .block_on(async {
                    let mut conn = agent_session(&socket, child).await?;
                    conn.request(
                        "call_tool",
                        json!({"server": c.server, "tool": c.tool, "arguments": arguments}),
                    )
                    .await
                })
                .map_err(CliError::Broker)?;
            let is_error = v.get("is_error").and_then(Value::as_bool) == Some(true);
            match c.format {
                Format::Json => json_out(out, &v)?,
                Format::Text => {
                    let t = v.get("text").and_then(Value::as_str).unwrap_or("");
                    // Tool output is untrusted: make it terminal-safe, keeping line breaks.
                    for line in t.lines() {
                        out_line(out, &text::single_line_capped(line, usize::MAX))?;
                    }
                }
            }
            if is_error {
                return Err(CliError::Server("the tool reported an error".into()));
            }
            Ok(())
        }
    }
}

/// A result's notes (what was left out or cut), one line each, marked as notes.
fn notes_out(out: &mut dyn Write, v: &Value) -> Result<(), CliError> {
    let empty = Vec::new();
    for n in v.get("notes").and_then(Value::as_array).unwrap_or(&empty) {
        out_line(
            out,
            &text::single_line(&format!("note: {}", n.as_str().unwrap_or(""))),
        )?;
    }
    Ok(())
}

/// `iteron audit verify`
pub(crate) fn run_audit(cmd: Audit, out: &mut dyn Write) -> Result<(), CliError> {
    let Audit::Verify(f) = cmd;
    let home = home()?;
    match iteron_broker::audit::verify(home.dir()) {
        Ok(v) => match f.format {
            Format::Json => json_out(
                out,
                &json!({"ok": true, "records": v.records, "files": v.files, "head": v.head, "head_lagging": v.head_lagging}),
            ),
            Format::Text => {
                out_line(
                    out,
                    &format!(
                        "audit log verified: {} records in {} files; head {}… (the full value: --format json)",
                        v.records,
                        v.files,
                        v.head.get(..12).unwrap_or_default()
                    ),
                )?;
                if v.head_lagging {
                    out_line(
                        out,
                        "note: the head was one record behind (the broker stopped between writing a record and its head)",
                    )?;
                }
                Ok(())
            }
        },
        Err(t) => Err(CliError::Audit(t.to_string())),
    }
}

/// The snapshot to show: a running broker's (what its sessions get, discovered when it
/// started) when one answers on this home's operator socket and `--repo` is absent or names the
/// repository it was started with; otherwise a discovery made now. The second value says which.
fn catalog_view(args: &CatalogArgs) -> Result<(Value, &'static str), CliError> {
    use std::os::unix::ffi::OsStrExt;
    let home = home()?;
    let socket = default_operator_socket(&home);
    if let Some(v) = broker_catalog(&socket) {
        let wanted = args.repo.as_ref().map(|r| {
            let real = std::fs::canonicalize(r).unwrap_or_else(|_| r.clone());
            iteron_broker::audit::sha256_hex(real.as_os_str().as_bytes())
        });
        let broker_repo = v.get("repo_sha256").and_then(Value::as_str);
        if wanted.is_none() || wanted.as_deref() == broker_repo {
            return Ok((v, "broker"));
        }
        let _ = writeln!(
            std::io::stderr(),
            "iteron: note: the running broker was started for another repository; this is a discovery of --repo made now"
        );
    }
    let cat = iteron_broker::catalog::discover(home.dir(), args.repo.as_deref());
    Ok((cat.snapshot_json(), "discovery"))
}

/// A running broker's snapshot, or `None` when no broker of this home answers in time.
fn broker_catalog(socket: &Path) -> Option<Value> {
    let rt = crate::rt::current_thread().ok()?;
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), async {
            let mut c = operator_connect(socket).await.ok()?;
            c.hello("iteron-cli").await.ok()?;
            c.request("catalog", json!({})).await.ok()
        })
        .await
        .ok()
        .flatten()
    })
}

fn rejected_text(out: &mut dyn Write, view: &Value) -> Result<(), CliError> {
    // Path and reason are already terminal-safe; escaping them again would double escapes.
    let empty = Vec::new();
    for r in view
        .get("rejected")
        .and_then(Value::as_array)
        .unwrap_or(&empty)
    {
        let g = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("");
        out_line(out, &format!("rejected {}: {}", g("path"), g("reason")))?;
    }
    let more = view
        .get("rejected_more")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    if more > 0 {
        out_line(out, &format!("({more} more rejected)"))?;
    }
    let omitted = view.get("omitted").and_then(Value::as_u64).unwrap_or(0);
    if omitted > 0 {
        out_line(
            out,
            &format!("({omitted} entries over the snapshot's size bound not shown)"),
        )?;
    }
    Ok(())
}

/// One view of the snapshot: its `key` entries (`skills` or `agents`), the rejections of that
/// kind and those concerning both, the counts, and where it came from.
fn view_of(snapshot: &Value, key: &str, source: &str) -> Value {
    let kind = if key == "skills" { "skill" } else { "agent" };
    let rejected: Vec<Value> = snapshot
        .get("rejected")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|r| r["kind"] == kind || r["kind"] == "other")
        .map(|r| json!({"path": r["path"], "reason": r["reason"]}))
        .collect();
    json!({
        key: snapshot.get(key).cloned().unwrap_or_else(|| json!([])),
        "rejected": rejected,
        "rejected_more": snapshot.get("rejected_more").cloned().unwrap_or(json!(0)),
        "omitted": snapshot.get("omitted").cloned().unwrap_or(json!(0)),
        "source": source,
    })
}

/// One view (`skills` or `agents`) of the snapshot: JSON as it is, or one text line per entry
/// (`line`) followed by the rejections.
fn run_view(
    args: CatalogArgs,
    out: &mut dyn Write,
    key: &str,
    line: fn(&Value) -> String,
) -> Result<(), CliError> {
    let (snapshot, source) = catalog_view(&args)?;
    let view = view_of(&snapshot, key, source);
    match args.format {
        Format::Json => json_out(out, &view),
        Format::Text => {
            let empty = Vec::new();
            for entry in view.get(key).and_then(Value::as_array).unwrap_or(&empty) {
                out_line(out, &text::single_line(&line(entry)))?;
            }
            rejected_text(out, &view)
        }
    }
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// `iteron skills`: the skill index (the running broker's, or discovered now), and what was
/// refused and why.
pub(crate) fn run_skills(args: CatalogArgs, out: &mut dyn Write) -> Result<(), CliError> {
    run_view(args, out, "skills", |s| {
        format!(
            "{}  ({})  {}",
            str_of(s, "name"),
            str_of(s, "tier"),
            str_of(s, "description")
        )
    })
}

/// `iteron agents`: the runtime snapshot of agent definitions, with tiers and identities.
pub(crate) fn run_agents(args: CatalogArgs, out: &mut dyn Write) -> Result<(), CliError> {
    run_view(args, out, "agents", |a| {
        let tools: Vec<&str> = a
            .get("tools")
            .and_then(Value::as_array)
            .map(|t| t.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let budget = |k: &str| a["budget"][k].as_u64().unwrap_or(0);
        format!(
            "{}  ({})  identity {}  tools {}  turns {}  wall {} s",
            str_of(a, "name"),
            str_of(a, "tier"),
            str_of(a, "identity").get(..16).unwrap_or_default(),
            tools.join(","),
            budget("max_turns"),
            budget("max_wall_secs")
        )
    })
}
