//! Approval rules at run time: the broker side of [`iteron_policy::rules`].
//!
//! The decision is the policy crate's pure [`rules::decide`]; this module gives it what only
//! the broker knows (the time, the agent's uid, the session's agent-definition identity, the
//! counts of calls each rule approved in this run and in this session), reserves a count when a
//! rule approves, and turns the ruling into what the daemon records and answers:
//!
//! - approved by a rule: the call skips the operator round trip, and every record of it says
//!   `approved_by_rule` with the rule's id and digest (its `dispatching` record is still written
//!   before the effect, and the `PreToolUse` hooks have already run: a hook block wins);
//! - refused by a deny rule: `denied_by_rule`, the rule named, `not_sent`;
//! - not decided: the call goes to the operator as without rules, parked for a bounded time by
//!   a noninteractive broker with deferred approval, or refused; when allow rules covered it,
//!   the closest one and why it did not approve are recorded and told to the agent (names and
//!   bounds from the rule, never a value from the call).
//!
//! The rules are those of the session's configuration snapshot, which the broker reads only from
//! the operator's `config.json` in its home: never from a repository, the agent or a server.
//! Counts live here, per broker run ([`RunCounts`]) and per session ([`SessionCounts`]); a count
//! is taken when a rule approves a call (a call refused after that, say because its server
//! restarted, still used it), and is keyed by the rule's id, so editing a rule keeps its count.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use serde_json::{Map, Value, json};

use iteron_policy::config::Config;

use crate::audit::Decision;
use iteron_policy::rules::{self, ApprovalsConfig, CallFacts, Outlook, Ruling, Used};

/// Most rule ids a count table holds before the ids no longer in the configuration are dropped
/// from it (the table then holds at most [`rules::MAX_RULES`]).
pub const MAX_COUNTED_RULES: usize = 2 * rules::MAX_RULES;

/// The calls each rule approved in this broker run.
#[derive(Debug, Default)]
pub struct RunCounts(Mutex<HashMap<String, u64>>);

/// The calls each rule approved in one session.
#[derive(Debug, Default)]
pub struct SessionCounts(Mutex<HashMap<String, u64>>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The rule that decided a call, as its records name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleMark {
    /// The rule's id.
    pub id: String,
    /// The rule's digest ([`rules::Rule::digest`]).
    pub digest: String,
}

impl RuleMark {
    fn of(rule: &rules::Rule) -> RuleMark {
        RuleMark {
            id: rule.id.as_str().to_owned(),
            digest: rule.digest(),
        }
    }

    /// `rule <id> (digest <hex>)`: how a record's detail names the rule (first, so a detail cut
    /// at its bound still names it).
    pub fn detail(&self) -> String {
        format!("rule {} (digest {})", self.id, self.digest)
    }
}

/// The audit decision of a call's record: `approved` becomes `approved_by_rule` when a rule
/// approved the call.
pub fn decision(rule: Option<&RuleMark>, decision: Decision) -> Decision {
    match (rule, decision) {
        (Some(_), Decision::Approved) => Decision::ApprovedByRule,
        _ => decision,
    }
}

/// The detail of a call's record: the rule that approved it, then what else there is to say.
pub fn detail(rule: Option<&RuleMark>, detail: Option<String>) -> Option<String> {
    match (rule, detail) {
        (Some(r), Some(d)) => Some(format!("{}; {d}", r.detail())),
        (Some(r), None) => Some(r.detail()),
        (None, d) => d,
    }
}

/// What the broker knows of a call when it asks the rules.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    /// The configured server.
    pub server: &'a str,
    /// The exposed tool, or `resources/read` / `prompts/get`.
    pub tool: &'a str,
    /// The canonical JSON of the arguments (an object).
    pub arguments: &'a str,
    /// Its SHA-256.
    pub args_sha256: &'a str,
    /// The agent's uid.
    pub uid: u32,
    /// The session's agent-definition identity (a child session).
    pub identity: Option<&'a str>,
}

/// What the rules decided before the operator is asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judged {
    /// An allow rule approved the call: no operator is asked.
    Approved(RuleMark),
    /// A deny rule refused it: no operator is asked.
    Denied(RuleMark),
    /// No rule decided: ask the operator (or park, or refuse). `note` says which allow rule came
    /// closest and why it did not approve; `park` is the deferred-approval time.
    Ask {
        /// The closest allow rule and why it did not approve (for the record and the agent).
        note: Option<String>,
        /// How long a noninteractive broker parks the call (deferred approval), if it does.
        park: Option<Duration>,
    },
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn used(run: &HashMap<String, u64>, session: &HashMap<String, u64>, id: &str) -> Used {
    Used {
        run: run.get(id).copied().unwrap_or(0),
        session: session.get(id).copied().unwrap_or(0),
    }
}

/// Add one to `id`'s count, keeping the table bounded by [`MAX_COUNTED_RULES`].
fn bump(table: &mut HashMap<String, u64>, id: &str, config: &ApprovalsConfig) {
    if !table.contains_key(id) && table.len() >= MAX_COUNTED_RULES {
        table.retain(|k, _| config.rules.iter().any(|r| r.id.as_str() == k));
    }
    *table.entry(id.to_owned()).or_insert(0) += 1;
}

/// Ask the rules about one call, and take the counts of the rule that approves it (the check
/// and the count are one step: two calls racing for a rule's last count cannot both have it).
pub fn judge(
    run: &RunCounts,
    session: &SessionCounts,
    config: &ApprovalsConfig,
    facts: &Facts<'_>,
) -> Judged {
    let park = config.deferred_secs.map(Duration::from_secs);
    if !config
        .rules
        .iter()
        .any(|r| r.covers(facts.server, facts.tool))
    {
        return Judged::Ask { note: None, park };
    }
    // The arguments are decoded only when a rule looks at them; text the broker itself
    // canonicalized always decodes, and an object that did not would match no argument rule.
    let arguments: Map<String, Value> =
        if rules::needs_arguments(&config.rules, facts.server, facts.tool) {
            match serde_json::from_str(facts.arguments) {
                Ok(Value::Object(m)) => m,
                _ => Map::new(),
            }
        } else {
            Map::new()
        };
    let call = CallFacts {
        server: facts.server,
        tool: facts.tool,
        arguments: &arguments,
        args_sha256: facts.args_sha256,
        uid: facts.uid,
        identity: facts.identity,
        now: now(),
    };
    let mut run_counts = lock(&run.0);
    let mut session_counts = lock(&session.0);
    match rules::decide(&config.rules, &call, |r| {
        used(&run_counts, &session_counts, r.id.as_str())
    }) {
        Ruling::Approve(rule) => {
            if rule.max_calls_per_run.is_some() {
                bump(&mut run_counts, rule.id.as_str(), config);
            }
            if rule.max_calls_per_session.is_some() {
                bump(&mut session_counts, rule.id.as_str(), config);
            }
            Judged::Approved(RuleMark::of(rule))
        }
        Ruling::Deny(rule) => Judged::Denied(RuleMark::of(rule)),
        Ruling::Unmatched { rule, why, others } => {
            let more = match others {
                0 => String::new(),
                1 => "; 1 more rule did not either".to_owned(),
                n => format!("; {n} more rules did not either"),
            };
            Judged::Ask {
                note: Some(format!(
                    "{} did not approve: {why}{more}",
                    RuleMark::of(rule).detail()
                )),
                park,
            }
        }
        Ruling::NoRule => Judged::Ask { note: None, park },
    }
}

/// A refusal's message with the note of the closest rule (when there is one).
pub fn with_note(message: &str, note: Option<&str>) -> String {
    match note {
        Some(n) => format!("{message} ({n})"),
        None => message.to_owned(),
    }
}

/// The `approval` marker of one tool in `list_tools`: `rule` (an allow rule can approve this
/// session's calls of it, those that meet its argument constraints), `denied_by_rule`,
/// `operator` (an operator is asked), `deferred` (a noninteractive broker parks calls for the
/// operator) or `refused_noninteractive`.
#[expect(
    clippy::too_many_arguments,
    reason = "one call site, in list_tools; a struct would only rename the same eight facts"
)]
pub fn marker(
    run: &RunCounts,
    session: &SessionCounts,
    config: &Config,
    server: &str,
    tool: &str,
    uid: u32,
    identity: Option<&str>,
    interactive: bool,
) -> &'static str {
    let approvals = &config.approvals;
    let outlook = if approvals.rules.iter().any(|r| r.covers(server, tool)) {
        let run_counts = lock(&run.0);
        let session_counts = lock(&session.0);
        rules::outlook(&approvals.rules, server, tool, uid, identity, now(), |r| {
            used(&run_counts, &session_counts, r.id.as_str())
        })
    } else {
        Outlook::NoRule
    };
    match outlook {
        Outlook::Denied => "denied_by_rule",
        Outlook::Rule => "rule",
        Outlook::NoRule if interactive => "operator",
        Outlook::NoRule if approvals.deferred_secs.is_some() => "deferred",
        Outlook::NoRule => "refused_noninteractive",
    }
}

/// Per-rule counts taken from the audit log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditCounts {
    /// Per rule (id, digest): calls approved (effects started), calls refused by it (a deny
    /// rule), calls it covered but did not approve; in the whole log and in the newest run.
    pub rules: Vec<RuleCount>,
    /// Records verified and read.
    pub records: u64,
    /// Agent records counted instead of written (`audit_suppressed`): refusals among them are
    /// not in the counts.
    pub suppressed: u64,
}

/// The counts of one version of one rule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleCount {
    /// The rule's id.
    pub id: String,
    /// The rule's digest.
    pub digest: String,
    /// Calls it approved (their `dispatching` records).
    pub approved: u64,
    /// Calls it refused (a deny rule).
    pub denied: u64,
    /// Calls it covered and did not approve (the closest rule of a refusal or an operator's
    /// question).
    pub unmatched: u64,
    /// Of `approved`, those in the newest broker run.
    pub approved_this_run: u64,
}

/// The rule a record's detail names: `rule <id> (digest <hex>)…`.
fn named_rule(detail: &str) -> Option<(&str, &str)> {
    let rest = detail.strip_prefix("rule ")?;
    let (id, rest) = rest.split_once(' ')?;
    let rest = rest.strip_prefix("(digest ")?;
    let digest = rest.get(..rules::RULE_DIGEST_HEX)?;
    if rest.as_bytes().get(rules::RULE_DIGEST_HEX) != Some(&b')')
        || iteron_policy::names::RuleId::parse(id).is_err()
        || !digest.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return None;
    }
    Some((id, digest))
}

/// Count, per rule, what the audit log under `home` records (after verifying it whole: a log
/// that fails verification gives no counts).
pub fn audit_counts(home: &Path) -> Result<AuditCounts, crate::audit::Tampered> {
    let mut by_rule: Vec<RuleCount> = Vec::new();
    let mut suppressed = 0u64;
    let verified = crate::audit::visit(home, |r| {
        let s = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("");
        match s("kind") {
            "broker_start" => by_rule.iter_mut().for_each(|c| c.approved_this_run = 0),
            crate::audit::SUPPRESSED_KIND => suppressed += 1,
            _ => {}
        }
        let Some((id, digest)) = named_rule(s("detail")) else {
            return;
        };
        let at = match by_rule
            .iter()
            .position(|c| c.id == id && c.digest == digest)
        {
            Some(i) => i,
            None => {
                by_rule.push(RuleCount {
                    id: id.to_owned(),
                    digest: digest.to_owned(),
                    ..RuleCount::default()
                });
                by_rule.len() - 1
            }
        };
        let c = &mut by_rule[at];
        match (s("decision"), s("outcome")) {
            ("approved_by_rule", "dispatching") => {
                c.approved += 1;
                c.approved_this_run += 1;
            }
            ("denied_by_rule", _) => c.denied += 1,
            _ if s("detail").contains(") did not approve: ") => c.unmatched += 1,
            _ => {}
        }
    })?;
    Ok(AuditCounts {
        rules: by_rule,
        records: verified.records,
        suppressed,
    })
}

impl AuditCounts {
    /// The machine-readable form.
    pub fn to_json(&self) -> Value {
        json!({
            "records": self.records,
            "suppressed_records": self.suppressed,
            "rules": self.rules.iter().map(RuleCount::to_json).collect::<Vec<_>>(),
        })
    }
}

impl RuleCount {
    /// The machine-readable form (one row of [`AuditCounts::to_json`]).
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "digest": self.digest,
            "approved": self.approved,
            "approved_this_run": self.approved_this_run,
            "denied": self.denied,
            "unmatched": self.unmatched,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iteron_policy::config::Config;

    fn config(rules: &str) -> Config {
        Config::parse(
            format!(
                r#"{{"schema_version": 2, "mcp_servers": [{{"name": "ev", "command": "/x"}}],
                "approvals": {{"rules": [{rules}]}}}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn facts<'a>(arguments: &'a str, uid: u32) -> Facts<'a> {
        Facts {
            server: "ev",
            tool: "echo",
            arguments,
            args_sha256: "00",
            uid,
            identity: None,
        }
    }

    #[test]
    fn counts_are_taken_once_per_approval_and_held_per_run_and_per_session() {
        let c = config(
            r#"{"id": "twice", "effect": "allow", "server": "ev", "tool": "echo",
                "arguments": {"text": {"prefix": "ci-"}},
                "max_calls_per_run": 3, "max_calls_per_session": 2}"#,
        );
        let run = RunCounts::default();
        let (s1, s2) = (SessionCounts::default(), SessionCounts::default());
        let ok = r#"{"text":"ci-1"}"#;
        let approved = |s: &SessionCounts| {
            matches!(
                judge(&run, s, &c.approvals, &facts(ok, 1000)),
                Judged::Approved(_)
            )
        };
        // An argument outside the rule takes no count.
        let outside = judge(&run, &s1, &c.approvals, &facts(r#"{"text":"x"}"#, 1000));
        let Judged::Ask {
            note: Some(note),
            park: None,
        } = outside
        else {
            panic!("{outside:?}")
        };
        assert!(
            note.starts_with("rule twice (digest ")
                && note
                    .ends_with(") did not approve: argument \"text\" is outside the rule's prefix"),
            "{note}"
        );
        assert!(approved(&s1));
        assert!(approved(&s1));
        // The session's two are spent; another session still has the run's third.
        let spent = judge(&run, &s1, &c.approvals, &facts(ok, 1000));
        assert!(
            matches!(&spent, Judged::Ask { note: Some(n), .. } if n.ends_with("its 2 calls per session are spent")),
            "{spent:?}"
        );
        assert!(approved(&s2));
        let spent = judge(&run, &s2, &c.approvals, &facts(ok, 1000));
        assert!(
            matches!(&spent, Judged::Ask { note: Some(n), .. } if n.ends_with("its 3 calls per broker run are spent")),
            "{spent:?}"
        );
        let fresh = SessionCounts::default();
        assert!(!approved(&fresh));
    }

    #[test]
    fn racing_calls_never_take_more_than_a_rules_count() {
        let c = config(
            r#"{"id": "five", "effect": "allow", "server": "ev", "tool": "echo",
                "max_calls_per_run": 5}"#,
        );
        let run = RunCounts::default();
        let approved = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    let s = SessionCounts::default();
                    for _ in 0..20 {
                        if matches!(
                            judge(&run, &s, &c.approvals, &facts("{}", 1)),
                            Judged::Approved(_)
                        ) {
                            approved.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        assert_eq!(approved.into_inner(), 5);
        iteron_test_support::record!("P15", json!({"threads": 8, "calls": 160, "approved": 5}),);
    }

    #[test]
    fn the_count_table_stays_bounded_one_over() {
        let c = config(r#"{"id": "kept", "effect": "allow", "server": "ev", "tool": "echo"}"#);
        let mut table = HashMap::new();
        for i in 0..MAX_COUNTED_RULES {
            bump(&mut table, &format!("old{i}"), &c.approvals);
        }
        assert_eq!(table.len(), MAX_COUNTED_RULES);
        bump(&mut table, "kept", &c.approvals);
        bump(&mut table, "kept", &c.approvals);
        assert_eq!(table.len(), 1);
        assert_eq!(table["kept"], 2);
        iteron_test_support::record!("P5", json!({"max_counted_rules": MAX_COUNTED_RULES}),);
    }

    #[test]
    fn records_name_the_rule_and_markers_say_what_to_expect() {
        let mark = RuleMark {
            id: "ci".into(),
            digest: "0123456789abcdef0123456789abcdef".into(),
        };
        assert_eq!(
            decision(Some(&mark), Decision::Approved),
            Decision::ApprovedByRule
        );
        assert_eq!(decision(Some(&mark), Decision::Refused), Decision::Refused);
        assert_eq!(decision(None, Decision::Approved), Decision::Approved);
        assert_eq!(
            detail(Some(&mark), Some("certainty maybe_applied".into())).unwrap(),
            "rule ci (digest 0123456789abcdef0123456789abcdef); certainty maybe_applied"
        );
        assert_eq!(
            named_rule(&detail(Some(&mark), Some("x".into())).unwrap()),
            Some(("ci", "0123456789abcdef0123456789abcdef"))
        );
        assert_eq!(named_rule("rule ci (digest 0123)"), None);
        assert_eq!(named_rule("skill x (user tier)"), None);

        let c = config(
            r#"{"id": "a", "effect": "allow", "server": "ev", "tool": "echo", "agent_uids": [65534]},
               {"id": "d", "effect": "deny", "server": "ev", "tool": "wipe"}"#,
        );
        let (run, s) = (RunCounts::default(), SessionCounts::default());
        let m = |tool: &str, uid: u32, interactive: bool| {
            marker(&run, &s, &c, "ev", tool, uid, None, interactive)
        };
        assert_eq!(m("echo", 65534, false), "rule");
        assert_eq!(m("echo", 1000, false), "refused_noninteractive");
        assert_eq!(m("echo", 1000, true), "operator");
        assert_eq!(m("wipe", 65534, true), "denied_by_rule");
        let mut deferred = c.clone();
        deferred.approvals.deferred_secs = Some(60);
        assert_eq!(
            marker(&run, &s, &deferred, "ev", "other", 1, None, false),
            "deferred"
        );
        assert_eq!(
            judge(&run, &s, &c.approvals, &facts("{}", 1)),
            Judged::Ask {
                note: Some(format!(
                    "rule a (digest {}) did not approve: the agent's uid is not one the rule allows",
                    c.approvals.rules[0].digest()
                )),
                park: None
            }
        );
        let Judged::Denied(mark) = judge(
            &run,
            &s,
            &c.approvals,
            &Facts {
                tool: "wipe",
                ..facts("{}", 1)
            },
        ) else {
            panic!("the deny rule refuses")
        };
        // What the agent is told is decided by the daemon's Denial (daemon/denial.rs tests).
        assert_eq!(mark.id, "d");
    }
}
