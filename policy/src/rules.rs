//! Approval rules: the operator's approval of tool calls given ahead of time, in
//! `~/.iteron/config.json` (`approvals.rules`), so that a broker nobody watches (CI) can still do
//! the work the operator chose, and only that.
//!
//! A rule names one exact server and one exact tool, and may constrain the call's top-level
//! arguments (an exact value, one of several values, a string prefix, an integer range, or "any
//! value"; when a rule names arguments, an argument it does not name is outside the rule), the
//! exact SHA-256 of the canonical arguments, the agent uids, the agent-definition identity of
//! the session, how many calls it approves per broker run and per session, and when it
//! expires. [`decide`] is the whole decision, pure:
//!
//! - a **deny** rule whose every constraint holds refuses the call, whatever any allow rule says
//!   (deny wins);
//! - otherwise the first **allow** rule (in file order) whose every constraint holds, its counts
//!   included, approves it;
//! - otherwise no rule decides: the call goes to the operator as it would without rules (or is
//!   refused by a noninteractive broker), and [`Ruling::Unmatched`] says which rule came closest
//!   and why it did not approve.
//!
//! Rules never widen exposure: they are consulted only for a call to a tool the policy already
//! exposes, so a hidden tool stays hidden and unknown. Rules come only from the operator's own
//! configuration file, never from a repository, the agent or a server. [`check`] finds the rules
//! that can never match, so none of them fails silently.

use std::collections::BTreeMap;
use std::fmt;

use serde::ser::{SerializeMap, SerializeStruct};
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};
use sha2::{Digest as _, Sha256};

use crate::capability::{CapabilitySet, Exposure, HideReason, decide_exposure};
use crate::config::Config;
use crate::names::{RuleId, ServerName, ToolName};

mod checks;
pub use checks::*;

/// Most rules in one configuration.
pub const MAX_RULES: usize = 256;
/// Most constrained arguments in one rule.
pub const MAX_RULE_ARGUMENTS: usize = 64;
/// Longest argument name a rule may constrain, in bytes.
pub const MAX_ARGUMENT_NAME: usize = 64;
/// Most values in one `one_of`.
pub const MAX_ONE_OF: usize = 64;
/// Most uids in one rule's `agent_uids`.
pub const MAX_RULE_UIDS: usize = 64;
/// Most identities in one rule's `agent_identities`.
pub const MAX_RULE_IDENTITIES: usize = 64;
/// Bounds of `max_calls_per_run` and `max_calls_per_session`.
pub const MAX_CALLS_RANGE: (u64, u64) = (1, 1_000_000_000);
/// Bounds of `approvals.deferred_secs`: how long a noninteractive broker parks a call that no
/// rule approved.
pub const DEFERRED_SECS_RANGE: (u64, u64) = (1, 3600);
/// The largest uid a rule may name (`(uid_t)-1` is no uid).
pub const MAX_UID: u32 = u32::MAX - 1;
/// The pseudo-tool a rule names to cover a server's `read_resource` (its MCP method).
pub const READ_RESOURCE: &str = "resources/read";
/// The pseudo-tool a rule names to cover a server's `get_prompt` (its MCP method).
pub const GET_PROMPT: &str = "prompts/get";
/// Hex digits of a rule digest: the first 128 bits of the SHA-256 of the rule's canonical JSON.
pub const RULE_DIGEST_HEX: usize = 32;

/// What a rule does to the calls it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Approve them (no operator round trip).
    Allow,
    /// Refuse them (no operator is asked); wins over every allow rule.
    Deny,
}

impl Effect {
    /// The configuration word.
    pub fn as_str(self) -> &'static str {
        match self {
            Effect::Allow => "allow",
            Effect::Deny => "deny",
        }
    }

    /// Parse the configuration word.
    pub fn parse(s: &str) -> Option<Effect> {
        match s {
            "allow" => Some(Effect::Allow),
            "deny" => Some(Effect::Deny),
            _ => None,
        }
    }
}

/// The one effect a rule covers: an MCP tool, or a server's resource reads or prompt gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleTool {
    /// A tool, by its exact name.
    Tool(ToolName),
    /// `read_resource` on the server (arguments: `uri`).
    ReadResource,
    /// `get_prompt` on the server (arguments: `name`, `arguments`).
    GetPrompt,
}

impl RuleTool {
    /// Parse a tool name or one of the two pseudo-tools.
    pub fn parse(s: &str) -> Result<RuleTool, crate::names::NameError> {
        match s {
            READ_RESOURCE => Ok(RuleTool::ReadResource),
            GET_PROMPT => Ok(RuleTool::GetPrompt),
            _ => ToolName::parse(s).map(RuleTool::Tool),
        }
    }

    /// The name as configured (and as the broker names the effect).
    pub fn as_str(&self) -> &str {
        match self {
            RuleTool::Tool(t) => t.as_str(),
            RuleTool::ReadResource => READ_RESOURCE,
            RuleTool::GetPrompt => GET_PROMPT,
        }
    }
}

/// A value a constraint compares with: a string, an integer or a boolean. An integer matches
/// only a JSON integer of the same value (`5`, not `5.0` or `"5"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scalar {
    /// A string, compared exactly (no case folding, no normalization).
    String(String),
    /// An integer.
    Integer(i64),
    /// A boolean.
    Bool(bool),
}

impl Scalar {
    /// Whether a call's value is exactly this one.
    pub fn matches(&self, v: &Value) -> bool {
        match (self, v) {
            (Scalar::String(a), Value::String(b)) => a == b,
            (Scalar::Integer(a), Value::Number(n)) => integer(n) == Some(*a),
            (Scalar::Bool(a), Value::Bool(b)) => a == b,
            _ => false,
        }
    }
}

/// A JSON number as an integer, when it is one written as one (no fraction, no exponent).
fn integer(n: &serde_json::Number) -> Option<i64> {
    if n.is_f64() {
        return None;
    }
    n.as_i64()
}

impl Serialize for Scalar {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Scalar::String(v) => s.serialize_str(v),
            Scalar::Integer(v) => s.serialize_i64(*v),
            Scalar::Bool(v) => s.serialize_bool(*v),
        }
    }
}

/// What one argument must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// Present, with any value.
    Any,
    /// Exactly this value.
    Equals(Scalar),
    /// Exactly one of these values.
    OneOf(Vec<Scalar>),
    /// A string that starts with this one (a string prefix: it says nothing about what a server
    /// makes of the rest, e.g. `/work/../etc` starts with `/work/`).
    Prefix(String),
    /// An integer from `min` to `max`, both included.
    Range {
        /// Smallest allowed.
        min: i64,
        /// Largest allowed.
        max: i64,
    },
}

impl Constraint {
    /// Whether a call's value satisfies it.
    pub fn holds(&self, v: &Value) -> bool {
        match self {
            Constraint::Any => true,
            Constraint::Equals(x) => x.matches(v),
            Constraint::OneOf(xs) => xs.iter().any(|x| x.matches(v)),
            Constraint::Prefix(p) => matches!(v, Value::String(s) if s.starts_with(p.as_str())),
            Constraint::Range { min, max } => match v {
                Value::Number(n) => integer(n).is_some_and(|i| (*min..=*max).contains(&i)),
                _ => false,
            },
        }
    }

    /// The constraint's kind, as configured.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::Any => "any",
            Constraint::Equals(_) => "equals",
            Constraint::OneOf(_) => "one_of",
            Constraint::Prefix(_) => "prefix",
            Constraint::Range { .. } => "range",
        }
    }
}

impl Serialize for Constraint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(1))?;
        match self {
            Constraint::Any => m.serialize_entry("any", &true)?,
            Constraint::Equals(x) => m.serialize_entry("equals", x)?,
            Constraint::OneOf(xs) => m.serialize_entry("one_of", xs)?,
            Constraint::Prefix(p) => m.serialize_entry("prefix", p)?,
            Constraint::Range { min, max } => {
                let mut r = BTreeMap::new();
                r.insert("max", *max);
                r.insert("min", *min);
                m.serialize_entry("range", &r)?;
            }
        }
        m.end()
    }
}

/// A SHA-256 in lowercase hex (64 digits).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Sha256Hex(String);

impl Sha256Hex {
    /// Validate: exactly 64 lowercase hex digits.
    pub fn parse(s: &str) -> Option<Sha256Hex> {
        (s.len() == 64
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .then(|| Sha256Hex(s.to_owned()))
    }

    /// The digest.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An expiry time: `YYYY-MM-DDTHH:MM:SSZ` (UTC, RFC 3339 without fractions or offsets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiry {
    unix: u64,
    text: String,
}

impl Expiry {
    /// Parse the one accepted form; years 1970 to 9999.
    pub fn parse(s: &str) -> Option<Expiry> {
        let b = s.as_bytes();
        if b.len() != 20
            || b[4] != b'-'
            || b[7] != b'-'
            || b[10] != b'T'
            || b[13] != b':'
            || b[16] != b':'
            || b[19] != b'Z'
        {
            return None;
        }
        let num = |from: usize, to: usize| -> Option<u64> {
            let part = s.get(from..to)?;
            if !part.bytes().all(|c| c.is_ascii_digit()) {
                return None;
            }
            part.parse().ok()
        };
        let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
        let (hour, minute, second) = (num(11, 13)?, num(14, 16)?, num(17, 19)?);
        let days_in = crate::calendar::days_in_month(year, month)?;
        if year < 1970 || day == 0 || day > days_in || hour > 23 || minute > 59 || second > 59 {
            return None;
        }
        let days = days_from_civil(year, month, day);
        Some(Expiry {
            unix: days * 86_400 + hour * 3600 + minute * 60 + second,
            text: s.to_owned(),
        })
    }

    /// Seconds since the Unix epoch.
    pub fn unix(&self) -> u64 {
        self.unix
    }

    /// The time as configured.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether the rule has expired at `now` (Unix seconds): from the named second on.
    pub fn passed(&self, now: u64) -> bool {
        now >= self.unix
    }
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar (year ≥ 1970).
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    // Howard Hinnant's algorithm, with March as the first month so the leap day comes last.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// One approval rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Its id (unique in the configuration; named in audit records and refusals).
    pub id: RuleId,
    /// Allow or deny.
    pub effect: Effect,
    /// The exact server.
    pub server: ServerName,
    /// The exact tool (or pseudo-tool).
    pub tool: RuleTool,
    /// Per-argument constraints; `None`: any arguments. When present, every named argument must
    /// be there and satisfy its constraint, and no other argument may be there.
    pub arguments: Option<BTreeMap<String, Constraint>>,
    /// The exact SHA-256 of the call's canonical arguments (as audited).
    pub args_sha256: Option<Sha256Hex>,
    /// The agent uids allowed; empty: any uid the broker admits.
    pub agent_uids: Vec<u32>,
    /// The agent-definition identities allowed; empty: any session, with or without one.
    pub agent_identities: Vec<Sha256Hex>,
    /// Most calls it approves in one broker run (allow rules only).
    pub max_calls_per_run: Option<u64>,
    /// Most calls it approves in one session (allow rules only).
    pub max_calls_per_session: Option<u64>,
    /// From this time on the rule decides nothing.
    pub expires: Option<Expiry>,
}

/// Keys of a rule, in their canonical order.
pub const RULE_KEYS: &[&str] = &[
    "id",
    "effect",
    "server",
    "tool",
    "arguments",
    "args_sha256",
    "agent_uids",
    "agent_identities",
    "max_calls_per_run",
    "max_calls_per_session",
    "expires",
];

impl Serialize for Rule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Rule", RULE_KEYS.len())?;
        st.serialize_field("id", &self.id)?;
        st.serialize_field("effect", self.effect.as_str())?;
        st.serialize_field("server", &self.server)?;
        st.serialize_field("tool", self.tool.as_str())?;
        if let Some(a) = &self.arguments {
            st.serialize_field("arguments", a)?;
        }
        if let Some(d) = &self.args_sha256 {
            st.serialize_field("args_sha256", d)?;
        }
        if !self.agent_uids.is_empty() {
            st.serialize_field("agent_uids", &self.agent_uids)?;
        }
        if !self.agent_identities.is_empty() {
            st.serialize_field("agent_identities", &self.agent_identities)?;
        }
        if let Some(n) = self.max_calls_per_run {
            st.serialize_field("max_calls_per_run", &n)?;
        }
        if let Some(n) = self.max_calls_per_session {
            st.serialize_field("max_calls_per_session", &n)?;
        }
        if let Some(e) = &self.expires {
            st.serialize_field("expires", e.as_str())?;
        }
        st.end()
    }
}

impl Rule {
    /// The rule's canonical JSON: compact, keys in [`RULE_KEYS`] order, argument names sorted.
    pub fn canonical_json(&self) -> String {
        // Serializing this type cannot fail: every key is a string and no value is a float.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The rule's digest: the first 128 bits of the SHA-256 of [`Rule::canonical_json`], as
    /// 32 lowercase hex digits. Audit records name it beside the id, so a record says which
    /// version of a rule decided.
    pub fn digest(&self) -> String {
        let d = Sha256::digest(self.canonical_json().as_bytes());
        let mut out = String::with_capacity(RULE_DIGEST_HEX);
        for b in d.iter().take(RULE_DIGEST_HEX / 2) {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        out
    }

    /// Whether it covers this server and tool (exact names).
    pub fn covers(&self, server: &str, tool: &str) -> bool {
        self.server.as_str() == server && self.tool.as_str() == tool
    }

    /// Whether it constrains the arguments at all (their values or their digest).
    pub fn constrains_arguments(&self) -> bool {
        self.arguments.is_some() || self.args_sha256.is_some()
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The `approvals` block of the configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApprovalsConfig {
    /// The rules, in file order, with unique ids.
    pub rules: Vec<Rule>,
    /// Opt-in: a noninteractive broker parks a call no rule approved for this many seconds,
    /// for an operator (or an operator-side automation on the operator socket) to approve by
    /// id and argument digest; `None` refuses such a call at once.
    pub deferred_secs: Option<u64>,
}

impl ApprovalsConfig {
    /// Whether the block says nothing.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.deferred_secs.is_none()
    }
}

impl Serialize for ApprovalsConfig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("ApprovalsConfig", 2)?;
        if let Some(d) = self.deferred_secs {
            st.serialize_field("deferred_secs", &d)?;
        }
        if !self.rules.is_empty() {
            st.serialize_field("rules", &self.rules)?;
        }
        st.end()
    }
}

/// What the broker knows of one call when the rules are asked.
#[derive(Debug, Clone, Copy)]
pub struct CallFacts<'a> {
    /// The configured server.
    pub server: &'a str,
    /// The exposed tool (or pseudo-tool).
    pub tool: &'a str,
    /// The arguments.
    pub arguments: &'a Map<String, Value>,
    /// SHA-256 of their canonical JSON.
    pub args_sha256: &'a str,
    /// The agent's uid (from the socket's peer credentials).
    pub uid: u32,
    /// The session's agent-definition identity, for a child session.
    pub identity: Option<&'a str>,
    /// Now, in Unix seconds.
    pub now: u64,
}

/// Calls a rule has approved so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Used {
    /// In this broker run.
    pub run: u64,
    /// In this session.
    pub session: u64,
}

/// Why one rule does not decide a call (the first constraint that fails, in a fixed order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Miss {
    /// It has expired.
    Expired,
    /// The agent's uid is not among its `agent_uids`.
    Uid,
    /// The session's agent-definition identity is not among its `agent_identities`.
    Identity,
    /// The arguments' digest is not its `args_sha256`.
    Digest,
    /// A named argument is absent.
    MissingArgument(String),
    /// An argument it does not name is present.
    OtherArgument(String),
    /// A named argument is outside its constraint.
    Outside {
        /// The argument.
        argument: String,
        /// The constraint's kind.
        kind: &'static str,
    },
    /// Its calls per run are spent.
    RunSpent(u64),
    /// Its calls per session are spent.
    SessionSpent(u64),
}

impl fmt::Display for Miss {
    /// Names and bounds from the operator's rule only; never a value from the call.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Miss::Expired => f.write_str("the rule has expired"),
            Miss::Uid => f.write_str("the agent's uid is not one the rule allows"),
            Miss::Identity => {
                f.write_str("the session's agent definition is not one the rule allows")
            }
            Miss::Digest => f.write_str("the arguments' digest is not the one the rule allows"),
            Miss::MissingArgument(a) => write!(f, "argument \"{a}\" is missing"),
            Miss::OtherArgument(_) => f.write_str("an argument the rule does not name is present"),
            Miss::Outside { argument, kind } => {
                write!(f, "argument \"{argument}\" is outside the rule's {kind}")
            }
            Miss::RunSpent(n) => write!(f, "its {n} calls per broker run are spent"),
            Miss::SessionSpent(n) => write!(f, "its {n} calls per session are spent"),
        }
    }
}

/// Which constraint of `rule` a call fails, if any. Counts are checked for allow rules only,
/// and last (a call outside the rule is reported as outside, not as over a count).
pub fn miss(rule: &Rule, call: &CallFacts<'_>, used: Used) -> Option<Miss> {
    if rule.expires.as_ref().is_some_and(|e| e.passed(call.now)) {
        return Some(Miss::Expired);
    }
    if !rule.agent_uids.is_empty() && !rule.agent_uids.contains(&call.uid) {
        return Some(Miss::Uid);
    }
    if !rule.agent_identities.is_empty()
        && !call
            .identity
            .is_some_and(|i| rule.agent_identities.iter().any(|x| x.as_str() == i))
    {
        return Some(Miss::Identity);
    }
    if let Some(d) = &rule.args_sha256
        && d.as_str() != call.args_sha256
    {
        return Some(Miss::Digest);
    }
    if let Some(named) = &rule.arguments {
        for (name, constraint) in named {
            match call.arguments.get(name) {
                None => return Some(Miss::MissingArgument(name.clone())),
                Some(v) if !constraint.holds(v) => {
                    return Some(Miss::Outside {
                        argument: name.clone(),
                        kind: constraint.kind(),
                    });
                }
                Some(_) => {}
            }
        }
        if let Some(other) = call.arguments.keys().find(|k| !named.contains_key(*k)) {
            return Some(Miss::OtherArgument(other.clone()));
        }
    }
    if rule.effect == Effect::Allow {
        if let Some(max) = rule.max_calls_per_run
            && used.run >= max
        {
            return Some(Miss::RunSpent(max));
        }
        if let Some(max) = rule.max_calls_per_session
            && used.session >= max
        {
            return Some(Miss::SessionSpent(max));
        }
    }
    None
}

/// What the rules decide about one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ruling<'r> {
    /// A deny rule matched: the call is refused, no operator is asked.
    Deny(&'r Rule),
    /// An allow rule matched: the call is approved, no operator is asked.
    Approve(&'r Rule),
    /// Allow rules cover the call but none matched: `rule` is the first of them, `why` says
    /// what it did not accept, `others` how many more covered it. The call goes on as if there
    /// were no rule.
    Unmatched {
        /// The first allow rule covering the call.
        rule: &'r Rule,
        /// Why it did not approve.
        why: Miss,
        /// How many more allow rules covered the call (and did not approve it either).
        others: usize,
    },
    /// No allow rule covers the call (and no deny rule matched).
    NoRule,
}

/// Decide one call: deny wins; then the first allow rule whose every constraint holds
/// (`used` gives each rule's counts).
pub fn decide<'r>(
    rules: &'r [Rule],
    call: &CallFacts<'_>,
    used: impl Fn(&Rule) -> Used,
) -> Ruling<'r> {
    let covering = || rules.iter().filter(|r| r.covers(call.server, call.tool));
    if let Some(deny) = covering()
        .filter(|r| r.effect == Effect::Deny)
        .find(|r| miss(r, call, Used::default()).is_none())
    {
        return Ruling::Deny(deny);
    }
    let mut first: Option<(&Rule, Miss)> = None;
    let mut others = 0;
    for rule in covering().filter(|r| r.effect == Effect::Allow) {
        match miss(rule, call, used(rule)) {
            None => return Ruling::Approve(rule),
            Some(why) if first.is_none() => first = Some((rule, why)),
            Some(_) => others += 1,
        }
    }
    match first {
        Some((rule, why)) => Ruling::Unmatched { rule, why, others },
        None => Ruling::NoRule,
    }
}

/// Whether any rule covering `server`/`tool` needs the call's arguments (so a caller can skip
/// decoding them when none does).
pub fn needs_arguments(rules: &[Rule], server: &str, tool: &str) -> bool {
    rules
        .iter()
        .any(|r| r.covers(server, tool) && r.arguments.is_some())
}

/// What an agent can expect of calls to one tool, before it makes any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outlook {
    /// A deny rule refuses every call of this session to it.
    Denied,
    /// An allow rule can approve calls of this session (those that meet its argument
    /// constraints).
    Rule,
    /// No rule applies.
    NoRule,
}

/// The outlook for one tool and one session: what [`decide`] would say of a call whose
/// arguments meet every argument constraint, at `now`, with these counts.
pub fn outlook(
    rules: &[Rule],
    server: &str,
    tool: &str,
    uid: u32,
    identity: Option<&str>,
    now: u64,
    used: impl Fn(&Rule) -> Used,
) -> Outlook {
    let session_fits = |r: &Rule| {
        !r.expires.as_ref().is_some_and(|e| e.passed(now))
            && (r.agent_uids.is_empty() || r.agent_uids.contains(&uid))
            && (r.agent_identities.is_empty()
                || identity.is_some_and(|i| r.agent_identities.iter().any(|x| x.as_str() == i)))
    };
    let covering = || {
        rules
            .iter()
            .filter(|r| r.covers(server, tool) && session_fits(r))
    };
    if covering().any(|r| r.effect == Effect::Deny && !r.constrains_arguments()) {
        return Outlook::Denied;
    }
    let left = |r: &Rule| {
        let u = used(r);
        r.max_calls_per_run.is_none_or(|m| u.run < m)
            && r.max_calls_per_session.is_none_or(|m| u.session < m)
    };
    if covering().any(|r| r.effect == Effect::Allow && left(r)) {
        return Outlook::Rule;
    }
    Outlook::NoRule
}

#[cfg(test)]
mod tests;
