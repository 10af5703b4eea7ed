//! What a session may see: the configuration as it is now, the exposure rule, and the listings
//! (tools of every exposed server, a bounded number at once; resources and prompts of one
//! server).

use super::denial::{Denial, describe_failure, slot_denial};
use super::project::field;
use super::{Broker, MAX_RESULT_TEXT, Session};
use crate::audit::Event;
use crate::audit::{Decision, Kind, Outcome};
use crate::ipc::proto::{self, Refusal};
use crate::mcp::client::Tool;
use crate::registry::{Slot, SlotError, Snapshot};
use crate::servers::KnownSecrets;
use iteron_policy::capability::{CapabilitySet, Exposure, decide_exposure};
use iteron_policy::config::ServerConfig;
use iteron_policy::names::ToolName;
use serde_json::{Value, json};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub(super) fn exposed(ceiling: CapabilitySet, server: &ServerConfig, tool: &str) -> bool {
    let Ok(name) = ToolName::parse(tool) else {
        return false;
    };
    matches!(
        decide_exposure(
            ceiling,
            &server.tools,
            &server.policy,
            &name,
            CapabilitySet::MCP_TOOL
        ),
        Exposure::Expose(_)
    )
}

/// The configuration as it is now: every request is decided on it, so a server removed or a
/// tool denied since a session opened is gone for that session too. Reading it costs a `stat`
/// when the file did not change. Fail closed: an unreadable configuration refuses the request.
pub(super) fn current(broker: &Broker) -> Result<Arc<Snapshot>, Denial> {
    broker
        .registry
        .snapshot()
        .map_err(|_| Denial::ConfigUnreadable)
}

/// The exposed catalog of one server for this session (connecting first if needed). The
/// server's full catalog is retained per generation by the registry; what this session may
/// see is decided here, on the configuration `snap` is.
pub(super) async fn session_catalog(
    broker: &Broker,
    s: &Session,
    snap: &Snapshot,
    server: &ServerConfig,
) -> Result<(Arc<Slot>, Arc<crate::mcp::client::Client>, Vec<Tool>), SlotError> {
    let (slot, client) = broker.registry.client(snap, server).await?;
    let all = broker
        .registry
        .catalog(&slot, &client)
        .await
        .map_err(|e| SlotError::Connect(slot.secrets().scrub(&e.to_string())))?;
    let ceiling = s.ceiling(&snap.config);
    let tools: Vec<Tool> = all
        .iter()
        .filter(|t| exposed(ceiling, server, &t.name))
        .cloned()
        .collect();
    Ok((slot, client, tools))
}

/// How long `list_tools` waits for one server's catalog (connecting included), counted from
/// when the server's turn comes. Servers are asked [`MAX_LIST_PARALLEL`] at a time, so hung
/// ones cost this once per round, not once per server.
pub const LIST_SERVER_DEADLINE: Duration = Duration::from_secs(15);

/// Most servers one `list_tools` asks at once (the operator's probes use the same bound); the
/// others wait for a free place.
pub const MAX_LIST_PARALLEL: usize = crate::servers::MAX_PARALLEL_CONNECTS;

/// Bound of a whole `list_tools`: a server not answered by then (still asked, or still waiting
/// for its turn) is `unavailable`, with a note saying how many were cut off.
pub const LIST_DEADLINE: Duration = Duration::from_secs(60);

// A stdio server's start ends (and is reported with its stderr lines) before the listing
// gives up on it.
const _: () =
    assert!(crate::registry::START_DEADLINE.as_millis() < LIST_SERVER_DEADLINE.as_millis());

/// Run `futures` on this task, at most `limit` at a time, in order: a future is first polled
/// when its turn comes, so a deadline it sets starts then. Stops when all are done or `whole`
/// has passed; the outputs come back in order, `None` for each future not done then (it is
/// dropped, with whatever it was starting).
pub(super) async fn join_bounded<T>(
    mut futures: Vec<Pin<Box<dyn Future<Output = T> + Send + '_>>>,
    limit: usize,
    whole: Duration,
) -> Vec<Option<T>> {
    let limit = limit.max(1);
    let mut out: Vec<Option<T>> = futures.iter().map(|_| None).collect();
    let mut started = 0usize;
    let mut done = 0usize;
    let mut end = std::pin::pin!(tokio::time::sleep(whole));
    std::future::poll_fn(|cx| {
        loop {
            // Admit the next ones while there is room.
            while started < futures.len() && started - done < limit {
                started += 1;
            }
            let mut finished = false;
            for (f, slot) in futures.iter_mut().zip(out.iter_mut()).take(started) {
                if slot.is_none()
                    && let std::task::Poll::Ready(v) = f.as_mut().poll(cx)
                {
                    *slot = Some(v);
                    done += 1;
                    finished = true;
                }
            }
            if done == futures.len() {
                return std::task::Poll::Ready(());
            }
            // A place came free and someone waits: start it now (its first poll registers
            // its waker), else sleep until something wakes this task.
            if !(finished && started < futures.len()) {
                break;
            }
        }
        end.as_mut().poll(cx)
    })
    .await;
    out
}

/// What one server contributed to a `list_tools` answer.
pub(super) enum Listed {
    Tools(Vec<Value>),
    Unavailable,
}

pub(super) async fn list_tools(broker: &Broker, s: &Session) -> Result<Value, Refusal> {
    let snap = current(broker)?;
    let ceiling = s.ceiling(&snap.config);
    // A server none of whose tools the policy can expose is never started and never named
    // (a child's read-only ceiling exposes no MCP tool at all).
    let servers: Vec<&ServerConfig> = snap
        .config
        .mcp_servers
        .iter()
        .filter(|server| {
            iteron_policy::capability::server_tools_exposed(ceiling, &server.tools, &server.policy)
        })
        .collect();
    let asks: Vec<Pin<Box<dyn Future<Output = Listed> + Send + '_>>> = servers
        .iter()
        .map(|server| {
            let snap = &snap;
            let ask = async move {
                match tokio::time::timeout(
                    LIST_SERVER_DEADLINE,
                    session_catalog(broker, s, snap, server),
                )
                .await
                {
                    Ok(Ok((slot, _, catalog))) => {
                        let secrets = slot.secrets();
                        Listed::Tools(
                            catalog
                                .iter()
                                .map(|t| {
                                    // Scrubbed where the server's bytes came in; scrubbed again
                                    // here, value by value, for what came through another way.
                                    let mut input_schema = t.input_schema.clone();
                                    secrets.scrub_json(&mut input_schema);
                                    json!({
                                        "server": server.name.as_str(),
                                        "name": t.name,
                                        "description": secrets.scrub(&t.description),
                                        "input_schema": input_schema,
                                        // Whether calls can be approved (broker/src/rules.rs).
                                        "approval": crate::rules::marker(
                                            &broker.rules,
                                            &s.rule_counts,
                                            &snap.config,
                                            server.name.as_str(),
                                            &t.name,
                                            s.peer.uid,
                                            s.child.as_ref().map(|c| c.def.identity.as_str()),
                                            broker.approvals.interactive(),
                                        ),
                                    })
                                })
                                .collect(),
                        )
                    }
                    // The agent learns only that the server is unavailable; the operator sees
                    // why in `iteron broker status`.
                    _ => Listed::Unavailable,
                }
            };
            Box::pin(ask) as Pin<Box<dyn Future<Output = Listed> + Send + '_>>
        })
        .collect();
    let listed = join_bounded(asks, MAX_LIST_PARALLEL, LIST_DEADLINE).await;
    let mut tools = Vec::new();
    let mut unavailable = Vec::new();
    let mut notes = Vec::new();
    let mut used = 0usize;
    let mut cut_off = 0usize;
    for (server, got) in servers.iter().zip(listed) {
        match got {
            None => {
                cut_off += 1;
                unavailable.push(server.name.as_str().to_owned());
            }
            Some(Listed::Tools(entries)) => {
                // A catalog that does not fit in what is left of the answer is left out whole,
                // for that server only, with a note (the answer itself always fits a frame).
                let size: usize = entries
                    .iter()
                    .map(|e| serde_json::to_vec(e).map_or(usize::MAX, |v| v.len()))
                    .fold(0usize, usize::saturating_add);
                if used.saturating_add(size) > MAX_RESULT_TEXT {
                    notes.push(format!(
                        "the catalog of server {} ({} tools, {size} bytes) does not fit in the answer (at most {MAX_RESULT_TEXT} bytes) and is left out",
                        server.name.as_str(),
                        entries.len()
                    ));
                    continue;
                }
                used += size;
                tools.extend(entries);
            }
            Some(Listed::Unavailable) => unavailable.push(server.name.as_str().to_owned()),
        }
    }
    if cut_off > 0 {
        notes.push(format!(
            "{cut_off} server(s) had not answered when the listing's bound of {} s ran out and are listed as unavailable",
            LIST_DEADLINE.as_secs()
        ));
    }
    broker.audit(Event {
        session: Some(s.id.clone()),
        peer_uid: Some(s.peer.uid),
        peer_pid: s.peer.pid,
        ..Event::new(Kind::ListTools, Decision::Allowed, Outcome::Ok)
    });
    Ok(json!({"tools": tools, "unavailable": unavailable, "notes": notes}))
}

/// Most resources or prompts listed from one server; more are dropped with a note.
pub const MAX_LISTED: usize = 1000;
/// Most prompt arguments in one `get_prompt`.
pub const MAX_PROMPT_ARGUMENTS: usize = 64;
/// Longest prompt name or argument name in a request.
pub const MAX_PROMPT_NAME: usize = 256;

/// The server a resource or prompt request names, if this session may use it. A server that
/// is not offered answers exactly like one that does not exist, and is never started.
pub(super) fn reads_server<'a>(
    s: &Session,
    snap: &'a Snapshot,
    name: &str,
) -> Result<&'a ServerConfig, Denial> {
    let server = snap.config.server(name).ok_or(Denial::UnknownServer)?;
    if !iteron_policy::capability::server_reads_exposed(s.ceiling(&snap.config), &server.policy) {
        return Err(Denial::UnknownServer);
    }
    Ok(server)
}

/// `list_resources` and `list_prompts`.
pub(super) async fn list_reads(
    broker: &Broker,
    s: &Session,
    server_name: &str,
    prompts: bool,
) -> Result<Value, Refusal> {
    let kind = if prompts {
        Kind::ListPrompts
    } else {
        Kind::ListResources
    };
    let audit = |decision: Decision, outcome: Outcome, server: Option<String>| {
        broker.audit(Event {
            session: Some(s.id.clone()),
            peer_uid: Some(s.peer.uid),
            peer_pid: s.peer.pid,
            server,
            ..Event::new(kind, decision, outcome)
        });
    };
    // Each refusal is recorded with the denial's own decision and outcome.
    let deny = |d: Denial, server: Option<String>| -> Refusal {
        let (decision, outcome) = d.audit();
        audit(decision, outcome, server);
        d.refusal()
    };
    let snap = current(broker)?;
    let server = reads_server(s, &snap, server_name).map_err(|d| deny(d, None))?;
    let name = server.name.as_str().to_owned();
    let (slot, client) = match broker.registry.client(&snap, server).await {
        Ok(x) => x,
        Err(e) => return Err(deny(slot_denial(&e), Some(name))),
    };
    let listed = if prompts {
        client.list_prompts().await
    } else {
        client.list_resources().await
    };
    let secrets = slot.secrets();
    let items = match listed {
        Ok(v) => v,
        Err(e) => {
            let why = secrets.scrub(&format!(
                "the server did not list its {}: {}",
                if prompts { "prompts" } else { "resources" },
                describe_failure(&e, &secrets)
            ));
            return Err(deny(Denial::ListFailed(why), Some(name)));
        }
    };
    let mut notes = Vec::new();
    let mut out = Vec::new();
    let mut used = 0usize;
    let mut unusable = 0usize;
    for item in items.iter().take(MAX_LISTED) {
        // What the agent sends back (a URI, a prompt or argument name) is passed exactly, or
        // not at all; what it only reads is made terminal-safe and bounded.
        let entry = if prompts {
            let Some(name) = exact(item, "name", valid_name, &secrets) else {
                unusable += 1;
                continue;
            };
            let arguments: Vec<Value> = item
                .get("arguments")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .take(MAX_PROMPT_ARGUMENTS)
                .filter_map(|a| {
                    Some(json!({
                        "name": exact(a, "name", valid_name, &secrets)?,
                        "description": field(a, "description", &secrets, 1024),
                        "required": a.get("required").and_then(Value::as_bool).unwrap_or(false),
                    }))
                })
                .collect();
            json!({
                "name": name,
                "description": field(item, "description", &secrets, 2048),
                "arguments": arguments,
            })
        } else {
            let Some(uri) = exact(item, "uri", valid_uri, &secrets) else {
                unusable += 1;
                continue;
            };
            json!({
                "uri": uri,
                "name": field(item, "name", &secrets, 256),
                "description": field(item, "description", &secrets, 2048),
                "mime_type": field(item, "mimeType", &secrets, 128),
            })
        };
        if !push_bounded(&mut out, entry, &mut used) {
            break;
        }
    }
    if unusable > 0 {
        notes.push(format!(
            "{unusable} entries were left out: a name or uri that is empty, too long, holds a control character or a secret"
        ));
    }
    if out.len() + unusable < items.len() {
        notes.push(format!(
            "{} of {} entries are shown (at most {MAX_LISTED}, and {MAX_RESULT_TEXT} bytes)",
            out.len(),
            items.len()
        ));
    }
    audit(Decision::Allowed, Outcome::Ok, Some(name));
    Ok(if prompts {
        json!({"prompts": out, "notes": notes})
    } else {
        json!({"resources": out, "notes": notes})
    })
}

pub(super) fn valid_uri(u: &str) -> bool {
    !u.is_empty() && u.len() <= proto::MAX_RESOURCE_URI && !u.chars().any(char::is_control)
}

pub(super) fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= MAX_PROMPT_NAME && !n.chars().any(char::is_control)
}

/// A name or URI the agent must be able to send back exactly: passed raw (JSON carries it
/// safely; the CLI escapes what it prints) if it is usable and holds no secret, else `None`.
pub(super) fn exact(
    v: &Value,
    key: &str,
    valid: fn(&str) -> bool,
    secrets: &KnownSecrets,
) -> Option<String> {
    let raw = v.get(key).and_then(Value::as_str).filter(|t| valid(t))?;
    (secrets.scrub(raw) == raw).then(|| raw.to_owned())
}

/// Add `entry` to `out` while the entries stay within `*budget` bytes of JSON (so an answer
/// always fits in a frame); `false` once one would not.
pub(super) fn push_bounded(out: &mut Vec<Value>, entry: Value, budget: &mut usize) -> bool {
    let size = serde_json::to_vec(&entry).map_or(usize::MAX, |v| v.len());
    if budget.saturating_add(size) > MAX_RESULT_TEXT {
        return false;
    }
    *budget += size;
    out.push(entry);
    true
}
