//! The authorization request (PKCE S256, a random `state`) and the checks on its response
//! (state, RFC 9207 `iss`) before a code is redeemed.
#![forbid(unsafe_code)]

use super::*;

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
    pub(super) verifier: SecretString,
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
