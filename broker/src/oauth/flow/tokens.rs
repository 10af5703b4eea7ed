//! Token responses: used only when whole and sane ([`parse_tokens`]).
#![forbid(unsafe_code)]

use super::*;

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
pub(super) fn is_token_text(s: &str) -> bool {
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
