//! `iteron mcp import --from claude|codex|claude-desktop FILE`: the MCP servers another tool is
//! configured with, added as Iteron servers.
//!
//! Those files hold *values* — API keys in `env`, bearer tokens in headers — where Iteron holds
//! only variable *names*. Every value is dropped: a variable given a literal value becomes a
//! forwarded name (`--env NAME`), a header with a literal value takes its value from a new
//! variable, `Authorization: Bearer …` becomes `oauth.access_token_env`, and the command prints
//! which variables the operator must now provide — never a value, not even in an error. What
//! Iteron cannot express (SSE servers, a working directory, `${…}` inside an argument, an
//! unknown key, a name or URL Iteron refuses) is refused entry by entry, each with its reason;
//! the rest is written in one locked, atomic update, like `mcp add`.

use std::collections::BTreeSet;
use std::io::Write;

use iteron_broker::store::Home;
use iteron_policy::config::{AddError, Config, ServerConfig, Transport};
use iteron_policy::names::{EnvName, HeaderName, ServerName, ToolName};
use serde_json::{Map, Value};

use crate::args::{AddArgs, ImportArgs, ImportFrom};
use crate::error::CliError;

/// Largest file read (the tools' own configuration files are far smaller).
pub(crate) const MAX_IMPORT_BYTES: u64 = 1 << 20;

/// One entry of the file, turned into a server, or why not.
struct Entry {
    /// The entry's name as shown: the server name when it is valid, else its position.
    shown: String,
    outcome: Result<Imported, String>,
}

struct Imported {
    server: ServerConfig,
    /// Variables the operator must now provide, each with where its value was.
    provide: Vec<(String, String)>,
}

/// Read `a.file` as `a.from`'s format and add what can be added.
pub(crate) fn run(
    a: &ImportArgs,
    home: &Home,
    out: &mut dyn Write,
    warn: &mut dyn Write,
) -> Result<(), CliError> {
    let servers = read(a.from, &a.file)?;
    let mut entries: Vec<Entry> = servers
        .iter()
        .enumerate()
        .map(|(i, (name, v))| entry(a.from, i, name, v))
        .collect();
    let accepted: Vec<ServerConfig> = entries
        .iter()
        .filter_map(|e| e.outcome.as_ref().ok().map(|i| i.server.clone()))
        .collect();
    // One update for every accepted entry: locked, atomic, fsynced, like `mcp add`. A name
    // that is taken (or the server limit) refuses that entry only.
    let mut refused_here: Vec<(String, String)> = Vec::new();
    if !a.dry_run && !accepted.is_empty() {
        refused_here = home.update(|config: &mut Config| {
            let mut refused = Vec::new();
            for s in accepted.iter().cloned() {
                let name = s.name.to_string();
                match config.add_server(s) {
                    Ok(()) => {}
                    Err(AddError::Exists(existing)) => refused.push((
                        name,
                        format!(
                            "an MCP server named {existing} already exists (names are compared case-insensitively)"
                        ),
                    )),
                    Err(e @ AddError::Full) => refused.push((name, e.to_string())),
                }
            }
            Ok::<_, CliError>(refused)
        })?;
    }
    for (name, why) in refused_here {
        if let Some(e) = entries.iter_mut().find(|e| e.shown == name) {
            e.outcome = Err(why);
        }
    }
    let verb = if a.dry_run {
        "would import"
    } else {
        "imported"
    };
    let mut provide: BTreeSet<(String, String)> = BTreeSet::new();
    let mut refused = 0;
    for e in &entries {
        match &e.outcome {
            Ok(i) => {
                crate::mcp::warn_credentials(&i.server, warn)?;
                line(
                    out,
                    &format!(
                        "{verb} {} MCP server {}",
                        i.server.transport.as_str(),
                        i.server.name
                    ),
                )?;
                for (var, from) in &i.provide {
                    provide.insert((var.clone(), format!("{} ({from})", i.server.name)));
                }
            }
            Err(why) => {
                refused += 1;
                line(out, &format!("refused {}: {why}", e.shown))?;
            }
        }
    }
    if !provide.is_empty() {
        line(
            out,
            "provide these variables to the broker (its environment, or $CREDENTIALS_DIRECTORY); \
             the values in the file were not imported and are not shown:",
        )?;
        for (var, server) in &provide {
            line(out, &format!("  {var}  for {server}"))?;
        }
    }
    if refused > 0 {
        return Err(CliError::Usage(format!(
            "{refused} of {} entries refused (see above); {}",
            entries.len(),
            if a.dry_run {
                "nothing was changed (--dry-run)"
            } else {
                "the others were imported"
            }
        )));
    }
    Ok(())
}

fn line(out: &mut dyn Write, s: &str) -> Result<(), CliError> {
    writeln!(out, "{}", iteron_policy::text::single_line_capped(s, 600)).map_err(CliError::Output)
}

/// The file's server entries, in file order: `mcpServers` (JSON) or `mcp_servers` (TOML).
fn read(from: ImportFrom, file: &std::path::Path) -> Result<Vec<(String, Value)>, CliError> {
    use std::io::Read;
    let unreadable = |what: &str| CliError::Usage(format!("the file to import {what}"));
    let f = std::fs::File::open(file).map_err(|e| unreadable(&format!("cannot be opened: {e}")))?;
    let mut bytes = Vec::new();
    f.take(MAX_IMPORT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| unreadable(&format!("cannot be read: {e}")))?;
    if bytes.len() as u64 > MAX_IMPORT_BYTES {
        return Err(unreadable(&format!(
            "is larger than {MAX_IMPORT_BYTES} bytes"
        )));
    }
    let text = std::str::from_utf8(&bytes).map_err(|_| unreadable("is not UTF-8"))?;
    // Parse errors are reported by position only: the file holds secrets.
    let (doc, key) = match from {
        ImportFrom::Claude | ImportFrom::ClaudeDesktop => {
            let v: Value = serde_json::from_str(text).map_err(|e| {
                unreadable(&format!(
                    "is not valid JSON (line {}, column {})",
                    e.line(),
                    e.column()
                ))
            })?;
            (v, "mcpServers")
        }
        ImportFrom::Codex => {
            let doc: toml_edit::DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
                unreadable(&match e.span() {
                    Some(span) => {
                        let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                        format!("is not valid TOML (line {line})")
                    }
                    None => "is not valid TOML".to_owned(),
                })
            })?;
            (table_json(doc.as_table()), "mcp_servers")
        }
    };
    match doc.get(key) {
        None => Ok(Vec::new()),
        Some(Value::Object(m)) => Ok(m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
        Some(_) => Err(unreadable(&format!(
            "has a {key} that is not a table of servers"
        ))),
    }
}

fn table_json(t: &toml_edit::Table) -> Value {
    Value::Object(
        t.iter()
            .map(|(k, item)| (k.to_owned(), item_json(item)))
            .collect(),
    )
}

fn item_json(item: &toml_edit::Item) -> Value {
    match item {
        toml_edit::Item::None => Value::Null,
        toml_edit::Item::Value(v) => value_json(v),
        toml_edit::Item::Table(t) => table_json(t),
        toml_edit::Item::ArrayOfTables(a) => Value::Array(a.iter().map(table_json).collect()),
    }
}

fn value_json(v: &toml_edit::Value) -> Value {
    match v {
        toml_edit::Value::String(s) => Value::String(s.value().clone()),
        toml_edit::Value::Integer(i) => Value::from(*i.value()),
        toml_edit::Value::Float(f) => Value::from(*f.value()),
        toml_edit::Value::Boolean(b) => Value::Bool(*b.value()),
        // A date is never a server setting Iteron reads; it only has to be refused.
        toml_edit::Value::Datetime(_) => Value::Null,
        toml_edit::Value::Array(a) => Value::Array(a.iter().map(value_json).collect()),
        toml_edit::Value::InlineTable(t) => Value::Object(
            t.iter()
                .map(|(k, v)| (k.to_owned(), value_json(v)))
                .collect::<Map<_, _>>(),
        ),
    }
}

/// The keys each format may use in an entry; any other is refused (it would be dropped
/// silently otherwise, and it may matter).
fn known_keys(from: ImportFrom) -> &'static [&'static str] {
    match from {
        ImportFrom::Claude => &["type", "command", "args", "env", "url", "headers"],
        ImportFrom::ClaudeDesktop => &["type", "command", "args", "env"],
        ImportFrom::Codex => &[
            "command",
            "args",
            "env",
            "env_vars",
            "cwd",
            "url",
            "bearer_token_env_var",
            "bearer_token",
            "http_headers",
            "env_http_headers",
            "enabled",
            "enabled_tools",
            "disabled_tools",
            "startup_timeout_sec",
            "startup_timeout_ms",
            "tool_timeout_sec",
        ],
    }
}

/// `${NAME}` exactly (the whole value), as Claude Code expands it.
fn reference(v: &str) -> Option<&str> {
    v.strip_prefix("${")?
        .strip_suffix('}')
        .filter(|n| EnvName::parse(n).is_ok())
}

/// A variable name made from a server's and a key's name (`github` + `x-api-key` →
/// `GITHUB_X_API_KEY`), for a value the file held literally.
fn derived(server: &str, key: &str) -> String {
    let mut n: String = format!("{server}_{key}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    if n.starts_with(|c: char| c.is_ascii_digit()) {
        n.insert(0, '_');
    }
    n
}

fn strings(v: Option<&Value>, what: &str) -> Result<Vec<String>, String> {
    match v {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("{what} must be a list of strings"))
            })
            .collect(),
        Some(_) => Err(format!("{what} must be a list of strings")),
    }
}

fn table<'a>(v: Option<&'a Value>, what: &str) -> Result<Vec<(&'a str, &'a str)>, String> {
    match v {
        None => Ok(Vec::new()),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, x)| {
                x.as_str()
                    .map(|s| (k.as_str(), s))
                    .ok_or_else(|| format!("{what} must map names to strings"))
            })
            .collect(),
        Some(_) => Err(format!("{what} must be a table of strings")),
    }
}

fn entry(from: ImportFrom, index: usize, raw_name: &str, v: &Value) -> Entry {
    let Ok(name) = ServerName::parse(raw_name) else {
        return Entry {
            shown: format!("entry {} (its name is not a valid server name)", index + 1),
            outcome: Err(
                "server names are 1-64 ASCII letters, digits, '.', '_', '-' (rename it in the file)"
                    .into(),
            ),
        };
    };
    Entry {
        shown: name.to_string(),
        outcome: convert(from, name.as_str(), v),
    }
}

fn convert(from: ImportFrom, name: &str, v: &Value) -> Result<Imported, String> {
    let Value::Object(m) = v else {
        return Err("the entry is not a table".into());
    };
    if let Some(k) = m.keys().find(|k| !known_keys(from).contains(&k.as_str())) {
        let k = iteron_policy::text::single_line_capped(k, 64);
        return Err(format!("unknown key {k} (not imported: it may matter)"));
    }
    if m.get("enabled") == Some(&Value::Bool(false)) {
        return Err("disabled in the file (enabled = false)".into());
    }
    if m.contains_key("cwd") {
        return Err("it sets a working directory (cwd); Iteron starts every server in /: use absolute paths in its arguments and add it with iteron mcp add".into());
    }
    let kind = m.get("type").and_then(Value::as_str);
    match kind {
        None | Some("stdio" | "http" | "streamable-http") => {}
        Some("sse") => {
            return Err("the SSE transport (protocol 2024-11-05) is not supported; add the server's Streamable HTTP endpoint with iteron mcp add --url".into());
        }
        Some(_) => return Err("its type is not stdio or http".into()),
    }
    let mut provide = Vec::new();
    let mut a = AddArgs {
        name: name.to_owned(),
        ..AddArgs::default()
    };
    let mut bearer: Option<EnvName> = None;
    if let Some(cmd) = m.get("command") {
        if m.contains_key("url") {
            return Err("it has both a command and a url".into());
        }
        let cmd = cmd.as_str().ok_or("command must be a string")?;
        if cmd.contains("${") {
            return Err("its command uses ${…} expansion, which Iteron does not do".into());
        }
        a.stdio = Some(cmd.to_owned());
        a.args = strings(m.get("args"), "args")?;
        if a.args.iter().any(|x| x.contains("${")) {
            return Err("an argument uses ${…} expansion, which Iteron does not do (arguments are passed as written; forward a variable with --env instead)".into());
        }
        let mut env: Vec<String> = Vec::new();
        for (k, val) in table(m.get("env"), "env")? {
            let Ok(var) = EnvName::parse(k) else {
                return Err("env names a variable that is not a valid variable name".into());
            };
            match reference(val) {
                Some(r) if r == var.as_str() => {}
                Some(r) => provide.push((var.to_string(), format!("its env {var} read ${{{r}}}"))),
                None => provide.push((var.to_string(), format!("its env {var} held a value"))),
            }
            env.push(var.to_string());
        }
        for var in strings(m.get("env_vars"), "env_vars")? {
            if !env.contains(&var) {
                env.push(var);
            }
        }
        a.env = env;
    } else if let Some(url) = m.get("url") {
        let url = url.as_str().ok_or("url must be a string")?;
        if url.contains("${") {
            return Err("its url uses ${…} expansion, which Iteron does not do".into());
        }
        a.url = Some(url.to_owned());
        let mut header_env: Vec<(HeaderName, String)> = Vec::new();
        let literal = |h: &HeaderName| derived(name, h.as_str());
        let headers = match from {
            ImportFrom::Codex => table(m.get("http_headers"), "http_headers")?,
            _ => table(m.get("headers"), "headers")?,
        };
        for (h, val) in headers {
            let header =
                HeaderName::parse(h).map_err(|e| format!("a header name is refused: {e}"))?;
            if header.as_str() == "authorization" {
                // `Bearer <token>`: the token comes from a variable (Iteron adds the scheme).
                let Some(token) = val.strip_prefix("Bearer ") else {
                    return Err("its Authorization header is not a Bearer token".into());
                };
                let var = match reference(token.trim()) {
                    Some(r) => r.to_owned(),
                    None => {
                        let var = derived(name, "token");
                        provide.push((var.clone(), "its Authorization header held a token".into()));
                        var
                    }
                };
                bearer =
                    Some(EnvName::parse(&var).map_err(|_| "a derived variable name is refused")?);
                continue;
            }
            let var = match reference(val) {
                Some(r) => r.to_owned(),
                None if val.contains("${") => {
                    return Err(format!(
                        "its header {header} mixes text and ${{…}}, which Iteron cannot send"
                    ));
                }
                None => {
                    let var = literal(&header);
                    provide.push((var.clone(), format!("its header {header} held a value")));
                    var
                }
            };
            header_env.push((header, var));
        }
        if from == ImportFrom::Codex {
            for (h, var) in table(m.get("env_http_headers"), "env_http_headers")? {
                let header =
                    HeaderName::parse(h).map_err(|e| format!("a header name is refused: {e}"))?;
                header_env.push((header, var.to_owned()));
            }
            if let Some(var) = m.get("bearer_token_env_var") {
                let var = var
                    .as_str()
                    .ok_or("bearer_token_env_var must be a string")?;
                bearer = Some(
                    EnvName::parse(var)
                        .map_err(|_| "bearer_token_env_var is not a variable name")?,
                );
            }
            if m.contains_key("bearer_token") {
                let var = derived(name, "token");
                provide.push((var.clone(), "its bearer_token held a token".into()));
                bearer =
                    Some(EnvName::parse(&var).map_err(|_| "a derived variable name is refused")?);
            }
        }
        a.header_env = header_env.iter().map(|(h, v)| format!("{h}={v}")).collect();
    } else {
        return Err("it has neither a command nor a url".into());
    }
    // The same checks as `mcp add`, with its one-line, value-free errors.
    let mut server = crate::mcp::build_server(&a).map_err(|e| e.to_string())?;
    if let (Some(var), Transport::Http(h)) = (bearer, &mut server.transport) {
        h.oauth
            .get_or_insert_with(Default::default)
            .access_token_env = Some(var);
    }
    let tools = |key: &str| -> Result<Vec<ToolName>, String> {
        strings(m.get(key), key)?
            .iter()
            .map(|t| {
                ToolName::parse(t)
                    .map_err(|_| format!("{key} names a tool that is not a valid tool name"))
            })
            .collect()
    };
    server.tools.allow = tools("enabled_tools")?;
    server.tools.deny = tools("disabled_tools")?;
    crate::mcp::check_entry(&server).map_err(|e| e.to_string())?;
    Ok(Imported { server, provide })
}
