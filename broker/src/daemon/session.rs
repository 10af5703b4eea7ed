//! An open session's requests, dispatched by kind (a child session's budgets checked around
//! each call), and the requests that need no server: skills and agent definitions.

use super::denial::Denial;
use super::effect::{Read, call_tool, server_read};
use super::listing::{list_reads, list_tools};
use super::operator::operator;
use super::{Broker, Peer, Session};
use crate::audit::Event;
use crate::audit::{Decision, Kind, Outcome};
use crate::catalog::Catalog;
use crate::ipc::proto::Reason;
use crate::ipc::proto::{self, AgentRequest, Refusal, Request};
use iteron_policy::agentdef::{self, AgentDef};
use iteron_policy::config::HookEvent;
use serde_json::{Value, json};
use std::sync::atomic::Ordering;
use std::time::Duration;

pub(super) async fn dispatch(
    broker: &Broker,
    peer: Peer,
    session: Option<&Session>,
    request: Request,
) -> Result<Value, Refusal> {
    if let Some(s) = session {
        check_wall_budget(s)?;
    }
    match (request, session) {
        (Request::Operator(r), _) => operator(broker, peer, r).await,
        (Request::Agent(r), Some(s)) => agent(broker, s, r).await,
        // An agent request is decoded only in an open session, which an agent connection has
        // from its `hello` on; refused rather than trusted if that ever were not so.
        (Request::Agent(_), None) => Err(Denial::NotAllowedHere.refusal()),
    }
}

async fn agent(broker: &Broker, s: &Session, request: AgentRequest) -> Result<Value, Refusal> {
    match request {
        AgentRequest::ListTools => list_tools(broker, s).await,
        AgentRequest::CallTool(c) => match &s.child {
            None => call_tool(broker, s, c).await,
            Some(child) => {
                let _serial = child.serial.lock().await;
                check_wall_budget(s)?;
                let turn = child.turns.fetch_add(1, Ordering::SeqCst) + 1;
                if turn > child.def.budget.max_turns {
                    return Err(Denial::ChildTurnsSpent.refusal());
                }
                let limit = child.def.budget.max_consecutive_tool_errors;
                if child.consecutive_errors.load(Ordering::SeqCst) >= limit {
                    return Err(Denial::ChildErrorLimit.refusal());
                }
                // The wall-clock budget bounds the call itself, not only its start.
                let left = Duration::from_secs(child.def.budget.max_wall_secs)
                    .saturating_sub(child.started.elapsed());
                let call = call_tool(broker, s, c);
                tokio::pin!(call);
                let r = tokio::select! {
                    // The call first: it must at least start (and open its record) even when
                    // the budget is about to run out.
                    biased;
                    r = &mut call => r,
                    _ = tokio::time::sleep(left) => {
                        // The call is dropped at the end of this block, after the flag is set:
                        // its record says the budget cut it.
                        child.budget_cut.store(true, Ordering::SeqCst);
                        Err(Denial::ChildWallDuringCall.refusal())
                    }
                };
                let failed = match &r {
                    Ok(v) => v.get("is_error").and_then(Value::as_bool) == Some(true),
                    Err(_) => true,
                };
                if failed {
                    child.consecutive_errors.fetch_add(1, Ordering::SeqCst);
                } else {
                    child.consecutive_errors.store(0, Ordering::SeqCst);
                }
                r
            }
        },
        AgentRequest::ListResources(a) => list_reads(broker, s, &a.server, false).await,
        AgentRequest::ListPrompts(a) => list_reads(broker, s, &a.server, true).await,
        AgentRequest::ReadResource(r) => {
            server_read(broker, s, &r.server, Read::Resource(r.uri)).await
        }
        AgentRequest::GetPrompt(g) => {
            let arguments = g
                .arguments
                .into_iter()
                .map(|(k, v)| (k, Value::String(v)))
                .collect();
            server_read(broker, s, &g.server, Read::Prompt(g.name, arguments)).await
        }
        AgentRequest::ListSkills => Ok(skills_index(&broker.catalog)),
        AgentRequest::UseSkill(u) => use_skill(broker, s, &u.name),
        AgentRequest::ResolveAgent(r) => {
            let answer = match resolve(&broker.catalog, &r.agent_type, r.model.as_deref()) {
                Ok(def) => json!({"agent": crate::catalog::agent_json(def, None), "reason": null}),
                Err(why) => json!({"agent": null, "reason": why}),
            };
            broker.audit(Event {
                session: Some(s.id.clone()),
                peer_uid: Some(s.peer.uid),
                peer_pid: s.peer.pid,
                ..Event::new(
                    Kind::ResolveAgent,
                    if answer["agent"].is_null() {
                        Decision::Refused
                    } else {
                        Decision::Allowed
                    },
                    Outcome::Ok,
                )
            });
            Ok(answer)
        }
        AgentRequest::SubmitPrompt(p) => {
            if p.prompt.len() > proto::MAX_PROMPT {
                return Err(Denial::PromptTooLong.refusal());
            }
            if s.child.is_none() {
                let reports = broker
                    .hooks
                    .lifecycle(
                        HookEvent::UserPromptSubmit,
                        json!({"event": "UserPromptSubmit", "session": s.id, "prompt": p.prompt}),
                    )
                    .await;
                broker.audit_hooks(Some(&s.id), s.peer, &reports);
            }
            Ok(json!({}))
        }
        // The connection answers these itself; refused rather than trusted if one ever
        // reached this point.
        AgentRequest::Hello(_) | AgentRequest::EndSession => Err(Denial::NotAllowedHere.refusal()),
    }
}

/// A child whose wall-clock budget is spent gets nothing more.
pub(super) fn check_wall_budget(s: &Session) -> Result<(), Refusal> {
    match &s.child {
        Some(c) if c.started.elapsed() > Duration::from_secs(c.def.budget.max_wall_secs) => {
            Err(Denial::ChildWallSpent.refusal())
        }
        _ => Ok(()),
    }
}

/// Look up an agent definition for a request: the request-side grammar first, then the exact
/// (case-sensitive) name, then the model policy. Refusals are fixed texts that never quote the
/// caller's `agentType` or model.
pub(super) fn resolve<'a>(
    catalog: &'a Catalog,
    agent_type: &str,
    model: Option<&str>,
) -> Result<&'a AgentDef, String> {
    if agentdef::check_agent_type(agent_type).is_err() {
        return Err(format!(
            "the agent type must be 1-{} bytes of ASCII letters, digits, '.', '_' or '-'",
            agentdef::MAX_NAME
        ));
    }
    if let Some(m) = model {
        agentdef::check_model_override(m).map_err(str::to_owned)?;
    }
    let Some(entry) = catalog.agent(agent_type) else {
        return Err("no agent definition with that name (names are case-sensitive)".into());
    };
    if matches!(entry.def.model, agentdef::ModelPolicy::Route(_))
        || model.is_some_and(|m| m != "inherit")
    {
        return Err("only the parent's model (inherit) can be used: this broker has no resolved provider, capability and pricing evidence for another route".into());
    }
    Ok(&entry.def)
}

pub(super) fn skills_index(catalog: &Catalog) -> Value {
    json!({
        "skills": catalog.skills.iter().map(|s| json!({
            "name": s.name,
            "tier": s.tier.as_str(),
            "description": s.description,
        })).collect::<Vec<_>>()
    })
}

pub(super) fn use_skill(broker: &Broker, s: &Session, name: &str) -> Result<Value, Refusal> {
    let outcome = broker.catalog.skill_body(name);
    broker.audit(Event {
        session: Some(s.id.clone()),
        peer_uid: Some(s.peer.uid),
        peer_pid: s.peer.pid,
        detail: outcome
            .as_ref()
            .ok()
            .map(|(e, _)| format!("skill {} ({} tier)", e.name, e.tier.as_str())),
        ..Event::new(
            Kind::UseSkill,
            if outcome.is_ok() {
                Decision::Allowed
            } else {
                Decision::Refused
            },
            match &outcome {
                Ok(_) => Outcome::Ok,
                Err(crate::catalog::UseSkillError::Unknown) => {
                    Outcome::Because(Reason::UnknownSkill)
                }
                Err(crate::catalog::UseSkillError::Changed) => {
                    Outcome::Because(Reason::ChangedSinceDiscovery)
                }
            },
        )
    });
    match outcome {
        Ok((entry, body)) => Ok(json!({
            "name": entry.name,
            "tier": entry.tier.as_str(),
            "body": body,
        })),
        Err(crate::catalog::UseSkillError::Unknown) => Err(Denial::UnknownSkill.refusal()),
        Err(crate::catalog::UseSkillError::Changed) => Err(Denial::SkillChanged.refusal()),
    }
}
