//! The credential store: private files under one lock, written atomically, and the keyring
//! entries of keyring-backed logins.

use std::fs::{self};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use iteron_policy::config::CredentialBackend;
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::format::{Stored, decode, decode_blob, encode};
use super::{
    BINDING_ID_DOMAIN, BINDING_ID_LEN, Binding, CREDENTIALS_DIR, Credential, CredentialError,
    LOCK_FILE, MAX_CREDENTIAL_BYTES, MAX_LEN, Secrets, TEMP_PREFIX, hex, io_err, is_lower_hex,
};
use crate::keyring::{Keyring, KeyringError};
use crate::private_fs::{self, FsError};
use crate::store::Home;

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
        private_fs::replace_file(&self.dir, TEMP_PREFIX, &target, bytes)?;
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
    let Some((mut file, meta)) = private_fs::open_private(path)? else {
        return Ok(None);
    };
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
