//! `iteron mcp add|list|get|remove`: configuration management with the operator's authority.
//!
//! Nothing here reads the value of an environment variable: servers store variable *names*, and
//! every output (text or JSON) shows names only. Values that came from the command line are
//! validated by the policy newtypes, whose errors never repeat the refused input.

use std::collections::BTreeMap;
use std::io::Write;

use iteron_broker::keyring::{self, KeyringError};
use iteron_broker::store::Home;
use iteron_policy::capability::{CapabilitySet, ServerPolicy, ToolFilter};
use iteron_policy::config::{
    AbsolutePath, AddError, ClientAuth, ClientId, Command, Config, CredentialBackend, Grant,
    HttpServer, OAuthConfig, Registration, Scope, ServerConfig, StdioServer, Transport, ValueError,
    check_arg,
};
use iteron_policy::names::{EnvName, HeaderName, NameError, ServerName};
use iteron_policy::text;
use iteron_policy::url::{EndpointUrl, IdentifierUrl};

use crate::args::{AddArgs, Format, Mcp};
use crate::error::CliError;

/// Run one `iteron mcp …` command against `home`, writing results to `out` and warnings to
/// `warn`.
pub(crate) fn run(
    cmd: Mcp,
    home: &Home,
    out: &mut dyn Write,
    warn: &mut dyn Write,
) -> Result<(), CliError> {
    match cmd {
        Mcp::Add(a) => add(a, home, out, warn),
        Mcp::List(f) => list(home, f.format, out),
        Mcp::Get(g) => get(home, &g.name, g.format, out),
        Mcp::Remove(r) => remove(home, &r.name, out),
        Mcp::Test(t) => crate::probe::test(
            home,
            &t.name,
            std::time::Duration::from_secs(t.timeout.timeout),
            t.format,
            out,
        ),
        Mcp::Status(s) => {
            let bounds = s.connect.then(|| crate::probe::Bounds::from(&s.bounds));
            crate::probe::status(home, s.name.as_deref(), bounds, s.format, out)
        }
        Mcp::Doctor(d) => {
            let bounds = d.connect.then(|| crate::probe::Bounds::from(&d.bounds));
            crate::probe::doctor(home, bounds, d.format, out)
        }
        Mcp::Import(i) => crate::import::run(&i, home, out, warn),
        Mcp::Auth(crate::args::Auth::Login(a)) => crate::auth::login(home, a, out, warn),
        Mcp::Auth(crate::args::Auth::Status(s)) => {
            crate::auth::status(home, &s.name, s.format, out)
        }
        Mcp::Auth(crate::args::Auth::Logout(l)) => crate::auth::logout(home, &l.name, out),
    }
}

fn usage(flag: &str, e: impl std::fmt::Display) -> CliError {
    CliError::Usage(format!("{flag} {e}"))
}

fn server_name(s: &str) -> Result<ServerName, CliError> {
    ServerName::parse(s).map_err(|e| usage("server name", e))
}

fn env_name(flag: &str, s: &str) -> Result<EnvName, CliError> {
    EnvName::parse(s).map_err(|e| match e {
        NameError::ValueGiven => {
            // Only the part before '=' is shown; the rest may be a secret.
            let name = s.split('=').next().unwrap_or_default();
            let shown = if EnvName::parse(name).is_ok() {
                name
            } else {
                "NAME"
            };
            CliError::Usage(format!(
                "{flag} takes a variable name, not NAME=value: write {flag} {shown}; the value is \
                 read from the environment when the server starts and is never stored"
            ))
        }
        other => usage(flag, other),
    })
}

fn optional_env(flag: &str, s: &Option<String>) -> Result<Option<EnvName>, CliError> {
    s.as_deref().map(|v| env_name(flag, v)).transpose()
}

fn url(flag: &str, s: &str) -> Result<EndpointUrl, CliError> {
    EndpointUrl::parse(s).map_err(|e| usage(flag, e))
}

/// An issuer or resource: checked like a URL, kept as written (it is compared as a string).
fn identifier(flag: &str, s: &str) -> Result<IdentifierUrl, CliError> {
    IdentifierUrl::parse(s).map_err(|e| usage(flag, e))
}

fn value<T>(flag: &str, r: Result<T, ValueError>) -> Result<T, CliError> {
    r.map_err(|e| usage(flag, e))
}

/// Flags that belong to the other transport are refused rather than silently ignored.
fn refuse_foreign(a: &AddArgs) -> Result<(), CliError> {
    let stdio_flags = [
        ("--env", !a.env.is_empty()),
        ("arguments after --", !a.args.is_empty()),
        ("--sandbox-readable", !a.sandbox_readable.is_empty()),
        ("--sandbox-writable", !a.sandbox_writable.is_empty()),
        ("--sandbox-run-as", a.sandbox_run_as.is_some()),
        ("--sandbox-network", a.sandbox_network.is_some()),
        ("--sandbox-egress", !a.sandbox_egress.is_empty()),
    ];
    let http_flags = [
        ("--header-env", !a.header_env.is_empty()),
        ("--oauth-resource", a.oauth_resource.is_some()),
        ("--oauth-scopes", a.oauth_scopes.is_some()),
        (
            "--oauth-client-registration",
            a.oauth_client_registration.is_some(),
        ),
        ("--oauth-client-id", a.oauth_client_id.is_some()),
        (
            "--oauth-client-secret-env",
            a.oauth_client_secret_env.is_some(),
        ),
        ("--oauth-issuer", a.oauth_issuer.is_some()),
        (
            "--oauth-credential-store",
            a.oauth_credential_store.is_some(),
        ),
        ("--oauth-grant", a.oauth_grant.is_some()),
        (
            "--oauth-token-endpoint-auth",
            a.oauth_token_endpoint_auth.is_some(),
        ),
        ("--oauth-client-key-file", a.oauth_client_key_file.is_some()),
        ("--oauth-client-key-env", a.oauth_client_key_env.is_some()),
        (
            "--oauth-identity-token-file",
            a.oauth_identity_token_file.is_some(),
        ),
        (
            "--oauth-identity-token-env",
            a.oauth_identity_token_env.is_some(),
        ),
        ("--oauth-dpop", a.oauth_dpop),
        ("--oauth-idp-issuer", a.oauth_idp_issuer.is_some()),
        ("--oauth-idp-client-id", a.oauth_idp_client_id.is_some()),
        (
            "--oauth-idp-client-secret-env",
            a.oauth_idp_client_secret_env.is_some(),
        ),
        (
            "--oauth-access-token-env",
            a.oauth_access_token_env.is_some(),
        ),
        ("--oauth-expires-at-env", a.oauth_expires_at_env.is_some()),
        ("--oauth-refresh-url", a.oauth_refresh_url.is_some()),
        (
            "--oauth-refresh-token-env",
            a.oauth_refresh_token_env.is_some(),
        ),
        ("--oauth-revoke-url", a.oauth_revoke_url.is_some()),
    ];
    let (foreign, kind): (&[(&str, bool)], &str) = if a.url.is_some() {
        (&stdio_flags, "--url")
    } else {
        (&http_flags, "--stdio")
    };
    if let Some((flag, _)) = foreign.iter().find(|(_, set)| *set) {
        return Err(CliError::Usage(format!(
            "{flag} cannot be used with {kind}"
        )));
    }
    Ok(())
}

/// `--oauth-credential-store`: `file` or `keyring`, and `keyring` only when the build has the
/// keyring backend (`keyring_built_in` is [`keyring::BUILT_IN`]): it is never downgraded to the
/// file store.
fn credential_store(word: &str, keyring_built_in: bool) -> Result<CredentialBackend, CliError> {
    let backend = CredentialBackend::parse(word).ok_or_else(|| {
        CliError::Usage("--oauth-credential-store must be file or keyring".into())
    })?;
    if backend == CredentialBackend::Keyring && !keyring_built_in {
        return Err(CliError::Usage(format!(
            "--oauth-credential-store keyring: {}; nothing falls back to the file store",
            KeyringError::NotBuiltIn.reason()
        )));
    }
    Ok(backend)
}

pub(crate) fn build_server(a: &AddArgs) -> Result<ServerConfig, CliError> {
    refuse_foreign(a)?;
    let name = server_name(&a.name)?;
    let transport = if let Some(u) = &a.url {
        let mut header_env = BTreeMap::new();
        for pair in &a.header_env {
            let Some((h, e)) = pair.split_once('=') else {
                return Err(CliError::Usage(
                    "--header-env takes HEADER=ENV_NAME (the variable's name, not its value)"
                        .into(),
                ));
            };
            let header = HeaderName::parse(h).map_err(|e| usage("--header-env header", e))?;
            let env = EnvName::parse(e).map_err(|_| {
                CliError::Usage(
                    "--header-env takes HEADER=ENV_NAME, and ENV_NAME must be an environment \
                     variable name ([A-Za-z_][A-Za-z0-9_]*), never the header's value"
                        .into(),
                )
            })?;
            if header_env.insert(header, env).is_some() {
                return Err(CliError::Usage("--header-env names a header twice".into()));
            }
        }
        let mut oauth = OAuthConfig {
            resource: a
                .oauth_resource
                .as_deref()
                .map(|s| identifier("--oauth-resource", s))
                .transpose()?,
            issuer: a
                .oauth_issuer
                .as_deref()
                .map(|s| identifier("--oauth-issuer", s))
                .transpose()?,
            client_id: a
                .oauth_client_id
                .as_deref()
                .map(|s| value("--oauth-client-id", ClientId::parse(s)))
                .transpose()?,
            client_secret_env: a
                .oauth_client_secret_env
                .as_deref()
                .map(|s| env_name("--oauth-client-secret-env", s))
                .transpose()?,
            grant: a
                .oauth_grant
                .as_deref()
                .map(|g| {
                    Grant::parse(g).ok_or_else(|| {
                        CliError::Usage(
                            "--oauth-grant must be authorization_code, client_credentials, \
                             jwt_bearer or id_jag"
                                .into(),
                        )
                    })
                })
                .transpose()?,
            token_endpoint_auth: a
                .oauth_token_endpoint_auth
                .as_deref()
                .map(|m| {
                    ClientAuth::parse(m).ok_or_else(|| {
                        CliError::Usage(
                            "--oauth-token-endpoint-auth must be client_secret_basic, \
                             client_secret_post or private_key_jwt"
                                .into(),
                        )
                    })
                })
                .transpose()?,
            client_key_file: a
                .oauth_client_key_file
                .as_deref()
                .map(|p| value("--oauth-client-key-file", AbsolutePath::parse(p)))
                .transpose()?,
            client_key_env: optional_env("--oauth-client-key-env", &a.oauth_client_key_env)?,
            identity_token_file: a
                .oauth_identity_token_file
                .as_deref()
                .map(|p| value("--oauth-identity-token-file", AbsolutePath::parse(p)))
                .transpose()?,
            identity_token_env: optional_env(
                "--oauth-identity-token-env",
                &a.oauth_identity_token_env,
            )?,
            dpop: a.oauth_dpop.then_some(true),
            idp_issuer: a
                .oauth_idp_issuer
                .as_deref()
                .map(|s| identifier("--oauth-idp-issuer", s))
                .transpose()?,
            idp_client_id: a
                .oauth_idp_client_id
                .as_deref()
                .map(|s| value("--oauth-idp-client-id", ClientId::parse(s)))
                .transpose()?,
            idp_client_secret_env: optional_env(
                "--oauth-idp-client-secret-env",
                &a.oauth_idp_client_secret_env,
            )?,
            access_token_env: optional_env("--oauth-access-token-env", &a.oauth_access_token_env)?,
            expires_at_env: optional_env("--oauth-expires-at-env", &a.oauth_expires_at_env)?,
            refresh_url: a
                .oauth_refresh_url
                .as_deref()
                .map(|u| url("--oauth-refresh-url", u))
                .transpose()?,
            refresh_token_env: optional_env(
                "--oauth-refresh-token-env",
                &a.oauth_refresh_token_env,
            )?,
            revoke_url: a
                .oauth_revoke_url
                .as_deref()
                .map(|u| url("--oauth-revoke-url", u))
                .transpose()?,
            ..OAuthConfig::default()
        };
        if let Some(reg) = &a.oauth_client_registration {
            oauth.client_registration = Some(Registration::parse(reg).ok_or_else(|| {
                CliError::Usage("--oauth-client-registration must be auto, cimd or dcr".into())
            })?);
        }
        if let Some(store) = &a.oauth_credential_store {
            oauth.credential_store = Some(credential_store(store, keyring::BUILT_IN)?);
        }
        if let Some(scopes) = &a.oauth_scopes {
            for s in scopes.split(',') {
                let scope = value("--oauth-scopes entry", Scope::parse(s))?;
                if oauth.scopes.contains(&scope) {
                    return Err(CliError::Usage("--oauth-scopes lists a scope twice".into()));
                }
                oauth.scopes.push(scope);
            }
        }
        Transport::Http(HttpServer {
            url: url("--url", u)?,
            header_env,
            oauth: (oauth != OAuthConfig::default()).then_some(oauth),
        })
    } else {
        let cmd = a.stdio.as_deref().unwrap_or_default();
        let command = value("--stdio", Command::parse(cmd))?;
        let mut env: Vec<EnvName> = Vec::new();
        for raw in &a.env {
            let n = env_name("--env", raw)?;
            if env.contains(&n) {
                return Err(CliError::Usage(format!("--env names {n} twice")));
            }
            env.push(n);
        }
        for (i, arg) in a.args.iter().enumerate() {
            check_arg(arg).map_err(|e| usage(&format!("argument {} after --", i + 1), e))?;
        }
        let paths = |flag: &str, raw: &[String]| -> Result<Vec<AbsolutePath>, CliError> {
            let mut out: Vec<AbsolutePath> = Vec::new();
            for r in raw {
                let p = value(flag, AbsolutePath::parse(r))?;
                if !out.contains(&p) {
                    out.push(p);
                }
            }
            if out.len() > iteron_policy::config::MAX_SANDBOX_PATHS {
                return Err(CliError::Usage(format!(
                    "{flag} may be given at most {} times",
                    iteron_policy::config::MAX_SANDBOX_PATHS
                )));
            }
            Ok(out)
        };
        Transport::Stdio(StdioServer {
            command,
            args: a.args.clone(),
            env,
            sandbox: iteron_policy::config::Sandbox {
                readable: paths("--sandbox-readable", &a.sandbox_readable)?,
                writable: paths("--sandbox-writable", &a.sandbox_writable)?,
                run_as: a
                    .sandbox_run_as
                    .as_deref()
                    .map(|r| value("--sandbox-run-as", iteron_policy::config::RunAs::parse(r)))
                    .transpose()?,
                network: a
                    .sandbox_network
                    .as_deref()
                    .map(|r| {
                        value(
                            "--sandbox-network",
                            iteron_policy::config::SandboxNetwork::parse(r),
                        )
                    })
                    .transpose()?,
                egress: {
                    let mut out = Vec::new();
                    for r in &a.sandbox_egress {
                        let rule = value(
                            "--sandbox-egress",
                            iteron_policy::egress::EgressRule::parse(r)
                                .map_err(iteron_policy::config::ValueError::Egress),
                        )?;
                        if !out.contains(&rule) {
                            out.push(rule);
                        }
                    }
                    out
                },
                ..Default::default()
            },
        })
    };
    Ok(ServerConfig {
        name,
        transport,
        tools: ToolFilter::default(),
        policy: ServerPolicy::default(),
    })
}

/// Check the new entry against every configuration rule (bounds included) *before* taking the
/// lock or creating anything, by reading it back through the same strict decoder the file uses.
pub(crate) fn check_entry(server: &ServerConfig) -> Result<(), CliError> {
    let probe = Config {
        mcp_servers: vec![server.clone()],
        ..Config::default()
    };
    Config::parse(probe.to_json_pretty().as_bytes())
        .map(|_| ())
        .map_err(|e| {
            let path = e.path.to_string();
            let field = path.strip_prefix("$.mcp_servers[0].").unwrap_or("server");
            CliError::Usage(format!("{field} {}", e.kind))
        })
}

/// Where a stored value looks like a credential, say so: it is stored as typed (the operator's
/// own 0600 file) and redacted from every listing, but secrets belong in the environment.
pub(crate) fn warn_credentials(
    server: &ServerConfig,
    warn: &mut dyn Write,
) -> Result<(), CliError> {
    let view = server_json(server);
    let raw = serde_json::to_value(server).unwrap_or(serde_json::Value::Null);
    if view != raw {
        writeln!(
            warn,
            "iteron: warning: a URL or argument of {} looks like a credential; it is stored as \
             typed and redacted from listings. Pass secrets as environment variables instead \
             (--env NAME, --header-env HEADER=NAME)",
            server.name
        )
        .map_err(CliError::Output)?;
    }
    Ok(())
}

fn add(a: AddArgs, home: &Home, out: &mut dyn Write, warn: &mut dyn Write) -> Result<(), CliError> {
    let server = build_server(&a)?;
    check_entry(&server)?;
    warn_credentials(&server, warn)?;
    let kind = server.transport.as_str();
    let name = server.name.clone();
    home.update(|config: &mut Config| {
        config.add_server(server).map_err(|e| match e {
            AddError::Exists(existing) => CliError::Conflict(format!(
                "an MCP server named {existing} already exists (names are compared \
                 case-insensitively); remove it first with: iteron mcp remove {existing}"
            )),
            AddError::Full => CliError::Conflict(e.to_string()),
        })
    })?;
    writeln!(out, "added {kind} MCP server {name}").map_err(CliError::Output)
}

fn remove(home: &Home, raw: &str, out: &mut dyn Write) -> Result<(), CliError> {
    let name = server_name(raw)?;
    home.update(|config: &mut Config| {
        config
            .remove_server(name.as_str())
            .map(|_| ())
            .ok_or(CliError::NotFound)
    })?;
    writeln!(out, "removed MCP server {name}").map_err(CliError::Output)
}

/// Stdio arguments as shown: each through credential redaction, and a value that follows a flag
/// whose name marks a credential (`--api-key VALUE`) is hidden too.
fn shown_args(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    for (i, arg) in args.iter().enumerate() {
        let after_flag = i
            .checked_sub(1)
            .and_then(|p| args.get(p))
            .filter(|prev| prev.starts_with('-') && !prev.contains('=') && !arg.starts_with('-'));
        let hidden = after_flag.is_some_and(|flag| {
            let pair = format!("{}={arg}", flag.trim_start_matches('-'));
            text::redact(&pair) != pair
        });
        out.push(if hidden {
            "[REDACTED]".to_owned()
        } else {
            text::redact(arg).into_owned()
        });
    }
    out
}

fn redact_strings(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::String(s) => {
            if let std::borrow::Cow::Owned(r) = text::redact(s) {
                *s = r;
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(redact_strings),
        serde_json::Value::Object(map) => map.values_mut().for_each(redact_strings),
        _ => {}
    }
}

/// The JSON view of a server: the configuration object with every string passed through
/// credential redaction (and stdio arguments through [`shown_args`]), so a secret pasted into a
/// URL or an argument is not spread further by listings.
fn server_json(s: &ServerConfig) -> serde_json::Value {
    // Serializing a ServerConfig cannot fail (string keys, no floats); Null would only show up
    // if that changed, and then nothing secret is printed either.
    let mut v = serde_json::to_value(s).unwrap_or(serde_json::Value::Null);
    redact_strings(&mut v);
    if let (Some(args), Transport::Stdio(st)) = (v.get_mut("args"), &s.transport) {
        *args = serde_json::Value::from(shown_args(&st.args));
    }
    v
}

fn print_json(out: &mut dyn Write, v: &serde_json::Value) -> Result<(), CliError> {
    crate::output::json(out, v)
}

fn target(s: &ServerConfig) -> String {
    match &s.transport {
        Transport::Stdio(st) => {
            let mut t = st.command.as_str().to_owned();
            for a in shown_args(&st.args) {
                t.push(' ');
                t.push_str(&a);
            }
            t
        }
        Transport::Http(h) => h.url.as_str().to_owned(),
    }
}

fn list(home: &Home, format: Format, out: &mut dyn Write) -> Result<(), CliError> {
    let config = home.load()?;
    if format == Format::Json {
        let servers: Vec<_> = config.mcp_servers.iter().map(server_json).collect();
        let doc = serde_json::json!({
            "schema_version": iteron_policy::config::SCHEMA_VERSION,
            "servers": servers,
        });
        return print_json(out, &doc);
    }
    if config.mcp_servers.is_empty() {
        return writeln!(
            out,
            "No MCP servers configured. Add one with: iteron mcp add <name> --stdio <command>"
        )
        .map_err(CliError::Output);
    }
    let width = config
        .mcp_servers
        .iter()
        .map(|s| s.name.as_str().len())
        .max()
        .unwrap_or(4)
        .max(4);
    let mut buf = String::new();
    buf.push_str(&format!("{:width$}  {:9}  TARGET\n", "NAME", "TRANSPORT"));
    for s in &config.mcp_servers {
        buf.push_str(&format!(
            "{:width$}  {:9}  {}\n",
            s.name.as_str(),
            s.transport.as_str(),
            text::single_line_capped(&target(s), 160)
        ));
    }
    out.write_all(buf.as_bytes()).map_err(CliError::Output)
}

fn get(home: &Home, raw: &str, format: Format, out: &mut dyn Write) -> Result<(), CliError> {
    let name = server_name(raw)?;
    let config = home.load()?;
    let server = config.server(name.as_str()).ok_or(CliError::NotFound)?;
    let confinement = crate::probe::confinement_of(server, home, config.ceiling());
    if format == Format::Json {
        let mut v = server_json(server);
        if let (Some(e), Some(obj)) = (&confinement, v.as_object_mut()) {
            obj.insert("confinement".into(), e.to_json());
        }
        return print_json(out, &v);
    }
    let mut lines: Vec<(String, String)> = vec![
        ("name".into(), server.name.to_string()),
        ("transport".into(), server.transport.as_str().into()),
    ];
    let names = |v: &[EnvName]| v.iter().map(EnvName::as_str).collect::<Vec<_>>().join(", ");
    match &server.transport {
        Transport::Stdio(st) => {
            lines.push(("command".into(), st.command.as_str().into()));
            if !st.args.is_empty() {
                let shown: Vec<String> = shown_args(&st.args)
                    .iter()
                    .map(|a| text::single_line_capped(a, 200))
                    .collect();
                lines.push(("args".into(), shown.join(" ")));
            }
            if !st.env.is_empty() {
                lines.push(("env (names only)".into(), names(&st.env)));
            }
            if let Some(e) = &confinement {
                lines.push(("confinement".into(), crate::probe::confinement_line(e)));
                lines.push(("runs as".into(), e.runs_as()));
                let list = |v: &[std::path::PathBuf]| {
                    v.iter()
                        .map(|p| text::single_line_capped(&p.to_string_lossy(), 200))
                        .collect::<Vec<_>>()
                        .join(" ")
                };
                if !e.writable.is_empty() {
                    lines.push(("writable".into(), list(&e.writable)));
                }
                for (p, why) in &e.dropped {
                    lines.push((
                        "grant dropped".into(),
                        format!(
                            "{}: {why}",
                            text::single_line_capped(&p.to_string_lossy(), 200)
                        ),
                    ));
                }
                for (p, why) in &e.unreachable {
                    lines.push((
                        "unreachable".into(),
                        format!(
                            "{}: {why}",
                            text::single_line_capped(&p.to_string_lossy(), 200)
                        ),
                    ));
                }
            }
        }
        Transport::Http(h) => {
            lines.push(("url".into(), h.url.as_str().into()));
            for (header, env) in &h.header_env {
                lines.push((format!("header {header}"), format!("from ${env}")));
            }
            if let Some(o) = &h.oauth {
                // Cannot fail (see server_json); Null would print nothing.
                let v = serde_json::to_value(o).unwrap_or(serde_json::Value::Null);
                if let serde_json::Value::Object(map) = v {
                    for (k, val) in map {
                        let shown = match val {
                            serde_json::Value::String(s) => s,
                            serde_json::Value::Array(items) => items
                                .iter()
                                .filter_map(|i| i.as_str().map(str::to_owned))
                                .collect::<Vec<_>>()
                                .join(","),
                            other => other.to_string(),
                        };
                        lines.push((format!("oauth.{k}"), shown));
                    }
                }
            }
        }
    }
    if !server.tools.allow.is_empty() {
        lines.push(("tools.allow".into(), join_names(&server.tools.allow)));
    }
    if !server.tools.deny.is_empty() {
        lines.push(("tools.deny".into(), join_names(&server.tools.deny)));
    }
    let ceiling = config.ceiling();
    let bound = server
        .policy
        .capabilities
        .map_or(ceiling, |c| c.intersect(ceiling));
    lines.push(("host ceiling".into(), ceiling.to_string()));
    if let Some(c) = server.policy.capabilities {
        lines.push(("policy.capabilities".into(), c.to_string()));
    }
    for (tool, set) in &server.policy.tools {
        lines.push((format!("policy.tools.{tool}"), set.to_string()));
    }
    lines.push(("admitted for its tools".into(), bound.to_string()));
    let exposed = CapabilitySet::MCP_TOOL.is_subset(bound);
    lines.push((
        "tool exposure".into(),
        if exposed {
            "MCP tools carry irreversible_external: exposed, every call needs approval".into()
        } else {
            "MCP tools carry irreversible_external, which is not admitted: no tool is exposed"
                .into()
        },
    ));
    let width = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut buf = String::new();
    for (k, v) in lines {
        buf.push_str(&format!(
            "{k:width$}  {}\n",
            text::single_line_capped(&v, 400)
        ));
    }
    out.write_all(buf.as_bytes()).map_err(CliError::Output)
}

fn join_names(v: &[iteron_policy::names::ToolName]) -> String {
    v.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Exit;

    #[test]
    fn a_keyring_store_is_refused_by_a_build_without_the_keyring_never_downgraded() {
        let e = credential_store("keyring", false).unwrap_err();
        assert_eq!(e.exit(), Exit::Usage);
        let line = e.line();
        assert!(
            line.contains("--oauth-credential-store keyring")
                && line.contains("built without the keyring backend")
                && line.contains("nothing falls back to the file store")
                && !line.contains('\n'),
            "{line}"
        );
        assert_eq!(
            credential_store("keyring", true).unwrap(),
            CredentialBackend::Keyring
        );
        for built_in in [false, true] {
            assert_eq!(
                credential_store("file", built_in).unwrap(),
                CredentialBackend::File
            );
            assert!(credential_store("auto", built_in).is_err());
        }
        // This build's own answer follows its feature.
        assert_eq!(
            credential_store("keyring", keyring::BUILT_IN).is_ok(),
            cfg!(feature = "keyring")
        );
    }
}
