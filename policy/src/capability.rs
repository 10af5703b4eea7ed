//! Capability classes, the host ceiling, per-server policy and the exposure decision.
//!
//! The rule this module exists to keep: configuration and untrusted input can only *narrow*
//! authority. A server's `policy.capabilities` and each `policy.tools` entry are intersected with
//! the host ceiling (never unioned); omitting them inherits the ceiling; naming a class the host
//! does not allow widens nothing. A tool whose admitted set is empty, or does not cover every
//! class its effect carries, is not exposed to the agent at all.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Serialize, Serializer};

use crate::names::ToolName;

/// A class of effect. The set is closed: adding one is a policy change reviewed like code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Capability {
    /// Reads that change nothing.
    ReadOnly,
    /// Writes inside the operator's workspace.
    WorkspaceWrite,
    /// Starting processes.
    Process,
    /// Reaching the network.
    WebEgress,
    /// Handing work to another agent.
    Delegation,
    /// Effects outside the local machine that cannot be undone.
    IrreversibleExternal,
}

impl Capability {
    /// Every class, in canonical order.
    pub const ALL: [Capability; 6] = [
        Capability::ReadOnly,
        Capability::WorkspaceWrite,
        Capability::Process,
        Capability::WebEgress,
        Capability::Delegation,
        Capability::IrreversibleExternal,
    ];

    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::ReadOnly => "read_only",
            Capability::WorkspaceWrite => "workspace_write",
            Capability::Process => "process",
            Capability::WebEgress => "web_egress",
            Capability::Delegation => "delegation",
            Capability::IrreversibleExternal => "irreversible_external",
        }
    }

    /// Parse the configuration spelling (exact, lower case).
    pub fn parse(s: &str) -> Option<Capability> {
        Capability::ALL.into_iter().find(|c| c.as_str() == s)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A set of capability classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CapabilitySet(u8);

impl CapabilitySet {
    /// No class.
    pub const EMPTY: CapabilitySet = CapabilitySet(0);

    /// Classes allowed when the operator configures no `host_ceiling`: reads, workspace writes,
    /// and irreversible external effects (every MCP tool call is one, and each needs approval).
    /// Process, network egress and delegation must be granted explicitly.
    pub const DEFAULT_HOST_CEILING: CapabilitySet = CapabilitySet(
        (1 << Capability::ReadOnly as u8)
            | (1 << Capability::WorkspaceWrite as u8)
            | (1 << Capability::IrreversibleExternal as u8),
    );

    /// What every MCP tool call carries, whatever the server's annotations claim.
    pub const MCP_TOOL: CapabilitySet = CapabilitySet(1 << Capability::IrreversibleExternal as u8);

    /// Build a set from classes.
    pub fn of(classes: &[Capability]) -> CapabilitySet {
        CapabilitySet(classes.iter().fold(0, |acc, c| acc | c.bit()))
    }

    /// Whether `class` is in the set.
    pub fn contains(self, class: Capability) -> bool {
        self.0 & class.bit() != 0
    }

    /// Add a class.
    pub fn insert(&mut self, class: Capability) {
        self.0 |= class.bit();
    }

    /// The classes in both sets.
    #[must_use]
    pub fn intersect(self, other: CapabilitySet) -> CapabilitySet {
        CapabilitySet(self.0 & other.0)
    }

    /// Whether every class of `self` is in `other`.
    pub fn is_subset(self, other: CapabilitySet) -> bool {
        self.0 & !other.0 == 0
    }

    /// Whether the set has no class.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The classes, in canonical order.
    pub fn iter(self) -> impl Iterator<Item = Capability> {
        Capability::ALL
            .into_iter()
            .filter(move |c| self.contains(*c))
    }
}

impl fmt::Display for CapabilitySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("(none)");
        }
        for (i, c) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(c.as_str())?;
        }
        Ok(())
    }
}

impl Serialize for CapabilitySet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter().map(Capability::as_str))
    }
}

/// The `tools` filter of a server: exact bare names. It can only name tools that already exist,
/// so a newly published tool passes an empty allow list; that is what [`ServerPolicy`] is for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ToolFilter {
    /// When non-empty, only these tools.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<ToolName>,
    /// Never these tools.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<ToolName>,
}

impl ToolFilter {
    /// Whether the filter says nothing.
    pub fn is_empty(&self) -> bool {
        self.allow.is_empty() && self.deny.is_empty()
    }
}

/// The `policy` block of a server: bounds on the classes its tools may carry, including tools it
/// has not published yet.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ServerPolicy {
    /// Bound for every tool of the server; `None` inherits the host ceiling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<CapabilitySet>,
    /// Per-tool bounds, intersected with the server bound and the host ceiling.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tools: BTreeMap<ToolName, CapabilitySet>,
}

impl ServerPolicy {
    /// Whether the policy says nothing.
    pub fn is_empty(&self) -> bool {
        self.capabilities.is_none() && self.tools.is_empty()
    }
}

/// The classes admitted for one tool: ceiling ∩ server bound (if any) ∩ tool bound (if any).
/// Only ever intersects, so the result is always a subset of the ceiling.
pub fn admitted(ceiling: CapabilitySet, policy: &ServerPolicy, tool: &ToolName) -> CapabilitySet {
    let mut set = ceiling;
    if let Some(server) = policy.capabilities {
        set = set.intersect(server);
    }
    if let Some(per_tool) = policy.tools.get(tool) {
        set = set.intersect(*per_tool);
    }
    set
}

/// Whether a server's resources and prompts are offered: reading a resource or getting a
/// prompt runs the server's code like a tool call, so it carries what an MCP tool carries
/// ([`CapabilitySet::MCP_TOOL`]) and needs it admitted by the ceiling and the server's bound.
/// Only ever intersects, like [`admitted`].
pub fn server_reads_exposed(ceiling: CapabilitySet, policy: &ServerPolicy) -> bool {
    let set = match policy.capabilities {
        Some(server) => ceiling.intersect(server),
        None => ceiling,
    };
    CapabilitySet::MCP_TOOL.iter().all(|c| set.contains(c))
}

/// Whether any tool of a server could be exposed: an MCP tool needs
/// [`CapabilitySet::MCP_TOOL`] admitted by the ceiling and the server's bound, and a non-empty
/// allow list must name a tool that is neither denied nor bound below it. A server for which
/// this is false is never started for an agent and never named to one. Only ever narrows: it
/// is true whenever [`decide_exposure`] could expose one of its tools.
pub fn server_tools_exposed(
    ceiling: CapabilitySet,
    filter: &ToolFilter,
    policy: &ServerPolicy,
) -> bool {
    if !server_reads_exposed(ceiling, policy) {
        return false;
    }
    filter.allow.is_empty()
        || filter.allow.iter().any(|t| {
            matches!(
                decide_exposure(ceiling, filter, policy, t, CapabilitySet::MCP_TOOL),
                Exposure::Expose(_)
            )
        })
}

/// Why a tool is not exposed. Internal: the agent sees an unexposed tool exactly as an unknown
/// one; these reasons are for the operator's diagnostics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HideReason {
    /// Listed in `tools.deny`.
    Denied,
    /// `tools.allow` is non-empty and does not list it.
    NotAllowed,
    /// Its admitted set is empty.
    NothingAdmitted,
    /// Its effect carries a class that is not admitted.
    ClassNotAdmitted(Capability),
    /// The caller declared no class for the effect: nothing can be checked, so it is hidden.
    NoClassDeclared,
}

impl fmt::Display for HideReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HideReason::Denied => f.write_str("listed in tools.deny"),
            HideReason::NotAllowed => f.write_str("not listed in tools.allow"),
            HideReason::NothingAdmitted => f.write_str("policy admits no capability class"),
            HideReason::ClassNotAdmitted(c) => write!(f, "policy does not admit class {c}"),
            HideReason::NoClassDeclared => f.write_str("the effect declares no capability class"),
        }
    }
}

/// Whether a tool is shown to the agent, and with which admitted classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exposure {
    /// Shown; the effect may carry these classes.
    Expose(CapabilitySet),
    /// Invisible to the agent.
    Hide(HideReason),
}

/// Decide whether `tool`, whose effect carries the classes `carried`, is exposed. The filter is
/// applied first (deny wins over allow), then the policy: the admitted set must be non-empty and
/// must cover every carried class. An effect that declares no class at all cannot be checked and
/// is hidden (fail closed); callers pass the classes of the effect (for MCP tools,
/// [`CapabilitySet::MCP_TOOL`]).
pub fn decide_exposure(
    ceiling: CapabilitySet,
    filter: &ToolFilter,
    policy: &ServerPolicy,
    tool: &ToolName,
    carried: CapabilitySet,
) -> Exposure {
    if filter.deny.contains(tool) {
        return Exposure::Hide(HideReason::Denied);
    }
    if !filter.allow.is_empty() && !filter.allow.contains(tool) {
        return Exposure::Hide(HideReason::NotAllowed);
    }
    if carried.is_empty() {
        return Exposure::Hide(HideReason::NoClassDeclared);
    }
    let set = admitted(ceiling, policy, tool);
    if set.is_empty() {
        return Exposure::Hide(HideReason::NothingAdmitted);
    }
    if let Some(missing) = carried.iter().find(|c| !set.contains(*c)) {
        return Exposure::Hide(HideReason::ClassNotAdmitted(missing));
    }
    Exposure::Expose(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tool(s: &str) -> ToolName {
        ToolName::parse(s).unwrap()
    }

    #[test]
    fn a_server_with_no_exposable_tool_is_known_without_its_catalog() {
        let all = CapabilitySet(63);
        let open = ServerPolicy::default();
        let none = ToolFilter::default();
        assert!(server_tools_exposed(all, &none, &open));
        let bound = ServerPolicy {
            capabilities: Some(CapabilitySet::of(&[Capability::ReadOnly])),
            ..ServerPolicy::default()
        };
        assert!(!server_tools_exposed(all, &none, &bound));
        // Every allowed tool denied, or bound below what a call carries.
        let allow_denied = ToolFilter {
            allow: vec![tool("a")],
            deny: vec![tool("a")],
        };
        assert!(!server_tools_exposed(all, &allow_denied, &open));
        let mut per_tool = ServerPolicy::default();
        per_tool.tools.insert(tool("a"), CapabilitySet::of(&[]));
        let allow_a = ToolFilter {
            allow: vec![tool("a")],
            deny: vec![],
        };
        assert!(!server_tools_exposed(all, &allow_a, &per_tool));
        assert!(server_tools_exposed(all, &allow_a, &open));
    }

    proptest! {
        /// Whenever some tool would be exposed, the server counts as exposing tools.
        #[test]
        fn server_tools_exposed_never_hides_an_exposed_tool(
            ceiling in 0u8..64, bound in proptest::option::of(0u8..64), per in 0u8..64,
            allow in any::<bool>(), deny in any::<bool>(),
        ) {
            let mut policy = ServerPolicy { capabilities: bound.map(CapabilitySet), ..ServerPolicy::default() };
            policy.tools.insert(tool("t"), CapabilitySet(per));
            let filter = ToolFilter {
                allow: if allow { vec![tool("t")] } else { vec![] },
                deny: if deny { vec![tool("t")] } else { vec![] },
            };
            for name in ["t", "u"] {
                if let Exposure::Expose(_) = decide_exposure(CapabilitySet(ceiling), &filter, &policy, &tool(name), CapabilitySet::MCP_TOOL) {
                    prop_assert!(server_tools_exposed(CapabilitySet(ceiling), &filter, &policy));
                }
            }
        }
    }

    #[test]
    fn server_reads_need_what_a_tool_call_needs() {
        let all = CapabilitySet(63);
        let open = ServerPolicy::default();
        assert!(server_reads_exposed(all, &open));
        assert!(server_reads_exposed(CapabilitySet::MCP_TOOL, &open));
        // A read-only ceiling (a child session) sees none.
        let read_only = CapabilitySet(1 << Capability::ReadOnly as u8);
        assert!(!server_reads_exposed(read_only, &open));
        // A server bound without irreversible_external offers none.
        let bound = ServerPolicy {
            capabilities: Some(read_only),
            ..ServerPolicy::default()
        };
        assert!(!server_reads_exposed(all, &bound));
    }

    fn arb_set() -> impl Strategy<Value = CapabilitySet> {
        (0u8..64).prop_map(CapabilitySet)
    }

    fn arb_policy() -> impl Strategy<Value = ServerPolicy> {
        (
            prop::option::of(arb_set()),
            prop::collection::btree_map(
                prop::sample::select(vec!["a", "b", "risky_tool"]).prop_map(tool),
                arb_set(),
                0..3,
            ),
        )
            .prop_map(|(capabilities, tools)| ServerPolicy {
                capabilities,
                tools,
            })
    }

    #[test]
    fn the_product_page_example_hides_the_emptied_tool() {
        let policy = ServerPolicy {
            capabilities: Some(CapabilitySet::of(&[Capability::IrreversibleExternal])),
            tools: [(tool("risky_tool"), CapabilitySet::EMPTY)].into(),
        };
        let filter = ToolFilter {
            allow: vec![],
            deny: vec![tool("delete_all")],
        };
        let ceiling = CapabilitySet::DEFAULT_HOST_CEILING;
        let mcp = CapabilitySet::MCP_TOOL;
        assert_eq!(
            decide_exposure(ceiling, &filter, &policy, &tool("risky_tool"), mcp),
            Exposure::Hide(HideReason::NothingAdmitted)
        );
        assert_eq!(
            decide_exposure(ceiling, &filter, &policy, &tool("delete_all"), mcp),
            Exposure::Hide(HideReason::Denied)
        );
        assert_eq!(
            decide_exposure(ceiling, &filter, &policy, &tool("new_tool"), mcp),
            Exposure::Expose(mcp)
        );
    }

    #[test]
    fn a_wider_server_policy_widens_nothing() {
        let policy = ServerPolicy {
            capabilities: Some(CapabilitySet::of(&Capability::ALL)),
            tools: BTreeMap::new(),
        };
        let ceiling = CapabilitySet::of(&[Capability::ReadOnly]);
        assert_eq!(admitted(ceiling, &policy, &tool("x")), ceiling);
        assert_eq!(
            decide_exposure(
                ceiling,
                &ToolFilter::default(),
                &policy,
                &tool("x"),
                CapabilitySet::MCP_TOOL
            ),
            Exposure::Hide(HideReason::ClassNotAdmitted(
                Capability::IrreversibleExternal
            ))
        );
    }

    #[test]
    fn allow_list_hides_unlisted_and_deny_wins() {
        let filter = ToolFilter {
            allow: vec![tool("a"), tool("b")],
            deny: vec![tool("b")],
        };
        let p = ServerPolicy::default();
        let c = CapabilitySet::DEFAULT_HOST_CEILING;
        let m = CapabilitySet::MCP_TOOL;
        assert_eq!(
            decide_exposure(c, &filter, &p, &tool("a"), m),
            Exposure::Expose(c)
        );
        assert_eq!(
            decide_exposure(c, &filter, &p, &tool("b"), m),
            Exposure::Hide(HideReason::Denied)
        );
        assert_eq!(
            decide_exposure(c, &filter, &p, &tool("z"), m),
            Exposure::Hide(HideReason::NotAllowed)
        );
    }

    #[test]
    fn capability_spellings_round_trip() {
        for c in Capability::ALL {
            assert_eq!(Capability::parse(c.as_str()), Some(c));
        }
        assert_eq!(Capability::parse("Read_Only"), None);
        assert_eq!(CapabilitySet::EMPTY.to_string(), "(none)");
    }

    proptest! {
        #[test]
        fn intersection_never_widens(ceiling in arb_set(), policy in arb_policy(),
                                     name in prop::sample::select(vec!["a", "b", "risky_tool", "other"])) {
            let t = tool(name);
            let set = admitted(ceiling, &policy, &t);
            prop_assert!(set.is_subset(ceiling));
            if let Some(server) = policy.capabilities {
                prop_assert!(set.is_subset(server));
            }
            if let Some(per_tool) = policy.tools.get(&t) {
                prop_assert!(set.is_subset(*per_tool));
            }
            if let Exposure::Expose(exposed) = decide_exposure(ceiling, &ToolFilter::default(), &policy, &t, CapabilitySet::MCP_TOOL) {
                prop_assert!(exposed.is_subset(ceiling));
                prop_assert!(CapabilitySet::MCP_TOOL.is_subset(exposed));
            }
        }

        #[test]
        fn omitted_policy_inherits_the_ceiling(ceiling in arb_set(), name in "[a-z]{1,8}") {
            prop_assert_eq!(admitted(ceiling, &ServerPolicy::default(), &tool(&name)), ceiling);
        }

        #[test]
        fn empty_admitted_set_means_not_exposed(ceiling in arb_set(), policy in arb_policy(),
                                                carried in arb_set(),
                                                name in prop::sample::select(vec!["a", "b", "risky_tool"])) {
            let t = tool(name);
            let decision = decide_exposure(ceiling, &ToolFilter::default(), &policy, &t, carried);
            if carried.is_empty() {
                prop_assert_eq!(decision, Exposure::Hide(HideReason::NoClassDeclared));
            } else if admitted(ceiling, &policy, &t).is_empty() {
                prop_assert_eq!(decision, Exposure::Hide(HideReason::NothingAdmitted));
            }
            if let Exposure::Expose(set) = decision {
                prop_assert!(!set.is_empty());
                prop_assert!(carried.is_subset(set));
            }
        }
    }
}
