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
//!
//! The backend is the `keyring` cargo feature (on by default). A build without it keeps this
//! module's types, but every call fails with [`KeyringError::NotBuiltIn`], and the
//! configuration store refuses a configuration naming the keyring when it is read or written
//! (see `store`): a keyring login is never silently downgraded to a file.
#![forbid(unsafe_code)]

#[cfg(feature = "keyring")]
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
#[cfg(feature = "keyring")]
use std::sync::mpsc;
#[cfg(feature = "keyring")]
use std::sync::{Arc, LazyLock};
use std::time::Duration;

#[cfg(feature = "keyring")]
use keyring_core::{CredentialStore as KeyringStore, Entry, Error as KError};
#[cfg(feature = "keyring")]
use zeroize::Zeroize;
use zeroize::Zeroizing;

/// Whether this build has the keyring backend (the `keyring` cargo feature).
pub const BUILT_IN: bool = cfg!(feature = "keyring");

/// The keyring service name of every Iteron entry; the account is the binding id.
pub const KEYRING_SERVICE: &str = "iteron-mcp-credentials";
/// How long one keyring call may take.
pub const KEYRING_TIMEOUT: Duration = Duration::from_secs(15);
/// Keyring calls whose caller gave up after [`KEYRING_TIMEOUT`] but which are still running (a
/// call stuck behind an unlock prompt keeps its thread); with this many, new calls are refused.
pub const MAX_KEYRING_CALLS: usize = 4;
/// Largest keyring entry read or written, in bytes.
pub const MAX_KEYRING_ENTRY: usize = 64 * 1024;

/// Abandoned calls against the system keyring, process-wide.
#[cfg(feature = "keyring")]
static SYSTEM_STUCK: LazyLock<Arc<AtomicUsize>> = LazyLock::new(|| Arc::new(AtomicUsize::new(0)));

#[cfg(feature = "keyring")]
const RUNNING: u8 = 0;
#[cfg(feature = "keyring")]
const DONE: u8 = 1;
#[cfg(feature = "keyring")]
const ABANDONED: u8 = 2;

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
    /// [`MAX_KEYRING_CALLS`] abandoned calls are still running (stuck behind a prompt?).
    Busy,
    /// This build has no keyring backend (built without the `keyring` cargo feature).
    NotBuiltIn,
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
            KeyringError::Busy => {
                "4 earlier keyring calls are still stuck waiting for the keyring (an unlock prompt?); try again later"
            }
            KeyringError::NotBuiltIn => {
                "this iteron was built without the keyring backend (cargo feature \"keyring\")"
            }
        }
    }
}

const _: () = assert!(KEYRING_TIMEOUT.as_secs() == 15 && MAX_KEYRING_CALLS == 4);

#[cfg(feature = "keyring")]
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

#[cfg(feature = "keyring")]
#[derive(Clone)]
enum Source {
    System,
    Store(Arc<KeyringStore>),
}

/// Where keyring entries live: the system keyring, or a given store (tests use
/// `keyring_core::mock`), with the bound on its running calls.
#[cfg(feature = "keyring")]
#[derive(Clone)]
pub struct Keyring {
    source: Source,
    stuck: Arc<AtomicUsize>,
}

#[cfg(feature = "keyring")]
impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.source {
            Source::System => "Keyring::System",
            Source::Store(_) => "Keyring::Store",
        })
    }
}

#[cfg(feature = "keyring")]
impl Keyring {
    /// The platform keyring (Secret Service on Linux), opened for each operation.
    pub fn system() -> Keyring {
        Keyring {
            source: Source::System,
            stuck: SYSTEM_STUCK.clone(),
        }
    }

    /// A specific store, with its own bound on running calls.
    pub fn store(store: Arc<KeyringStore>) -> Keyring {
        Keyring {
            source: Source::Store(store),
            stuck: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn entry(&self, account: &str) -> Result<Entry, KError> {
        let store: Arc<KeyringStore> = match &self.source {
            Source::Store(s) => s.clone(),
            Source::System => zbus_secret_service_keyring_store::Store::new()?,
        };
        Entry::new_in_store(&store, KEYRING_SERVICE, account)
    }

    /// Run `op` on the entry for `account` on a helper thread, waiting at most `timeout`.
    /// `hold` (a lock guard) is dropped on that thread only when `op` has really finished, so
    /// a call the caller gave up on still keeps other writers out until it lands or fails.
    fn call<T: Send + 'static, H: Send + 'static>(
        &self,
        account: &str,
        timeout: Duration,
        hold: H,
        op: impl FnOnce(&Entry) -> Result<T, KError> + Send + 'static,
    ) -> Result<T, KeyringError> {
        if self.stuck.load(Ordering::Acquire) >= MAX_KEYRING_CALLS {
            return Err(KeyringError::Busy);
        }
        let state = Arc::new(AtomicU8::new(RUNNING));
        let (tx, rx) = mpsc::sync_channel(1);
        let this = self.clone();
        let account = account.to_owned();
        let worker_state = state.clone();
        let spawned = std::thread::Builder::new()
            .name("iteron-keyring".into())
            .spawn(move || {
                let result = this.entry(&account).and_then(|e| op(&e)).map_err(classify);
                drop(hold);
                if worker_state.swap(DONE, Ordering::AcqRel) == ABANDONED {
                    this.stuck.fetch_sub(1, Ordering::AcqRel);
                }
                // The receiver may have given up; then the result is dropped here.
                let _ = tx.send(result);
            });
        if spawned.is_err() {
            return Err(KeyringError::Refused);
        }
        match rx.recv_timeout(timeout) {
            Ok(result) => result,
            Err(_) => {
                // Count the call as stuck before marking it, so the worker's decrement can
                // never come first; if it finished in between, take the count back.
                self.stuck.fetch_add(1, Ordering::AcqRel);
                if state
                    .compare_exchange(RUNNING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    self.stuck.fetch_sub(1, Ordering::AcqRel);
                    if let Ok(result) = rx.recv() {
                        return result;
                    }
                }
                Err(KeyringError::TimedOut)
            }
        }
    }

    /// Store `secret` as the entry for `account`, replacing any earlier one; `hold` is released
    /// when the write has finished (see [`Keyring::call`]).
    pub(crate) fn set_holding<H: Send + 'static>(
        &self,
        account: &str,
        secret: Zeroizing<Vec<u8>>,
        hold: H,
    ) -> Result<(), KeyringError> {
        if secret.len() > MAX_KEYRING_ENTRY {
            return Err(KeyringError::Refused);
        }
        self.call(account, KEYRING_TIMEOUT, hold, move |e| {
            e.set_secret(&secret)
        })
    }

    /// Store `secret` as the entry for `account`, replacing any earlier one.
    pub fn set(&self, account: &str, secret: Zeroizing<Vec<u8>>) -> Result<(), KeyringError> {
        self.set_holding(account, secret, ())
    }

    /// The entry for `account`; an entry over [`MAX_KEYRING_ENTRY`] is refused (the copy read
    /// is zeroized; the entry itself stays in the keyring).
    pub fn get(&self, account: &str) -> Result<Zeroizing<Vec<u8>>, KeyringError> {
        let blob = self.call(account, KEYRING_TIMEOUT, (), |e| {
            e.get_secret().map(Zeroizing::new)
        })?;
        if blob.len() > MAX_KEYRING_ENTRY {
            return Err(KeyringError::Unreadable);
        }
        Ok(blob)
    }

    /// Delete the entry for `account`; `Ok(false)` when there was none. `hold` is released
    /// when the delete has finished.
    pub(crate) fn delete_holding<H: Send + 'static>(
        &self,
        account: &str,
        hold: H,
    ) -> Result<bool, KeyringError> {
        match self.call(account, KEYRING_TIMEOUT, hold, |e| e.delete_credential()) {
            Ok(()) => Ok(true),
            Err(KeyringError::NoEntry) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Delete the entry for `account`; `Ok(false)` when there was none.
    pub fn delete(&self, account: &str) -> Result<bool, KeyringError> {
        self.delete_holding(account, ())
    }

    /// Check that the keyring can store an entry: write and delete a throwaway one beside
    /// `account`. A keyring that only reads (no default collection, read-only) fails here.
    pub fn probe_write(&self, account: &str) -> Result<(), KeyringError> {
        let probe = format!("{account}.probe");
        self.set(&probe, Zeroizing::new(b"iteron keyring probe".to_vec()))?;
        self.delete(&probe).map(|_| ())
    }
}

/// A build without the keyring backend: the same surface, and every call fails with
/// [`KeyringError::NotBuiltIn`] before touching anything.
#[cfg(not(feature = "keyring"))]
#[derive(Debug, Clone)]
pub struct Keyring {
    _none: (),
}

#[cfg(not(feature = "keyring"))]
impl Keyring {
    /// The platform keyring, which this build does not have.
    pub fn system() -> Keyring {
        Keyring { _none: () }
    }

    /// Refused: this build has no keyring ([`KeyringError::NotBuiltIn`]); `hold` is released
    /// at once.
    pub(crate) fn set_holding<H: Send + 'static>(
        &self,
        _account: &str,
        _secret: Zeroizing<Vec<u8>>,
        hold: H,
    ) -> Result<(), KeyringError> {
        drop(hold);
        Err(KeyringError::NotBuiltIn)
    }

    /// Refused: this build has no keyring ([`KeyringError::NotBuiltIn`]).
    pub fn set(&self, account: &str, secret: Zeroizing<Vec<u8>>) -> Result<(), KeyringError> {
        self.set_holding(account, secret, ())
    }

    /// Refused: this build has no keyring ([`KeyringError::NotBuiltIn`]).
    pub fn get(&self, _account: &str) -> Result<Zeroizing<Vec<u8>>, KeyringError> {
        Err(KeyringError::NotBuiltIn)
    }

    /// Refused: this build has no keyring ([`KeyringError::NotBuiltIn`]); `hold` is released
    /// at once.
    pub(crate) fn delete_holding<H: Send + 'static>(
        &self,
        _account: &str,
        hold: H,
    ) -> Result<bool, KeyringError> {
        drop(hold);
        Err(KeyringError::NotBuiltIn)
    }

    /// Refused: this build has no keyring ([`KeyringError::NotBuiltIn`]).
    pub fn delete(&self, account: &str) -> Result<bool, KeyringError> {
        self.delete_holding(account, ())
    }

    /// Refused: this build has no keyring ([`KeyringError::NotBuiltIn`]).
    pub fn probe_write(&self, account: &str) -> Result<(), KeyringError> {
        self.set(account, Zeroizing::new(Vec::new()))
    }
}

#[cfg(all(test, not(feature = "keyring")))]
mod tests_without_keyring {
    use super::*;

    #[test]
    fn without_the_keyring_feature_every_call_is_refused_as_not_built_in() {
        const { assert!(!BUILT_IN) };
        let k = Keyring::system();
        let secret = || Zeroizing::new(b"CANARY-kr".to_vec());
        assert_eq!(k.set("a", secret()), Err(KeyringError::NotBuiltIn));
        assert_eq!(k.get("a").unwrap_err(), KeyringError::NotBuiltIn);
        assert_eq!(k.delete("a"), Err(KeyringError::NotBuiltIn));
        assert_eq!(k.probe_write("a"), Err(KeyringError::NotBuiltIn));
        let reason = KeyringError::NotBuiltIn.reason();
        assert!(reason.contains("built without") && !reason.contains('\n'));
    }
}

#[cfg(all(test, feature = "keyring"))]
mod tests {
    use super::*;

    #[test]
    fn set_get_delete_round_trip_in_a_mock_store() {
        let k = Keyring::store(keyring_core::mock::Store::new().unwrap());
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
    fn errors_are_classified_into_fixed_single_line_reasons() {
        let cases = [
            (KError::NoEntry, KeyringError::NoEntry),
            (KError::NoDefaultStore, KeyringError::Unavailable),
            (
                KError::PlatformFailure("dbus".into()),
                KeyringError::Unavailable,
            ),
            (
                KError::NoStorageAccess("locked".into()),
                KeyringError::Denied,
            ),
            (KError::BadEncoding(b"raw".to_vec()), KeyringError::Refused),
            (
                KError::BadDataFormat(b"raw".to_vec(), "x".into()),
                KeyringError::Refused,
            ),
            (
                KError::Invalid("x".into(), "y".into()),
                KeyringError::Refused,
            ),
        ];
        for (e, want) in cases {
            let got = classify(e);
            assert_eq!(got, want);
            assert!(!got.reason().contains('\n'));
        }
    }

    #[test]
    fn a_call_past_its_deadline_times_out_and_holds_its_guard_until_it_ends() {
        let k = Keyring::store(keyring_core::mock::Store::new().unwrap());
        let guard = Arc::new(());
        let held = guard.clone();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let got = k.call("slow", Duration::from_millis(50), held, move |_| {
            let _ = release_rx.recv();
            Ok(())
        });
        assert_eq!(got.unwrap_err(), KeyringError::TimedOut);
        // The caller gave up, but the stuck call still holds the guard.
        assert_eq!(Arc::strong_count(&guard), 2);
        release_tx.send(()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&guard) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(Arc::strong_count(&guard), 1);
    }

    #[test]
    fn stuck_calls_are_bounded() {
        let k = Keyring::store(keyring_core::mock::Store::new().unwrap());
        let mut releases = Vec::new();
        let mut busy = false;
        for _ in 0..=MAX_KEYRING_CALLS {
            let (tx, rx) = mpsc::channel::<()>();
            releases.push(tx);
            match k.call("stuck", Duration::from_millis(20), (), move |_| {
                let _ = rx.recv();
                Ok(())
            }) {
                Err(KeyringError::TimedOut) => {}
                Err(KeyringError::Busy) => {
                    busy = true;
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(busy, "more than {MAX_KEYRING_CALLS} calls ran at once");
        drop(releases);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while k.get("none") == Err(KeyringError::Busy) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(k.get("none").unwrap_err(), KeyringError::NoEntry);
    }

    #[test]
    fn many_concurrent_quick_calls_are_never_refused() {
        let k = Keyring::store(keyring_core::mock::Store::new().unwrap());
        k.set("a", Zeroizing::new(b"v".to_vec())).unwrap();
        let threads: Vec<_> = (0..4 * MAX_KEYRING_CALLS)
            .map(|_| {
                let k = k.clone();
                std::thread::spawn(move || k.get("a").map(|v| v.to_vec()))
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap().unwrap(), b"v");
        }
    }

    #[test]
    fn entries_over_the_bound_are_refused_both_ways() {
        let store: Arc<KeyringStore> = keyring_core::mock::Store::new().unwrap();
        let k = Keyring::store(store.clone());
        k.set("a", Zeroizing::new(vec![b'x'; MAX_KEYRING_ENTRY]))
            .unwrap();
        assert_eq!(k.get("a").unwrap().len(), MAX_KEYRING_ENTRY);
        assert_eq!(
            k.set("a", Zeroizing::new(vec![b'x'; MAX_KEYRING_ENTRY + 1]))
                .unwrap_err(),
            KeyringError::Refused
        );
        // Something else wrote a larger entry under our name: refused on read.
        Entry::new_in_store(&store, KEYRING_SERVICE, "a")
            .unwrap()
            .set_secret(&vec![b'y'; MAX_KEYRING_ENTRY + 1])
            .unwrap();
        assert_eq!(k.get("a").unwrap_err(), KeyringError::Unreadable);
    }

    #[test]
    fn the_write_probe_leaves_nothing_behind() {
        let k = Keyring::store(keyring_core::mock::Store::new().unwrap());
        k.probe_write("acct").unwrap();
        assert_eq!(k.get("acct.probe").unwrap_err(), KeyringError::NoEntry);
        assert_eq!(k.get("acct").unwrap_err(), KeyringError::NoEntry);
    }

    #[test]
    fn an_injected_failure_is_reported_not_papered_over() {
        let store = keyring_core::mock::Store::new().unwrap();
        let k = Keyring::store(store.clone());
        k.set("a", Zeroizing::new(b"one".to_vec())).unwrap();
        let entry =
            Entry::new_in_store(&(store as Arc<KeyringStore>), KEYRING_SERVICE, "a").unwrap();
        let mock: &keyring_core::mock::Cred = entry.as_any().downcast_ref().unwrap();
        mock.set_error(KError::NoStorageAccess("locked".into()));
        assert_eq!(k.get("a").unwrap_err(), KeyringError::Denied);
        assert_eq!(k.get("a").unwrap().as_slice(), b"one");
    }
}
