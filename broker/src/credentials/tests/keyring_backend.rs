//! The keyring backend: secrets only in the keyring, each entry tied to its exact binding and
//! home, and an unusable keyring failing closed.
use super::*;
use crate::keyring::{KEYRING_SERVICE, Keyring};
use zeroize::Zeroizing;

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
    let before = CredentialStore::with_keyring(&Home::at(fresh.clone()).unwrap(), keyring.clone())
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
