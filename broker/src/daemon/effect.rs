//! The effect pipeline: exposure → `PreToolUse` hooks → approval (rule or operator) →
//! `dispatching` record → the effect, once → outcome record → `PostToolUse` hooks. Tool calls,
//! resource reads and prompt gets all go this way.

use super::arguments::take_arguments;
use super::denial::{Denial, describe_failure, failure_reason, slot_denial};
use super::listing::{
    MAX_PROMPT_ARGUMENTS, current, exposed, reads_server, session_catalog, valid_name, valid_uri,
};
use super::project::{cut_escaped, project_contents, project_prompt};
use super::record::{CallRecord, Dispatched};
use super::{Broker, MAX_RESULT_TEXT, Session};
use crate::approvals::{self, CallInfo};
use crate::audit::{Decision, Kind, Outcome};
use crate::hooks::ToolEvent;
use crate::ipc::proto::{self, Refusal};
use crate::mcp::client::McpError;
use crate::registry::Slot;
use crate::servers::KnownSecrets;
use serde_json::{Map, Value, json};
use std::future::Future;
use std::sync::Arc;

pub(super) async fn call_tool(
    broker: &Broker,
    s: &Session,
    c: proto::CallTool,
) -> Result<Value, Refusal> {
    let (arguments, args_sha256, _charge) = take_arguments(broker, s, Value::Object(c.arguments))?;
    // First, before anything tells known tools from unknown ones: an unwritable audit log
    // refuses every call alike.
    let mut record = CallRecord::open(broker, s, Kind::CallTool, &args_sha256)?;
    let snap = current(broker).map_err(|d| record.deny(d))?;
    let Some(server) = snap.config.server(&c.server) else {
        return Err(record.deny(Denial::UnknownTool));
    };
    record.event.server = Some(server.name.as_str().to_owned());
    let ceiling = s.ceiling(&snap.config);
    // Policy and filters first: a hidden tool never starts its server.
    if !exposed(ceiling, server, &c.tool) {
        return Err(record.deny(Denial::UnknownTool));
    }
    let (slot, client, catalog) = session_catalog(broker, s, &snap, server)
        .await
        .map_err(|e| record.deny(slot_denial(&e)))?;
    let generation = slot.generation();
    let Some(tool) = catalog.iter().find(|t| t.name == c.tool) else {
        return Err(record.deny(Denial::UnknownTool));
    };
    record.event.tool = Some(tool.name.clone());
    let effect = Effect {
        server: server.name.as_str(),
        what: &tool.name,
        arguments,
        generation,
        args_sha256,
    };
    let (event, dispatched) = before_effect(broker, s, &mut record, &slot, effect).await?;
    // Exactly the bytes the operator approved are sent; the tree lives only for the call.
    let result = under_cancel(
        &slot,
        dispatched,
        s,
        &event,
        client.call_tool(&tool.name, event.arguments_map()),
    )
    .await;
    let secrets = slot.secrets();
    let (answer, outcome, detail) = match result {
        None => cancelled_effect(),
        Some(Ok(p)) => {
            let mut text_out = secrets.scrub(&p.text);
            let mut notes = p.notes.clone();
            if cut_escaped(&mut text_out, MAX_RESULT_TEXT) {
                notes.push(format!(
                    "the result was cut to {MAX_RESULT_TEXT} bytes (as JSON text)"
                ));
            }
            let outcome = if p.is_error {
                Outcome::ToolError
            } else {
                Outcome::Ok
            };
            (
                Ok(json!({"text": text_out, "is_error": p.is_error, "notes": notes})),
                outcome,
                None,
            )
        }
        Some(Err(e)) => failed_effect(&e, &secrets),
    };
    after_effect(broker, s, &mut record, &event, outcome, detail).await;
    answer
}

/// One read a server performs for the agent.
pub(super) enum Read {
    Resource(String),
    Prompt(String, Map<String, Value>),
}

/// `read_resource` and `get_prompt`: approved per call, audited before and after.
pub(super) async fn server_read(
    broker: &Broker,
    s: &Session,
    server_name: &str,
    read: Read,
) -> Result<Value, Refusal> {
    let (kind, method, args) = match &read {
        Read::Resource(uri) => (Kind::ReadResource, "resources/read", json!({"uri": uri})),
        Read::Prompt(name, arguments) => (
            Kind::GetPrompt,
            "prompts/get",
            json!({"name": name, "arguments": arguments}),
        ),
    };
    let (arguments, args_sha256, _charge) = take_arguments(broker, s, args)?;
    let mut record = CallRecord::open(broker, s, kind, &args_sha256)?;
    let snap = current(broker).map_err(|d| record.deny(d))?;
    let server = reads_server(s, &snap, server_name).map_err(|d| record.deny(d))?;
    record.event.server = Some(server.name.as_str().to_owned());
    // The request's own bounds, before anything starts or reaches the operator.
    let malformed = match &read {
        Read::Resource(uri) => (!valid_uri(uri)).then_some(
            "the uri is empty, over 2048 bytes or holds a control character; nothing was sent",
        ),
        Read::Prompt(name, arguments) => (!valid_name(name)
            || arguments.len() > MAX_PROMPT_ARGUMENTS
            || arguments.keys().any(|k| !valid_name(k)))
        .then_some(
            "the prompt name or an argument name is empty, over 256 bytes or holds a control character, or there are over 64 arguments; nothing was sent",
        ),
    };
    if let Some(why) = malformed {
        return Err(record.deny(Denial::BadRequest(why)));
    }
    let (slot, client) = broker
        .registry
        .client(&snap, server)
        .await
        .map_err(|e| record.deny(slot_denial(&e)))?;
    let generation = slot.generation();
    // The tool hooks run around this effect too, with the MCP method as the tool's name.
    let effect = Effect {
        server: server.name.as_str(),
        what: method,
        arguments,
        generation,
        args_sha256,
    };
    let (event, dispatched) = before_effect(broker, s, &mut record, &slot, effect).await?;
    let effect = async {
        match &read {
            Read::Resource(uri) => client.read_resource(uri).await,
            Read::Prompt(name, arguments) => client.get_prompt(name, arguments.clone()).await,
        }
    };
    let result = under_cancel(&slot, dispatched, s, &event, effect).await;
    let secrets = slot.secrets();
    let (answer, outcome, detail) = match result {
        None => cancelled_effect(),
        Some(Ok(v)) => (
            Ok(match &read {
                Read::Resource(_) => project_contents(&v, &secrets),
                Read::Prompt(..) => project_prompt(&v, &secrets),
            }),
            Outcome::Ok,
            None,
        ),
        Some(Err(e)) => failed_effect(&e, &secrets),
    };
    after_effect(broker, s, &mut record, &event, outcome, detail).await;
    answer
}

/// One effect about to be asked for: on which server, what (a tool's name, or the MCP method
/// of a read), with which arguments, for which generation of the server's process.
pub(super) struct Effect<'a> {
    pub(super) server: &'a str,
    pub(super) what: &'a str,
    pub(super) arguments: Arc<str>,
    pub(super) generation: u64,
    pub(super) args_sha256: String,
}

/// What every effect goes through between exposure and the effect itself: the `PreToolUse`
/// hooks (not for a child), the operator's approval, the checks that the server is still the
/// one the request was prepared for and was not cancelled meanwhile, and the `dispatching`
/// record (if it cannot be written, nothing is sent). Returns the hooks' view of the effect
/// and the proof of that record, which the effect consumes; on any refusal the call's record
/// is finished and nothing was sent.
pub(super) async fn before_effect(
    broker: &Broker,
    s: &Session,
    record: &mut CallRecord<'_>,
    slot: &Slot,
    effect: Effect<'_>,
) -> Result<(ToolEvent, Dispatched), Refusal> {
    let Effect {
        server,
        what,
        arguments,
        generation,
        args_sha256,
    } = effect;
    let event = ToolEvent {
        session: s.id.clone(),
        server: server.to_owned(),
        tool: what.to_owned(),
        arguments,
    };
    let hooks = record.pre_tool_use(&event).await?;
    // A cancel, restart or stop of this server from now on also stops this call.
    let epoch = slot.cancel_epoch();
    // Approval rules (broker/src/rules.rs): the operator's own rules approve or refuse ahead
    // of time; whatever they leave undecided goes on to the operator as before.
    // Judged on the rules as they are now: a rule the operator removed no longer approves.
    let snap = current(broker).map_err(|d| record.deny(d))?;
    let judged = crate::rules::judge(
        &broker.rules,
        &s.rule_counts,
        &snap.config.approvals,
        &crate::rules::Facts {
            server: &event.server,
            tool: &event.tool,
            arguments: &event.arguments,
            args_sha256: &args_sha256,
            uid: s.peer.uid,
            identity: s.child.as_ref().map(|c| c.def.identity.as_str()),
        },
    );
    let (approval, note) = match judged {
        crate::rules::Judged::Approved(mark) => (Ok(Some(mark)), None),
        crate::rules::Judged::Denied(mark) => {
            return Err(record.deny(Denial::DeniedByRule(mark)));
        }
        crate::rules::Judged::Ask { note, park } => {
            let preview = approvals::Arguments::from_canonical(Arc::clone(&event.arguments));
            let info = CallInfo {
                session: s.id.clone(),
                peer_uid: s.peer.uid,
                peer_pid: s.peer.pid,
                server: event.server.clone(),
                tool: event.tool.clone(),
                args_sha256,
                arguments: preview,
            };
            let asked = broker.approvals.approve_or_park(info, park).await;
            (asked.map(|()| None), note)
        }
    };
    let approved = match approval {
        Ok(rule) => record.approved(hooks, rule),
        Err(why) => return Err(record.deny(Denial::NotApproved(why, note))),
    };
    // The operator may have restarted or stopped the server while the call waited: never send
    // it to a different (or closed) connection than the one it was prepared for.
    if slot.generation() != generation || !slot.is_ready() {
        return Err(record.deny(Denial::ServerRestarted));
    }
    if slot.cancel_epoch() != epoch {
        return Err(record.deny(Denial::CancelledWhileWaiting));
    }
    // The effect is audited before it happens.
    let dispatched = record
        .dispatching(approved, epoch)
        .map_err(|gate| record.deny(Denial::DispatchNotRecorded(gate)))?;
    Ok((event, dispatched))
}

/// Run `effect` as one call on `slot`, consuming the proof that it was approved and its
/// `dispatching` record written: `None` if the operator cancels calls on the server (a cancel,
/// restart or stop) before it completes. The only place an effect's future is run.
pub(super) async fn under_cancel<T>(
    slot: &Slot,
    dispatched: Dispatched,
    s: &Session,
    event: &ToolEvent,
    effect: impl Future<Output = T>,
) -> Option<T> {
    let mut guard = slot.begin_call(
        dispatched.epoch(),
        approvals::CallContext {
            session: s.id.clone(),
            peer_uid: s.peer.uid,
            tool: event.tool.clone(),
        },
    );
    tokio::select! {
        biased;
        _ = guard.cancelled.changed() => None,
        r = effect => Some(r),
    }
}

pub(super) type EffectEnd = (Result<Value, Refusal>, Outcome, Option<String>);

/// An effect the operator cancelled while it ran.
pub(super) fn cancelled_effect() -> EffectEnd {
    let d = Denial::CancelledDuringEffect;
    (
        Err(d.refusal()),
        d.audit().1,
        Some("certainty maybe_applied".to_owned()),
    )
}

/// An effect that failed: the agent gets a fixed description (or the server's own error) and
/// the certainty; the audit record also gets the full failure, scrubbed.
pub(super) fn failed_effect(e: &McpError, secrets: &KnownSecrets) -> EffectEnd {
    let d = Denial::EffectFailed {
        message: secrets.scrub(&describe_failure(e, secrets)),
        certainty: e.certainty(),
        reason: failure_reason(e),
    };
    let failure = secrets.scrub(&e.to_string());
    (
        Err(d.refusal()),
        d.audit().1,
        Some(format!("certainty {}; {failure}", e.certainty().as_str())),
    )
}

/// Record an effect's outcome, then run the `PostToolUse` hooks (not for a child). The outcome
/// is recorded first: an agent that goes away during a hook cannot turn an applied effect into
/// a "cancelled" record.
pub(super) async fn after_effect(
    broker: &Broker,
    s: &Session,
    record: &mut CallRecord<'_>,
    event: &ToolEvent,
    outcome: Outcome,
    detail: Option<String>,
) {
    record.finish(Decision::Approved, outcome, detail);
    if s.child.is_none() {
        let reports = broker.hooks.post_tool_use(event, outcome.as_str()).await;
        broker.audit_hooks(Some(&s.id), s.peer, &reports);
    }
}
