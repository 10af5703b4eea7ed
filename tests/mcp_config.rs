//! End-to-end tests of `iteron mcp add|list|get|remove` and `iteron demo`: each runs the built
//! binary in a private temporary ITERON_HOME with a scrubbed environment.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};

/// A canary with no token shape, so redaction heuristics cannot hide a leak: a test passes only
/// if the value is never written at all (or is hidden by a rule that applies to any value).
const CANARY: &str = "CANARYplain7f3a9c0d";

struct Sandbox {
    root: PathBuf,
}

impl Sandbox {
    fn new() -> Sandbox {
        static N: AtomicU64 = AtomicU64::new(0);
        let root = std::env::temp_dir().join(format!(
            "iteron-e2e-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("user")).unwrap();
        Sandbox { root }
    }

    fn home(&self) -> PathBuf {
        self.root.join("iteron-home")
    }

    fn config(&self) -> PathBuf {
        self.home().join("config.json")
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_iteron"));
        c.args(args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", self.root.join("user"))
            .env("ITERON_HOME", self.home())
            .env("ITERON_TEST_SECRET", CANARY);
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        let out = self.command(args).output().unwrap();
        for stream in [&out.stdout, &out.stderr] {
            let text = String::from_utf8_lossy(stream);
            assert!(
                !text.contains("CANARY"),
                "canary leaked by {args:?}: {text}"
            );
        }
        out
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "{args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn fails(&self, args: &[&str], code: i32) -> String {
        let out = self.run(args);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{args:?}: stdout {} stderr {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.lines().count(), 1, "one line expected: {err:?}");
        assert!(err.len() <= 513, "error longer than 512 bytes: {err:?}");
        assert!(err.starts_with("iteron: error: "), "{err:?}");
        err
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap()
}

#[test]
fn add_list_get_remove_round_trip_in_text_and_json() {
    let sb = Sandbox::new();
    assert!(
        sb.ok(&["mcp", "list"])
            .contains("No MCP servers configured")
    );
    assert_eq!(
        json(&sb.ok(&["mcp", "list", "--format", "json"])),
        serde_json::json!({"schema_version": 2, "servers": []})
    );
    let added = sb.ok(&[
        "mcp",
        "add",
        "files",
        "--stdio",
        "/usr/bin/python3",
        "--env",
        "ITERON_TEST_SECRET",
        "--",
        "/srv/server.py",
        "--root",
        "/data",
    ]);
    assert_eq!(added, "added stdio MCP server files\n");
    sb.ok(&[
        "mcp",
        "add",
        "remote",
        "--url",
        "https://mcp.example.com/mcp",
        "--header-env",
        "X-Tenant=ITERON_TENANT",
        "--oauth-scopes",
        "read,write",
        "--oauth-client-registration",
        "dcr",
        "--oauth-issuer",
        "https://auth.example.com",
        "--oauth-client-secret-env",
        "ITERON_CLIENT_SECRET",
    ]);

    let list = sb.ok(&["mcp", "list"]);
    let lines: Vec<&str> = list.lines().collect();
    assert_eq!(lines.len(), 3, "{list}");
    assert!(lines[0].starts_with("NAME"));
    assert!(lines[1].starts_with("files ") && lines[1].contains("stdio"));
    assert!(lines[1].contains("/usr/bin/python3 /srv/server.py --root /data"));
    assert!(lines[2].starts_with("remote ") && lines[2].contains("https://mcp.example.com/mcp"));

    let listed = json(&sb.ok(&["mcp", "list", "--format", "json"]));
    assert_eq!(listed["schema_version"], 2);
    let servers = listed["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 2);
    assert_eq!(
        servers[0],
        serde_json::json!({
            "name": "files",
            "transport": "stdio",
            "command": "/usr/bin/python3",
            "args": ["/srv/server.py", "--root", "/data"],
            "env": ["ITERON_TEST_SECRET"],
        })
    );
    assert_eq!(
        servers[1],
        serde_json::json!({
            "name": "remote",
            "transport": "http",
            "url": "https://mcp.example.com/mcp",
            "header_env": {"x-tenant": "ITERON_TENANT"},
            "oauth": {
                "scopes": ["read", "write"],
                "client_registration": "dcr",
                "client_secret_env": "ITERON_CLIENT_SECRET",
                "issuer": "https://auth.example.com",
            },
        })
    );
    // The JSON listing is exactly what the configuration file holds.
    let file = json(&fs::read_to_string(sb.config()).unwrap());
    assert_eq!(file["mcp_servers"], listed["servers"]);

    // `get` prints that entry, with the `schema_version` every top-level JSON output carries.
    let mut got = json(&sb.ok(&["mcp", "get", "remote", "--format", "json"]));
    assert_eq!(got["schema_version"], 2);
    got.as_object_mut().unwrap().remove("schema_version");
    assert_eq!(got, servers[1]);
    let text = sb.ok(&["mcp", "get", "files"]);
    assert!(
        text.contains("env (names only)") && text.contains("ITERON_TEST_SECRET"),
        "{text}"
    );
    assert!(text.contains("every call needs approval"), "{text}");

    assert_eq!(
        sb.ok(&["mcp", "remove", "files"]),
        "removed MCP server files\n"
    );
    let listed = json(&sb.ok(&["mcp", "list", "--format", "json"]));
    assert_eq!(listed["servers"].as_array().unwrap().len(), 1);
    sb.fails(&["mcp", "get", "files"], 4);
    sb.fails(&["mcp", "remove", "files"], 4);
}

#[test]
fn store_files_are_private() {
    let sb = Sandbox::new();
    sb.ok(&["mcp", "add", "a", "--stdio", "/bin/true"]);
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&sb.home()), 0o700);
    assert_eq!(mode(&sb.config()), 0o600);
}

#[test]
fn a_malformed_config_exits_3_and_stays_byte_for_byte() {
    let sb = Sandbox::new();
    sb.ok(&["mcp", "add", "a", "--stdio", "/bin/true"]);
    let cases: &[&[u8]] = &[
        b"{\"schema_version\": 2, \"mcp_servers\": [}\n",
        b"{\"schema_version\": 2, \"schema_version\": 2}",
        b"{\"schema_version\": 1, \"mcp_servers\": []}",
        b"{\"schema_version\": 2, \"mcp_servers\": [{\"name\": \"a\", \"command\": \"/x\", \"extra\": 1}]}",
        b"\xff\xfe",
    ];
    for broken in cases {
        fs::write(sb.config(), broken).unwrap();
        for args in [
            &["mcp", "list"][..],
            &["mcp", "list", "--format", "json"],
            &["mcp", "get", "a"],
            &["mcp", "remove", "a"],
            &["mcp", "add", "b", "--stdio", "/bin/true"],
        ] {
            let err = sb.fails(args, 3);
            assert!(err.contains("line "), "error names a position: {err}");
            assert_eq!(&fs::read(sb.config()).unwrap(), broken);
        }
    }
    fs::write(sb.config(), cases[2]).unwrap();
    let err = sb.fails(&["mcp", "list"], 3);
    assert!(
        err.contains("unsupported schema_version 1; this iteron reads schema_version 2"),
        "{err}"
    );
    fs::write(sb.config(), cases[3]).unwrap();
    let err = sb.fails(&["mcp", "list"], 3);
    assert!(
        err.contains("$.mcp_servers[0].extra (line 1, column "),
        "{err}"
    );
    iteron_test_support::record!("P6", serde_json::json!({}),);
}

#[test]
fn twenty_concurrent_adds_lose_no_update() {
    let sb = Sandbox::new();
    let children: Vec<_> = (0..20)
        .map(|i| {
            sb.command(&["mcp", "add", &format!("s{i:02}"), "--stdio", "/bin/true"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let listed = json(&sb.ok(&["mcp", "list", "--format", "json"]));
    let mut names: Vec<String> = listed["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    let want: Vec<String> = (0..20).map(|i| format!("s{i:02}")).collect();
    assert_eq!(names, want);
    let leftovers: Vec<_> = fs::read_dir(sb.home())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "config.json" && n != "config.lock")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    iteron_test_support::record!("P6", serde_json::json!({}),);
}

#[test]
fn env_takes_names_and_values_are_refused_without_echo() {
    let sb = Sandbox::new();
    let err = sb.fails(
        &[
            "mcp",
            "add",
            "a",
            "--stdio",
            "/bin/true",
            "--env",
            &format!("FOO={CANARY}"),
        ],
        2,
    );
    assert!(
        err.contains("--env takes a variable name, not NAME=value: write --env FOO"),
        "{err}"
    );
    sb.fails(
        &[
            "mcp",
            "add",
            "a",
            "--stdio",
            "/bin/true",
            "--env",
            "FOO=bar",
        ],
        2,
    );
    assert!(!sb.config().exists(), "a refused add writes nothing");
    sb.fails(
        &["mcp", "add", "a", "--stdio", "/bin/true", "--env", "1BAD"],
        2,
    );
    sb.fails(
        &[
            "mcp",
            "add",
            "a",
            "--url",
            "https://a.example/",
            "--header-env",
            &format!("x-api-key={CANARY}-value"),
        ],
        2,
    );
    sb.fails(
        &[
            "mcp",
            "add",
            "a",
            "--url",
            "https://a.example/",
            "--oauth-client-secret-env",
            &format!("S={CANARY}"),
        ],
        2,
    );
    // A value that happens to fit the variable-name grammar cannot be told from a name: it is
    // stored as the name the operator gave (docs/cli.md says so). Anything else is refused.
    sb.fails(
        &[
            "mcp",
            "add",
            "a",
            "--url",
            "https://a.example/",
            "--oauth-client-secret-env",
            &format!("{CANARY} x"),
        ],
        2,
    );
}

#[test]
fn add_writes_every_noninteractive_oauth_key_and_refuses_what_cannot_work_at_its_key() {
    let sb = Sandbox::new();
    let key = sb.root.join("client.pem");
    let key_s = key.to_str().unwrap().to_owned();
    let token = sb.root.join("token.jwt");
    let token_s = token.to_str().unwrap().to_owned();
    // Each noninteractive kind, written through flags, comes back as the keys the file holds.
    let cases: Vec<(&str, Vec<&str>, serde_json::Value)> = vec![
        (
            "cc",
            vec![
                "--oauth-grant",
                "client_credentials",
                "--oauth-issuer",
                "https://as.example",
                "--oauth-client-id",
                "ci",
                "--oauth-token-endpoint-auth",
                "private_key_jwt",
                "--oauth-client-key-file",
                &key_s,
                "--oauth-dpop",
            ],
            serde_json::json!({"grant": "client_credentials", "issuer": "https://as.example",
                "client_id": "ci", "token_endpoint_auth": "private_key_jwt",
                "client_key_file": key_s, "dpop": true}),
        ),
        (
            "cc-env",
            vec![
                "--oauth-grant",
                "client_credentials",
                "--oauth-issuer",
                "https://as.example",
                "--oauth-client-id",
                "ci",
                "--oauth-client-key-env",
                "CI_KEY",
            ],
            serde_json::json!({"grant": "client_credentials", "client_key_env": "CI_KEY"}),
        ),
        (
            "wif",
            vec![
                "--oauth-grant",
                "jwt_bearer",
                "--oauth-issuer",
                "https://as.example",
                "--oauth-identity-token-file",
                &token_s,
            ],
            serde_json::json!({"grant": "jwt_bearer", "identity_token_file": token_s}),
        ),
        (
            "wif-env",
            vec![
                "--oauth-grant",
                "jwt_bearer",
                "--oauth-issuer",
                "https://as.example",
                "--oauth-identity-token-env",
                "CI_ID_TOKEN",
            ],
            serde_json::json!({"grant": "jwt_bearer", "identity_token_env": "CI_ID_TOKEN"}),
        ),
        (
            "jag",
            vec![
                "--oauth-grant",
                "id_jag",
                "--oauth-issuer",
                "https://as.example",
                "--oauth-client-id",
                "c",
                "--oauth-identity-token-env",
                "ID_TOKEN",
                "--oauth-idp-issuer",
                "https://idp.example",
                "--oauth-idp-client-id",
                "i",
                "--oauth-idp-client-secret-env",
                "IDP_SECRET",
            ],
            serde_json::json!({"grant": "id_jag", "idp_issuer": "https://idp.example",
                "idp_client_id": "i", "idp_client_secret_env": "IDP_SECRET"}),
        ),
        (
            "ext",
            vec![
                "--oauth-access-token-env",
                "T",
                "--oauth-expires-at-env",
                "E",
                "--oauth-refresh-url",
                "https://as.example/token",
                "--oauth-refresh-token-env",
                "R",
                "--oauth-revoke-url",
                "https://as.example/revoke",
                "--oauth-client-id",
                "c",
            ],
            serde_json::json!({"access_token_env": "T", "expires_at_env": "E",
                "refresh_url": "https://as.example/token", "refresh_token_env": "R",
                "revoke_url": "https://as.example/revoke", "client_id": "c"}),
        ),
    ];
    for (name, flags, want) in &cases {
        let mut args = vec!["mcp", "add", name, "--url", "https://mcp.example/mcp"];
        args.extend(flags.iter().copied());
        sb.ok(&args);
        let got = json(&sb.ok(&["mcp", "get", name, "--format", "json"]));
        let oauth = &got["oauth"];
        for (k, v) in want.as_object().unwrap() {
            assert_eq!(&oauth[k], v, "{name}: {k} in {got}");
        }
    }
    let on_disk = json(&fs::read_to_string(sb.config()).unwrap());
    assert_eq!(
        on_disk["mcp_servers"].as_array().unwrap().len(),
        cases.len()
    );
    // What cannot work is refused at its key, one line, nothing written.
    let before = fs::read(sb.config()).unwrap();
    let refused: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--oauth-grant", "client_credentials"], "oauth.grant"),
        (vec!["--oauth-grant", "password"], "--oauth-grant must be"),
        (
            vec!["--oauth-token-endpoint-auth", "tls_client_auth"],
            "--oauth-token-endpoint-auth must be",
        ),
        (
            vec!["--oauth-client-key-file", "relative.pem"],
            "--oauth-client-key-file",
        ),
        (
            vec!["--oauth-refresh-url", "http://as.example/token"],
            "--oauth-refresh-url",
        ),
        (
            vec![
                "--oauth-grant",
                "jwt_bearer",
                "--oauth-issuer",
                "https://as.example",
            ],
            "identity",
        ),
        (vec!["--oauth-expires-at-env", "E"], "oauth."),
    ];
    for (flags, says) in &refused {
        let mut args = vec!["mcp", "add", "bad", "--url", "https://mcp.example/mcp"];
        args.extend(flags.iter().copied());
        let err = sb.fails(&args, 2);
        assert!(err.contains(says), "{flags:?}: {err}");
    }
    // A value given where a variable's name belongs is refused without echo.
    let err = sb.fails(
        &[
            "mcp",
            "add",
            "bad",
            "--url",
            "https://mcp.example/mcp",
            "--oauth-grant",
            "jwt_bearer",
            "--oauth-issuer",
            "https://as.example",
            "--oauth-identity-token-env",
            &format!("ID={CANARY}"),
        ],
        2,
    );
    assert!(err.contains("--oauth-identity-token-env"), "{err}");
    // The stdio transport refuses them all.
    let err = sb.fails(
        &["mcp", "add", "s", "--stdio", "/bin/true", "--oauth-dpop"],
        2,
    );
    assert!(
        err.contains("--oauth-dpop cannot be used with --stdio"),
        "{err}"
    );
    assert_eq!(
        fs::read(sb.config()).unwrap(),
        before,
        "a refused add changed the file"
    );
}

#[test]
fn a_canary_secret_never_appears_in_any_output_or_file() {
    let sb = Sandbox::new();
    // The canary is in the environment of every run (ITERON_TEST_SECRET) and the server names
    // that variable; it must reach no output and no file.
    sb.ok(&[
        "mcp",
        "add",
        "s",
        "--stdio",
        "/bin/true",
        "--env",
        "ITERON_TEST_SECRET",
    ]);
    sb.ok(&[
        "mcp",
        "add",
        "h",
        "--url",
        "https://a.example/mcp",
        "--header-env",
        "authorization=ITERON_TEST_SECRET",
        "--oauth-client-secret-env",
        "ITERON_TEST_SECRET",
    ]);
    for args in [
        &["mcp", "list"][..],
        &["mcp", "list", "--format", "json"],
        &["mcp", "get", "s"],
        &["mcp", "get", "s", "--format", "json"],
        &["mcp", "get", "h"],
        &["mcp", "get", "h", "--format", "json"],
        &["mcp", "remove", "s"],
        &["demo"],
    ] {
        sb.ok(args);
    }
    // Values pasted where they do not belong are refused without echo (checked in run()).
    sb.fails(
        &[
            "mcp",
            "add",
            "u",
            "--url",
            &format!("https://user:{CANARY}@a.example/"),
        ],
        2,
    );
    sb.fails(
        &[
            "mcp",
            "add",
            "q",
            "--url",
            &format!("https://a.example/mcp#{CANARY}"),
        ],
        2,
    );
    sb.fails(&["mcp", "get", CANARY], 4);
    sb.fails(&["mcp", "remove", CANARY], 4);
    sb.fails(&["mcp", "add", "z", "--bogus", CANARY], 2);
    sb.fails(&["mcp", "add", "z", &format!("--bogus={CANARY}")], 2);
    sb.fails(&[CANARY], 2);
    sb.fails(&["mcp", CANARY], 2);
    sb.fails(&["mcp", "list", "--format", CANARY], 2);
    // The classic mistake: the variable expanded instead of named.
    let err = sb.fails(
        &[
            "mcp",
            "add",
            "x",
            "--stdio",
            "/bin/true",
            "--env",
            "API_KEY",
            CANARY,
        ],
        2,
    );
    assert!(err.contains("unexpected extra argument"), "{err}");
    // A secret pasted into a stdio argument or a URL is stored (the operator typed it) but
    // hidden from every listing, and the operator is warned.
    let out = sb.run(&[
        "mcp",
        "add",
        "pasted",
        "--stdio",
        "/bin/true",
        "--",
        &format!("--token={CANARY}"),
        "--api-key",
        CANARY,
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("looks like a credential"));
    let out = sb.run(&[
        "mcp",
        "add",
        "pasted-url",
        "--url",
        &format!("https://a.example/mcp?api_key={CANARY}"),
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("looks like a credential"));
    for args in [
        &["mcp", "list"][..],
        &["mcp", "list", "--format", "json"],
        &["mcp", "get", "pasted"],
        &["mcp", "get", "pasted", "--format", "json"],
        &["mcp", "get", "pasted-url"],
        &["mcp", "get", "pasted-url", "--format", "json"],
    ] {
        sb.ok(args);
    }
    let config = fs::read_to_string(sb.config()).unwrap();
    assert_eq!(
        config.matches("CANARY").count(),
        3,
        "only what the operator typed"
    );
    sb.ok(&["mcp", "remove", "pasted"]);
    sb.ok(&["mcp", "remove", "pasted-url"]);
    assert!(!fs::read_to_string(sb.config()).unwrap().contains("CANARY"));
    iteron_test_support::record!("P1", serde_json::json!({}),);
}

#[test]
fn an_open_config_is_refused_not_repaired() {
    let sb = Sandbox::new();
    sb.ok(&["mcp", "add", "a", "--stdio", "/bin/true"]);
    let before = fs::read(sb.config()).unwrap();
    for mode in [0o640, 0o604, 0o660] {
        fs::set_permissions(sb.config(), fs::Permissions::from_mode(mode)).unwrap();
        let err = sb.fails(&["mcp", "list"], 5);
        assert!(
            err.contains(&format!("mode 0{mode:o}")) && err.contains("chmod 600"),
            "{err}"
        );
        sb.fails(&["mcp", "add", "b", "--stdio", "/bin/true"], 5);
        let meta = fs::metadata(sb.config()).unwrap();
        assert_eq!(
            meta.permissions().mode() & 0o777,
            mode,
            "mode left as found"
        );
        assert_eq!(fs::read(sb.config()).unwrap(), before);
    }
    fs::set_permissions(sb.config(), fs::Permissions::from_mode(0o600)).unwrap();
    fs::set_permissions(sb.home(), fs::Permissions::from_mode(0o755)).unwrap();
    let err = sb.fails(&["mcp", "list"], 5);
    assert!(err.contains("chmod 700"), "{err}");
    fs::set_permissions(sb.home(), fs::Permissions::from_mode(0o700)).unwrap();
    sb.ok(&["mcp", "list"]);
}

/// A second name for config.json (a hard link, which survives the atomic rename and may sit
/// where others can reach it) is refused like a symlink, exit 5, and nothing is written.
#[test]
fn a_hard_linked_config_is_refused_like_a_symlink() {
    use std::os::unix::fs::MetadataExt;
    let sb = Sandbox::new();
    sb.ok(&["mcp", "add", "a", "--stdio", "/bin/true"]);
    let before = fs::read(sb.config()).unwrap();
    let other = sb.home().join("second-name");
    fs::hard_link(sb.config(), &other).unwrap();
    let err = sb.fails(&["mcp", "list"], 5);
    assert!(err.contains("has 2 hard links"), "{err}");
    sb.fails(&["mcp", "add", "b", "--stdio", "/bin/true"], 5);
    assert_eq!(fs::read(sb.config()).unwrap(), before);
    assert_eq!(
        fs::metadata(sb.config()).unwrap().nlink(),
        2,
        "left as found"
    );
    fs::remove_file(&other).unwrap();
    sb.ok(&["mcp", "list"]);
    iteron_test_support::record!("P11", serde_json::json!({"exit": 5}),);
}

#[test]
fn conflicts_and_bad_values_have_their_exit_codes() {
    let sb = Sandbox::new();
    sb.ok(&["mcp", "add", "GitHub", "--stdio", "gh-mcp"]);
    let err = sb.fails(&["mcp", "add", "github", "--stdio", "/bin/true"], 6);
    assert!(err.contains("GitHub already exists"), "{err}");
    for (args, needle) in [
        (
            &["mcp", "add", "a b", "--stdio", "/bin/true"][..],
            "server name",
        ),
        (&["mcp", "add", "a", "--stdio", "./relative"], "--stdio"),
        (
            &["mcp", "add", "a", "--url", "http://example.com/"],
            "loopback",
        ),
        (&["mcp", "add", "a", "--url", "ftp://example.com/"], "--url"),
        (
            &[
                "mcp",
                "add",
                "a",
                "--stdio",
                "/bin/true",
                "--oauth-issuer",
                "https://a.example",
            ],
            "cannot be used with --stdio",
        ),
        (
            &[
                "mcp",
                "add",
                "a",
                "--url",
                "https://a.example/",
                "--env",
                "X",
            ],
            "cannot be used with --url",
        ),
        (
            &[
                "mcp",
                "add",
                "a",
                "--url",
                "https://a.example/",
                "--",
                "arg",
            ],
            "cannot be used with --url",
        ),
        (&["mcp", "add", "a"], "required"),
        (
            &[
                "mcp",
                "add",
                "a",
                "--url",
                "https://a.example/",
                "--stdio",
                "/bin/true",
            ],
            "cannot be used",
        ),
        (
            &["mcp", "list", "--format", "yaml"],
            "invalid value for --format <FORMAT> (expected one of: text, json)",
        ),
        (
            &[
                "mcp",
                "add",
                "a",
                "--stdio",
                "/bin/true",
                "--",
                "\u{202e}evil",
            ],
            "bidirectional",
        ),
    ] {
        let err = sb.fails(args, 2);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // http to loopback is accepted.
    sb.ok(&["mcp", "add", "local", "--url", "http://127.0.0.1:8080/mcp"]);
    let err = sb.fails(&[], 2);
    assert!(err.contains("missing command"), "{err}");
    let err = sb.fails(&["mcp", "add", "x"], 2);
    assert!(
        err.contains("missing required argument: --url <URL>|--stdio <COMMAND>")
            || err.contains("missing required argument"),
        "{err}"
    );
    let err = sb.fails(
        &["mcp", "add", "x", "--stdio", "/usr/bin/env TOKEN=1 srv"],
        2,
    );
    assert!(err.contains("without spaces"), "{err}");
}

#[test]
fn command_line_bounds_are_checked_before_anything_is_written() {
    let sb = Sandbox::new();
    let many: Vec<String> = (0..257).map(|i| format!("a{i}")).collect();
    let mut args = vec!["mcp", "add", "big", "--stdio", "/bin/true", "--"];
    args.extend(many.iter().map(String::as_str));
    let err = sb.fails(&args, 2);
    assert!(err.contains("args more than 256 entries"), "{err}");
    let envs: Vec<String> = (0..129).map(|i| format!("E{i}")).collect();
    let mut args = vec!["mcp", "add", "big", "--stdio", "/bin/true"];
    for e in &envs {
        args.push("--env");
        args.push(e);
    }
    let err = sb.fails(&args, 2);
    assert!(err.contains("env more than 128 entries"), "{err}");
    let scopes = (0..65)
        .map(|i| format!("s{i}"))
        .collect::<Vec<_>>()
        .join(",");
    sb.fails(
        &[
            "mcp",
            "add",
            "big",
            "--url",
            "https://a.example/",
            "--oauth-scopes",
            &scopes,
        ],
        2,
    );
    assert!(!sb.home().exists(), "a refused add creates nothing");
}

#[test]
fn a_keyring_server_without_a_reachable_keyring_fails_before_any_request() {
    let sb = Sandbox::new();
    // A port nothing listens on: a request would fail with another message.
    sb.ok(&[
        "mcp",
        "add",
        "kr",
        "--url",
        "http://127.0.0.1:9/mcp",
        "--oauth-credential-store",
        "keyring",
    ]);
    let got = json(&sb.ok(&["mcp", "get", "kr", "--format", "json"]));
    assert_eq!(got["oauth"]["credential_store"], "keyring", "{got}");
    let no_bus = sb.root.join("no-bus");
    fs::create_dir_all(&no_bus).unwrap();
    let out = sb
        .command(&["mcp", "auth", "login", "kr", "--no-browser"])
        .env("XDG_RUNTIME_DIR", &no_bus)
        .env(
            "DBUS_SESSION_BUS_ADDRESS",
            format!("unix:path={}", no_bus.join("bus").display()),
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(8), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no keyring is reachable"), "{err}");
    assert!(err.contains("nothing falls back to a file"), "{err}");
    assert!(!sb.home().join("mcp-credentials").exists());
    // A bad word is a usage error and writes nothing.
    let e = sb.fails(
        &[
            "mcp",
            "add",
            "kr2",
            "--url",
            "https://a.example/mcp",
            "--oauth-credential-store",
            "auto",
        ],
        2,
    );
    assert!(e.contains("file or keyring"), "{e}");
    let e = sb.fails(
        &[
            "mcp",
            "add",
            "kr3",
            "--oauth-credential-store",
            "file",
            "--stdio",
            "/bin/true",
        ],
        2,
    );
    assert!(
        e.contains("--oauth-credential-store cannot be used with --stdio"),
        "{e}"
    );
}

#[test]
fn demo_runs_in_a_throwaway_home_and_never_touches_the_real_one() {
    let sb = Sandbox::new();
    let mut c = sb.command(&["demo"]);
    c.env_remove("ITERON_HOME");
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "$ iteron mcp add demo-echo",
        "added stdio MCP server demo-echo",
        "demo-echo    stdio",
        "--env takes a variable name, not NAME=value",
        "removed MCP server demo-remote",
        "$ iteron agent --socket",
        "demo-echo/echo  [refused_noninteractive]  Return the given text.",
        "unknown_tool: unknown tool",
        "approval_required",
        "[1] call demo-echo/echo from uid ",
        "approved 1",
        "hello, approved",
        "audit log verified:",
        "~/.iteron was not touched",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    assert!(
        !text.contains("sk-demo-not-a-real-token"),
        "the refused value is not echoed"
    );
    // The value the demo's broker forwards to its server never reaches the agent or the output.
    assert!(!text.contains("sk-demo-forwarded-token"));
    assert!(
        !text.contains("delete_all ran"),
        "the denied tool never ran"
    );
    assert!(!sb.root.join("user").join(".iteron").exists());
    assert!(!sb.home().exists());
    let demo_home = text
        .lines()
        .next()
        .and_then(|l| l.split("ITERON_HOME=").nth(1))
        .unwrap();
    assert!(!Path::new(demo_home).exists(), "demo home removed");
    // Issue 14.14: the fixture server is the binary's own copy, written into the throwaway
    // directory: an installed binary needs no source tree.
    let demo_dir = Path::new(demo_home).parent().unwrap();
    let registered = text
        .lines()
        .find(|l| l.starts_with("$ iteron mcp add demo-echo"))
        .and_then(|l| l.split(" -- ").nth(1))
        .unwrap();
    assert_eq!(
        Path::new(registered),
        demo_dir.join("fixture").join("demo_server.py"),
        "{text}"
    );
    iteron_test_support::record!("P1", serde_json::json!({}),);
}

#[test]
fn add_refuses_urls_that_are_never_a_destination_and_so_does_the_loader() {
    let sb = Sandbox::new();
    sb.ok(&["mcp", "add", "keep", "--stdio", "/bin/true"]);
    let before = fs::read(sb.config()).unwrap();
    let bad = [
        ("https://224.0.0.1/mcp", "224.0.0.1 is a multicast address"),
        ("https://[ff02::1]/mcp", "[ff02::1] is a multicast address"),
        (
            "https://198.51.100.4/mcp",
            "198.51.100.4 is a documentation-only address",
        ),
        (
            "https://[2001:db8::7]/mcp",
            "[2001:db8::7] is a documentation-only address",
        ),
        ("https://0.0.0.0/mcp", "unspecified address"),
        ("https://[::]:8443/mcp", "unspecified address"),
        ("https://mcp.example:0/mcp", "port is 0"),
        ("http://127.0.0.1:0/mcp", "port is 0"),
    ];
    let mut refused = 0;
    for (u, rule) in bad {
        // The server URL, and each OAuth URL given on the command line.
        for flags in [
            vec!["--url", u],
            vec!["--url", "https://mcp.example/mcp", "--oauth-issuer", u],
            vec!["--url", "https://mcp.example/mcp", "--oauth-resource", u],
            vec!["--url", "https://mcp.example/mcp", "--oauth-client-id", u],
        ] {
            let mut args = vec!["mcp", "add", "srv"];
            args.extend(flags.iter().copied());
            let err = sb.fails(&args, 2);
            assert!(err.contains(rule), "{args:?}: {err}");
            assert!(
                err.contains(flags[flags.len() - 2]),
                "names the flag: {err}"
            );
            assert_eq!(fs::read(sb.config()).unwrap(), before, "{args:?}");
            refused += 1;
        }
    }
    // The loader refuses them too: a file edited by hand exits 3 and stays as it is.
    for (u, rule) in bad {
        let doc = format!(
            r#"{{"schema_version": 2, "mcp_servers": [{{"name": "srv", "transport": "http", "url": "{u}"}}]}}"#
        );
        fs::write(sb.config(), &doc).unwrap();
        let err = sb.fails(&["mcp", "list"], 3);
        assert!(
            err.contains("$.mcp_servers[0].url") && err.contains(rule),
            "{err}"
        );
        assert_eq!(fs::read_to_string(sb.config()).unwrap(), doc);
    }
    iteron_test_support::record!(
        "P12",
        serde_json::json!({"refused_adds": refused, "refused_files": bad.len()}),
    );
}

/// Issue 14.6: a bearer token the operator supplies with `--header-env Authorization=VAR` is
/// Iteron's to forward, not to hold: `auth status`, `mcp status` and `doctor` call the
/// credential `external` (naming the variable, never its value), like `oauth.access_token_env`.
#[test]
fn a_bearer_from_header_env_authorization_shows_as_external() {
    let sb = Sandbox::new();
    sb.ok(&[
        "mcp",
        "add",
        "bearer",
        "--url",
        "https://mcp.example/mcp",
        "--header-env",
        "Authorization=ITERON_TEST_SECRET",
    ]);
    sb.ok(&[
        "mcp",
        "add",
        "tenant",
        "--url",
        "https://mcp.example/mcp",
        "--header-env",
        "x-tenant=ITERON_TEST_SECRET",
    ]);
    let status = json(&sb.ok(&["mcp", "auth", "status", "bearer", "--format", "json"]));
    assert_eq!(status["state"], "external", "{status}");
    assert!(
        sb.ok(&["mcp", "auth", "status", "bearer"])
            .starts_with("bearer: external")
    );
    // Another header is not a bearer: that server is logged out.
    let other = json(&sb.ok(&["mcp", "auth", "status", "tenant", "--format", "json"]));
    assert_eq!(other["state"], "logged_out", "{other}");
    let listed = json(&sb.ok(&["mcp", "status", "--format", "json"]));
    assert_eq!(listed["servers"][0]["credential"], "external", "{listed}");
    assert_eq!(listed["servers"][1]["credential"], "logged_out", "{listed}");
    let out = sb.run(&["mcp", "doctor", "--format", "json"]);
    let doctor: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let credential = doctor["servers"][0]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "credential")
        .unwrap()
        .clone();
    assert_eq!(credential["ok"], true, "{credential}");
    assert_eq!(
        credential["detail"], "external (bearer token from $ITERON_TEST_SECRET)",
        "{credential}"
    );
}

/// Issue 14.21: shell completions and man pages come from the clap definitions: every command
/// has a page, every flag of a command is on its page and in the completions, and a command or
/// shell that does not exist is a usage error.
#[test]
fn completions_and_man_pages_are_generated_from_the_command_line_grammar() {
    let sb = Sandbox::new();
    let bash = sb.ok(&["completions", "bash"]);
    assert!(bash.contains("_iteron()"), "{bash}");
    let zsh = sb.ok(&["completions", "zsh"]);
    assert!(zsh.starts_with("#compdef iteron"), "{zsh}");
    let fish = sb.ok(&["completions", "fish"]);
    assert!(fish.contains("complete -c iteron"), "{fish}");
    sb.fails(&["completions", "cmd.exe"], 2);
    let top = sb.ok(&["man"]);
    assert!(top.contains(".TH iteron 1"), "{top}");
    for cmd in [
        "mcp",
        "demo",
        "broker",
        "approvals",
        "agent",
        "audit",
        "skills",
        "agents",
        "completions",
        "man",
    ] {
        assert!(top.contains(cmd), "iteron(1) lists {cmd}");
        let page = sb.ok(&["man", cmd]);
        assert!(
            page.contains(&format!(".TH iteron-{cmd} 1")),
            "{cmd}: {page}"
        );
    }
    let add = sb.ok(&["man", "mcp", "add"]);
    for flag in [
        "--stdio",
        "--url",
        "--env",
        "--header-env",
        "--sandbox-readable",
        "--sandbox-writable",
        "--sandbox-run-as",
        "--oauth-resource",
        "--oauth-scopes",
        "--oauth-client-registration",
        "--oauth-client-id",
        "--oauth-client-secret-env",
        "--oauth-issuer",
        "--oauth-credential-store",
    ] {
        let roff = flag.replace('-', "\\-");
        assert!(add.contains(&roff), "iteron-mcp-add(1) lacks {flag}");
        assert!(bash.contains(flag), "bash completion lacks {flag}");
    }
    let err = sb.fails(&["man", "mcp", "no-such-command"], 2);
    assert!(!err.contains("no-such-command"), "{err}");
}

/// Issue 14.22: `mcp import` reads Claude Code, Codex and Claude Desktop configurations. Every
/// value in them (env values, header values, bearer tokens) becomes a variable name to provide
/// and is never written or shown; what Iteron cannot express is refused with its reason; the
/// rest is written in one atomic update.
#[test]
fn import_turns_values_into_names_and_refuses_what_it_cannot_express() {
    let sb = Sandbox::new();
    sb.ok(&["mcp", "add", "keep", "--stdio", "/bin/true"]);
    // Every import's output names variables, never a value: not the canary, nor any part of
    // it long enough to be its random tail (`Sandbox::run` checks the prefix of every command).
    let tail = &CANARY["CANARY".len()..];
    let imported = |out: &Output| -> (String, String) {
        let (text, err) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        for shown in [&text, &err] {
            assert!(!shown.contains(CANARY), "a value was shown: {shown}");
            for n in 0..=tail.len() - 6 {
                let part = &tail[n..n + 6];
                assert!(
                    !shown.contains(part),
                    "part of a value ({part}) was shown: {shown}"
                );
            }
        }
        (text, err)
    };
    let claude = sb.root.join("mcp.json");
    fs::write(
        &claude,
        format!(
            r#"{{"mcpServers": {{
  "files": {{"command": "/usr/bin/python3", "args": ["/srv/server.py"],
             "env": {{"API_KEY": "{CANARY}-env", "HOME_DIR": "${{HOME_DIR}}", "OTHER": "${{SOMETHING}}"}}}},
  "remote": {{"type": "http", "url": "https://mcp.example.com/mcp",
              "headers": {{"Authorization": "Bearer {CANARY}-token", "X-Tenant": "${{TENANT}}",
                           "X-Api-Key": "{CANARY}-header"}}}},
  "legacy": {{"type": "sse", "url": "https://mcp.example.com/sse"}},
  "expands": {{"command": "npx", "args": ["${{PKG}}"]}},
  "bad name!": {{"command": "/bin/true"}},
  "odd": {{"command": "/bin/true", "timeout": 5}},
  "keep": {{"command": "/bin/true"}}
}}}}"#
        ),
    )
    .unwrap();
    let before = fs::read(sb.config()).unwrap();
    // --dry-run says the same and changes nothing.
    let out = sb.run(&[
        "mcp",
        "import",
        "--from",
        "claude",
        claude.to_str().unwrap(),
        "--dry-run",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let (text, _) = imported(&out);
    assert!(
        text.contains("would import stdio MCP server files"),
        "{text}"
    );
    assert_eq!(fs::read(sb.config()).unwrap(), before);

    let out = sb.run(&[
        "mcp",
        "import",
        "--from",
        "claude",
        claude.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "some entries were refused");
    let (text, err) = imported(&out);
    assert!(err.contains("5 of 7 entries refused"), "{err}");
    for needle in [
        "imported stdio MCP server files",
        "imported http MCP server remote",
        "refused legacy: the SSE transport",
        "refused expands: an argument uses ${…} expansion",
        "refused entry 5 (its name is not a valid server name)",
        "refused odd: unknown key timeout",
        "refused keep: an MCP server named keep already exists",
        "  API_KEY  for files (its env API_KEY held a value)",
        "  OTHER  for files (its env OTHER read ${SOMETHING})",
        "  REMOTE_TOKEN  for remote (its Authorization header held a token)",
        "  REMOTE_X_API_KEY  for remote (its header x-api-key held a value)",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    assert!(
        !text.contains("HOME_DIR  for"),
        "a ${{NAME}} of its own name needs nothing new"
    );
    let config = fs::read_to_string(sb.config()).unwrap();
    assert!(
        !config.contains("CANARY"),
        "a value reached the configuration"
    );
    assert_eq!(
        fs::metadata(sb.config()).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let files = json(&sb.ok(&["mcp", "get", "files", "--format", "json"]));
    assert_eq!(
        files["env"],
        serde_json::json!(["API_KEY", "HOME_DIR", "OTHER"])
    );
    assert_eq!(files["args"], serde_json::json!(["/srv/server.py"]));
    let remote = json(&sb.ok(&["mcp", "get", "remote", "--format", "json"]));
    assert_eq!(
        remote["header_env"],
        serde_json::json!({"x-api-key": "REMOTE_X_API_KEY", "x-tenant": "TENANT"})
    );
    assert_eq!(remote["oauth"]["access_token_env"], "REMOTE_TOKEN");
    assert_eq!(
        json(&sb.ok(&["mcp", "auth", "status", "remote", "--format", "json"]))["state"],
        "external"
    );

    // Codex's TOML.
    let codex = sb.root.join("config.toml");
    fs::write(
        &codex,
        format!(
            r#"model = "gpt"
[mcp_servers.gh]
command = "/usr/bin/gh-mcp"
args = ["serve"]
env = {{ GITHUB_TOKEN = "{CANARY}-gh" }}
env_vars = ["LANG_X"]
enabled_tools = ["search"]

[mcp_servers.docs]
url = "https://docs.example.com/mcp"
bearer_token_env_var = "DOCS_TOKEN"
http_headers = {{ "X-Org" = "{CANARY}-org" }}
env_http_headers = {{ "X-Team" = "TEAM_VAR" }}

[mcp_servers.off]
command = "/bin/true"
enabled = false

[mcp_servers.wd]
command = "/bin/true"
cwd = "/srv"
"#
        ),
    )
    .unwrap();
    let out = sb.run(&["mcp", "import", "--from", "codex", codex.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let (text, _) = imported(&out);
    for needle in [
        "imported stdio MCP server gh",
        "imported http MCP server docs",
        "refused off: disabled in the file",
        "refused wd: it sets a working directory",
        "  GITHUB_TOKEN  for gh (its env GITHUB_TOKEN held a value)",
        "  DOCS_X_ORG  for docs (its header x-org held a value)",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    let gh = json(&sb.ok(&["mcp", "get", "gh", "--format", "json"]));
    assert_eq!(gh["env"], serde_json::json!(["GITHUB_TOKEN", "LANG_X"]));
    assert_eq!(gh["tools"]["allow"], serde_json::json!(["search"]));
    let docs = json(&sb.ok(&["mcp", "get", "docs", "--format", "json"]));
    assert_eq!(docs["oauth"]["access_token_env"], "DOCS_TOKEN");
    assert_eq!(
        docs["header_env"],
        serde_json::json!({"x-org": "DOCS_X_ORG", "x-team": "TEAM_VAR"})
    );

    // Claude Desktop: stdio only; everything accepted exits 0.
    let desktop = sb.root.join("claude_desktop_config.json");
    fs::write(
        &desktop,
        format!(r#"{{"mcpServers": {{"desk": {{"command": "/bin/true", "env": {{"K": "{CANARY}"}}}}}}}}"#),
    )
    .unwrap();
    let out = sb.run(&[
        "mcp",
        "import",
        "--from",
        "claude-desktop",
        desktop.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (text, _) = imported(&out);
    assert!(text.contains("imported stdio MCP server desk"), "{text}");
    assert!(text.contains("  K  for desk"), "{text}");
    fs::write(
        &desktop,
        r#"{"mcpServers": {"web": {"url": "https://x.example/mcp"}}}"#,
    )
    .unwrap();
    let out = sb.run(&[
        "mcp",
        "import",
        "--from",
        "claude-desktop",
        desktop.to_str().unwrap(),
    ]);
    let (text, _) = imported(&out);
    assert!(text.contains("refused web: unknown key url"), "{text}");

    // A broken file: one line, by position, no value; nothing changes.
    let before = fs::read(sb.config()).unwrap();
    fs::write(
        &claude,
        format!(r#"{{"mcpServers": {{"a": {{"env": {{"K": "{CANARY}"#),
    )
    .unwrap();
    let broken = &[
        "mcp",
        "import",
        "--from",
        "claude",
        claude.to_str().unwrap(),
    ];
    let err = sb.fails(broken, 2);
    assert!(err.contains("is not valid JSON (line 1"), "{err}");
    imported(&sb.run(broken));
    fs::write(
        &codex,
        format!("[mcp_servers.a]\nenv = {{ K = \"{CANARY}\" \n"),
    )
    .unwrap();
    let broken = &["mcp", "import", "--from", "codex", codex.to_str().unwrap()];
    let err = sb.fails(broken, 2);
    assert!(err.contains("is not valid TOML"), "{err}");
    imported(&sb.run(broken));
    assert_eq!(fs::read(sb.config()).unwrap(), before);
    assert!(!fs::read_to_string(sb.config()).unwrap().contains("CANARY"));
}
