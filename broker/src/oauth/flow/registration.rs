//! Client registration: pre-registered, a client ID metadata document, or dynamic
//! registration (RFC 7591), in that order; a forced `cimd` or `dcr` never falls back.
#![forbid(unsafe_code)]

use super::*;

/// Choose the token endpoint method for a pre-registered confidential client.
pub(super) fn confidential_method(meta: &ServerMetadata) -> TokenAuth {
    let offered = &meta.token_endpoint_auth_methods;
    if offered.is_empty() || offered.iter().any(|m| m == "client_secret_basic") {
        TokenAuth::Basic
    } else if offered.iter().any(|m| m == "client_secret_post") {
        TokenAuth::Post
    } else {
        TokenAuth::Basic
    }
}

/// Obtain a client for `meta` in the given mode.
pub async fn register(
    http: &ZoneClient,
    meta: &ServerMetadata,
    mode: &Mode,
    settings: &ClientSettings,
    redirect_uri: &str,
) -> Result<OAuthClient, OAuthError> {
    let pre = settings.client_id.as_ref().filter(|id| !id.contains("://"));
    if *mode == Mode::Auto
        && let Some(id) = pre
    {
        let auth = if settings.client_key.is_some() {
            TokenAuth::PrivateKeyJwt
        } else if settings.client_secret.is_some() {
            confidential_method(meta)
        } else {
            TokenAuth::None
        };
        return Ok(OAuthClient {
            id: id.clone(),
            secret: settings.client_secret.clone(),
            key: settings.client_key.clone(),
            dpop: None,
            auth,
            kind: ClientKind::PreRegistered,
            issuer: meta.issuer.clone(),
        });
    }
    let cimd = settings
        .cimd_url
        .clone()
        .or_else(|| settings.client_id.clone().filter(|id| id.contains("://")));
    let cimd_ok = meta.cimd_supported && cimd.is_some();
    match mode {
        Mode::Cimd if !cimd_ok => {
            return Err(OAuthError::NoRegistration(
                "client ID metadata documents were required, and the server or the settings do not offer them",
            ));
        }
        Mode::Cimd | Mode::Auto if cimd_ok => {
            return Ok(OAuthClient {
                id: cimd.unwrap_or_default(),
                secret: None,
                key: None,
                dpop: None,
                auth: TokenAuth::None,
                kind: ClientKind::Cimd,
                issuer: meta.issuer.clone(),
            });
        }
        _ => {}
    }
    let Some(endpoint) = &meta.registration_endpoint else {
        return Err(OAuthError::NoRegistration(
            "the server offers neither a client ID metadata document nor dynamic registration",
        ));
    };
    let method = if meta.token_endpoint_auth_methods.is_empty()
        || meta.token_endpoint_auth_methods.iter().any(|m| m == "none")
    {
        "none"
    } else if meta
        .token_endpoint_auth_methods
        .iter()
        .any(|m| m == "client_secret_basic")
    {
        "client_secret_basic"
    } else {
        "client_secret_post"
    };
    let body = json!({
        "client_name": settings.client_name,
        "redirect_uris": [redirect_uri],
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
        "token_endpoint_auth_method": method,
        "application_type": "native",
    });
    let doc = post_json(http, endpoint, &body).await?;
    let id = doc
        .get("client_id")
        .and_then(Value::as_str)
        .ok_or(OAuthError::Malformed(
            "registration response (no client_id)",
        ))?;
    // The client id is stored, sent and shown: printable ASCII (or a URL passing the endpoint
    // rules), bounded, like one the operator configures.
    let id = iteron_policy::config::ClientId::parse(id)
        .map_err(|_| {
            OAuthError::Malformed(
                "registration response (the client_id is not printable ASCII of at most 256 bytes)",
            )
        })?
        .as_str()
        .to_owned();
    let secret = match doc.get("client_secret") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if is_token_text(s) => Some(SecretString::from(s.to_owned())),
        Some(_) => {
            return Err(OAuthError::Malformed(
                "registration response (the client_secret is not visible ASCII of at most 16 KiB)",
            ));
        }
    };
    let auth = doc
        .get("token_endpoint_auth_method")
        .and_then(Value::as_str)
        .and_then(TokenAuth::parse)
        .unwrap_or(if secret.is_some() {
            TokenAuth::Basic
        } else {
            TokenAuth::None
        });
    Ok(OAuthClient {
        id,
        secret,
        key: None,
        dpop: None,
        auth,
        kind: ClientKind::Dynamic,
        issuer: meta.issuer.clone(),
    })
}

pub(super) async fn post_json(
    http: &ZoneClient,
    url: &EndpointUrl,
    body: &Value,
) -> Result<Value, OAuthError> {
    let mut req = Request::new(Method::POST, url.clone());
    req.headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    req.headers
        .insert(ACCEPT, HeaderValue::from_static("application/json"));
    req.body = Some(serde_json::to_vec(body).map_err(|_| OAuthError::Malformed("request"))?);
    let resp = http.send(req).await?;
    let status = resp.status().as_u16();
    let bytes = resp.body(MAX_OAUTH_BODY).await?;
    let doc: Value =
        serde_json::from_slice(&bytes).map_err(|_| OAuthError::Malformed("JSON response"))?;
    if !(200..300).contains(&status) {
        return Err(server_error(&doc, status));
    }
    Ok(doc)
}

pub(super) fn server_error(doc: &Value, status: u16) -> OAuthError {
    let error = doc
        .get("error")
        .and_then(Value::as_str)
        .filter(|e| e.len() <= 64 && e.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .unwrap_or("error")
        .to_owned();
    OAuthError::Server { error, status }
}
