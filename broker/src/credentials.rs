//! OAuth credentials on disk: `$ITERON_HOME/mcp-credentials/<binding-id>`, one file per server.
//!
//! Guarantees:
//! - a file is named by its binding id (a truncated, domain-separated SHA-256 of the server
//!   name), never by the raw name;
//! - the home and the credentials directory are created 0700 and every file 0600 *at creation*
//!   (a temp file opened `O_CREAT|O_EXCL|O_NOFOLLOW`); nothing is ever chmod-ed afterwards;
//! - every write holds an exclusive `flock` on `mcp-credentials/.lock`, writes the temp file,
//!   fsyncs it, renames it over the credential and fsyncs the directory, so a crash (even
//!   `kill -9`) leaves the old or the new file and never a partial one, and concurrent writers
//!   lose no update; [`CredentialStore::update_secrets`] is a read-modify-write under that lock,
//!   which is where a rotated refresh token is persisted before the new access token is used;
//! - a directory or file that is a symlink or special file, is not owned by the effective uid,
//!   or has any group/other permission bit is refused, never repaired; the error names the
//!   `chmod` to run; a FIFO planted in place of a file cannot block the open;
//! - reads are bounded to [`MAX_CREDENTIAL_BYTES`] (+1 byte to detect oversize);
//! - there is one format: schema 1, parsed strictly (objects only, no unknown or duplicate
//!   fields, no wrong types). Any other schema or a file with a missing field is
//!   [`CredentialError::Outdated`] (re-login required; no migration, no second format); a file
//!   that is not that format is [`CredentialError::Corrupt`] and is left untouched;
//! - nothing is written that this build could not read back identically;
//! - secrets live in [`SecretString`]; the serialized and the read file bytes live in
//!   [`Zeroizing`] buffers allocated once at full size (so no reallocation leaves a copy
//!   behind; only a string with JSON escapes passes through `serde_json`'s own scratch buffer,
//!   which is outside our control); `Debug` shows `[not shown]`, and no error carries file
//!   content (not even `serde_json`'s message, which can quote a value);
//! - a stored binding whose server name or configuration digest no longer matches the
//!   configuration is reported by [`check_binding`], so the caller asks for a re-login instead
//!   of silently reusing the credential.

use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::marker::PhantomData;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iteron_policy::config::{CredentialBackend, ServerConfig};
use iteron_policy::names::ServerName;
use iteron_policy::zone::Zone;
use secrecy::{ExposeSecret, SecretString};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use crate::keyring::{KEYRING_SERVICE, Keyring, KeyringError};
use crate::oauth::flow::{ClientKind, TokenAuth};
use crate::private_fs::{self, FsError};
use crate::store::Home;

/// The only file format this build reads and writes.
pub const CREDENTIAL_SCHEMA: u32 = 1;
/// The credentials directory's name inside the home directory.
pub const CREDENTIALS_DIR: &str = "mcp-credentials";
/// Largest credential file, in bytes.
pub const MAX_CREDENTIAL_BYTES: u64 = 64 * 1024;
/// The lock file's name inside the credentials directory (one lock for the whole directory).
pub const LOCK_FILE: &str = ".lock";
/// How long a writer waits for the lock before giving up.
pub const LOCK_TIMEOUT: Duration = private_fs::LOCK_TIMEOUT;

const MAX_LEN: usize = 64 * 1024;
const _: () = assert!(MAX_LEN as u64 == MAX_CREDENTIAL_BYTES);
/// Prefix of temp files; with the lock held, anything with it is a leftover of a dead writer.
const TEMP_PREFIX: &str = ".tmp-";
const BINDING_ID_DOMAIN: &[u8] = b"iteron-binding-v1\0";
const BINDING_ID_LEN: usize = 32;
const DIGEST_LEN: usize = 64;

/// What a credential is bound to. Not secret; `auth status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The server name at login.
    pub server: String,
    /// The OAuth resource (RFC 8707) the token was issued for.
    pub resource: String,
    /// The authorization server's issuer.
    pub issuer: String,
    /// The network zone recorded at first login; refresh and revoke stay within it.
    pub zone: Zone,
    /// The OAuth client id.
    pub client_id: String,
    /// How the client was registered.
    pub client_kind: ClientKind,
    /// Token endpoint authentication.
    pub token_auth: TokenAuth,
    /// Scopes asked for.
    pub requested_scopes: Vec<String>,
    /// Scopes granted.
    pub granted_scopes: Vec<String>,
    /// Lowercase hex SHA-256 of the server's configuration at login ([`config_digest`]).
    pub config_digest: String,
    /// Where the secrets are kept; chosen at login from the configuration, never switched.
    pub secret_store: CredentialBackend,
}

/// The secret part. `Debug` shows nothing secret.
#[derive(Clone)]
pub struct Secrets {
    /// The access token.
    pub access_token: SecretString,
    /// The refresh token, if the authorization server issued one.
    pub refresh_token: Option<SecretString>,
    /// A dynamically registered client's secret.
    pub client_secret: Option<SecretString>,
    /// When the access token expires, in unix seconds.
    pub expires_at: Option<u64>,
    /// The authorization server refused the refresh token (`invalid_grant`, or a rotation
    /// whose tokens could not be kept and were revoked): only a new login helps, and `auth
    /// status` says `refresh_failed`. Written as `"refresh_failed": true` only when set; a
    /// file without the key reads as `false`.
    pub refresh_failed: bool,
    /// The DPoP key the tokens are bound to (base64url PKCS#8), when the login asked for
    /// sender-constrained tokens. Written only when present; absent reads as `None`.
    pub dpop_key: Option<SecretString>,
}

/// A stored credential: its binding and its secrets.
#[derive(Clone)]
pub struct Credential {
    /// What it is bound to.
    pub binding: Binding,
    /// The secrets.
    pub secrets: Secrets,
}

struct NotShown;

impl fmt::Debug for NotShown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[not shown]")
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secrets")
            .field("access_token", &NotShown)
            .field(
                "refresh_token",
                &self.refresh_token.as_ref().map(|_| NotShown),
            )
            .field(
                "client_secret",
                &self.client_secret.as_ref().map(|_| NotShown),
            )
            .field("expires_at", &self.expires_at)
            .field("refresh_failed", &self.refresh_failed)
            .field("dpop_key", &self.dpop_key.as_ref().map(|_| NotShown))
            .finish()
    }
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credential")
            .field("binding", &self.binding)
            .field("secrets", &self.secrets)
            .finish()
    }
}

/// Everything that can go wrong with the credential store. `Display` is one line with no file
/// content and no secret.
#[derive(Debug)]
pub enum CredentialError {
    /// A private file or directory is unsafe to use, or a system call on it failed.
    Fs(FsError),
    /// The file exceeds [`MAX_CREDENTIAL_BYTES`].
    TooLarge(PathBuf),
    /// The keyring holding this login's secrets cannot be used; nothing falls back to a file.
    Keyring {
        /// The server.
        server: String,
        /// Why.
        reason: KeyringError,
    },
    /// Another schema or an incomplete file: re-login required.
    Outdated {
        /// The file.
        path: PathBuf,
        /// What is missing or different.
        reason: &'static str,
    },
    /// Not the credential format (not JSON, wrong types, unknown fields); left untouched.
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: &'static str,
        /// Line and column of the problem, when known.
        at: Option<(usize, usize)>,
    },
    /// The credential cannot be stored as given (it would not read back, or is too large);
    /// nothing was written.
    Unwritable(&'static str),
}

impl fmt::Display for CredentialError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CredentialError::Fs(e @ FsError::LockTimeout(_)) => write!(
                f,
                "{e} (a keyring call stuck behind an unlock prompt also holds it)"
            ),
            CredentialError::Fs(e) => e.fmt(f),
            CredentialError::Keyring { server, reason } => {
                write!(
                    f,
                    "the keyring holding the credential of {server} cannot be used: {}; nothing falls back to a file",
                    reason.reason()
                )?;
                if matches!(reason, KeyringError::NoEntry | KeyringError::Mismatch) {
                    write!(f, "; re-login required: iteron mcp auth login {server}")?;
                }
                Ok(())
            }
            CredentialError::TooLarge(p) => write!(
                f,
                "refusing credential file {}: larger than {MAX_CREDENTIAL_BYTES} bytes",
                p.display()
            ),
            CredentialError::Outdated { path, reason } => write!(
                f,
                "credential file {} is outdated or incomplete ({reason}); re-login required: iteron mcp auth login <server>",
                path.display()
            ),
            CredentialError::Corrupt { path, reason, at } => {
                write!(f, "refusing credential file {}: {reason}", path.display())?;
                if let Some((line, column)) = at {
                    write!(f, " (line {line}, column {column})")?;
                }
                f.write_str("; it was left untouched: inspect or remove it, then log in again")
            }
            CredentialError::Unwritable(reason) => write!(
                f,
                "refusing to store the credential: {reason}; nothing was written"
            ),
        }
    }
}

impl std::error::Error for CredentialError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CredentialError::Fs(e) => e.source(),
            _ => None,
        }
    }
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CredentialError + use<> {
    let path = path.to_path_buf();
    move |source| CredentialError::Fs(FsError::Io { op, path, source })
}

/// Why a stored binding no longer fits the configuration (→ re-login required, never silent
/// reuse).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mismatch {
    /// The credential was issued for a server of another name.
    ServerRenamed,
    /// The server's configuration changed since login.
    ConfigChanged,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mismatch::ServerRenamed => {
                "the credential was issued for a server of another name; re-login required"
            }
            Mismatch::ConfigChanged => {
                "the server's configuration changed since login; re-login required"
            }
        })
    }
}

impl std::error::Error for Mismatch {}

/// sha256 (hex) of the server's canonical configuration JSON (`serde_json::to_vec` of the
/// [`ServerConfig`]).
///
/// Serializing a `ServerConfig` cannot fail (it has string keys only); should it ever, the
/// digest is empty, which no stored binding can hold, so [`check_binding`] fails closed.
pub fn config_digest(server: &ServerConfig) -> String {
    match serde_json::to_vec(server) {
        Ok(bytes) => hex(&Sha256::digest(&bytes)),
        Err(_) => String::new(),
    }
}

/// Check a stored binding against the server's current configuration.
pub fn check_binding(b: &Binding, server: &ServerConfig) -> Result<(), Mismatch> {
    if b.server != server.name.as_str() {
        return Err(Mismatch::ServerRenamed);
    }
    if b.config_digest != config_digest(server) {
        return Err(Mismatch::ConfigChanged);
    }
    Ok(())
}

/// Lowercase hex of bytes (digests in file names, bindings and the audit chain).
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

const CLIENT_KINDS: [ClientKind; 3] = [
    ClientKind::PreRegistered,
    ClientKind::Cimd,
    ClientKind::Dynamic,
];
const TOKEN_AUTHS: [TokenAuth; 4] = [
    TokenAuth::None,
    TokenAuth::Basic,
    TokenAuth::Post,
    TokenAuth::PrivateKeyJwt,
];

fn client_kind_str(kind: ClientKind) -> &'static str {
    match kind {
        ClientKind::PreRegistered => "pre_registered",
        ClientKind::Cimd => "cimd",
        ClientKind::Dynamic => "dynamic",
    }
}

// A variant added to either enum but not to these tables is caught by the read-back check in
// `encode`: such a credential is refused instead of written unreadable.
fn client_kind_parse(s: &str) -> Option<ClientKind> {
    CLIENT_KINDS.into_iter().find(|k| client_kind_str(*k) == s)
}

fn token_auth_parse(s: &str) -> Option<TokenAuth> {
    TOKEN_AUTHS.into_iter().find(|t| t.as_str() == s)
}

/// What the reader and the writer both require of a binding beyond its types.
fn validate(b: &Binding) -> Result<(), &'static str> {
    if ServerName::parse(&b.server).is_err() {
        return Err("the server name is not valid");
    }
    if !is_lower_hex(&b.config_digest, DIGEST_LEN) {
        return Err("the configuration digest is not 64 lowercase hex digits");
    }
    Ok(())
}

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
enum Decode {
    Outdated(&'static str),
    Corrupt(&'static str, Option<(usize, usize)>),
}

impl Decode {
    fn at(self, path: &Path) -> CredentialError {
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
struct Stored {
    binding: Binding,
    secrets: Option<Secrets>,
    /// The keyring account named by the file, for a keyring-backed credential.
    keyring_account: Option<String>,
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
fn binding_sha256(b: &Binding, account: &str) -> String {
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
fn decode_blob(bytes: &[u8], binding: &Binding, account: &str) -> Result<Secrets, KeyringError> {
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

fn decode(bytes: &[u8]) -> Result<Stored, Decode> {
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

fn same(a: &Credential, b: &Credential) -> bool {
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
struct Encoded {
    file: Zeroizing<Vec<u8>>,
    blob: Option<Zeroizing<Vec<u8>>>,
}

fn to_bounded<T: Serialize>(value: &T) -> Result<Zeroizing<Vec<u8>>, CredentialError> {
    let mut buf = Zeroizing::new(Vec::with_capacity(MAX_LEN));
    // The only way these plain structs can fail to serialize is `Bounded` refusing to grow.
    serde_json::to_writer(Bounded(&mut buf), value)
        .map_err(|_| CredentialError::Unwritable("the credential would exceed 64 KiB"))?;
    Ok(buf)
}

/// Encode a credential; `account` is the keyring account of a keyring-backed one.
fn encode(cred: &Credential, account: &str) -> Result<Encoded, CredentialError> {
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

// ---- The store ------------------------------------------------------------------------------

/// The credential store: files in `$ITERON_HOME/mcp-credentials`, and for keyring-backed
/// logins the secrets in the keyring.
#[derive(Debug, Clone)]
pub struct CredentialStore {
    home: PathBuf,
    dir: PathBuf,
    keyring: Keyring,
}

impl CredentialStore {
    /// The store of a home; nothing is touched until the first operation.
    pub fn new(home: &Home) -> CredentialStore {
        Self::with_keyring(home, Keyring::system())
    }

    /// The store of a home whose keyring-backed secrets live in `keyring`.
    pub fn with_keyring(home: &Home, keyring: Keyring) -> CredentialStore {
        let home = home.dir().to_path_buf();
        CredentialStore {
            dir: home.join(CREDENTIALS_DIR),
            home,
            keyring,
        }
    }

    /// The credentials directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// File name for a server: the first 32 hex chars of
    /// sha256("iteron-binding-v1\0" + server name) — never the raw name.
    pub fn binding_id(server: &str) -> String {
        let mut h = Sha256::new();
        h.update(BINDING_ID_DOMAIN);
        h.update(server.as_bytes());
        let mut id = hex(&h.finalize());
        id.truncate(BINDING_ID_LEN);
        id
    }

    /// The credential file's path for a server.
    pub fn path_for(&self, server: &str) -> PathBuf {
        self.dir.join(Self::binding_id(server))
    }

    /// The keyring account of a server in this home: a digest of the home's path and the
    /// server name, so two homes with a server of the same name never share an entry.
    /// The home's path is resolved (symlinks, `..`) when it exists, so the same home reached
    /// by another path keeps its entries.
    pub fn keyring_account(&self, server: &str) -> String {
        let home = resolve_existing_prefix(&self.home);
        let mut h = Sha256::new();
        h.update(b"iteron-keyring-account-v1\0");
        h.update(home.as_os_str().as_encoded_bytes());
        h.update(b"\0");
        h.update(server.as_bytes());
        let mut id = hex(&h.finalize());
        id.truncate(BINDING_ID_LEN);
        id
    }

    /// Read a server's file, refusing one that names another server, or another home's
    /// keyring entry (a copied or moved home: a new login is needed).
    fn read_own(&self, server: &str) -> Result<Option<Stored>, CredentialError> {
        let path = self.path_for(server);
        let Some(stored) = read_stored(&path)? else {
            return Ok(None);
        };
        if stored.binding.server != server {
            return Err(CredentialError::Corrupt {
                path,
                reason: "it holds the credential of another server",
                at: None,
            });
        }
        if stored
            .keyring_account
            .as_ref()
            .is_some_and(|a| *a != self.keyring_account(server))
        {
            return Err(Self::keyring_err(server)(KeyringError::Mismatch));
        }
        Ok(Some(stored))
    }

    /// Read a server's credential; `None` when there is none. A file stored under this
    /// server's id that names another server is refused as corrupt.
    pub fn load(&self, server: &str) -> Result<Option<Credential>, CredentialError> {
        match self.load_once(server) {
            // A concurrent re-login replaces the keyring entry and then the file, under the
            // lock: wait for it and read once more before asking for a new login.
            Err(CredentialError::Keyring {
                reason: KeyringError::Mismatch,
                ..
            }) => {
                let _lock = self.lock()?;
                self.load_once(server)
            }
            other => other,
        }
    }

    fn load_once(&self, server: &str) -> Result<Option<Credential>, CredentialError> {
        if !self.check_dirs()? {
            return Ok(None);
        }
        let Some(stored) = self.read_own(server)? else {
            return Ok(None);
        };
        let secrets = match stored.secrets {
            Some(secrets) => secrets,
            None => {
                let account = self.keyring_account(server);
                let blob = self
                    .keyring
                    .get(&account)
                    .map_err(Self::keyring_err(server))?;
                decode_blob(&blob, &stored.binding, &account).map_err(Self::keyring_err(server))?
            }
        };
        Ok(Some(Credential {
            binding: stored.binding,
            secrets,
        }))
    }

    fn keyring_err(server: &str) -> impl FnOnce(KeyringError) -> CredentialError + use<> {
        let server = server.to_owned();
        move |reason| CredentialError::Keyring { server, reason }
    }

    /// Check that the keyring can store this server's secrets (a throwaway entry is written
    /// and deleted), before a login whose secrets will go there.
    pub fn probe_keyring(&self, server: &str) -> Result<(), CredentialError> {
        self.keyring
            .probe_write(&self.keyring_account(server))
            .map_err(Self::keyring_err(server))
    }

    /// Take the directory lock. Shared so a keyring call the caller stopped waiting for keeps
    /// it until that call has really finished (see [`Keyring`]).
    fn lock(&self) -> Result<Arc<private_fs::Lock>, CredentialError> {
        Ok(Arc::new(private_fs::acquire_lock(
            &self.dir.join(LOCK_FILE),
        )?))
    }

    /// Store a credential (a login), replacing any earlier one for the same server. Creates
    /// the directory 0700 if needed; the write is atomic under the lock. `Ok(Some(reason))`:
    /// stored, but the previous login's keyring entry (replaced by a file-store login) could
    /// not be deleted — the caller tells the operator, since no file refers to it any more.
    pub fn save(&self, cred: &Credential) -> Result<Option<KeyringError>, CredentialError> {
        let server = &cred.binding.server;
        let account = self.keyring_account(server);
        let encoded = encode(cred, &account)?;
        self.ensure_dirs()?;
        let lock = self.lock()?;
        // A re-login that moves the secrets out of the keyring removes the old entry once the
        // new file is in place; an unreadable old file is replaced without looking further.
        let was_keyring = matches!(
            read_stored(&self.path_for(server)),
            Ok(Some(Stored { binding, .. })) if binding.secret_store == CredentialBackend::Keyring
        );
        // The keyring entry first: a file pointing at a missing or older entry is refused on
        // read (the entry is tied to the exact binding), never used with the wrong secrets.
        let to_keyring = encoded.blob.is_some();
        if let Some(blob) = encoded.blob {
            self.keyring
                .set_holding(&account, blob, lock.clone())
                .map_err(Self::keyring_err(server))?;
        }
        self.replace(server, &encoded.file)?;
        if was_keyring && !to_keyring {
            // The login itself succeeded; an entry that cannot be deleted is reported.
            if let Err(reason) = self.keyring.delete_holding(&account, lock) {
                return Ok(Some(reason));
            }
        }
        Ok(None)
    }

    /// Read-modify-write the secrets under the lock (refresh-token rotation persists here
    /// before the new access token is used). Returns whether the credential existed; when it
    /// did not, `f` is not called and nothing is written.
    pub fn update_secrets(
        &self,
        server: &str,
        f: impl FnOnce(&mut Secrets),
    ) -> Result<bool, CredentialError> {
        if !self.check_dirs()? {
            return Ok(false);
        }
        let lock = self.lock()?;
        let Some(mut cred) = self.load_once(server)? else {
            return Ok(false);
        };
        f(&mut cred.secrets);
        let account = self.keyring_account(server);
        let encoded = encode(&cred, &account)?;
        match encoded.blob {
            // The binding, and so the file, is unchanged: only the keyring entry is replaced.
            Some(blob) => self
                .keyring
                .set_holding(&account, blob, lock)
                .map_err(Self::keyring_err(server))?,
            None => self.replace(server, &encoded.file)?,
        }
        Ok(true)
    }

    /// Remove a server's credential under the lock (logout). Returns whether one existed. The
    /// entry is removed even if a load would refuse it (wrong mode, symlink): logout must
    /// always be able to clear local state; only a directory in its place is refused.
    ///
    /// The keyring entry is deleted first when the file says the secrets are there, or when
    /// `keyring_configured` (the server's configuration names the keyring) — then also when
    /// the file is missing or unreadable, so no entry outlives a logout. If that delete fails
    /// the file stays, so a later logout finds the entry again.
    pub fn delete(&self, server: &str, keyring_configured: bool) -> Result<bool, CredentialError> {
        if !self.check_dirs()? {
            if keyring_configured {
                return self.delete_keyring_entry(server, ());
            }
            return Ok(false);
        }
        let lock = self.lock()?;
        let path = self.path_for(server);
        let exists = match fs::symlink_metadata(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(io_err("inspect", &path)(e)),
            Ok(meta) if meta.is_dir() => {
                return Err(CredentialError::Fs(FsError::NotPlain {
                    path,
                    expected: "regular file",
                }));
            }
            Ok(_) => true,
        };
        let in_keyring = match read_stored(&path) {
            Ok(Some(stored)) => stored.binding.secret_store == CredentialBackend::Keyring,
            Ok(None) | Err(_) => keyring_configured,
        };
        let mut removed = false;
        if in_keyring {
            removed |= self.delete_keyring_entry(server, lock.clone())?;
        }
        if !exists {
            return Ok(removed);
        }
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(removed),
            Err(e) => return Err(io_err("remove", &path)(e)),
        }
        // The entry is gone and cannot be brought back; see `replace` on the directory fsync.
        let _ = private_fs::sync_dir(&self.dir);
        Ok(true)
    }

    fn delete_keyring_entry<H: Send + 'static>(
        &self,
        server: &str,
        hold: H,
    ) -> Result<bool, CredentialError> {
        self.keyring
            .delete_holding(&self.keyring_account(server), hold)
            .map_err(Self::keyring_err(server))
    }

    /// The bindings of every stored credential (for status and doctor), sorted by server.
    /// Lock and temp files are skipped; any credential file that would be refused on load
    /// makes the listing fail with that file's error.
    pub fn list(&self) -> Result<Vec<Binding>, CredentialError> {
        if !self.check_dirs()? {
            return Ok(Vec::new());
        }
        let entries = fs::read_dir(&self.dir).map_err(io_err("list", &self.dir))?;
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("list", &self.dir))?;
            let name = entry.file_name();
            let Some(name) = name.to_str().filter(|n| is_lower_hex(n, BINDING_ID_LEN)) else {
                continue;
            };
            let path = entry.path();
            // Vanished since the listing: a concurrent logout.
            let Some(cred) = read_stored(&path)? else {
                continue;
            };
            if Self::binding_id(&cred.binding.server) != name {
                return Err(CredentialError::Corrupt {
                    path,
                    reason: "it holds the credential of another server",
                    at: None,
                });
            }
            out.push(cred.binding);
        }
        out.sort_by(|a, b| a.server.cmp(&b.server));
        Ok(out)
    }

    /// Whether the credentials directory exists; refuses an unsafe home or directory.
    fn check_dirs(&self) -> Result<bool, CredentialError> {
        for dir in [&self.home, &self.dir] {
            match fs::symlink_metadata(dir) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
                Err(e) => return Err(io_err("inspect", dir)(e)),
                Ok(meta) => private_fs::check_private(dir, &meta, true)?,
            }
        }
        Ok(true)
    }

    /// Create the home and the credentials directory 0700 if missing, then check both.
    fn ensure_dirs(&self) -> Result<(), CredentialError> {
        for dir in [&self.home, &self.dir] {
            private_fs::ensure_private_dir(dir)?;
        }
        Ok(())
    }

    /// Atomically replace a server's file. The caller holds the lock.
    fn replace(&self, server: &str, bytes: &[u8]) -> Result<(), CredentialError> {
        private_fs::remove_stale_temps(&self.dir, TEMP_PREFIX);
        let target = self.path_for(server);
        let temp = self.dir.join(private_fs::temp_name(TEMP_PREFIX));
        let written = private_fs::write_new_file(&temp, bytes)
            .map_err(CredentialError::from)
            .and_then(|()| fs::rename(&temp, &target).map_err(io_err("replace", &target)));
        if let Err(e) = written {
            let _ = fs::remove_file(&temp);
            return Err(e);
        }
        // The rename has happened: the change is visible and cannot be taken back, so reporting
        // failure now would make the caller retry (or abandon) an applied change. Syncing the
        // directory makes it durable; if that fails there is nothing better to do than carry on.
        let _ = private_fs::sync_dir(&self.dir);
        Ok(())
    }
}

/// `path` with its longest existing prefix resolved (symlinks, `..`): the same before and after
/// the missing rest is created.
fn resolve_existing_prefix(path: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut cur = path;
    loop {
        if let Ok(real) = fs::canonicalize(cur) {
            return rest.iter().rev().fold(real, |acc, c| acc.join(c));
        }
        match (cur.parent(), cur.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                cur = parent;
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// Read and parse one credential file; `None` when it does not exist.
fn read_stored(path: &Path) -> Result<Option<Stored>, CredentialError> {
    // O_NONBLOCK: a FIFO planted in place of the file must not block the open; it is then
    // refused by the type check.
    let flags = nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK;
    let mut file = match OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits())
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err(CredentialError::Fs(FsError::NotPlain {
                path: path.to_path_buf(),
                expected: "regular file",
            }));
        }
        Err(e) => return Err(io_err("open", path)(e)),
    };
    let meta = file.metadata().map_err(io_err("inspect", path))?;
    private_fs::check_private(path, &meta, false)?;
    if meta.len() > MAX_CREDENTIAL_BYTES {
        return Err(CredentialError::TooLarge(path.to_path_buf()));
    }
    // One byte past the bound, so a file that grew since the stat is detected, never truncated.
    let mut buf = Zeroizing::new(vec![0u8; MAX_LEN + 1]);
    let mut len = 0;
    while len < buf.len() {
        match file.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read", path)(e)),
        }
    }
    if len > MAX_LEN {
        return Err(CredentialError::TooLarge(path.to_path_buf()));
    }
    decode(&buf[..len]).map(Some).map_err(|d| d.at(path))
}

impl From<FsError> for CredentialError {
    fn from(e: FsError) -> Self {
        CredentialError::Fs(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iteron_policy::config::{Command, StdioServer, Transport};
    use proptest::prelude::*;
    use std::hash::{BuildHasher, Hasher, RandomState};
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::ExitStatusExt;
    use std::sync::atomic::AtomicUsize;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::Instant;

    const CANARY: &str = "CANARY-5ecr3t-9f1c";

    fn temp_home() -> (PathBuf, Home) {
        static N: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir().join(format!(
            "iteron-cred-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(&base).unwrap();
        let home = Home::at(base.join("home")).unwrap();
        (base, home)
    }

    fn server(name: &str, args: &[&str]) -> ServerConfig {
        ServerConfig {
            name: ServerName::parse(name).unwrap(),
            transport: Transport::Stdio(StdioServer {
                command: Command::parse("/usr/bin/mcp-fixture").unwrap(),
                args: args.iter().map(|a| a.to_string()).collect(),
                env: vec![],
                sandbox: Default::default(),
            }),
            tools: Default::default(),
            policy: Default::default(),
        }
    }

    fn credential(name: &str, token: &str) -> Credential {
        Credential {
            binding: Binding {
                server: name.to_owned(),
                resource: "https://mcp.example.com/mcp".to_owned(),
                issuer: "https://auth.example.com".to_owned(),
                zone: Zone::Public,
                client_id: format!("client-{name}"),
                client_kind: ClientKind::Dynamic,
                token_auth: TokenAuth::Post,
                requested_scopes: vec!["read".to_owned(), "write".to_owned()],
                granted_scopes: vec!["read".to_owned()],
                config_digest: config_digest(&server(name, &[])),
                secret_store: CredentialBackend::File,
            },
            secrets: Secrets {
                access_token: SecretString::from(format!("at-{token}")),
                refresh_token: Some(SecretString::from(format!("rt-{token}"))),
                client_secret: Some(SecretString::from(format!("cs-{token}"))),
                expires_at: Some(1_900_000_000),
                refresh_failed: false,
                dpop_key: None,
            },
        }
    }

    #[test]
    fn a_stored_credential_is_scrubbed_from_what_a_server_sends_back() {
        let cred = credential("srv", "canary-9f2c1e");
        let k = crate::servers::KnownSecrets::default().with_credential(&cred);
        let echoed = "Authorization: at-canary-9f2c1e; refresh rt-canary-9f2c1e; cs-canary-9f2c1e";
        let shown = k.scrub(echoed);
        assert!(!shown.contains("canary-9f2c1e"), "{shown}");
        assert_eq!(shown.matches("[REDACTED]").count(), 3);
    }

    /// A token rotated in (or a new login) after the server connected is scrubbed too: the
    /// server's token source teaches every token it hands out to the server's scrubber.
    #[test]
    fn every_token_handed_to_a_server_is_learned_by_its_scrubber() {
        use crate::mcp::client::TokenSource;
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("srv", "first-5d1a")).unwrap();
        let learned = crate::servers::LearnedSecrets::default();
        let scrubber = crate::servers::KnownSecrets::default().with_learned(learned.clone());
        let source =
            crate::servers::StoredToken::new(CredentialStore::new(&home), "srv", learned.clone());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let first = rt.block_on(source.current()).unwrap();
        assert_eq!(first.token.expose_secret(), "at-first-5d1a");
        // The stored token changes while the server runs (a refresh persisted its rotation).
        store
            .update_secrets("srv", |s| {
                s.access_token = SecretString::from("at-second-77c0");
            })
            .unwrap();
        let second = rt.block_on(source.current()).unwrap();
        assert_eq!(second.token.expose_secret(), "at-second-77c0");
        let shown = scrubber.scrub("old at-first-5d1a, new at-second-77c0");
        assert_eq!(shown, "old [REDACTED], new [REDACTED]");
        // The refresh token and client secret of the credential are learned too.
        assert_eq!(
            scrubber.scrub("rt-first-5d1a cs-first-5d1a"),
            "[REDACTED] [REDACTED]"
        );
        // Bounded, failing closed: once the set is full nothing is forgotten, and a new
        // token is refused rather than handed out unscrubbed.
        let mut i = 0;
        while learned.learn(&format!("tok-{i:04}")) {
            i += 1;
        }
        assert_eq!(scrubber.scrub("at-first-5d1a"), "[REDACTED]");
        assert_eq!(scrubber.scrub(&format!("tok-{:04}", i - 1)), "[REDACTED]");
        assert_eq!(
            scrubber.scrub(&format!("tok-{i:04}")),
            format!("tok-{i:04}")
        );
        store
            .update_secrets("srv", |s| {
                s.access_token = SecretString::from("at-third-0e4b");
            })
            .unwrap();
        let refused = rt.block_on(source.current()).err().unwrap();
        assert!(refused.contains("restart it"), "{refused}");
        assert!(!refused.contains("third"), "{refused}");
        crate::test_report::record(
            "P1",
            "broker/src/credentials.rs::every_token_handed_to_a_server_is_learned_by_its_scrubber",
            serde_json::json!({"max_learned": crate::servers::MAX_LEARNED_SECRETS}),
        );
        let _ = fs::remove_dir_all(base);
    }

    fn assert_holds(c: &Credential, name: &str, token: &str) {
        let want = credential(name, token);
        assert_eq!(c.binding, want.binding);
        assert!(same(c, &want), "{name}: secrets differ");
    }

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// Write raw bytes as a private file, bypassing the store (to plant test files).
    fn plant(path: &Path, bytes: &[u8]) {
        let _ = fs::remove_file(path);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .unwrap();
        f.write_all(bytes).unwrap();
    }

    /// The stored file of a valid credential as a JSON value, for tests that edit it.
    fn stored_json(store: &CredentialStore, name: &str) -> serde_json::Value {
        serde_json::from_slice(&fs::read(store.path_for(name)).unwrap()).unwrap()
    }

    /// A change to a stored file's JSON.
    type Edit = fn(&mut serde_json::Value);

    /// Remove a key from the file's top level or from one of its sections.
    fn remove_key(v: &mut serde_json::Value, section: Option<&str>, key: &str) {
        let object = match section {
            Some(section) => &mut v[section],
            None => v,
        };
        object.as_object_mut().unwrap().remove(key);
    }

    fn one_line(e: &dyn fmt::Display) -> String {
        let s = e.to_string();
        assert!(
            !s.contains('\n') && s.len() <= 512,
            "not a short single line: {s}"
        );
        s
    }

    #[test]
    fn a_saved_credential_loads_back_updates_and_deletes() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        assert!(store.load("gh").unwrap().is_none());
        let cred = credential("gh", "one");
        store.save(&cred).unwrap();
        assert_holds(&store.load("gh").unwrap().unwrap(), "gh", "one");
        assert_eq!(store.list().unwrap(), vec![cred.binding.clone()]);

        let existed = store
            .update_secrets("gh", |s| {
                s.access_token = SecretString::from("at-two");
                s.refresh_token = Some(SecretString::from("rt-two"));
                s.client_secret = None;
                s.expires_at = None;
            })
            .unwrap();
        assert!(existed);
        let back = store.load("gh").unwrap().unwrap();
        assert_eq!(back.binding, cred.binding);
        assert_eq!(back.secrets.access_token.expose_secret(), "at-two");
        assert_eq!(
            back.secrets
                .refresh_token
                .as_ref()
                .map(|t| t.expose_secret()),
            Some("rt-two")
        );
        assert!(back.secrets.client_secret.is_none());
        assert_eq!(back.secrets.expires_at, None);

        assert!(store.delete("gh", false).unwrap());
        assert!(store.load("gh").unwrap().is_none());
        assert!(!store.delete("gh", false).unwrap());
        assert!(store.list().unwrap().is_empty());
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn updating_or_deleting_a_missing_credential_reports_false_and_creates_nothing() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        let mut called = false;
        assert!(!store.update_secrets("gh", |_| called = true).unwrap());
        assert!(!store.delete("gh", false).unwrap());
        assert!(store.list().unwrap().is_empty());
        assert!(!called);
        assert!(!home.dir().exists());
        store.save(&credential("other", "x")).unwrap();
        assert!(!store.update_secrets("gh", |_| called = true).unwrap());
        assert!(!called);
        assert!(!store.path_for("gh").exists());
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn first_save_creates_a_0700_directory_and_a_0600_file() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("gh", "one")).unwrap();
        assert_eq!(mode(home.dir()), 0o700);
        assert_eq!(mode(store.dir()), 0o700);
        assert_eq!(mode(&store.path_for("gh")), 0o600);
        assert_eq!(mode(&store.dir().join(LOCK_FILE)), 0o600);
        store.update_secrets("gh", |_| {}).unwrap();
        assert_eq!(mode(&store.path_for("gh")), 0o600);
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn binding_id_is_stable_hex_and_hides_the_server_name() {
        let id = CredentialStore::binding_id("github");
        assert_eq!(id, CredentialStore::binding_id("github"));
        assert!(is_lower_hex(&id, 32), "{id}");
        assert!(!id.contains("github"));
        let mut h = Sha256::new();
        h.update(b"iteron-binding-v1\0github");
        assert_eq!(id, hex(&h.finalize())[..32]);
        assert_ne!(id, CredentialStore::binding_id("GitHub"));
        assert_ne!(id, CredentialStore::binding_id("github2"));

        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("github", "one")).unwrap();
        let names: Vec<String> = fs::read_dir(store.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.contains(&id));
        assert!(names.iter().all(|n| !n.contains("github")), "{names:?}");
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn check_binding_detects_a_renamed_server_and_a_changed_configuration() {
        let cfg = server("gh", &["--stdio"]);
        let mut b = credential("gh", "x").binding;
        b.config_digest = config_digest(&cfg);
        assert!(is_lower_hex(&b.config_digest, 64));
        assert_eq!(check_binding(&b, &cfg), Ok(()));
        assert_eq!(
            check_binding(&b, &server("gh2", &["--stdio"])),
            Err(Mismatch::ServerRenamed)
        );
        let changed = server("gh", &["--stdio", "--write"]);
        assert_ne!(config_digest(&changed), config_digest(&cfg));
        assert_eq!(check_binding(&b, &changed), Err(Mismatch::ConfigChanged));
        assert_eq!(config_digest(&cfg), config_digest(&cfg.clone()));
        one_line(&Mismatch::ConfigChanged);
    }

    #[test]
    fn a_group_readable_file_is_refused_with_the_chmod_to_run_and_left_alone() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("gh", "one")).unwrap();
        let path = store.path_for("gh");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let e = store.load("gh").unwrap_err();
        assert!(
            matches!(
                e,
                CredentialError::Fs(FsError::OpenMode {
                    mode: 0o644,
                    want: 0o600,
                    ..
                })
            ),
            "{e}"
        );
        assert!(one_line(&e).contains(&format!("chmod 600 {}", path.display())));
        assert!(matches!(
            store.update_secrets("gh", |_| {}).unwrap_err(),
            CredentialError::Fs(FsError::OpenMode { .. })
        ));
        assert!(matches!(
            store.list().unwrap_err(),
            CredentialError::Fs(FsError::OpenMode { .. })
        ));
        assert_eq!(mode(&path), 0o644);
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn an_open_directory_is_refused_and_not_repaired() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("gh", "one")).unwrap();
        fs::set_permissions(store.dir(), fs::Permissions::from_mode(0o750)).unwrap();
        let e = store.load("gh").unwrap_err();
        assert!(
            matches!(
                e,
                CredentialError::Fs(FsError::OpenMode {
                    mode: 0o750,
                    want: 0o700,
                    ..
                })
            ),
            "{e}"
        );
        assert!(one_line(&e).contains("chmod 700"));
        assert!(matches!(
            store.save(&credential("gh", "two")).unwrap_err(),
            CredentialError::Fs(FsError::OpenMode { .. })
        ));
        assert!(matches!(
            store.delete("gh", false).unwrap_err(),
            CredentialError::Fs(FsError::OpenMode { .. })
        ));
        assert_eq!(mode(store.dir()), 0o750);
        fs::set_permissions(store.dir(), fs::Permissions::from_mode(0o700)).unwrap();
        assert_holds(&store.load("gh").unwrap().unwrap(), "gh", "one");
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_symlinked_credential_file_or_directory_is_refused() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("gh", "one")).unwrap();
        let path = store.path_for("gh");
        let elsewhere = base.join("elsewhere");
        fs::rename(&path, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
        assert!(matches!(
            store.load("gh").unwrap_err(),
            CredentialError::Fs(FsError::NotPlain { .. })
        ));
        assert!(matches!(
            store.list().unwrap_err(),
            CredentialError::Fs(FsError::NotPlain { .. })
        ));
        // Logout still clears the link, never its target.
        assert!(store.delete("gh", false).unwrap());
        assert!(elsewhere.exists());

        let real = base.join("real-dir");
        fs::rename(store.dir(), &real).unwrap();
        std::os::unix::fs::symlink(&real, store.dir()).unwrap();
        assert!(matches!(
            store.load("gh").unwrap_err(),
            CredentialError::Fs(FsError::NotPlain { .. })
        ));
        assert!(matches!(
            store.save(&credential("gh", "two")).unwrap_err(),
            CredentialError::Fs(FsError::NotPlain { .. })
        ));
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_fifo_in_place_of_a_credential_is_refused_without_blocking() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("gh", "one")).unwrap();
        let path = store.path_for("gh");
        fs::remove_file(&path).unwrap();
        nix::unistd::mkfifo(
            &path,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .unwrap();
        assert!(matches!(
            store.load("gh").unwrap_err(),
            CredentialError::Fs(FsError::NotPlain { .. })
        ));
        assert!(matches!(
            store.list().unwrap_err(),
            CredentialError::Fs(FsError::NotPlain { .. })
        ));
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_credential_owned_by_another_uid_is_refused() {
        // Needs root to hand the file to uid 65534 (CI runs as root).
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: not root, cannot chown");
            return;
        }
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("gh", "one")).unwrap();
        let nobody = Some(nix::unistd::Uid::from_raw(65534));
        nix::unistd::chown(&store.path_for("gh"), nobody, None).unwrap();
        assert!(matches!(
            store.load("gh").unwrap_err(),
            CredentialError::Fs(FsError::WrongOwner { owner: 65534, .. })
        ));
        nix::unistd::chown(&store.path_for("gh"), Some(nix::unistd::geteuid()), None).unwrap();
        nix::unistd::chown(store.dir(), nobody, None).unwrap();
        assert!(matches!(
            store.load("gh").unwrap_err(),
            CredentialError::Fs(FsError::WrongOwner { owner: 65534, .. })
        ));
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_file_one_byte_over_the_bound_is_refused() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("gh", "one")).unwrap();
        let path = store.path_for("gh");
        let mut exact = fs::read(&path).unwrap();
        exact.resize(MAX_LEN, b' ');
        plant(&path, &exact);
        assert_holds(&store.load("gh").unwrap().unwrap(), "gh", "one");
        exact.push(b' ');
        plant(&path, &exact);
        assert!(matches!(
            store.load("gh").unwrap_err(),
            CredentialError::TooLarge(_)
        ));
        assert_eq!(fs::read(&path).unwrap(), exact);

        let mut huge = credential("gh", "one");
        huge.secrets.access_token = SecretString::from("x".repeat(MAX_LEN));
        assert!(matches!(
            store.save(&huge).unwrap_err(),
            CredentialError::Unwritable(_)
        ));
        assert_eq!(fs::read(&path).unwrap(), exact);
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn schema_0_schema_2_and_missing_fields_require_a_re_login() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("gh", "one")).unwrap();
        let valid = stored_json(&store, "gh");
        let path = store.path_for("gh");
        let edits: [(&str, Edit); 7] = [
            ("schema 0", |v| v["schema"] = 0.into()),
            ("schema 2", |v| v["schema"] = 2.into()),
            ("no schema", |v| remove_key(v, None, "schema")),
            ("no secrets", |v| remove_key(v, None, "secrets")),
            ("no zone", |v| remove_key(v, Some("binding"), "zone")),
            ("no digest", |v| {
                remove_key(v, Some("binding"), "config_digest")
            }),
            ("no refresh_token key", |v| {
                remove_key(v, Some("secrets"), "refresh_token")
            }),
        ];
        for (what, edit) in edits {
            let mut v = valid.clone();
            edit(&mut v);
            let bytes = serde_json::to_vec(&v).unwrap();
            plant(&path, &bytes);
            let e = store.load("gh").unwrap_err();
            assert!(matches!(e, CredentialError::Outdated { .. }), "{what}: {e}");
            assert!(one_line(&e).contains("re-login required"), "{what}");
            assert!(matches!(
                store.update_secrets("gh", |_| {}).unwrap_err(),
                CredentialError::Outdated { .. }
            ));
            assert_eq!(fs::read(&path).unwrap(), bytes, "{what}: file changed");
        }
        // A new login replaces an outdated file.
        store.save(&credential("gh", "two")).unwrap();
        assert_holds(&store.load("gh").unwrap().unwrap(), "gh", "two");
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn garbage_is_corrupt_and_the_file_stays_byte_for_byte_unchanged() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("gh", "one")).unwrap();
        let valid = stored_json(&store, "gh");
        let path = store.path_for("gh");
        let edit = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = valid.clone();
            f(&mut v);
            serde_json::to_vec(&v).unwrap()
        };
        let samples: Vec<(&str, Vec<u8>)> = vec![
            ("not json", b"access_token=abc".to_vec()),
            ("truncated", b"{\"schema\": 1, \"binding\": {".to_vec()),
            ("empty", Vec::new()),
            ("array", b"[1, {}, {}]".to_vec()),
            ("schema string", edit(&|v| v["schema"] = "1".into())),
            (
                "expires_at string",
                edit(&|v| v["secrets"]["expires_at"] = "soon".into()),
            ),
            (
                "null access token",
                edit(&|v| v["secrets"]["access_token"] = serde_json::Value::Null),
            ),
            ("unknown top field", edit(&|v| v["extra"] = true.into())),
            (
                "unknown secret field",
                edit(&|v| v["secrets"]["id_token"] = "x".into()),
            ),
            (
                "binding as array",
                edit(&|v| v["binding"] = serde_json::json!(["gh"])),
            ),
            (
                "unknown zone",
                edit(&|v| v["binding"]["zone"] = "moon".into()),
            ),
            (
                "unknown client kind",
                edit(&|v| v["binding"]["client_kind"] = "dcr".into()),
            ),
            (
                "unknown auth",
                edit(&|v| v["binding"]["token_auth"] = "tls_client_auth".into()),
            ),
            (
                "bad digest",
                edit(&|v| v["binding"]["config_digest"] = "ABC".into()),
            ),
            (
                "other server",
                edit(&|v| v["binding"]["server"] = "gl".into()),
            ),
        ];
        let dup = {
            let text = String::from_utf8(edit(&|_| {})).unwrap();
            text.replacen("{\"schema\":1,", "{\"schema\":1,\"schema\":1,", 1)
                .into_bytes()
        };
        for (what, bytes) in samples.into_iter().chain([("duplicate key", dup)]) {
            plant(&path, &bytes);
            let e = store.load("gh").unwrap_err();
            assert!(matches!(e, CredentialError::Corrupt { .. }), "{what}: {e}");
            one_line(&e);
            assert!(matches!(
                store
                    .update_secrets("gh", |s| s.expires_at = Some(1))
                    .unwrap_err(),
                CredentialError::Corrupt { .. }
            ));
            assert!(store.list().is_err(), "{what}");
            assert_eq!(fs::read(&path).unwrap(), bytes, "{what}: file changed");
        }
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn no_secret_reaches_any_error_or_debug_output() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        let cred = credential("gh", CANARY);
        let shown = format!("{cred:?} {:?} {:?}", cred.secrets, cred.binding);
        assert!(!shown.contains(CANARY), "{shown}");
        assert!(shown.contains("[not shown]"));
        store.save(&cred).unwrap();
        let path = store.path_for("gh");
        let valid = stored_json(&store, "gh");
        let edit = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = valid.clone();
            f(&mut v);
            serde_json::to_vec(&v).unwrap()
        };
        let mut errors = Vec::new();
        let files: Vec<Vec<u8>> = vec![
            edit(&|v| v["secrets"]["expires_at"] = CANARY.into()),
            edit(&|v| v["secrets"]["access_token"] = 7.into()),
            edit(&|v| v["secrets"][CANARY] = CANARY.into()),
            edit(&|v| v["schema"] = CANARY.into()),
            edit(&|v| v["binding"]["zone"] = CANARY.into()),
            edit(&|v| v["schema"] = 2.into()),
            edit(&|v| remove_key(v, Some("binding"), "issuer")),
            format!("{{\"schema\": 1, \"secrets\": {{\"access_token\": \"{CANARY}\" ]")
                .into_bytes(),
            format!("{{\"schema\": {CANARY}}}").into_bytes(),
            {
                let mut big = edit(&|_| {});
                big.resize(MAX_LEN + 1, b' ');
                big
            },
        ];
        for bytes in files {
            plant(&path, &bytes);
            errors.push(store.load("gh").unwrap_err());
            errors.push(store.update_secrets("gh", |_| {}).unwrap_err());
        }
        store.save(&cred).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        errors.push(store.load("gh").unwrap_err());
        let mut bad = cred.clone();
        bad.binding.config_digest = CANARY.to_owned();
        errors.push(store.save(&bad).unwrap_err());
        for e in &errors {
            let text = format!("{e} {e:?}");
            assert!(!text.contains(CANARY), "{text}");
            assert!(!text.contains("5ecr3t"), "{text}");
            one_line(e);
        }
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn list_returns_bindings_only_and_skips_lock_and_temp_files() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        store.save(&credential("b", "1")).unwrap();
        store.save(&credential("a", "2")).unwrap();
        let stale = store.dir().join(format!("{TEMP_PREFIX}999-0"));
        plant(&stale, b"{\"schema\": 1, \"bin");
        plant(&store.dir().join("README"), b"not a credential");
        let servers: Vec<String> = store
            .list()
            .unwrap()
            .into_iter()
            .map(|b| b.server)
            .collect();
        assert_eq!(servers, ["a", "b"]);
        // The next writer clears what a dead writer left behind.
        store.update_secrets("a", |_| {}).unwrap();
        assert!(!stale.exists());
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_credential_this_build_could_not_read_back_is_never_written() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        let mut bad_name = credential("gh", "one");
        bad_name.binding.server = "../gh".to_owned();
        let mut bad_digest = credential("gh", "one");
        bad_digest.binding.config_digest = config_digest(&server("gh", &[])).to_uppercase();
        for c in [bad_name, bad_digest] {
            assert!(matches!(
                store.save(&c).unwrap_err(),
                CredentialError::Unwritable(_)
            ));
        }
        assert!(!store.dir().exists());
        store.save(&credential("gh", "one")).unwrap();
        let e = store
            .update_secrets("gh", |s| {
                s.access_token = SecretString::from("x".repeat(MAX_LEN))
            })
            .unwrap_err();
        assert!(matches!(e, CredentialError::Unwritable(_)), "{e}");
        assert_holds(&store.load("gh").unwrap().unwrap(), "gh", "one");
        fs::remove_dir_all(base).unwrap();
    }

    // ---- keyring backend -------------------------------------------------------------------

    #[cfg(feature = "keyring")]
    fn mock_keyring() -> (Arc<keyring_core::CredentialStore>, Keyring) {
        let store: Arc<keyring_core::CredentialStore> = keyring_core::mock::Store::new().unwrap();
        (store.clone(), Keyring::store(store))
    }

    #[cfg(feature = "keyring")]
    /// Make the next keyring call on `server`'s entry in `cs` fail with `e`.
    fn fail_next(
        mock: &Arc<keyring_core::CredentialStore>,
        cs: &CredentialStore,
        server: &str,
        e: keyring_core::Error,
    ) {
        let entry =
            keyring_core::Entry::new_in_store(mock, KEYRING_SERVICE, &cs.keyring_account(server))
                .unwrap();
        let cred: &keyring_core::mock::Cred = entry.as_any().downcast_ref().unwrap();
        cred.set_error(e);
    }

    #[cfg(feature = "keyring")]
    fn locked() -> keyring_core::Error {
        keyring_core::Error::NoStorageAccess("locked".into())
    }

    fn keyring_credential(name: &str, token: &str) -> Credential {
        let mut c = credential(name, token);
        c.binding.secret_store = CredentialBackend::Keyring;
        c
    }

    #[cfg(feature = "keyring")]
    fn entry_exists(keyring: &Keyring, cs: &CredentialStore, server: &str) -> bool {
        match keyring.get(&cs.keyring_account(server)) {
            Ok(_) => true,
            Err(KeyringError::NoEntry) => false,
            Err(e) => panic!("{e:?}"),
        }
    }

    #[cfg(feature = "keyring")]
    fn access_of(store: &CredentialStore, server: &str) -> String {
        let c = store.load(server).unwrap().unwrap();
        c.secrets.access_token.expose_secret().to_owned()
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn keyring_backed_secrets_never_touch_the_file() {
        let (base, home) = temp_home();
        let (_, keyring) = mock_keyring();
        let store = CredentialStore::with_keyring(&home, keyring.clone());
        store.save(&keyring_credential("kr", CANARY)).unwrap();
        let file = fs::read_to_string(store.path_for("kr")).unwrap();
        assert!(!file.contains(CANARY), "{file}");
        assert!(file.contains(KEYRING_SERVICE));
        assert_eq!(mode(&store.path_for("kr")), 0o600);
        assert_eq!(access_of(&store, "kr"), format!("at-{CANARY}"));
        let c = store.load("kr").unwrap().unwrap();
        assert_eq!(c.binding.secret_store, CredentialBackend::Keyring);
        assert_eq!(
            store.list().unwrap()[0].secret_store,
            CredentialBackend::Keyring
        );

        // Rotation replaces only the keyring entry; the file stays byte for byte.
        let rotated = format!("{CANARY}-2");
        assert!(
            store
                .update_secrets("kr", |s| s.refresh_token =
                    Some(SecretString::from(rotated.clone())))
                .unwrap()
        );
        assert_eq!(fs::read_to_string(store.path_for("kr")).unwrap(), file);
        let c = store.load("kr").unwrap().unwrap();
        assert_eq!(c.secrets.refresh_token.unwrap().expose_secret(), rotated);

        assert!(store.delete("kr", true).unwrap());
        assert!(!store.path_for("kr").exists());
        assert!(!entry_exists(&keyring, &store, "kr"));
        fs::remove_dir_all(base).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn a_failed_keyring_write_writes_no_file_and_keeps_the_previous_login() {
        let (base, home) = temp_home();
        let (mock, keyring) = mock_keyring();
        let store = CredentialStore::with_keyring(&home, keyring);
        // First login: the keyring write fails, so no file appears, secret or not.
        fail_next(&mock, &store, "kr", locked());
        let e = store.save(&keyring_credential("kr", CANARY)).unwrap_err();
        assert!(
            matches!(
                e,
                CredentialError::Keyring {
                    reason: KeyringError::Denied,
                    ..
                }
            ),
            "{e}"
        );
        assert!(!e.to_string().contains(CANARY));
        assert!(!store.path_for("kr").exists());
        // A re-login whose keyring write fails leaves the earlier login whole and usable.
        store.save(&keyring_credential("kr", "first")).unwrap();
        let file = fs::read(store.path_for("kr")).unwrap();
        let mut second = keyring_credential("kr", "second");
        second.binding.client_id = "client-second".into();
        fail_next(&mock, &store, "kr", locked());
        assert!(store.save(&second).is_err());
        assert_eq!(fs::read(store.path_for("kr")).unwrap(), file);
        assert_eq!(access_of(&store, "kr"), "at-first");
        fs::remove_dir_all(base).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn the_login_probe_needs_a_keyring_that_accepts_writes() {
        let (base, home) = temp_home();
        let (mock, keyring) = mock_keyring();
        let store = CredentialStore::with_keyring(&home, keyring.clone());
        store.probe_keyring("kr").unwrap();
        // A keyring that reads but refuses writes fails the probe.
        let probe = format!("{}.probe", store.keyring_account("kr"));
        let entry = keyring_core::Entry::new_in_store(&mock, KEYRING_SERVICE, &probe).unwrap();
        let cred: &keyring_core::mock::Cred = entry.as_any().downcast_ref().unwrap();
        cred.set_error(locked());
        assert!(matches!(
            store.probe_keyring("kr").unwrap_err(),
            CredentialError::Keyring {
                reason: KeyringError::Denied,
                ..
            }
        ));
        assert_eq!(keyring.get(&probe).unwrap_err(), KeyringError::NoEntry);
        fs::remove_dir_all(base).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn an_unusable_keyring_fails_closed_and_never_falls_back_to_a_file() {
        let (base, home) = temp_home();
        let (mock, keyring) = mock_keyring();
        let store = CredentialStore::with_keyring(&home, keyring.clone());
        store.save(&keyring_credential("kr", CANARY)).unwrap();
        for (injected, want) in [
            (locked(), KeyringError::Denied),
            (
                keyring_core::Error::PlatformFailure("no bus".into()),
                KeyringError::Unavailable,
            ),
            (keyring_core::Error::NoEntry, KeyringError::NoEntry),
        ] {
            fail_next(&mock, &store, "kr", injected);
            let e = store.load("kr").unwrap_err();
            assert!(
                matches!(&e, CredentialError::Keyring { reason, .. } if *reason == want),
                "{e}"
            );
            let line = e.to_string();
            assert!(line.contains("nothing falls back to a file"), "{line}");
            assert!(!line.contains('\n') && !line.contains(CANARY), "{line}");
        }
        // A keyring failure during a rotation is reported and changes nothing.
        fail_next(&mock, &store, "kr", locked());
        assert!(store.update_secrets("kr", |_| {}).is_err());
        assert_eq!(access_of(&store, "kr"), format!("at-{CANARY}"));
        // Listing bindings (auth status, doctor) never calls the keyring: the injected error is
        // still pending afterwards.
        fail_next(&mock, &store, "kr", locked());
        assert_eq!(store.list().unwrap().len(), 1);
        assert!(matches!(
            store.load("kr").unwrap_err(),
            CredentialError::Keyring {
                reason: KeyringError::Denied,
                ..
            }
        ));
        // Logout with a failing keyring keeps the file so a later logout can retry.
        fail_next(&mock, &store, "kr", locked());
        assert!(store.delete("kr", true).is_err());
        assert!(store.path_for("kr").exists());
        assert!(entry_exists(&keyring, &store, "kr"));
        assert!(store.delete("kr", true).unwrap());
        assert!(!entry_exists(&keyring, &store, "kr"));
        fs::remove_dir_all(base).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn logout_of_a_keyring_server_clears_an_entry_whose_file_is_gone_or_broken() {
        let (base, home) = temp_home();
        let (_, keyring) = mock_keyring();
        let store = CredentialStore::with_keyring(&home, keyring.clone());
        // A crash after the keyring write of a first login leaves an entry and no file.
        store.save(&keyring_credential("kr", CANARY)).unwrap();
        fs::remove_file(store.path_for("kr")).unwrap();
        assert!(entry_exists(&keyring, &store, "kr"));
        assert!(store.delete("kr", true).unwrap());
        assert!(!entry_exists(&keyring, &store, "kr"));
        // A broken file: the file goes, and so does the entry.
        store.save(&keyring_credential("kr", CANARY)).unwrap();
        fs::write(store.path_for("kr"), "{").unwrap();
        assert!(store.delete("kr", true).unwrap());
        assert!(!store.path_for("kr").exists());
        assert!(!entry_exists(&keyring, &store, "kr"));
        // A file-store server never calls the keyring on logout, even with no file.
        let (mock2, keyring2) = mock_keyring();
        let files = CredentialStore::with_keyring(&home, keyring2);
        files.save(&credential("plain", "x")).unwrap();
        fail_next(&mock2, &files, "plain", locked());
        assert!(files.delete("plain", false).unwrap());
        assert!(!files.delete("plain", false).unwrap());
        fs::remove_dir_all(base).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn two_homes_with_the_same_server_name_never_share_a_keyring_entry() {
        let (base_a, home_a) = temp_home();
        let (base_b, home_b) = temp_home();
        let (_, keyring) = mock_keyring();
        let a = CredentialStore::with_keyring(&home_a, keyring.clone());
        let b = CredentialStore::with_keyring(&home_b, keyring.clone());
        assert_ne!(a.keyring_account("gh"), b.keyring_account("gh"));
        a.save(&keyring_credential("gh", "home-a")).unwrap();
        b.save(&keyring_credential("gh", "home-b")).unwrap();
        assert_eq!(access_of(&a, "gh"), "at-home-a");
        assert_eq!(access_of(&b, "gh"), "at-home-b");
        assert!(b.delete("gh", true).unwrap());
        assert_eq!(access_of(&a, "gh"), "at-home-a");
        // A file copied from another home is refused (re-login), never pointed at that home's
        // entry.
        b.save(&keyring_credential("gh", "home-b")).unwrap();
        fs::copy(b.path_for("gh"), a.path_for("gh")).unwrap();
        assert!(matches!(
            a.load("gh").unwrap_err(),
            CredentialError::Keyring {
                reason: KeyringError::Mismatch,
                ..
            }
        ));
        // The account of a home does not change when the home is created.
        let fresh = base_a.join("later/home");
        let before =
            CredentialStore::with_keyring(&Home::at(fresh.clone()).unwrap(), keyring.clone())
                .keyring_account("gh");
        fs::create_dir_all(&fresh).unwrap();
        let after = CredentialStore::with_keyring(&Home::at(fresh).unwrap(), keyring.clone())
            .keyring_account("gh");
        assert_eq!(before, after);
        // The same home reached through a symlink keeps its entries.
        let link = base_a.join("link");
        std::os::unix::fs::symlink(home_a.dir(), &link).unwrap();
        let via_link = CredentialStore::with_keyring(&Home::at(link).unwrap(), keyring.clone());
        assert_eq!(via_link.keyring_account("gh"), a.keyring_account("gh"));
        fs::remove_dir_all(base_a).unwrap();
        fs::remove_dir_all(base_b).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn a_keyring_entry_is_tied_to_its_exact_binding() {
        let (base, home) = temp_home();
        let (_, keyring) = mock_keyring();
        let store = CredentialStore::with_keyring(&home, keyring.clone());
        store.save(&keyring_credential("kr", CANARY)).unwrap();
        let first = fs::read(store.path_for("kr")).unwrap();
        // A re-login with another client id; then the old file comes back (a crash between
        // the keyring write and the rename looks the same): the new secrets are refused.
        let mut other = keyring_credential("kr", "second");
        other.binding.client_id = "client-other".into();
        store.save(&other).unwrap();
        fs::write(store.path_for("kr"), &first).unwrap();
        let e = store.load("kr").unwrap_err();
        assert!(
            matches!(
                e,
                CredentialError::Keyring {
                    reason: KeyringError::Mismatch,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("re-login required"), "{e}");
        fs::remove_dir_all(base).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn keyring_entries_are_parsed_strictly() {
        let (base, home) = temp_home();
        let (_, keyring) = mock_keyring();
        let store = CredentialStore::with_keyring(&home, keyring.clone());
        let cred = keyring_credential("kr", CANARY);
        store.save(&cred).unwrap();
        let account = store.keyring_account("kr");
        let good = String::from_utf8(keyring.get(&account).unwrap().to_vec()).unwrap();
        let digest = binding_sha256(&cred.binding, &account);
        assert!(good.contains(&digest));
        let cases = [
            (
                good.replace(&digest, &"0".repeat(64)),
                KeyringError::Mismatch,
            ),
            (
                good.replace("\"schema\":1", "\"schema\":2"),
                KeyringError::Unreadable,
            ),
            (
                good.replace("\"schema\":1", "\"schema\":1,\"extra\":true"),
                KeyringError::Unreadable,
            ),
            (
                good.replace("\"schema\":1", "\"schema\":1,\"schema\":1"),
                KeyringError::Unreadable,
            ),
            (
                good.replace(",\"expires_at\":1900000000", ""),
                KeyringError::Unreadable,
            ),
            ("{\"schema\": 1}".to_owned(), KeyringError::Unreadable),
            ("[]".to_owned(), KeyringError::Unreadable),
        ];
        for (bad, want) in cases {
            assert_ne!(bad, good);
            keyring
                .set(&account, Zeroizing::new(bad.clone().into_bytes()))
                .unwrap();
            let e = store.load("kr").unwrap_err();
            assert!(
                matches!(&e, CredentialError::Keyring { reason, .. } if *reason == want),
                "{bad}: {e}"
            );
            assert!(!e.to_string().contains(CANARY));
        }
        fs::remove_dir_all(base).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn relogin_into_the_file_store_removes_the_keyring_entry() {
        let (base, home) = temp_home();
        let (_, keyring) = mock_keyring();
        let store = CredentialStore::with_keyring(&home, keyring.clone());
        store.save(&keyring_credential("kr", CANARY)).unwrap();
        assert!(entry_exists(&keyring, &store, "kr"));
        store.save(&credential("kr", "in-file")).unwrap();
        assert!(!entry_exists(&keyring, &store, "kr"));
        let c = store.load("kr").unwrap().unwrap();
        assert_eq!(c.binding.secret_store, CredentialBackend::File);
        assert_eq!(c.secrets.access_token.expose_secret(), "at-in-file");
        fs::remove_dir_all(base).unwrap();
    }

    #[cfg(feature = "keyring")]
    #[test]
    fn keyring_references_are_checked_strictly() {
        let (base, home) = temp_home();
        let (_, keyring) = mock_keyring();
        let store = CredentialStore::with_keyring(&home, keyring);
        store.save(&keyring_credential("kr", CANARY)).unwrap();
        let good = fs::read_to_string(store.path_for("kr")).unwrap();
        let account = store.keyring_account("kr");
        // Another account in the reference: a copied home, which needs a new login.
        fs::write(
            store.path_for("kr"),
            good.replace(&account, &"0".repeat(32)),
        )
        .unwrap();
        assert!(matches!(
            store.load("kr").unwrap_err(),
            CredentialError::Keyring {
                reason: KeyringError::Mismatch,
                ..
            }
        ));
        let cases = [
            good.replace(&account, "not-hex"),
            good.replace(KEYRING_SERVICE, "someone-else"),
            good.replace(
                "\"keyring\":",
                "\"secrets\":{\"access_token\":\"a\",\"refresh_token\":null,\"client_secret\":null,\"expires_at\":null},\"keyring\":",
            ),
        ];
        for bad in cases {
            assert_ne!(bad, good);
            fs::write(store.path_for("kr"), &bad).unwrap();
            assert!(
                matches!(
                    store.load("kr").unwrap_err(),
                    CredentialError::Corrupt { .. }
                ),
                "{bad}"
            );
        }
        fs::remove_dir_all(base).unwrap();
    }

    // ---- kill -9 during refresh writes ------------------------------------------------------

    const CHILD_ENV: &str = "ITERON_CRED_CHILD";
    const ROTATING: &str = "rotating";
    const CHILD_WRITES: u64 = 500;
    const KILL_ROUNDS: u64 = 6;

    /// A random-looking token that still tells which write produced it.
    fn rotation_token(kind: &str, seq: u64) -> String {
        let d = Sha256::digest(format!("{kind}:{seq}").as_bytes());
        format!("{kind}-{seq}-{}", &hex(&d)[..20])
    }

    fn seq_of(token: &str) -> Option<u64> {
        token.split('-').nth(1)?.parse().ok()
    }

    /// The write sequence number of the stored file, checking that every secret comes from
    /// that same write.
    fn checked_seq(store: &CredentialStore) -> u64 {
        let c = store
            .load(ROTATING)
            .unwrap()
            .expect("the credential file is present");
        let seq = seq_of(c.secrets.access_token.expose_secret()).unwrap();
        assert_eq!(
            c.secrets.access_token.expose_secret(),
            rotation_token("at", seq)
        );
        assert_eq!(
            c.secrets.refresh_token.as_ref().unwrap().expose_secret(),
            rotation_token("rt", seq)
        );
        assert_eq!(c.secrets.expires_at, Some(seq));
        assert_eq!(c.binding, credential(ROTATING, "x").binding);
        seq
    }

    fn random_below(n: u64) -> u64 {
        RandomState::new().build_hasher().finish() % n
    }

    #[test]
    fn kill_9_during_500_refresh_writes_always_leaves_a_parsable_private_file() {
        if let Some(dir) = std::env::var_os(CHILD_ENV) {
            // Child mode: rotate 500 times, continuing from whatever the file holds.
            let store = CredentialStore::new(&Home::at(PathBuf::from(dir)).unwrap());
            for _ in 0..CHILD_WRITES {
                let existed = store
                    .update_secrets(ROTATING, |s| {
                        let seq = seq_of(s.access_token.expose_secret()).unwrap() + 1;
                        s.access_token = SecretString::from(rotation_token("at", seq));
                        s.refresh_token = Some(SecretString::from(rotation_token("rt", seq)));
                        s.expires_at = Some(seq);
                    })
                    .unwrap();
                assert!(existed);
            }
            return;
        }

        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        let mut cred = credential(ROTATING, "x");
        cred.secrets.access_token = SecretString::from(rotation_token("at", 0));
        cred.secrets.refresh_token = Some(SecretString::from(rotation_token("rt", 0)));
        cred.secrets.expires_at = Some(0);
        store.save(&cred).unwrap();
        let module = module_path!().split_once("::").unwrap().1;
        let test_name = format!(
            "{module}::kill_9_during_500_refresh_writes_always_leaves_a_parsable_private_file"
        );
        let exe = std::env::current_exe().unwrap();
        let path = store.path_for(ROTATING);
        let mut last = 0;
        let mut killed = 0;
        for round in 1..=KILL_ROUNDS {
            let mut child = std::process::Command::new(&exe)
                .args(["--exact", &test_name, "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, home.dir())
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            // Kill at a random-ish point of this child's 500 writes: once it has passed a
            // random write number, plus a random fraction of a write.
            let target = last + 1 + random_below(CHILD_WRITES - 1);
            let deadline = Instant::now() + Duration::from_secs(120);
            while checked_seq(&store) < target
                && Instant::now() < deadline
                && child.try_wait().unwrap().is_none()
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_micros(random_below(3_000)));
            let _ = child.kill(); // SIGKILL
            let status = child.wait().unwrap();
            if status.signal() == Some(nix::libc::SIGKILL) {
                killed += 1;
            } else {
                assert!(status.success(), "round {round}: child failed: {status:?}");
            }
            assert_eq!(mode(&path), 0o600, "round {round}");
            let seq = checked_seq(&store);
            assert!(
                seq >= last,
                "round {round}: rolled back from {last} to {seq}"
            );
            assert!(
                seq <= round * CHILD_WRITES,
                "round {round}: {seq} was never written"
            );
            last = seq;
        }
        assert!(last > 0, "no child ever wrote");
        assert!(killed > 0, "no child was killed mid-run");
        // Temp files of killed writers are cleared by the next writer.
        store.update_secrets(ROTATING, |_| {}).unwrap();
        let names: Vec<String> = fs::read_dir(store.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(
            names.iter().all(|n| !n.starts_with(TEMP_PREFIX)),
            "{names:?}"
        );
        fs::remove_dir_all(base).unwrap();
        crate::test_report::record(
            "P6",
            "broker/src/credentials.rs::kill_9_during_500_refresh_writes_always_leaves_a_parsable_private_file",
            serde_json::json!({}),
        );
    }

    #[test]
    fn twenty_concurrent_logins_racing_a_logout_lose_or_mix_no_binding() {
        let (base, home) = temp_home();
        let store = CredentialStore::new(&home);
        let names: Vec<String> = (0..20).map(|i| format!("srv-{i:02}")).collect();
        let victim = names[7].clone();
        let start = Arc::new(Barrier::new(names.len() + 1));
        let finished = Arc::new(AtomicUsize::new(0));
        let logins: Vec<_> = names
            .iter()
            .map(|name| {
                let (store, start, finished) = (store.clone(), start.clone(), finished.clone());
                let name = name.clone();
                std::thread::spawn(move || {
                    start.wait();
                    store.save(&credential(&name, &name)).unwrap();
                    finished.fetch_add(1, Ordering::SeqCst);
                })
            })
            .collect();
        let logout = {
            let (store, start, finished) = (store.clone(), start.clone(), finished.clone());
            let victim = victim.clone();
            let total = names.len();
            std::thread::spawn(move || {
                start.wait();
                let mut deletes = 0;
                while finished.load(Ordering::SeqCst) < total {
                    store.delete(&victim, false).unwrap();
                    deletes += 1;
                    std::thread::yield_now();
                }
                deletes
            })
        };
        for t in logins {
            t.join().unwrap();
        }
        assert!(logout.join().unwrap() > 0);
        for name in &names {
            match store.load(name).unwrap() {
                Some(c) => assert_holds(&c, name, name),
                None => assert_eq!(name, &victim, "{name} was lost"),
            }
        }
        let listed = store.list().unwrap();
        let others = listed.iter().filter(|b| b.server != victim).count();
        assert_eq!(others, names.len() - 1);
        for b in &listed {
            assert_eq!(b, &credential(&b.server, "x").binding);
        }
        fs::remove_dir_all(base).unwrap();
        crate::test_report::record(
            "P6",
            "broker/src/credentials.rs::twenty_concurrent_logins_racing_a_logout_lose_or_mix_no_binding",
            serde_json::json!({}),
        );
    }

    // ---- properties of the file format ------------------------------------------------------

    fn arb_zone() -> impl Strategy<Value = Zone> {
        prop::sample::select(Zone::ALL.to_vec())
    }

    proptest! {
        #[test]
        fn any_credential_round_trips_through_the_file_format(
            resource in any::<String>(),
            issuer in any::<String>(),
            client_id in any::<String>(),
            zone in arb_zone(),
            kind in prop::sample::select(CLIENT_KINDS.to_vec()),
            auth in prop::sample::select(TOKEN_AUTHS.to_vec()),
            scopes in prop::collection::vec(any::<String>(), 0..4),
            access in any::<String>(),
            refresh in prop::option::of(any::<String>()),
            secret in prop::option::of(any::<String>()),
            expires in prop::option::of(any::<u64>()),
            dpop_key in prop::option::of("[A-Za-z0-9_-]{1,200}"),
            keyring in any::<bool>(),
        ) {
            let mut c = credential("prop", "x");
            if keyring {
                c.binding.secret_store = CredentialBackend::Keyring;
            }
            c.binding.resource = resource;
            c.binding.issuer = issuer;
            c.binding.client_id = client_id;
            c.binding.zone = zone;
            c.binding.client_kind = kind;
            c.binding.token_auth = auth;
            c.binding.granted_scopes = scopes;
            c.secrets.access_token = SecretString::from(access);
            c.secrets.refresh_token = refresh.map(SecretString::from);
            c.secrets.client_secret = secret.map(SecretString::from);
            c.secrets.expires_at = expires;
            c.secrets.dpop_key = dpop_key.map(SecretString::from);
            let account = "0123456789abcdef0123456789abcdef";
            let encoded = encode(&c, account).unwrap();
            let stored = decode(&encoded.file).unwrap();
            prop_assert_eq!(&stored.binding, &c.binding);
            let secrets = match (&encoded.blob, stored.secrets) {
                (None, Some(s)) if !keyring => s,
                (Some(blob), None) if keyring => {
                    // The file holds no secret at all.
                    let file = std::str::from_utf8(&encoded.file).unwrap();
                    prop_assert!(!file.contains("access_token"));
                    prop_assert_eq!(stored.keyring_account.as_deref(), Some(account));
                    decode_blob(blob, &stored.binding, account).unwrap()
                }
                _ => panic!("secrets in the wrong place"),
            };
            let back = Credential { binding: stored.binding, secrets };
            prop_assert!(same(&back, &c));
        }

        #[test]
        fn arbitrary_keyring_entries_never_panic_the_parser(
            bytes in prop::collection::vec(any::<u8>(), 0..512),
        ) {
            let mut b = credential("prop", "x").binding;
            b.secret_store = CredentialBackend::Keyring;
            let _ = decode_blob(&bytes, &b, "a");
        }

        #[test]
        fn a_keyring_entry_never_matches_another_binding_or_account(
            client_id in "[a-z]{1,12}",
            other_account in "[0-9a-f]{32}",
        ) {
            let mut c = keyring_credential("prop", "x");
            let account = "0123456789abcdef0123456789abcdef";
            let blob = encode(&c, account).unwrap().blob.unwrap();
            prop_assert!(decode_blob(&blob, &c.binding, account).is_ok());
            if other_account != account {
                prop_assert_eq!(
                    decode_blob(&blob, &c.binding, &other_account).unwrap_err(),
                    KeyringError::Mismatch
                );
            }
            let original = c.binding.client_id.clone();
            c.binding.client_id = client_id;
            if c.binding.client_id != original {
                prop_assert_eq!(
                    decode_blob(&blob, &c.binding, account).unwrap_err(),
                    KeyringError::Mismatch
                );
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_parser(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn truncating_a_valid_file_never_yields_a_credential(cut in 0usize..400) {
            let bytes = encode(&credential("prop", "x"), "a").unwrap().file;
            let cut = cut.min(bytes.len() - 1);
            prop_assert!(decode(&bytes[..cut]).is_err());
        }
    }
}
