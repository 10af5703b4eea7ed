//! The authorization-code flow: client registration, the authorization request with PKCE S256
//! and a random `state`, the checks on the authorization response (state, RFC 9207 `iss`), and
//! the token endpoint (code exchange, refresh, revocation) with `resource` on every request.
//!
//! Rules kept here:
//! - registration order: pre-registered → client ID metadata document → dynamic registration;
//!   a forced `cimd` or `dcr` never falls back to the other;
//! - a client secret goes only to a token endpoint on the same origin as the issuer it was
//!   registered with (`same_origin_secret`), and a login whose confidential client would have
//!   to send it elsewhere stops before the browser is involved (`check_secret_destination`);
//! - a token response is used only when it is whole and sane (`parse_tokens`): a non-empty
//!   visible-ASCII `access_token` of at most [`MAX_TOKEN_BYTES`], `token_type` Bearer, an
//!   `expires_in` between 1 s and [`MAX_EXPIRES_IN_SECS`], a `scope` of RFC 6749 scope tokens;
//!   a successful response that breaks a rule has its tokens revoked, never silently dropped;
//! - `iss`: if the server advertises it, it must be present and equal; if present anyway, equal;
//!   comparison is exact (no normalisation); on a mismatch the code is never redeemed;
//! - scope choice: operator's, else the challenge's, else the resource's `scopes_supported`,
//!   else none (omitted); `offline_access` is never added.

use std::fmt;
use std::sync::Arc;

use base64::Engine;
use reqwest::Method;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use iteron_policy::url::EndpointUrl;

use super::jose::SigningKey;
use super::metadata::ServerMetadata;
use super::{MAX_OAUTH_BODY, OAuthError, Revoked, host_of};
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
    /// An RFC 7523 client assertion signed with the client's private key.
    PrivateKeyJwt,
}

impl TokenAuth {
    /// The RFC 7591 spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenAuth::None => "none",
            TokenAuth::Basic => "client_secret_basic",
            TokenAuth::Post => "client_secret_post",
            TokenAuth::PrivateKeyJwt => "private_key_jwt",
        }
    }

    /// Parse the RFC 7591 spelling.
    pub fn parse(s: &str) -> Option<TokenAuth> {
        match s {
            "none" => Some(TokenAuth::None),
            "client_secret_basic" => Some(TokenAuth::Basic),
            "client_secret_post" => Some(TokenAuth::Post),
            "private_key_jwt" => Some(TokenAuth::PrivateKeyJwt),
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
    /// The private key of a `private_key_jwt` client (never stored by Iteron: it is read from
    /// where the operator named it).
    pub key: Option<Arc<SigningKey>>,
    /// The DPoP key its tokens are bound to (`oauth.dpop`): every token request carries a
    /// proof, and only DPoP-bound tokens are accepted.
    pub dpop: Option<Arc<super::dpop::DpopKey>>,
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
            .field("key", &self.key.as_ref().map(|k| k.alg()))
            .field("dpop", &self.dpop.as_ref().map(|k| k.thumbprint()))
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
    /// Its private key (`private_key_jwt`), instead of a secret.
    pub client_key: Option<Arc<SigningKey>>,
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
    let mut url = meta
        .authorization_endpoint
        .as_ref()
        .ok_or(OAuthError::Malformed(
            "authorization-server metadata (no authorization_endpoint)",
        ))?
        .as_url()
        .clone();
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

/// Whether a request that reached the loopback callback is the answer to the attempt whose
/// `state` is given: exactly one `state` parameter, equal to it, and a `code` or an `error`.
/// Anything else (another, a repeated or no state; neither code nor error) did not come from
/// the authorization server for this login and is ignored — it can neither redeem a code nor
/// end the login. A response that passes is then checked whole by [`finish`].
pub fn answers_state(state: &str, callback: &str) -> bool {
    let Ok(url) = url::Url::parse(callback) else {
        return false;
    };
    let (mut states, mut matching, mut answer) = (0usize, false, false);
    for (k, v) in url.query_pairs() {
        match k.as_ref() {
            "state" => {
                states += 1;
                matching = v == state;
            }
            "code" | "error" => answer = true,
            _ => {}
        }
    }
    states == 1 && matching && answer
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

/// Longest access token, refresh token or client secret accepted, in bytes.
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;
/// Longest access-token lifetime accepted (`expires_in`): one year. Longer is absurd for a
/// bearer token and is refused, as is a negative, zero or non-integer value.
pub const MAX_EXPIRES_IN_SECS: u64 = 366 * 24 * 60 * 60;
/// Longest `scope` accepted in a token response, in bytes.
pub const MAX_SCOPE_BYTES: usize = 4 * 1024;

/// Whether `s` can be a token: non-empty visible ASCII (`!` to `~`: no space, no control, no
/// non-ASCII) of at most [`MAX_TOKEN_BYTES`]. It goes into an `Authorization` header and a
/// credential file, and nothing else fits either safely.
fn is_token_text(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_TOKEN_BYTES && s.bytes().all(|b| b.is_ascii_graphic())
}

/// Tokens from the token endpoint, validated ([`parse_tokens`]). Never shown.
pub struct Tokens {
    /// The access token (visible ASCII, at most [`MAX_TOKEN_BYTES`]).
    pub access: SecretString,
    /// The refresh token, if one was issued (the same rules).
    pub refresh: Option<SecretString>,
    /// Lifetime in seconds, if given: 1 to [`MAX_EXPIRES_IN_SECS`].
    pub expires_in: Option<u64>,
    /// The granted scope, if given: RFC 6749 scope tokens joined by one space.
    pub scope: Option<String>,
}

impl Tokens {
    /// When the access token expires, in unix seconds, counted from `now` (no overflow: the
    /// lifetime is bounded and the sum saturates).
    pub fn expires_at(&self, now: u64) -> Option<u64> {
        self.expires_in.map(|e| now.saturating_add(e))
    }
}

/// Validate a successful token response (RFC 6749 §5.1) for a Bearer token. `Err` names the
/// rule it broke.
pub fn parse_tokens(doc: &Value) -> Result<Tokens, &'static str> {
    parse_tokens_as(doc, false)
}

/// Validate a successful token response; with `dpop`, the token must be DPoP-bound
/// (`token_type` DPoP), never a Bearer token: a sender-constrained login is never silently
/// weakened.
pub fn parse_tokens_as(doc: &Value, dpop: bool) -> Result<Tokens, &'static str> {
    let access = match doc.get("access_token") {
        Some(Value::String(s)) if is_token_text(s) => SecretString::from(s.to_owned()),
        Some(Value::String(s)) if s.len() > MAX_TOKEN_BYTES => {
            return Err("its access_token is longer than 16 KiB");
        }
        Some(Value::String(_)) => {
            return Err("its access_token is empty or not visible ASCII");
        }
        _ => return Err("it has no access_token string"),
    };
    match doc.get("token_type").and_then(Value::as_str) {
        Some(t) if t.eq_ignore_ascii_case("bearer") && !dpop => {}
        Some(t) if t.eq_ignore_ascii_case("dpop") && dpop => {}
        // A sender-constrained token that was not asked for cannot be used as one (its key
        // is not Iteron's), and a Bearer token where DPoP was asked for is weaker than asked.
        Some(t) if t.eq_ignore_ascii_case("dpop") => {
            return Err("its token_type is DPoP, which was not asked for");
        }
        Some(t) if t.eq_ignore_ascii_case("bearer") => {
            return Err("its token_type is Bearer, but a DPoP-bound token was asked for");
        }
        Some(_) if dpop => return Err("its token_type is not DPoP"),
        Some(_) => return Err("its token_type is not Bearer"),
        None => return Err("it has no token_type"),
    }
    let refresh = match doc.get("refresh_token") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if is_token_text(s) => Some(SecretString::from(s.to_owned())),
        Some(Value::String(s)) if s.len() > MAX_TOKEN_BYTES => {
            return Err("its refresh_token is longer than 16 KiB");
        }
        Some(_) => return Err("its refresh_token is empty or not visible ASCII"),
    };
    let expires_in = match doc.get("expires_in") {
        None | Some(Value::Null) => None,
        Some(v) => {
            // An integer, or (as some servers send it) a string of at most 10 digits.
            let n = match v {
                Value::Number(n) => n.as_u64(),
                Value::String(s) if !s.is_empty() && s.len() <= 10 => s
                    .bytes()
                    .all(|b| b.is_ascii_digit())
                    .then(|| s.parse().ok())
                    .flatten(),
                _ => None,
            };
            match n {
                Some(n) if (1..=MAX_EXPIRES_IN_SECS).contains(&n) => Some(n),
                _ => {
                    return Err(
                        "its expires_in is not a whole number of seconds from 1 to one year",
                    );
                }
            }
        }
    };
    let scope = match doc.get("scope") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.len() <= MAX_SCOPE_BYTES => {
            let tokens: Vec<&str> = s.split(' ').filter(|t| !t.is_empty()).collect();
            if tokens
                .iter()
                .any(|t| iteron_policy::config::Scope::parse(t).is_err())
            {
                return Err("its scope is not a list of RFC 6749 scope tokens");
            }
            Some(tokens.join(" "))
        }
        Some(_) => return Err("its scope is not a string of at most 4 KiB"),
    };
    Ok(Tokens {
        access,
        refresh,
        expires_in,
        scope,
    })
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens")
            .field("expires_in", &self.expires_in)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

/// Whether a secret may go to `endpoint`: only on the issuer's own origin.
///
/// "Origin" is RFC 6454's: the scheme, host and port of both URLs as the WHATWG URL parser
/// reads them (scheme and host lowercased, international names IDNA-encoded, every spelling of
/// an IPv4 address made canonical, the default port implied), compared exactly. Another scheme
/// (`http` against `https`), another port, a subdomain or parent domain, a trailing-dot
/// spelling of a name, or a name against an IP address (even one it resolves to) are all
/// other origins; the path and query never matter. The issuer
/// is the one the operator pinned (`--oauth-issuer`, `oauth.issuer`) — a pre-registered
/// secret is refused without one — or, for a dynamically registered confidential client,
/// the issuer whose metadata was fetched and checked for it.
pub fn same_origin_secret(issuer: &str, endpoint: &EndpointUrl) -> bool {
    url::Url::parse(issuer).is_ok_and(|i| i.origin() == endpoint.as_url().origin())
}

/// A client that holds a secret must be able to use it where it is going: its token endpoint
/// must be on the issuer's own origin ([`same_origin_secret`]). Checked before the operator is
/// sent to authorize, so a login that could only fail (or leak the secret) stops first.
pub fn check_secret_destination(
    meta: &ServerMetadata,
    client: &OAuthClient,
) -> Result<(), OAuthError> {
    if (client.secret.is_some() || client.key.is_some())
        && client.auth != TokenAuth::None
        && !same_origin_secret(&meta.issuer, &meta.token_endpoint)
    {
        return Err(OAuthError::BadEndpoint {
            which: "token_endpoint",
            host: host_of(meta.token_endpoint.as_str()),
            why: "it is on another origin than the issuer, and a client secret is only ever sent \
                  to the issuer's own origin (scheme, host and port)"
                .into(),
        });
    }
    Ok(())
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
        // A workload without a client id sends none.
        (TokenAuth::None, _) if client.id.is_empty() => {}
        (TokenAuth::None, _) => form.push(("client_id", client.id.clone())),
        (TokenAuth::PrivateKeyJwt, _) => {
            let Some(key) = &client.key else {
                if missing == MissingSecret::IdOnly {
                    form.push(("client_id", client.id.clone()));
                } else {
                    return Err(OAuthError::NoRegistration(
                        "a private_key_jwt client has no key",
                    ));
                }
                return finish_form(req, form);
            };
            // The assertion authenticates the client for a minute: it goes where a secret may.
            if !same_origin_secret(&meta.issuer, endpoint) {
                return Err(OAuthError::BadEndpoint {
                    which,
                    host: host_of(endpoint.as_str()),
                    why: "a client assertion is only sent to the issuer's own origin".into(),
                });
            }
            form.push(("client_id", client.id.clone()));
            form.push((
                "client_assertion_type",
                "urn:ietf:params:oauth:client-assertion-type:jwt-bearer".to_owned(),
            ));
            form.push((
                "client_assertion",
                client_assertion(key, &client.id, &meta.issuer)?,
            ));
        }
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
                    host: host_of(endpoint.as_str()),
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
    finish_form(req, form)
}

/// Encode `form` as the body of `req`, zeroizing every working copy.
fn finish_form(
    mut req: Request,
    mut form: Vec<(&'static str, String)>,
) -> Result<Request, OAuthError> {
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

/// How long a client assertion is valid.
pub const CLIENT_ASSERTION_LIFETIME_SECS: u64 = 60;

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// An RFC 7523 client assertion (RFC 7523bis: the audience is the issuer identifier): `iss`
/// and `sub` the client id, a random `jti`, valid for [`CLIENT_ASSERTION_LIFETIME_SECS`].
pub fn client_assertion(
    key: &SigningKey,
    client_id: &str,
    issuer: &str,
) -> Result<String, OAuthError> {
    let now = unix_now();
    key.sign(
        &json!({"typ": "JWT"}),
        &json!({
            "iss": client_id,
            "sub": client_id,
            "aud": issuer,
            "jti": random_token(24)?,
            "iat": now,
            "exp": now.saturating_add(CLIENT_ASSERTION_LIFETIME_SECS),
        }),
    )
    .map_err(|_| OAuthError::Malformed("client assertion (signing failed)"))
}

async fn token_request(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    form: Vec<(&'static str, String)>,
) -> Result<Tokens, OAuthError> {
    // The form holds the code, refresh token or assertion: wiped however this returns.
    let form = WipedForm(form);
    let mut nonce_retried = false;
    let doc = loop {
        let mut req = client_post(
            meta,
            client,
            &meta.token_endpoint,
            "token_endpoint",
            form.0.clone(),
            MissingSecret::Refuse,
        )?;
        req.headers
            .insert(ACCEPT, HeaderValue::from_static("application/json"));
        if let Some(key) = &client.dpop {
            // A fresh proof for every request, with the server's last nonce.
            let proof = key
                .proof(
                    "POST",
                    meta.token_endpoint.as_url(),
                    None,
                    key.as_nonce().as_deref(),
                )
                .map_err(|_| OAuthError::Malformed("DPoP proof (signing failed)"))?;
            req.headers.insert(
                reqwest::header::HeaderName::from_static(super::dpop::DPOP_HEADER),
                HeaderValue::from_str(&proof).map_err(|_| OAuthError::Malformed("DPoP proof"))?,
            );
        }
        let resp = http.send(req).await?;
        let status = resp.status().as_u16();
        let offered = resp
            .headers()
            .get(super::dpop::NONCE_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|n| super::dpop::valid_nonce(n))
            .map(str::to_owned);
        let bytes = zeroize::Zeroizing::new(resp.body(MAX_OAUTH_BODY).await?);
        let doc: Value =
            serde_json::from_slice(&bytes).map_err(|_| OAuthError::Malformed("token response"))?;
        if let (Some(key), Some(n)) = (&client.dpop, &offered) {
            key.set_as_nonce(n);
        }
        if !(200..300).contains(&status) {
            let err = server_error(&doc, status);
            // RFC 9449 §8: the server refused the request before acting on it and named the
            // nonce to use: send it once more, with a new proof carrying that nonce.
            if let (Some(_), Some(_), OAuthError::Server { error, .. }) =
                (&client.dpop, &offered, &err)
                && error == super::dpop::USE_DPOP_NONCE
                && !nonce_retried
            {
                nonce_retried = true;
                continue;
            }
            return Err(err);
        }
        break doc;
    };
    drop(form);
    match parse_tokens_as(&doc, client.dpop.is_some()) {
        Ok(tokens) => Ok(tokens),
        Err(why) => {
            // The server granted something Iteron will not hold: revoke what it sent rather
            // than leave a live grant behind.
            let revoked = revoke_unusable(http, meta, client, &doc).await;
            Err(OAuthError::UnusableTokens { why, revoked })
        }
    }
}

/// A form whose values are zeroized when it is dropped.
struct WipedForm(Vec<(&'static str, String)>);

impl Drop for WipedForm {
    fn drop(&mut self) {
        for (_, v) in &mut self.0 {
            zeroize::Zeroize::zeroize(v);
        }
    }
}

/// Revoke every token string a refused token response carried (refresh token first: at most
/// servers that ends the whole grant), whatever its shape.
async fn revoke_unusable(
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

/// The client-credentials grant (RFC 6749 §4.4) with `resource` and, when chosen, `scope`.
/// Only a confidential client (a secret or a key) may use it.
pub async fn client_credentials(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    resource: &str,
    scope: Option<&str>,
) -> Result<Tokens, OAuthError> {
    if client.auth == TokenAuth::None {
        return Err(OAuthError::NoRegistration(
            "the client-credentials grant needs a client secret or key",
        ));
    }
    let mut form = vec![
        ("grant_type", "client_credentials".to_owned()),
        ("resource", resource.to_owned()),
    ];
    if let Some(s) = scope {
        form.push(("scope", s.to_owned()));
    }
    token_request(http, meta, client, form).await
}

/// The RFC 7523 JWT-bearer grant type.
pub const JWT_BEARER_GRANT: &str = "urn:ietf:params:oauth:grant-type:jwt-bearer";

/// The RFC 7523 §2.1 JWT-bearer grant: `assertion` (a workload identity token, or an ID-JAG)
/// exchanged for an access token, with `resource` and, when chosen, `scope`. A client without
/// a secret or key identifies itself by id (when it has one).
pub async fn jwt_bearer(
    http: &ZoneClient,
    meta: &ServerMetadata,
    client: &OAuthClient,
    assertion: &SecretString,
    resource: &str,
    scope: Option<&str>,
) -> Result<Tokens, OAuthError> {
    let mut form = vec![
        ("grant_type", JWT_BEARER_GRANT.to_owned()),
        ("assertion", assertion.expose_secret().to_owned()),
        ("resource", resource.to_owned()),
    ];
    if let Some(s) = scope {
        form.push(("scope", s.to_owned()));
    }
    token_request(http, meta, client, form).await
}

/// The RFC 8693 token-exchange grant type.
pub const TOKEN_EXCHANGE_GRANT: &str = "urn:ietf:params:oauth:grant-type:token-exchange";
/// The token type of an ID token (the subject of the exchange).
pub const ID_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:id_token";
/// The token type of an Identity Assertion JWT Authorization Grant.
pub const ID_JAG_TYPE: &str = "urn:ietf:params:oauth:token-type:id-jag";

/// Enterprise-managed authorization, first step: exchange the user's ID token at the identity
/// provider's token endpoint (RFC 8693) for an ID-JAG addressed to `audience` (the
/// authorization server's issuer) for `resource`. The answer must say `issued_token_type` is
/// an ID-JAG and carry it as one compact JWT of at most [`MAX_TOKEN_BYTES`]; it is an assertion
/// for the next grant, never presented to a resource.
pub async fn exchange_for_id_jag(
    http: &ZoneClient,
    idp: &ServerMetadata,
    client: &OAuthClient,
    id_token: &SecretString,
    audience: &str,
    resource: &str,
    scope: Option<&str>,
) -> Result<SecretString, OAuthError> {
    let mut form = vec![
        ("grant_type", TOKEN_EXCHANGE_GRANT.to_owned()),
        ("requested_token_type", ID_JAG_TYPE.to_owned()),
        ("subject_token", id_token.expose_secret().to_owned()),
        ("subject_token_type", ID_TOKEN_TYPE.to_owned()),
        ("audience", audience.to_owned()),
        ("resource", resource.to_owned()),
    ];
    if let Some(s) = scope {
        form.push(("scope", s.to_owned()));
    }
    let mut req = client_post(
        idp,
        client,
        &idp.token_endpoint,
        "token_endpoint",
        form,
        MissingSecret::Refuse,
    )?;
    req.headers
        .insert(ACCEPT, HeaderValue::from_static("application/json"));
    let resp = http.send(req).await?;
    let status = resp.status().as_u16();
    let bytes = zeroize::Zeroizing::new(resp.body(MAX_OAUTH_BODY).await?);
    let doc: Value = serde_json::from_slice(&bytes)
        .map_err(|_| OAuthError::Malformed("token exchange response"))?;
    if !(200..300).contains(&status) {
        return Err(server_error(&doc, status));
    }
    if doc.get("issued_token_type").and_then(Value::as_str) != Some(ID_JAG_TYPE) {
        return Err(OAuthError::Malformed(
            "token exchange response (issued_token_type is not an ID-JAG)",
        ));
    }
    match doc.get("access_token").and_then(Value::as_str) {
        Some(t) if is_token_text(t) && t.split('.').count() == 3 => {
            Ok(SecretString::from(t.to_owned()))
        }
        _ => Err(OAuthError::Malformed(
            "token exchange response (the ID-JAG is not one compact JWT of at most 16 KiB)",
        )),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(iss_supported: bool) -> ServerMetadata {
        ServerMetadata {
            issuer: "https://as.example".into(),
            authorization_endpoint: Some(
                EndpointUrl::parse("https://as.example/authorize").unwrap(),
            ),
            token_endpoint: EndpointUrl::parse("https://as.example/token").unwrap(),
            registration_endpoint: None,
            revocation_endpoint: None,
            token_endpoint_auth_methods: vec![],
            scopes_supported: vec![],
            cimd_supported: false,
            iss_parameter_supported: iss_supported,
            grant_types_supported: vec![],
        }
    }

    fn client() -> OAuthClient {
        OAuthClient {
            id: "c1".into(),
            secret: None,
            key: None,
            dpop: None,
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

    fn doc(patch: Value) -> Value {
        let mut v = json!({"access_token": "at", "token_type": "Bearer"});
        if let (Value::Object(p), Some(o)) = (patch, v.as_object_mut()) {
            for (k, x) in p {
                o.insert(k, x);
            }
        }
        v
    }

    #[test]
    fn token_responses_are_validated_at_every_bound_and_one_over() {
        // access_token and refresh_token: visible ASCII, 1 to MAX_TOKEN_BYTES.
        for key in ["access_token", "refresh_token"] {
            let exact = "a".repeat(MAX_TOKEN_BYTES);
            assert!(
                parse_tokens(&doc(json!({key: exact}))).is_ok(),
                "{key} at the limit"
            );
            let over = "a".repeat(MAX_TOKEN_BYTES + 1);
            assert_eq!(
                parse_tokens(&doc(json!({key: over}))).err(),
                Some(if key == "access_token" {
                    "its access_token is longer than 16 KiB"
                } else {
                    "its refresh_token is longer than 16 KiB"
                })
            );
            for bad in ["", "a b", "a\u{1b}[2J", "caf\u{e9}", "a\tb", "\u{202e}x"] {
                assert!(
                    parse_tokens(&doc(json!({key: bad}))).is_err(),
                    "{key} {bad:?}"
                );
            }
            assert!(
                parse_tokens(&doc(json!({key: 42}))).is_err(),
                "{key} as a number"
            );
        }
        assert!(parse_tokens(&json!({"token_type": "Bearer"})).is_err());
        assert!(
            parse_tokens(&doc(json!({"refresh_token": null})))
                .unwrap()
                .refresh
                .is_none()
        );
        // token_type: Bearer in any case; DPoP was never asked for; anything else or none is
        // refused.
        for ok in ["Bearer", "bearer", "BEARER"] {
            assert!(
                parse_tokens(&doc(json!({"token_type": ok}))).is_ok(),
                "{ok}"
            );
        }
        for bad in [
            json!("DPoP"),
            json!("dpop"),
            json!("mac"),
            json!(""),
            json!(1),
        ] {
            assert!(
                parse_tokens(&doc(json!({"token_type": bad}))).is_err(),
                "{bad}"
            );
        }
        let mut none = doc(json!({}));
        none.as_object_mut().unwrap().remove("token_type");
        assert_eq!(parse_tokens(&none).err(), Some("it has no token_type"));
        // expires_in: 1 to MAX_EXPIRES_IN_SECS, an integer or a string of digits.
        let lifetime =
            |v: Value| parse_tokens(&doc(json!({"expires_in": v}))).map(|t| t.expires_in);
        assert_eq!(lifetime(json!(1)), Ok(Some(1)));
        assert_eq!(
            lifetime(json!(MAX_EXPIRES_IN_SECS)),
            Ok(Some(MAX_EXPIRES_IN_SECS))
        );
        assert_eq!(lifetime(json!("3600")), Ok(Some(3600)));
        assert_eq!(lifetime(Value::Null), Ok(None));
        for bad in [
            json!(0),
            json!(-1),
            json!(MAX_EXPIRES_IN_SECS + 1),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(3600.5),
            json!(1e300),
            json!("-5"),
            json!("36O0"),
            json!("99999999999"),
            json!(""),
            json!(true),
        ] {
            assert!(lifetime(bad.clone()).is_err(), "{bad}");
        }
        // Added to a clock near the end of time, nothing wraps.
        let t = parse_tokens(&doc(json!({"expires_in": MAX_EXPIRES_IN_SECS}))).unwrap();
        assert_eq!(t.expires_at(u64::MAX - 5), Some(u64::MAX));
        assert_eq!(t.expires_at(1000), Some(1000 + MAX_EXPIRES_IN_SECS));
        // scope: scope tokens only, at most MAX_SCOPE_BYTES.
        let scope = |v: Value| parse_tokens(&doc(json!({"scope": v}))).map(|t| t.scope);
        assert_eq!(scope(json!("a  b:c")), Ok(Some("a b:c".to_owned())));
        let many = vec!["abcdefg"; MAX_SCOPE_BYTES / 8].join(" ");
        let exact = format!("{many} ");
        assert_eq!(exact.len(), MAX_SCOPE_BYTES);
        assert_eq!(scope(json!(exact)), Ok(Some(many.clone())));
        let over = format!("{many} x");
        assert_eq!(over.len(), MAX_SCOPE_BYTES + 1);
        assert!(scope(json!(over)).is_err());
        assert!(
            scope(json!("a".repeat(257))).is_err(),
            "one token is at most 256 bytes"
        );
        for bad in [
            "a\u{1b}[2J",
            "a\rb",
            "a\"b",
            "a\\b",
            "\u{202e}a",
            "a\u{9b}b",
            "caf\u{e9}",
        ] {
            assert!(scope(json!(bad)).is_err(), "{bad:?}");
        }
        iteron_test_support::record!(
            "P5",
            json!({"max_token_bytes": MAX_TOKEN_BYTES, "max_expires_in": MAX_EXPIRES_IN_SECS,
                   "max_scope_bytes": MAX_SCOPE_BYTES}),
        );
    }

    #[test]
    fn a_state_answers_an_attempt_only_once_and_with_a_code_or_an_error() {
        let cb = |q: &str| format!("http://127.0.0.1:9/callback?{q}");
        assert!(answers_state("s1", &cb("code=c&state=s1")));
        assert!(answers_state("s1", &cb("error=access_denied&state=s1")));
        for stray in [
            "code=c&state=s2",
            "code=c",
            "state=s1",
            "code=c&state=",
            "code=c&state=s1&state=s1",
            "code=c&state=s1x",
            "code=c&STATE=s1",
        ] {
            assert!(!answers_state("s1", &cb(stray)), "{stray}");
        }
        assert!(!answers_state("s1", "not a url"));
    }

    #[test]
    fn secrets_only_go_to_the_issuers_origin() {
        let same = EndpointUrl::parse("https://as.example/oauth/token").unwrap();
        let other = EndpointUrl::parse("https://tokens.other.example/token").unwrap();
        assert!(same_origin_secret("https://as.example", &same));
        assert!(!same_origin_secret("https://as.example", &other));
        // The origin as the URL parser reads it: default port, case, path.
        for same in [
            "https://as.example:443/token",
            "https://AS.Example/t?x=1",
            "HTTPS://as.example/",
        ] {
            assert!(
                same_origin_secret(
                    "https://as.example/tenant",
                    &EndpointUrl::parse(same).unwrap()
                ),
                "{same}"
            );
        }
        for other in [
            "https://as.example:8443/token",
            "https://login.as.example/token",
            "https://example/token",
            "https://as.example./token",
            "http://127.0.0.1/token",
        ] {
            assert!(
                !same_origin_secret("https://as.example", &EndpointUrl::parse(other).unwrap()),
                "{other}"
            );
        }
        assert!(same_origin_secret(
            "http://127.0.0.1:8080",
            &EndpointUrl::parse("http://0x7f.0.0.1:8080/token").unwrap()
        ));
        assert!(!same_origin_secret(
            "http://127.0.0.1:8080",
            &EndpointUrl::parse("http://localhost:8080/token").unwrap()
        ));
        let c = OAuthClient {
            secret: Some(SecretString::from("s3cr3t-value".to_owned())),
            ..client()
        };
        assert!(!format!("{c:?}").contains("s3cr3t"));
    }
}
