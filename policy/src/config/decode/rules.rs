//! Decoding the approval rules and their argument constraints.

use std::collections::BTreeMap;

use super::{
    Fields, Result2, array, err, name_value, optional, parsed, ranged, string, string_list,
    value_err, wrong_type,
};
use crate::config::values::check_text;
use crate::config::{ConfigErrorKind, MAX_STRING_BYTES, ValueError};
use crate::json::{Node, Path, Pos, Value};
use crate::names::{RuleId, ServerName};
use crate::rules::{
    ApprovalsConfig, Constraint, DEFERRED_SECS_RANGE, Effect, Expiry, MAX_ARGUMENT_NAME,
    MAX_CALLS_RANGE, MAX_ONE_OF, MAX_RULE_ARGUMENTS, MAX_RULE_IDENTITIES, MAX_RULE_UIDS, MAX_RULES,
    MAX_UID, Rule, RuleTool, Scalar, Sha256Hex,
};

pub(super) fn decode_approvals(node: &Node, path: &Path) -> Result2<ApprovalsConfig> {
    let f = Fields::new(node, path, &["deferred_secs", "rules"])?;
    let mut out = ApprovalsConfig {
        rules: Vec::new(),
        deferred_secs: optional(&f, "deferred_secs", ranged(DEFERRED_SECS_RANGE))?,
    };
    if let Some((n, p)) = f.get("rules") {
        let items = array(n, &p, MAX_RULES)?;
        let mut seen: BTreeMap<RuleId, Pos> = BTreeMap::new();
        for (i, item) in items.iter().enumerate() {
            let ip = p.index(i);
            let rule = decode_rule(item, &ip)?;
            // decode_rule succeeded, so the item is an object with an "id" member.
            let id_pos = match &item.value {
                Value::Object(ms) => ms
                    .iter()
                    .find(|m| m.key == "id")
                    .map_or(item.pos, |m| m.node.pos),
                _ => item.pos,
            };
            if let Some(first) = seen.get(&rule.id) {
                return Err(err(
                    &ip.key("id"),
                    id_pos,
                    ConfigErrorKind::Duplicate { first: *first },
                ));
            }
            seen.insert(rule.id.clone(), id_pos);
            out.rules.push(rule);
        }
    }
    Ok(out)
}

const CONSTRAINT_KEYS: &[&str] = &["any", "equals", "one_of", "prefix", "range"];

fn decode_rule(node: &Node, path: &Path) -> Result2<Rule> {
    let f = Fields::new(node, path, crate::rules::RULE_KEYS)?;
    let id = {
        let (n, p) = f.require("id")?;
        parsed(|s| name_value(RuleId::parse(s)))(n, &p)?
    };
    let effect = {
        let (n, p) = f.require("effect")?;
        Effect::parse(string(n, &p)?).ok_or_else(|| {
            err(
                &p,
                n.pos,
                ConfigErrorKind::UnknownWord {
                    allowed: &["allow", "deny"],
                },
            )
        })?
    };
    let server = {
        let (n, p) = f.require("server")?;
        parsed(|s| name_value(ServerName::parse(s)))(n, &p)?
    };
    let tool = {
        let (n, p) = f.require("tool")?;
        parsed(|s| name_value(RuleTool::parse(s)))(n, &p)?
    };
    let arguments = match f.get("arguments") {
        None => None,
        Some((n, p)) => Some(decode_arguments(n, &p)?),
    };
    let digest = |s: &str| Sha256Hex::parse(s).ok_or(ValueError::BadDigest);
    let args_sha256 = optional(&f, "args_sha256", parsed(digest))?;
    let agent_uids = match f.get("agent_uids") {
        None => Vec::new(),
        Some((n, p)) => {
            let items = array(n, &p, MAX_RULE_UIDS)?;
            let mut uids: Vec<u32> = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let ip = p.index(i);
                let uid = ranged((0, u64::from(MAX_UID)))(item, &ip)?;
                // ranged bounded it to MAX_UID, which fits a u32.
                let uid = u32::try_from(uid).unwrap_or(u32::MAX);
                if let Some(j) = uids.iter().position(|u| *u == uid) {
                    return Err(err(
                        &ip,
                        item.pos,
                        ConfigErrorKind::Duplicate {
                            first: items[j].pos,
                        },
                    ));
                }
                uids.push(uid);
            }
            uids
        }
    };
    let agent_identities = match f.get("agent_identities") {
        None => Vec::new(),
        Some((n, p)) => string_list(n, &p, MAX_RULE_IDENTITIES, digest)?,
    };
    let mut counts = [None, None];
    for (slot, key) in counts
        .iter_mut()
        .zip(["max_calls_per_run", "max_calls_per_session"])
    {
        if let Some((n, p)) = f.get(key) {
            if effect == Effect::Deny {
                return Err(err(&p, n.pos, ConfigErrorKind::NotForDeny { key }));
            }
            *slot = Some(ranged(MAX_CALLS_RANGE)(n, &p)?);
        }
    }
    let expires = optional(
        &f,
        "expires",
        parsed(|s| Expiry::parse(s).ok_or(ValueError::BadTime)),
    )?;
    Ok(Rule {
        id,
        effect,
        server,
        tool,
        arguments,
        args_sha256,
        agent_uids,
        agent_identities,
        max_calls_per_run: counts[0],
        max_calls_per_session: counts[1],
        expires,
    })
}

fn decode_arguments(node: &Node, path: &Path) -> Result2<BTreeMap<String, Constraint>> {
    let f = Fields::new_any(node, path)?;
    if f.members.len() > MAX_RULE_ARGUMENTS {
        return Err(err(
            path,
            node.pos,
            ConfigErrorKind::TooMany {
                max: MAX_RULE_ARGUMENTS,
            },
        ));
    }
    let mut out = BTreeMap::new();
    for m in f.members {
        let kp = path.key(&m.key);
        check_text(&m.key, MAX_ARGUMENT_NAME)
            .map_err(|e| err(&kp, m.key_pos, ConfigErrorKind::Value(e)))?;
        out.insert(m.key.clone(), decode_constraint(&m.node, &kp)?);
    }
    Ok(out)
}

fn decode_constraint(node: &Node, path: &Path) -> Result2<Constraint> {
    let f = Fields::new(node, path, CONSTRAINT_KEYS)?;
    let [m] = f.members else {
        return Err(err(
            path,
            node.pos,
            ConfigErrorKind::ExactlyOne {
                allowed: CONSTRAINT_KEYS,
            },
        ));
    };
    let p = path.key(&m.key);
    let n = &m.node;
    Ok(match m.key.as_str() {
        "any" => match n.value {
            Value::Bool(true) => Constraint::Any,
            _ => {
                return Err(err(
                    &p,
                    n.pos,
                    ConfigErrorKind::UnknownWord { allowed: &["true"] },
                ));
            }
        },
        "equals" => Constraint::Equals(scalar(n, &p)?),
        "one_of" => {
            let items = array(n, &p, MAX_ONE_OF)?;
            if items.is_empty() {
                return Err(value_err(&p, n, ValueError::Empty));
            }
            let mut values: Vec<Scalar> = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let ip = p.index(i);
                let v = scalar(item, &ip)?;
                if let Some(j) = values.iter().position(|x| *x == v) {
                    return Err(err(
                        &ip,
                        item.pos,
                        ConfigErrorKind::Duplicate {
                            first: items[j].pos,
                        },
                    ));
                }
                values.push(v);
            }
            Constraint::OneOf(values)
        }
        "prefix" => {
            let s = string(n, &p)?;
            check_text(s, MAX_STRING_BYTES).map_err(|e| value_err(&p, n, e))?;
            Constraint::Prefix(s.to_owned())
        }
        _ => {
            let rf = Fields::new(n, &p, &["min", "max"])?;
            let (min_n, min_p) = rf.require("min")?;
            let (max_n, max_p) = rf.require("max")?;
            let min = int64(min_n, &min_p)?;
            let max = int64(max_n, &max_p)?;
            if min > max {
                return Err(err(&p, n.pos, ConfigErrorKind::RangeInverted));
            }
            Constraint::Range { min, max }
        }
    })
}

/// An integer that fits an `i64`, written as one (no fraction, no exponent).
fn int64(node: &Node, path: &Path) -> Result2<i64> {
    match &node.value {
        Value::Number(raw) => raw
            .parse::<i64>()
            .map_err(|_| wrong_type(path, node, "a 64-bit integer")),
        _ => Err(wrong_type(path, node, "a 64-bit integer")),
    }
}

/// A constraint's value: a string (bounded, displayable), an integer or a boolean.
fn scalar(node: &Node, path: &Path) -> Result2<Scalar> {
    match &node.value {
        Value::String(s) => {
            // An exact value may be empty (an empty argument is a value like any other).
            if !s.is_empty() {
                check_text(s, MAX_STRING_BYTES).map_err(|e| value_err(path, node, e))?;
            }
            Ok(Scalar::String(s.clone()))
        }
        Value::Bool(b) => Ok(Scalar::Bool(*b)),
        Value::Number(_) => int64(node, path).map(Scalar::Integer),
        _ => Err(wrong_type(path, node, "a string, an integer or a boolean")),
    }
}
