//! `iteron mcp auth logout`: revoke what the server accepts revoking, then forget the
//! credential (or, for a token the operator supplies, say what was and was not done).

use super::*;

/// `auth logout` of an externally managed token: revoke it at `revoke_url` (best effort, like
/// every logout: the answer is reported, the exit status stays 0). Nothing is stored locally,
/// so nothing is deleted.
pub(super) fn logout_external(
    home: &Home,
    config: &iteron_policy::config::Config,
    server: &ServerConfig,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    use iteron_broker::ipc::client::ClientError;
    use iteron_broker::oauth::Revoked;
    use iteron_broker::servers::{ExternalLogout, logout_external};
    // A running broker holds the tokens it renewed (rotated, in its memory only): it revokes
    // those, never sends them again, and restarts the server.
    let socket = iteron_broker::start::default_operator_socket(home);
    if socket.exists() {
        match crate::broker::operator_request(
            &socket,
            OperatorRequest::Logout(ServerArg {
                server: server.name.as_str().to_owned(),
            }),
        ) {
            Ok(v) => {
                let what = match v.get("revoked").and_then(serde_json::Value::as_str) {
                    Some("revoked") => "the running broker revoked its tokens at revoke_url",
                    Some("no_revoke_url") => {
                        "the configuration names no revoke_url; the running broker stopped using its tokens, which stay valid until they expire"
                    }
                    Some("nothing_to_revoke") => "the running broker held no token",
                    _ => {
                        "the running broker's revocation at revoke_url failed; it stopped using its tokens"
                    }
                };
                return writeln!(
                    out,
                    "logged out of {} (externally managed token): {what}",
                    server.name
                )
                .map_err(CliError::Output);
            }
            // No broker listens: this process revokes what the variables hold.
            Err(CliError::Broker(ClientError::Connect(_))) => {}
            Err(e) => return Err(e),
        }
    }
    let rt = crate::rt::multi_thread()?;
    let vars = crate::probe::Vars::load()?;
    let lookup = |n: &str| vars.get(n);
    let outcome = rt
        .block_on(logout_external(server, &config.network, &lookup))
        .map_err(fail)?;
    let what = match outcome {
        ExternalLogout::NoRevokeUrl => {
            "the configuration names no revoke_url, so nothing was revoked (the token stays valid until it expires)"
        }
        ExternalLogout::Revoked(Revoked::Revoked) => "revoked at revoke_url",
        ExternalLogout::Revoked(Revoked::NothingToRevoke) => {
            "no token was set in the named variables, so nothing was revoked"
        }
        ExternalLogout::Revoked(Revoked::NotOffered) => "the configuration names no revoke_url",
        ExternalLogout::Revoked(Revoked::Failed) => {
            "revocation at revoke_url failed (the tokens may stay valid until they expire)"
        }
    };
    writeln!(
        out,
        "logged out of {} (externally managed token): {what}",
        server.name
    )
    .map_err(CliError::Output)
}

/// What revoking a login's tokens came to at the authorization server.
pub(super) enum Revocations {
    /// Every token was revoked.
    Revoked,
    /// The server offers no revocation endpoint: nothing was sent.
    NotOffered,
    /// The server refused a revocation with this HTTP status (the first one refused).
    Refused(u16),
}

impl Revocations {
    /// One clause for the logout line (`what` names the tokens).
    pub(super) fn said(&self, what: &str) -> String {
        match self {
            Revocations::Revoked => format!("{what} revoked at the authorization server"),
            Revocations::NotOffered => "the authorization server offers no revocation".into(),
            Revocations::Refused(status) => format!("revocation failed (HTTP {status})"),
        }
    }
}

/// Revoke a login's refresh and access tokens (RFC 7009): revoked, not offered, or the status
/// of the first refusal; a request that fails on the way is an error.
pub(super) async fn revoke_tokens(
    http: &iteron_broker::net::ZoneClient,
    meta: &metadata::ServerMetadata,
    client: &flow::OAuthClient,
    secrets: &Secrets,
) -> Result<Revocations, String> {
    let mut refused = None;
    let tokens = secrets
        .refresh_token
        .iter()
        .map(|t| (t, "refresh_token"))
        .chain([(&secrets.access_token, "access_token")]);
    for (token, hint) in tokens {
        match flow::revoke(http, meta, client, token, hint)
            .await
            .map_err(|e| e.to_string())?
        {
            flow::Revocation::Accepted => {}
            flow::Revocation::NotOffered => return Ok(Revocations::NotOffered),
            flow::Revocation::Refused(status) => {
                refused.get_or_insert(status);
            }
        }
    }
    Ok(refused.map_or(Revocations::Revoked, Revocations::Refused))
}

/// `iteron mcp auth logout <name>`: best-effort revocation, then the file is deleted whatever
/// the remote answered.
pub(crate) fn logout(home: &Home, raw: &str, out: &mut dyn Write) -> Result<(), CliError> {
    let config = home.load()?;
    let server = http_server(&config, raw)?;
    if is_external(server) {
        return logout_external(home, &config, server, out);
    }
    let store = CredentialStore::new(home);
    let keyring_configured = matches!(
        &server.transport,
        Transport::Http(h) if h.oauth.as_ref().and_then(|o| o.credential_store)
            == Some(CredentialBackend::Keyring)
    );
    let (cred, mut revoked) = match store.load(server.name.as_str()) {
        Ok(c) => (c, "no credential was stored".to_owned()),
        // A keyring that cannot be reached cannot be cleared either: stop here, keeping the
        // file so a later logout finds the entry.
        Err(e) if e.keyring_unreachable() => return Err(fail(e)),
        Err(_) => (
            None,
            "the stored credential could not be read, so nothing was revoked (it is deleted anyway)"
                .to_owned(),
        ),
    };
    if let Some(c) = &cred {
        // Variables as the broker reads them: `$CREDENTIALS_DIRECTORY` first, then the
        // environment.
        let vars = crate::probe::Vars::load()?;
        let rt = crate::rt::multi_thread()?;
        let outcome: Result<Revocations, String> = rt.block_on(async {
            let net =
                Net::new(NetConfig::from_operator(&config.network).map_err(|e| e.to_string())?)
                    .map_err(|e| e.to_string())?;
            // Revocation goes out under the zone recorded at login.
            let http = net.client(c.binding.zone).map_err(|e| e.to_string())?;
            let meta = metadata::discover_server_for(
                &http,
                &c.binding.issuer,
                metadata::Purpose::TokenEndpoint,
            )
            .await
            .map_err(|e| e.to_string())?;
            // A pre-registered client's secret or key comes from where the configuration
            // names it (it is not copied into the credential).
            let configured = match &server.transport {
                Transport::Http(h) => h.oauth.clone().unwrap_or_default(),
                Transport::Stdio(_) => Default::default(),
            };
            let lookup = |n: &str| vars.get(n);
            let secret = c.secrets.client_secret.clone().or_else(|| {
                configured
                    .client_secret_env
                    .as_ref()
                    .and_then(|n| vars.get(n.as_str()))
                    .and_then(|v| v.into_string().ok())
                    .map(SecretString::from)
            });
            let key = iteron_broker::servers::client_key(&configured, &lookup)
                .ok()
                .flatten();
            let client = flow::OAuthClient {
                id: c.binding.client_id.clone(),
                secret,
                key,
                dpop: None,
                auth: c.binding.token_auth,
                kind: c.binding.client_kind,
                issuer: c.binding.issuer.clone(),
            };
            revoke_tokens(&http, &meta, &client, &c.secrets).await
        });
        revoked = match outcome {
            Ok(Revocations::Revoked) => "revoked at the authorization server".to_owned(),
            Ok(r @ Revocations::NotOffered) => r.said(""),
            Ok(r @ Revocations::Refused(_)) => {
                format!("{} (the local credential is deleted anyway)", r.said(""))
            }
            Err(_) => "revocation failed (the local credential is deleted anyway)".to_owned(),
        };
    }
    store
        .delete(server.name.as_str(), keyring_configured)
        .map_err(fail)?;
    // A noninteractive grant says which: the broker obtains a new token by itself at its next
    // use, which is worth knowing at logout.
    let grant = match &server.transport {
        Transport::Http(h) => h
            .oauth
            .as_ref()
            .and_then(|o| o.grant)
            .filter(|g| g.is_noninteractive())
            .map(|g| {
                format!(
                    " ({} grant: a broker obtains a new token at its next use)",
                    g.as_str()
                )
            })
            .unwrap_or_default(),
        Transport::Stdio(_) => String::new(),
    };
    writeln!(out, "logged out of {}{grant}: {revoked}", server.name).map_err(CliError::Output)
}
