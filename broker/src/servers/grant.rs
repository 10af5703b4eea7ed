//! Noninteractive grants: the request a server's configuration asks for (with the client's
//! secret or key), the credential a login or grant yields, and storing it (or revoking its
//! tokens when it cannot be stored).

use std::ffi::OsString;
use std::sync::Arc;

use iteron_policy::config::{NetworkConfig, ServerConfig, Transport};
use iteron_policy::zone::Zone;

use super::{ConnectError, secret_var, unix_now};
use crate::net::{Net, NetConfig, endpoint_zone};

/// The client's private key, read from where the operator named it (`client_key_file`, else
/// `client_key_env`, whose `$CREDENTIALS_DIRECTORY` credential wins over the environment).
pub fn client_key(
    o: &iteron_policy::config::OAuthConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
) -> Result<Option<Arc<crate::oauth::jose::SigningKey>>, ConnectError> {
    use crate::oauth::jose::{MAX_KEY_PEM_BYTES, SigningKey};
    let pem = match (&o.client_key_file, &o.client_key_env) {
        (Some(path), _) => {
            let bytes = crate::oauth::material::read_private_file(
                std::path::Path::new(path.as_str()),
                MAX_KEY_PEM_BYTES,
            )
            .map_err(|why| ConnectError::ClientKey(format!("file {why}")))?;
            zeroize::Zeroizing::new(String::from_utf8(bytes.to_vec()).map_err(|_| {
                ConnectError::ClientKey(format!("file is not text: {}", path.as_str()))
            })?)
        }
        (None, Some(var)) => {
            use secrecy::ExposeSecret;
            let v = secret_var(lookup, var)?;
            zeroize::Zeroizing::new(v.expose_secret().to_owned())
        }
        (None, None) => return Ok(None),
    };
    let where_ = o
        .client_key_file
        .as_ref()
        .map(|p| format!("in {}", p.as_str()))
        .or_else(|| o.client_key_env.as_ref().map(|v| format!("named by {v}")))
        .unwrap_or_default();
    SigningKey::from_pem(&pem)
        .map(|k| Some(Arc::new(k)))
        .map_err(|e| ConnectError::ClientKey(format!("{where_}: {e}")))
}

/// The noninteractive grant `server` is configured for (`oauth.grant`), with the client's
/// secret or key read from where the operator named them; `None` for a browser login.
pub fn grant_request(
    server: &ServerConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
) -> Result<Option<crate::oauth::grant::GrantRequest>, ConnectError> {
    use crate::oauth::flow::{ClientKind, OAuthClient, TokenAuth};
    use crate::oauth::grant::{GrantRequest, IdentitySource, IdentityToken, Kind};
    use iteron_policy::config::{ClientAuth, Grant};
    let Transport::Http(h) = &server.transport else {
        return Ok(None);
    };
    let Some(o) = &h.oauth else {
        return Ok(None);
    };
    let kind = match o.grant {
        None | Some(Grant::AuthorizationCode) => return Ok(None),
        Some(Grant::ClientCredentials) => Kind::ClientCredentials,
        Some(Grant::JwtBearer) => Kind::JwtBearer,
        Some(Grant::IdJag) => Kind::IdJag,
    };
    // The identity token: a file is read at every exchange; a variable's value is fixed.
    // What the authorization server refused is remembered per server for the life of the
    // process, across reconnects (each connect builds a new request).
    let source = match (&o.identity_token_file, &o.identity_token_env) {
        (Some(path), _) => Some(IdentitySource::File(std::path::PathBuf::from(
            path.as_str(),
        ))),
        (None, Some(var)) => Some(IdentitySource::Value(
            secret_var(lookup, var)?,
            format!("named by {var}"),
        )),
        (None, None) => None,
    };
    let identity = source
        .map(|s| IdentityToken::for_server(server.name.as_str(), s))
        .transpose()
        .map_err(ConnectError::OAuth)?;
    let secret = o
        .client_secret_env
        .as_ref()
        .map(|n| secret_var(lookup, n))
        .transpose()?;
    let key = client_key(o, lookup)?;
    let auth = match (o.token_endpoint_auth, &key, &secret) {
        (Some(ClientAuth::PrivateKeyJwt), _, _) | (None, Some(_), _) => TokenAuth::PrivateKeyJwt,
        (Some(ClientAuth::ClientSecretPost), _, _) => TokenAuth::Post,
        (Some(ClientAuth::ClientSecretBasic), _, _) | (None, None, Some(_)) => TokenAuth::Basic,
        (None, None, None) => TokenAuth::None,
    };
    // The configuration guarantees a plain client id and a pinned issuer for these grants.
    let issuer = o
        .issuer
        .as_ref()
        .map(|i| i.as_str().to_owned())
        .ok_or(ConnectError::ReauthRequired("the grant needs oauth.issuer"))?;
    Ok(Some(GrantRequest {
        server: h.url.clone(),
        resource: o.resource.as_ref().map(|r| r.as_str().to_owned()),
        issuer: issuer.clone(),
        scopes: (!o.scopes.is_empty()).then(|| {
            o.scopes
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        }),
        client: OAuthClient {
            id: o
                .client_id
                .as_ref()
                .map(|c| c.as_str().to_owned())
                .unwrap_or_default(),
            secret,
            key,
            dpop: None,
            auth,
            kind: ClientKind::PreRegistered,
            issuer,
        },
        kind,
        identity,
        dpop: o.dpop == Some(true),
        idp: match (&o.idp_issuer, &o.idp_client_id) {
            (Some(iss), Some(id)) => {
                let idp_secret = o
                    .idp_client_secret_env
                    .as_ref()
                    .map(|n| secret_var(lookup, n))
                    .transpose()?;
                // As the operator wrote it: the provider's metadata must name it exactly.
                let issuer = iss.as_str().to_owned();
                Some(crate::oauth::grant::IdentityProvider {
                    issuer: issuer.clone(),
                    client: OAuthClient {
                        id: id.as_str().to_owned(),
                        auth: if idp_secret.is_some() {
                            TokenAuth::Basic
                        } else {
                            TokenAuth::None
                        },
                        secret: idp_secret,
                        key: None,
                        dpop: None,
                        kind: ClientKind::PreRegistered,
                        issuer,
                    },
                })
            }
            _ => None,
        },
    }))
}

/// The credential a completed login or grant yields for `server` (bound to its current
/// configuration and `zone`). A pre-registered client's secret is not copied into it: it is
/// read from where the operator named it whenever it is needed; a dynamically registered
/// client's secret exists nowhere else and is kept.
pub fn credential_of(
    server: &ServerConfig,
    outcome: crate::oauth::login::LoginOutcome,
    zone: Zone,
    now: u64,
) -> crate::credentials::Credential {
    use crate::credentials::{Binding, Credential, Secrets};
    let words = |s: Option<&str>| -> Vec<String> {
        s.unwrap_or("")
            .split(' ')
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let granted = words(
        outcome
            .tokens
            .scope
            .as_deref()
            .or(outcome.requested.as_deref()),
    );
    let backend = match &server.transport {
        Transport::Http(h) => h.oauth.as_ref().and_then(|o| o.credential_store),
        Transport::Stdio(_) => None,
    }
    .unwrap_or(iteron_policy::config::CredentialBackend::File);
    let expires_at = outcome.tokens.expires_at(now);
    let client_secret = match outcome.client.kind {
        crate::oauth::flow::ClientKind::Dynamic => outcome.client.secret.clone(),
        _ => None,
    };
    Credential {
        binding: Binding {
            server: server.name.to_string(),
            resource: outcome.resource,
            issuer: outcome.server.issuer.clone(),
            zone,
            client_id: outcome.client.id.clone(),
            client_kind: outcome.client.kind,
            token_auth: outcome.client.auth,
            requested_scopes: words(outcome.requested.as_deref()),
            granted_scopes: granted,
            config_digest: crate::credentials::config_digest(server),
            secret_store: backend,
        },
        secrets: Secrets {
            access_token: outcome.tokens.access,
            refresh_token: outcome.tokens.refresh,
            client_secret,
            expires_at,
            refresh_failed: false,
            dpop_key: outcome.client.dpop.as_ref().map(|k| k.stored()),
        },
    }
}

/// Run a noninteractive grant for the server `cred` binds (or, with no credential yet, for
/// `server`) under its binding zone and store what it yields, replacing the stored credential
/// whole. Tokens that cannot be stored are revoked, never left live. Returns the credential and
/// the authorization server's metadata.
pub(super) async fn obtain_and_store(
    store: &crate::credentials::CredentialStore,
    cred: &crate::credentials::Credential,
    network: &NetworkConfig,
    grant: &crate::oauth::grant::GrantRequest,
) -> Result<
    (
        crate::credentials::Credential,
        crate::oauth::metadata::ServerMetadata,
    ),
    ConnectError,
> {
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let http = net.client(cred.binding.zone).map_err(ConnectError::Net)?;
    let mut req = grant.clone();
    // A renewal stays on the resource it was bound to.
    req.resource = Some(cred.binding.resource.clone());
    let outcome = crate::oauth::grant::obtain(&http, &req, None)
        .await
        .map_err(ConnectError::OAuth)?;
    store_outcome(store, cred, outcome, &http).await
}

/// Store a grant's outcome over `previous` (its binding, with the new tokens and scopes).
async fn store_outcome(
    store: &crate::credentials::CredentialStore,
    previous: &crate::credentials::Credential,
    outcome: crate::oauth::login::LoginOutcome,
    http: &crate::net::ZoneClient,
) -> Result<
    (
        crate::credentials::Credential,
        crate::oauth::metadata::ServerMetadata,
    ),
    ConnectError,
> {
    let meta = outcome.server.clone();
    let client = outcome.client.clone();
    let granted: Vec<String> = outcome
        .tokens
        .scope
        .as_deref()
        .or(outcome.requested.as_deref())
        .unwrap_or("")
        .split(' ')
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect();
    let mut cred = previous.clone();
    cred.binding.resource = outcome.resource;
    cred.binding.granted_scopes = granted;
    cred.secrets.expires_at = outcome.tokens.expires_at(unix_now());
    cred.secrets.access_token = outcome.tokens.access;
    cred.secrets.refresh_token = outcome.tokens.refresh;
    cred.secrets.refresh_failed = false;
    // A new grant is bound to the key it was obtained with.
    cred.secrets.dpop_key = client.dpop.as_ref().map(|k| k.stored());
    save_or_revoke(store, http, &client, cred, meta).await
}

/// Run `server`'s noninteractive grant for the first time (no credential, or one bound to
/// another configuration) and store the result. Shared by the broker and `auth login`.
pub async fn login_noninteractive(
    home: &crate::store::Home,
    server: &ServerConfig,
    network: &NetworkConfig,
    grant: &crate::oauth::grant::GrantRequest,
    challenge: Option<&crate::oauth::Challenge>,
) -> Result<
    (
        crate::credentials::Credential,
        crate::oauth::metadata::ServerMetadata,
    ),
    ConnectError,
> {
    let Transport::Http(h) = &server.transport else {
        return Err(ConnectError::ReauthRequired("not an HTTP server"));
    };
    let zone = endpoint_zone(&h.url).map_err(ConnectError::Net)?;
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let http = net.client(zone).map_err(ConnectError::Net)?;
    let outcome = crate::oauth::grant::obtain(&http, grant, challenge)
        .await
        .map_err(ConnectError::OAuth)?;
    let store = crate::credentials::CredentialStore::new(home);
    let meta = outcome.server.clone();
    let client = outcome.client.clone();
    let cred = credential_of(server, outcome, zone, unix_now());
    save_or_revoke(&store, &http, &client, cred, meta).await
}

/// Store a freshly granted credential; if it cannot be stored, revoke its tokens at the
/// authorization server (so no live token is left that nothing holds) and say so.
async fn save_or_revoke(
    store: &crate::credentials::CredentialStore,
    http: &crate::net::ZoneClient,
    client: &crate::oauth::flow::OAuthClient,
    cred: crate::credentials::Credential,
    meta: crate::oauth::metadata::ServerMetadata,
) -> Result<
    (
        crate::credentials::Credential,
        crate::oauth::metadata::ServerMetadata,
    ),
    ConnectError,
> {
    let saved = cred.clone();
    let store2 = store.clone();
    let result = tokio::task::spawn_blocking(move || store2.save(&saved).map(|_| ()))
        .await
        .map_err(|_| "the credential store task failed".to_owned())
        .and_then(|r| r.map_err(|e| e.to_string()));
    if let Err(why) = result {
        let revoked = crate::oauth::flow::revoke_all(
            http,
            &meta,
            client,
            &cred.secrets.access_token,
            cred.secrets.refresh_token.as_ref(),
        )
        .await;
        return Err(ConnectError::Credentials(format!(
            "{why}; {}",
            revoked.as_str()
        )));
    }
    Ok((cred, meta))
}
