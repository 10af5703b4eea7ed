//! `iteron mcp auth login|status|logout`: the operator's OAuth credentials for HTTP servers.
//!
//! Tokens go from the token endpoint into the 0600 credential file and nowhere else: no output,
//! no error text, no JSON ever contains one. `status` shows the binding (issuer, resource, zone,
//! scopes, expiry) and one of `logged_in | logged_out | expired | refresh_failed |
//! reauth_required | keyring_unavailable | external`.
//!
//! Everything printed that a server or an authorization server chose (the authorization URL,
//! issuer, scopes, client id, resource, error text) goes through [`iteron_policy::text`]: text
//! lines are escaped ([`text::escape_capped`], [`text::single_line_capped`]), JSON output has
//! every unsafe character written as a `\u` escape ([`text::json_terminal_safe`]). The
//! authorization URL reaches the desktop's opener only inside a private page file
//! ([`login::OpenerPage`]), never as an argument another user could read.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use iteron_broker::credentials::{
    Binding, Credential, CredentialStore, Secrets, check_binding, config_digest,
};
use iteron_broker::ipc::proto::{OperatorRequest, ServerArg};
use iteron_broker::net::endpoint_zone;
use iteron_broker::net::{Net, NetConfig};
use iteron_broker::oauth::flow::{self, ClientSettings, Mode};
use iteron_broker::oauth::login::{self, LoginRequest};
use iteron_broker::oauth::{SecretString, metadata};
use iteron_broker::store::Home;
use iteron_policy::config::{CredentialBackend, Registration, ServerConfig, Transport};
use iteron_policy::names::EnvName;
use iteron_policy::text;
use serde_json::json;

use crate::args::{Format, LoginArgs};
use crate::error::CliError;

mod logout;
pub(crate) use logout::logout;
use logout::revoke_tokens;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn http_server<'a>(
    config: &'a iteron_policy::config::Config,
    raw: &str,
) -> Result<&'a ServerConfig, CliError> {
    iteron_policy::names::ServerName::parse(raw)
        .map_err(|e| CliError::Usage(format!("server name {e}")))?;
    let server = config.server(raw).ok_or(CliError::NotFound)?;
    if !matches!(server.transport, Transport::Http(_)) {
        return Err(CliError::Usage(
            "OAuth applies to HTTP servers; this one uses stdio".into(),
        ));
    }
    Ok(server)
}

fn fail(e: impl std::fmt::Display) -> CliError {
    CliError::Server(text::single_line_capped(&e.to_string(), 400))
}

/// Longest authorization URL shown (escaped); built from validated parts, it is far shorter.
const MAX_SHOWN_URL: usize = 32 * 1024;

/// A remote value on a text line: escaped, redacted, bounded.
fn shown(s: &str, max: usize) -> String {
    text::single_line_capped(s, max)
}

/// `iteron mcp auth login <name>`.
pub(crate) fn login(
    home: &Home,
    a: LoginArgs,
    out: &mut dyn Write,
    warn: &mut dyn Write,
) -> Result<(), CliError> {
    let config = home.load()?;
    let server = http_server(&config, &a.name)?;
    let Transport::Http(h) = &server.transport else {
        return Err(CliError::Usage("not an HTTP server".into()));
    };
    let oauth = h.oauth.clone().unwrap_or_default();
    let mode = match a
        .oauth_client_registration
        .as_deref()
        .map(Registration::parse)
        .unwrap_or(oauth.client_registration)
    {
        None if a.oauth_client_registration.is_some() => {
            return Err(CliError::Usage(
                "--oauth-client-registration must be auto, cimd or dcr".into(),
            ));
        }
        None | Some(Registration::Auto) => Mode::Auto,
        Some(Registration::Cimd) => Mode::Cimd,
        Some(Registration::Dcr) => Mode::Dcr,
    };
    let secret_env = match &a.client_secret_env {
        Some(n) => Some(
            EnvName::parse(n).map_err(|e| CliError::Usage(format!("--client-secret-env {e}")))?,
        ),
        None => oauth.client_secret_env.clone(),
    };
    // Variables are read as the broker reads them: a `$CREDENTIALS_DIRECTORY` credential
    // first, then the environment.
    let vars = crate::probe::Vars::load()?;
    let lookup = |n: &str| vars.get(n);
    let client_secret = match &secret_env {
        Some(name) => Some(SecretString::from(
            lookup(name.as_str())
                .and_then(|v| v.into_string().ok())
                .ok_or_else(|| {
                    CliError::Usage(format!(
                        "variable {name} (the client secret) is not set, in the environment or $CREDENTIALS_DIRECTORY"
                    ))
                })?,
        )),
        None => None,
    };
    let client_id = a
        .client_id
        .clone()
        .or_else(|| oauth.client_id.as_ref().map(|c| c.as_str().to_owned()));
    let cimd_url = client_id.clone().filter(|c| c.contains("://"));
    if let Some(scopes) = &a.scopes {
        for t in scopes.split([',', ' ']).filter(|t| !t.is_empty()) {
            iteron_policy::config::Scope::parse(t)
                .map_err(|e| CliError::Usage(format!("--scopes entry {e}")))?;
        }
    }
    let zone = endpoint_zone(&h.url).map_err(fail)?;
    let store = CredentialStore::new(home);
    let backend = oauth.credential_store.unwrap_or(CredentialBackend::File);
    if backend == CredentialBackend::Keyring {
        // Before any authorization request: a code redeemed into an unusable keyring would be
        // lost, and nothing falls back to a file.
        store.probe_keyring(server.name.as_str()).map_err(fail)?;
    }
    if let Some(grant) = iteron_broker::servers::grant_request(server, &lookup).map_err(fail)? {
        return login_noninteractive(home, &config, server, grant, &a, zone, out);
    }
    let previous = store
        .load(server.name.as_str())
        .ok()
        .flatten()
        .filter(|c| check_binding(&c.binding, server).is_ok());
    let req = LoginRequest {
        server: h.url.clone(),
        resource: a
            .oauth_resource
            .clone()
            .or_else(|| oauth.resource.as_ref().map(|r| r.as_str().to_owned())),
        issuer: a
            .oauth_issuer
            .clone()
            .or_else(|| oauth.issuer.as_ref().map(|i| i.as_str().to_owned())),
        operator_scopes: a.scopes.clone(),
        configured_scopes: (!oauth.scopes.is_empty()).then(|| {
            oauth
                .scopes
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        }),
        previous_scopes: previous
            .as_ref()
            .map(|c| c.binding.granted_scopes.clone())
            .unwrap_or_default(),
        previous: previous.as_ref().map(|c| login::Previous {
            resource: c.binding.resource.clone(),
            issuer: c.binding.issuer.clone(),
        }),
        mode,
        dpop: oauth.dpop == Some(true),
        client: ClientSettings {
            client_id: client_id.filter(|c| !c.contains("://")),
            client_secret,
            client_key: iteron_broker::servers::client_key(&oauth, &lookup).map_err(fail)?,
            cimd_url,
            client_name: "Iteron".into(),
        },
    };
    let no_browser = a.no_browser;
    // Pages handed to the opener live until the login ends (then they are removed).
    let pages: std::sync::Mutex<Vec<login::OpenerPage>> = std::sync::Mutex::new(Vec::new());
    let rt = crate::rt::multi_thread()?;
    let outcome = rt.block_on(async {
        let net = Net::new(NetConfig::from_operator(&config.network).map_err(fail)?).map_err(fail)?;
        let http = net.client(zone).map_err(fail)?;
        // Learn the challenge with one unauthenticated request (a 401 names the metadata).
        let challenge = probe_challenge(&http, &h.url).await;
        let result = login::login(&http, zone, &req, challenge.as_ref(), |url, may_open| {
            let mut stdout = std::io::stdout();
            // Not redacted (the operator needs all of it), but escaped.
            let _ = writeln!(
                stdout,
                "Open this URL to authorize iteron for {}:\n{}",
                server.name,
                text::escape_capped(url, MAX_SHOWN_URL)
            );
            if !may_open {
                let _ = writeln!(
                    stdout,
                    "(not opened automatically: it leads to a more privileged network zone than the server)"
                );
            } else if !no_browser {
                match login::OpenerPage::write(home.dir(), url) {
                    Ok(page) => {
                        open_browser(page.path());
                        if let Ok(mut p) = pages.lock() {
                            p.push(page);
                        }
                    }
                    Err(_) => {
                        let _ = writeln!(
                            stdout,
                            "(not opened automatically: the page for the browser could not be written)"
                        );
                    }
                }
            }
            let _ = stdout.flush();
        })
        .await
        .map_err(fail)?;
        Ok::<_, CliError>(result)
    });
    drop(pages);
    let outcome = outcome?;
    let granted: Vec<String> = outcome
        .tokens
        .scope
        .clone()
        .or(outcome.requested.clone())
        .unwrap_or_default()
        .split(' ')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    let binding = Binding {
        server: server.name.to_string(),
        resource: outcome.resource.clone(),
        issuer: outcome.server.issuer.clone(),
        zone,
        client_id: outcome.client.id.clone(),
        client_kind: outcome.client.kind,
        token_auth: outcome.client.auth,
        requested_scopes: outcome
            .requested
            .clone()
            .unwrap_or_default()
            .split(' ')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        granted_scopes: granted.clone(),
        config_digest: config_digest(server),
        secret_store: backend,
    };
    let expires_at = outcome.tokens.expires_at(now());
    let secrets = Secrets {
        access_token: outcome.tokens.access,
        refresh_token: outcome.tokens.refresh,
        client_secret: outcome.client.secret.clone(),
        expires_at,
        refresh_failed: false,
        dpop_key: outcome.client.dpop.as_ref().map(|k| k.stored()),
    };
    let cred = Credential { binding, secrets };
    let saved = store.save(&cred);
    if let Ok(Some(reason)) = &saved {
        writeln!(
            warn,
            "iteron: warning: the previous login's secrets could not be removed from the keyring ({}); \
             remove the entry of service iteron-mcp-credentials, account {}, with the keyring's own tools",
            reason.reason(),
            store.keyring_account(server.name.as_str())
        )
        .map_err(CliError::Output)?;
    }
    if let Err(e) = saved {
        // The tokens exist at the authorization server but could not be kept: revoke them
        // rather than leave a live grant nobody holds.
        let revoked = rt.block_on(async {
            let net =
                Net::new(NetConfig::from_operator(&config.network).map_err(|e| e.to_string())?)
                    .map_err(|e| e.to_string())?;
            let http = net.client(zone).map_err(|e| e.to_string())?;
            revoke_tokens(&http, &outcome.server, &outcome.client, &cred.secrets).await
        });
        let what = match revoked {
            Ok(r) => r.said("the new tokens were"),
            Err(_) => "revoking the new tokens failed".into(),
        };
        return Err(fail(format!("{e}; {what}")));
    }
    writeln!(
        out,
        "logged in to {}: issuer {}, scopes {}",
        server.name,
        shown(&outcome.server.issuer, 200),
        if granted.is_empty() {
            "(none)".to_owned()
        } else {
            shown(&granted.join(" "), 400)
        }
    )
    .map_err(CliError::Output)
}

/// `auth login` for a server whose grant needs no browser: the token is fetched at once with
/// the client's own credentials (from where the configuration names them) and stored like a
/// login's. Only `--scopes` may change what the configuration says.
fn login_noninteractive(
    home: &Home,
    config: &iteron_policy::config::Config,
    server: &ServerConfig,
    mut grant: iteron_broker::oauth::grant::GrantRequest,
    a: &LoginArgs,
    zone: iteron_policy::zone::Zone,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    for (given, flag) in [
        (a.oauth_resource.is_some(), "--oauth-resource"),
        (
            a.oauth_client_registration.is_some(),
            "--oauth-client-registration",
        ),
        (a.client_id.is_some(), "--client-id"),
        (a.client_secret_env.is_some(), "--client-secret-env"),
        (a.oauth_issuer.is_some(), "--oauth-issuer"),
    ] {
        if given {
            return Err(CliError::Usage(format!(
                "{flag} does not apply: this server's grant takes its client, issuer and resource from the configuration"
            )));
        }
    }
    if let Some(scopes) = &a.scopes {
        // Together with what the stored token (of this configuration) was granted, as for a
        // browser login: a re-login never drops a scope.
        let mut all: Vec<String> = CredentialStore::new(home)
            .load(server.name.as_str())
            .ok()
            .flatten()
            .filter(|c| check_binding(&c.binding, server).is_ok())
            .map(|c| c.binding.granted_scopes)
            .unwrap_or_default();
        for t in scopes.split([',', ' ']).filter(|t| !t.is_empty()) {
            if !all.iter().any(|s| s == t) {
                all.push(t.to_owned());
            }
        }
        grant.scopes = Some(all.join(" "));
    }
    let rt = crate::rt::multi_thread()?;
    let (cred, _meta) = rt.block_on(async {
        let net =
            Net::new(NetConfig::from_operator(&config.network).map_err(fail)?).map_err(fail)?;
        let http = net.client(zone).map_err(fail)?;
        let challenge = probe_challenge(&http, &grant.server).await;
        iteron_broker::servers::login_noninteractive(
            home,
            server,
            &config.network,
            &grant,
            challenge.as_ref(),
        )
        .await
        .map_err(fail)
    })?;
    let granted = &cred.binding.granted_scopes;
    writeln!(
        out,
        "logged in to {} without a browser ({} grant, {}): issuer {}, scopes {}",
        server.name,
        grant.kind.as_str(),
        cred.binding.token_auth.as_str(),
        shown(&cred.binding.issuer, 200),
        if granted.is_empty() {
            "(none)".to_owned()
        } else {
            shown(&granted.join(" "), 400)
        }
    )
    .map_err(CliError::Output)
}

async fn probe_challenge(
    http: &iteron_broker::net::ZoneClient,
    url: &iteron_policy::url::EndpointUrl,
) -> Option<iteron_broker::oauth::Challenge> {
    use iteron_broker::net::Request;
    let mut req = Request::new(reqwest::Method::POST, url.clone());
    req.headers.insert(
        reqwest::header::CONTENT_TYPE,
        reqwest::header::HeaderValue::from_static("application/json"),
    );
    req.headers.insert(
        reqwest::header::ACCEPT,
        reqwest::header::HeaderValue::from_static("application/json, text/event-stream"),
    );
    req.body = Some(
        br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"iteron","version":"0"}}}"#
            .to_vec(),
    );
    let resp = http.send(req).await.ok()?;
    if resp.status().as_u16() != 401 {
        return None;
    }
    resp.headers()
        .get(reqwest::header::WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
        .and_then(iteron_broker::oauth::parse_challenge)
}

/// Hand the private page that leads to the authorization URL to the desktop's opener, with a
/// scrubbed environment and no shell. Only the page's path is an argument: the URL (with its
/// `state` and PKCE challenge) stays in the 0600 file. Failure is fine: the URL was printed.
fn open_browser(page: &std::path::Path) {
    let mut cmd = std::process::Command::new("xdg-open");
    cmd.arg(page)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    for k in [
        "PATH",
        "DISPLAY",
        "WAYLAND_DISPLAY",
        "XDG_RUNTIME_DIR",
        "DBUS_SESSION_BUS_ADDRESS",
        "HOME",
    ] {
        if let Some(v) = std::env::var_os(k) {
            cmd.env(k, v);
        }
    }
    let _ = cmd.spawn();
}

/// The variable that supplies this server's bearer token from the environment, if one does:
/// `oauth.access_token_env`, or a `header_env` entry for `Authorization` (header names are
/// stored lower-case). Such a server's credential is `external`: Iteron holds no login for it.
pub(crate) fn external_bearer(h: &iteron_policy::config::HttpServer) -> Option<&EnvName> {
    h.oauth
        .as_ref()
        .and_then(|o| o.access_token_env.as_ref())
        .or_else(|| {
            h.header_env
                .iter()
                .find(|(header, _)| header.as_str() == "authorization")
                .map(|(_, var)| var)
        })
}

/// Whether the server's credential is an externally managed token (`oauth.access_token_env`).
fn is_external(server: &ServerConfig) -> bool {
    matches!(&server.transport, Transport::Http(h)
        if h.oauth.as_ref().and_then(|o| o.access_token_env.as_ref()).is_some())
}

/// How an HTTP server's tokens are obtained, as `auth status`, `mcp status` and `doctor` show
/// it: `external` (`access_token_env`), else the configured grant (`authorization_code` by
/// default, `client_credentials`, `jwt_bearer`, `id_jag`). `None` for stdio.
pub(crate) fn grant_of(server: &ServerConfig) -> Option<&'static str> {
    let Transport::Http(h) = &server.transport else {
        return None;
    };
    if external_bearer(h).is_some() {
        return Some("external");
    }
    let o = h.oauth.as_ref();
    Some(
        o.and_then(|o| o.grant)
            .unwrap_or(iteron_policy::config::Grant::AuthorizationCode)
            .as_str(),
    )
}

/// Whether the server's tokens are obtained without a browser (the broker renews them itself).
fn noninteractive(server: &ServerConfig) -> bool {
    matches!(&server.transport, Transport::Http(h)
        if h.oauth.as_ref().and_then(|o| o.grant).is_some_and(|g| g.is_noninteractive()))
}

/// Whether the server's tokens are DPoP-bound: the stored credential's say; without one, the
/// configuration.
fn dpop_of(server: &ServerConfig, cred: Option<&Credential>) -> bool {
    match cred {
        Some(c) => c.secrets.dpop_key.is_some(),
        None => matches!(&server.transport, Transport::Http(h)
            if h.oauth.as_ref().and_then(|o| o.dpop) == Some(true)),
    }
}

/// The state `auth status` reports. A noninteractive grant's credential is never `expired`,
/// `refresh_failed` or `reauth_required`: the broker runs the grant again by itself (a
/// credential of another configuration reads as `logged_out`).
pub(crate) fn state_of(server: &ServerConfig, cred: Option<&Credential>) -> &'static str {
    let Transport::Http(h) = &server.transport else {
        return "logged_out";
    };
    if external_bearer(h).is_some() {
        return "external";
    }
    let renewable = noninteractive(server);
    match cred {
        None => "logged_out",
        Some(c) if check_binding(&c.binding, server).is_err() && renewable => "logged_out",
        Some(c) if check_binding(&c.binding, server).is_err() => "reauth_required",
        Some(_) if renewable => "logged_in",
        Some(c) if c.secrets.refresh_failed => "refresh_failed",
        Some(c) => match c.secrets.expires_at {
            Some(t) if t <= now() && c.secrets.refresh_token.is_none() => "expired",
            _ => "logged_in",
        },
    }
}

/// `iteron mcp auth status <name>`.
pub(crate) fn status(
    home: &Home,
    raw: &str,
    format: Format,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let config = home.load()?;
    let server = http_server(&config, raw)?;
    let store = CredentialStore::new(home);
    let cred = match store.load(server.name.as_str()) {
        Ok(c) => c,
        Err(e) => {
            // A keyring that cannot be reached says nothing about the login itself.
            let state = if e.keyring_unreachable() {
                "keyring_unavailable"
            } else {
                "reauth_required"
            };
            let v = json!({"name": server.name.as_str(), "state": state, "reason": text::single_line_capped(&e.to_string(), 300)});
            return print(out, format, &v);
        }
    };
    let state = state_of(server, cred.as_ref());
    let mut v = json!({"name": server.name.as_str(), "state": state,
        "grant": grant_of(server), "dpop": dpop_of(server, cred.as_ref())});
    if state == "refresh_failed"
        && let Some(obj) = v.as_object_mut()
    {
        obj.insert(
            "reason".into(),
            format!(
                "the authorization server refused the refresh token; log in again: iteron mcp auth login {}",
                server.name
            )
            .into(),
        );
    }
    if let (Some(c), Some(obj)) = (&cred, v.as_object_mut()) {
        obj.insert("issuer".into(), c.binding.issuer.clone().into());
        obj.insert("resource".into(), c.binding.resource.clone().into());
        obj.insert("zone".into(), c.binding.zone.as_str().into());
        obj.insert("store".into(), c.binding.secret_store.as_str().into());
        obj.insert("client_id".into(), c.binding.client_id.clone().into());
        obj.insert(
            "granted_scopes".into(),
            c.binding.granted_scopes.clone().into(),
        );
        obj.insert("expires_at".into(), c.secrets.expires_at.into());
        obj.insert(
            "refreshable".into(),
            (c.secrets.refresh_token.is_some() || noninteractive(server)).into(),
        );
    }
    print(out, format, &v)
}

fn print(out: &mut dyn Write, format: Format, v: &serde_json::Value) -> Result<(), CliError> {
    if format == Format::Json {
        return crate::output::json(out, v);
    }
    let mut line = format!(
        "{}: {}",
        v["name"].as_str().unwrap_or(""),
        v["state"].as_str().unwrap_or("")
    );
    for k in ["grant", "issuer", "resource", "zone", "store"] {
        if let Some(x) = v[k].as_str() {
            line.push_str(&format!(", {k} {x}"));
        }
    }
    if v["dpop"] == true {
        line.push_str(", DPoP-bound");
    }
    if let Some(s) = v["granted_scopes"].as_array() {
        let s: Vec<&str> = s.iter().filter_map(|x| x.as_str()).collect();
        line.push_str(&format!(
            ", scopes {}",
            if s.is_empty() {
                "(none)".to_owned()
            } else {
                s.join(" ")
            }
        ));
    }
    if let Some(r) = v["reason"].as_str() {
        line.push_str(&format!("; {r}"));
    }
    writeln!(out, "{}", text::single_line_capped(&line, 600)).map_err(CliError::Output)
}
