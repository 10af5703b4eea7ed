//! The audit record of one effect request, written when the request ends however it ends
//! (including when its future is dropped).

use super::denial::Denial;
use super::{Broker, Session, elapsed_ms};
use crate::audit::{self, Decision, Event, Kind, Outcome};
use crate::hooks::{ToolEvent, Verdict};
use crate::ipc::proto::Refusal;
use crate::rules::RuleMark;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Writes the call's audit record when the call ends however it ends — including when the
/// agent disconnects and the call's future is dropped mid-way.
pub(super) struct CallRecord<'a> {
    pub(super) broker: &'a Broker,
    pub(super) session: &'a Session,
    pub(super) event: Event,
    pub(super) started: Instant,
    pub(super) done: bool,
    /// The approval rule that approved the call, named in each of its records.
    pub(super) rule: Option<RuleMark>,
}

impl<'a> CallRecord<'a> {
    /// Start the record of one effect request. When the audit log cannot be written the request
    /// is refused at once, the same way whatever it names (and that refusal is recorded if the
    /// log takes it).
    pub(super) fn open(
        broker: &'a Broker,
        s: &'a Session,
        kind: Kind,
        args_sha256: &str,
    ) -> Result<CallRecord<'a>, Refusal> {
        let mut record = CallRecord {
            broker,
            session: s,
            event: Event {
                session: Some(s.id.clone()),
                peer_uid: Some(s.peer.uid),
                peer_pid: s.peer.pid,
                args_sha256: Some(args_sha256.to_owned()),
                // Until the request gets further: a record written on drop before that says
                // the request was abandoned (its outcome is set when it is written).
                ..Event::new(kind, Decision::Abandoned, Outcome::CancelledByDisconnect)
            },
            started: Instant::now(),
            done: false,
            rule: None,
        };
        if let Err(gate) = broker.audit.effect_gate() {
            return Err(record.deny(Denial::AuditUnwritable(gate)));
        }
        Ok(record)
    }
}

impl CallRecord<'_> {
    /// End the request refused: its record gets the denial's decision and outcome (and what a
    /// rule or its note says), and the agent the denial's refusal — both from one value, so the
    /// audit log and the answer cannot disagree.
    pub(super) fn deny(&mut self, d: Denial) -> Refusal {
        let (decision, outcome) = d.audit();
        let detail = match &d {
            Denial::DeniedByRule(mark) => Some(mark.detail()),
            Denial::NotApproved(_, note) => note.clone(),
            _ => None,
        };
        self.finish(decision, outcome, detail);
        d.refusal()
    }
}

impl CallRecord<'_> {
    pub(super) fn finish(&mut self, decision: Decision, outcome: Outcome, detail: Option<String>) {
        // A rule-approved call says so, and names the rule, in every record.
        self.event.decision = crate::rules::decision(self.rule.as_ref(), decision);
        self.event.outcome = outcome;
        self.event.detail = crate::rules::detail(self.rule.as_ref(), detail);
        self.event.duration_ms = elapsed_ms(self.started);
        self.broker.audit(self.event.clone());
        self.done = true;
    }
}

/// Proof that a call's `PreToolUse` hooks let it through (a child session runs none). Only
/// [`CallRecord::pre_tool_use`] makes one.
pub(super) struct HooksPassed(());

/// Proof that a call was approved, by an operator's rule or by the operator, after its hooks.
/// Only [`CallRecord::approved`] makes one, and only from a [`HooksPassed`].
pub(super) struct Approved(());

/// Proof that a call's `dispatching` record is in the audit log: what an effect consumes
/// (`effect::under_cancel` is the only place an effect's future is run, and it takes one by
/// value). Only [`CallRecord::dispatching`] makes one, and only from an [`Approved`]; it is
/// neither `Clone` nor `Copy`, so one approval sends one effect.
pub(super) struct Dispatched {
    epoch: u64,
}

impl Dispatched {
    /// The server's cancel epoch the effect was approved under.
    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }
}

impl CallRecord<'_> {
    /// Run the operator's `PreToolUse` hooks for this call (not for a child session) and audit
    /// them; a block ends the call refused.
    pub(super) async fn pre_tool_use(&mut self, event: &ToolEvent) -> Result<HooksPassed, Refusal> {
        if self.session.child.is_none() {
            let (verdict, reports) = self.broker.hooks.pre_tool_use(event).await;
            self.broker
                .audit_hooks(Some(&self.session.id), self.session.peer, &reports);
            if let Verdict::Block(reason) = verdict {
                // Escaped once (by the hook runner), and capped so the certainty always fits.
                return Err(self.deny(Denial::BlockedByHook(reason)));
            }
        }
        self.event.decision = Decision::AwaitingApproval;
        Ok(HooksPassed(()))
    }

    /// The call is approved: by `rule` (named in each of its records from now on), or by the
    /// operator.
    pub(super) fn approved(&mut self, _hooks: HooksPassed, rule: Option<RuleMark>) -> Approved {
        if let Some(mark) = rule {
            self.event.detail = Some(mark.detail());
            self.rule = Some(mark);
        }
        self.event.decision = Decision::Approved;
        Approved(())
    }

    /// Write the "dispatching" record of an approved call, or say why the effect may not start
    /// (the log failed, or its disk is under the reserve).
    pub(super) fn dispatching(
        &mut self,
        _approved: Approved,
        epoch: u64,
    ) -> Result<Dispatched, audit::Gate> {
        let mut e = self.event.clone();
        e.decision = crate::rules::decision(self.rule.as_ref(), Decision::Approved);
        e.outcome = Outcome::Dispatching;
        e.duration_ms = elapsed_ms(self.started);
        self.broker.audit.append_effect(&e)?;
        Ok(Dispatched { epoch })
    }
}

impl Drop for CallRecord<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.event.duration_ms = elapsed_ms(self.started);
            // Only a tool call is cut by the budget (a child's calls are serialized, and once
            // the budget is spent no other starts).
            let budget_cut = self.event.kind == Kind::CallTool
                && self
                    .session
                    .child
                    .as_ref()
                    .is_some_and(|c| c.budget_cut.load(Ordering::SeqCst));
            self.event.outcome = if budget_cut {
                Outcome::CancelledByBudget
            } else if *self.broker.shutdown.borrow() {
                Outcome::CancelledByShutdown
            } else {
                Outcome::CancelledByDisconnect
            };
            self.broker.audit(self.event.clone());
        }
    }
}
