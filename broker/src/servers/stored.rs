//! The operator's stored OAuth credential: loaded off the runtime, refreshed with its rotation
//! persisted first, and handed to the client as its managed token.

use std::sync::Arc;

use iteron_policy::config::NetworkConfig;

use super::grant::obtain_and_store;
use super::{ConnectError, LearnedSecrets, MAX_LEARNED_SECRETS, REFRESH_MARGIN_SECS, unix_now};
use crate::mcp::client::AccessToken;
use crate::net::{Net, NetConfig};

/// Load a stored credential off the async runtime: a keyring read can take up to its 15 s
/// deadline and must not stall the other tasks.
pub(super) async fn load_stored(
    store: &crate::credentials::CredentialStore,
    server: &str,
) -> Result<Option<crate::credentials::Credential>, String> {
    let (store, server) = (store.clone(), server.to_owned());
    tokio::task::spawn_blocking(move || store.load(&server).map_err(|e| e.to_string()))
        .await
        .map_err(|_| "the credential store task failed".to_owned())?
}

/// Refresh a stored credential: under the zone recorded at login, with the same `resource`,
/// and the rotated refresh token persisted (atomically, under the store's lock) before the new
/// access token is used.
///
/// When the authorization server refuses the refresh token (`invalid_grant`), or rotates it
/// into tokens Iteron cannot use (they are revoked by [`crate::oauth::flow`]), the dead refresh
/// token is dropped and the credential marked `refresh_failed`: `auth status` says so and only
/// a new login helps. When the rotated tokens cannot be stored (over the credential bound, a
/// full disk, a busy lock), they are revoked at the authorization server, never just dropped.
pub(super) async fn refresh_stored(
    store: &crate::credentials::CredentialStore,
    cred: &crate::credentials::Credential,
    network: &NetworkConfig,
    grant: Option<&crate::oauth::grant::GrantRequest>,
) -> Result<AccessToken, ConnectError> {
    use crate::oauth::{OAuthError, flow, metadata};
    let Some(refresh_token) = &cred.secrets.refresh_token else {
        // A noninteractive grant needs no refresh token: the broker runs it again.
        if let Some(g) = grant {
            let (renewed, _) = obtain_and_store(store, cred, network, g).await?;
            return access_of(&renewed);
        }
        return Err(ConnectError::ReauthRequired(
            if cred.secrets.refresh_failed {
                "the authorization server refused the refresh token"
            } else {
                "the access token expired and there is no refresh token"
            },
        ));
    };
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let http = net.client(cred.binding.zone).map_err(ConnectError::Net)?;
    let meta = metadata::discover_server_for(
        &http,
        &cred.binding.issuer,
        metadata::Purpose::TokenEndpoint,
    )
    .await
    .map_err(ConnectError::OAuth)?;
    // A pre-registered client's secret or key comes from where the operator named it.
    let client = flow::OAuthClient {
        id: cred.binding.client_id.clone(),
        secret: cred
            .secrets
            .client_secret
            .clone()
            .or_else(|| grant.and_then(|g| g.client.secret.clone())),
        key: grant.and_then(|g| g.client.key.clone()),
        // A DPoP-bound grant is refreshed with the key it is bound to.
        dpop: stored_dpop_key(cred)?,
        auth: cred.binding.token_auth,
        kind: cred.binding.client_kind,
        issuer: cred.binding.issuer.clone(),
    };
    let (store, server) = (store.clone(), cred.binding.server.clone());
    let tokens =
        match flow::refresh(&http, &meta, &client, refresh_token, &cred.binding.resource).await {
            Ok(t) => t,
            Err(e) => {
                let refused = match &e {
                    OAuthError::Server { error, .. } if error == "invalid_grant" => {
                        Some("the authorization server refused the refresh token (invalid_grant)")
                    }
                    OAuthError::UnusableTokens { .. } => Some(
                        "the authorization server rotated the refresh token into tokens that \
                         could not be kept",
                    ),
                    _ => None,
                };
                let Some(why) = refused else {
                    return Err(ConnectError::OAuth(e));
                };
                let (store, server) = (store.clone(), server.clone());
                let presented = refresh_token.clone();
                // Best effort: the refusal is reported whether or not the mark is written. Only
                // the refresh token that was refused is forgotten: one another process stored
                // meanwhile (it refreshed first) is kept.
                let _ = tokio::task::spawn_blocking(move || {
                    store.update_secrets(&server, |s| {
                        use secrecy::ExposeSecret;
                        let same = s
                            .refresh_token
                            .as_ref()
                            .is_some_and(|r| r.expose_secret() == presented.expose_secret());
                        if same {
                            s.refresh_token = None;
                            s.refresh_failed = true;
                        }
                    })
                })
                .await;
                if let OAuthError::UnusableTokens { .. } = e {
                    return Err(ConnectError::OAuth(e));
                }
                return Err(ConnectError::ReauthRequired(why));
            }
        };
    let access = tokens.access.clone();
    let rotated = tokens.refresh.clone();
    let expires_at = tokens.expires_at(unix_now());
    // Off the runtime, like `load_stored`; the rotated refresh token is persisted before the
    // new access token is handed out.
    let stored = tokio::task::spawn_blocking(move || {
        store.update_secrets(&server, |s| {
            s.access_token = tokens.access;
            if let Some(r) = tokens.refresh {
                s.refresh_token = Some(r);
            }
            s.expires_at = expires_at;
            s.refresh_failed = false;
        })
    })
    .await
    .map_err(|_| "the credential store task failed".to_owned())
    .and_then(|r| r.map_err(|e| e.to_string()))
    .and_then(|existed| {
        if existed {
            Ok(())
        } else {
            Err("the credential was removed while it was being refreshed".to_owned())
        }
    });
    if let Err(why) = stored {
        // The authorization server has rotated the grant into tokens nobody holds now:
        // revoke them rather than leave them live.
        let revoked = flow::revoke_all(&http, &meta, &client, &access, rotated.as_ref()).await;
        return Err(ConnectError::Credentials(format!(
            "{why}; {}",
            revoked.as_str()
        )));
    }
    Ok(AccessToken {
        token: access,
        dpop: client.dpop,
    })
}

/// The access token of a stored credential as it is presented (DPoP-bound when it has a key).
pub(super) fn access_of(
    cred: &crate::credentials::Credential,
) -> Result<AccessToken, ConnectError> {
    Ok(AccessToken {
        token: cred.secrets.access_token.clone(),
        dpop: stored_dpop_key(cred)?,
    })
}

/// The DPoP key a stored credential's tokens are bound to, if any.
fn stored_dpop_key(
    cred: &crate::credentials::Credential,
) -> Result<Option<Arc<crate::oauth::dpop::DpopKey>>, ConnectError> {
    cred.secrets
        .dpop_key
        .as_ref()
        .map(|k| {
            crate::oauth::dpop::DpopKey::from_stored(k)
                .map(Arc::new)
                .map_err(|_| ConnectError::ReauthRequired("the stored DPoP key cannot be read"))
        })
        .transpose()
}

/// The operator's stored OAuth credential as the client's managed token: read from the store
/// at each request, refreshed (with rotation persisted first) when it is about to expire or
/// after a 401.
pub(crate) struct StoredToken {
    pub(super) store: crate::credentials::CredentialStore,
    pub(super) server: String,
    pub(super) network: NetworkConfig,
    /// Every token handed out is learned here first.
    pub(super) learned: LearnedSecrets,
    /// The noninteractive grant that renews the credential when it has no refresh token.
    pub(super) grant: Option<crate::oauth::grant::GrantRequest>,
    /// Held while the credential is renewed: requests of one connection that find it expiring
    /// together (a call and the standalone stream's reopening, say) renew it once, so a
    /// refresh token is never presented twice.
    pub(super) renewing: tokio::sync::Mutex<()>,
}

impl StoredToken {
    #[cfg(test)]
    pub(crate) fn new(
        store: crate::credentials::CredentialStore,
        server: &str,
        learned: LearnedSecrets,
    ) -> StoredToken {
        StoredToken {
            store,
            server: server.to_owned(),
            network: NetworkConfig::default(),
            learned,
            grant: None,
            renewing: tokio::sync::Mutex::new(()),
        }
    }

    async fn get(&self, force: bool) -> Result<AccessToken, String> {
        let load = || async {
            load_stored(&self.store, &self.server)
                .await?
                .ok_or("the credential was removed; log in again".to_owned())
        };
        let expiring = |c: &crate::credentials::Credential| {
            c.secrets
                .expires_at
                .is_some_and(|t| t <= unix_now() + REFRESH_MARGIN_SECS)
        };
        let mut cred = load().await?;
        // Renewals are one at a time; the one that waited reads the credential again and
        // renews only if it still needs to (after a 401 it always does, with what is stored).
        let _renewing = if force || expiring(&cred) {
            let held = self.renewing.lock().await;
            cred = load().await?;
            Some(held)
        } else {
            None
        };
        let expiring = expiring(&cred);
        let too_many = || {
            format!(
                "this server was handed more than {MAX_LEARNED_SECRETS} distinct secrets since it started; restart it (iteron broker restart)"
            )
        };
        // Learned before use: a token the scrubber does not know is never handed out.
        if !self.learned.learn_credential(&cred) {
            return Err(too_many());
        }
        let token = if force || expiring {
            refresh_stored(&self.store, &cred, &self.network, self.grant.as_ref())
                .await
                .map_err(|e| e.to_string())?
        } else {
            access_of(&cred).map_err(|e| e.to_string())?
        };
        {
            use secrecy::ExposeSecret;
            if !self.learned.learn(token.token.expose_secret()) {
                return Err(too_many());
            }
        }
        Ok(token)
    }
}

impl crate::mcp::client::TokenSource for StoredToken {
    fn current(&self) -> crate::mcp::client::TokenFuture<'_> {
        Box::pin(self.get(false))
    }

    fn refresh(&self) -> crate::mcp::client::TokenFuture<'_> {
        Box::pin(self.get(true))
    }
}
