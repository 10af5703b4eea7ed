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
//!
//! Its parts: [`registration`] (the client), [`authorize`] (the request and its response),
//! [`tokens`] (token responses), [`revocation`]; the token endpoint grants stay here.

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

mod authorize;
mod registration;
mod revocation;
mod tokens;
pub use authorize::*;
pub use registration::*;
pub use revocation::*;
pub use tokens::*;

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

/// Make `client` ready to ask for tokens: a fresh DPoP key when the login is DPoP-bound (held
/// only by the broker), then [`check_secret_destination`].
pub fn ready_client(
    meta: &ServerMetadata,
    client: &mut OAuthClient,
    dpop: bool,
) -> Result<(), OAuthError> {
    if dpop {
        client.dpop = Some(std::sync::Arc::new(
            super::dpop::DpopKey::generate()
                .map_err(|_| OAuthError::Malformed("DPoP key (generation failed)"))?,
        ));
    }
    check_secret_destination(meta, client)
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
