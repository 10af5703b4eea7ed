//! `kill -9` during refresh writes, and concurrent logins racing a logout.
use super::*;

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
    let test_name =
        format!("{module}::kill_9_during_500_refresh_writes_always_leaves_a_parsable_private_file");
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
    iteron_test_support::record!("P6", serde_json::json!({}),);
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
    iteron_test_support::record!("P6", serde_json::json!({}),);
}
