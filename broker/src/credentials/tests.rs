//! The credential store's unit tests: the file store, and properties of the file format
//! (the keyring backend and the crash and race tests are in `tests/`).

use super::format::*;
use super::store::*;
use super::*;
use crate::store::Home;
use iteron_policy::config::{Command, StdioServer, Transport};
use proptest::prelude::*;
use secrecy::ExposeSecret;
use std::fs::{self, OpenOptions};
use std::hash::{BuildHasher, Hasher, RandomState};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;

const CANARY: &str = "CANARY-5ecr3t-9f1c";

#[allow(
    dead_code,
    reason = "the scripted server's helpers this file does not use"
)]
#[path = "../../tests/support/scripted.rs"]
mod scripted;

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

fn keyring_credential(name: &str, token: &str) -> Credential {
    let mut c = credential(name, token);
    c.binding.secret_store = CredentialBackend::Keyring;
    c
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
    iteron_test_support::record!(
        "P1",
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
        format!("{{\"schema\": 1, \"secrets\": {{\"access_token\": \"{CANARY}\" ]").into_bytes(),
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

mod crash_and_race;
#[cfg(feature = "keyring")]
mod keyring_backend;

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

/// A two-worker runtime (the renewals under test race on separate threads).
fn two_workers() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A scripted authorization server on loopback: its metadata, and `token` answering the
/// token endpoint.
async fn scripted_issuer(
    token: impl Fn() -> scripted::Reply + Send + Sync + 'static,
) -> scripted::Server {
    use scripted::{Reply, Seen, Server};
    Server::start(move |base| {
        let base = base.to_owned();
        Arc::new(move |req: &Seen| match (req.method.as_str(), req.path()) {
            ("GET", "/.well-known/oauth-authorization-server") => Reply::json(serde_json::json!({
                "issuer": base,
                "token_endpoint": format!("{base}/token"),
            })),
            ("POST", "/token") => token(),
            _ => Reply::not_found(),
        })
    })
    .await
}

/// `srv`'s login at `issuer` (a public client on loopback), stored already expired, and a
/// token source over it.
fn expired_login(home: &Home, issuer: String) -> crate::servers::StoredToken {
    let mut cred = credential("srv", "first");
    cred.binding.issuer = issuer;
    cred.binding.zone = Zone::Loopback;
    cred.binding.token_auth = TokenAuth::None;
    cred.secrets.client_secret = None;
    cred.secrets.expires_at = Some(1);
    CredentialStore::new(home).save(&cred).unwrap();
    crate::servers::StoredToken::new(
        CredentialStore::new(home),
        "srv",
        crate::servers::LearnedSecrets::default(),
    )
}

/// Two requests of one connection that find the stored token expired at the same moment (a
/// tool call and the standalone stream's reopening, say) renew it once: the second waits, reads
/// the credential again and uses what the first stored, so a refresh token is never presented
/// twice (an authorization server that detects reuse may revoke the whole grant).
#[test]
fn requests_that_find_the_token_expired_together_renew_it_once() {
    use crate::mcp::client::TokenSource;
    let (_base, home) = temp_home();
    two_workers().block_on(async {
        let issued = Arc::new(AtomicUsize::new(0));
        let auth = scripted_issuer(move || {
            let n = issued.fetch_add(1, Ordering::SeqCst) + 1;
            scripted::Reply::json(serde_json::json!({
                "access_token": format!("at-renewed-{n}"),
                "token_type": "Bearer",
                "expires_in": 3600,
                "refresh_token": format!("rt-renewed-{n}"),
            }))
        })
        .await;
        let source = Arc::new(expired_login(&home, auth.base()));
        let (a, b) = (Arc::clone(&source), Arc::clone(&source));
        let (x, y) = tokio::join!(
            tokio::spawn(async move { a.current().await }),
            tokio::spawn(async move { b.current().await }),
        );
        let (x, y) = (x.unwrap().unwrap(), y.unwrap().unwrap());
        assert_eq!(x.token.expose_secret(), "at-renewed-1");
        assert_eq!(y.token.expose_secret(), "at-renewed-1");
        let refreshes = auth.to("/token");
        assert_eq!(refreshes.len(), 1, "{refreshes:?}");
        assert_eq!(refreshes[0].form()["refresh_token"], "rt-first");
        let kept = CredentialStore::new(&home).load("srv").unwrap().unwrap();
        assert_eq!(
            kept.secrets.refresh_token.unwrap().expose_secret(),
            "rt-renewed-1"
        );
    });
}

/// A refresh token the authorization server refuses is forgotten only if it is still the one
/// stored: one another process stored meanwhile (it refreshed first) is kept.
#[test]
fn a_refused_refresh_token_is_forgotten_only_if_it_is_still_the_stored_one() {
    use crate::mcp::client::TokenSource;
    let (_base, home) = temp_home();
    let other_process = CredentialStore::new(&home);
    two_workers().block_on(async {
        let auth = scripted_issuer(move || {
            // Another process refreshed first: it stored its rotation, and the token presented
            // here is refused as already used.
            other_process
                .update_secrets("srv", |s| {
                    s.access_token = SecretString::from("at-theirs");
                    s.refresh_token = Some(SecretString::from("rt-theirs"));
                    s.expires_at = Some(4_000_000_000);
                })
                .unwrap();
            scripted::Reply::status(400, serde_json::json!({"error": "invalid_grant"}))
        })
        .await;
        let source = expired_login(&home, auth.base());
        assert!(source.current().await.is_err());
        let kept = CredentialStore::new(&home).load("srv").unwrap().unwrap();
        assert_eq!(
            kept.secrets.refresh_token.unwrap().expose_secret(),
            "rt-theirs"
        );
        assert!(!kept.secrets.refresh_failed);
        // The next use finds the other process's token fresh and uses it.
        let next = source.current().await.unwrap();
        assert_eq!(next.token.expose_secret(), "at-theirs");
    });
}
