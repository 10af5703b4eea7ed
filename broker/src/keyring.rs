//! The operating-system keyring as a home for the secret part of an OAuth login.
//!
//! Chosen per server (`oauth.credential_store = "keyring"`), recorded in the credential file,
//! and never switched silently: when the keyring cannot be used the operation fails with a
//! fixed, secret-free reason, and nothing falls back to a file. On Linux the keyring is the
//! Secret Service (GNOME Keyring, KWallet) reached over the D-Bus session bus.
//!
//! Every call runs on its own thread under [`KEYRING_TIMEOUT`]: a keyring waiting for an
//! unlock prompt must not hang the broker. A timed-out write may still land later; the caller
//! treats it as failed, and the digest check on read (see `credentials`) refuses a secret that
//! does not belong to the stored binding.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use keyring_core::{CredentialStore as KeyringStore, Entry, Error as KError};
use zeroize::{Zeroize, Zeroizing};

/// The keyring service name of every Iteron entry; the account is the binding id.
pub const KEYRING_SERVICE: &str = "iteron-mcp-credentials";
/// How long one keyring call may take.
pub const KEYRING_TIMEOUT: Duration = Duration::from_secs(15);

/// Why the keyring could not be used. Fixed texts only: platform messages are never shown
/// (some error values even carry the raw secret bytes, which are zeroized here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyringError {
    /// There is no entry for this binding.
    NoEntry,
    /// No keyring service is reachable.
    Unavailable,
    /// The keyring is locked or refused access.
    Denied,
    /// The call did not finish within [`KEYRING_TIMEOUT`].
    TimedOut,
    /// Anything else the keyring refused.
    Refused,
    /// The entry is not an Iteron credential.
    Unreadable,
    /// The entry belongs to another login than the stored binding.
    Mismatch,
}

impl KeyringError {
    /// One line for the operator.
    pub fn reason(self) -> &'static str {
        match self {
            KeyringError::NoEntry => "the keyring holds no secret for this login",
            KeyringError::Unavailable => {
                "no keyring is reachable (on Linux: a D-Bus session bus with a Secret Service such as gnome-keyring)"
            }
            KeyringError::Denied => "the keyring is locked or refused access",
            KeyringError::TimedOut => {
                "the keyring did not answer within 15 s (is it waiting for an unlock prompt?)"
            }
            KeyringError::Refused => "the keyring refused the request",
            KeyringError::Unreadable => "the keyring entry is not an Iteron credential",
            KeyringError::Mismatch => "the keyring entry belongs to another login",
        }
    }
}

const _: () = assert!(KEYRING_TIMEOUT.as_secs() == 15);

fn classify(e: KError) -> KeyringError {
    match e {
        KError::NoEntry => KeyringError::NoEntry,
        KError::NoDefaultStore | KError::PlatformFailure(_) => KeyringError::Unavailable,
        KError::NoStorageAccess(_) => KeyringError::Denied,
        KError::BadEncoding(mut bytes) | KError::BadDataFormat(mut bytes, _) => {
            bytes.zeroize();
            KeyringError::Refused
        }
        _ => KeyringError::Refused,
    }
}

/// Where keyring entries live: the system keyring, or a given store (tests use
/// `keyring_core::mock`).
#[derive(Clone)]
pub enum Keyring {
    /// The platform keyring, opened for each operation.
    System,
    /// A specific store.
    Store(Arc<KeyringStore>),
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Keyring::System => "Keyring::System",
            Keyring::Store(_) => "Keyring::Store",
        })
    }
}

impl Keyring {
    fn entry(&self, account: &str) -> Result<Entry, KError> {
        let store: Arc<KeyringStore> = match self {
            Keyring::Store(s) => s.clone(),
            Keyring::System => zbus_secret_service_keyring_store::Store::new()?,
        };
        Entry::new_in_store(&store, KEYRING_SERVICE, account)
    }

    /// Run `op` on the entry for `account` on a helper thread, waiting at most
    /// [`KEYRING_TIMEOUT`].
    fn call<T: Send + 'static>(
        &self,
        account: &str,
        op: impl FnOnce(&Entry) -> Result<T, KError> + Send + 'static,
    ) -> Result<T, KeyringError> {
        let (tx, rx) = mpsc::sync_channel(1);
        let this = self.clone();
        let account = account.to_owned();
        let spawned = std::thread::Builder::new()
            .name("iteron-keyring".into())
            .spawn(move || {
                let result = this.entry(&account).and_then(|e| op(&e)).map_err(classify);
                // The receiver may have given up; then the result is dropped here.
                let _ = tx.send(result);
            });
        if spawned.is_err() {
            return Err(KeyringError::Refused);
        }
        match rx.recv_timeout(KEYRING_TIMEOUT) {
            Ok(result) => result,
            Err(_) => Err(KeyringError::TimedOut),
        }
    }

    /// Store `secret` as the entry for `account`, replacing any earlier one.
    pub fn set(&self, account: &str, secret: Zeroizing<Vec<u8>>) -> Result<(), KeyringError> {
        self.call(account, move |e| e.set_secret(&secret))
    }

    /// The entry for `account`.
    pub fn get(&self, account: &str) -> Result<Zeroizing<Vec<u8>>, KeyringError> {
        self.call(account, |e| e.get_secret().map(Zeroizing::new))
    }

    /// Delete the entry for `account`; `Ok(false)` when there was none.
    pub fn delete(&self, account: &str) -> Result<bool, KeyringError> {
        match self.call(account, |e| e.delete_credential()) {
            Ok(()) => Ok(true),
            Err(KeyringError::NoEntry) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_delete_round_trip_in_a_mock_store() {
        let k = Keyring::Store(keyring_core::mock::Store::new().unwrap());
        assert_eq!(k.get("a").unwrap_err(), KeyringError::NoEntry);
        k.set("a", Zeroizing::new(b"one".to_vec())).unwrap();
        k.set("b", Zeroizing::new(b"two".to_vec())).unwrap();
        assert_eq!(k.get("a").unwrap().as_slice(), b"one");
        k.set("a", Zeroizing::new(b"three".to_vec())).unwrap();
        assert_eq!(k.get("a").unwrap().as_slice(), b"three");
        assert!(k.delete("a").unwrap());
        assert!(!k.delete("a").unwrap());
        assert_eq!(k.get("b").unwrap().as_slice(), b"two");
    }

    #[test]
    fn errors_are_classified_and_never_carry_platform_text() {
        let cases = [
            (KError::NoEntry, KeyringError::NoEntry),
            (KError::NoDefaultStore, KeyringError::Unavailable),
            (
                KError::PlatformFailure("dbus: CANARY-5ecr3t".into()),
                KeyringError::Unavailable,
            ),
            (
                KError::NoStorageAccess("locked CANARY-5ecr3t".into()),
                KeyringError::Denied,
            ),
            (
                KError::BadEncoding(b"CANARY-5ecr3t".to_vec()),
                KeyringError::Refused,
            ),
            (
                KError::Invalid("CANARY-5ecr3t".into(), "x".into()),
                KeyringError::Refused,
            ),
        ];
        for (e, want) in cases {
            let got = classify(e);
            assert_eq!(got, want);
            assert!(!got.reason().contains("CANARY"));
            assert!(!got.reason().contains('\n'));
        }
    }

    #[test]
    fn an_injected_failure_is_reported_not_papered_over() {
        let store = keyring_core::mock::Store::new().unwrap();
        let k = Keyring::Store(store.clone());
        k.set("a", Zeroizing::new(b"one".to_vec())).unwrap();
        let entry =
            Entry::new_in_store(&(store as Arc<KeyringStore>), KEYRING_SERVICE, "a").unwrap();
        let mock: &keyring_core::mock::Cred = entry.as_any().downcast_ref().unwrap();
        mock.set_error(KError::NoStorageAccess("locked".into()));
        assert_eq!(k.get("a").unwrap_err(), KeyringError::Denied);
        assert_eq!(k.get("a").unwrap().as_slice(), b"one");
    }
}
