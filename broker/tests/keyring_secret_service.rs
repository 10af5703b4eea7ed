//! The keyring backend against a real Secret Service (gnome-keyring on a private D-Bus session
//! bus). `scripts/test` starts that session and runs these with `--ignored`; outside it there
//! is no keyring to talk to.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::PathBuf;

use iteron_broker::credentials::{Binding, Credential, CredentialError, CredentialStore, Secrets};
use iteron_broker::keyring::{Keyring, KeyringError};
use iteron_broker::oauth::flow::{ClientKind, TokenAuth};
use iteron_broker::oauth::{ExposeSecret, SecretString};
use iteron_broker::store::Home;
use iteron_policy::config::CredentialBackend;
use iteron_policy::zone::Zone;

const CANARY: &str = "CANARY-ss-7d2e41";

fn temp_home(tag: &str) -> (PathBuf, Home) {
    let base = std::env::temp_dir().join(format!("iteron-ss-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&base);
    fs::create_dir_all(&base).unwrap();
    let home = Home::at(base.join("home")).unwrap();
    (base, home)
}

fn credential(server: &str, access: &str) -> Credential {
    Credential {
        binding: Binding {
            server: server.into(),
            resource: "https://mcp.example.com/mcp".into(),
            issuer: "https://auth.example.com".into(),
            zone: Zone::Public,
            client_id: "client".into(),
            client_kind: ClientKind::Dynamic,
            token_auth: TokenAuth::None,
            requested_scopes: vec!["read".into()],
            granted_scopes: vec!["read".into()],
            config_digest: "a".repeat(64),
            secret_store: CredentialBackend::Keyring,
        },
        secrets: Secrets {
            access_token: SecretString::from(access.to_owned()),
            refresh_token: Some(SecretString::from(format!("{access}-refresh"))),
            client_secret: None,
            expires_at: Some(1),
            refresh_failed: false,
            // A DPoP key is a secret like the tokens: it lives in the service, never the file.
            dpop_key: Some(SecretString::from(format!("{access}-dpop-key"))),
        },
    }
}

#[test]
#[ignore = "needs a D-Bus session bus with an unlocked Secret Service; scripts/test provides one (dbus-run-session + gnome-keyring)"]
fn secret_service_stores_rotates_and_deletes_without_writing_secrets_to_disk() {
    let (base, home) = temp_home("roundtrip");
    let store = CredentialStore::new(&home);
    let server = format!("ss-{}", std::process::id());
    store.probe_keyring(&server).unwrap();
    store.save(&credential(&server, CANARY)).unwrap();
    let file = fs::read_to_string(store.path_for(&server)).unwrap();
    assert!(!file.contains(CANARY), "{file}");

    // A second store (a second process would do the same) reads it back from the service.
    let again = CredentialStore::new(&home);
    let c = again.load(&server).unwrap().unwrap();
    assert_eq!(c.secrets.access_token.expose_secret(), CANARY);
    assert_eq!(
        c.secrets
            .dpop_key
            .as_ref()
            .map(|k| k.expose_secret().to_owned()),
        Some(format!("{CANARY}-dpop-key"))
    );
    assert_eq!(c.binding.secret_store, CredentialBackend::Keyring);

    let rotated = format!("{CANARY}-rotated");
    assert!(
        store
            .update_secrets(&server, |s| s.refresh_token =
                Some(SecretString::from(rotated.clone())))
            .unwrap()
    );
    let c = again.load(&server).unwrap().unwrap();
    assert_eq!(c.secrets.refresh_token.unwrap().expose_secret(), rotated);

    assert!(store.delete(&server, true).unwrap());
    assert!(!store.path_for(&server).exists());
    // The entry is gone from the service itself.
    let account = store.keyring_account(&server);
    assert_eq!(
        Keyring::system().get(&account).unwrap_err(),
        KeyringError::NoEntry
    );
    fs::remove_dir_all(base).unwrap();
}

#[test]
#[ignore = "needs a D-Bus session bus with an unlocked Secret Service; scripts/test provides one (dbus-run-session + gnome-keyring)"]
fn a_deleted_secret_service_entry_requires_a_re_login() {
    let (base, home) = temp_home("gone");
    let store = CredentialStore::new(&home);
    let server = format!("ss-gone-{}", std::process::id());
    store.save(&credential(&server, CANARY)).unwrap();
    // Someone removed the entry with the keyring's own tools.
    assert!(
        Keyring::system()
            .delete(&store.keyring_account(&server))
            .unwrap()
    );
    let e = store.load(&server).unwrap_err();
    assert!(
        matches!(
            e,
            CredentialError::Keyring {
                reason: KeyringError::NoEntry,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("re-login required"), "{e}");
    assert!(store.delete(&server, true).unwrap());
    fs::remove_dir_all(base).unwrap();
}
