//! DPoP (RFC 9449): sender-constrained tokens. With `oauth.dpop`, every token Iteron obtains is
//! bound to a P-256 key the broker generated for that login or grant and keeps only in the
//! credential store (file or keyring, like the tokens); a stolen access or refresh token is
//! useless without it.
//!
//! A proof is a fresh `dpop+jwt` JWS for one request: the public key in its header, a random
//! `jti`, `htm` (the method), `htu` (the URL without query or fragment), `iat`, the server's
//! `nonce` when it gave one, and for a resource request `ath` (the access token's SHA-256).
//! A server that wants a nonce refuses the request with `use_dpop_nonce` and a `DPoP-Nonce`
//! header: the request is sent once more with a new proof carrying that nonce. That is not a
//! retry of an effect — the server refused the request before acting on it — and it happens
//! at most once per request. Nonces a server offers on any answer are kept for the next proof.

use std::fmt;
use std::sync::Mutex;

use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::jose::{KeyError, SigningKey, b64url};

/// The header that carries a proof, and the one that carries a server's nonce.
pub const DPOP_HEADER: &str = "dpop";
/// The header a server sends a nonce in.
pub const NONCE_HEADER: &str = "dpop-nonce";
/// The error code of a server that wants a (new) nonce.
pub const USE_DPOP_NONCE: &str = "use_dpop_nonce";
/// Longest nonce accepted from a server, in bytes.
pub const MAX_NONCE_BYTES: usize = 1024;

/// Whether `s` is a nonce Iteron puts into a proof: RFC 9449 §8.1 `1*NQCHAR` (visible ASCII
/// without `"` and `\`), at most [`MAX_NONCE_BYTES`].
pub fn valid_nonce(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NONCE_BYTES
        && s.bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
}

/// `htu`: the URL without query and fragment (RFC 9449 §4.2).
pub fn htu(url: &url::Url) -> String {
    let mut u = url.clone();
    u.set_query(None);
    u.set_fragment(None);
    u.to_string()
}

/// `ath`: base64url of the SHA-256 of the access token (RFC 9449 §4.2).
pub fn ath(access_token: &SecretString) -> String {
    b64url(&Sha256::digest(access_token.expose_secret().as_bytes()))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A DPoP key: the P-256 signing key, its public JWK, and its PKCS#8 form for the credential
/// store. Never shown.
pub struct DpopKey {
    key: SigningKey,
    jwk: Value,
    der: Zeroizing<Vec<u8>>,
    /// The last nonce the authorization server gave.
    as_nonce: Mutex<Option<String>>,
}

impl fmt::Debug for DpopKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DpopKey")
            .field("thumbprint", &self.thumbprint())
            .finish_non_exhaustive()
    }
}

impl DpopKey {
    /// A new key.
    pub fn generate() -> Result<DpopKey, KeyError> {
        let (key, der) = SigningKey::generate_es256()?;
        DpopKey::with(key, der)
    }

    /// The key stored as PKCS#8 DER (a P-256 key only).
    pub fn from_der(der: &[u8]) -> Result<DpopKey, KeyError> {
        let key = SigningKey::from_pkcs8_der(der)?;
        DpopKey::with(key, Zeroizing::new(der.to_vec()))
    }

    fn with(key: SigningKey, der: Zeroizing<Vec<u8>>) -> Result<DpopKey, KeyError> {
        let jwk = key.public_jwk().ok_or(KeyError::Unsupported)?;
        Ok(DpopKey {
            key,
            jwk,
            der,
            as_nonce: Mutex::new(None),
        })
    }

    /// The key as stored: base64url of its PKCS#8 DER (a secret).
    pub fn stored(&self) -> SecretString {
        SecretString::from(b64url(&self.der))
    }

    /// A key read back from [`DpopKey::stored`].
    pub fn from_stored(s: &SecretString) -> Result<DpopKey, KeyError> {
        use base64::Engine;
        let der = Zeroizing::new(
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(s.expose_secret().as_bytes())
                .map_err(|_| KeyError::NotPkcs8("the stored DPoP key is not base64url"))?,
        );
        DpopKey::from_der(&der)
    }

    /// The RFC 7638 thumbprint (`jkt`) of the public key.
    pub fn thumbprint(&self) -> String {
        self.key.thumbprint().unwrap_or_default()
    }

    /// A fresh proof for `method` `url`, bound to `access_token` (resource requests) and
    /// carrying `nonce` when the server gave one.
    pub fn proof(
        &self,
        method: &str,
        url: &url::Url,
        access_token: Option<&SecretString>,
        nonce: Option<&str>,
    ) -> Result<String, KeyError> {
        let mut claims = json!({
            "jti": super::flow::random_token(24).map_err(|_| KeyError::Crypto)?,
            "htm": method,
            "htu": htu(url),
            "iat": unix_now(),
        });
        if let Some(obj) = claims.as_object_mut() {
            if let Some(t) = access_token {
                obj.insert("ath".into(), ath(t).into());
            }
            if let Some(n) = nonce {
                obj.insert("nonce".into(), n.into());
            }
        }
        self.key
            .sign(&json!({"typ": "dpop+jwt", "jwk": self.jwk}), &claims)
    }

    /// The authorization server's last nonce.
    pub fn as_nonce(&self) -> Option<String> {
        self.as_nonce.lock().ok().and_then(|n| n.clone())
    }

    /// Keep a nonce the authorization server gave (ignored unless [`valid_nonce`]).
    pub fn set_as_nonce(&self, nonce: &str) {
        if valid_nonce(nonce)
            && let Ok(mut n) = self.as_nonce.lock()
        {
            *n = Some(nonce.to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oauth::jose::decode_unverified;

    #[test]
    fn a_proof_is_fresh_and_bound_to_method_url_token_and_nonce() {
        let k = DpopKey::generate().unwrap();
        let url = url::Url::parse("https://mcp.example/mcp?tenant=1#frag").unwrap();
        let token = SecretString::from("at-123".to_owned());
        let a = k.proof("POST", &url, Some(&token), Some("n-1")).unwrap();
        let b = k.proof("POST", &url, Some(&token), Some("n-1")).unwrap();
        let (h, c) = decode_unverified(&a).unwrap();
        assert_eq!(h["typ"], "dpop+jwt");
        assert_eq!(h["alg"], "ES256");
        assert_eq!(h["jwk"]["kty"], "EC");
        assert!(
            h["jwk"].get("d").is_none(),
            "the private key is in the proof"
        );
        assert_eq!(c["htm"], "POST");
        assert_eq!(c["htu"], "https://mcp.example/mcp");
        assert_eq!(c["nonce"], "n-1");
        // ath: base64url(SHA-256("at-123")), computed independently with Python's hashlib.
        assert_eq!(c["ath"], "pZOyhFN0Z9eQivPyniH1Gg1OzUpcjUffjr7n0FzCLck");
        let (_, c2) = decode_unverified(&b).unwrap();
        assert_ne!(c["jti"], c2["jti"], "a proof was reused");
        // A token-endpoint proof has no ath; no nonce when none was given.
        let (_, c) = decode_unverified(&k.proof("GET", &url, None, None).unwrap()).unwrap();
        assert!(c.get("ath").is_none() && c.get("nonce").is_none());
        assert_eq!(c["htm"], "GET");
        // The stored form reloads the same key.
        let again = DpopKey::from_stored(&k.stored()).unwrap();
        assert_eq!(again.thumbprint(), k.thumbprint());
        assert!(!format!("{k:?}").contains(k.stored().expose_secret()));
    }

    #[test]
    fn nonces_are_nqchar_strings_within_the_bound_and_one_over() {
        assert!(valid_nonce("conformance-as-dpop-nonce"));
        assert!(valid_nonce(&"n".repeat(MAX_NONCE_BYTES)));
        assert!(!valid_nonce(&"n".repeat(MAX_NONCE_BYTES + 1)));
        for bad in ["", "a b", "a\"b", "a\\b", "a\u{1b}", "caf\u{e9}", "a\nb"] {
            assert!(!valid_nonce(bad), "{bad:?}");
        }
        let k = DpopKey::generate().unwrap();
        k.set_as_nonce("a b");
        assert_eq!(k.as_nonce(), None);
        k.set_as_nonce("ok");
        assert_eq!(k.as_nonce().as_deref(), Some("ok"));
        iteron_test_support::record!(
            "P5",
            serde_json::json!({"max_nonce_bytes": MAX_NONCE_BYTES}),
        );
    }
}
