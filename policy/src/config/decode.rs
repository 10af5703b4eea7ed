//! Decoding the positioned JSON tree strictly: the schema's keys, types and bounds, the root,
//! the network, the sandbox and the hooks.

use std::collections::BTreeMap;

use super::{
    AbsolutePath, Config, ConfigError, ConfigErrorKind, HookEvent, MAX_HOOKS_PER_EVENT,
    MAX_NAMESERVERS, MAX_SANDBOX_PATHS, MAX_SERVERS, MEMORY_MB_RANGE, Nameserver, NetworkConfig,
    OPEN_FILES_RANGE, PROCESSES_RANGE, RunAs, SCHEMA_VERSION, Sandbox, SandboxNetwork, ValueError,
};
use crate::capability::{Capability, CapabilitySet};
use crate::egress::{EgressRule, MAX_EGRESS_RULES};
use crate::json::{Member, Node, Path, Pos, Value};
use crate::names::{EnvName, NameError};
use crate::rules::ApprovalsConfig;
use crate::url::{EndpointUrl, IdentifierUrl};
use rules::decode_approvals;
use server::decode_server;

// ---------------------------------------------------------------------------------------------
// Decoding from the positioned JSON tree.

type Result2<T> = Result<T, ConfigError>;

fn err(path: &Path, pos: Pos, kind: ConfigErrorKind) -> ConfigError {
    ConfigError {
        path: path.clone(),
        pos,
        kind,
    }
}

fn value_err(path: &Path, node: &Node, e: ValueError) -> ConfigError {
    err(path, node.pos, ConfigErrorKind::Value(e))
}

fn wrong_type(path: &Path, node: &Node, expected: &'static str) -> ConfigError {
    err(
        path,
        node.pos,
        ConfigErrorKind::WrongType {
            expected,
            found: node.value.type_name(),
        },
    )
}

/// An object whose keys were checked against the schema.
struct Fields<'a> {
    members: &'a [Member],
    path: Path,
    pos: Pos,
}

impl<'a> Fields<'a> {
    fn new(node: &'a Node, path: &Path, allowed: &'static [&'static str]) -> Result2<Self> {
        let Value::Object(members) = &node.value else {
            return Err(wrong_type(path, node, "an object"));
        };
        for m in members {
            if !allowed.contains(&m.key.as_str()) {
                let mut shown = Path::root().key(&m.key).to_string();
                // Path display is `$.key` or `$["…"]`; keep only the escaped key text.
                shown = shown
                    .trim_start_matches("$.")
                    .trim_start_matches("$[\"")
                    .trim_end_matches("\"]")
                    .to_owned();
                return Err(err(
                    &path.key(&m.key),
                    m.key_pos,
                    ConfigErrorKind::UnknownKey {
                        key: shown,
                        allowed,
                    },
                ));
            }
        }
        Ok(Fields {
            members,
            path: path.clone(),
            pos: node.pos,
        })
    }

    fn get(&self, key: &str) -> Option<(&'a Node, Path)> {
        self.members
            .iter()
            .find(|m| m.key == key)
            .map(|m| (&m.node, self.path.key(key)))
    }

    fn require(&self, key: &'static str) -> Result2<(&'a Node, Path)> {
        self.get(key)
            .ok_or_else(|| err(&self.path, self.pos, ConfigErrorKind::MissingKey(key)))
    }
}

fn string<'a>(node: &'a Node, path: &Path) -> Result2<&'a str> {
    match &node.value {
        Value::String(s) => Ok(s),
        _ => Err(wrong_type(path, node, "a string")),
    }
}

fn array<'a>(node: &'a Node, path: &Path, max: usize) -> Result2<&'a [Node]> {
    let Value::Array(items) = &node.value else {
        return Err(wrong_type(path, node, "an array"));
    };
    if items.len() > max {
        return Err(err(path, node.pos, ConfigErrorKind::TooMany { max }));
    }
    Ok(items)
}

/// Decode a list of strings with a parser, refusing duplicates.
fn string_list<T: PartialEq>(
    node: &Node,
    path: &Path,
    max: usize,
    parse: impl Fn(&str) -> Result<T, ValueError>,
) -> Result2<Vec<T>> {
    let items = array(node, path, max)?;
    let mut out: Vec<T> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let p = path.index(i);
        let v = parse(string(item, &p)?).map_err(|e| value_err(&p, item, e))?;
        if let Some(j) = out.iter().position(|x| *x == v) {
            return Err(err(
                &p,
                item.pos,
                ConfigErrorKind::Duplicate {
                    first: items[j].pos,
                },
            ));
        }
        out.push(v);
    }
    Ok(out)
}

fn capability_set(node: &Node, path: &Path) -> Result2<CapabilitySet> {
    const ALLOWED: &[&str] = &[
        "read_only",
        "workspace_write",
        "process",
        "web_egress",
        "delegation",
        "irreversible_external",
    ];
    let items = array(node, path, Capability::ALL.len())?;
    let mut set = CapabilitySet::EMPTY;
    for (i, item) in items.iter().enumerate() {
        let p = path.index(i);
        let word = string(item, &p)?;
        let c = Capability::parse(word).ok_or_else(|| {
            err(
                &p,
                item.pos,
                ConfigErrorKind::UnknownWord { allowed: ALLOWED },
            )
        })?;
        if set.contains(c) {
            let first = items
                .iter()
                .find(|n| matches!(&n.value, Value::String(s) if s == word))
                .map_or(item.pos, |n| n.pos);
            return Err(err(&p, item.pos, ConfigErrorKind::Duplicate { first }));
        }
        set.insert(c);
    }
    Ok(set)
}

fn name_value<T>(r: Result<T, NameError>) -> Result<T, ValueError> {
    r.map_err(ValueError::Name)
}

fn optional<T>(
    f: &Fields<'_>,
    key: &str,
    decode: impl Fn(&Node, &Path) -> Result2<T>,
) -> Result2<Option<T>> {
    match f.get(key) {
        Some((node, path)) => decode(node, &path).map(Some),
        None => Ok(None),
    }
}

fn parsed<T>(parse: impl Fn(&str) -> Result<T, ValueError>) -> impl Fn(&Node, &Path) -> Result2<T> {
    move |node, path| parse(string(node, path)?).map_err(|e| value_err(path, node, e))
}

fn url_value(s: &str) -> Result<EndpointUrl, ValueError> {
    EndpointUrl::parse(s).map_err(ValueError::Url)
}

fn identifier_value(s: &str) -> Result<IdentifierUrl, ValueError> {
    IdentifierUrl::parse(s).map_err(ValueError::Url)
}

fn env_value(s: &str) -> Result<EnvName, ValueError> {
    name_value(EnvName::parse(s))
}

pub(super) const ROOT_KEYS: &[&str] = &[
    "schema_version",
    "host_ceiling",
    "mcp_servers",
    "hooks",
    "hooks_writable",
    "hooks_run_as",
    "network",
    "approvals",
];
pub(super) const SERVER_KEYS: &[&str] = &[
    "name",
    "transport",
    "command",
    "args",
    "env",
    "url",
    "header_env",
    "oauth",
    "tools",
    "policy",
    "sandbox",
];
const STDIO_ONLY: &[&str] = &["command", "args", "env", "sandbox"];
const SANDBOX_KEYS: &[&str] = &[
    "readable",
    "writable",
    "max_open_files",
    "max_memory_mb",
    "max_processes",
    "run_as",
    "network",
    "egress",
];

fn ranged(range: (u64, u64)) -> impl Fn(&Node, &Path) -> Result2<u64> {
    move |node, path| match &node.value {
        Value::Number(raw) => raw
            .parse::<u64>()
            .ok()
            .filter(|n| (range.0..=range.1).contains(n))
            .ok_or_else(|| {
                err(
                    path,
                    node.pos,
                    ConfigErrorKind::OutOfRange {
                        min: range.0,
                        max: range.1,
                    },
                )
            }),
        _ => Err(wrong_type(path, node, "an integer")),
    }
}

fn decode_sandbox(node: &Node, path: &Path) -> Result2<Sandbox> {
    let f = Fields::new(node, path, SANDBOX_KEYS)?;
    let paths = |key: &str| -> Result2<Vec<AbsolutePath>> {
        match f.get(key) {
            None => Ok(Vec::new()),
            Some((n, p)) => string_list(n, &p, MAX_SANDBOX_PATHS, AbsolutePath::parse),
        }
    };
    Ok(Sandbox {
        readable: paths("readable")?,
        writable: paths("writable")?,
        max_open_files: optional(&f, "max_open_files", ranged(OPEN_FILES_RANGE))?,
        max_memory_mb: optional(&f, "max_memory_mb", ranged(MEMORY_MB_RANGE))?,
        max_processes: optional(&f, "max_processes", ranged(PROCESSES_RANGE))?,
        run_as: optional(&f, "run_as", parsed(RunAs::parse))?,
        network: optional(&f, "network", parsed(SandboxNetwork::parse))?,
        egress: match f.get("egress") {
            None => Vec::new(),
            Some((n, p)) => string_list(n, &p, MAX_EGRESS_RULES, |s| {
                EgressRule::parse(s).map_err(ValueError::Egress)
            })?,
        },
    })
}
const HTTP_ONLY: &[&str] = &["url", "header_env", "oauth"];

pub(super) fn decode_config(root: &Node) -> Result2<Config> {
    let top = Path::root();
    let Value::Object(members) = &root.value else {
        return Err(wrong_type(&top, root, "an object"));
    };
    // The version decides how everything else is read, so it is checked before any other key.
    match members.iter().find(|m| m.key == "schema_version") {
        None => {
            return Err(err(
                &top,
                root.pos,
                ConfigErrorKind::SchemaVersion { found: None },
            ));
        }
        Some(m) => {
            let found = match &m.node.value {
                Value::Number(raw) => raw.parse::<u64>().ok(),
                _ => None,
            };
            if found != Some(u64::from(SCHEMA_VERSION)) {
                return Err(err(
                    &top.key("schema_version"),
                    m.node.pos,
                    ConfigErrorKind::SchemaVersion { found },
                ));
            }
        }
    }
    let f = Fields::new(root, &top, ROOT_KEYS)?;
    let host_ceiling = optional(&f, "host_ceiling", capability_set)?;
    let mut config = Config {
        host_ceiling,
        mcp_servers: Vec::new(),
        hooks: BTreeMap::new(),
        hooks_writable: Vec::new(),
        hooks_run_as: None,
        network: NetworkConfig::default(),
        approvals: ApprovalsConfig::default(),
    };
    if let Some((node, path)) = f.get("mcp_servers") {
        let items = array(node, &path, MAX_SERVERS)?;
        let mut seen: BTreeMap<String, Pos> = BTreeMap::new();
        for (i, item) in items.iter().enumerate() {
            let p = path.index(i);
            let server = decode_server(item, &p)?;
            // decode_server succeeded, so the item is an object with a "name" member.
            let name_pos = match &item.value {
                Value::Object(ms) => ms
                    .iter()
                    .find(|m| m.key == "name")
                    .map_or(item.pos, |m| m.node.pos),
                _ => item.pos,
            };
            if let Some(first) = seen.get(&server.name.folded()) {
                return Err(err(
                    &p.key("name"),
                    name_pos,
                    ConfigErrorKind::Duplicate { first: *first },
                ));
            }
            seen.insert(server.name.folded(), name_pos);
            config.mcp_servers.push(server);
        }
    }
    if let Some((node, path)) = f.get("hooks_writable") {
        config.hooks_writable = string_list(node, &path, MAX_SANDBOX_PATHS, AbsolutePath::parse)?;
    }
    config.hooks_run_as = optional(&f, "hooks_run_as", parsed(RunAs::parse))?;
    if let Some((node, path)) = f.get("hooks") {
        config.hooks = decode_hooks(node, &path)?;
    }
    if let Some((node, path)) = f.get("network") {
        let nf = Fields::new(node, &path, &["nameservers", "ca_bundle"])?;
        if let Some((n, p)) = nf.get("nameservers") {
            config.network.nameservers = string_list(n, &p, MAX_NAMESERVERS, Nameserver::parse)?;
        }
        config.network.ca_bundle = optional(&nf, "ca_bundle", parsed(AbsolutePath::parse))?;
    }
    if let Some((node, path)) = f.get("approvals") {
        config.approvals = decode_approvals(node, &path)?;
    }
    Ok(config)
}

fn decode_hooks(node: &Node, path: &Path) -> Result2<BTreeMap<HookEvent, Vec<AbsolutePath>>> {
    let f = Fields::new(node, path, HookEvent::NAMES)?;
    let mut hooks = BTreeMap::new();
    for m in f.members {
        // Fields::new admitted only the event names, so parse always succeeds here; an unknown
        // word would already have been reported as an unknown key.
        let Some(event) = HookEvent::parse(&m.key) else {
            continue;
        };
        let p = path.key(&m.key);
        let commands = string_list(&m.node, &p, MAX_HOOKS_PER_EVENT, AbsolutePath::parse)?;
        hooks.insert(event, commands);
    }
    Ok(hooks)
}

mod rules;
mod server;
