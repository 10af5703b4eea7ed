//! Executable agent definitions (`agents/*.md`): strict frontmatter, a read-only tool registry,
//! budgets that only narrow, a model policy, and a SHA-256 content identity.
//!
//! ```text
//! ---
//! name: reviewer
//! description: Reviews one bounded source area.
//! tools: [read_file, grep, git_diff]
//! model: inherit
//! maxTurns: 8
//! maxTokens: 12000
//! maxWallSecs: 90
//! maxConsecutiveToolErrors: 2
//! ---
//! Review the assigned area. Report direct evidence with file and line references.
//! ```
//!
//! `name` and the body are required; every other key is optional; any other key, or a key
//! twice, is an error. `tools` (keep only these) and `disallowedTools` (remove these) are
//! mutually exclusive and name tools of [`READ_ONLY_TOOLS`] only: a definition can never grant
//! an edit, process, shell, web-egress, workflow or delegation tool.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::frontmatter::{self, Value};
use crate::skill::name_ok;
use crate::text;

/// Longest agent name (and request-side `agentType`), in bytes.
pub const MAX_NAME: usize = 128;
/// Largest definition file read.
pub const MAX_FILE: usize = 64 * 1024;
/// The child ceiling: turns.
pub const MAX_TURNS: u64 = 30;
/// The child ceiling: wall seconds.
pub const MAX_WALL_SECS: u64 = 300;
/// The child ceiling: consecutive tool errors.
pub const MAX_CONSECUTIVE_TOOL_ERRORS: u64 = 3;
/// Largest `maxTokens`.
pub const MAX_TOKENS: u64 = 100_000_000;
/// The shared parent cost ledger counts whole micro-dollars up to this many (2^53, the
/// largest range in which every integer is exact in an f64).
pub const MAX_USD_MICROS: u64 = 1 << 53;
/// Longest request-side model override, in bytes.
pub const MAX_MODEL: usize = 512;
/// Longest description.
pub const MAX_DESCRIPTION: usize = 1024;

/// Iteron's built-in read-only tool registry: the only tools a definition may name.
pub const READ_ONLY_TOOLS: [&str; 8] = [
    "read_file",
    "list_dir",
    "glob",
    "grep",
    "git_status",
    "git_diff",
    "git_log",
    "git_show",
];

/// Where a definition came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// `~/.iteron/agents`: operator-owned.
    User,
    /// `<repo>/.iteron/agents`: workspace input.
    Repository,
}

impl Tier {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::User => "user",
            Tier::Repository => "repository",
        }
    }
}

/// Which model a child uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelPolicy {
    /// The parent's exact route.
    Inherit,
    /// Another route, usable only with resolved provider, capability and pricing evidence.
    Route(String),
}

/// The budgets of a child (each at most the built-in ceiling).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Turns.
    pub max_turns: u64,
    /// Wall seconds.
    pub max_wall_secs: u64,
    /// Consecutive tool errors before the child is stopped.
    pub max_consecutive_tool_errors: u64,
    /// Tokens, if limited.
    pub max_tokens: Option<u64>,
    /// Cost ceiling in micro-dollars, if limited.
    pub max_usd_micros: Option<u64>,
}

impl Budget {
    /// The built-in child ceiling.
    pub const CEILING: Budget = Budget {
        max_turns: MAX_TURNS,
        max_wall_secs: MAX_WALL_SECS,
        max_consecutive_tool_errors: MAX_CONSECUTIVE_TOOL_ERRORS,
        max_tokens: None,
        max_usd_micros: None,
    };
}

/// An admitted definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentDef {
    /// The name.
    pub name: String,
    /// The description (may be empty).
    pub description: String,
    /// The system prompt (the body).
    pub system_prompt: String,
    /// The tools the child may use, in registry order.
    pub tools: Vec<&'static str>,
    /// The model policy.
    pub model: ModelPolicy,
    /// The budgets.
    pub budget: Budget,
    /// Where it came from.
    pub tier: Tier,
    /// SHA-256 (hex) over name, system prompt, tool filter, model policy, budget and tier.
    pub identity: String,
}

/// Why a definition (or a request) was refused. Texts never quote the file or the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentError {
    /// Over [`MAX_FILE`] bytes.
    TooLarge,
    /// Not UTF-8.
    NotUtf8,
    /// A bidi, invisible or other unsafe character.
    UnsafeText(text::UnsafeChar),
    /// Malformed frontmatter.
    Frontmatter(frontmatter::Error),
    /// An unknown key (line).
    UnknownKey(usize),
    /// `name` is missing.
    MissingName,
    /// The body (system prompt) is empty.
    MissingBody,
    /// The name breaks the grammar.
    BadName,
    /// Both `tools` and `disallowedTools`.
    BothToolLists,
    /// A tool outside the read-only registry (its name when it is a plain identifier).
    NotReadOnly(Option<String>),
    /// A value of the wrong shape (key).
    BadValue(&'static str),
    /// A budget over the child ceiling (key, ceiling).
    OverCeiling(&'static str, u64),
    /// `maxUsd` is negative, not finite, or not representable in the cost ledger.
    UnrepresentableUsd,
}

impl fmt::Display for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentError::TooLarge => write!(f, "the definition is over {MAX_FILE} bytes"),
            AgentError::NotUtf8 => f.write_str("the definition is not UTF-8"),
            AgentError::UnsafeText(c) => {
                write!(f, "the definition contains a forbidden character ({c})")
            }
            AgentError::Frontmatter(e) => write!(f, "frontmatter: {e}"),
            AgentError::UnknownKey(line) => write!(f, "frontmatter line {line}: unknown key"),
            AgentError::MissingName => f.write_str("frontmatter: name is required"),
            AgentError::MissingBody => f.write_str("the body (the system prompt) is required"),
            AgentError::BadName => write!(
                f,
                "the name must be 1-{MAX_NAME} bytes of ASCII letters, digits, '.', '_' or '-'"
            ),
            AgentError::BothToolLists => {
                f.write_str("tools and disallowedTools are mutually exclusive")
            }
            AgentError::NotReadOnly(Some(t)) => write!(
                f,
                "{t} is not in the read-only tool registry (a definition cannot grant edit, process, shell, web-egress, workflow or delegation tools)"
            ),
            AgentError::NotReadOnly(None) => f.write_str(
                "a tool outside the read-only registry is named (a definition cannot grant edit, process, shell, web-egress, workflow or delegation tools)",
            ),
            AgentError::BadValue(k) => write!(f, "{k} has a value of the wrong kind"),
            AgentError::OverCeiling(k, max) => {
                write!(f, "{k} must be between 1 and {max} (budgets only narrow)")
            }
            AgentError::UnrepresentableUsd => f.write_str(
                "maxUsd must be a finite, non-negative amount the cost ledger represents exactly (whole micro-dollars)",
            ),
        }
    }
}

impl std::error::Error for AgentError {}

fn scalar<'a>(v: &'a Value, key: &'static str) -> Result<&'a str, AgentError> {
    match v {
        Value::Scalar { text, .. } => Ok(text),
        Value::List(_) => Err(AgentError::BadValue(key)),
    }
}

fn unsigned(v: &Value, key: &'static str, min: u64, max: u64) -> Result<u64, AgentError> {
    let s = match v {
        Value::Scalar {
            text,
            quoted: false,
        } => text,
        _ => return Err(AgentError::BadValue(key)),
    };
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(AgentError::BadValue(key));
    }
    match s.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(AgentError::OverCeiling(key, max)),
    }
}

/// `maxUsd` in whole micro-dollars: finite, non-negative, at most 6 decimal places, within
/// [`MAX_USD_MICROS`].
fn usd_micros(v: &Value) -> Result<u64, AgentError> {
    let s = match v {
        Value::Scalar {
            text,
            quoted: false,
        } => text.as_str(),
        _ => return Err(AgentError::BadValue("maxUsd")),
    };
    // Decimal notation only: no sign, exponent, NaN or infinity spelling.
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    let digits = |x: &str| x.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(frac) || (s.contains('.') && frac.is_empty()) {
        return Err(AgentError::UnrepresentableUsd);
    }
    if frac.len() > 6 && frac[6..].bytes().any(|b| b != b'0') {
        return Err(AgentError::UnrepresentableUsd);
    }
    let whole: u64 = whole.parse().map_err(|_| AgentError::UnrepresentableUsd)?;
    let mut micros_frac = 0u64;
    for (i, b) in frac.bytes().take(6).enumerate() {
        micros_frac += u64::from(b - b'0') * 10u64.pow(5 - i as u32);
    }
    let total = whole
        .checked_mul(1_000_000)
        .and_then(|w| w.checked_add(micros_frac))
        .ok_or(AgentError::UnrepresentableUsd)?;
    if total > MAX_USD_MICROS {
        return Err(AgentError::UnrepresentableUsd);
    }
    Ok(total)
}

fn tool_list(v: &Value) -> Result<Vec<&'static str>, AgentError> {
    let Value::List(items) = v else {
        return Err(AgentError::BadValue("tools"));
    };
    let mut out = Vec::new();
    for item in items {
        let Some(t) = READ_ONLY_TOOLS.iter().find(|t| **t == item.as_str()) else {
            let shown = (item.len() <= 64
                && item
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.')))
            .then(|| item.clone());
            return Err(AgentError::NotReadOnly(shown));
        };
        out.push(*t);
    }
    Ok(out)
}

/// The request-side `agentType` grammar (the same as definition names), checked before lookup.
pub fn check_agent_type(s: &str) -> Result<(), AgentError> {
    if name_ok(s, MAX_NAME) {
        Ok(())
    } else {
        Err(AgentError::BadName)
    }
}

/// A request-side model override: non-blank, control-free, at most [`MAX_MODEL`] bytes.
pub fn check_model_override(s: &str) -> Result<(), &'static str> {
    if s.trim().is_empty() {
        return Err("the model override is blank");
    }
    if s.len() > MAX_MODEL {
        return Err("the model override is over 512 bytes");
    }
    if text::check_untrusted(s, false).is_err() {
        return Err("the model override contains control or invisible characters");
    }
    Ok(())
}

/// Parse and validate a definition file.
pub fn parse(bytes: &[u8], tier: Tier) -> Result<AgentDef, AgentError> {
    let doc = frontmatter::decode(bytes, MAX_FILE).map_err(|e| match e {
        frontmatter::DecodeError::TooLarge => AgentError::TooLarge,
        frontmatter::DecodeError::NotUtf8 => AgentError::NotUtf8,
        frontmatter::DecodeError::UnsafeText(c) => AgentError::UnsafeText(c),
        frontmatter::DecodeError::Frontmatter(f) => AgentError::Frontmatter(f),
    })?;
    let mut name = None;
    let mut description = String::new();
    let mut tools: Option<Vec<&'static str>> = None;
    let mut disallowed: Option<Vec<&'static str>> = None;
    let mut model = ModelPolicy::Inherit;
    let mut budget = Budget::CEILING;
    for e in &doc.entries {
        let v = &e.value;
        match e.key.as_str() {
            "name" => name = Some(scalar(v, "name")?.to_owned()),
            "description" => {
                let d = scalar(v, "description")?;
                if d.len() > MAX_DESCRIPTION || d.contains('\n') {
                    return Err(AgentError::BadValue("description"));
                }
                description = d.to_owned();
            }
            "tools" => tools = Some(tool_list(v)?),
            "disallowedTools" => {
                disallowed = Some(tool_list(v).map_err(|e| match e {
                    AgentError::BadValue(_) => AgentError::BadValue("disallowedTools"),
                    other => other,
                })?);
            }
            "model" => {
                let m = scalar(v, "model")?;
                if check_model_override(m).is_err() {
                    return Err(AgentError::BadValue("model"));
                }
                model = if m == "inherit" {
                    ModelPolicy::Inherit
                } else {
                    ModelPolicy::Route(m.to_owned())
                };
            }
            "maxTurns" => budget.max_turns = unsigned(v, "maxTurns", 1, MAX_TURNS)?,
            "maxWallSecs" => budget.max_wall_secs = unsigned(v, "maxWallSecs", 1, MAX_WALL_SECS)?,
            "maxConsecutiveToolErrors" => {
                budget.max_consecutive_tool_errors = unsigned(
                    v,
                    "maxConsecutiveToolErrors",
                    1,
                    MAX_CONSECUTIVE_TOOL_ERRORS,
                )?;
            }
            "maxTokens" => budget.max_tokens = Some(unsigned(v, "maxTokens", 1, MAX_TOKENS)?),
            "maxUsd" => budget.max_usd_micros = Some(usd_micros(v)?),
            _ => return Err(AgentError::UnknownKey(e.line)),
        }
    }
    let name = name.ok_or(AgentError::MissingName)?;
    if !name_ok(&name, MAX_NAME) {
        return Err(AgentError::BadName);
    }
    if doc.body.trim().is_empty() {
        return Err(AgentError::MissingBody);
    }
    let tools = match (tools, disallowed) {
        (Some(_), Some(_)) => return Err(AgentError::BothToolLists),
        (Some(keep), None) => READ_ONLY_TOOLS
            .iter()
            .copied()
            .filter(|t| keep.contains(t))
            .collect(),
        (None, Some(drop)) => READ_ONLY_TOOLS
            .iter()
            .copied()
            .filter(|t| !drop.contains(t))
            .collect(),
        (None, None) => READ_ONLY_TOOLS.to_vec(),
    };
    let mut def = AgentDef {
        name,
        description,
        system_prompt: doc.body,
        tools,
        model,
        budget,
        tier,
        identity: String::new(),
    };
    def.identity = identity(&def);
    Ok(def)
}

/// SHA-256 (hex) over the fields that decide what a child is: each field length-prefixed so no
/// two different definitions share an encoding.
pub fn identity(d: &AgentDef) -> String {
    let mut h = Sha256::new();
    let mut field = |label: &str, bytes: &[u8]| {
        h.update(label.as_bytes());
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    };
    field("iteron-agent-identity-v1", b"");
    field("name", d.name.as_bytes());
    field("system_prompt", d.system_prompt.as_bytes());
    field("tools", d.tools.join(",").as_bytes());
    match &d.model {
        ModelPolicy::Inherit => field("model", b"inherit"),
        ModelPolicy::Route(r) => field("model_route", r.as_bytes()),
    }
    let b = &d.budget;
    field(
        "budget",
        format!(
            "{}/{}/{}/{:?}/{:?}",
            b.max_turns,
            b.max_wall_secs,
            b.max_consecutive_tool_errors,
            b.max_tokens,
            b.max_usd_micros
        )
        .as_bytes(),
    );
    field("tier", d.tier.as_str().as_bytes());
    let digest = h.finalize();
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PAGE: &str = "---\nname: reviewer\ndescription: Reviews one bounded source area.\ntools: [read_file, grep, git_diff]\nmodel: inherit\nmaxTurns: 8\nmaxTokens: 12000\nmaxWallSecs: 90\nmaxConsecutiveToolErrors: 2\n---\nReview the assigned area. Report direct evidence with file and line references.\n";

    fn with(extra: &str) -> String {
        format!("---\nname: a\n{extra}\n---\nPrompt.\n")
    }

    #[test]
    fn the_product_page_example_is_admitted() {
        let d = parse(PAGE.as_bytes(), Tier::Repository).unwrap();
        assert_eq!(d.name, "reviewer");
        assert_eq!(d.tools, vec!["read_file", "grep", "git_diff"]);
        assert_eq!(d.model, ModelPolicy::Inherit);
        assert_eq!(
            d.budget,
            Budget {
                max_turns: 8,
                max_wall_secs: 90,
                max_consecutive_tool_errors: 2,
                max_tokens: Some(12000),
                max_usd_micros: None
            }
        );
        assert_eq!(d.identity.len(), 64);
    }

    #[test]
    fn omitting_both_lists_keeps_the_registry_and_disallowed_removes() {
        let d = parse(with("").as_bytes(), Tier::User).unwrap();
        assert_eq!(d.tools, READ_ONLY_TOOLS.to_vec());
        assert_eq!(d.budget, Budget::CEILING);
        let d = parse(with("disallowedTools: [grep, glob]").as_bytes(), Tier::User).unwrap();
        assert!(!d.tools.contains(&"grep") && !d.tools.contains(&"glob"));
        assert_eq!(d.tools.len(), READ_ONLY_TOOLS.len() - 2);
    }

    #[test]
    fn hostile_definitions_are_refused_with_their_reason() {
        let cases: Vec<(String, AgentError)> = vec![
            (with("color: red"), AgentError::UnknownKey(3)),
            (
                with("name: b"),
                AgentError::Frontmatter(frontmatter::Error {
                    line: 3,
                    kind: frontmatter::ErrorKind::DuplicateKey,
                }),
            ),
            (
                with("tools: [grep]\ndisallowedTools: [glob]"),
                AgentError::BothToolLists,
            ),
            (
                with("maxTurns: 31"),
                AgentError::OverCeiling("maxTurns", 30),
            ),
            (with("maxTurns: 0"), AgentError::OverCeiling("maxTurns", 30)),
            (
                with("maxWallSecs: 301"),
                AgentError::OverCeiling("maxWallSecs", 300),
            ),
            (
                with("maxConsecutiveToolErrors: 4"),
                AgentError::OverCeiling("maxConsecutiveToolErrors", 3),
            ),
            (
                with("maxConsecutiveToolErrors: 0"),
                AgentError::OverCeiling("maxConsecutiveToolErrors", 3),
            ),
            (with("maxUsd: -1"), AgentError::UnrepresentableUsd),
            (with("maxUsd: NaN"), AgentError::UnrepresentableUsd),
            (with("maxUsd: .nan"), AgentError::UnrepresentableUsd),
            (with("maxUsd: 1e309"), AgentError::UnrepresentableUsd),
            (with("maxUsd: inf"), AgentError::UnrepresentableUsd),
            (with("maxUsd: 0.0000001"), AgentError::UnrepresentableUsd),
            (with("maxUsd: 99999999999"), AgentError::UnrepresentableUsd),
            (with("maxUsd: \"5\""), AgentError::BadValue("maxUsd")),
            (
                with("tools: [shell]"),
                AgentError::NotReadOnly(Some("shell".into())),
            ),
            (
                with("tools: [edit_file]"),
                AgentError::NotReadOnly(Some("edit_file".into())),
            ),
            (
                with("disallowedTools: [web_fetch]"),
                AgentError::NotReadOnly(Some("web_fetch".into())),
            ),
            (with("tools: grep"), AgentError::BadValue("tools")),
            (with("maxTurns: eight"), AgentError::BadValue("maxTurns")),
            (
                format!("---\nname: {}\n---\nP\n", "n".repeat(129)),
                AgentError::BadName,
            ),
            ("---\nname: a/b\n---\nP\n".into(), AgentError::BadName),
            ("---\nname: a\n---\n \n".into(), AgentError::MissingBody),
            (
                "---\ndescription: d\n---\nP\n".into(),
                AgentError::MissingName,
            ),
        ];
        for (text, want) in cases {
            assert_eq!(
                parse(text.as_bytes(), Tier::Repository).unwrap_err(),
                want,
                "{text:?}"
            );
        }
        // Exactly at the ceilings is accepted.
        let d = parse(
            with("maxTurns: 30\nmaxWallSecs: 300\nmaxConsecutiveToolErrors: 3\nmaxUsd: 12.5")
                .as_bytes(),
            Tier::User,
        )
        .unwrap();
        assert_eq!(d.budget.max_usd_micros, Some(12_500_000));
        assert!(
            parse(
                format!("---\nname: {}\n---\nP\n", "n".repeat(128)).as_bytes(),
                Tier::User
            )
            .is_ok()
        );
        assert!(parse(with("maxUsd: 0").as_bytes(), Tier::User).is_ok());
    }

    #[test]
    fn the_identity_covers_every_field_that_decides_the_child() {
        let base = parse(PAGE.as_bytes(), Tier::Repository).unwrap();
        let user = parse(PAGE.as_bytes(), Tier::User).unwrap();
        assert_ne!(base.identity, user.identity, "trust tier");
        for (from, to) in [
            ("Review the assigned", "Review the whole"),
            (
                "tools: [read_file, grep, git_diff]",
                "tools: [read_file, grep]",
            ),
            ("model: inherit", "model: other-route"),
            ("maxTurns: 8", "maxTurns: 9"),
            ("name: reviewer", "name: reviewer2"),
        ] {
            let changed = parse(PAGE.replace(from, to).as_bytes(), Tier::Repository).unwrap();
            assert_ne!(changed.identity, base.identity, "{from}");
        }
        // The description is not part of what the child is.
        let same = parse(
            PAGE.replace("bounded source", "single source").as_bytes(),
            Tier::Repository,
        )
        .unwrap();
        assert_eq!(same.identity, base.identity);
    }

    #[test]
    fn request_side_names_and_models() {
        assert!(check_agent_type("reviewer").is_ok());
        assert!(check_agent_type("Reviewer.v2_x-y").is_ok());
        for bad in ["", "a b", "a/b", "ré", &"n".repeat(129), "..", "a\u{202e}"] {
            assert!(check_agent_type(bad).is_err(), "{bad:?}");
        }
        assert!(check_model_override("claude-x").is_ok());
        for bad in ["", "   ", "a\u{7}", &"m".repeat(513), "x\u{200b}"] {
            assert!(check_model_override(bad).is_err(), "{bad:?}");
        }
        assert!(check_model_override(&"m".repeat(512)).is_ok());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn arbitrary_files_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400), s in "\\PC{0,200}") {
            let _ = parse(&bytes, Tier::Repository);
            let _ = parse(format!("---\nname: x\n{s}\n---\nbody").as_bytes(), Tier::Repository);
        }

        #[test]
        fn unknown_keys_are_always_refused(key in "[a-zA-Z][a-zA-Z0-9_]{0,16}") {
            let known = ["name", "description", "tools", "disallowedTools", "model", "maxTurns",
                "maxTokens", "maxWallSecs", "maxConsecutiveToolErrors", "maxUsd"];
            prop_assume!(!known.contains(&key.as_str()));
            let text = format!("---\nname: x\n{key}: v\n---\nbody");
            prop_assert_eq!(parse(text.as_bytes(), Tier::User).unwrap_err(), AgentError::UnknownKey(3));
        }

        #[test]
        fn usd_amounts_are_exact_or_refused(whole in 0u64..1_000_000, frac in 0u64..1_000_000) {
            let text = with(&format!("maxUsd: {whole}.{frac:06}"));
            let d = parse(text.as_bytes(), Tier::User).unwrap();
            prop_assert_eq!(d.budget.max_usd_micros, Some(whole * 1_000_000 + frac));
        }
    }
}
