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
//!   [`Zeroizing`](zeroize::Zeroizing) buffers allocated once at full size (so no reallocation leaves a copy
//!   behind; only a string with JSON escapes passes through `serde_json`'s own scratch buffer,
//!   which is outside our control); `Debug` shows `[not shown]`, and no error carries file
//!   content (not even `serde_json`'s message, which can quote a value);
//! - a stored binding whose server name or configuration digest no longer matches the
//!   configuration is reported by [`check_binding`], so the caller asks for a re-login instead
//!   of silently reusing the credential.
#![forbid(unsafe_code)]

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use iteron_policy::config::{CredentialBackend, ServerConfig};
use iteron_policy::names::ServerName;
use iteron_policy::zone::Zone;
use secrecy::SecretString;
use sha2::{Digest, Sha256};

use crate::keyring::KeyringError;
use crate::oauth::flow::{ClientKind, TokenAuth};
use crate::private_fs::{self, FsError};

mod format;
mod store;
#[cfg(test)]
mod tests;

pub use store::CredentialStore;

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

impl CredentialError {
    /// The keyring could not be reached (unavailable, denied, timed out, refused, busy or not
    /// in this build): this says nothing about the stored login itself.
    pub fn keyring_unreachable(&self) -> bool {
        matches!(
            self,
            CredentialError::Keyring {
                reason: KeyringError::Unavailable
                    | KeyringError::Denied
                    | KeyringError::TimedOut
                    | KeyringError::Refused
                    | KeyringError::Busy
                    | KeyringError::NotBuiltIn,
                ..
            }
        )
    }
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
