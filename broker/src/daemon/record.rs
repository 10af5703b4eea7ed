//! The audit record of one effect request, written when the request ends however it ends
//! (including when its future is dropped).

use super::denial::Denial;
use super::{Broker, Session, elapsed_ms};
use crate::audit::{self, Event};
use crate::ipc::proto::Refusal;
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
    pub(super) rule: Option<crate::rules::RuleMark>,
}

impl<'a> CallRecord<'a> {
    /// Start the record of one effect request. When the audit log cannot be written the request
    /// is refused at once, the same way whatever it names (and that refusal is recorded if the
    /// log takes it).
    pub(super) fn open(
        broker: &'a Broker,
        s: &'a Session,
        kind: &'static str,
        args_sha256: &str,
    ) -> Result<CallRecord<'a>, Refusal> {
        let mut record = CallRecord {
            broker,
            session: s,
            event: Event {
                session: Some(s.id.clone()),
                peer_uid: Some(s.peer.uid),
                peer_pid: s.peer.pid,
                kind,
                args_sha256: Some(args_sha256.to_owned()),
                ..Event::default()
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
    pub(super) fn finish(
        &mut self,
        decision: &'static str,
        outcome: &'static str,
        detail: Option<String>,
    ) {
        // A rule-approved call says so, and names the rule, in every record.
        self.event.decision = crate::rules::decision(self.rule.as_ref(), decision);
        self.event.outcome = outcome;
        self.event.detail = crate::rules::detail(self.rule.as_ref(), detail);
        self.event.duration_ms = elapsed_ms(self.started);
        self.broker.audit(self.event.clone());
        self.done = true;
    }
}

impl CallRecord<'_> {
    /// Write the "dispatching" record of an approved call, or say why the effect may not start
    /// (the log failed, or its disk is under the reserve).
    pub(super) fn dispatching(&mut self) -> Result<(), audit::Gate> {
        let mut e = self.event.clone();
        e.decision = crate::rules::decision(self.rule.as_ref(), "approved");
        e.outcome = "dispatching";
        e.duration_ms = elapsed_ms(self.started);
        self.broker.audit.append_effect(&e)
    }
}

impl Drop for CallRecord<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.event.duration_ms = elapsed_ms(self.started);
            if self.event.decision.is_empty() {
                self.event.decision = "abandoned";
            }
            // Only a tool call is cut by the budget (a child's calls are serialized, and once
            // the budget is spent no other starts).
            let budget_cut = self.event.kind == "call_tool"
                && self
                    .session
                    .child
                    .as_ref()
                    .is_some_and(|c| c.budget_cut.load(Ordering::SeqCst));
            self.event.outcome = if budget_cut {
                "cancelled_by_budget"
            } else if *self.broker.shutdown.borrow() {
                "cancelled_by_shutdown"
            } else {
                "cancelled_by_disconnect"
            };
            self.broker.audit(self.event.clone());
        }
    }
}
