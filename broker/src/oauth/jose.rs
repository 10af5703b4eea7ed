//! Compact JWS signing for what Iteron itself asserts: RFC 7523 client assertions
//! (`private_key_jwt`) and RFC 9449 DPoP proofs. Signing only — Iteron never verifies a token
//! it is given (it forwards them) — with `ring`, the crypto library the TLS stack already uses.
//!
//! Keys: an unencrypted PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`) of a P-256 key (`ES256`) or
//! an RSA key of 2048 to 8192 bits (`RS256`), at most [`MAX_KEY_PEM_BYTES`]; or a P-256 key
//! generated here (DPoP). The private key never leaves [`SigningKey`]: it has no `Debug` of its
//! content and no accessor; the PEM text and the DER bytes pass only through [`Zeroizing`]
//! buffers (ring keeps its own copy of the key material, which it does not wipe).

use std::fmt;

use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, KeyPair, RsaKeyPair};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

/// Largest key PEM accepted, in bytes (an 8192-bit RSA PKCS#8 key is about 6.4 KiB).
pub const MAX_KEY_PEM_BYTES: usize = 16 * 1024;

const PEM_BEGIN: &str = "-----BEGIN PRIVATE KEY-----";
const PEM_END: &str = "-----END PRIVATE KEY-----";

/// Why a key cannot be used. `Display` is one line and never quotes the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    /// Longer than [`MAX_KEY_PEM_BYTES`].
    TooLarge,
    /// Not one unencrypted PKCS#8 PEM block (the fixed text says which form was found).
    NotPkcs8(&'static str),
    /// PKCS#8, but neither a P-256 nor an acceptable RSA key (or inconsistent).
    Unsupported,
    /// The system's randomness or the signer failed.
    Crypto,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::TooLarge => write!(f, "the key is larger than {MAX_KEY_PEM_BYTES} bytes"),
            KeyError::NotPkcs8(what) => write!(
                f,
                "the key is not an unencrypted PKCS#8 PEM ({what}; convert it with openssl pkcs8 -topk8 -nocrypt)"
            ),
            KeyError::Unsupported => f.write_str(
                "the key is neither a P-256 (ES256) nor an RSA 2048-8192 bit (RS256) key",
            ),
            KeyError::Crypto => f.write_str("signing failed"),
        }
    }
}

impl std::error::Error for KeyError {}

enum Inner {
    Es256(EcdsaKeyPair),
    Rs256(RsaKeyPair),
}

/// A private signing key. Never shown.
pub struct SigningKey {
    inner: Inner,
    rng: SystemRandom,
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SigningKey")
            .field("alg", &self.alg())
            .finish_non_exhaustive()
    }
}

/// Base64url without padding.
pub fn b64url(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

impl SigningKey {
    /// Parse an unencrypted PKCS#8 PEM (surrounding whitespace and one final newline allowed).
    pub fn from_pem(pem: &str) -> Result<SigningKey, KeyError> {
        if pem.len() > MAX_KEY_PEM_BYTES {
            return Err(KeyError::TooLarge);
        }
        let text = pem.trim();
        if text.starts_with("-----BEGIN ENCRYPTED PRIVATE KEY-----") {
            return Err(KeyError::NotPkcs8("it is encrypted"));
        }
        if text.starts_with("-----BEGIN EC PRIVATE KEY-----")
            || text.starts_with("-----BEGIN RSA PRIVATE KEY-----")
        {
            return Err(KeyError::NotPkcs8("it is a SEC 1 or PKCS#1 key"));
        }
        let body = text
            .strip_prefix(PEM_BEGIN)
            .and_then(|t| t.strip_suffix(PEM_END))
            .ok_or(KeyError::NotPkcs8("no single BEGIN PRIVATE KEY block"))?;
        if body.contains("-----") {
            return Err(KeyError::NotPkcs8("more than one block"));
        }
        let b64: Zeroizing<String> =
            Zeroizing::new(body.chars().filter(|c| !c.is_ascii_whitespace()).collect());
        let der = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(b64.as_bytes())
                .map_err(|_| KeyError::NotPkcs8("its base64 is malformed"))?,
        );
        SigningKey::from_pkcs8_der(&der)
    }

    /// A PKCS#8 DER key: P-256 first, then RSA.
    pub fn from_pkcs8_der(der: &[u8]) -> Result<SigningKey, KeyError> {
        let rng = SystemRandom::new();
        if let Ok(k) =
            EcdsaKeyPair::from_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, der, &rng)
        {
            return Ok(SigningKey {
                inner: Inner::Es256(k),
                rng,
            });
        }
        RsaKeyPair::from_pkcs8(der)
            .map(|k| SigningKey {
                inner: Inner::Rs256(k),
                rng,
            })
            .map_err(|_| KeyError::Unsupported)
    }

    /// A new P-256 key, with its PKCS#8 DER (to be kept as a secret by the caller).
    pub fn generate_es256() -> Result<(SigningKey, Zeroizing<Vec<u8>>), KeyError> {
        let rng = SystemRandom::new();
        let doc = EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
            .map_err(|_| KeyError::Crypto)?;
        let der = Zeroizing::new(doc.as_ref().to_vec());
        let key = SigningKey::from_pkcs8_der(&der)?;
        Ok((key, der))
    }

    /// The JWS algorithm: `ES256` or `RS256`.
    pub fn alg(&self) -> &'static str {
        match self.inner {
            Inner::Es256(_) => "ES256",
            Inner::Rs256(_) => "RS256",
        }
    }

    /// The public key as a JWK with only its required members (RFC 7638 order), for an EC
    /// key; `None` for RSA (Iteron embeds only its own P-256 DPoP keys).
    pub fn public_jwk(&self) -> Option<Value> {
        let Inner::Es256(k) = &self.inner else {
            return None;
        };
        // Uncompressed point: 0x04 || X (32 bytes) || Y (32 bytes).
        let point = k.public_key().as_ref();
        if point.len() != 65 || point[0] != 4 {
            return None;
        }
        Some(json!({
            "crv": "P-256",
            "kty": "EC",
            "x": b64url(&point[1..33]),
            "y": b64url(&point[33..65]),
        }))
    }

    /// The RFC 7638 SHA-256 thumbprint of [`SigningKey::public_jwk`], base64url.
    pub fn thumbprint(&self) -> Option<String> {
        let jwk = self.public_jwk()?;
        // The required members, lexicographically, no whitespace: serde_json keeps the
        // insertion order, which `public_jwk` wrote sorted.
        let canonical = serde_json::to_string(&jwk).ok()?;
        Some(b64url(&Sha256::digest(canonical.as_bytes())))
    }

    /// Sign `claims` under `header` (to which `alg` is added) as a compact JWS.
    pub fn sign(&self, header: &Value, claims: &Value) -> Result<String, KeyError> {
        let mut header = header.clone();
        let Some(h) = header.as_object_mut() else {
            return Err(KeyError::Crypto);
        };
        h.insert("alg".into(), self.alg().into());
        let head = b64url(&serde_json::to_vec(&header).map_err(|_| KeyError::Crypto)?);
        let body = b64url(&serde_json::to_vec(claims).map_err(|_| KeyError::Crypto)?);
        let input = format!("{head}.{body}");
        let sig = match &self.inner {
            Inner::Es256(k) => k
                .sign(&self.rng, input.as_bytes())
                .map_err(|_| KeyError::Crypto)?
                .as_ref()
                .to_vec(),
            Inner::Rs256(k) => {
                let mut out = vec![0u8; k.public().modulus_len()];
                k.sign(
                    &signature::RSA_PKCS1_SHA256,
                    &self.rng,
                    input.as_bytes(),
                    &mut out,
                )
                .map_err(|_| KeyError::Crypto)?;
                out
            }
        };
        Ok(format!("{input}.{}", b64url(&sig)))
    }

    /// Verify a compact JWS of this key (tests only: Iteron verifies nothing in production).
    #[cfg(test)]
    pub(crate) fn verify(&self, jws: &str) -> bool {
        let Some((input, sig)) = jws.rsplit_once('.') else {
            return false;
        };
        let Ok(sig) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(sig) else {
            return false;
        };
        match &self.inner {
            Inner::Es256(k) => signature::UnparsedPublicKey::new(
                &signature::ECDSA_P256_SHA256_FIXED,
                k.public_key().as_ref(),
            )
            .verify(input.as_bytes(), &sig)
            .is_ok(),
            Inner::Rs256(k) => signature::UnparsedPublicKey::new(
                &signature::RSA_PKCS1_2048_8192_SHA256,
                k.public_key().as_ref(),
            )
            .verify(input.as_bytes(), &sig)
            .is_ok(),
        }
    }
}

/// The decoded header and claims of a compact JWS (tests and diagnostics; no verification).
pub fn decode_unverified(jws: &str) -> Option<(Value, Value)> {
    let mut parts = jws.split('.');
    let (h, c) = (parts.next()?, parts.next()?);
    let d = |s: &str| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
    };
    Some((d(h)?, d(c)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys generated for these tests only (`openssl genpkey -algorithm EC -pkeyopt
    /// ec_paramgen_curve:P-256`, and `-algorithm RSA -pkeyopt rsa_keygen_bits:2048`).
    const EC_PEM: &str = include_str!("../../../fixtures/keys/p256-test-only.pem");
    const RSA_PEM: &str = include_str!("../../../fixtures/keys/rsa-2048-test-only.pem");

    #[test]
    fn an_es256_pem_signs_jws_that_verify() {
        let k = SigningKey::from_pem(EC_PEM).unwrap();
        assert_eq!(k.alg(), "ES256");
        let jws = k
            .sign(&json!({"typ": "JWT"}), &json!({"iss": "c", "n": 1}))
            .unwrap();
        assert!(k.verify(&jws));
        let (h, c) = decode_unverified(&jws).unwrap();
        assert_eq!(h, json!({"typ": "JWT", "alg": "ES256"}));
        assert_eq!(c, json!({"iss": "c", "n": 1}));
        // A flipped signature byte does not verify.
        let mut bad = jws.clone().into_bytes();
        let last = bad.len() - 2;
        bad[last] = if bad[last] == b'A' { b'B' } else { b'A' };
        assert!(!k.verify(&String::from_utf8(bad).unwrap()));
        assert!(!format!("{k:?}").contains("MIGH"));
    }

    #[test]
    fn an_rs256_pem_signs_jws_that_verify() {
        let k = SigningKey::from_pem(RSA_PEM).unwrap();
        assert_eq!(k.alg(), "RS256");
        assert!(k.public_jwk().is_none());
        let jws = k
            .sign(&json!({"typ": "JWT"}), &json!({"sub": "c"}))
            .unwrap();
        assert!(k.verify(&jws));
        let (h, _) = decode_unverified(&jws).unwrap();
        assert_eq!(h["alg"], "RS256");
    }

    #[test]
    fn the_thumbprint_is_the_rfc_7638_digest_of_the_public_jwk() {
        let k = SigningKey::from_pem(EC_PEM).unwrap();
        let jwk = k.public_jwk().unwrap();
        assert_eq!(
            serde_json::to_string(&jwk).unwrap(),
            r#"{"crv":"P-256","kty":"EC","x":"UyS5SOaIFfNTIqXV2FWYdZ0D1KWZXwnu2Lj649JNUxA","y":"Y-Ey7bbZ0PD2XoPj_3VbYCfrOL5gDxR6AQDTHVQTdQE"}"#
        );
        // Computed independently: the point from `openssl ec -pubout -outform DER`, the JWK
        // and its SHA-256 in Python.
        assert_eq!(
            k.thumbprint().unwrap(),
            "jU4NtY5OAo4Q7VTAaPvFku-UCGbsEhG4F_c0zuRmMg8"
        );
    }

    #[test]
    fn generated_keys_are_fresh_p256_keys_that_reload_from_their_der() {
        let (a, der) = SigningKey::generate_es256().unwrap();
        let (b, _) = SigningKey::generate_es256().unwrap();
        assert_ne!(a.thumbprint(), b.thumbprint());
        let again = SigningKey::from_pkcs8_der(&der).unwrap();
        assert_eq!(again.thumbprint(), a.thumbprint());
        let jws = again.sign(&json!({}), &json!({})).unwrap();
        assert!(a.verify(&jws));
    }

    #[test]
    fn keys_that_are_not_unencrypted_pkcs8_are_refused_by_their_form_at_the_bound_and_one_over() {
        for (pem, want) in [
            ("", "no single BEGIN PRIVATE KEY block"),
            (
                "-----BEGIN EC PRIVATE KEY-----\nAA\n-----END EC PRIVATE KEY-----",
                "SEC 1",
            ),
            (
                "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAA\n-----END ENCRYPTED PRIVATE KEY-----",
                "encrypted",
            ),
            (
                "-----BEGIN PRIVATE KEY-----\n!!\n-----END PRIVATE KEY-----",
                "base64",
            ),
        ] {
            let e = SigningKey::from_pem(pem).unwrap_err();
            assert!(e.to_string().contains(want), "{pem}: {e}");
        }
        let two = format!("{EC_PEM}{EC_PEM}");
        assert!(SigningKey::from_pem(&two).is_err());
        assert_eq!(
            SigningKey::from_pem("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----")
                .unwrap_err(),
            KeyError::Unsupported
        );
        // Padding the good key with whitespace up to the bound is fine; one byte more is not.
        let pad = MAX_KEY_PEM_BYTES - EC_PEM.len();
        let exact = format!("{}{EC_PEM}", " ".repeat(pad));
        assert_eq!(exact.len(), MAX_KEY_PEM_BYTES);
        assert!(SigningKey::from_pem(&exact).is_ok());
        let over = format!(" {exact}");
        assert_eq!(SigningKey::from_pem(&over).unwrap_err(), KeyError::TooLarge);
        iteron_test_support::record!("P5", json!({"max_key_pem_bytes": MAX_KEY_PEM_BYTES}),);
    }
}
