//! The one file format (schema 1): written only when this build reads it back identically, read
//! strictly (objects only, no unknown or duplicate fields, no wrong types), and the keyring
//! entry tied to its exact binding.

use std::fmt;
use std::io::{self, Write};
use std::marker::PhantomData;
use std::path::Path;

use iteron_policy::config::CredentialBackend;
use iteron_policy::zone::Zone;
use secrecy::{ExposeSecret, SecretString};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::{
    BINDING_ID_LEN, Binding, CREDENTIAL_SCHEMA, Credential, CredentialError, MAX_LEN, Secrets,
    client_kind_parse, client_kind_str, hex, is_lower_hex, token_auth_parse, validate,
};
use crate::keyring::{KEYRING_SERVICE, KeyringError};

// ---- The file format ------------------------------------------------------------------------

#[derive(Serialize)]
struct FileOut<'a> {
    schema: u32,
    binding: BindingOut<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    secrets: Option<SecretsOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    keyring: Option<KeyringRef<'a>>,
}

/// Where the secrets of a keyring-backed credential are.
#[derive(Serialize)]
struct KeyringRef<'a> {
    service: &'static str,
    account: &'a str,
}

/// The keyring entry of a keyring-backed credential: the secrets, tied to the exact binding
/// stored beside them.
#[derive(Serialize)]
struct BlobOut<'a> {
    schema: u32,
    binding_sha256: &'a str,
    secrets: SecretsOut<'a>,
}

#[derive(Serialize)]
struct BindingOut<'a> {
    server: &'a str,
    resource: &'a str,
    issuer: &'a str,
    zone: &'static str,
    client_id: &'a str,
    client_kind: &'static str,
    token_auth: &'static str,
    requested_scopes: &'a [String],
    granted_scopes: &'a [String],
    config_digest: &'a str,
}

#[derive(Serialize)]
struct SecretsOut<'a> {
    access_token: &'a str,
    refresh_token: Option<&'a str>,
    client_secret: Option<&'a str>,
    expires_at: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    refresh_failed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    dpop_key: Option<&'a str>,
}

/// A field that must be present: missing → `None` (the file is incomplete); present → the
/// value, whose type is checked strictly (so `null` is only accepted where `T` is an `Option`).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// A JSON object and nothing else (serde's derived structs would also accept an array).
struct Obj<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(V(PhantomData)).map(Obj)
    }
}

/// A secret string read straight into a [`SecretString`].
struct SecretIn(SecretString);

impl<'de> Deserialize<'de> for SecretIn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = SecretIn;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SecretIn, E> {
                Ok(SecretIn(SecretString::from(v)))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<SecretIn, E> {
                let v = Zeroizing::new(v);
                Ok(SecretIn(SecretString::from(v.as_str())))
            }
        }
        d.deserialize_str(V)
    }
}

/// Reads only the schema number; everything else is skipped.
#[derive(Deserialize)]
struct Probe {
    #[serde(default)]
    schema: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileIn {
    /// Checked by the probe; accepted here so the strict parse allows the key.
    #[serde(rename = "schema", default)]
    _schema: Option<de::IgnoredAny>,
    #[serde(default, deserialize_with = "present")]
    binding: Option<Obj<BindingIn>>,
    #[serde(default, deserialize_with = "present")]
    secrets: Option<Obj<SecretsIn>>,
    #[serde(default, deserialize_with = "present")]
    keyring: Option<Obj<KeyringRefIn>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyringRefIn {
    #[serde(default, deserialize_with = "present")]
    service: Option<String>,
    #[serde(default, deserialize_with = "present")]
    account: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BlobIn {
    #[serde(default, deserialize_with = "present")]
    schema: Option<u32>,
    #[serde(default, deserialize_with = "present")]
    binding_sha256: Option<String>,
    #[serde(default, deserialize_with = "present")]
    secrets: Option<Obj<SecretsIn>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BindingIn {
    #[serde(default, deserialize_with = "present")]
    server: Option<String>,
    #[serde(default, deserialize_with = "present")]
    resource: Option<String>,
    #[serde(default, deserialize_with = "present")]
    issuer: Option<String>,
    #[serde(default, deserialize_with = "present")]
    zone: Option<String>,
    #[serde(default, deserialize_with = "present")]
    client_id: Option<String>,
    #[serde(default, deserialize_with = "present")]
    client_kind: Option<String>,
    #[serde(default, deserialize_with = "present")]
    token_auth: Option<String>,
    #[serde(default, deserialize_with = "present")]
    requested_scopes: Option<Vec<String>>,
    #[serde(default, deserialize_with = "present")]
    granted_scopes: Option<Vec<String>>,
    #[serde(default, deserialize_with = "present")]
    config_digest: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretsIn {
    #[serde(default, deserialize_with = "present")]
    access_token: Option<SecretIn>,
    #[serde(default, deserialize_with = "present")]
    refresh_token: Option<Option<SecretIn>>,
    #[serde(default, deserialize_with = "present")]
    client_secret: Option<Option<SecretIn>>,
    #[serde(default, deserialize_with = "present")]
    expires_at: Option<Option<u64>>,
    /// Optional: absent means `false`.
    #[serde(default)]
    refresh_failed: bool,
    /// Optional: absent means no DPoP key.
    #[serde(default)]
    dpop_key: Option<SecretIn>,
}

/// Why bytes are not a credential, before the path is known.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decode {
    Outdated(&'static str),
    Corrupt(&'static str, Option<(usize, usize)>),
}

impl Decode {
    pub(super) fn at(self, path: &Path) -> CredentialError {
        let path = path.to_path_buf();
        match self {
            Decode::Outdated(reason) => CredentialError::Outdated { path, reason },
            Decode::Corrupt(reason, at) => CredentialError::Corrupt { path, reason, at },
        }
    }
}

/// Only the category and position of a `serde_json` error are kept: its message can quote the
/// offending value, which may be a secret.
fn syntax_or(e: &serde_json::Error, data_reason: &'static str) -> Decode {
    let reason = match e.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => "not valid JSON",
        serde_json::error::Category::Data => data_reason,
        serde_json::error::Category::Io => "unreadable",
    };
    Decode::Corrupt(reason, Some((e.line(), e.column())))
}

fn need<T>(v: Option<T>) -> Result<T, Decode> {
    v.ok_or(Decode::Outdated("a field is missing"))
}

/// A credential file as read: the binding, and the secrets unless they are in the keyring.
pub(super) struct Stored {
    pub(super) binding: Binding,
    pub(super) secrets: Option<Secrets>,
    /// The keyring account named by the file, for a keyring-backed credential.
    pub(super) keyring_account: Option<String>,
}

fn secrets_in(s: SecretsIn) -> Result<Secrets, Decode> {
    Ok(Secrets {
        access_token: need(s.access_token)?.0,
        refresh_token: need(s.refresh_token)?.map(|t| t.0),
        client_secret: need(s.client_secret)?.map(|t| t.0),
        expires_at: need(s.expires_at)?,
        refresh_failed: s.refresh_failed,
        dpop_key: s.dpop_key.map(|k| k.0),
    })
}

fn secrets_out(s: &Secrets) -> SecretsOut<'_> {
    SecretsOut {
        access_token: s.access_token.expose_secret(),
        refresh_token: s.refresh_token.as_ref().map(|t| t.expose_secret()),
        client_secret: s.client_secret.as_ref().map(|t| t.expose_secret()),
        expires_at: s.expires_at,
        refresh_failed: s.refresh_failed,
        dpop_key: s.dpop_key.as_ref().map(|t| t.expose_secret()),
    }
}

fn binding_out(b: &Binding) -> BindingOut<'_> {
    BindingOut {
        server: &b.server,
        resource: &b.resource,
        issuer: &b.issuer,
        zone: b.zone.as_str(),
        client_id: &b.client_id,
        client_kind: client_kind_str(b.client_kind),
        token_auth: b.token_auth.as_str(),
        requested_scopes: &b.requested_scopes,
        granted_scopes: &b.granted_scopes,
        config_digest: &b.config_digest,
    }
}

/// Lowercase hex SHA-256 of the binding as written (what a keyring entry is tied to).
pub(super) fn binding_sha256(b: &Binding, account: &str) -> String {
    // Serializing plain strings and string lists into a Vec cannot fail.
    let bytes = serde_json::to_vec(&binding_out(b)).unwrap_or_default();
    let mut h = Sha256::new();
    h.update(b"iteron-keyring-binding-v1\0");
    h.update(b.secret_store.as_str().as_bytes());
    h.update(b"\0");
    h.update(account.as_bytes());
    h.update(b"\0");
    h.update(&bytes);
    hex(&h.finalize())
}

/// Decode a keyring entry and check it belongs to `binding`.
pub(super) fn decode_blob(
    bytes: &[u8],
    binding: &Binding,
    account: &str,
) -> Result<Secrets, KeyringError> {
    let blob: Obj<BlobIn> = serde_json::from_slice(bytes).map_err(|_| KeyringError::Unreadable)?;
    let blob = blob.0;
    if blob.schema != Some(CREDENTIAL_SCHEMA) {
        return Err(KeyringError::Unreadable);
    }
    let digest = blob.binding_sha256.ok_or(KeyringError::Unreadable)?;
    let s = blob.secrets.ok_or(KeyringError::Unreadable)?.0;
    if digest != binding_sha256(binding, account) {
        return Err(KeyringError::Mismatch);
    }
    secrets_in(s).map_err(|_| KeyringError::Unreadable)
}

pub(super) fn decode(bytes: &[u8]) -> Result<Stored, Decode> {
    let probe: Obj<Probe> =
        serde_json::from_slice(bytes).map_err(|e| syntax_or(&e, "not a credential object"))?;
    match probe.0.schema {
        None => return Err(Decode::Outdated("it has no schema number")),
        Some(serde_json::Value::Number(n)) => {
            if n.as_u64() != Some(u64::from(CREDENTIAL_SCHEMA)) {
                return Err(Decode::Outdated("its schema is not 1"));
            }
        }
        Some(_) => return Err(Decode::Corrupt("the schema is not a number", None)),
    }
    let file: Obj<FileIn> = serde_json::from_slice(bytes)
        .map_err(|e| syntax_or(&e, "a field is unknown, repeated or of the wrong type"))?;
    let b = need(file.0.binding)?.0;
    let zone = need(b.zone)?;
    let client_kind = need(b.client_kind)?;
    let token_auth = need(b.token_auth)?;
    let binding = Binding {
        server: need(b.server)?,
        resource: need(b.resource)?,
        issuer: need(b.issuer)?,
        zone: Zone::parse(&zone).ok_or(Decode::Corrupt("unknown network zone", None))?,
        client_id: need(b.client_id)?,
        client_kind: client_kind_parse(&client_kind)
            .ok_or(Decode::Corrupt("unknown client registration kind", None))?,
        token_auth: token_auth_parse(&token_auth)
            .ok_or(Decode::Corrupt("unknown token endpoint auth method", None))?,
        requested_scopes: need(b.requested_scopes)?,
        granted_scopes: need(b.granted_scopes)?,
        config_digest: need(b.config_digest)?,
        secret_store: CredentialBackend::File,
    };
    validate(&binding).map_err(|reason| Decode::Corrupt(reason, None))?;
    match (file.0.secrets, file.0.keyring) {
        (Some(s), None) => Ok(Stored {
            binding,
            secrets: Some(secrets_in(s.0)?),
            keyring_account: None,
        }),
        (None, Some(k)) => {
            let k = k.0;
            let account = need(k.account)?;
            if need(k.service)? != KEYRING_SERVICE || !is_lower_hex(&account, BINDING_ID_LEN) {
                return Err(Decode::Corrupt(
                    "the keyring reference is not an Iteron keyring entry",
                    None,
                ));
            }
            Ok(Stored {
                binding: Binding {
                    secret_store: CredentialBackend::Keyring,
                    ..binding
                },
                secrets: None,
                keyring_account: Some(account),
            })
        }
        (Some(_), Some(_)) => Err(Decode::Corrupt(
            "it has both secrets and a keyring reference",
            None,
        )),
        (None, None) => Err(Decode::Outdated("a field is missing")),
    }
}

/// Appends into a buffer allocated at full size, refusing to grow it (growing would leave a
/// copy of the secrets in the freed allocation).
struct Bounded<'a>(&'a mut Vec<u8>);

impl Write for Bounded<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.0.len().saturating_add(data.len()) > MAX_LEN {
            return Err(io::Error::other("credential too large"));
        }
        self.0.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn same_secret(a: &SecretString, b: &SecretString) -> bool {
    a.expose_secret() == b.expose_secret()
}

fn same_optional_secret(a: Option<&SecretString>, b: Option<&SecretString>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => same_secret(a, b),
        _ => false,
    }
}

pub(super) fn same(a: &Credential, b: &Credential) -> bool {
    a.binding == b.binding
        && same_secret(&a.secrets.access_token, &b.secrets.access_token)
        && same_optional_secret(
            a.secrets.refresh_token.as_ref(),
            b.secrets.refresh_token.as_ref(),
        )
        && same_optional_secret(
            a.secrets.client_secret.as_ref(),
            b.secrets.client_secret.as_ref(),
        )
        && a.secrets.expires_at == b.secrets.expires_at
        && a.secrets.refresh_failed == b.secrets.refresh_failed
        && same_optional_secret(a.secrets.dpop_key.as_ref(), b.secrets.dpop_key.as_ref())
}

/// The bytes of a credential: the file, and for a keyring-backed credential the keyring entry.
pub(super) struct Encoded {
    pub(super) file: Zeroizing<Vec<u8>>,
    pub(super) blob: Option<Zeroizing<Vec<u8>>>,
}

fn to_bounded<T: Serialize>(value: &T) -> Result<Zeroizing<Vec<u8>>, CredentialError> {
    let mut buf = Zeroizing::new(Vec::with_capacity(MAX_LEN));
    // The only way these plain structs can fail to serialize is `Bounded` refusing to grow.
    serde_json::to_writer(Bounded(&mut buf), value)
        .map_err(|_| CredentialError::Unwritable("the credential would exceed 64 KiB"))?;
    Ok(buf)
}

/// Encode a credential; `account` is the keyring account of a keyring-backed one.
pub(super) fn encode(cred: &Credential, account: &str) -> Result<Encoded, CredentialError> {
    validate(&cred.binding).map_err(CredentialError::Unwritable)?;
    let (b, s) = (&cred.binding, &cred.secrets);
    let keyring = b.secret_store == CredentialBackend::Keyring;
    let file = to_bounded(&FileOut {
        schema: CREDENTIAL_SCHEMA,
        binding: binding_out(b),
        secrets: (!keyring).then(|| secrets_out(s)),
        keyring: keyring.then_some(KeyringRef {
            service: KEYRING_SERVICE,
            account,
        }),
    })?;
    let blob = if keyring {
        let digest = binding_sha256(b, account);
        Some(to_bounded(&BlobOut {
            schema: CREDENTIAL_SCHEMA,
            binding_sha256: &digest,
            secrets: secrets_out(s),
        })?)
    } else {
        None
    };
    let back = decode(&file).ok().and_then(|stored| {
        let secrets = match (&blob, stored.secrets) {
            (None, Some(secrets)) => secrets,
            (Some(blob), None) if stored.keyring_account.as_deref() == Some(account) => {
                decode_blob(blob, &stored.binding, account).ok()?
            }
            _ => return None,
        };
        Some(Credential {
            binding: stored.binding,
            secrets,
        })
    });
    match back {
        Some(back) if same(&back, cred) => Ok(Encoded { file, blob }),
        _ => Err(CredentialError::Unwritable(
            "it would not read back identically",
        )),
    }
}
