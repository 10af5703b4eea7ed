//! What `iteron mcp doctor` and the broker's start say of the operator's rules: every rule
//! checked against the configuration, the clock and the catalog, without deciding a call.

use super::*;

/// Why a rule can never match, found by [`check`] or [`check_catalog`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// No server of that name is configured.
    UnknownServer,
    /// The policy hides the tool from every session (so no call of it can reach the rule).
    Hidden(HideReason),
    /// The server's resources and prompts are not offered (its policy does not admit what a
    /// read needs).
    ReadsNotOffered,
    /// It has expired.
    Expired,
    /// It requires an agent-definition identity, and the sessions that have one (child
    /// sessions) are read-only: they can make no MCP call at all.
    IdentityNeverCalls,
    /// A deny rule without constraints on the arguments refuses every call this allow rule
    /// could approve.
    Shadowed(RuleId),
    /// The server does not list the tool (from its catalog).
    NotListed,
    /// The tool's input schema has no such argument (from its catalog).
    NoSuchArgument(String),
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::UnknownServer => f.write_str("no server of that name is configured"),
            Finding::Hidden(why) => write!(f, "the tool is hidden by policy ({why})"),
            Finding::ReadsNotOffered => {
                f.write_str("the server's resources and prompts are not offered by its policy")
            }
            Finding::Expired => f.write_str("the rule has expired"),
            Finding::IdentityNeverCalls => f.write_str(
                "it requires an agent-definition identity, and child sessions (the only ones with one) are read-only and make no MCP calls",
            ),
            Finding::Shadowed(deny) => write!(
                f,
                "deny rule {deny} refuses every call of this tool that it could approve"
            ),
            Finding::NotListed => f.write_str("the server does not list this tool"),
            Finding::NoSuchArgument(a) => {
                write!(f, "the tool's input schema has no argument \"{a}\"")
            }
        }
    }
}

impl Finding {
    /// A stable word for machine-readable output.
    pub fn code(&self) -> &'static str {
        match self {
            Finding::UnknownServer => "unknown_server",
            Finding::Hidden(_) => "hidden_by_policy",
            Finding::ReadsNotOffered => "reads_not_offered",
            Finding::Expired => "expired",
            Finding::IdentityNeverCalls => "identity_never_calls",
            Finding::Shadowed(_) => "shadowed_by_deny",
            Finding::NotListed => "not_listed",
            Finding::NoSuchArgument(_) => "no_such_argument",
        }
    }
}

/// Every reason each rule can never match, from the configuration alone, at `now`.
pub fn check(config: &Config, now: u64) -> Vec<(RuleId, Finding)> {
    let rules = &config.approvals.rules;
    let mut out = Vec::new();
    for rule in rules {
        let mut found = |f: Finding| out.push((rule.id.clone(), f));
        if rule.expires.as_ref().is_some_and(|e| e.passed(now)) {
            found(Finding::Expired);
        }
        let Some(server) = config.server(rule.server.as_str()) else {
            found(Finding::UnknownServer);
            continue;
        };
        let ceiling = config.ceiling();
        match &rule.tool {
            RuleTool::Tool(t) => {
                if let Exposure::Hide(why) = decide_exposure(
                    ceiling,
                    &server.tools,
                    &server.policy,
                    t,
                    CapabilitySet::MCP_TOOL,
                ) {
                    found(Finding::Hidden(why));
                }
            }
            RuleTool::ReadResource | RuleTool::GetPrompt => {
                if !crate::capability::server_reads_exposed(ceiling, &server.policy) {
                    found(Finding::ReadsNotOffered);
                }
            }
        }
        if !rule.agent_identities.is_empty() {
            found(Finding::IdentityNeverCalls);
        }
        if rule.effect == Effect::Allow
            && let Some(deny) = rules.iter().find(|d| {
                d.effect == Effect::Deny
                    && d.covers(rule.server.as_str(), rule.tool.as_str())
                    && !d.constrains_arguments()
                    && d.expires.is_none()
                    && d.agent_identities.is_empty()
                    && (d.agent_uids.is_empty()
                        || (!rule.agent_uids.is_empty()
                            && rule.agent_uids.iter().all(|u| d.agent_uids.contains(u))))
            })
        {
            found(Finding::Shadowed(deny.id.clone()));
        }
    }
    out
}

/// What a server's catalog says of a rule: `tools` is the catalog, each tool's name with its
/// input schema (the pseudo-tools are not in it; their arguments are fixed by MCP).
pub fn check_catalog<'a>(
    rule: &Rule,
    mut tools: impl Iterator<Item = (&'a str, &'a Value)>,
) -> Vec<Finding> {
    let known: Vec<String> = match &rule.tool {
        RuleTool::ReadResource => vec!["uri".into()],
        RuleTool::GetPrompt => vec!["name".into(), "arguments".into()],
        RuleTool::Tool(t) => match tools.find(|(n, _)| *n == t.as_str()) {
            None => return vec![Finding::NotListed],
            Some((_, schema)) => schema
                .get("properties")
                .and_then(Value::as_object)
                .map(|p| p.keys().cloned().collect())
                .unwrap_or_default(),
        },
    };
    rule.arguments
        .iter()
        .flat_map(|a| a.keys())
        .filter(|a| !known.contains(a))
        .map(|a| Finding::NoSuchArgument(a.clone()))
        .collect()
}
