//! `iteron skills` and `iteron agents` against the hostile repository fixture
//! (`fixtures/hostile-repo`) and an operator home (`fixtures/hostile-home`): every hostile file
//! is refused with its documented reason, the good ones are admitted, and nothing else is
//! affected.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use iteron_test_support as support;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// A private copy of the operator-home fixture.
fn home(name: &str) -> PathBuf {
    let base = std::env::temp_dir().join(format!("iteron-catalog-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    support::copy_tree(
        &repo().join("fixtures/hostile-home"),
        &base.join("home"),
        0o700,
        0o600,
    );
    base.join("home")
}

fn run(home: &Path, args: &[&str]) -> (Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_iteron"))
        .args(args)
        .env("ITERON_HOME", home)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        serde_json::from_slice(&out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// Every expected path is reported with its reason, and nothing else is.
fn assert_rejected(v: &Value, want: &[(&str, &str)]) {
    let r = rejected(v);
    for (path, reason) in want {
        let got = r
            .get(*path)
            .unwrap_or_else(|| panic!("{path} not reported: {r:#?}"));
        assert!(got.contains(reason), "{path}: {got}");
    }
    assert_eq!(r.len(), want.len(), "{r:#?}");
}

fn rejected(v: &Value) -> BTreeMap<String, String> {
    v["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["path"]
                    .as_str()
                    .unwrap()
                    .replace("fixtures/hostile-repo/", ""),
                r["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn hostile_skills_are_refused_with_their_reasons_and_the_good_ones_stay() {
    let h = home("skills");
    let (v, _) = run(
        &h,
        &[
            "skills",
            "--repo",
            "fixtures/hostile-repo",
            "--format",
            "json",
        ],
    );
    let skills: Vec<(&str, &str)> = v["skills"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["tier"].as_str().unwrap()))
        .collect();
    assert_eq!(skills, vec![("deploy", "user"), ("lint", "repository")]);
    let want: &[(&str, &str)] = &[
        (
            ".iteron/skills/deploy/SKILL.md",
            "shadowed by the user skill of the same name",
        ),
        (
            ".iteron/skills/evil\\u{202e}txt.md/SKILL.md",
            "bidirectional control U+202E",
        ),
        (".iteron/skills/zwj/SKILL.md", "invisible character U+200D"),
        (
            ".iteron/skills/filler/SKILL.md",
            "invisible character U+3164",
        ),
        (".iteron/skills/vs16/SKILL.md", "invisible character U+FE0F"),
        (".iteron/skills/huge/SKILL.md", "at most 262144 bytes"),
        (
            ".iteron/skills/linked",
            "a symlink (symlinks are never followed)",
        ),
        (
            ".iteron/skills/node_modules",
            "inside a dependency/vendor directory (node_modules)",
        ),
        (
            "node_modules/some-pkg/.iteron/skills/helper/SKILL.md",
            "inside a dependency/vendor directory (node_modules); stripped",
        ),
        (
            "packages/app/.iteron/skills/nested/SKILL.md",
            "not at the repository root; ignored",
        ),
        (
            ".iteron/config.json",
            "hooks in a repository are ignored (hooks load only from ~/.iteron/config.json)",
        ),
    ];
    assert_rejected(&v, want);
    // The rendered path is terminal-safe: the RLO is escaped, never emitted.
    assert!(!serde_json::to_string(&v).unwrap().contains('\u{202e}'));
    iteron_test_support::record!("P7", serde_json::json!({}),);
}

#[test]
fn hostile_agent_definitions_are_refused_with_their_reasons() {
    let h = home("agents");
    let (v, _) = run(
        &h,
        &[
            "agents",
            "--repo",
            "fixtures/hostile-repo",
            "--format",
            "json",
        ],
    );
    let agents: Vec<(&str, &str)> = v["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["name"].as_str().unwrap(), a["tier"].as_str().unwrap()))
        .collect();
    assert_eq!(
        agents,
        vec![
            ("Planner", "user"),
            ("reviewer", "user"),
            ("router", "user")
        ]
    );
    for a in v["agents"].as_array().unwrap() {
        assert_eq!(a["identity"].as_str().unwrap().len(), 64);
        for t in a["tools"].as_array().unwrap() {
            assert!(iteron_policy::agentdef::READ_ONLY_TOOLS.contains(&t.as_str().unwrap()));
        }
    }
    let planner = &v["agents"][0];
    assert_eq!(planner["budget"]["max_usd_micros"], 2_500_000);
    assert_eq!(planner["budget"]["max_turns"], 30);
    let want: &[(&str, &str)] = &[
        (
            ".iteron/agents/reviewer.md",
            "shadowed by the user definition of the same name",
        ),
        (".iteron/agents/unknown-key.md", "unknown key"),
        (".iteron/agents/duplicate-key.md", "duplicate key"),
        (
            ".iteron/agents/both-lists.md",
            "tools and disallowedTools are mutually exclusive",
        ),
        (
            ".iteron/agents/turns-31.md",
            "maxTurns must be between 1 and 30",
        ),
        (
            ".iteron/agents/usd-negative.md",
            "maxUsd must be a finite, non-negative amount",
        ),
        (
            ".iteron/agents/usd-nan.md",
            "maxUsd must be a finite, non-negative amount",
        ),
        (
            ".iteron/agents/usd-huge.md",
            "maxUsd must be a finite, non-negative amount",
        ),
        (".iteron/agents/name-129.md", "the name must be 1-128 bytes"),
        (
            ".iteron/agents/name-slash.md",
            "the name must be 1-128 bytes",
        ),
        (
            ".iteron/agents/wants-shell.md",
            "shell is not in the read-only tool registry",
        ),
        (
            ".iteron/agents/writer.md",
            "edit_file is not in the read-only tool registry",
        ),
        (
            "node_modules/some-pkg/.iteron/agents/sneaky.md",
            "inside a dependency/vendor directory (node_modules); stripped",
        ),
        (
            "vendor/lib/.iteron/agents/vendored.md",
            "inside a dependency/vendor directory (vendor); stripped",
        ),
        (".iteron/config.json", "hooks in a repository are ignored"),
    ];
    assert_rejected(&v, want);
    iteron_test_support::record!("P7", serde_json::json!({}),);
}

#[test]
fn a_trusted_directory_others_can_write_is_not_trusted() {
    let h = home("open");
    std::fs::set_permissions(h.join("skills"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let (v, _) = run(&h, &["skills", "--format", "json"]);
    assert_eq!(v["skills"], serde_json::json!([]));
    let r = rejected(&v);
    let reason = r.values().next().unwrap();
    assert!(reason.contains("writable by group or others"), "{reason}");
    // The agents directory is unaffected.
    let (v, _) = run(&h, &["agents", "--format", "json"]);
    assert_eq!(v["agents"].as_array().unwrap().len(), 3);
    // One group-writable definition inside a private directory is refused alone.
    std::fs::set_permissions(
        h.join("agents/router.md"),
        std::fs::Permissions::from_mode(0o620),
    )
    .unwrap();
    let (v, _) = run(&h, &["agents", "--format", "json"]);
    let names: Vec<&str> = v["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["Planner", "reviewer"]);
    let r = rejected(&v);
    assert!(
        r.values()
            .any(|why| why.contains("a trusted file must be the operator's alone"))
    );
}

#[test]
fn the_text_output_names_each_refusal_on_one_line() {
    let h = home("text");
    let out = Command::new(env!("CARGO_BIN_EXE_iteron"))
        .args(["agents", "--repo", "fixtures/hostile-repo"])
        .env("ITERON_HOME", &h)
        .current_dir(repo())
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("reviewer  (user)  identity "))
    );
    assert!(text.lines().any(|l| {
        l.starts_with("rejected fixtures/hostile-repo/.iteron/agents/turns-31.md: maxTurns")
    }));
    assert!(text.lines().all(|l| l.len() <= 512));
}

/// The skill index holds at most 256 entries: the 256th is indexed, the 257th is refused with
/// its reason.
#[test]
fn the_skill_index_is_bounded_at_the_limit_and_one_over() {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let max = iteron_policy::skill::MAX_INDEX;
    let base = std::env::temp_dir().join(format!("iteron-catalog-index-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let home = base.join("home");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(home.join("skills"))
        .unwrap();
    let add = |i: usize| {
        let dir = home.join("skills").join(format!("s{i:03}"));
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        let file = dir.join("SKILL.md");
        std::fs::write(
            &file,
            format!("---\nname: s{i:03}\ndescription: Skill {i}.\n---\nBody {i}.\n"),
        )
        .unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    };
    for i in 0..max {
        add(i);
    }
    let (v, _) = run(&home, &["skills", "--format", "json"]);
    assert_eq!(v["skills"].as_array().unwrap().len(), max);
    assert!(v["rejected"].as_array().unwrap().is_empty(), "{v}");
    add(max);
    let (v, _) = run(&home, &["skills", "--format", "json"]);
    assert_eq!(v["skills"].as_array().unwrap().len(), max);
    let r = rejected(&v);
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(
        r.values()
            .all(|why| why == "the skill index is full (256 entries)"),
        "{r:?}"
    );
    iteron_test_support::record!("P5", serde_json::json!({"max_index": max}),);
    let _ = std::fs::remove_dir_all(&base);
}

/// At most 256 agent definitions are admitted: the 257th is refused with its reason.
#[test]
fn the_agent_index_is_bounded_at_the_limit_and_one_over() {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let max = iteron_broker::catalog::MAX_AGENTS;
    let base = std::env::temp_dir().join(format!("iteron-catalog-agents-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let home = base.join("home");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(home.join("agents"))
        .unwrap();
    let add = |i: usize| {
        let file = home.join("agents").join(format!("a{i:03}.md"));
        std::fs::write(
            &file,
            format!(
                "---\nname: a{i:03}\ndescription: Agent {i}.\ntools: [read_file]\n---\nWork.\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    };
    for i in 0..max {
        add(i);
    }
    let (v, _) = run(&home, &["agents", "--format", "json"]);
    assert_eq!(v["agents"].as_array().unwrap().len(), max);
    assert!(v["rejected"].as_array().unwrap().is_empty(), "{v}");
    assert_eq!(v["omitted"], 0);
    add(max);
    let (v, _) = run(&home, &["agents", "--format", "json"]);
    assert_eq!(v["agents"].as_array().unwrap().len(), max);
    let r = rejected(&v);
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(
        r.values()
            .all(|why| why == "the agent index is full (256 entries)"),
        "{r:?}"
    );
    iteron_test_support::record!("P5", serde_json::json!({"max_agents": max}),);
    let _ = std::fs::remove_dir_all(&base);
}
