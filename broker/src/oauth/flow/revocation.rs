//! Revocation (RFC 7009): of a refused token response's tokens, and at logout.
#![forbid(unsafe_code)]

use super::*;

/// Revoke every token string a refused token response carried (refresh token first: at most
/// servers that ends the whole grant), whatever its shape.
pub(super) async fn revoke_unusable(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    doc: &Value,
) -> Revoked {
    let mut found = false;
    let mut all = true;
    for (key, hint) in [
        ("refresh_token", "refresh_token"),
        ("access_token", "access_token"),
    ] {
        let Some(t) = doc
            .get(key)
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        else {
            continue;
        };
        found = true;
        let token = SecretString::from(t.to_owned());
        match revoke(http, meta, client, &token, hint).await {
            Ok(Revocation::Accepted) => {}
            Ok(Revocation::NotOffered) => return Revoked::NotOffered,
            Ok(Revocation::Refused(_)) | Err(_) => all = false,
        }
    }
    match (found, all) {
        (false, _) => Revoked::NothingToRevoke,
        (true, true) => Revoked::Revoked,
        (true, false) => Revoked::Failed,
    }
}

/// Revoke tokens Iteron obtained but could not keep (refresh token first), best effort.
pub async fn revoke_all(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    access: &SecretString,
    refresh: Option<&SecretString>,
) -> Revoked {
    if meta.revocation_endpoint.is_none() {
        return Revoked::NotOffered;
    }
    let mut all = true;
    if let Some(r) = refresh {
        all &= matches!(
            revoke(http, meta, client, r, "refresh_token").await,
            Ok(Revocation::Accepted)
        );
    }
    all &= matches!(
        revoke(http, meta, client, access, "access_token").await,
        Ok(Revocation::Accepted)
    );
    if all {
        Revoked::Revoked
    } else {
        Revoked::Failed
    }
}

/// What one RFC 7009 revocation request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revocation {
    /// The server accepted it (a 2xx answer).
    Accepted,
    /// The server offers no revocation endpoint: nothing was sent.
    NotOffered,
    /// The server answered with this other HTTP status: the token may still be valid.
    Refused(u16),
}

/// RFC 7009 revocation, best effort: accepted, not offered (no endpoint: nothing sent), or
/// refused with the HTTP status the server answered. A request that fails on the way is an
/// error.
pub async fn revoke(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    token: &SecretString,
    hint: &'static str,
) -> Result<Revocation, OAuthError> {
    let Some(endpoint) = &meta.revocation_endpoint else {
        return Ok(Revocation::NotOffered);
    };
    let form = vec![
        ("token", token.expose_secret().to_owned()),
        ("token_type_hint", hint.to_owned()),
    ];
    let req = client_post(
        meta,
        client,
        endpoint,
        "revocation_endpoint",
        form,
        MissingSecret::IdOnly,
    )?;
    let resp = http.send(req).await?;
    let status = resp.status();
    Ok(if status.is_success() {
        Revocation::Accepted
    } else {
        Revocation::Refused(status.as_u16())
    })
}
