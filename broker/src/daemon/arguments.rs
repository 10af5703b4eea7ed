//! A call's arguments while it is in flight: canonical bytes and digest only (the tree is
//! dropped), weighed against the per-uid and broker-wide argument budget.

use super::denial::Denial;
use super::{Broker, Session};
use crate::audit::{self, Event};
use crate::audit::{Decision, Kind, Outcome};
use crate::ipc::proto::Reason;
use crate::ipc::proto::Refusal;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Weight charged for each JSON node of a call's arguments while the call is in flight (about
/// what one parsed node costs), on top of the bytes of their canonical JSON.
pub const ARGUMENT_NODE_WEIGHT: usize = 64;
/// Most argument weight one agent uid may have in calls in flight (waiting for a server, for
/// approval, or running).
pub const MAX_ARGUMENT_WEIGHT_PER_UID: usize = 32 * 1024 * 1024;
/// Most argument weight in flight across the broker.
pub const MAX_ARGUMENT_WEIGHT: usize = 96 * 1024 * 1024;

/// The number of JSON nodes of a value (every value, container or scalar, counts one).
pub fn json_nodes(v: &Value) -> usize {
    let mut n = 0usize;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        n += 1;
        match v {
            Value::Array(a) => stack.extend(a.iter()),
            Value::Object(m) => stack.extend(m.values()),
            _ => {}
        }
    }
    n
}

/// The argument weight of calls in flight, per agent uid and in total.
#[derive(Default)]
pub(super) struct ArgumentBudget(Mutex<(HashMap<u32, usize>, usize)>);

/// One call's share of the [`ArgumentBudget`], given back when the call ends however it ends.
pub(super) struct ArgumentCharge<'a> {
    pub(super) budget: &'a ArgumentBudget,
    pub(super) uid: u32,
    pub(super) weight: usize,
}

impl ArgumentBudget {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<u32, usize>, usize)> {
        match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Charge `weight` to `uid`, unless that would pass the uid's or the broker's bound.
    pub(super) fn charge(&self, uid: u32, weight: usize) -> Option<ArgumentCharge<'_>> {
        let charged = charge_step(
            &mut self.lock(),
            uid,
            weight,
            MAX_ARGUMENT_WEIGHT_PER_UID,
            MAX_ARGUMENT_WEIGHT,
        );
        // The charge is built only once it was made (and the lock is released): dropping one
        // gives its weight back.
        if charged {
            Some(ArgumentCharge {
                budget: self,
                uid,
                weight,
            })
        } else {
            None
        }
    }
}

/// Add `weight` for `uid` if both bounds hold afterwards.
pub(super) fn charge_step(
    w: &mut (HashMap<u32, usize>, usize),
    uid: u32,
    weight: usize,
    per_uid: usize,
    total: usize,
) -> bool {
    let mine = w.0.get(&uid).copied().unwrap_or(0);
    if mine.saturating_add(weight) > per_uid || w.1.saturating_add(weight) > total {
        return false;
    }
    w.0.insert(uid, mine + weight);
    w.1 += weight;
    true
}

impl Drop for ArgumentCharge<'_> {
    fn drop(&mut self) {
        let mut w = self.budget.lock();
        if let Some(mine) = w.0.get_mut(&self.uid) {
            *mine = mine.saturating_sub(self.weight);
            if *mine == 0 {
                w.0.remove(&self.uid);
            }
        }
        w.1 = w.1.saturating_sub(self.weight);
    }
}

/// The canonical bytes of a request's arguments, its digest, and its share of the argument
/// budget. The parsed tree is dropped here: from now on the call keeps only bytes (a waiting
/// call costs its bytes, not a tree many times their size).
pub(super) fn take_arguments<'a>(
    broker: &'a Broker,
    s: &Session,
    arguments: Value,
) -> Result<(Arc<str>, String, ArgumentCharge<'a>), Refusal> {
    let nodes = json_nodes(&arguments);
    let canonical = audit::canonical_json(&arguments);
    drop(arguments);
    let args_sha256 = audit::sha256_hex(&canonical);
    let weight = canonical
        .len()
        .saturating_add(nodes.saturating_mul(ARGUMENT_NODE_WEIGHT));
    let Some(charge) = broker.arguments.charge(s.peer.uid, weight) else {
        broker.audit(Event {
            session: Some(s.id.clone()),
            peer_uid: Some(s.peer.uid),
            peer_pid: s.peer.pid,
            args_sha256: Some(args_sha256),
            ..Event::new(
                Kind::CallTool,
                Decision::Refused,
                Outcome::Because(Reason::ArgumentsBudgetFull),
            )
        });
        return Err(Denial::ArgumentsBudgetFull.refusal());
    };
    // canonical_json writes serde_json's output, which is UTF-8.
    let text: Arc<str> = String::from_utf8(canonical)
        .map_err(|_| Denial::ArgumentsNotUtf8.refusal())?
        .into();
    Ok((text, args_sha256, charge))
}
