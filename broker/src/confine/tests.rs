use super::*;

fn tree(name: &str) -> PathBuf {
    let base = std::env::temp_dir().join(format!("iteron-confine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    for d in ["a/home/x", "a/b", "a/c", "d"] {
        std::fs::create_dir_all(base.join(d)).unwrap();
    }
    std::fs::write(base.join("a/file"), "f").unwrap();
    base
}

#[test]
fn run_as_switches_only_under_a_root_broker_and_never_silently() {
    let to = |uid, gid| Identity {
        uid,
        gid,
        switched: true,
    };
    let keep = |uid, gid| Identity {
        uid,
        gid,
        switched: false,
    };
    // A root broker: nobody by default, root only when asked, or a dedicated account.
    assert_eq!(identity_for(RunAs::Nobody, 0, 0), Ok(to(65534, 65534)));
    assert_eq!(identity_for(RunAs::Root, 0, 0), Ok(keep(0, 0)));
    let ids = RunAs::Ids { uid: 7, gid: 8 };
    assert_eq!(identity_for(ids, 0, 0), Ok(to(7, 8)));
    // A broker that is not root cannot switch: its own uid, and another one is refused.
    assert_eq!(identity_for(RunAs::Nobody, 1000, 100), Ok(keep(1000, 100)));
    assert_eq!(identity_for(RunAs::Root, 1000, 100), Ok(keep(1000, 100)));
    let own = RunAs::Ids {
        uid: 1000,
        gid: 100,
    };
    assert_eq!(identity_for(own, 1000, 100), Ok(keep(1000, 100)));
    assert_eq!(identity_for(ids, 1000, 100), Err(IdentityError::NeedsRoot));
    // And a refused identity stops the start (prepare fails, nothing is spawned).
    if !nix::unistd::geteuid().is_root() {
        let spec = Spec {
            run_as: ids,
            ..Spec::default()
        };
        assert!(prepare(&spec).is_err());
    }
}

#[test]
fn a_web_egress_server_without_network_namespaces_starts_only_on_the_hosts_network() {
    let none = || Err::<(), String>("unshare: Operation not permitted".to_owned());
    let egress = Spec {
        network: true,
        ..Spec::default()
    };
    // No namespace: it is not started, and the reason says what the operator can do.
    let e = plan_with(&egress, none());
    assert!(matches!(e.net, NetState::Refused(_)));
    assert!(
        e.network_words().starts_with("cannot start")
            && e.network_words().contains("sandbox.network \"host\""),
        "{}",
        e.network_words()
    );
    let err = prepare_with(&egress, none()).err().unwrap();
    assert!(err.to_string().contains("cannot start"), "{err}");
    // sandbox.network "host": it starts, unconfined, and says so.
    let host = Spec {
        net_mode: SandboxNetwork::Host,
        ..egress.clone()
    };
    let e = plan_with(&host, none());
    assert_eq!(e.net, NetState::Host);
    assert!(e.network_words().starts_with("UNCONFINED"));
    let (prepared, _, proxy) = prepare_with(&host, none()).unwrap();
    assert!(prepared.netns.is_none() && proxy.is_none());
    // A server without web_egress still starts: no sockets, whatever the namespaces.
    let plain = Spec::default();
    let e = plan_with(&plain, none());
    assert!(matches!(e.net, NetState::NoNamespace(_)));
    assert!(e.network_words().starts_with("denied"));
    assert!(prepare_with(&plain, none()).unwrap().0.netns.is_none());
    // With namespaces: its own, and for web_egress the proxy channel.
    assert_eq!(plan_with(&plain, Ok(())).net, NetState::Isolated);
    let (prepared, e, proxy) = prepare_with(&egress, Ok(())).unwrap();
    assert_eq!(e.net, NetState::Egress);
    // Either a namespace made ahead of time with its listener, or the child makes both.
    match (&prepared.netns, &proxy) {
        (Some(n), Some(sys::ProxyListener::Ready(_))) => assert!(n.join.is_some()),
        (Some(n), Some(sys::ProxyListener::Arrives(_))) => assert!(n.proxy.is_some()),
        other => panic!("{other:?}"),
    }
    let json = e.to_json();
    assert_eq!(json["network_namespace"], true);
    assert!(
        json["network"]
            .as_str()
            .unwrap()
            .starts_with("egress only through the broker")
    );
    iteron_test_support::record!("P9", serde_json::json!({}),);
}

#[test]
fn the_secrets_of_etc_are_denied_and_reachability_follows_the_modes() {
    // A child that keeps the broker's uid (root here, or the operator's uid and groups).
    let keep = Spec {
        run_as: RunAs::Root,
        ..Spec::default()
    };
    let e = plan(&keep);
    for secret in ["/etc/shadow", "/etc/gshadow"] {
        let p = Path::new(secret);
        if p.exists() {
            let real = std::fs::canonicalize(p).unwrap();
            assert!(e.denied.contains(&real), "{secret}: {:?}", e.denied);
            assert!(
                !e.readable.iter().any(|r| real.starts_with(r)),
                "{secret} lies beneath a readable root"
            );
        }
    }
    // /etc itself is granted as its other entries.
    if Path::new("/etc/passwd").exists() {
        assert!(
            e.readable
                .iter()
                .any(|r| Path::new("/etc/passwd").starts_with(r))
        );
    }
    // A child switched to nobody: the modes keep it out, so /etc is granted whole (one
    // rule instead of one per entry), unless a secret's mode would let it in.
    if nix::unistd::geteuid().is_root() {
        let e = plan(&Spec::default());
        for secret in ETC_SECRETS {
            let p = Path::new(secret);
            if p.exists() {
                assert_eq!(
                    e.denied.contains(&std::fs::canonicalize(p).unwrap()),
                    exposed_to(p, NOBODY_ID, NOBODY_ID),
                    "{secret}"
                );
            }
        }
    }
    // Mode bits, as a uid that is not root sees them.
    let t = tree("modes");
    use std::os::unix::fs::PermissionsExt;
    let private = t.join("a");
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    assert!(!reachable_by(&t.join("a/file"), 65534, 65534, false));
    assert!(reachable_by(&t.join("d"), 65534, 65534, false));
    assert!(!reachable_by(&t.join("d"), 65534, 65534, true));
    assert!(reachable_by(&t.join("d"), 0, 0, true));
    // Search alone on a directory exposes what is beneath it.
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o711)).unwrap();
    assert!(exposed_to(&private, 65534, 65534));
    assert!(!reachable_by(&private, 65534, 65534, false));
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o755)).unwrap();
    let _ = std::fs::remove_dir_all(&t);
}

#[test]
fn a_grant_containing_the_home_becomes_its_siblings() {
    let t = tree("expand");
    let deny = vec![t.join("a/home")];
    let mut got = expand(&t, &deny);
    got.sort();
    assert_eq!(
        got,
        vec![t.join("a/b"), t.join("a/c"), t.join("a/file"), t.join("d")]
    );
    assert_eq!(expand(&t.join("d"), &deny), vec![t.join("d")]);
    assert!(expand(&t.join("a/home/x"), &deny).is_empty());
    let _ = std::fs::remove_dir_all(&t);
}

#[test]
fn a_rule_never_lands_on_a_forbidden_inode_whatever_the_path() {
    use std::os::unix::fs::MetadataExt;
    let Some(abi) = sys::landlock_abi() else {
        return; // nothing to test without Landlock (doctor reports it)
    };
    let t = tree("swap");
    let home = t.join("a/home");
    std::os::unix::fs::symlink(&home, t.join("link")).unwrap();
    let m = std::fs::metadata(&home).unwrap();
    let rs = sys::landlock_ruleset(abi, true).unwrap();
    let read = landlock::READ_FILE | landlock::READ_DIR;
    // Through a symlink (as if swapped in after planning): refused.
    assert!(sys::landlock_allow(&rs, &t.join("link"), read, &[(m.dev(), m.ino())]).is_err());
    // Through a symlink that leads below the home (a directory that is not itself forbidden):
    // refused too, since a planned path never holds a link.
    std::fs::create_dir_all(home.join("secret")).unwrap();
    std::os::unix::fs::symlink(home.join("secret"), t.join("below")).unwrap();
    let e = sys::landlock_allow(&rs, &t.join("below"), read, &[(m.dev(), m.ino())]).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    // A link above the granted directory, not only its last component, is refused as well.
    std::os::unix::fs::symlink(&home, t.join("via")).unwrap();
    assert!(sys::landlock_allow(&rs, &t.join("via/secret"), read, &[(m.dev(), m.ino())]).is_err());
    // A sibling: granted.
    assert!(sys::landlock_allow(&rs, &t.join("d"), read, &[(m.dev(), m.ino())]).is_ok());
    // And a grant planned through the symlink is dropped as inside the home.
    let spec = Spec {
        deny: vec![home.clone()],
        readable: vec![t.join("link")],
        ..Spec::default()
    };
    let e = plan(&spec);
    assert!(
        e.dropped
            .iter()
            .any(|(_, why)| *why == "inside a denied directory")
    );
    iteron_test_support::record!("P9", serde_json::json!({"links_swapped_in": "refused"}));
    let _ = std::fs::remove_dir_all(&t);
}

#[test]
fn the_install_tree_includes_node_module_roots_and_venvs() {
    let t = tree("install");
    std::fs::create_dir_all(t.join("proj/node_modules/pkg/dist")).unwrap();
    std::fs::write(t.join("proj/node_modules/pkg/dist/index.js"), "").unwrap();
    std::fs::create_dir_all(t.join("proj/peers")).unwrap();
    std::fs::write(t.join("proj/peers/server.mjs"), "").unwrap();
    let got = install_tree(
        Path::new("/usr/bin/env"),
        &[
            t.join("proj/peers/server.mjs")
                .to_string_lossy()
                .into_owned(),
            "--flag".into(),
        ],
        &[],
    );
    let t = std::fs::canonicalize(&t).unwrap();
    assert!(got.contains(&t.join("proj/peers")), "{got:?}");
    assert!(got.contains(&t.join("proj/node_modules")), "{got:?}");
    assert!(got.contains(&PathBuf::from("/usr/bin")), "{got:?}");
}

/// A program beside the denied home (both in one scratch directory, as with a binary in `/tmp`
/// and a home in `/tmp`) is granted alone: its directory, with every other entry of it, is
/// not — and the plan stays a handful of rules however full that directory is.
#[test]
fn a_program_beside_a_denied_path_is_granted_alone_not_its_directory() {
    let t = tree("beside");
    let t = std::fs::canonicalize(&t).unwrap();
    let home = t.join("a/home");
    std::fs::create_dir_all(t.join("a/bin")).unwrap();
    for i in 0..200 {
        std::fs::write(t.join(format!("a/other-{i}")), "x").unwrap();
    }
    let server = t.join("a/server");
    std::fs::write(&server, "#!/bin/sh\n").unwrap();
    let tool = t.join("a/bin/tool");
    std::fs::write(&tool, "").unwrap();
    let deny = vec![home.clone()];
    // The script (its interpreter's tree too), and a program in a/bin whose prefix a/ holds
    // the home: each granted without a directory that holds the home.
    let got = install_tree(&server, &[], &deny);
    assert!(got.contains(&server), "{got:?}");
    assert!(got.contains(&PathBuf::from("/bin")) || got.contains(&PathBuf::from("/usr/bin")));
    assert!(!got.iter().any(|g| home.starts_with(g)), "{got:?}");
    let got = install_tree(&tool, &[], &deny);
    assert_eq!(got, vec![t.join("a/bin")], "the prefix a/ holds the home");
    // Without the denial the directory is the install tree, as before.
    assert!(install_tree(&server, &[], &[]).contains(&t.join("a")));
    // The plan grants the program and none of its 200 neighbours.
    let spec = Spec {
        deny,
        ..Spec::default()
    };
    let e = describe(&spec, &server, &[]);
    assert!(e.readable.contains(&server), "{:?}", e.readable);
    assert!(
        !e.readable
            .iter()
            .any(|r| r.starts_with(t.join("a/other-0")))
    );
    assert!(!e.readable.iter().any(|r| r.starts_with(&t) && r != &server));
    let base = plan(&spec).readable.len();
    assert!(
        e.readable.len() <= base + 4,
        "{} vs {base}",
        e.readable.len()
    );
    std::fs::remove_dir_all(&t).unwrap();
}

#[test]
fn the_memoized_canonical_path_is_what_realpath_answers() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::fs::symlink;
    let t = std::env::temp_dir().join(format!("iteron-canon-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&t);
    std::fs::create_dir_all(t.join("a/b/c")).unwrap();
    std::fs::write(t.join("a/file"), b"x").unwrap();
    symlink("a/b", t.join("rel")).unwrap(); // relative
    symlink(t.join("a/b/c"), t.join("abs")).unwrap(); // absolute
    symlink("rel", t.join("chain")).unwrap(); // a link to a link
    symlink("../..", t.join("a/b/c/up")).unwrap(); // a link through ..
    symlink("loop2", t.join("loop1")).unwrap();
    symlink("loop1", t.join("loop2")).unwrap();
    symlink("missing", t.join("dangling")).unwrap();
    let cases = [
        "a",
        "a/b/c",
        "a/./b/../b/c",
        "rel",
        "rel/c",
        "rel/..",
        "abs",
        "abs/..",
        "chain/c",
        "chain/c/up",
        "chain/c/up/file",
        "a/b/c/up/b",
        "a/file",
        "a/file/x",
        "a/missing",
        "loop1",
        "loop1/x",
        "dangling",
        "dangling/x",
        "..",
    ];
    for case in cases {
        let p = t.join(case);
        let want = std::fs::canonicalize(&p).ok();
        // Asked twice inside one memo (the second from the memo), and in a fresh one.
        let (first, second) = memoized(|| (canonical(&p), canonical(&p)));
        assert_eq!(first, want, "{case}");
        assert_eq!(second, want, "{case}");
    }
    // Every case inside one memo, so prefixes and links are shared between them.
    memoized(|| {
        for case in cases {
            let p = t.join(case);
            assert_eq!(canonical(&p), std::fs::canonicalize(&p).ok(), "{case}");
            assert_eq!(
                meta(&p).map(|m| (m.dev(), m.ino())),
                std::fs::metadata(&p).ok().map(|m| (m.dev(), m.ino())),
                "{case}"
            );
        }
    });
    std::fs::remove_dir_all(&t).unwrap();
}

#[test]
fn a_path_beneath_a_directory_granted_as_much_gets_no_rule_of_its_own() {
    let p = |s: &str| PathBuf::from(s);
    let readable = vec![
        p("/opt/tool"),
        p("/usr"),
        p("/usr/bin"),
        p("/usr/lib"),
        p("/usrx"),
        p("/w/r"),
    ];
    let writable = vec![p("/usr/tmp"), p("/w"), p("/w/scratch"), p("/x")];
    let (r, w) = rule_paths(&readable, &writable);
    // `/usr/bin` and `/usr/lib` lie under `/usr` (read), `/w/r` under `/w` (write covers read);
    // `/usrx` is a sibling with a common prefix, not a descendant.
    assert_eq!(r, [&p("/opt/tool"), &p("/usr"), &p("/usrx")]);
    // A writable path under a readable one keeps its rule (it grants more); one under a
    // writable directory does not.
    assert_eq!(w, [&p("/usr/tmp"), &p("/w"), &p("/x")]);
    let alone = [p("/usr/bin")];
    assert_eq!(rule_paths(&alone, &[]).0, [&alone[0]]);
}
