//! `iteron mcp doctor`: every server's configuration, confinement, credentials and approval
//! rules checked, without acting (and with `--connect`, a bounded probe of each).

use super::*;

/// Static checks of one server (no network, no process).
pub(super) fn check_server(s: &ServerConfig, home: Option<&Home>, vars: &Vars) -> Vec<Value> {
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
                let set = vars.source(var.as_str());
                checks.push(json!({
                    "check": format!("env {var}"),
                    "ok": set.is_some(),
                    "detail": set.unwrap_or("not set in this environment: the server will not receive it"),
                }));
            }
        }
        Transport::Http(h) => {
            let scheme = h.url.as_url().scheme();
            checks.push(json!({"check": "url", "ok": true, "detail": format!("{scheme} endpoint {}", h.url.origin_display())}));
            let names = h.header_env.values().map(|v| v.as_str().to_owned()).chain(
                h.oauth
                    .iter()
                    .flat_map(|o| o.access_token_env.iter().map(|v| v.as_str().to_owned())),
            );
            for var in names {
                let set = vars.source(&var);
                checks.push(json!({
                    "check": format!("env {var}"),
                    "ok": set.is_some(),
                    "detail": set.unwrap_or("not set: connecting will fail"),
                }));
            }
            if let Some(var) = crate::auth::external_bearer(h) {
                checks.push(json!({"check": "credential", "ok": true, "detail": format!("external (bearer token from ${var})")}));
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
                checks.push(grant_check(s, g, vars));
            }
        }
    }
    checks
}

/// The `grant` check of `doctor`: how tokens are obtained, and — for the grants Iteron runs
/// without a browser — whether the client's secret, key and identity token can be read now
/// (read locally; nothing is sent).
pub(super) fn grant_check(s: &ServerConfig, grant: &str, vars: &Vars) -> Value {
    let lookup = |k: &str| vars.get(k);
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
    connect: Option<Bounds>,
    format: Format,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let config = home.load()?;
    let mut servers = Vec::new();
    let mut all_ok = true;
    // The credentials directory the broker would read; one it would refuse is a failed check
    // (and the rest is checked without it).
    let (vars, credentials_directory) = match Vars::load() {
        Ok(v) => {
            let shown = match &v.unit {
                None => json!({"ok": true, "detail": "not set ($CREDENTIALS_DIRECTORY)"}),
                Some(u) => json!({
                    "ok": true,
                    "detail": text::single_line_capped(&format!(
                        "{}: supplies {}",
                        u.dir().display(),
                        u.names().collect::<Vec<_>>().join(", ")
                    ), 400),
                }),
            };
            (v, shown)
        }
        Err(e) => {
            all_ok = false;
            (
                Vars { unit: None },
                json!({"ok": false, "detail": text::single_line_capped(&e.to_string(), 400)}),
            )
        }
    };
    for s in &config.mcp_servers {
        let mut checks = check_server(s, Some(home), &vars);
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
    let audit = crate::views::audit_state(home);
    all_ok &= audit["state"] == "ok";
    // Every approval rule that can never match is a problem, not a silent no-op.
    let mut approval_rules = crate::rules::report(&config, None);
    all_ok &= approval_rules.iter().all(|r| r["ok"] == Value::Bool(true));
    // Every configured hook command, as the broker would run it.
    let problems = iteron_broker::start::hook_runner(home, &config).problems();
    let mut hooks = Vec::new();
    for (event, commands) in &config.hooks {
        for cmd in commands {
            let shown = text::single_line_capped(cmd.as_str(), 200);
            let problem = problems
                .iter()
                .find(|p| p.event == *event && p.command == shown);
            all_ok &= problem.is_none();
            hooks.push(json!({
                "event": event.as_str(),
                "command": shown,
                "ok": problem.is_none(),
                "detail": problem.map_or_else(|| "found and executable".to_owned(), |p| p.why.clone()),
            }));
        }
    }
    let report = json!({
        "home": home.dir().display().to_string(),
        "config": "valid",
        "permissions": "private (0700 directory, 0600 file)",
        "network": network,
        "audit": audit,
        "credentials_directory": credentials_directory,
        "hooks": hooks,
        "servers": servers,
        "approval_rules": approval_rules,
        "ok": all_ok,
    });
    if format == Format::Text {
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
        buf.push_str(&format!(
            "credentials {} {}\n",
            if report["credentials_directory"]["ok"] == Value::Bool(true) {
                "ok  "
            } else {
                "FAIL"
            },
            report["credentials_directory"]["detail"]
                .as_str()
                .unwrap_or("")
        ));
        for h in &hooks {
            buf.push_str(&format!(
                "hook        {} {} {}: {}\n",
                if h["ok"] == Value::Bool(true) {
                    "ok  "
                } else {
                    "FAIL"
                },
                h["event"].as_str().unwrap_or(""),
                h["command"].as_str().unwrap_or(""),
                h["detail"].as_str().unwrap_or("")
            ));
        }
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
        // With --connect the rules are shown once the catalogs are in (below).
        if !approval_rules.is_empty() && connect.is_none() {
            buf.push_str(&rules_text(&approval_rules, false));
        }
        out.write_all(buf.as_bytes()).map_err(CliError::Output)?;
        out.flush().map_err(CliError::Output)?;
    }
    let mut report = report;
    if let Some(bounds) = connect {
        // Every server at once (bounded); in text, each result as it ends.
        let chosen: Vec<&ServerConfig> = config.mcp_servers.iter().collect();
        let check = |r: &Result<Value, String>| match r {
            Ok(found) => {
                json!({"check": "connect", "ok": true, "detail": format!("protocol {}, {} tools", found["protocol_version"].as_str().unwrap_or("?"), found["tool_count"])})
            }
            Err(e) => json!({"check": "connect", "ok": false, "detail": e}),
        };
        let results = probe_all(home, &config, &chosen, Arc::new(vars), bounds, |i, r| {
            let (Format::Text, Some(s)) = (format, chosen.get(i)) else {
                return Ok(());
            };
            let c = check(r);
            writeln!(
                out,
                "connect     {} {}: {}",
                if c["ok"] == Value::Bool(true) {
                    "ok  "
                } else {
                    "FAIL"
                },
                s.name,
                text::single_line_capped(c["detail"].as_str().unwrap_or(""), 400)
            )
            .map_err(CliError::Output)?;
            out.flush().map_err(CliError::Output)
        })?;
        // The catalogs listed, for checking the approval rules against them.
        let mut catalogs = std::collections::BTreeMap::new();
        for (i, r) in results.into_iter().enumerate() {
            let c = check(&summary(&r));
            all_ok &= c["ok"] == Value::Bool(true);
            if let Some(checks) = report["servers"][i]["checks"].as_array_mut() {
                checks.push(c);
            }
            if let Some(s) = chosen.get(i) {
                catalogs.insert(s.name.as_str().to_owned(), r.map(|(_, tools)| tools));
            }
        }
        approval_rules = crate::rules::report(&config, Some(&catalogs));
        all_ok &= approval_rules.iter().all(|r| r["ok"] == Value::Bool(true));
        if format == Format::Text && !approval_rules.is_empty() {
            out.write_all(rules_text(&approval_rules, true).as_bytes())
                .map_err(CliError::Output)?;
        }
        report["approval_rules"] = Value::from(approval_rules);
        report["ok"] = Value::Bool(all_ok);
    }
    if format == Format::Json {
        print(out, &report)?;
    }
    if all_ok {
        Ok(())
    } else {
        Err(CliError::Server("doctor found problems (see above)".into()))
    }
}

/// The approval-rules section of doctor's text report.
pub(super) fn rules_text(rows: &[Value], checked: bool) -> String {
    let mut buf = format!(
        "approval rules ({})\n",
        if checked {
            "checked against the servers' catalogs"
        } else {
            "tools and argument names not checked against the servers: use --connect"
        }
    );
    for line in crate::rules::report_lines(rows) {
        buf.push_str(&format!("  {line}\n"));
    }
    buf
}
