//! SECURITY.md names, for each promise, the tests that prove it. This test fails when a named
//! test no longer exists, so the document cannot keep claiming a proof that was deleted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

#[test]
fn every_test_named_in_security_md_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("SECURITY.md")).unwrap();
    let mut checked = 0;
    for (i, piece) in doc.split('`').enumerate() {
        // Odd pieces are inside backticks.
        if i % 2 == 0 || !piece.contains(".rs::") {
            continue;
        }
        let (file, name) = piece.rsplit_once("::").unwrap();
        let source = std::fs::read_to_string(root.join(file))
            .unwrap_or_else(|e| panic!("SECURITY.md names {file}, which cannot be read: {e}"));
        let at = source
            .find(&format!("fn {name}("))
            .unwrap_or_else(|| panic!("SECURITY.md names {file}::{name}, which does not exist"));
        // It must be a test that runs: a #[test] (plain, tokio or inside proptest!) right above.
        let mut start = at.saturating_sub(300);
        while !source.is_char_boundary(start) {
            start -= 1;
        }
        let before = &source[start..at];
        let attr = before
            .rfind("#[test]")
            .or_else(|| before.rfind("#[tokio::test"));
        let is_test = attr.is_some_and(|a| !before[a..].contains("\n}\n"));
        assert!(
            is_test,
            "SECURITY.md names {file}::{name}, which is not a #[test]"
        );
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} test references found");
}

/// Issue 14.23: the systemd unit of docs/broker.md carries the hardening `systemd-analyze
/// security` checks, keeps out what would break the broker (a user namespace would hide the
/// agent's uid from the peer check; W^X memory would break JIT servers; the network is the
/// broker's job), and, where `systemd-analyze` is installed, rates at most 2.0.
#[test]
fn the_documented_systemd_unit_is_hardened_and_keeps_what_the_broker_needs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("docs/broker.md")).unwrap();
    let start = doc.find("```ini\n[Unit]\nDescription=Iteron").unwrap() + "```ini\n".len();
    let unit = &doc[start..start + doc[start..].find("```").unwrap()];
    let lines: Vec<&str> = unit.lines().map(str::trim).collect();
    for wanted in [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "PrivateMounts=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictSUIDSGID=yes",
        "RestrictNamespaces=user net",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "LockPersonality=yes",
        "RestrictRealtime=yes",
        "RemoveIPC=yes",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service landlock_create_ruleset landlock_add_rule landlock_restrict_self seccomp",
        "SystemCallFilter=capset",
        "CapabilityBoundingSet=",
        "UMask=0077",
        "LimitCORE=0",
        "KillMode=mixed",
    ] {
        assert!(lines.contains(&wanted), "the unit lacks {wanted}");
    }
    // The second filter never removes what confinement needs (Landlock and seccomp are in
    // the allow list by name, rlimits in @resources, unshare and setns in @process), and the
    // capset every confined child makes is allowed again after it.
    let deny = lines
        .iter()
        .find(|l| l.starts_with("SystemCallFilter=~"))
        .unwrap();
    for kept in [
        "@sandbox",
        "@resources",
        "@system-service",
        "@process",
        "capset",
    ] {
        assert!(!deny.contains(kept), "{deny} removes {kept}");
    }
    let at = |l: &str| lines.iter().position(|x| *x == l).unwrap();
    assert!(
        at("SystemCallFilter=capset")
            > lines
                .iter()
                .position(|l| l.starts_with("SystemCallFilter=~"))
                .unwrap(),
        "capset is put back before @privileged is removed"
    );
    for absent in [
        "PrivateUsers=",
        "MemoryDenyWriteExecute=",
        "PrivateNetwork=",
        "IPAddressDeny=",
    ] {
        assert!(
            !lines.iter().any(|l| l.starts_with(absent)),
            "{absent} would break the broker"
        );
        assert!(
            doc.contains(&format!("`{absent}`")),
            "the doc says why {absent} is left out"
        );
    }
    let analyze = Path::new("/usr/bin/systemd-analyze");
    if !analyze.exists() {
        eprintln!("systemd-analyze is not installed: the exposure rating is not checked");
        return;
    }
    let dir = std::env::temp_dir().join(format!("iteron-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("iteron.service");
    std::fs::write(&file, unit).unwrap();
    let out = std::process::Command::new(analyze)
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    // A word systemd does not know is ignored with a warning: a group name that an older
    // systemd lacks would silently drop what it was meant to keep.
    let warned = String::from_utf8_lossy(&out.stderr);
    assert!(
        !warned.contains("ignoring"),
        "systemd-analyze ignored part of the unit: {warned}"
    );
    let rating: f64 = text
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for iteron.service: ")
                .nth(1)
        })
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no rating in: {text}"));
    assert!(rating <= 2.0, "exposure {rating}: {text}");
}
