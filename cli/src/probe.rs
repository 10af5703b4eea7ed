//! `iteron mcp test|status|doctor`: connect and look, never act.
//!
//! `test` connects, negotiates and lists tools — it never calls a tool. `status` and `doctor`
//! without `--connect` touch no network and start no process. Every probe is bounded by a
//! deadline. Outputs name environment variables, never their values.

use std::ffi::OsString;
use std::io::Write;
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

/// Deadline of one probe (connect + negotiate + list).
pub(crate) const PROBE_DEADLINE: Duration = Duration::from_secs(30);

fn lookup(name: &str) -> Option<OsString> {
    std::env::var_os(name)
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
/// tools, within [`PROBE_DEADLINE`].
async fn probe(home: &Home, config: &Config, server: &ServerConfig) -> Result<Value, String> {
    probe_tools(home, config, server).await.map(|(v, _)| v)
}

/// [`probe`], also giving the tools themselves (names and input schemas).
pub(crate) async fn probe_tools(
    home: &Home,
    config: &Config,
    server: &ServerConfig,
) -> Result<(Value, Vec<iteron_broker::mcp::client::Tool>), String> {
    let work = async {
        let client = servers::connect_with_credentials(
            server,
            &config.network,
            &lookup,
            Options::default(),
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
    match tokio::time::timeout(PROBE_DEADLINE, work).await {
        Ok(r) => r.map_err(|e| text::single_line_capped(&secrets.scrub(&e), 400)),
        Err(_) => Err(format!("no answer within {} s", PROBE_DEADLINE.as_secs())),
    }
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
    format: Format,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let config = home.load()?;
    let server = find(&config, raw)?;
    let result = crate::rt::multi_thread()?.block_on(probe(home, &config, server));
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
    connect: bool,
    format: Format,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let config = home.load()?;
    let chosen: Vec<&ServerConfig> = match name {
        Some(n) => vec![find(&config, n)?],
        None => config.mcp_servers.iter().collect(),
    };
    let mut rows = Vec::new();
    if connect {
        let rt = crate::rt::multi_thread()?;
        for s in &chosen {
            let r = rt.block_on(probe(home, &config, s));
            let mut v = probe_json(s, r.clone());
            if let Some(obj) = v.as_object_mut() {
                obj.insert(
                    "state".into(),
                    Value::from(if r.is_ok() { "reachable" } else { "failed" }),
                );
                obj.remove("tools");
                obj.remove("dropped_tools");
            }
            rows.push(v);
        }
    } else {
        for s in &chosen {
            rows.push(json!({"name": s.name.as_str(), "transport": s.transport.as_str(), "state": "not_probed"}));
        }
    }
    // The credential state of HTTP servers (read from the local store; no network).
    let store = CredentialStore::new(home);
    for (row, s) in rows.iter_mut().zip(&chosen) {
        if matches!(s.transport, Transport::Http(_))
            && let Some(obj) = row.as_object_mut()
        {
            let cred = store.load(s.name.as_str()).ok().flatten();
            obj.insert(
                "credential".into(),
                crate::auth::state_of(s, cred.as_ref()).into(),
            );
            obj.insert("grant".into(), crate::auth::grant_of(s).into());
        }
    }
    if format == Format::Json {
        return print(out, &json!({"servers": rows}));
    }
    if rows.is_empty() {
        return writeln!(out, "No MCP servers configured.").map_err(CliError::Output);
    }
    for r in &rows {
        let mut line = format!(
            "{}  {}  {}",
            r["name"].as_str().unwrap_or(""),
            r["transport"].as_str().unwrap_or(""),
            r["state"].as_str().unwrap_or("")
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
    }
    Ok(())
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

/// Static checks of one server (no network, no process).
fn check_server(s: &ServerConfig, home: Option<&Home>) -> Vec<Value> {
    let mut checks = Vec::new();
    match &s.transport {
        Transport::Stdio(st) => {
            let found = resolve_program(st.command.as_str(), SAFE_PATH);
            let ok = found.as_ref().is_some_and(|p| {
                std::fs::metadata(p).is_ok_and(|m| {
                    use std::os::unix::fs::PermissionsExt;
                    m.is_file() && m.permissions().mode() & 0o111 != 0
                })
            });
            checks.push(json!({
                "check": "command",
                "ok": ok,
                "detail": if ok { "found and executable".to_owned() } else { format!("{} is not an executable file on the server PATH ({SAFE_PATH})", st.command.as_str()) },
            }));
            for var in &st.env {
                let set = std::env::var_os(var.as_str()).is_some();
                checks.push(json!({
                    "check": format!("env {var}"),
                    "ok": set,
                    "detail": if set { "set (value not shown)" } else { "not set in this environment: the server will not receive it" },
                }));
            }
        }
        Transport::Http(h) => {
            let scheme = h.url.as_url().scheme();
            checks.push(json!({"check": "url", "ok": true, "detail": format!("{scheme} endpoint {}", h.url.origin_display())}));
            let vars = h.header_env.values().map(|v| v.as_str().to_owned()).chain(
                h.oauth
                    .iter()
                    .flat_map(|o| o.access_token_env.iter().map(|v| v.as_str().to_owned())),
            );
            for var in vars {
                let set = std::env::var_os(&var).is_some();
                checks.push(json!({
                    "check": format!("env {var}"),
                    "ok": set,
                    "detail": if set { "set (value not shown)" } else { "not set: connecting will fail" },
                }));
            }
            if h.oauth
                .as_ref()
                .and_then(|o| o.access_token_env.as_ref())
                .is_some()
            {
                checks.push(json!({"check": "credential", "ok": true, "detail": "external (bearer token from the environment)"}));
            } else if let Some(home) = home {
                let cred = CredentialStore::new(home).load(s.name.as_str());
                let (ok, detail) = match &cred {
                    Err(e) => (false, text::single_line_capped(&e.to_string(), 300)),
                    Ok(c) => {
                        let state = crate::auth::state_of(s, c.as_ref());
                        (
                            !matches!(state, "reauth_required" | "expired" | "refresh_failed"),
                            state.to_owned(),
                        )
                    }
                };
                checks.push(json!({"check": "credential", "ok": ok, "detail": detail}));
            }
            if let Some(g) = crate::auth::grant_of(s) {
                checks.push(grant_check(s, g));
            }
        }
    }
    checks
}

/// The `grant` check of `doctor`: how tokens are obtained, and — for the grants Iteron runs
/// without a browser — whether the client's secret, key and identity token can be read now
/// (read locally; nothing is sent).
fn grant_check(s: &ServerConfig, grant: &str) -> Value {
    let dpop = matches!(&s.transport, Transport::Http(h)
        if h.oauth.as_ref().and_then(|o| o.dpop) == Some(true));
    let bound = if dpop { ", DPoP-bound" } else { "" };
    match servers::grant_request(s, &lookup) {
        Ok(Some(req)) => {
            let identity = req.identity.as_ref().map(|i| i.check());
            match identity {
                Some(Err(e)) => json!({"check": "grant", "ok": false,
                    "detail": text::single_line_capped(&format!("{grant}: {e}"), 300)}),
                _ => json!({"check": "grant", "ok": true, "detail": format!(
                    "{grant} ({}; no browser needed){bound}", req.client.auth.as_str())}),
            }
        }
        Ok(None) => json!({"check": "grant", "ok": true, "detail": format!("{grant}{bound}")}),
        Err(e) => json!({"check": "grant", "ok": false,
            "detail": text::single_line_capped(&format!("{grant}: {e}"), 300)}),
    }
}

/// `iteron mcp doctor [--connect]`.
pub(crate) fn doctor(
    home: &Home,
    connect: bool,
    format: Format,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let config = home.load()?;
    let mut servers = Vec::new();
    let rt = if connect {
        Some(crate::rt::multi_thread()?)
    } else {
        None
    };
    let mut all_ok = true;
    // The catalogs listed by --connect, for checking the approval rules against them.
    let mut catalogs = std::collections::BTreeMap::new();
    for s in &config.mcp_servers {
        let mut checks = check_server(s, Some(home));
        if let Some(eff) = confinement_of(s, home, config.ceiling()) {
            checks.push(json!({
                "check": "confinement",
                // Without Landlock the filesystem is open; a child that cannot run as its uid
                // (a run_as it cannot honour, a command it cannot read) would fail to start.
                "ok": eff.landlock_abi.is_some()
                    && eff.identity.is_ok()
                    && !matches!(eff.net, iteron_broker::confine::NetState::Refused(_))
                    && !eff.unreachable.iter().any(|(p, _)| {
                        confinement_command(s).is_some_and(|c| c == *p)
                    }),
                "detail": confinement_line(&eff),
            }));
        }
        if let Some(rt) = &rt {
            let r = rt.block_on(probe_tools(home, &config, s));
            checks.push(match &r {
                Ok((found, _)) => json!({"check": "connect", "ok": true, "detail": format!("protocol {}, {} tools", found["protocol_version"].as_str().unwrap_or("?"), found["tool_count"])}),
                Err(e) => json!({"check": "connect", "ok": false, "detail": e}),
            });
            catalogs.insert(s.name.as_str().to_owned(), r.map(|(_, tools)| tools));
        }
        all_ok &= checks.iter().all(|c| c["ok"] == Value::Bool(true));
        servers.push(
            json!({"name": s.name.as_str(), "transport": s.transport.as_str(), "checks": checks}),
        );
    }
    let network = json!({
        "nameservers": if config.network.nameservers.is_empty() { Value::from("system resolv.conf and hosts file") } else { Value::from(config.network.nameservers.iter().map(|n| n.0.to_string()).collect::<Vec<_>>()) },
        "ca_bundle": match &config.network.ca_bundle {
            None => Value::from("none (built-in web PKI roots only)"),
            Some(p) => match iteron_broker::net::NetConfig::from_operator(&config.network) {
                Ok(_) => Value::from(format!("{} (readable)", p.as_str())),
                Err(e) => { all_ok = false; Value::from(e.to_string()) }
            },
        },
        "proxy_environment": "ignored",
        "tls_environment": "ignored",
    });
    let audit = crate::broker::audit_state(home);
    all_ok &= audit["state"] == "ok";
    // Every approval rule that can never match is a problem, not a silent no-op.
    let approval_rules = crate::rules::report(&config, connect.then_some(&catalogs));
    all_ok &= approval_rules.iter().all(|r| r["ok"] == Value::Bool(true));
    let report = json!({
        "home": home.dir().display().to_string(),
        "config": "valid",
        "permissions": "private (0700 directory, 0600 file)",
        "network": network,
        "audit": audit,
        "servers": servers,
        "approval_rules": approval_rules,
        "ok": all_ok,
    });
    if format == Format::Json {
        print(out, &report)?;
    } else {
        let mut buf = String::new();
        buf.push_str(&format!(
            "home        {}\nconfig      valid, private\n",
            text::single_line(&home.dir().display().to_string())
        ));
        buf.push_str(&format!(
            "nameservers {}\n",
            text::single_line(&report["network"]["nameservers"].to_string())
        ));
        buf.push_str(&format!(
            "ca bundle   {}\n",
            text::single_line(report["network"]["ca_bundle"].as_str().unwrap_or(""))
        ));
        buf.push_str("proxy/TLS environment variables: ignored\n");
        buf.push_str(&format!(
            "audit log   {} {}: {} ({})\n",
            if report["audit"]["state"] == "ok" {
                "ok  "
            } else {
                "FAIL"
            },
            report["audit"]["state"].as_str().unwrap_or(""),
            text::single_line_capped(report["audit"]["detail"].as_str().unwrap_or("-"), 400),
            report["audit"]["source"].as_str().unwrap_or("")
        ));
        for s in &servers {
            buf.push_str(&format!(
                "{} ({})\n",
                s["name"].as_str().unwrap_or(""),
                s["transport"].as_str().unwrap_or("")
            ));
            for c in s["checks"].as_array().into_iter().flatten() {
                let mark = if c["ok"] == Value::Bool(true) {
                    "ok  "
                } else {
                    "FAIL"
                };
                buf.push_str(&format!(
                    "  {mark} {}: {}\n",
                    c["check"].as_str().unwrap_or(""),
                    text::single_line_capped(c["detail"].as_str().unwrap_or(""), 400)
                ));
            }
        }
        if !approval_rules.is_empty() {
            buf.push_str(&format!(
                "approval rules ({})\n",
                if connect {
                    "checked against the servers' catalogs"
                } else {
                    "tools and argument names not checked against the servers: use --connect"
                }
            ));
            for line in crate::rules::report_lines(&approval_rules) {
                buf.push_str(&format!("  {line}\n"));
            }
        }
        out.write_all(buf.as_bytes()).map_err(CliError::Output)?;
    }
    if all_ok {
        Ok(())
    } else {
        Err(CliError::Server("doctor found problems (see above)".into()))
    }
}
