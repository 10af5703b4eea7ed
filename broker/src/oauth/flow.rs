//! The authorization-code flow: client registration, the authorization request with PKCE S256
//! and a random `state`, the checks on the authorization response (state, RFC 9207 `iss`), and
//! the token endpoint (code exchange, refresh, revocation) with `resource` on every request.
//!
//! Rules kept here:
//! - registration order: pre-registered → client ID metadata document → dynamic registration;
//!   a forced `cimd` or `dcr` never falls back to the other;
//! - a client secret goes only to a token endpoint on the same origin as the issuer it was
//!   registered with (`same_origin_secret`);
//! - `iss`: if the server advertises it, it must be present and equal; if present anyway, equal;
//!   comparison is exact (no normalisation); on a mismatch the code is never redeemed;
//! - scope choice: operator's, else the challenge's, else the resource's `scopes_supported`,
//!   else none (omitted); `offline_access` is never added.

use std::fmt;

use base64::Engine;
use reqwest::Method;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use iteron_policy::url::EndpointUrl;

use super::metadata::ServerMetadata;
use super::{MAX_OAUTH_BODY, OAuthError};
use crate::net::{Request, ZoneClient};

/// How the client authenticates at the token endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenAuth {
    /// Public client: `client_id` in the body.
    None,
    /// HTTP Basic with the client secret.
    Basic,
    /// `client_id` + `client_secret` in the body.
    Post,
}

impl TokenAuth {
    /// The RFC 7591 spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenAuth::None => "none",
            TokenAuth::Basic => "client_secret_basic",
            TokenAuth::Post => "client_secret_post",
        }
    }

    fn parse(s: &str) -> Option<TokenAuth> {
        match s {
            "none" => Some(TokenAuth::None),
            "client_secret_basic" => Some(TokenAuth::Basic),
            "client_secret_post" => Some(TokenAuth::Post),
            _ => None,
        }
    }
}

/// How the client came to exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKind {
    /// Given by the operator.
    PreRegistered,
    /// A client ID metadata document URL.
    Cimd,
    /// Registered dynamically (RFC 7591).
    Dynamic,
}

/// A registered OAuth client. The secret is never shown.
#[derive(Clone)]
pub struct OAuthClient {
    /// The client id.
    pub id: String,
    /// The client secret, for confidential clients.
    pub secret: Option<SecretString>,
    /// Token endpoint authentication.
    pub auth: TokenAuth,
    /// How it was obtained.
    pub kind: ClientKind,
    /// The issuer it belongs to (credentials never cross issuers).
    pub issuer: String,
}

impl fmt::Debug for OAuthClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OAuthClient")
            .field("id", &self.id)
            .field("secret", &self.secret.as_ref().map(|_| "[not shown]"))
            .field("auth", &self.auth)
            .field("kind", &self.kind)
            .field("issuer", &self.issuer)
            .finish()
    }
}

/// The registration mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Pre-registered if given, else CIMD if offered, else DCR.
    Auto,
    /// Only a client ID metadata document.
    Cimd,
    /// Only dynamic registration.
    Dcr,
}

/// Operator-supplied client settings.
#[derive(Clone, Default)]
pub struct ClientSettings {
    /// A pre-registered client id (or, with a CIMD URL, that URL).
    pub client_id: Option<String>,
    /// Its secret.
    pub client_secret: Option<SecretString>,
    /// The client ID metadata document URL this client would present.
    pub cimd_url: Option<String>,
    /// The client name sent in dynamic registration.
    pub client_name: String,
}

/// Choose the token endpoint method for a pre-registered confidential client.
fn confidential_method(meta: &ServerMetadata) -> TokenAuth {
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
        let auth = if settings.client_secret.is_some() {
            confidential_method(meta)
        } else {
            TokenAuth::None
        };
        return Ok(OAuthClient {
            id: id.clone(),
            secret: settings.client_secret.clone(),
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
        ))?
        .to_owned();
    let secret = doc
        .get("client_secret")
        .and_then(Value::as_str)
        .map(|s| SecretString::from(s.to_owned()));
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
        auth,
        kind: ClientKind::Dynamic,
        issuer: meta.issuer.clone(),
    })
}

async fn post_json(
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

fn server_error(doc: &Value, status: u16) -> OAuthError {
    let error = doc
        .get("error")
        .and_then(Value::as_str)
        .filter(|e| e.len() <= 64 && e.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .unwrap_or("error")
        .to_owned();
    OAuthError::Server { error, status }
}

/// Random bytes as base64url without padding.
pub fn random_token(bytes: usize) -> Result<String, OAuthError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|_| OAuthError::Malformed("system randomness"))?;
    let out = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&buf);
    zeroize::Zeroize::zeroize(&mut buf);
    Ok(out)
}

/// The S256 challenge of a verifier.
pub fn s256(verifier: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes()))
}

/// One authorization attempt: what was sent, and what is needed to check the answer and
/// redeem the code. Never shown.
pub struct Attempt {
    /// The URL for the browser.
    pub url: String,
    /// The `state` sent.
    pub state: String,
    verifier: SecretString,
    /// The `redirect_uri` sent.
    pub redirect_uri: String,
    /// The issuer expected in the answer.
    pub issuer: String,
    /// Whether the server promised `iss`.
    pub iss_required: bool,
    /// The `resource` sent.
    pub resource: String,
    /// The scope requested (None: omitted).
    pub scope: Option<String>,
}

/// Choose the scope to request, in priority order; `None` omits the parameter.
pub fn choose_scope(
    operator: Option<&str>,
    configured: Option<&str>,
    challenge: Option<&str>,
    resource_supported: &[String],
    server_supported: &[String],
) -> Option<String> {
    let pick = |s: Option<&str>| {
        s.map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    pick(operator)
        .or_else(|| pick(configured))
        .or_else(|| pick(challenge))
        .or_else(|| (!resource_supported.is_empty()).then(|| resource_supported.join(" ")))
        .or_else(|| {
            let s: Vec<&str> = server_supported
                .iter()
                .map(String::as_str)
                .filter(|s| *s != "offline_access")
                .collect();
            (!s.is_empty()).then(|| s.join(" "))
        })
}

/// Build the authorization request.
pub fn start(
    meta: &ServerMetadata,
    client: &OAuthClient,
    redirect_uri: &str,
    resource: &str,
    scope: Option<String>,
) -> Result<Attempt, OAuthError> {
    let state = random_token(24)?;
    let verifier = random_token(48)?;
    let challenge = s256(&verifier);
    let mut url = meta.authorization_endpoint.as_url().clone();
    {
        let mut q = url.query_pairs_mut();
        q.append_pair("response_type", "code")
            .append_pair("client_id", &client.id)
            .append_pair("redirect_uri", redirect_uri)
            .append_pair("state", &state)
            .append_pair("code_challenge", &challenge)
            .append_pair("code_challenge_method", "S256")
            .append_pair("resource", resource);
        if let Some(s) = &scope {
            q.append_pair("scope", s);
        }
    }
    Ok(Attempt {
        url: url.to_string(),
        state,
        verifier: SecretString::from(verifier),
        redirect_uri: redirect_uri.to_owned(),
        issuer: meta.issuer.clone(),
        iss_required: meta.iss_parameter_supported,
        resource: resource.to_owned(),
        scope,
    })
}

/// The `error` of an authorization response — only when the response passed the `state` and
/// `iss` checks (an error in a response that fails them is never acted on).
pub fn response_error(attempt: &Attempt, callback: &str) -> Option<String> {
    let url = url::Url::parse(callback).ok()?;
    let mut state = None;
    let mut iss = None;
    let mut error = None;
    for (k, v) in url.query_pairs() {
        let slot = match k.as_ref() {
            "state" => &mut state,
            "iss" => &mut iss,
            "error" => &mut error,
            _ => continue,
        };
        if slot.is_some() {
            return None;
        }
        *slot = Some(v.into_owned());
    }
    if state.as_deref() != Some(attempt.state.as_str()) {
        return None;
    }
    match iss.as_deref() {
        Some(i) if i != attempt.issuer => return None,
        None if attempt.iss_required => return None,
        _ => {}
    }
    error
}

/// Check an authorization response (the redirect URL the browser was sent to) and return the
/// code. On any mismatch nothing is redeemed, and an `error` in a mismatched response is not
/// acted on either.
pub fn finish(attempt: &Attempt, callback: &str) -> Result<SecretString, OAuthError> {
    let url = url::Url::parse(callback).map_err(|_| OAuthError::Callback("not a URL"))?;
    let mut code = None;
    let mut state = None;
    let mut iss = None;
    let mut error = None;
    for (k, v) in url.query_pairs() {
        let slot = match k.as_ref() {
            "code" => &mut code,
            "state" => &mut state,
            "iss" => &mut iss,
            "error" => &mut error,
            _ => continue,
        };
        if slot.is_some() {
            return Err(OAuthError::Callback("a parameter appears twice"));
        }
        *slot = Some(v.into_owned());
    }
    if state.as_deref() != Some(attempt.state.as_str()) {
        return Err(OAuthError::Callback("the state does not match"));
    }
    match iss.as_deref() {
        Some(i) if i != attempt.issuer => {
            return Err(OAuthError::Callback("the iss does not match the issuer"));
        }
        None if attempt.iss_required => {
            return Err(OAuthError::Callback(
                "the server promised an iss parameter and sent none",
            ));
        }
        _ => {}
    }
    if error.is_some() {
        return Err(OAuthError::Callback(
            "the authorization server refused the request",
        ));
    }
    code.map(SecretString::from)
        .ok_or(OAuthError::Callback("no code"))
}

/// Tokens from the token endpoint. Never shown.
pub struct Tokens {
    /// The access token.
    pub access: SecretString,
    /// The refresh token, if one was issued.
    pub refresh: Option<SecretString>,
    /// Lifetime in seconds, if given.
    pub expires_in: Option<u64>,
    /// The granted scope, if given.
    pub scope: Option<String>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens")
            .field("expires_in", &self.expires_in)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

/// Whether a secret may go to `token_endpoint`: only on the issuer's own origin.
pub fn same_origin_secret(issuer: &str, token_endpoint: &EndpointUrl) -> bool {
    url::Url::parse(issuer).is_ok_and(|i| i.origin() == token_endpoint.as_url().origin())
}

/// What to do when a confidential client has no stored secret.
#[derive(Clone, Copy, PartialEq, Eq)]
enum MissingSecret {
    /// Refuse: a grant without client authentication would only be rejected.
    Refuse,
    /// Identify the client by id alone (revocation is best effort).
    IdOnly,
}

/// A form POST to `endpoint` (the token or revocation endpoint) carrying the client's
/// authentication. The secret goes only to the issuer's own origin, in a sensitive header
/// (`client_secret_basic`) or in the body (`client_secret_post`); every copy is zeroized.
fn client_post(
    meta: &ServerMetadata,
    client: &OAuthClient,
    endpoint: &EndpointUrl,
    which: &'static str,
    mut form: Vec<(&'static str, String)>,
    missing: MissingSecret,
) -> Result<Request, OAuthError> {
    if client.issuer != meta.issuer {
        return Err(OAuthError::NoRegistration(
            "the client was registered with another issuer; it is never reused across issuers",
        ));
    }
    let mut req = Request::new(Method::POST, endpoint.clone());
    req.headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/x-www-form-urlencoded"),
    );
    match (client.auth, &client.secret) {
        (TokenAuth::None, _) => form.push(("client_id", client.id.clone())),
        (_, None) if missing == MissingSecret::IdOnly => {
            form.push(("client_id", client.id.clone()));
        }
        (_, None) => {
            return Err(OAuthError::NoRegistration(
                "a confidential client has no secret",
            ));
        }
        (auth, Some(secret)) => {
            if !same_origin_secret(&meta.issuer, endpoint) {
                return Err(OAuthError::BadEndpoint {
                    which,
                    why: "a client secret is only sent to the issuer's own origin".into(),
                });
            }
            if auth == TokenAuth::Basic {
                let enc = |s: &str| {
                    url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>()
                };
                let pair = zeroize::Zeroizing::new(format!(
                    "{}:{}",
                    enc(&client.id),
                    enc(secret.expose_secret())
                ));
                let b64 = zeroize::Zeroizing::new(
                    base64::engine::general_purpose::STANDARD.encode(pair.as_bytes()),
                );
                let mut v = HeaderValue::from_str(&format!("Basic {}", b64.as_str()))
                    .map_err(|_| OAuthError::Malformed("client credentials"))?;
                v.set_sensitive(true);
                req.headers.insert(AUTHORIZATION, v);
            } else {
                form.push(("client_id", client.id.clone()));
                form.push(("client_secret", secret.expose_secret().to_owned()));
            }
        }
    }
    let body = zeroize::Zeroizing::new(
        url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(form.iter().map(|(k, v)| (*k, v.as_str())))
            .finish(),
    );
    for (_, v) in &mut form {
        zeroize::Zeroize::zeroize(v);
    }
    req.body = Some(body.as_bytes().to_vec());
    Ok(req)
}

async fn token_request(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    form: Vec<(&'static str, String)>,
) -> Result<Tokens, OAuthError> {
    let mut req = client_post(
        meta,
        client,
        &meta.token_endpoint,
        "token_endpoint",
        form,
        MissingSecret::Refuse,
    )?;
    req.headers
        .insert(ACCEPT, HeaderValue::from_static("application/json"));
    let resp = http.send(req).await?;
    let status = resp.status().as_u16();
    let bytes = zeroize::Zeroizing::new(resp.body(MAX_OAUTH_BODY).await?);
    let doc: Value =
        serde_json::from_slice(&bytes).map_err(|_| OAuthError::Malformed("token response"))?;
    if !(200..300).contains(&status) {
        return Err(server_error(&doc, status));
    }
    let access = doc
        .get("access_token")
        .and_then(Value::as_str)
        .ok_or(OAuthError::Malformed("token response (no access_token)"))?;
    Ok(Tokens {
        access: SecretString::from(access.to_owned()),
        refresh: doc
            .get("refresh_token")
            .and_then(Value::as_str)
            .map(|s| SecretString::from(s.to_owned())),
        expires_in: doc.get("expires_in").and_then(Value::as_u64),
        scope: doc.get("scope").and_then(Value::as_str).map(str::to_owned),
    })
}

/// Redeem a code (once).
pub async fn exchange(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    attempt: &Attempt,
    code: SecretString,
) -> Result<Tokens, OAuthError> {
    let form = vec![
        ("grant_type", "authorization_code".to_owned()),
        ("code", code.expose_secret().to_owned()),
        ("redirect_uri", attempt.redirect_uri.clone()),
        ("code_verifier", attempt.verifier.expose_secret().to_owned()),
        ("resource", attempt.resource.clone()),
    ];
    token_request(http, meta, client, form).await
}

/// Refresh, with the same `resource`.
pub async fn refresh(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    refresh_token: &SecretString,
    resource: &str,
) -> Result<Tokens, OAuthError> {
    let form = vec![
        ("grant_type", "refresh_token".to_owned()),
        ("refresh_token", refresh_token.expose_secret().to_owned()),
        ("resource", resource.to_owned()),
    ];
    token_request(http, meta, client, form).await
}

/// RFC 7009 revocation, best effort: `Ok(true)` when the server accepted it, `Ok(false)` when
/// it offers no revocation endpoint.
pub async fn revoke(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    token: &SecretString,
    hint: &'static str,
) -> Result<bool, OAuthError> {
    let Some(endpoint) = &meta.revocation_endpoint else {
        return Ok(false);
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
    Ok(resp.status().is_success())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(iss_supported: bool) -> ServerMetadata {
        ServerMetadata {
            issuer: "https://as.example".into(),
            authorization_endpoint: EndpointUrl::parse("https://as.example/authorize").unwrap(),
            token_endpoint: EndpointUrl::parse("https://as.example/token").unwrap(),
            registration_endpoint: None,
            revocation_endpoint: None,
            token_endpoint_auth_methods: vec![],
            scopes_supported: vec![],
            cimd_supported: false,
            iss_parameter_supported: iss_supported,
        }
    }

    fn client() -> OAuthClient {
        OAuthClient {
            id: "c1".into(),
            secret: None,
            auth: TokenAuth::None,
            kind: ClientKind::Dynamic,
            issuer: "https://as.example".into(),
        }
    }

    #[test]
    fn pkce_s256_is_base64url_of_sha256() {
        // Expected value computed independently (Python: urlsafe_b64encode(sha256(v)) without
        // padding).
        assert_eq!(
            s256("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWjOEjXk"),
            "VYFANLqdx_HDV6BqEhluZJ63rtrIPROSSFdB3P6G83I"
        );
        let a = random_token(32).unwrap();
        let b = random_token(32).unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 43);
    }

    #[test]
    fn the_authorization_request_carries_pkce_state_and_resource() {
        let a = start(
            &meta(true),
            &client(),
            "http://127.0.0.1:9/cb",
            "https://r.example/mcp",
            Some("read".into()),
        )
        .unwrap();
        let u = url::Url::parse(&a.url).unwrap();
        let q: std::collections::HashMap<_, _> = u.query_pairs().into_owned().collect();
        assert_eq!(q["response_type"], "code");
        assert_eq!(q["code_challenge_method"], "S256");
        assert_eq!(q["code_challenge"], s256(a.verifier.expose_secret()));
        assert_eq!(q["state"], a.state);
        assert_eq!(q["resource"], "https://r.example/mcp");
        assert_eq!(q["scope"], "read");
        let none = start(
            &meta(true),
            &client(),
            "http://127.0.0.1:9/cb",
            "https://r.example/mcp",
            None,
        )
        .unwrap();
        assert!(!none.url.contains("scope="));
    }

    #[test]
    fn iss_rules_follow_rfc_9207() {
        let a = start(&meta(true), &client(), "http://127.0.0.1:9/cb", "r", None).unwrap();
        let cb = |q: &str| format!("http://127.0.0.1:9/cb?{q}");
        let st = &a.state;
        assert!(
            finish(
                &a,
                &cb(&format!("code=x&state={st}&iss=https%3A%2F%2Fas.example"))
            )
            .is_ok()
        );
        assert!(
            finish(&a, &cb(&format!("code=x&state={st}"))).is_err(),
            "promised iss missing"
        );
        assert!(
            finish(
                &a,
                &cb(&format!(
                    "code=x&state={st}&iss=https%3A%2F%2Fas.example%2F"
                ))
            )
            .is_err(),
            "no normalisation"
        );
        assert!(finish(&a, &cb("code=x&state=wrong&iss=https%3A%2F%2Fas.example")).is_err());
        assert!(
            finish(
                &a,
                &cb(&format!(
                    "error=access_denied&state={st}&iss=https%3A%2F%2Fevil.example"
                ))
            )
            .is_err()
        );
        assert!(
            finish(
                &a,
                &cb(&format!(
                    "code=x&code=y&state={st}&iss=https%3A%2F%2Fas.example"
                ))
            )
            .is_err()
        );
        let b = start(&meta(false), &client(), "http://127.0.0.1:9/cb", "r", None).unwrap();
        let st = &b.state;
        assert!(
            finish(&b, &cb(&format!("code=x&state={st}"))).is_ok(),
            "not promised, absent: fine"
        );
        assert!(
            finish(
                &b,
                &cb(&format!(
                    "code=x&state={st}&iss=https%3A%2F%2Fother.example"
                ))
            )
            .is_err()
        );
    }

    #[test]
    fn scope_priority_is_operator_config_challenge_resource_server() {
        let rs = vec!["mcp:basic".to_owned(), "mcp:read".to_owned()];
        let ss = vec!["a".to_owned(), "offline_access".to_owned()];
        assert_eq!(
            choose_scope(Some("x y"), Some("c"), Some("ch"), &rs, &ss).as_deref(),
            Some("x y")
        );
        assert_eq!(
            choose_scope(None, Some("c"), Some("ch"), &rs, &ss).as_deref(),
            Some("c")
        );
        assert_eq!(
            choose_scope(None, None, Some("ch"), &rs, &ss).as_deref(),
            Some("ch")
        );
        assert_eq!(
            choose_scope(None, None, None, &rs, &ss).as_deref(),
            Some("mcp:basic mcp:read")
        );
        assert_eq!(
            choose_scope(None, None, None, &[], &ss).as_deref(),
            Some("a")
        );
        assert_eq!(choose_scope(None, None, None, &[], &[]), None);
    }

    #[test]
    fn secrets_only_go_to_the_issuers_origin() {
        let same = EndpointUrl::parse("https://as.example/oauth/token").unwrap();
        let other = EndpointUrl::parse("https://tokens.other.example/token").unwrap();
        assert!(same_origin_secret("https://as.example", &same));
        assert!(!same_origin_secret("https://as.example", &other));
        let c = OAuthClient {
            secret: Some(SecretString::from("s3cr3t-value".to_owned())),
            ..client()
        };
        assert!(!format!("{c:?}").contains("s3cr3t"));
    }
}
