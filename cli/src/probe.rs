//! `iteron mcp test|status|doctor`: connect and look, never act.
//!
//! `test` connects, negotiates and lists tools — it never calls a tool. `status` and `doctor`
//! without `--connect` touch no network and start no process. Every probe is bounded by a
//! deadline. Outputs name environment variables, never their values.

use std::ffi::OsString;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use iteron_broker::credentials::CredentialStore;
use iteron_broker::mcp::client::{McpError, Options};
use iteron_broker::mcp::{TransportError, TransportErrorKind};
use iteron_broker::servers::{self, ConnectError};
use iteron_broker::spawn::{SAFE_PATH, resolve_program};
use iteron_broker::store::Home;
use iteron_policy::config::{Config, ServerConfig, Transport};
use iteron_policy::text;
use serde_json::{Value, json};

use crate::args::Format;
use crate::error::CliError;

mod doctor;
pub(crate) use doctor::doctor;

/// Default deadline of one probe (connect + negotiate + list); `--timeout` sets another.
pub(crate) const PROBE_DEADLINE: Duration = Duration::from_secs(30);
/// Default bound of a whole `status --connect` or `doctor --connect` run; `--run-timeout`
/// sets another. Probes still running then are stopped and reported as not finished.
pub(crate) const RUN_DEADLINE: Duration = Duration::from_secs(120);
/// Most servers probed at once (the broker's `list_tools` uses the same bound); the others
/// wait for a free slot (their own deadline starts when they get one).
pub(crate) const MAX_PARALLEL_PROBES: usize = servers::MAX_PARALLEL_CONNECTS;
/// Of a probe's deadline, the part kept back from the stdio start, so the start reports its
/// own timeout (with the server's last stderr lines) before the probe's bound ends it.
const START_MARGIN: Duration = Duration::from_millis(500);

/// Where probes read the variables a server names, as the broker does: a credential of
/// `$CREDENTIALS_DIRECTORY` (systemd's `LoadCredential=`) first, then the environment. The
/// directory is read once, checked like the broker checks it, and denied to every child.
pub(crate) struct Vars {
    unit: Option<iteron_broker::unit_secrets::UnitSecrets>,
}

impl Vars {
    /// Read `$CREDENTIALS_DIRECTORY` when it is set; a directory the broker would refuse is
    /// refused here too (one line naming the file, never a value).
    pub(crate) fn load() -> Result<Vars, CliError> {
        let unit = iteron_broker::unit_secrets::UnitSecrets::from_env(|k| std::env::var_os(k))
            .map_err(|e| CliError::Serve(e.to_string()))?;
        if let Some(u) = &unit {
            iteron_broker::confine::deny_to_every_child(vec![u.dir().to_path_buf()]);
        }
        Ok(Vars { unit })
    }

    /// The value of `name`: the credentials directory's, else the environment's.
    pub(crate) fn get(&self, name: &str) -> Option<OsString> {
        self.unit
            .as_ref()
            .and_then(|u| u.get(name))
            .or_else(|| std::env::var_os(name))
    }

    /// Where `name` is set, in words (never its value), or `None`.
    fn source(&self, name: &str) -> Option<&'static str> {
        if self.unit.as_ref().is_some_and(|u| u.get(name).is_some()) {
            Some("set by the credentials directory (value not shown)")
        } else if std::env::var_os(name).is_some() {
            Some("set (value not shown)")
        } else {
            None
        }
    }
}

/// The result of probing one server, as shown.
fn probe_json(server: &ServerConfig, outcome: Result<Value, String>) -> Value {
    let mut v = json!({"name": server.name.as_str(), "transport": server.transport.as_str()});
    match outcome {
        Ok(found) => {
            if let (Some(obj), Some(more)) = (v.as_object_mut(), found.as_object()) {
                for (k, x) in more {
                    obj.insert(k.clone(), x.clone());
                }
            }
        }
        Err(why) => {
            if let Some(obj) = v.as_object_mut() {
                obj.insert("error".into(), Value::String(why));
            }
        }
    }
    v
}

/// Connect to one server (with the operator's stored OAuth credential, if any) and list its
/// tools, within `deadline`.
async fn probe(
    home: &Home,
    config: &Config,
    server: &ServerConfig,
    vars: &Vars,
    deadline: Duration,
) -> Result<Value, String> {
    probe_tools(home, config, server, vars, deadline)
        .await
        .map(|(v, _)| v)
}

/// [`probe`], also giving the tools themselves (names and input schemas).
pub(crate) async fn probe_tools(
    home: &Home,
    config: &Config,
    server: &ServerConfig,
    vars: &Vars,
    deadline: Duration,
) -> Result<(Value, Vec<iteron_broker::mcp::client::Tool>), String> {
    let lookup = |k: &str| vars.get(k);
    let opts = Options {
        start_deadline: deadline
            .saturating_sub(START_MARGIN)
            .max(Duration::from_secs(1)),
        ..Options::default()
    };
    let work = async {
        let client = servers::connect_with_credentials(
            server,
            &config.network,
            &lookup,
            opts,
            home,
            servers::SpawnContext {
                home: home.dir().to_path_buf(),
                ceiling: config.ceiling(),
                egress: None,
            },
            &servers::LearnedSecrets::default(),
        )
        .await
        .map_err(|e: ConnectError| match &e {
            ConnectError::Mcp(m) => explain(m, home, server),
            other => other.to_string(),
        })?;
        let listed = client
            .list_tools()
            .await
            .map_err(|e| explain(&e, home, server));
        let stderr = client.stderr_tail(3).await;
        let era = client.era();
        let info = client.server_info();
        let dropped = client.dropped_tools();
        client.close().await;
        let tools = match listed {
            Ok(t) => t,
            Err(e) => {
                let tail = if stderr.is_empty() {
                    String::new()
                } else {
                    format!(" (server stderr: {})", stderr.join(" | "))
                };
                return Err(format!("{e}{tail}"));
            }
        };
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
        let summary = json!({
            "protocol_version": era.version().as_str(),
            "tool_count": tools.len(),
            "tools": names,
            "server": info.map(|(n, v)| json!({"name": n, "version": v})),
            "dropped_tools": dropped.iter().map(|d| json!({"name": d.name, "reason": d.reason})).collect::<Vec<_>>(),
        });
        Ok((summary, tools))
    };
    let secrets = servers::KnownSecrets::of(server, &lookup);
    match tokio::time::timeout(deadline, work).await {
        Ok(r) => r.map_err(|e| text::single_line_capped(&secrets.scrub(&e), 400)),
        Err(_) => Err(format!("no answer within {} s", deadline.as_secs())),
    }
}

/// How a run of several probes is bounded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// Deadline of each probe.
    pub(crate) each: Duration,
    /// Bound of the whole run.
    pub(crate) run: Duration,
}

impl From<&crate::args::ProbeBounds> for Bounds {
    fn from(b: &crate::args::ProbeBounds) -> Bounds {
        Bounds {
            each: Duration::from_secs(b.each.timeout),
            run: Duration::from_secs(b.run_timeout),
        }
    }
}

/// A progress line on stderr, kept only when stderr is a terminal (never in a pipe or a
/// file); it is cleared before each result line and at the end.
struct Progress {
    on: bool,
    total: usize,
}

impl Progress {
    fn new(total: usize) -> Progress {
        let on = total > 0 && nix::unistd::isatty(std::io::stderr()).unwrap_or(false);
        Progress { on, total }
    }

    fn clear(&self) {
        if self.on {
            let mut e = std::io::stderr();
            let _ = write!(e, "\r\x1b[K");
            let _ = e.flush();
        }
    }

    fn show(&self, done: usize) {
        if self.on {
            let mut e = std::io::stderr();
            let _ = write!(
                e,
                "\r\x1b[Kprobing: {done}/{} done, {} running or waiting",
                self.total,
                self.total - done
            );
            let _ = e.flush();
        }
    }
}

/// What one probe found: its summary and the tools themselves, or why it failed.
type Probed = Result<(Value, Vec<iteron_broker::mcp::client::Tool>), String>;

/// The summary of a [`Probed`].
fn summary(r: &Probed) -> Result<Value, String> {
    r.as_ref().map(|(v, _)| v.clone()).map_err(Clone::clone)
}

/// Probe `chosen` at once, at most [`MAX_PARALLEL_PROBES`] at a time, each within
/// `bounds.each` and all within `bounds.run`; `arrived(index, result)` is called as each
/// result arrives (with the progress line out of the way). Returns every result in the
/// order of `chosen`; a probe the run's bound cut short is an error saying so.
fn probe_all(
    home: &Home,
    config: &Config,
    chosen: &[&ServerConfig],
    vars: Arc<Vars>,
    bounds: Bounds,
    mut arrived: impl FnMut(usize, &Result<Value, String>) -> Result<(), CliError>,
) -> Result<Vec<Probed>, CliError> {
    let rt = crate::rt::multi_thread()?;
    let progress = Progress::new(chosen.len());
    let mut results: Vec<Option<Probed>> = vec![None; chosen.len()];
    let outcome = rt.block_on(async {
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_PARALLEL_PROBES));
        let mut set = tokio::task::JoinSet::new();
        for (i, s) in chosen.iter().enumerate() {
            let (home, config, server) = (home.clone(), config.clone(), (*s).clone());
            let (vars, slots) = (Arc::clone(&vars), Arc::clone(&slots));
            set.spawn(async move {
                // Never closed: acquiring only waits for a free slot.
                let _slot = slots.acquire_owned().await;
                (
                    i,
                    probe_tools(&home, &config, &server, &vars, bounds.each).await,
                )
            });
        }
        progress.show(0);
        let end = tokio::time::Instant::now() + bounds.run;
        let mut done = 0;
        while let Ok(Some(joined)) = tokio::time::timeout_at(end, set.join_next()).await {
            let Ok((i, r)) = joined else { continue };
            done += 1;
            progress.clear();
            let shown = arrived(i, &summary(&r));
            if let Some(slot) = results.get_mut(i) {
                *slot = Some(r);
            }
            shown?;
            progress.show(done);
        }
        // Whatever is still running is stopped (its children are killed as it is dropped).
        set.abort_all();
        while set.join_next().await.is_some() {}
        Ok::<(), CliError>(())
    });
    progress.clear();
    outcome?;
    let mut all = Vec::with_capacity(results.len());
    for (i, r) in results.into_iter().enumerate() {
        let r = match r {
            Some(r) => r,
            None => {
                let cut: Probed = Err(format!(
                    "not finished within the run's bound of {} s (see --run-timeout)",
                    bounds.run.as_secs()
                ));
                arrived(i, &summary(&cut))?;
                cut
            }
        };
        all.push(r);
    }
    Ok(all)
}

/// An error as the operator should read it. A valid `403 insufficient_scope` challenge is its
/// own diagnostic: the operator re-logs in explicitly with the union of what was granted and
/// what is asked — nothing is replayed automatically.
fn explain(e: &McpError, home: &Home, server: &ServerConfig) -> String {
    if let McpError::Transport(TransportError {
        kind:
            TransportErrorKind::Unauthorized {
                status: 403,
                challenge: Some(c),
                ..
            },
        ..
    }) = e
        && c.error.as_deref() == Some("insufficient_scope")
    {
        let mut scopes: Vec<String> = CredentialStore::new(home)
            .load(server.name.as_str())
            .ok()
            .flatten()
            .map(|cred| cred.binding.granted_scopes)
            .unwrap_or_default();
        let asked: Vec<&str> = c
            .scope
            .as_deref()
            .unwrap_or("")
            .split(' ')
            .filter(|s| !s.is_empty())
            .collect();
        for s in &asked {
            if !scopes.iter().any(|x| x == s) {
                scopes.push((*s).to_owned());
            }
        }
        // The scope names come from the server: a command is suggested only when every one is
        // a plain word that pastes into a shell as itself (no quoting, no `,` splitting).
        let plain = |s: &str| {
            iteron_policy::config::Scope::parse(s).is_ok()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b":._/-+=@%~".contains(&b))
        };
        if asked.is_empty() || !scopes.iter().all(|s| plain(s)) {
            return format!(
                "the server requires more scope ({}); to grant it, log in again explicitly with \
                 iteron mcp auth login {} --scopes and the scopes you choose to grant",
                text::single_line_capped(c.scope.as_deref().unwrap_or("unspecified"), 200),
                server.name
            );
        }
        return format!(
            "the server requires more scope ({}); to grant it, log in again explicitly: \
             iteron mcp auth login {} --scopes {}",
            asked.join(" "),
            server.name,
            scopes.join(",")
        );
    }
    e.to_string()
}

fn find<'a>(config: &'a Config, raw: &str) -> Result<&'a ServerConfig, CliError> {
    iteron_policy::names::ServerName::parse(raw)
        .map_err(|e| CliError::Usage(format!("server name {e}")))?;
    config.server(raw).ok_or(CliError::NotFound)
}

fn print(out: &mut dyn Write, v: &Value) -> Result<(), CliError> {
    crate::output::json(out, v)
}

/// `iteron mcp test <name>`.
pub(crate) fn test(
    home: &Home,
    raw: &str,
    timeout: Duration,
    format: Format,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let config = home.load()?;
    let server = find(&config, raw)?;
    let result =
        crate::rt::multi_thread()?.block_on(probe(home, &config, server, &Vars::load()?, timeout));
    let v = probe_json(server, result.clone());
    if format == Format::Json {
        print(out, &v)?;
    } else {
        if let Ok(found) = &result {
            {
                writeln!(
                    out,
                    "{}: connected ({}), protocol {}, {} tools",
                    server.name,
                    server.transport.as_str(),
                    found["protocol_version"].as_str().unwrap_or("?"),
                    found["tool_count"]
                )
                .map_err(CliError::Output)?;
                if let Some(tools) = found["tools"].as_array() {
                    for t in tools.iter().filter_map(Value::as_str) {
                        writeln!(out, "  {t}").map_err(CliError::Output)?;
                    }
                }
                if let Some(dropped) = found["dropped_tools"].as_array() {
                    for d in dropped {
                        writeln!(
                            out,
                            "  dropped {}: {}",
                            d["name"].as_str().unwrap_or(""),
                            d["reason"].as_str().unwrap_or("")
                        )
                        .map_err(CliError::Output)?;
                    }
                }
            }
        }
    }
    match result {
        Ok(_) => Ok(()),
        Err(why) => Err(CliError::Server(why)),
    }
}

/// `iteron mcp status [name] [--connect]`.
pub(crate) fn status(
    home: &Home,
    name: Option<&str>,
    connect: Option<Bounds>,
    format: Format,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let config = home.load()?;
    let chosen: Vec<&ServerConfig> = match name {
        Some(n) => vec![find(&config, n)?],
        None => config.mcp_servers.iter().collect(),
    };
    let store = CredentialStore::new(home);
    // One row: the probe's result (or not probed), and the credential state of an HTTP
    // server (read from the local store; no network).
    let row = |s: &ServerConfig, r: Option<&Result<Value, String>>| {
        let mut v = match r {
            None => {
                json!({"name": s.name.as_str(), "transport": s.transport.as_str(), "phase": "not_probed", "state": "not_probed"})
            }
            Some(r) => {
                let mut v = probe_json(s, r.clone());
                if let Some(obj) = v.as_object_mut() {
                    let phase = Value::from(if r.is_ok() { "reachable" } else { "failed" });
                    obj.insert("phase".into(), phase.clone());
                    // The name the row had before `phase` (kept for its readers).
                    obj.insert("state".into(), phase);
                    obj.remove("dropped_tools");
                }
                v
            }
        };
        if matches!(s.transport, Transport::Http(_))
            && let Some(obj) = v.as_object_mut()
        {
            let cred = store.load(s.name.as_str()).ok().flatten();
            obj.insert(
                "credential".into(),
                crate::auth::state_of(s, cred.as_ref()).into(),
            );
            obj.insert("grant".into(), crate::auth::grant_of(s).into());
        }
        v
    };
    if format == Format::Text && chosen.is_empty() {
        return writeln!(out, "No MCP servers configured.").map_err(CliError::Output);
    }
    let rows: Vec<Value> = match connect {
        None => chosen.iter().map(|s| row(s, None)).collect(),
        Some(bounds) => {
            let vars = Arc::new(Vars::load()?);
            // Text: each line as its probe ends; JSON: one document at the end.
            let results = probe_all(home, &config, &chosen, vars, bounds, |i, r| {
                match (format, chosen.get(i)) {
                    (Format::Text, Some(s)) => status_line(out, &row(s, Some(r))),
                    _ => Ok(()),
                }
            })?;
            chosen
                .iter()
                .zip(&results)
                .map(|(s, r)| row(s, Some(&summary(r))))
                .collect()
        }
    };
    let failed = rows.iter().filter(|r| r["phase"] == "failed").count();
    if format == Format::Json {
        print(out, &json!({"servers": rows}))?;
    } else if connect.is_none() {
        for r in &rows {
            status_line(out, r)?;
        }
    }
    if failed > 0 {
        return Err(CliError::Server(format!(
            "{failed} of {} server(s) failed (see above)",
            rows.len()
        )));
    }
    Ok(())
}

fn status_line(out: &mut dyn Write, r: &Value) -> Result<(), CliError> {
    let mut line = format!(
        "{}  {}  {}",
        r["name"].as_str().unwrap_or(""),
        r["transport"].as_str().unwrap_or(""),
        r["phase"].as_str().unwrap_or("")
    );
    if let Some(v) = r["protocol_version"].as_str() {
        line.push_str(&format!("  protocol {v}  {} tools", r["tool_count"]));
    }
    if let Some(c) = r["credential"].as_str() {
        line.push_str(&format!("  credential {c}"));
    }
    if let Some(g) = r["grant"].as_str() {
        line.push_str(&format!("  grant {g}"));
    }
    if let Some(e) = r["error"].as_str() {
        line.push_str(&format!("  {e}"));
    }
    writeln!(out, "{}", text::single_line_capped(&line, 600)).map_err(CliError::Output)?;
    out.flush().map_err(CliError::Output)
}

/// What a stdio server's confinement would enforce if it started now (`None` for HTTP).
pub(crate) fn confinement_of(
    s: &ServerConfig,
    home: &Home,
    ceiling: iteron_policy::capability::CapabilitySet,
) -> Option<iteron_broker::confine::Effective> {
    let Transport::Stdio(st) = &s.transport else {
        return None;
    };
    let ctx = servers::SpawnContext {
        home: home.dir().to_path_buf(),
        ceiling,
        egress: None,
    };
    let spec = servers::stdio_confinement(s, st, &ctx);
    let program = resolve_program(st.command.as_str(), SAFE_PATH)
        .unwrap_or_else(|| std::path::PathBuf::from(st.command.as_str()));
    Some(iteron_broker::confine::describe(&spec, &program, &st.args))
}

/// The program of a stdio server as `confinement_of` resolves it.
fn confinement_command(s: &ServerConfig) -> Option<std::path::PathBuf> {
    let Transport::Stdio(st) = &s.transport else {
        return None;
    };
    Some(
        resolve_program(st.command.as_str(), SAFE_PATH)
            .unwrap_or_else(|| std::path::PathBuf::from(st.command.as_str())),
    )
}

/// One line: how the filesystem and the network are confined.
pub(crate) fn confinement_line(e: &iteron_broker::confine::Effective) -> String {
    let fs = match e.landlock_abi {
        Some(abi) => format!(
            "filesystem confined (landlock ABI {abi}: {} readable, {} writable roots, the operator home denied)",
            e.readable.len(),
            e.writable.len() + 1
        ),
        None => "filesystem NOT confined: this kernel has no Landlock".to_owned(),
    };
    use iteron_broker::confine::NetState;
    let net = match &e.net {
        NetState::Isolated => {
            "network denied (its own network namespace, loopback down)".to_owned()
        }
        NetState::NoNamespace(_) => {
            "network denied (no network namespace on this system)".to_owned()
        }
        NetState::Egress => format!(
            "network only through the broker's egress path (its own network namespace; the public zone{})",
            match e.egress.len() {
                0 => String::new(),
                n => format!(" and {n} destination(s) sandbox.egress names"),
            }
        ),
        NetState::Host => {
            "network UNCONFINED (sandbox.network \"host\": the network as the host sees it)"
                .to_owned()
        }
        NetState::Refused(why) => format!(
            "network: CANNOT START (web_egress needs a network namespace, which this system does not offer: {why}; set sandbox.network \"host\" to run it unconfined)"
        ),
    };
    let mut line = format!(
        "{fs}; {net}; no Unix sockets; no keyrings; no_new_privs; runs as {}",
        e.runs_as()
    );
    if !e.dropped.is_empty() {
        line.push_str(&format!("; {} grant(s) dropped", e.dropped.len()));
    }
    if let Some((p, why)) = e.unreachable.first() {
        line.push_str(&format!(
            "; {} path(s) the child's uid cannot reach, e.g. {}: {why} (grant it by file mode, or set sandbox.run_as)",
            e.unreachable.len(),
            text::single_line_capped(&p.to_string_lossy(), 160)
        ));
    }
    line
}
