//! `iteron approvals rules list|check|explain`, `iteron audit rules`, and the approval-rule
//! findings `iteron mcp doctor` and `iteron broker serve` report.
//!
//! Everything here reads the operator's own `$ITERON_HOME/config.json` (the only place rules
//! come from) with the operator's authority; nothing here makes a call. `explain` runs the same
//! pure decision the broker runs (`iteron_policy::rules::decide`), with the per-run counts of the
//! newest broker run in the audit log and a fresh session's (zero) per-session counts.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::SystemTime;

use iteron_broker::mcp::client::Tool;
use iteron_broker::rules::RuleCount;
use iteron_broker::store::Home;
use iteron_policy::capability::{CapabilitySet, Exposure, decide_exposure};
use iteron_policy::config::Config;
use iteron_policy::rules::{
    self, CallFacts, Constraint, Effect, Rule, RuleTool, Ruling, Scalar, Sha256Hex, Used,
};
use iteron_policy::text;
use serde_json::{Map, Value, json};

use crate::args::{ExplainArgs, Format, Rules, RulesCheckArgs};
use crate::error::CliError;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn out_line(out: &mut dyn Write, line: &str) -> Result<(), CliError> {
    writeln!(out, "{line}").map_err(CliError::Output)
}

fn home() -> Result<Home, CliError> {
    Home::from_env(|k| std::env::var_os(k)).map_err(CliError::from)
}

/// `iteron approvals rules …`
pub(crate) fn run(cmd: Rules, out: &mut dyn Write) -> Result<(), CliError> {
    let home = home()?;
    let config = home.load()?;
    match cmd {
        Rules::List(f) => list(&config, f.format, out),
        Rules::Check(a) => check(&home, &config, &a, out),
        Rules::Explain(a) => explain(&home, &config, &a, out),
    }
}

fn scalar_text(s: &Scalar) -> String {
    match s {
        Scalar::String(v) => format!("{v:?}"),
        Scalar::Integer(v) => v.to_string(),
        Scalar::Bool(v) => v.to_string(),
    }
}

/// One line of what a rule requires, in the operator's own words (escaped for the terminal).
fn summary(rule: &Rule) -> String {
    let mut parts = Vec::new();
    match &rule.arguments {
        None => parts.push("any arguments".to_owned()),
        Some(named) if named.is_empty() => parts.push("no arguments".to_owned()),
        Some(named) => {
            for (name, c) in named {
                parts.push(match c {
                    Constraint::Any => format!("{name} any value"),
                    Constraint::Equals(v) => format!("{name} = {}", scalar_text(v)),
                    Constraint::OneOf(vs) => format!(
                        "{name} one of [{}]",
                        vs.iter().map(scalar_text).collect::<Vec<_>>().join(", ")
                    ),
                    Constraint::Prefix(p) => format!("{name} starts with {p:?}"),
                    Constraint::Range { min, max } => format!("{name} in {min}..={max}"),
                });
            }
            parts.push("no other argument".to_owned());
        }
    }
    if let Some(d) = &rule.args_sha256 {
        parts.push(format!("args_sha256 {}", d.as_str()));
    }
    if !rule.agent_uids.is_empty() {
        let uids: Vec<String> = rule.agent_uids.iter().map(u32::to_string).collect();
        parts.push(format!("uid {}", uids.join(",")));
    }
    if !rule.agent_identities.is_empty() {
        parts.push(format!(
            "{} agent identit{}",
            rule.agent_identities.len(),
            if rule.agent_identities.len() == 1 {
                "y"
            } else {
                "ies"
            }
        ));
    }
    if let Some(n) = rule.max_calls_per_run {
        parts.push(format!("at most {n} per run"));
    }
    if let Some(n) = rule.max_calls_per_session {
        parts.push(format!("at most {n} per session"));
    }
    if let Some(e) = &rule.expires {
        parts.push(format!("until {}", e.as_str()));
    }
    text::escape_capped(&parts.join("; "), 2048)
}

fn rule_head(rule: &Rule) -> String {
    format!(
        "{} ({} {}/{})",
        rule.id,
        rule.effect.as_str(),
        rule.server,
        rule.tool.as_str()
    )
}

fn list(config: &Config, format: Format, out: &mut dyn Write) -> Result<(), CliError> {
    let rules = &config.approvals.rules;
    if format == Format::Json {
        let v = json!({
            "deferred_secs": config.approvals.deferred_secs,
            "rules": rules.iter().map(|r| json!({
                "id": r.id.as_str(),
                "effect": r.effect.as_str(),
                "server": r.server.as_str(),
                "tool": r.tool.as_str(),
                "digest": r.digest(),
                "rule": serde_json::to_value(r).unwrap_or(Value::Null),
            })).collect::<Vec<_>>(),
        });
        return crate::output::json(out, &v);
    }
    if rules.is_empty() {
        out_line(
            out,
            "no approval rules (every call needs the operator's approval)",
        )?;
    }
    for r in rules {
        out_line(
            out,
            &format!("{}  digest {}  {}", rule_head(r), r.digest(), summary(r)),
        )?;
    }
    match config.approvals.deferred_secs {
        Some(s) => out_line(
            out,
            &format!(
                "deferred approval: a noninteractive broker parks a call no rule approves for {s} s"
            ),
        ),
        None => Ok(()),
    }
}

/// Each rule with its findings: from the configuration, and from the servers' catalogs when
/// `catalogs` is given (a server whose catalog could not be listed leaves its rules unchecked,
/// which is a finding too).
pub(crate) fn report(
    config: &Config,
    catalogs: Option<&BTreeMap<String, Result<Vec<Tool>, String>>>,
) -> Vec<Value> {
    let mut found: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
    for (id, f) in rules::check(config, now()) {
        if let Some(r) = config.approvals.rules.iter().find(|r| r.id == id) {
            found
                .entry(r.id.as_str())
                .or_default()
                .push(json!({"code": f.code(), "detail": f.to_string()}));
        }
    }
    let mut rows = Vec::new();
    for r in &config.approvals.rules {
        let mut findings = found.remove(r.id.as_str()).unwrap_or_default();
        // A hidden tool is not in the catalog the broker lists either: the policy finding
        // says it all.
        let checkable = config.server(r.server.as_str()).is_some()
            && !findings.iter().any(|f| f["code"] == "hidden_by_policy");
        if let (Some(catalogs), true) = (catalogs, checkable) {
            match catalogs.get(r.server.as_str()) {
                Some(Ok(tools)) => {
                    let listed = tools.iter().map(|t| (t.name.as_str(), &t.input_schema));
                    for f in rules::check_catalog(r, listed) {
                        findings.push(json!({"code": f.code(), "detail": f.to_string()}));
                    }
                }
                Some(Err(e)) => findings.push(json!({
                    "code": "not_checked",
                    "detail": format!("the server's catalog could not be listed: {}", text::single_line_capped(e, 300)),
                })),
                None => {}
            }
        }
        rows.push(json!({
            "id": r.id.as_str(),
            "effect": r.effect.as_str(),
            "server": r.server.as_str(),
            "tool": r.tool.as_str(),
            "digest": r.digest(),
            "ok": findings.is_empty(),
            "findings": findings,
        }));
    }
    rows
}

/// The catalogs of the servers the rules name (each probed once, bounded like `mcp test`).
pub(crate) fn catalogs(
    home: &Home,
    config: &Config,
) -> Result<BTreeMap<String, Result<Vec<Tool>, String>>, CliError> {
    let rt = crate::rt::multi_thread()?;
    let vars = crate::probe::Vars::load()?;
    let mut out = BTreeMap::new();
    for r in &config.approvals.rules {
        let name = r.server.as_str();
        if out.contains_key(name) {
            continue;
        }
        if let Some(server) = config.server(name) {
            let got = rt.block_on(crate::probe::probe_tools(
                home,
                config,
                server,
                &vars,
                crate::probe::PROBE_DEADLINE,
            ));
            out.insert(name.to_owned(), got.map(|(_, tools)| tools));
        }
    }
    Ok(out)
}

/// Text lines of a [`report`]: one per rule, `ok` or `FAIL` with every finding.
pub(crate) fn report_lines(rows: &[Value]) -> Vec<String> {
    rows.iter()
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap_or("");
            let head = format!(
                "{} ({} {}/{})",
                s("id"),
                s("effect"),
                s("server"),
                s("tool")
            );
            let findings: Vec<String> = r["findings"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f["detail"].as_str().map(str::to_owned))
                .collect();
            if findings.is_empty() {
                format!("ok   {head}")
            } else {
                text::single_line_capped(
                    &format!("FAIL {head}: can never match: {}", findings.join("; ")),
                    2048,
                )
            }
        })
        .collect()
}

fn check(
    home: &Home,
    config: &Config,
    a: &RulesCheckArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let catalogs = if a.connect {
        Some(catalogs(home, config)?)
    } else {
        None
    };
    let rows = report(config, catalogs.as_ref());
    let bad = rows.iter().filter(|r| r["ok"] != Value::Bool(true)).count();
    if a.format == Format::Json {
        crate::output::json(
            out,
            &json!({"ok": bad == 0, "connected": a.connect, "rules": rows}),
        )?;
    } else {
        if rows.is_empty() {
            out_line(out, "no approval rules")?;
        }
        for line in report_lines(&rows) {
            out_line(out, &line)?;
        }
        if !a.connect && !rows.is_empty() {
            out_line(
                out,
                "note: tools and argument names were not checked against the servers (use --connect)",
            )?;
        }
    }
    if bad == 0 {
        Ok(())
    } else {
        Err(CliError::Server(format!(
            "{bad} approval rule(s) can never match (see above)"
        )))
    }
}

/// The per-run counts of the newest broker run in the audit log, by rule id (`None` when the
/// log cannot be verified).
fn run_counts(home: &Home) -> Option<BTreeMap<String, u64>> {
    let counts = iteron_broker::rules::audit_counts(home.dir()).ok()?;
    let mut by_id = BTreeMap::new();
    for c in counts.rules {
        *by_id.entry(c.id).or_insert(0) += c.approved_this_run;
    }
    Some(by_id)
}

fn explain(
    home: &Home,
    config: &Config,
    a: &ExplainArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let arguments: Map<String, Value> = match serde_json::from_str(&a.json) {
        Ok(Value::Object(m)) => m,
        _ => return Err(CliError::Usage("--json must be a JSON object".into())),
    };
    let identity = match &a.agent_identity {
        None => None,
        Some(i) => Some(Sha256Hex::parse(i).ok_or_else(|| {
            CliError::Usage("--agent-identity must be 64 lowercase hex digits".into())
        })?),
    };
    let uid = a.uid.unwrap_or_else(|| nix::unistd::geteuid().as_raw());
    let canonical = iteron_broker::audit::canonical_json(&Value::Object(arguments.clone()));
    let args_sha256 = iteron_broker::audit::sha256_hex(&canonical);
    let hidden = match config.server(&a.server) {
        None => Some("no server of that name is configured".to_owned()),
        Some(server) => match RuleTool::parse(&a.tool) {
            Err(_) => Some("not a tool name".to_owned()),
            Ok(RuleTool::Tool(t)) => match decide_exposure(
                config.ceiling(),
                &server.tools,
                &server.policy,
                &t,
                CapabilitySet::MCP_TOOL,
            ) {
                Exposure::Hide(why) => Some(format!("the tool is hidden by policy ({why})")),
                Exposure::Expose(_) => None,
            },
            Ok(_) => {
                (!iteron_policy::capability::server_reads_exposed(config.ceiling(), &server.policy))
                    .then(|| {
                        "the server's resources and prompts are not offered by its policy".into()
                    })
            }
        },
    };
    let counts = run_counts(home);
    let used = |r: &Rule| Used {
        run: counts
            .as_ref()
            .and_then(|c| c.get(r.id.as_str()).copied())
            .unwrap_or(0),
        session: 0,
    };
    let facts = CallFacts {
        server: &a.server,
        tool: &a.tool,
        arguments: &arguments,
        args_sha256: &args_sha256,
        uid,
        identity: identity.as_ref().map(Sha256Hex::as_str),
        now: now(),
    };
    let covering: Vec<&Rule> = config
        .approvals
        .rules
        .iter()
        .filter(|r| r.covers(&a.server, &a.tool))
        .collect();
    let per_rule: Vec<Value> = covering
        .iter()
        .map(|r| {
            let why = rules::miss(r, &facts, used(r));
            json!({
                "id": r.id.as_str(),
                "effect": r.effect.as_str(),
                "digest": r.digest(),
                "matches": why.is_none(),
                "why": why.map(|w| w.to_string()),
                "used_this_run": used(r).run,
            })
        })
        .collect();
    let deferred = config.approvals.deferred_secs;
    let otherwise = match deferred {
        Some(s) => format!(
            "an interactive broker asks the operator; a noninteractive one parks it for {s} s for approval by id and digest"
        ),
        None => {
            "an interactive broker asks the operator; a noninteractive one refuses it (not_sent)"
                .to_owned()
        }
    };
    let (decision, rule, reason) = match &hidden {
        Some(why) => (
            "hidden",
            None,
            format!(
                "{why}: the agent is told \"unknown tool\"; rules never widen exposure, so none applies"
            ),
        ),
        None => match rules::decide(&config.approvals.rules, &facts, used) {
            Ruling::Approve(r) => (
                "approved_by_rule",
                Some(r),
                format!(
                    "rule {} approves it: every one of its constraints holds",
                    r.id
                ),
            ),
            Ruling::Deny(r) => (
                "denied_by_rule",
                Some(r),
                format!(
                    "deny rule {} refuses it (deny rules win over allow rules)",
                    r.id
                ),
            ),
            Ruling::Unmatched { rule, why, .. } => (
                "no_rule",
                None,
                format!(
                    "no rule approves it (the first allow rule, {}: {why}); {otherwise}",
                    rule.id
                ),
            ),
            Ruling::NoRule => (
                "no_rule",
                None,
                format!("no rule covers {}/{}; {otherwise}", a.server, a.tool),
            ),
        },
    };
    if a.format == Format::Json {
        return crate::output::json(
            out,
            &json!({
                "server": a.server,
                "tool": a.tool,
                "args_sha256": args_sha256,
                "uid": uid,
                "agent_identity": identity.as_ref().map(Sha256Hex::as_str),
                "exposed": hidden.is_none(),
                "decision": decision,
                "rule": rule.map(|r| json!({"id": r.id.as_str(), "digest": r.digest()})),
                "reason": reason,
                "rules": per_rule,
                "counts": if counts.is_some() {
                    "per run: the newest broker run in the audit log; per session: a new session"
                } else {
                    "per run: unknown (the audit log could not be verified), taken as 0; per session: a new session"
                },
            }),
        );
    }
    // Escaped, not redacted: the digest must be shown whole (the operator's own input and
    // configuration, nothing from an agent or a server).
    out_line(
        out,
        &text::escape_capped(
            &format!(
                "{decision}: {}/{} as uid {uid}, args_sha256 {args_sha256}",
                a.server, a.tool
            ),
            1024,
        ),
    )?;
    out_line(out, &text::escape_capped(&reason, 1024))?;
    if hidden.is_some() {
        return Ok(());
    }
    for (r, row) in covering.iter().zip(&per_rule) {
        let verdict = match row["why"].as_str() {
            None if r.effect == Effect::Deny => "matches (refuses)".to_owned(),
            None => "matches".to_owned(),
            Some(w) => format!("does not match: {w}"),
        };
        out_line(
            out,
            &text::escape_capped(&format!("  {}: {verdict}", rule_head(r)), 1024),
        )?;
    }
    if !covering.is_empty() {
        out_line(
            out,
            if counts.is_some() {
                "counts: per run from the newest broker run in the audit log; per session as for a new session"
            } else {
                "counts: the audit log could not be verified, so per-run counts are taken as 0"
            },
        )?;
    }
    Ok(())
}

/// `iteron audit rules`: per rule, what the verified audit log records.
pub(crate) fn audit_rules(format: Format, out: &mut dyn Write) -> Result<(), CliError> {
    let home = home()?;
    let counts = iteron_broker::rules::audit_counts(home.dir())
        .map_err(|t| CliError::Audit(t.to_string()))?;
    // The configuration's rules are listed too, with what they did (possibly nothing); a rule
    // version in the log that the configuration no longer has is marked.
    let config = home.load().ok();
    let configured = |id: &str, digest: &str| {
        config.as_ref().is_some_and(|c| {
            c.approvals
                .rules
                .iter()
                .any(|r| r.id.as_str() == id && r.digest() == digest)
        })
    };
    let mut rows: Vec<Value> = counts
        .rules
        .iter()
        .map(|c| with_in_config(c.to_json(), configured(&c.id, &c.digest)))
        .collect();
    for r in config.iter().flat_map(|c| c.approvals.rules.iter()) {
        let digest = r.digest();
        if !counts
            .rules
            .iter()
            .any(|c| c.id == r.id.as_str() && c.digest == digest)
        {
            let unused = RuleCount {
                id: r.id.as_str().to_owned(),
                digest,
                ..RuleCount::default()
            };
            rows.push(with_in_config(unused.to_json(), true));
        }
    }
    if format == Format::Json {
        return crate::output::json(
            out,
            &json!({
                "records": counts.records,
                "suppressed_records": counts.suppressed,
                "rules": rows,
            }),
        );
    }
    out_line(
        out,
        &format!(
            "audit log verified: {} records; per approval rule:",
            counts.records
        ),
    )?;
    if rows.is_empty() {
        out_line(out, "no approval rule is configured or recorded")?;
    }
    for r in &rows {
        let n = |k: &str| r[k].as_u64().unwrap_or(0);
        out_line(
            out,
            &text::single_line(&format!(
                "{} (digest {}): approved {} ({} in the newest run), denied {}, not matched {}{}",
                r["id"].as_str().unwrap_or(""),
                r["digest"].as_str().unwrap_or(""),
                n("approved"),
                n("approved_this_run"),
                n("denied"),
                n("unmatched"),
                if r["in_config"] == Value::Bool(true) {
                    ""
                } else {
                    " (not in the configuration now)"
                }
            )),
        )?;
    }
    if counts.suppressed > 0 {
        out_line(
            out,
            &format!(
                "note: {} summary records count agent records that were not written one by one; refusals among them are not counted above",
                counts.suppressed
            ),
        )?;
    }
    Ok(())
}

/// One rule's counts with whether the configuration still has that version of the rule.
fn with_in_config(mut row: Value, in_config: bool) -> Value {
    if let Some(o) = row.as_object_mut() {
        o.insert("in_config".into(), json!(in_config));
    }
    row
}
