//! The audit log's unit tests.

use super::files::{civil, day_files, parse_head};
use super::*;
use serde_json::json;
use std::os::unix::fs::PermissionsExt;

fn home() -> PathBuf {
    let base = std::env::temp_dir().join(format!(
        "iteron-audit-{}-{}",
        std::process::id(),
        private_fs::temp_name("t")
    ));
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().mode(0o700).create(&base).unwrap();
    base
}

/// A log that sends nothing to journald.
fn open(h: &Path) -> Result<AuditLog, AuditError> {
    AuditLog::open_with(h, &Options { journal: None })
}

fn event(i: u64) -> Event {
    Event {
        session: Some(format!("s{i}")),
        peer_uid: Some(1000),
        peer_pid: Some(42),
        server: Some("srv".into()),
        tool: Some("echo".into()),
        args_sha256: Some(sha256_hex(&canonical_json(&json!({"i": i})))),
        duration_ms: i,
        ..Event::new(Kind::CallTool, Decision::Approved, Outcome::Ok)
    }
}

/// A cheap request of an agent: counted, not written, beyond the rate.
fn cheap(uid: u32) -> Event {
    Event {
        session: Some("s1".into()),
        peer_uid: Some(uid),
        peer_pid: Some(42),
        ..Event::new(Kind::ListTools, Decision::Allowed, Outcome::Ok)
    }
}

fn write_log(n: u64) -> (PathBuf, PathBuf) {
    let h = home();
    let log = open(&h).unwrap();
    for i in 0..n {
        log.append(&event(i)).unwrap();
    }
    let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
    (h, file)
}

fn lines(path: &Path) -> Vec<String> {
    fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn put(path: &Path, lines: &[String]) {
    let mut s = lines.join("\n");
    if !lines.is_empty() {
        s.push('\n');
    }
    fs::write(path, s).unwrap();
}

/// A record as someone else would forge it: `base` with another sequence number, chained
/// to `prev`.
fn forged(base: &str, seq: u64, prev: &str) -> String {
    let mut v: Value = serde_json::from_str(base).unwrap();
    v["seq"] = json!(seq);
    v["prev"] = json!(prev);
    v["outcome"] = json!("forged");
    serde_json::to_string(&v).unwrap()
}

fn hash(line: &str) -> String {
    sha256_hex(line.as_bytes())
}

fn broken(r: Result<AuditLog, AuditError>) -> String {
    match r {
        Err(AuditError::Broken(why)) => why,
        Err(e) => panic!("not Broken: {e}"),
        Ok(_) => panic!("the log was opened"),
    }
}

/// Mount a tmpfs of `size` at a fresh directory (root only); `None` with the reason when
/// that is impossible here.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(size: &str) -> Result<Tmpfs, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("not root, cannot mount a tmpfs".into());
        }
        let dir = home();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700")])
            .arg("tmpfs")
            .arg(&dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            let _ = fs::remove_dir(&dir);
            return Err(format!(
                "mount -t tmpfs failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = fs::remove_dir(&self.0);
    }
}

#[test]
fn records_carry_exactly_the_documented_keys_in_order() {
    let (_home, file) = write_log(2);
    let line = lines(&file)[1].clone();
    let v: Value = serde_json::from_str(&line).unwrap();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(keys, KEYS);
    assert_eq!(v["seq"], 1);
}

#[test]
fn dates_are_civil_utc() {
    assert_eq!(civil(0), (1970, 1, 1));
    assert_eq!(civil(19_723), (2024, 1, 1));
    assert_eq!(civil(19_782), (2024, 2, 29));
    assert_eq!(civil(20_787), (2026, 11, 30));
    let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_796_004_245_123);
    assert_eq!(utc(t).0, "2026-11-30T02:04:05.123Z");
}

#[test]
fn canonical_json_sorts_keys_at_every_depth() {
    let a = json!({"b": 1, "a": {"y": [1, {"d": 1, "c": 2}], "x": null}});
    assert_eq!(
        String::from_utf8(canonical_json(&a)).unwrap(),
        r#"{"a":{"x":null,"y":[1,{"c":2,"d":1}]},"b":1}"#
    );
}

#[test]
fn a_written_log_verifies_and_continues_across_reopen() {
    let (h, file) = write_log(5);
    let v = verify(&h, &[]).unwrap();
    assert_eq!((v.records, v.files, v.being_written), (5, 1, 0));
    assert_eq!(v.newest.as_ref().unwrap().seq, 4);
    assert_eq!(v.newest.unwrap().sha256, hash(&lines(&file)[4]));
    let log = open(&h).unwrap();
    log.append(&event(9)).unwrap();
    assert_eq!(verify(&h, &[]).unwrap().records, 6);
    assert!(lines(&file)[5].contains("\"seq\":5"));
    // No argument values, only their digest.
    assert!(!fs::read_to_string(&file).unwrap().contains("\"i\""));
    for f in [&file, &h.join("audit/head"), &h.join(ANCHOR)] {
        assert_eq!(fs::metadata(f).unwrap().permissions().mode() & 0o777, 0o600);
    }
}

#[test]
fn a_second_broker_cannot_open_the_same_log() {
    let h = home();
    let _first = open(&h).unwrap();
    assert!(matches!(open(&h), Err(AuditError::Busy(_))));
}

#[test]
fn every_kind_of_tampering_is_detected() {
    type Tamper = fn(&Path, &Path);
    let cases: Vec<(&str, Tamper)> = vec![
        ("edit a field", |_, f| {
            let mut l = lines(f);
            l[2] = l[2].replace("\"approved\"", "\"denied\"");
            put(f, &l);
        }),
        ("edit the last record", |_, f| {
            let mut l = lines(f);
            l[4] = l[4].replace("\"ok\"", "\"failed\"");
            put(f, &l);
        }),
        ("swap two records", |_, f| {
            let mut l = lines(f);
            l.swap(1, 2);
            put(f, &l);
        }),
        ("remove a middle record", |_, f| {
            let mut l = lines(f);
            l.remove(2);
            put(f, &l);
        }),
        ("remove the first record", |_, f| {
            let mut l = lines(f);
            l.remove(0);
            put(f, &l);
        }),
        ("remove the last two records", |_, f| {
            let mut l = lines(f);
            l.truncate(3);
            put(f, &l);
        }),
        ("remove the whole file", |_, f| fs::remove_file(f).unwrap()),
        ("remove the head", |h, _| {
            fs::remove_file(h.join("audit").join(HEAD)).unwrap()
        }),
        ("duplicate a record", |_, f| {
            let mut l = lines(f);
            let d = l[1].clone();
            l.insert(2, d);
            put(f, &l);
        }),
        ("add a field", |_, f| {
            let mut l = lines(f);
            l[1] = l[1].replacen('{', "{\"x\":1,", 1);
            put(f, &l);
        }),
        ("cut the last line", |_, f| {
            let s = fs::read_to_string(f).unwrap();
            fs::write(f, &s[..s.len() - 5]).unwrap();
        }),
        ("move a record to another day", |h, f| {
            let mut l = lines(f);
            let last = l.pop().unwrap();
            put(f, &l);
            fs::write(h.join("audit").join("2999-01-01.jsonl"), last + "\n").unwrap();
        }),
        ("whitespace inside a record", |_, f| {
            let mut l = lines(f);
            l[1] = l[1].replacen(',', ", ", 1);
            put(f, &l);
        }),
    ];
    for (name, tamper) in cases {
        let (h, file) = write_log(5);
        verify(&h, &[]).unwrap();
        tamper(&h, &file);
        assert!(verify(&h, &[]).is_err(), "not detected: {name}");
        // The broker refuses to append to a log whose end no longer matches (where the end
        // was touched).
        if name.contains("last") || name.contains("whole") || name.contains("head") {
            assert!(open(&h).is_err(), "opened after: {name}");
        }
    }
}

#[test]
fn a_tampered_tail_is_never_laundered_by_a_broker_start() {
    type Tamper = fn(&Path, &Path);
    let cases: Vec<(&str, Tamper)> = vec![
        // The red team's case: edit the newest record, append one chained to the edit.
        (
            "edit the newest record and chain a record to the edit",
            |_, f| {
                let mut l = lines(f);
                l[4] = l[4].replace("\"ok\"", "\"failed\"");
                let next = forged(&l[4], 5, &hash(&l[4]));
                l.push(next);
                put(f, &l);
            },
        ),
        (
            "edit the newest record and chain a record to the head",
            |_, f| {
                let mut l = lines(f);
                let head = hash(&l[4]);
                l[4] = l[4].replace("\"ok\"", "\"failed\"");
                let next = forged(&l[4], 5, &head);
                l.push(next);
                put(f, &l);
            },
        ),
        ("edit the record before the newest", |_, f| {
            let mut l = lines(f);
            l[3] = l[3].replace("\"ok\"", "\"failed\"");
            put(f, &l);
        }),
        ("append a record chained to nothing", |_, f| {
            let mut l = lines(f);
            let next = forged(&l[4], 5, GENESIS);
            l.push(next);
            put(f, &l);
        }),
        ("append a record with the wrong sequence number", |_, f| {
            let mut l = lines(f);
            let next = forged(&l[4], 7, &hash(&l[4]));
            l.push(next);
            put(f, &l);
        }),
    ];
    for (name, tamper) in &cases {
        let (h, file) = write_log(5);
        tamper(&h, &file);
        let before = fs::read(&file).unwrap();
        let why = broken(open(&h));
        assert!(!why.contains('\n'), "{why}");
        // Nothing was appended, so nothing was laundered: the tampering stays evident.
        assert_eq!(fs::read(&file).unwrap(), before, "{name}");
        assert!(verify(&h, &[]).is_err(), "verify passed after: {name}");
    }
    iteron_test_support::record!("P11", json!({"cases": cases.len()}),);
}

#[test]
fn a_record_appended_without_its_head_is_reported_and_its_adoption_recorded() {
    let (h, file) = write_log(3);
    let head = h.join("audit").join(HEAD);
    assert_eq!(parse_head(&fs::read(&head).unwrap()).unwrap().0, 2);
    // A record chained correctly but never confirmed by the head: what a kill between the
    // record and its head leaves, and what someone else appending a record leaves.
    let mut l = lines(&file);
    let one = forged(&l[2], 3, &hash(&l[2]));
    l.push(one.clone());
    put(&file, &l);
    let t = verify(&h, &[]).unwrap_err();
    assert!(
        t.why.contains("record (3) is not confirmed by the head"),
        "{t}"
    );
    // Two are never a crash: the broker refuses them as well.
    let mut two = l.clone();
    two.push(forged(&one, 4, &hash(&one)));
    put(&file, &two);
    let t = verify(&h, &[]).unwrap_err();
    assert!(t.why.contains("newest 2 records are not confirmed"), "{t}");
    assert!(broken(open(&h)).contains("does not match the head"));
    // One is adopted at a start, and the adoption is a record of its own, reported forever.
    put(&file, &l);
    let log = open(&h).unwrap();
    let written = lines(&file);
    assert_eq!(written.len(), 5);
    let adoption: Value = serde_json::from_str(&written[4]).unwrap();
    assert_eq!(adoption["kind"], ADOPTED_KIND);
    assert_eq!(adoption["prev"], hash(&one));
    assert!(adoption["detail"].as_str().unwrap().contains("record 3"));
    log.append(&event(7)).unwrap();
    let v = verify(&h, &[]).unwrap();
    assert_eq!((v.records, v.adopted.clone()), (6, vec![3]));
    drop(log);
    // While a broker holds the log, a record after the head is one it is still writing.
    let log = open(&h).unwrap();
    let mut l = lines(&file);
    let last = l.last().unwrap().clone();
    l.push(forged(&last, 6, &hash(&last)));
    put(&file, &l);
    assert_eq!(verify(&h, &[]).unwrap().being_written, 1);
    drop(log);
    assert!(verify(&h, &[]).is_err());
    iteron_test_support::record!("P11", json!({"adopted": [3]}),);
}

#[test]
fn a_removed_or_cut_log_is_evident_through_the_anchor_and_pins() {
    let (h, file) = write_log(4);
    // The anchor is written after a run's first record and moved to the newest at close.
    assert_eq!(parse_head(&fs::read(h.join(ANCHOR)).unwrap()).unwrap().0, 0);
    let log = open(&h).unwrap();
    log.append(&event(4)).unwrap();
    log.close();
    drop(log);
    let newest = verify(&h, &[]).unwrap().newest.unwrap();
    assert_eq!(newest.seq, 4);
    assert_eq!(
        parse_head(&fs::read(h.join(ANCHOR)).unwrap()).unwrap(),
        (newest.seq, newest.sha256.clone())
    );
    let v = verify(&h, std::slice::from_ref(&newest)).unwrap();
    assert_eq!((v.anchor, v.expected), (Some(newest.clone()), 1));
    // A pin parses from what the broker prints, and mismatches are named.
    assert_eq!(Pin::parse(&newest.to_string()).unwrap(), newest);
    for bad in ["", "5", "x:ab", "5:abc", &format!("-1:{}", newest.sha256)] {
        assert!(Pin::parse(bad).is_err(), "{bad}");
    }
    let wrong = Pin {
        seq: 2,
        sha256: GENESIS.into(),
    };
    let t = verify(&h, &[wrong]).unwrap_err();
    assert!(t.why.contains("record 2 does not match"), "{t}");
    let later = Pin {
        seq: 9,
        sha256: GENESIS.into(),
    };
    assert!(
        verify(&h, &[later])
            .unwrap_err()
            .why
            .contains("ends before record 9")
    );

    // Cut the newest records and rewrite the head to match: the anchor still names record 4.
    let saved = fs::read(&file).unwrap();
    let saved_head = fs::read(h.join("audit/head")).unwrap();
    let mut l = lines(&file);
    l.truncate(3);
    fs::write(h.join("audit/head"), head_bytes(2, &hash(&l[2]))).unwrap();
    put(&file, &l);
    assert!(
        verify(&h, &[])
            .unwrap_err()
            .why
            .contains("ends before record 4")
    );
    assert!(broken(open(&h)).contains("ends before record 4"));
    fs::write(&file, &saved).unwrap();
    fs::write(h.join("audit/head"), &saved_head).unwrap();
    verify(&h, &[]).unwrap();

    // Remove every day file and the head: not "0 records", and no new chain.
    fs::remove_file(&file).unwrap();
    fs::remove_file(h.join("audit/head")).unwrap();
    let t = verify(&h, &[]).unwrap_err();
    assert!(t.why.contains("audit-anchor names"), "{t}");
    let why = broken(open(&h));
    assert!(
        why.contains("missing or empty but audit-anchor names record 4"),
        "{why}"
    );
    assert!(
        day_files(&h.join("audit")).unwrap().is_empty(),
        "a new chain was started"
    );
    assert_eq!(inspect(&h).state, "failed");
    // Or the whole directory.
    fs::remove_dir_all(h.join("audit")).unwrap();
    assert!(verify(&h, &[]).is_err());
    assert_eq!(inspect(&h).state, "failed");
    // With the anchor gone too only a pin kept elsewhere shows it.
    fs::remove_file(h.join(ANCHOR)).unwrap();
    assert_eq!(verify(&h, &[]).unwrap().records, 0);
    assert!(
        verify(&h, &[newest])
            .unwrap_err()
            .why
            .contains("ends before record 4")
    );
    iteron_test_support::record!("P11", json!({"anchor_seq": 4}),);
}

#[test]
fn each_record_goes_to_the_journal_socket() {
    let h = home();
    let sock = h.join("journal.sock");
    let journal = UnixDatagram::bind(&sock).unwrap();
    journal
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let log = AuditLog::open_with(
        &h,
        &Options {
            journal: Some(sock.clone()),
        },
    )
    .unwrap();
    for i in 0..3 {
        log.append(&event(i)).unwrap();
    }
    let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
    let written = lines(&file);
    for (i, line) in written.iter().enumerate() {
        let mut buf = vec![0u8; 4096];
        let n = journal.recv(&mut buf).unwrap();
        let msg = &buf[..n];
        let text = String::from_utf8_lossy(msg);
        let want = format!("{i}:{}", hash(line));
        assert!(
            text.starts_with(&format!("MESSAGE=iteron audit record {want} (call_tool)\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("\nITERON_AUDIT_SEQ={i}\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("\nITERON_AUDIT_SHA256={}\n", hash(line))),
            "{text}"
        );
        assert!(
            text.contains("\nSYSLOG_IDENTIFIER=iteron-broker\n"),
            "{text}"
        );
        // The home in the length-prefixed form.
        let at = msg.windows(12).position(|w| w == b"ITERON_HOME\n").unwrap() + 12;
        let len = u64::from_le_bytes(msg[at..at + 8].try_into().unwrap()) as usize;
        assert_eq!(&msg[at + 8..at + 8 + len], h.as_os_str().as_bytes());
        assert_eq!(msg.len(), at + 8 + len + 1);
    }
    // A path that is not a socket: nothing is sent, and the log works.
    drop(log);
    let log = AuditLog::open_with(
        &h,
        &Options {
            journal: Some(file.clone()),
        },
    )
    .unwrap();
    assert!(log.journal.is_none());
    log.append(&event(3)).unwrap();
    iteron_test_support::record!("P11", json!({"records": written.len()}),);
}

#[test]
fn verify_refuses_what_the_broker_refuses() {
    let (h, file) = write_log(2);
    let dir = h.join("audit");
    let mut checked = Vec::new();
    let mut refused = |name: &str, h: &Path| {
        let t = verify(h, &[]).unwrap_err();
        assert!(t.why.starts_with("refusing "), "{name}: {t}");
        assert!(open(h).is_err(), "{name}: the broker opened it");
        checked.push(name.to_owned());
    };
    // A symlinked audit/ directory.
    let real = h.join("elsewhere");
    fs::rename(&dir, &real).unwrap();
    std::os::unix::fs::symlink(&real, &dir).unwrap();
    refused("symlinked audit/", &h);
    fs::remove_file(&dir).unwrap();
    fs::rename(&real, &dir).unwrap();
    verify(&h, &[]).unwrap();
    // Loose modes on audit/ and on the home.
    for d in [&dir, &h] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
        refused("a loose mode", &h);
        fs::set_permissions(d, fs::Permissions::from_mode(0o700)).unwrap();
    }
    // A foreign owner (root can hand it to another uid).
    if nix::unistd::geteuid().is_root() {
        let nobody = Some(nix::unistd::Uid::from_raw(65534));
        nix::unistd::chown(&dir, nobody, None).unwrap();
        refused("a foreign audit/", &h);
        nix::unistd::chown(&dir, Some(nix::unistd::geteuid()), None).unwrap();
    }
    // A hard link to a day file, the head or the anchor.
    for f in [file.clone(), dir.join(HEAD), h.join(ANCHOR)] {
        let link = h.join("second-name");
        fs::hard_link(&f, &link).unwrap();
        refused("a hard-linked file", &h);
        assert!(verify(&h, &[]).unwrap_err().why.contains("2 hard links"));
        fs::remove_file(&link).unwrap();
    }
    verify(&h, &[]).unwrap();
    open(&h).unwrap();
    iteron_test_support::record!("P11", json!({"cases": checked}),);
}

#[test]
fn a_full_filesystem_never_leaves_a_torn_record() {
    let fs_ = match Tmpfs::mount("64k") {
        Ok(m) => m,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let h = fs_.0.join("home");
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().mode(0o700).create(&h).unwrap();
    let log = open(&h).unwrap();
    log.append(&event(0)).unwrap();
    // Fill every free page: the day file can grow only within the page it has.
    let mut filler = fs::File::create(fs_.0.join("filler")).unwrap();
    while filler.write_all(&[0u8; 4096]).is_ok() {}
    drop(filler);
    let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
    let page = 4096u64;
    // A record without detail; one with the longest detail (200 bytes) is 200 + a few more.
    let plain = fs::metadata(&file).unwrap().len();
    let mut ok = 1u64;
    let failure = loop {
        let room = page - fs::metadata(&file).unwrap().len();
        // Short records while a long one would still fit (each leaves room > 0), then a
        // long one that does not fit: the write is cut mid-record.
        let mut e = event(ok);
        e.detail = Some("x".repeat(if room >= plain + 200 { 10 } else { 200 }));
        match log.append(&e) {
            Ok(()) => ok += 1,
            Err(e) => break e,
        }
        assert!(ok < 100, "the page never filled up");
    };
    assert!(log.failed());
    let why = failure.to_string();
    assert!(
        matches!(failure, AuditError::Append { restored: true, .. })
            && why.contains("bytes were written"),
        "not a short write: {why}"
    );
    // Nothing more is appended, and effects are refused.
    assert!(log.append(&event(0)).is_err());
    assert_eq!(log.effect_gate(), Err(Gate::Failed));
    assert_eq!(log.state_json()["state"], "failed");
    let bytes = fs::read(&file).unwrap();
    assert_eq!(bytes.last(), Some(&b'\n'), "the file ends in a torn record");
    drop(log);
    let v = verify(&h, &[]).unwrap();
    assert_eq!(v.records, ok);
    iteron_test_support::record!("P11", json!({"records_before_full": ok, "failure": why}),);
}

#[test]
fn under_the_space_reserve_effects_are_refused_and_agent_records_only_counted() {
    // The bound itself, at the limit and one under.
    assert!(!below_reserve(SPACE_RESERVE));
    assert!(below_reserve(SPACE_RESERVE - 1));
    assert!(below_reserve(0));
    let fs_ = match Tmpfs::mount("1m") {
        Ok(m) => m,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let h = fs_.0.join("home");
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().mode(0o700).create(&h).unwrap();
    let log = open(&h).unwrap();
    let free = match log.effect_gate() {
        Err(Gate::LowSpace { free }) => free,
        other => panic!("{other:?}"),
    };
    assert!(free > 0 && below_reserve(free), "{free}");
    assert_eq!(log.state_json()["state"], "low_space");
    // An effect's record is refused with its reason; the operator's actions and agents'
    // effect records are still written; agents' other records are counted.
    assert_eq!(log.append_effect(&event(0)), Err(Gate::LowSpace { free }));
    log.append(&event(1)).unwrap();
    log.append(&Event {
        peer_uid: Some(1000),
        ..Event::new(Kind::OperatorCancel, Decision::Allowed, Outcome::Ok)
    })
    .unwrap();
    for _ in 0..500 {
        log.append(&cheap(1000)).unwrap();
    }
    let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
    assert_eq!(lines(&file).len(), 2);
    assert_eq!(log.state_json()["suppressed_records"], 500);
    // At stop the count is written.
    log.close();
    let l = lines(&file);
    assert_eq!(l.len(), 3);
    let summary: Value = serde_json::from_str(&l[2]).unwrap();
    assert_eq!(summary["kind"], SUPPRESSED_KIND);
    assert!(
        summary["detail"]
            .as_str()
            .unwrap()
            .starts_with("500 records")
    );
    drop(log);
    verify(&h, &[]).unwrap();
    iteron_test_support::record!("P11", json!({"reserve": SPACE_RESERVE, "free": free}),);
}

/// Sleep until just after the start of the next second, so a burst stays in one second.
fn next_second() {
    let since = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap();
    std::thread::sleep(
        Duration::from_millis(1010)
            .saturating_sub(Duration::from_nanos(u64::from(since.subsec_nanos()))),
    );
}

#[test]
fn agent_records_are_rate_limited_per_uid_at_the_limit_and_one_over() {
    // The step itself: the limit is written, one over is counted, a new second starts over.
    let mut w = Window::default();
    for _ in 0..MAX_AGENT_RECORDS_PER_SEC {
        assert!(rate_step(&mut w, 7));
    }
    assert!(!rate_step(&mut w, 7));
    assert_eq!(w.suppressed, 1);
    assert!(rate_step(&mut w, 8));
    assert_eq!((w.written, w.suppressed), (1, 1));
    // Effects, operator actions and refused peers are never counted instead of written.
    assert!(limitable(&cheap(1)));
    for e in [
        event(0),
        Event {
            outcome: Outcome::Dispatching,
            decision: Decision::Approved,
            ..cheap(1)
        },
        Event {
            decision: Decision::Denied,
            ..cheap(1)
        },
        Event {
            kind: Kind::OperatorDecide,
            ..cheap(1)
        },
        Event {
            kind: Kind::ConnectAgent,
            decision: Decision::Refused,
            ..cheap(1)
        },
        Event {
            kind: Kind::BrokerStart,
            peer_uid: None,
            ..cheap(1)
        },
    ] {
        assert!(!limitable(&e), "{e:?}");
    }
    // Through the log, within one second (retried if the machine stalled past it).
    let max = u64::from(MAX_AGENT_RECORDS_PER_SEC);
    let mut tries = 0;
    let (h, file) = loop {
        tries += 1;
        let h = home();
        let log = open(&h).unwrap();
        next_second();
        let second = unix_second();
        // uid 1000 one over, uid 1001 two over, then three effects of uid 1000.
        for _ in 0..=max {
            log.append(&cheap(1000)).unwrap();
        }
        for _ in 0..max + 2 {
            log.append(&cheap(1001)).unwrap();
        }
        for i in 0..3 {
            log.append(&event(i)).unwrap();
        }
        if unix_second() != second {
            assert!(tries < 3, "the machine is too slow for a one-second burst");
            continue;
        }
        let file = day_files(&h.join("audit")).unwrap().pop().unwrap();
        let records = |file: &Path| -> Vec<Value> {
            lines(file)
                .iter()
                .map(|x| serde_json::from_str(x).unwrap())
                .collect()
        };
        let count = |l: &[Value], uid: u32, kind: &str| {
            l.iter()
                .filter(|v| v["peer_uid"] == uid && v["kind"] == kind)
                .count() as u64
        };
        let l = records(&file);
        assert_eq!(count(&l, 1000, "list_tools"), max, "at the limit");
        assert_eq!(
            count(&l, 1001, "list_tools"),
            max,
            "each uid has its own budget"
        );
        assert_eq!(count(&l, 1000, "call_tool"), 3, "effects are all written");
        // The count comes first in the uid's next written record.
        let at = l.iter().position(|v| v["kind"] == SUPPRESSED_KIND).unwrap();
        assert_eq!(l[at]["peer_uid"], 1000);
        assert!(
            l[at]["detail"]
                .as_str()
                .unwrap()
                .starts_with("1 records of this uid were counted"),
            "{}",
            l[at]
        );
        assert_eq!(l[at + 1]["kind"], "call_tool");
        assert_eq!(log.state_json()["suppressed_records"], 3);
        // What is still pending is written at stop.
        log.close();
        let l = records(&file);
        let last = l.last().unwrap();
        assert_eq!(
            (&last["kind"], &last["peer_uid"]),
            (&json!(SUPPRESSED_KIND), &json!(1001))
        );
        assert!(last["detail"].as_str().unwrap().starts_with("2 records"));
        break (h, file);
    };
    verify(&h, &[]).unwrap();
    assert!(lines(&file).len() as u64 <= 2 * max + 6);
    iteron_test_support::record!("P11", json!({"max_per_sec": MAX_AGENT_RECORDS_PER_SEC}),);
}
