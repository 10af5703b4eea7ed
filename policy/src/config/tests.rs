use super::decode::{ROOT_KEYS, SERVER_KEYS};
use super::*;
use crate::capability::Capability;
use crate::egress::{EgressRuleError, MAX_EGRESS_RULES};
use crate::json::SyntaxError;
use crate::names::ToolName;
use proptest::prelude::*;

fn parse(s: &str) -> Result<Config, ConfigError> {
    Config::parse(s.as_bytes())
}

fn error(s: &str) -> ConfigError {
    parse(s).unwrap_err()
}

const STDIO_EXAMPLE: &str = r#"{
  "schema_version": 2,
  "mcp_servers": [
    {
      "name": "example",
      "command": "/absolute/path/to/operator-owned-server",
      "args": [],
      "tools": { "deny": ["delete_all"] },
      "policy": {
        "capabilities": ["irreversible_external"],
        "tools": { "risky_tool": [] }
      }
    }
  ]
}"#;

const HTTP_EXAMPLE: &str = r#"{
  "schema_version": 2,
  "mcp_servers": [
    {
      "name": "remote-example",
      "transport": "http",
      "url": "https://mcp.example.com/mcp",
      "header_env": { "x-tenant": "ITERON_MCP_TENANT" },
      "oauth": {
        "access_token_env": "ITERON_MCP_ACCESS_TOKEN",
        "expires_at_env": "ITERON_MCP_ACCESS_EXPIRES_AT",
        "refresh_url": "https://mcp.example.com/oauth/token",
        "refresh_token_env": "ITERON_MCP_REFRESH_TOKEN",
        "revoke_url": "https://mcp.example.com/oauth/revoke",
        "client_id": "iteron",
        "client_secret_env": "ITERON_MCP_CLIENT_SECRET"
      }
    }
  ]
}"#;

const HOOKS_EXAMPLE: &str = r#"{
  "schema_version": 2,
  "hooks": {
    "PreToolUse": ["/path/to/operator-owned-policy-check"]
  }
}"#;

#[test]
fn the_product_page_examples_parse() {
    let c = parse(STDIO_EXAMPLE).unwrap();
    let s = &c.mcp_servers[0];
    assert_eq!(s.name.as_str(), "example");
    assert!(matches!(s.transport, Transport::Stdio(_)));
    assert_eq!(s.tools.deny[0].as_str(), "delete_all");
    assert_eq!(
        s.policy.capabilities,
        Some(CapabilitySet::of(&[Capability::IrreversibleExternal]))
    );
    let c = parse(HTTP_EXAMPLE).unwrap();
    let Transport::Http(h) = &c.mcp_servers[0].transport else {
        panic!("http expected")
    };
    assert_eq!(h.url.as_str(), "https://mcp.example.com/mcp");
    let oauth = h.oauth.as_ref().unwrap();
    assert_eq!(oauth.client_id.as_ref().unwrap().as_str(), "iteron");
    let c = parse(HOOKS_EXAMPLE).unwrap();
    assert_eq!(c.hooks[&HookEvent::PreToolUse].len(), 1);
}

#[test]
fn examples_round_trip_through_the_canonical_form() {
    for doc in [STDIO_EXAMPLE, HTTP_EXAMPLE, HOOKS_EXAMPLE] {
        let c = parse(doc).unwrap();
        let again = parse(&c.to_json_pretty()).unwrap();
        assert_eq!(c, again);
    }
}

#[test]
fn canonical_form_writes_transport_and_schema_version_first() {
    let c = parse(STDIO_EXAMPLE).unwrap();
    let out = c.to_json_pretty();
    assert!(out.starts_with("{\n  \"schema_version\": 2,"), "{out}");
    assert!(out.contains("\"transport\": \"stdio\""));
    assert!(out.ends_with("}\n"));
}

#[test]
fn unsupported_schema_versions_are_named() {
    let e = error(r#"{"schema_version": 1, "servers": {}}"#);
    assert_eq!(e.kind, ConfigErrorKind::SchemaVersion { found: Some(1) });
    assert_eq!(
        e.to_string(),
        "$.schema_version (line 1, column 20): unsupported schema_version 1; \
         this iteron reads schema_version 2"
    );
    for doc in [
        r#"{"schema_version": "2"}"#,
        r#"{"schema_version": 2.0}"#,
        r#"{"schema_version": -2}"#,
        r#"{"mcp_servers": []}"#,
    ] {
        assert_eq!(
            error(doc).kind,
            ConfigErrorKind::SchemaVersion { found: None },
            "{doc}"
        );
    }
    assert_eq!(
        error(r#"{"schema_version": 3}"#).kind,
        ConfigErrorKind::SchemaVersion { found: Some(3) }
    );
}

#[test]
fn unknown_keys_are_errors_with_path_and_position() {
    let doc = "{\"schema_version\": 2, \"mcp_servers\": [\n {\"name\": \"a\", \"command\": \"/x\",\n  \"tols\": {}}]}";
    let e = error(doc);
    assert_eq!(e.path.to_string(), "$.mcp_servers[0].tols");
    assert_eq!(e.pos, Pos { line: 3, column: 3 });
    assert!(
        e.to_string()
            .contains("unknown key \"tols\" (allowed: name, transport")
    );
    let e = error(
        r#"{"schema_version": 2, "mcp_servers": [{"name": "a", "command": "/x", "policy": {"capabilites": []}}]}"#,
    );
    assert_eq!(e.path.to_string(), "$.mcp_servers[0].policy.capabilites");
}

#[test]
fn duplicate_json_keys_are_errors() {
    let e = error(
        r#"{"schema_version": 2, "mcp_servers": [{"name": "a", "name": "b", "command": "/x"}]}"#,
    );
    assert!(matches!(
        e.kind,
        ConfigErrorKind::Syntax(SyntaxError::DuplicateKey { .. })
    ));
    assert_eq!(e.path.to_string(), "$.mcp_servers[0].name");
    let e = error(r#"{"schema_version": 2, "schema_version": 2}"#);
    assert!(matches!(
        e.kind,
        ConfigErrorKind::Syntax(SyntaxError::DuplicateKey { .. })
    ));
    let e = error(
        r#"{"schema_version": 2, "mcp_servers": [{"name": "a", "transport": "http", "url": "https://a.example/", "header_env": {"X-A": "A", "x-a": "B"}}]}"#,
    );
    assert!(matches!(e.kind, ConfigErrorKind::Duplicate { .. }), "{e}");
}

#[test]
fn server_names_that_fold_alike_are_duplicates() {
    let e = error(
        r#"{"schema_version": 2, "mcp_servers": [
        {"name": "GitHub", "command": "/x"},
        {"name": "github", "command": "/y"}]}"#,
    );
    assert_eq!(e.path.to_string(), "$.mcp_servers[1].name");
    assert_eq!(
        e.kind,
        ConfigErrorKind::Duplicate {
            first: Pos {
                line: 2,
                column: 18
            }
        }
    );
}

#[test]
fn keys_of_the_other_transport_are_refused() {
    let e = error(
        r#"{"schema_version": 2, "mcp_servers": [{"name": "a", "url": "https://a.example/"}]}"#,
    );
    assert_eq!(
        e.kind,
        ConfigErrorKind::NotForTransport {
            key: "url",
            transport: "stdio"
        }
    );
    assert!(e.to_string().contains("set \"transport\": \"http\""));
    let e = error(
        r#"{"schema_version": 2, "mcp_servers": [{"name": "a", "transport": "http", "url": "https://a.example/", "env": ["X"]}]}"#,
    );
    assert_eq!(
        e.kind,
        ConfigErrorKind::NotForTransport {
            key: "env",
            transport: "http"
        }
    );
}

#[test]
fn value_rules_are_enforced() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"name": "a b", "command": "/x"}"#,
            "$.mcp_servers[0].name",
        ),
        (
            r#"{"name": "a", "command": "./x"}"#,
            "$.mcp_servers[0].command",
        ),
        (
            r#"{"name": "a", "command": "/x/../y"}"#,
            "$.mcp_servers[0].command",
        ),
        (
            r#"{"name": "a", "command": "/x", "env": ["A=b"]}"#,
            "$.mcp_servers[0].env[0]",
        ),
        (
            r#"{"name": "a", "command": "/x", "env": ["A", "A"]}"#,
            "$.mcp_servers[0].env[1]",
        ),
        (
            r#"{"name": "a", "command": "/x", "args": ["ok", "a\u0000b"]}"#,
            "$.mcp_servers[0].args[1]",
        ),
        (
            r#"{"name": "a", "command": "/x", "args": ["\u202e"]}"#,
            "$.mcp_servers[0].args[0]",
        ),
        (
            r#"{"name": "a", "transport": "http", "url": "http://example.com/mcp"}"#,
            "$.mcp_servers[0].url",
        ),
        (
            r#"{"name": "a", "transport": "http", "url": "https://u:p@example.com/"}"#,
            "$.mcp_servers[0].url",
        ),
        (
            r#"{"name": "a", "transport": "grpc"}"#,
            "$.mcp_servers[0].transport",
        ),
        (r#"{"name": "a", "transport": "http"}"#, "$.mcp_servers[0]"),
        (r#"{"command": "/x"}"#, "$.mcp_servers[0]"),
        (
            r#"{"name": "a", "command": "/x", "tools": {"allow": ["t"], "deny": ["t"]}}"#,
            "$.mcp_servers[0].tools.deny[0]",
        ),
        (
            r#"{"name": "a", "command": "/x", "policy": {"capabilities": ["root"]}}"#,
            "$.mcp_servers[0].policy.capabilities[0]",
        ),
        (
            r#"{"name": "a", "command": "/x", "policy": {"capabilities": ["process", "process"]}}"#,
            "$.mcp_servers[0].policy.capabilities[1]",
        ),
        (
            r#"{"name": "a", "command": "/x", "policy": {"tools": {"bad name": []}}}"#,
            "$.mcp_servers[0].policy.tools[\"bad name\"]",
        ),
        (
            r#"{"name": "a", "transport": "http", "url": "https://a.example/", "header_env": {"Host": "H"}}"#,
            "$.mcp_servers[0].header_env.Host",
        ),
        (
            r#"{"name": "a", "transport": "http", "url": "https://a.example/", "oauth": {"scopes": ["a b"]}}"#,
            "$.mcp_servers[0].oauth.scopes[0]",
        ),
        (
            r#"{"name": "a", "transport": "http", "url": "https://a.example/", "oauth": {"client_registration": "magic"}}"#,
            "$.mcp_servers[0].oauth.client_registration",
        ),
        (
            r#"{"name": "a", "transport": "http", "url": "https://a.example/", "oauth": {"credential_store": "Keyring"}}"#,
            "$.mcp_servers[0].oauth.credential_store",
        ),
        (
            r#"{"name": "a", "transport": "http", "url": "https://a.example/", "oauth": {"credential_store": "auto"}}"#,
            "$.mcp_servers[0].oauth.credential_store",
        ),
        (
            r#"{"name": "a", "transport": "http", "url": "https://a.example/", "oauth": {"client_id": "http://evil.example/cimd"}}"#,
            "$.mcp_servers[0].oauth.client_id",
        ),
        (r#"{"name": "a", "command": 7}"#, "$.mcp_servers[0].command"),
    ];
    for (server, path) in cases {
        let doc = format!(r#"{{"schema_version": 2, "mcp_servers": [{server}]}}"#);
        let e = error(&doc);
        assert_eq!(e.path.to_string(), *path, "{server}: {e}");
        assert!(!e.to_string().contains('\n'));
    }
}

#[test]
fn credential_store_is_file_or_keyring_and_round_trips() {
    for (word, want) in [
        ("file", CredentialBackend::File),
        ("keyring", CredentialBackend::Keyring),
    ] {
        let doc = format!(
            r#"{{"schema_version": 2, "mcp_servers": [{{"name": "a", "transport": "http", "url": "https://a.example/", "oauth": {{"credential_store": "{word}"}}}}]}}"#
        );
        let c = parse(&doc).unwrap();
        let Transport::Http(h) = &c.mcp_servers[0].transport else {
            panic!("not http");
        };
        assert_eq!(h.oauth.as_ref().unwrap().credential_store, Some(want));
        assert_eq!(want.as_str(), word);
        assert_eq!(Config::parse(c.to_json_pretty().as_bytes()).unwrap(), c);
    }
    let e = error(
        r#"{"schema_version": 2, "mcp_servers": [{"name": "a", "transport": "http", "url": "https://a.example/", "oauth": {"credential_store": "auto"}}]}"#,
    );
    assert!(e.to_string().contains("file, keyring"), "{e}");
}

#[test]
fn hooks_accept_only_known_events_and_absolute_commands() {
    let e = error(r#"{"schema_version": 2, "hooks": {"PreToolUse": ["relative/check"]}}"#);
    assert_eq!(e.path.to_string(), "$.hooks.PreToolUse[0]");
    let e = error(r#"{"schema_version": 2, "hooks": {"preToolUse": ["/x"]}}"#);
    assert!(matches!(e.kind, ConfigErrorKind::UnknownKey { .. }));
}

#[test]
fn bounds_are_enforced_one_over() {
    let args = |n: usize| {
        let list: Vec<String> = (0..n).map(|i| format!("\"a{i}\"")).collect();
        format!(
            r#"{{"schema_version": 2, "mcp_servers": [{{"name": "a", "command": "/x", "args": [{}]}}]}}"#,
            list.join(",")
        )
    };
    parse(&args(MAX_ARGS)).unwrap();
    assert_eq!(
        error(&args(MAX_ARGS + 1)).kind,
        ConfigErrorKind::TooMany { max: MAX_ARGS }
    );
    let arg = |n: usize| {
        format!(
            r#"{{"schema_version": 2, "mcp_servers": [{{"name": "a", "command": "/x", "args": ["{}"]}}]}}"#,
            "x".repeat(n)
        )
    };
    parse(&arg(MAX_STRING_BYTES)).unwrap();
    assert_eq!(
        error(&arg(MAX_STRING_BYTES + 1)).kind,
        ConfigErrorKind::Value(ValueError::TooLong {
            max: MAX_STRING_BYTES
        })
    );
    let servers = |n: usize| {
        let list: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"name": "s{i}", "command": "/x"}}"#))
            .collect();
        format!(
            r#"{{"schema_version": 2, "mcp_servers": [{}]}}"#,
            list.join(",")
        )
    };
    assert_eq!(
        parse(&servers(MAX_SERVERS)).unwrap().mcp_servers.len(),
        MAX_SERVERS
    );
    assert_eq!(
        error(&servers(MAX_SERVERS + 1)).kind,
        ConfigErrorKind::TooMany { max: MAX_SERVERS }
    );
    let padded = |n: usize| {
        let doc = r#"{"schema_version": 2}"#;
        format!("{doc}{}", " ".repeat(n - doc.len()))
    };
    parse(&padded(MAX_CONFIG_BYTES)).unwrap();
    assert_eq!(
        error(&padded(MAX_CONFIG_BYTES + 1)).kind,
        ConfigErrorKind::TooLarge
    );
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

#[test]
fn errors_never_quote_values() {
    let canary = "sk-live-CANARY0123456789abcdef";
    let docs = [
        format!(
            r#"{{"schema_version": 2, "mcp_servers": [{{"name": "a", "command": "/x", "args": "{canary}"}}]}}"#
        ),
        format!(
            r#"{{"schema_version": 2, "mcp_servers": [{{"name": "a", "command": "/x", "env": ["TOKEN={canary}"]}}]}}"#
        ),
        format!(
            r#"{{"schema_version": 2, "mcp_servers": [{{"name": "a", "transport": "http", "url": "https://x:{canary}@a.example/"}}]}}"#
        ),
        format!(
            r#"{{"schema_version": 2, "mcp_servers": [{{"name": "{canary}!", "command": "/x"}}]}}"#
        ),
        format!(r#"{{"schema_version": "{canary}"}}"#),
        format!(
            r#"{{"schema_version": 2, "mcp_servers": [{{"name": "a", "transport": "http", "url": "https://a.example/", "header_env": {{"x-a": "{canary}"}}}}]}}"#
        ),
    ];
    for doc in docs {
        let e = error(&doc).to_string();
        assert!(!e.contains("CANARY"), "{e}");
    }
}

#[test]
fn add_and_remove_respect_folded_names() {
    let mut c = parse(STDIO_EXAMPLE).unwrap();
    let mut dup = c.mcp_servers[0].clone();
    dup.name = ServerName::parse("EXAMPLE").unwrap();
    assert!(matches!(c.add_server(dup), Err(AddError::Exists(_))));
    assert!(c.remove_server("EXAMPLE").is_none());
    assert!(c.remove_server("example").is_some());
    assert!(c.mcp_servers.is_empty());
}

// ---- property tests -------------------------------------------------------------------------

fn arb_server(index: usize) -> impl Strategy<Value = ServerConfig> {
    let name = "[a-z][a-z0-9._-]{0,12}"
        .prop_map(move |s| ServerName::parse(&format!("{s}{index}")).unwrap());
    let env = prop::collection::btree_set("[A-Z_][A-Z0-9_]{0,10}", 0..4).prop_map(|s| {
        s.into_iter()
            .map(|n| EnvName::parse(&n).unwrap())
            .collect::<Vec<_>>()
    });
    let arg = prop_oneof!["[ -~]{0,24}", "[a-zé日本 ]{0,8}"];
    let stdio = (
        prop_oneof!["/[a-z]{1,8}(/[a-z0-9_]{1,8}){0,3}", "[a-z][a-z0-9_-]{0,8}"],
        prop::collection::vec(arg, 0..5),
        env,
    )
        .prop_map(|(cmd, args, env)| {
            Transport::Stdio(StdioServer {
                command: Command::parse(&cmd).unwrap(),
                args,
                env,
                sandbox: Default::default(),
            })
        });
    let url = prop_oneof![
        "https://[a-z]{1,10}\\.example(:[1-9][0-9]{1,3})?/[a-z]{0,8}",
        "http://127\\.0\\.0\\.1:[1-9][0-9]{1,3}/mcp",
    ]
    .prop_map(|u| EndpointUrl::parse(&u).unwrap());
    // Identifiers round-trip as written: bare origins, trailing slashes, upper-case hosts.
    let identifier = prop_oneof![
        "https://[a-zA-Z]{1,10}\\.example(:[1-9][0-9]{1,3})?(/[a-z]{0,8})?",
        "http://127\\.0\\.0\\.1:[1-9][0-9]{1,3}(/mcp)?",
    ]
    .prop_map(|u| IdentifierUrl::parse(&u).unwrap());
    let headers = prop::collection::btree_map("x-[a-z]{1,8}", "[A-Z][A-Z0-9_]{0,8}", 0..3)
        .prop_map(|m| {
            m.into_iter()
                .map(|(h, e)| (HeaderName::parse(&h).unwrap(), EnvName::parse(&e).unwrap()))
                .collect::<BTreeMap<_, _>>()
        });
    let env_opt =
        || prop::option::of("[A-Z][A-Z0-9_]{0,8}".prop_map(|e| EnvName::parse(&e).unwrap()));
    let oauth = prop::option::of(
        (
            prop::option::of(identifier.clone()),
            prop::collection::btree_set("[a-z:.]{1,10}", 0..3),
            prop::option::of(prop::sample::select(vec![
                Registration::Auto,
                Registration::Cimd,
                Registration::Dcr,
            ])),
            prop::option::of("[a-zA-Z0-9_-]{1,16}"),
            env_opt(),
            prop::option::of(identifier),
            env_opt(),
            prop::option::of(prop::sample::select(vec![
                CredentialBackend::File,
                CredentialBackend::Keyring,
            ])),
        )
            .prop_map(
                |(resource, scopes, reg, client_id, secret, issuer, token, store)| OAuthConfig {
                    resource,
                    scopes: scopes
                        .into_iter()
                        .map(|s| Scope::parse(&s).unwrap())
                        .collect(),
                    client_registration: reg,
                    client_id: client_id.map(|c| ClientId::parse(&c).unwrap()),
                    client_secret_env: secret,
                    issuer,
                    access_token_env: token,
                    credential_store: store,
                    ..OAuthConfig::default()
                },
            ),
    );
    let http = (url, headers, oauth).prop_map(|(url, header_env, oauth)| {
        Transport::Http(HttpServer {
            url,
            header_env,
            oauth,
        })
    });
    let tools = prop::collection::btree_set("[a-z_]{1,8}", 0..6).prop_map(|set| {
        let names: Vec<ToolName> = set
            .into_iter()
            .map(|t| ToolName::parse(&t).unwrap())
            .collect();
        let half = names.len() / 2;
        ToolFilter {
            allow: names[..half].to_vec(),
            deny: names[half..].to_vec(),
        }
    });
    let caps = (0u8..64).prop_map(|bits| {
        let mut s = CapabilitySet::EMPTY;
        for (i, c) in Capability::ALL.into_iter().enumerate() {
            if bits & (1 << i) != 0 {
                s.insert(c);
            }
        }
        s
    });
    let policy = (
        prop::option::of(caps.clone()),
        prop::collection::btree_map("[a-z_]{1,8}", caps, 0..3),
    )
        .prop_map(|(capabilities, tools)| ServerPolicy {
            capabilities,
            tools: tools
                .into_iter()
                .map(|(t, c)| (ToolName::parse(&t).unwrap(), c))
                .collect(),
        });
    (name, prop_oneof![stdio, http], tools, policy).prop_map(|(name, transport, tools, policy)| {
        ServerConfig {
            name,
            transport,
            tools,
            policy,
        }
    })
}

fn arb_config() -> impl Strategy<Value = Config> {
    let servers = (0usize..5).prop_flat_map(|n| (0..n).map(arb_server).collect::<Vec<_>>());
    let hooks = prop::collection::btree_map(
        prop::sample::select(HookEvent::ALL.to_vec()),
        prop::collection::btree_set("/[a-z]{1,6}/[a-z]{1,6}", 0..3).prop_map(|s| {
            s.into_iter()
                .map(|p| AbsolutePath::parse(&p).unwrap())
                .collect::<Vec<_>>()
        }),
        0..3,
    );
    let ceiling = prop::option::of((0u8..64).prop_map(|bits| {
        let mut s = CapabilitySet::EMPTY;
        for (i, c) in Capability::ALL.into_iter().enumerate() {
            if bits & (1 << i) != 0 {
                s.insert(c);
            }
        }
        s
    }));
    let network = (
        prop::collection::btree_set(
            prop_oneof![
                (1u8..=254, 1u16..).prop_map(|(o, p)| format!("10.0.0.{o}:{p}")),
                (1u8..=254).prop_map(|o| format!("192.168.1.{o}")),
                (1u16..).prop_map(|p| format!("[::1]:{p}")),
            ],
            0..3,
        ),
        prop::option::of("/etc/[a-z]{1,8}\\.pem"),
    )
        .prop_map(|(ns, ca)| NetworkConfig {
            nameservers: ns.iter().map(|n| Nameserver::parse(n).unwrap()).collect(),
            ca_bundle: ca.map(|c| AbsolutePath::parse(&c).unwrap()),
        });
    (ceiling, servers, hooks, network).prop_map(|(host_ceiling, mcp_servers, hooks, network)| {
        Config {
            host_ceiling,
            mcp_servers,
            hooks,
            hooks_writable: Vec::new(),
            hooks_run_as: None,
            network,
            approvals: Default::default(),
        }
    })
}

/// Paths (as key lists) of every object in a serialized config whose keys are schema keys.
fn schema_objects(v: &serde_json::Value, at: Vec<String>, out: &mut Vec<Vec<String>>) {
    if let serde_json::Value::Object(map) = v {
        let data_map = matches!(at.last().map(String::as_str), Some("header_env" | "hooks"))
            || (at.len() >= 2 && at[at.len() - 1] == "tools" && at[at.len() - 2] == "policy");
        if !data_map {
            out.push(at.clone());
        }
        for (k, child) in map {
            let mut next = at.clone();
            next.push(k.clone());
            schema_objects(child, next, out);
        }
    } else if let serde_json::Value::Array(items) = v {
        for (i, child) in items.iter().enumerate() {
            let mut next = at.clone();
            next.push(i.to_string());
            schema_objects(child, next, out);
        }
    }
}

fn object_at<'a>(
    v: &'a mut serde_json::Value,
    at: &[String],
) -> &'a mut serde_json::Map<String, serde_json::Value> {
    let mut cur = v;
    for seg in at {
        cur = match cur {
            serde_json::Value::Object(m) => m.get_mut(seg).unwrap(),
            serde_json::Value::Array(a) => &mut a[seg.parse::<usize>().unwrap()],
            _ => unreachable!(),
        };
    }
    cur.as_object_mut().unwrap()
}

/// Objects with at least one member, in document order.
fn count_objects(v: &serde_json::Value, n: &mut usize) {
    match v {
        serde_json::Value::Object(m) => {
            if !m.is_empty() {
                *n += 1;
            }
            m.values().for_each(|c| count_objects(c, n));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|c| count_objects(c, n)),
        _ => {}
    }
}

/// Compact JSON of `v`, with the first member of the `target`-th non-empty object written twice.
fn emit_with_duplicate(v: &serde_json::Value, target: usize, seen: &mut usize) -> String {
    match v {
        serde_json::Value::Object(m) if !m.is_empty() => {
            let here = *seen == target;
            *seen += 1;
            let mut parts: Vec<String> = m
                .iter()
                .map(|(k, c)| {
                    format!(
                        "{}:{}",
                        serde_json::to_string(k).unwrap(),
                        emit_with_duplicate(c, target, seen)
                    )
                })
                .collect();
            if here {
                let first = parts[0].clone();
                parts.push(first);
            }
            format!("{{{}}}", parts.join(","))
        }
        serde_json::Value::Array(a) => {
            let parts: Vec<String> = a
                .iter()
                .map(|c| emit_with_duplicate(c, target, seen))
                .collect();
            format!("[{}]", parts.join(","))
        }
        other => serde_json::to_string(other).unwrap(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn parse_serialize_parse_round_trips(c in arb_config()) {
        let text = c.to_json_pretty();
        let again = Config::parse(text.as_bytes()).unwrap();
        prop_assert_eq!(&again, &c);
        prop_assert_eq!(again.to_json_pretty(), text);
    }

    #[test]
    fn a_document_with_an_unknown_key_is_rejected(c in arb_config(), pick in any::<prop::sample::Index>(),
                                                  key in "[a-z_]{1,12}") {
        let mut v = serde_json::to_value(&c).unwrap();
        let mut objects = Vec::new();
        schema_objects(&v, Vec::new(), &mut objects);
        let at = pick.get(&objects).clone();
        let obj = object_at(&mut v, &at);
        let known: &[&str] = &[ROOT_KEYS, SERVER_KEYS, OAUTH_KEYS, &["allow", "deny", "capabilities", "tools", "nameservers", "ca_bundle"]].concat();
        prop_assume!(!known.contains(&key.as_str()));
        obj.insert(key, serde_json::Value::Null);
        let text = serde_json::to_string(&v).unwrap();
        let e = Config::parse(text.as_bytes()).unwrap_err();
        let is_unknown_key = matches!(e.kind, ConfigErrorKind::UnknownKey { .. });
        prop_assert!(is_unknown_key, "{}", e);
    }

    #[test]
    fn a_document_with_a_duplicate_key_is_rejected(c in arb_config(), pick in any::<prop::sample::Index>()) {
        let v = serde_json::to_value(&c).unwrap();
        let mut count = 0;
        count_objects(&v, &mut count);
        let target = pick.index(count);
        let mut seen = 0;
        let doubled = emit_with_duplicate(&v, target, &mut seen);
        let e = Config::parse(doubled.as_bytes()).unwrap_err();
        let is_dup = matches!(e.kind, ConfigErrorKind::Syntax(SyntaxError::DuplicateKey { .. }));
        prop_assert!(is_dup, "{}", e);
    }
}

#[test]
fn the_documented_example_parses_and_round_trips() {
    let doc = include_str!("../../../docs/configuration.md");
    let start = doc.find("```json\n").expect("json example") + "```json\n".len();
    let end = start + doc[start..].find("\n```").expect("end of example");
    let c = parse(&doc[start..end]).unwrap();
    assert_eq!(c.mcp_servers.len(), 2);
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);
}

#[test]
fn network_block_names_nameservers_and_a_ca_bundle() {
    let c = parse(
        r#"{"schema_version": 2, "network": {"nameservers": ["127.0.0.1:5353", "::1", "[::1]:53"], "ca_bundle": "/etc/iteron/ca.pem"}}"#,
    );
    let e = c.unwrap_err();
    assert_eq!(
        e.path.to_string(),
        "$.network.nameservers[2]",
        "::1 and [::1]:53 are the same server: {e}"
    );
    let c = parse(r#"{"schema_version": 2, "network": {"nameservers": ["127.0.0.1:5353", "10.0.0.2"], "ca_bundle": "/etc/iteron/ca.pem"}}"#).unwrap();
    assert_eq!(c.network.nameservers[1].0, "10.0.0.2:53".parse().unwrap());
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);
    for bad in [
        "\"0.0.0.0\"",
        "\"127.0.0.1:0\"",
        "\"dns.example\"",
        "\"224.0.0.1\"",
    ] {
        let doc = format!(r#"{{"schema_version": 2, "network": {{"nameservers": [{bad}]}}}}"#);
        assert_eq!(
            error(&doc).path.to_string(),
            "$.network.nameservers[0]",
            "{bad}"
        );
    }
    let e = error(r#"{"schema_version": 2, "network": {"ca_bundle": "relative.pem"}}"#);
    assert_eq!(e.path.to_string(), "$.network.ca_bundle");
}

/// Build a document around one server (or root) fragment produced for `n` items.
fn doc_with(fragment: &str) -> String {
    format!(r#"{{"schema_version": 2, {fragment}}}"#)
}

fn stdio_with(extra: &str) -> String {
    doc_with(&format!(
        r#""mcp_servers": [{{"name": "a", "command": "/x"{extra}}}]"#
    ))
}

fn http_with(extra: &str) -> String {
    doc_with(&format!(
        r#""mcp_servers": [{{"name": "a", "transport": "http", "url": "https://a.example/"{extra}}}]"#
    ))
}

fn quoted_list(n: usize, item: impl Fn(usize) -> String) -> String {
    (0..n)
        .map(|i| format!("\"{}\"", item(i)))
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn every_list_bound_holds_at_the_limit_and_fails_one_over() {
    type Build = Box<dyn Fn(usize) -> String>;
    let cases: Vec<(&str, usize, Build)> = vec![
        (
            "env",
            MAX_ENV_NAMES,
            Box::new(|n| {
                stdio_with(&format!(
                    r#", "env": [{}]"#,
                    quoted_list(n, |i| format!("E{i}"))
                ))
            }),
        ),
        (
            "header_env",
            MAX_HEADERS,
            Box::new(|n| {
                let m: Vec<String> = (0..n).map(|i| format!(r#""x-h{i}": "E""#)).collect();
                http_with(&format!(r#", "header_env": {{{}}}"#, m.join(",")))
            }),
        ),
        (
            "tools.allow",
            MAX_TOOL_NAMES,
            Box::new(|n| {
                stdio_with(&format!(
                    r#", "tools": {{"allow": [{}]}}"#,
                    quoted_list(n, |i| format!("t{i}"))
                ))
            }),
        ),
        (
            "tools.deny",
            MAX_TOOL_NAMES,
            Box::new(|n| {
                stdio_with(&format!(
                    r#", "tools": {{"deny": [{}]}}"#,
                    quoted_list(n, |i| format!("t{i}"))
                ))
            }),
        ),
        (
            "policy.tools",
            MAX_TOOL_NAMES,
            Box::new(|n| {
                let m: Vec<String> = (0..n).map(|i| format!(r#""t{i}": []"#)).collect();
                stdio_with(&format!(r#", "policy": {{"tools": {{{}}}}}"#, m.join(",")))
            }),
        ),
        (
            "oauth.scopes",
            MAX_SCOPES,
            Box::new(|n| {
                http_with(&format!(
                    r#", "oauth": {{"scopes": [{}]}}"#,
                    quoted_list(n, |i| format!("s{i}"))
                ))
            }),
        ),
        (
            "hooks",
            MAX_HOOKS_PER_EVENT,
            Box::new(|n| {
                doc_with(&format!(
                    r#""hooks": {{"Stop": [{}]}}"#,
                    quoted_list(n, |i| format!("/h/{i}"))
                ))
            }),
        ),
        (
            "nameservers",
            MAX_NAMESERVERS,
            Box::new(|n| {
                doc_with(&format!(
                    r#""network": {{"nameservers": [{}]}}"#,
                    quoted_list(n, |i| format!("10.0.0.{}", i + 1))
                ))
            }),
        ),
    ];
    for (what, max, build) in cases {
        parse(&build(max)).unwrap_or_else(|e| panic!("{what} at {max}: {e}"));
        assert_eq!(
            error(&build(max + 1)).kind,
            ConfigErrorKind::TooMany { max },
            "{what} one over"
        );
    }
}

#[test]
fn every_length_bound_holds_at_the_limit_and_fails_one_over() {
    let scope = |n: usize| {
        http_with(&format!(
            r#", "oauth": {{"scopes": ["{}"]}}"#,
            "s".repeat(n)
        ))
    };
    parse(&scope(MAX_TOKEN_BYTES)).unwrap();
    assert_eq!(
        error(&scope(MAX_TOKEN_BYTES + 1)).kind,
        ConfigErrorKind::Value(ValueError::TooLong {
            max: MAX_TOKEN_BYTES
        })
    );
    let client = |n: usize| {
        http_with(&format!(
            r#", "oauth": {{"client_id": "{}"}}"#,
            "c".repeat(n)
        ))
    };
    parse(&client(MAX_TOKEN_BYTES)).unwrap();
    assert!(
        error(&client(MAX_TOKEN_BYTES + 1))
            .to_string()
            .contains("longer than 256")
    );
    let header = |n: usize| http_with(&format!(r#", "header_env": {{"{}": "E"}}"#, "h".repeat(n)));
    parse(&header(crate::names::MAX_HEADER_NAME)).unwrap();
    assert!(
        error(&header(crate::names::MAX_HEADER_NAME + 1))
            .to_string()
            .contains("longer than 64")
    );
    let env = |n: usize| stdio_with(&format!(r#", "env": ["{}"]"#, "E".repeat(n)));
    parse(&env(crate::names::MAX_ENV_NAME)).unwrap();
    assert!(
        error(&env(crate::names::MAX_ENV_NAME + 1))
            .to_string()
            .contains("longer than 128")
    );
    let tool = |n: usize| stdio_with(&format!(r#", "tools": {{"allow": ["{}"]}}"#, "t".repeat(n)));
    parse(&tool(crate::names::MAX_TOOL_NAME)).unwrap();
    assert!(
        error(&tool(crate::names::MAX_TOOL_NAME + 1))
            .to_string()
            .contains("longer than 128")
    );
    let name = |n: usize| {
        doc_with(&format!(
            r#""mcp_servers": [{{"name": "{}", "command": "/x"}}]"#,
            "n".repeat(n)
        ))
    };
    parse(&name(crate::names::MAX_SERVER_NAME)).unwrap();
    assert!(
        error(&name(crate::names::MAX_SERVER_NAME + 1))
            .to_string()
            .contains("longer than 64")
    );
    let url = |n: usize| {
        let base = "https://a.example/";
        http_with("").replace(base, &format!("{base}{}", "p".repeat(n - base.len())))
    };
    parse(&url(crate::url::MAX_URL_BYTES)).unwrap();
    assert!(parse(&url(crate::url::MAX_URL_BYTES + 1)).is_err());
}

#[test]
fn a_command_is_one_program_without_spaces() {
    let e = error(&doc_with(
        r#""mcp_servers": [{"name": "a", "command": "/usr/bin/env TOKEN=x server"}]"#,
    ));
    assert_eq!(e.kind, ConfigErrorKind::Value(ValueError::Whitespace));
}

#[test]
fn the_sandbox_block_is_strict_and_bounded_one_over() {
    let paths = |key: &str, n: usize| {
        let list: Vec<String> = (0..n).map(|i| format!("\"/srv/p{i}\"")).collect();
        stdio_with(&format!(
            r#", "sandbox": {{"{key}": [{}]}}"#,
            list.join(",")
        ))
    };
    for key in ["readable", "writable"] {
        parse(&paths(key, MAX_SANDBOX_PATHS)).unwrap();
        assert_eq!(
            error(&paths(key, MAX_SANDBOX_PATHS + 1)).kind,
            ConfigErrorKind::TooMany {
                max: MAX_SANDBOX_PATHS
            }
        );
    }
    let limit = |key: &str, n: u64| stdio_with(&format!(r#", "sandbox": {{"{key}": {n}}}"#));
    for (key, (min, max)) in [
        ("max_open_files", OPEN_FILES_RANGE),
        ("max_memory_mb", MEMORY_MB_RANGE),
        ("max_processes", PROCESSES_RANGE),
    ] {
        parse(&limit(key, min)).unwrap();
        parse(&limit(key, max)).unwrap();
        for bad in [min - 1, max + 1] {
            assert_eq!(
                error(&limit(key, bad)).kind,
                ConfigErrorKind::OutOfRange { min, max },
                "{key} {bad}"
            );
        }
    }
    let c = parse(&stdio_with(
        r#", "sandbox": {"writable": ["/srv/data"], "max_open_files": 64}"#,
    ))
    .unwrap();
    let Transport::Stdio(st) = &c.mcp_servers[0].transport else {
        panic!("stdio")
    };
    assert_eq!(st.sandbox.writable[0].as_str(), "/srv/data");
    assert_eq!(st.sandbox.max_open_files, Some(64));
    // It round-trips through the store's serializer.
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);
    for bad in [
        r#", "sandbox": {"writable": ["relative/path"]}"#,
        r#", "sandbox": {"writable": ["/a", "/a"]}"#,
        r#", "sandbox": {"network": true}"#,
        r#", "sandbox": {"max_open_files": "64"}"#,
        r#", "sandbox": []"#,
    ] {
        assert!(parse(&stdio_with(bad)).is_err(), "{bad}");
    }
    assert!(matches!(
        error(&http_with(r#", "sandbox": {}"#)).kind,
        ConfigErrorKind::NotForTransport { key: "sandbox", .. }
    ));
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

#[test]
fn run_as_takes_nobody_root_or_ids_within_bounds_one_over() {
    let with = |v: &str| stdio_with(&format!(r#", "sandbox": {{"run_as": "{v}"}}"#));
    let run_as = |v: &str| -> Option<RunAs> {
        let c = parse(&with(v)).ok()?;
        assert_eq!(parse(&c.to_json_pretty()).unwrap(), c, "round trip of {v}");
        let Transport::Stdio(st) = &c.mcp_servers[0].transport else {
            panic!("stdio")
        };
        st.sandbox.run_as
    };
    assert_eq!(run_as("nobody"), Some(RunAs::Nobody));
    assert_eq!(run_as("root"), Some(RunAs::Root));
    assert_eq!(run_as("1:1"), Some(RunAs::Ids { uid: 1, gid: 1 }));
    let top = format!("{MAX_RUN_AS_ID}:{MAX_RUN_AS_ID}");
    assert_eq!(
        run_as(&top),
        Some(RunAs::Ids {
            uid: MAX_RUN_AS_ID,
            gid: MAX_RUN_AS_ID
        })
    );
    // One over each bound, 0 (that is "root", said explicitly), and everything else.
    let over = u64::from(MAX_RUN_AS_ID) + 1;
    for bad in [
        format!("{over}:1"),
        format!("1:{over}"),
        "0:0".to_owned(),
        "0:1".to_owned(),
        "1:0".to_owned(),
        "1".to_owned(),
        "1:".to_owned(),
        ":1".to_owned(),
        "1:1:1".to_owned(),
        "+1:1".to_owned(),
        " 1:1".to_owned(),
        "00000000001:1".to_owned(),
        "Root".to_owned(),
        "daemon".to_owned(),
        String::new(),
    ] {
        assert_eq!(
            error(&with(&bad)).kind,
            ConfigErrorKind::Value(ValueError::BadRunAs),
            "{bad:?}"
        );
    }
    assert!(matches!(
        error(&stdio_with(r#", "sandbox": {"run_as": 65534}"#)).kind,
        ConfigErrorKind::WrongType { .. }
    ));
    // The error names the grammar, never the value.
    let shown = error(&with("secret-word")).to_string();
    assert!(!shown.contains("secret-word"), "{shown}");
    // Hooks have their own setting at the top level, with the same grammar.
    let c = parse(&doc_with(r#""hooks_run_as": "root""#)).unwrap();
    assert_eq!(c.hooks_run_as, Some(RunAs::Root));
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);
    assert_eq!(
        parse(&doc_with(r#""mcp_servers": []"#))
            .unwrap()
            .hooks_run_as,
        None
    );
    assert_eq!(
        error(&doc_with(&format!(r#""hooks_run_as": "{over}:1""#))).kind,
        ConfigErrorKind::Value(ValueError::BadRunAs)
    );
    iteron_test_support::record!("P9", serde_json::json!({"max_id": MAX_RUN_AS_ID}),);
}

#[test]
fn hooks_writable_is_bounded_one_over_and_absolute() {
    let list = |n: usize| {
        let items: Vec<String> = (0..n).map(|i| format!("\"/var/log/h{i}\"")).collect();
        doc_with(&format!(r#""hooks_writable": [{}]"#, items.join(",")))
    };
    let c = parse(&list(MAX_SANDBOX_PATHS)).unwrap();
    assert_eq!(c.hooks_writable.len(), MAX_SANDBOX_PATHS);
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);
    assert_eq!(
        error(&list(MAX_SANDBOX_PATHS + 1)).kind,
        ConfigErrorKind::TooMany {
            max: MAX_SANDBOX_PATHS
        }
    );
    assert!(parse(&doc_with(r#""hooks_writable": ["relative"]"#)).is_err());
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

#[test]
fn urls_that_are_never_a_destination_are_refused_with_their_rule() {
    // Every URL the configuration holds, with a multicast, documentation or unspecified IP
    // literal, or port 0: refused at its path, the rule named.
    let keys = [
        ("url", "$.mcp_servers[0].url"),
        ("oauth.resource", "$.mcp_servers[0].oauth.resource"),
        ("oauth.issuer", "$.mcp_servers[0].oauth.issuer"),
        ("oauth.client_id", "$.mcp_servers[0].oauth.client_id"),
        ("oauth.refresh_url", "$.mcp_servers[0].oauth.refresh_url"),
        ("oauth.revoke_url", "$.mcp_servers[0].oauth.revoke_url"),
        ("oauth.idp_issuer", "$.mcp_servers[0].oauth.idp_issuer"),
    ];
    let bad = [
        ("https://224.0.0.1/mcp", "multicast"),
        ("https://[ff05::2]/mcp", "multicast"),
        ("https://192.0.2.1/mcp", "documentation-only"),
        ("https://[2001:db8::1]/mcp", "documentation-only"),
        ("https://0.0.0.0/mcp", "unspecified"),
        ("https://[::]/mcp", "unspecified"),
        ("https://mcp.example:0/mcp", "port is 0"),
        ("http://127.0.0.1:0/mcp", "port is 0"),
    ];
    for (key, path) in keys {
        for (u, rule) in bad {
            let server = match key.split_once('.') {
                None => format!(r#"{{"name": "a", "transport": "http", "url": "{u}"}}"#),
                Some((_, k)) => format!(
                    r#"{{"name": "a", "transport": "http", "url": "https://a.example/", "oauth": {{"{k}": "{u}"}}}}"#
                ),
            };
            let e = error(&doc_with(&format!(r#""mcp_servers": [{server}]"#)));
            assert_eq!(e.path.to_string(), path, "{key} {u}: {e}");
            let line = e.to_string();
            assert!(line.contains(rule), "{key} {u}: {line}");
            assert!(!line.contains('\n'));
        }
        // The control: the same key with an ordinary address is accepted.
        let server = match key.split_once('.') {
            None => r#"{"name": "a", "transport": "http", "url": "https://203.0.114.1:8443/mcp"}"#
                .to_owned(),
            Some((_, k)) => {
                // The externally managed token's endpoints come with what they need.
                let with = match k {
                    "refresh_url" => {
                        r#", "access_token_env": "T", "refresh_token_env": "R", "client_id": "c""#
                    }
                    "revoke_url" => r#", "access_token_env": "T", "client_id": "c""#,
                    "idp_issuer" => {
                        r#", "grant": "id_jag", "issuer": "https://as.example", "client_id": "c", "idp_client_id": "i", "identity_token_env": "ID""#
                    }
                    _ => "",
                };
                format!(
                    r#"{{"name": "a", "transport": "http", "url": "https://a.example/", "oauth": {{"{k}": "https://203.0.114.1:8443/x"{with}}}}}"#
                )
            }
        };
        parse(&doc_with(&format!(r#""mcp_servers": [{server}]"#)))
            .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
    iteron_test_support::record!(
        "P12",
        serde_json::json!({"keys": keys.len(), "urls": bad.len()}),
    );
}

#[test]
fn the_externally_managed_token_block_is_refused_when_its_keys_do_not_fit_together() {
    let server = |oauth: &str| {
        doc_with(&format!(
            r#""mcp_servers": [{{"name": "a", "transport": "http", "url": "https://a.example/mcp", "oauth": {{{oauth}}}}}]"#
        ))
    };
    let cases = [
        (
            r#""expires_at_env": "E""#,
            "$.mcp_servers[0].oauth.expires_at_env",
            "needs access_token_env",
        ),
        (
            r#""revoke_url": "https://a.example/revoke", "client_id": "c""#,
            "$.mcp_servers[0].oauth.revoke_url",
            "needs access_token_env",
        ),
        (
            r#""access_token_env": "T", "refresh_url": "https://a.example/token", "client_id": "c""#,
            "$.mcp_servers[0].oauth.refresh_url",
            "needs refresh_token_env",
        ),
        (
            r#""access_token_env": "T", "refresh_token_env": "R", "client_id": "c""#,
            "$.mcp_servers[0].oauth.refresh_token_env",
            "needs refresh_url",
        ),
        (
            r#""access_token_env": "T", "refresh_url": "https://a.example/token", "refresh_token_env": "R""#,
            "$.mcp_servers[0].oauth.refresh_url",
            "needs client_id",
        ),
        (
            r#""access_token_env": "T", "revoke_url": "https://a.example/revoke""#,
            "$.mcp_servers[0].oauth.revoke_url",
            "needs client_id",
        ),
    ];
    for (oauth, path, why) in cases {
        let e = error(&server(oauth));
        assert_eq!(e.path.to_string(), path, "{oauth}: {e}");
        assert!(
            matches!(e.kind, ConfigErrorKind::Inconsistent(_)),
            "{oauth}: {e}"
        );
        let line = e.to_string();
        assert!(
            line.contains(why) && !line.contains('\n'),
            "{oauth}: {line}"
        );
    }
    // The whole block, as the product page shows it, and a token alone are fine.
    parse(HTTP_EXAMPLE).unwrap();
    parse(&server(r#""access_token_env": "T""#)).unwrap();
    parse(&server(r#""access_token_env": "T", "expires_at_env": "E""#)).unwrap();
}

#[test]
fn noninteractive_grants_name_their_client_credentials_consistently() {
    let server = |oauth: &str| {
        doc_with(&format!(
            r#""mcp_servers": [{{"name": "a", "transport": "http", "url": "https://a.example/mcp", "oauth": {{{oauth}}}}}]"#
        ))
    };
    let cc = r#""grant": "client_credentials", "client_id": "ci", "issuer": "https://as.example""#;
    for ok in [
        format!(r#"{cc}, "client_secret_env": "S""#),
        format!(r#"{cc}, "client_secret_env": "S", "token_endpoint_auth": "client_secret_post""#),
        format!(r#"{cc}, "client_key_file": "/etc/iteron/ci.pem""#),
        format!(r#"{cc}, "client_key_env": "K", "token_endpoint_auth": "private_key_jwt""#),
        r#""client_id": "pre", "client_key_env": "K""#.to_owned(),
    ] {
        let c = parse(&server(&ok)).unwrap_or_else(|e| panic!("{ok}: {e}"));
        let Transport::Http(h) = &c.mcp_servers[0].transport else {
            panic!("http expected")
        };
        // The canonical form keeps every key.
        let again = parse(&c.to_json_pretty()).unwrap();
        assert_eq!(again, c, "{ok}");
        assert!(h.oauth.is_some());
    }
    let cases = [
        (r#""grant": "password""#.to_owned(), "oauth.grant", "must be one of"),
        (cc.to_owned(), "oauth.grant", "needs client_secret_env, client_key_file or client_key_env"),
        (
            r#""grant": "client_credentials", "client_id": "ci", "client_secret_env": "S""#.to_owned(),
            "oauth.grant",
            "needs issuer",
        ),
        (
            r#""grant": "client_credentials", "issuer": "https://as.example", "client_secret_env": "S""#.to_owned(),
            "oauth.grant",
            "needs a pre-registered client_id",
        ),
        (
            format!(r#"{cc}, "client_secret_env": "S", "access_token_env": "T""#),
            "oauth.grant",
            "excludes access_token_env",
        ),
        (
            format!(r#"{cc}, "client_secret_env": "S", "client_registration": "dcr""#),
            "oauth.client_registration",
            "applies to the authorization_code grant only",
        ),
        (
            format!(r#"{cc}, "client_key_file": "/k.pem", "client_key_env": "K""#),
            "oauth.client_key_env",
            "excludes client_key_file",
        ),
        (
            format!(r#"{cc}, "client_secret_env": "S", "token_endpoint_auth": "private_key_jwt""#),
            "oauth.token_endpoint_auth",
            "private_key_jwt needs client_key_file or client_key_env",
        ),
        (
            format!(r#"{cc}, "client_key_env": "K", "token_endpoint_auth": "client_secret_basic""#),
            "oauth.token_endpoint_auth",
            "needs client_secret_env",
        ),
        (
            format!(r#"{cc}, "client_key_env": "K", "client_secret_env": "S", "token_endpoint_auth": "client_secret_basic""#),
            "oauth.client_key_env",
            "only used with token_endpoint_auth private_key_jwt",
        ),
        (
            format!(r#"{cc}, "client_key_env": "K", "client_secret_env": "S""#),
            "oauth.client_secret_env",
            "is ambiguous",
        ),
        (
            r#""client_id": "https://client.example/cimd.json", "client_key_env": "K""#.to_owned(),
            "oauth.client_key_env",
            "needs a pre-registered client_id",
        ),
        (
            format!(r#"{cc}, "client_key_file": "relative.pem""#),
            "oauth.client_key_file",
            "absolute path",
        ),
    ];
    for (oauth, key, why) in cases {
        let e = error(&server(&oauth));
        assert_eq!(
            e.path.to_string(),
            format!("$.mcp_servers[0].{key}"),
            "{oauth}: {e}"
        );
        let line = e.to_string();
        assert!(
            line.contains(why) && !line.contains('\n'),
            "{oauth}: {line}"
        );
    }
}

#[test]
fn the_jwt_bearer_grant_names_its_identity_token_once() {
    let server = |oauth: &str| {
        doc_with(&format!(
            r#""mcp_servers": [{{"name": "a", "transport": "http", "url": "https://a.example/mcp", "oauth": {{{oauth}}}}}]"#
        ))
    };
    let jb = r#""grant": "jwt_bearer", "issuer": "https://as.example""#;
    for ok in [
        format!(r#"{jb}, "identity_token_file": "/var/run/secrets/tokens/mcp""#),
        format!(r#"{jb}, "identity_token_env": "CI_JOB_JWT", "client_id": "wl""#),
        format!(r#"{jb}, "identity_token_env": "T", "client_id": "wl", "client_secret_env": "S""#),
    ] {
        let c = parse(&server(&ok)).unwrap_or_else(|e| panic!("{ok}: {e}"));
        assert_eq!(parse(&c.to_json_pretty()).unwrap(), c, "{ok}");
    }
    let cases = [
        (
            jb.to_owned(),
            "oauth.grant",
            "need identity_token_file or identity_token_env",
        ),
        (
            r#""grant": "jwt_bearer", "identity_token_env": "T""#.to_owned(),
            "oauth.grant",
            "needs issuer",
        ),
        (
            format!(r#"{jb}, "identity_token_file": "/t", "identity_token_env": "T""#),
            "oauth.identity_token_env",
            "excludes identity_token_file",
        ),
        (
            r#""identity_token_env": "T""#.to_owned(),
            "oauth.identity_token_env",
            "only used with grant jwt_bearer or id_jag",
        ),
        (
            format!(r#"{jb}, "identity_token_file": "t.jwt""#),
            "oauth.identity_token_file",
            "absolute path",
        ),
        (
            format!(r#"{jb}, "identity_token_env": "T", "client_id": "https://c.example/m.json""#),
            "oauth.client_id",
            "pre-registered client_id",
        ),
    ];
    for (oauth, key, why) in cases {
        let e = error(&server(&oauth));
        assert_eq!(
            e.path.to_string(),
            format!("$.mcp_servers[0].{key}"),
            "{oauth}: {e}"
        );
        let line = e.to_string();
        assert!(
            line.contains(why) && !line.contains('\n'),
            "{oauth}: {line}"
        );
    }
}

#[test]
fn the_id_jag_grant_names_its_identity_provider_whole() {
    let server = |oauth: &str| {
        doc_with(&format!(
            r#""mcp_servers": [{{"name": "a", "transport": "http", "url": "https://a.example/mcp", "oauth": {{{oauth}}}}}]"#
        ))
    };
    let full = r#""grant": "id_jag", "issuer": "https://as.example", "client_id": "mcp-client", "client_secret_env": "S", "idp_issuer": "https://idp.example", "idp_client_id": "idp-client", "identity_token_env": "ID_TOKEN""#;
    let c = parse(&server(full)).unwrap();
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);
    parse(&server(&format!(
        r#"{full}, "idp_client_secret_env": "IS""#
    )))
    .unwrap();
    let without = |key: &str| {
        full.split(", ")
            .filter(|kv| !kv.starts_with(&format!("\"{key}\"")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (oauth, key, why) in [
        (
            without("idp_issuer"),
            "oauth.grant",
            "id_jag needs idp_issuer",
        ),
        (
            without("idp_client_id"),
            "oauth.grant",
            "id_jag needs idp_client_id",
        ),
        (
            without("client_id"),
            "oauth.grant",
            "id_jag needs client_id",
        ),
        (
            without("identity_token_env"),
            "oauth.grant",
            "need identity_token_file or identity_token_env",
        ),
        (
            r#""idp_issuer": "https://idp.example""#.to_owned(),
            "oauth.idp_issuer",
            "only used with grant id_jag",
        ),
        (
            r#""client_id": "c", "idp_client_secret_env": "X""#.to_owned(),
            "oauth.idp_client_secret_env",
            "only used with grant id_jag",
        ),
    ] {
        let e = error(&server(&oauth));
        assert_eq!(
            e.path.to_string(),
            format!("$.mcp_servers[0].{key}"),
            "{oauth}: {e}"
        );
        assert!(e.to_string().contains(why), "{oauth}: {e}");
    }
}

/// A document with one server `ev` and these rules (a JSON array's inside).
fn rules_doc(rules: &str) -> String {
    doc_with(&format!(
        r#""mcp_servers": [{{"name": "ev", "command": "/x"}}], "approvals": {{"rules": [{rules}]}}"#
    ))
}

/// One allow rule for ev/echo with `extra` members.
fn rule_with(extra: &str) -> String {
    rules_doc(&format!(
        r#"{{"id": "r", "effect": "allow", "server": "ev", "tool": "echo"{extra}}}"#
    ))
}

#[test]
fn approval_rules_are_read_strictly() {
    let full = rule_with(
        r#", "arguments": {"text": {"prefix": "ci-"}, "n": {"range": {"min": -2, "max": 9}},
            "mode": {"one_of": ["a", 2, true]}, "flag": {"equals": false}, "note": {"any": true}},
        "args_sha256": "0000000000000000000000000000000000000000000000000000000000000000",
        "agent_uids": [0, 65534],
        "agent_identities": ["1111111111111111111111111111111111111111111111111111111111111111"],
        "max_calls_per_run": 10, "max_calls_per_session": 2,
        "expires": "2030-06-01T12:00:00Z""#,
    );
    let c = parse(&full).unwrap();
    let r = &c.approvals.rules[0];
    assert_eq!(r.agent_uids, vec![0, 65534]);
    assert_eq!(r.arguments.as_ref().unwrap().len(), 5);
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);

    let cases: &[(&str, &str, &str)] = &[
        (
            r#", "colour": 1"#,
            "$.approvals.rules[0].colour",
            "unknown key",
        ),
        (
            r#", "arguments": {"t": {"regex": ".*"}}"#,
            "$.approvals.rules[0].arguments.t.regex",
            "unknown key",
        ),
        (
            r#", "arguments": {"t": {}}"#,
            "$.approvals.rules[0].arguments.t",
            "exactly one of",
        ),
        (
            r#", "arguments": {"t": {"equals": 1, "prefix": "a"}}"#,
            "$.approvals.rules[0].arguments.t",
            "exactly one of",
        ),
        (
            r#", "arguments": {"t": {"any": false}}"#,
            "$.approvals.rules[0].arguments.t.any",
            "must be one of: true",
        ),
        (
            r#", "arguments": {"t": {"equals": 1.5}}"#,
            "$.approvals.rules[0].arguments.t.equals",
            "64-bit integer",
        ),
        (
            r#", "arguments": {"t": {"equals": 1e3}}"#,
            "$.approvals.rules[0].arguments.t.equals",
            "64-bit integer",
        ),
        (
            r#", "arguments": {"t": {"equals": 9223372036854775808}}"#,
            "$.approvals.rules[0].arguments.t.equals",
            "64-bit integer",
        ),
        (
            r#", "arguments": {"t": {"equals": null}}"#,
            "$.approvals.rules[0].arguments.t.equals",
            "a string, an integer or a boolean",
        ),
        (
            r#", "arguments": {"t": {"equals": ["a"]}}"#,
            "$.approvals.rules[0].arguments.t.equals",
            "a string, an integer or a boolean",
        ),
        (
            r#", "arguments": {"t": {"one_of": []}}"#,
            "$.approvals.rules[0].arguments.t.one_of",
            "is empty",
        ),
        (
            r#", "arguments": {"t": {"one_of": ["a", "a"]}}"#,
            "$.approvals.rules[0].arguments.t.one_of[1]",
            "duplicate",
        ),
        (
            r#", "arguments": {"t": {"prefix": ""}}"#,
            "$.approvals.rules[0].arguments.t.prefix",
            "is empty",
        ),
        (
            r#", "arguments": {"t": {"prefix": "a\u202eb"}}"#,
            "$.approvals.rules[0].arguments.t.prefix",
            "contains",
        ),
        (
            r#", "arguments": {"t": {"range": {"min": 3, "max": 2}}}"#,
            "$.approvals.rules[0].arguments.t.range",
            "min is greater than max",
        ),
        (
            r#", "arguments": {"t": {"range": {"min": 3}}}"#,
            "$.approvals.rules[0].arguments.t.range",
            "missing required key \"max\"",
        ),
        (
            r#", "arguments": {"t\u200b": {"any": true}}"#,
            "$.approvals.rules[0].arguments[\"t\\u{200b}\"]",
            "invisible character",
        ),
        (
            r#", "arguments": []"#,
            "$.approvals.rules[0].arguments",
            "expected an object",
        ),
        (r#", "args_sha256": "ABCDEF"#, "", ""),
        (
            r#", "args_sha256": "00""#,
            "$.approvals.rules[0].args_sha256",
            "64 lowercase hex",
        ),
        (
            r#", "agent_identities": ["00"]"#,
            "$.approvals.rules[0].agent_identities[0]",
            "64 lowercase hex",
        ),
        (
            r#", "agent_uids": [-1]"#,
            "$.approvals.rules[0].agent_uids[0]",
            "from 0 to",
        ),
        (
            r#", "agent_uids": [4294967295]"#,
            "$.approvals.rules[0].agent_uids[0]",
            "from 0 to 4294967294",
        ),
        (
            r#", "agent_uids": [5, 5]"#,
            "$.approvals.rules[0].agent_uids[1]",
            "duplicate",
        ),
        (
            r#", "agent_uids": ["5"]"#,
            "$.approvals.rules[0].agent_uids[0]",
            "an integer",
        ),
        (
            r#", "max_calls_per_run": 0"#,
            "$.approvals.rules[0].max_calls_per_run",
            "from 1 to",
        ),
        (
            r#", "max_calls_per_session": 1000000001"#,
            "$.approvals.rules[0].max_calls_per_session",
            "from 1 to 1000000000",
        ),
        (
            r#", "expires": "2030-06-01""#,
            "$.approvals.rules[0].expires",
            "YYYY-MM-DDTHH:MM:SSZ",
        ),
        (
            r#", "expires": "2030-02-30T00:00:00Z""#,
            "$.approvals.rules[0].expires",
            "YYYY-MM-DDTHH:MM:SSZ",
        ),
    ];
    for (extra, path, words) in cases {
        if path.is_empty() {
            // Malformed JSON (an unterminated string): a syntax error, not a rule error.
            assert!(matches!(
                error(&rule_with(extra)).kind,
                ConfigErrorKind::Syntax(_)
            ));
            continue;
        }
        let e = error(&rule_with(extra));
        assert_eq!(e.path.to_string(), *path, "{extra}: {e}");
        assert!(e.to_string().contains(words), "{extra}: {e}");
    }
    let whole: &[(&str, &str, &str)] = &[
        (
            r#"{"effect": "allow", "server": "ev", "tool": "echo"}"#,
            "$.approvals.rules[0]",
            "missing required key \"id\"",
        ),
        (
            r#"{"id": "r", "server": "ev", "tool": "echo"}"#,
            "$.approvals.rules[0]",
            "missing required key \"effect\"",
        ),
        (
            r#"{"id": "r", "effect": "permit", "server": "ev", "tool": "echo"}"#,
            "$.approvals.rules[0].effect",
            "must be one of: allow, deny",
        ),
        (
            r#"{"id": "-r", "effect": "allow", "server": "ev", "tool": "echo"}"#,
            "$.approvals.rules[0].id",
            "starts with",
        ),
        (
            r#"{"id": "r", "effect": "allow", "server": "e*", "tool": "echo"}"#,
            "$.approvals.rules[0].server",
            "outside the allowed set",
        ),
        (
            r#"{"id": "r", "effect": "allow", "server": "ev", "tool": "ec ho"}"#,
            "$.approvals.rules[0].tool",
            "outside the allowed set",
        ),
        (
            r#"{"id": "r", "effect": "allow", "server": "ev", "tool": "resources/list"}"#,
            "$.approvals.rules[0].tool",
            "outside the allowed set",
        ),
        (
            r#"{"id": "r", "effect": "deny", "server": "ev", "tool": "echo", "max_calls_per_run": 3}"#,
            "$.approvals.rules[0].max_calls_per_run",
            "allow rules only",
        ),
        (
            r#"{"id": "r", "effect": "deny", "server": "ev", "tool": "echo", "max_calls_per_session": 3}"#,
            "$.approvals.rules[0].max_calls_per_session",
            "allow rules only",
        ),
        (
            r#"{"id": "r", "effect": "allow", "server": "ev", "tool": "a"}, {"id": "r", "effect": "deny", "server": "ev", "tool": "b"}"#,
            "$.approvals.rules[1].id",
            "duplicate entry (first at line 1",
        ),
        ("7", "$.approvals.rules[0]", "expected an object"),
    ];
    for (rules, path, words) in whole {
        let e = error(&rules_doc(rules));
        assert_eq!(e.path.to_string(), *path, "{rules}: {e}");
        assert!(e.to_string().contains(words), "{rules}: {e}");
    }
    for (block, path, words) in [
        (
            r#"{"rules": [], "deferred": 3}"#,
            "$.approvals.deferred",
            "unknown key",
        ),
        (
            r#"{"deferred_secs": 0}"#,
            "$.approvals.deferred_secs",
            "from 1 to 3600",
        ),
        (r#"[]"#, "$.approvals", "expected an object"),
    ] {
        let e = error(&doc_with(&format!(r#""approvals": {block}"#)));
        assert_eq!(e.path.to_string(), path, "{block}: {e}");
        assert!(e.to_string().contains(words), "{block}: {e}");
    }
    // The pseudo-tools of resource reads and prompt gets are names a rule may use.
    for tool in ["resources/read", "prompts/get"] {
        parse(&rules_doc(&format!(
            r#"{{"id": "r", "effect": "allow", "server": "ev", "tool": "{tool}"}}"#
        )))
        .unwrap();
    }
    // A rule naming a server that is not configured is not a schema error: removing a server
    // must never make the file unreadable; `approvals rules check` reports it.
    parse(&rules_doc(
        r#"{"id": "r", "effect": "allow", "server": "gone", "tool": "echo"}"#,
    ))
    .unwrap();
}

#[test]
fn approval_rule_bounds_hold_at_the_limit_and_one_over() {
    use crate::rules::{
        DEFERRED_SECS_RANGE, MAX_ARGUMENT_NAME, MAX_CALLS_RANGE, MAX_ONE_OF, MAX_RULE_ARGUMENTS,
        MAX_RULE_IDENTITIES, MAX_RULE_UIDS, MAX_RULES, MAX_UID,
    };
    type Build = Box<dyn Fn(usize) -> String>;
    let hex = |i: usize| format!("{i:064x}");
    let lists: Vec<(&str, usize, Build)> = vec![
        (
            "rules",
            MAX_RULES,
            Box::new(|n| {
                rules_doc(
                    &(0..n)
                        .map(|i| {
                            format!(
                                r#"{{"id": "r{i}", "effect": "allow", "server": "ev", "tool": "echo"}}"#
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(","),
                )
            }),
        ),
        (
            "arguments",
            MAX_RULE_ARGUMENTS,
            Box::new(|n| {
                let m: Vec<String> = (0..n)
                    .map(|i| format!(r#""a{i}": {{"any": true}}"#))
                    .collect();
                rule_with(&format!(r#", "arguments": {{{}}}"#, m.join(",")))
            }),
        ),
        (
            "one_of",
            MAX_ONE_OF,
            Box::new(|n| {
                let v: Vec<String> = (0..n).map(|i| i.to_string()).collect();
                rule_with(&format!(
                    r#", "arguments": {{"a": {{"one_of": [{}]}}}}"#,
                    v.join(",")
                ))
            }),
        ),
        (
            "agent_uids",
            MAX_RULE_UIDS,
            Box::new(|n| {
                let v: Vec<String> = (0..n).map(|i| i.to_string()).collect();
                rule_with(&format!(r#", "agent_uids": [{}]"#, v.join(",")))
            }),
        ),
        (
            "agent_identities",
            MAX_RULE_IDENTITIES,
            Box::new(move |n| {
                rule_with(&format!(
                    r#", "agent_identities": [{}]"#,
                    quoted_list(n, hex)
                ))
            }),
        ),
    ];
    for (what, max, build) in lists {
        parse(&build(max)).unwrap_or_else(|e| panic!("{what} at {max}: {e}"));
        assert_eq!(
            error(&build(max + 1)).kind,
            ConfigErrorKind::TooMany { max },
            "{what} one over"
        );
    }
    let name = |n: usize| {
        rule_with(&format!(
            r#", "arguments": {{"{}": {{"any": true}}}}"#,
            "a".repeat(n)
        ))
    };
    parse(&name(MAX_ARGUMENT_NAME)).unwrap();
    assert_eq!(
        error(&name(MAX_ARGUMENT_NAME + 1)).kind,
        ConfigErrorKind::Value(ValueError::TooLong {
            max: MAX_ARGUMENT_NAME
        })
    );
    let value = |n: usize| {
        rule_with(&format!(
            r#", "arguments": {{"a": {{"equals": "{}"}}}}"#,
            "v".repeat(n)
        ))
    };
    parse(&value(MAX_STRING_BYTES)).unwrap();
    assert_eq!(
        error(&value(MAX_STRING_BYTES + 1)).kind,
        ConfigErrorKind::Value(ValueError::TooLong {
            max: MAX_STRING_BYTES
        })
    );
    let id = |n: usize| {
        rules_doc(&format!(
            r#"{{"id": "{}", "effect": "allow", "server": "ev", "tool": "echo"}}"#,
            "r".repeat(n)
        ))
    };
    parse(&id(crate::names::MAX_RULE_ID)).unwrap();
    assert!(
        error(&id(crate::names::MAX_RULE_ID + 1))
            .to_string()
            .contains("longer than 32 bytes")
    );
    type Ranged = Box<dyn Fn(u64) -> String>;
    let ranges: Vec<(&str, (u64, u64), Ranged)> = vec![
        (
            "max_calls_per_run",
            MAX_CALLS_RANGE,
            Box::new(|v| rule_with(&format!(r#", "max_calls_per_run": {v}"#))),
        ),
        (
            "max_calls_per_session",
            MAX_CALLS_RANGE,
            Box::new(|v| rule_with(&format!(r#", "max_calls_per_session": {v}"#))),
        ),
        (
            "agent_uids",
            (0, u64::from(MAX_UID)),
            Box::new(|v| rule_with(&format!(r#", "agent_uids": [{v}]"#))),
        ),
        (
            "deferred_secs",
            DEFERRED_SECS_RANGE,
            Box::new(|v| doc_with(&format!(r#""approvals": {{"deferred_secs": {v}}}"#))),
        ),
    ];
    for (what, (min, max), build) in ranges {
        parse(&build(min)).unwrap_or_else(|e| panic!("{what} at {min}: {e}"));
        parse(&build(max)).unwrap_or_else(|e| panic!("{what} at {max}: {e}"));
        assert_eq!(
            error(&build(max + 1)).kind,
            ConfigErrorKind::OutOfRange { min, max },
            "{what} one over"
        );
        if min > 0 {
            assert_eq!(
                error(&build(min - 1)).kind,
                ConfigErrorKind::OutOfRange { min, max },
                "{what} one under"
            );
        }
    }
    iteron_test_support::record!(
        "P5",
        serde_json::json!({
            "rules": MAX_RULES, "arguments": MAX_RULE_ARGUMENTS, "one_of": MAX_ONE_OF,
            "agent_uids": MAX_RULE_UIDS, "agent_identities": MAX_RULE_IDENTITIES,
            "argument_name": MAX_ARGUMENT_NAME, "calls": MAX_CALLS_RANGE,
            "deferred_secs": DEFERRED_SECS_RANGE,
        }),
    );
}

#[test]
fn sandbox_network_and_egress_parse_strictly_within_bounds_one_over() {
    let with = |fragment: &str| stdio_with(&format!(r#", "sandbox": {{{fragment}}}"#));
    let sandbox = |fragment: &str| match parse(&with(fragment)).unwrap().mcp_servers[0]
        .transport
        .clone()
    {
        Transport::Stdio(st) => st.sandbox,
        Transport::Http(_) => unreachable!(),
    };
    assert_eq!(sandbox("").network, None);
    assert_eq!(
        sandbox(r#""network": "host""#).network,
        Some(SandboxNetwork::Host)
    );
    assert_eq!(
        sandbox(r#""network": "namespace""#).network,
        Some(SandboxNetwork::Namespace)
    );
    for bad in ["Host", "none", ""] {
        assert_eq!(
            error(&with(&format!(r#""network": "{bad}""#))).kind,
            ConfigErrorKind::Value(ValueError::BadSandboxNetwork),
            "{bad:?}"
        );
    }
    let rules = sandbox(r#""egress": ["intranet.example", "*.corp.example", "10.0.0.0/8"]"#).egress;
    assert_eq!(
        rules,
        vec![
            EgressRule::Name("intranet.example".into()),
            EgressRule::Suffix("corp.example".into()),
            EgressRule::Cidr {
                net: "10.0.0.0".parse().unwrap(),
                len: 8
            },
        ]
    );
    // The list's bound at the limit and one over; duplicates and bad entries are errors.
    let list = |n: usize| {
        format!(
            r#""egress": [{}]"#,
            quoted_list(n, |i| format!("h{i}.example"))
        )
    };
    assert_eq!(
        sandbox(&list(MAX_EGRESS_RULES)).egress.len(),
        MAX_EGRESS_RULES
    );
    assert!(matches!(
        error(&with(&list(MAX_EGRESS_RULES + 1))).kind,
        ConfigErrorKind::TooMany { .. }
    ));
    assert!(matches!(
        error(&with(r#""egress": ["a.example", "A.example"]"#)).kind,
        ConfigErrorKind::Duplicate { .. }
    ));
    for (bad, why) in [
        ("*.com", EgressRuleError::TooWide),
        ("10.0.0.1/8", EgressRuleError::BadCidr),
        ("http://a.example/", EgressRuleError::Grammar),
    ] {
        let e = error(&with(&format!(r#""egress": ["{bad}"]"#)));
        assert_eq!(
            e.kind,
            ConfigErrorKind::Value(ValueError::Egress(why)),
            "{bad}"
        );
        assert_eq!(e.path.to_string(), "$.mcp_servers[0].sandbox.egress[0]");
    }
    // Written back, it reads the same.
    let c = parse(&with(
        r#""network": "host", "egress": ["*.corp.example", "fd00::/8"]"#,
    ))
    .unwrap();
    assert_eq!(parse(&c.to_json_pretty()).unwrap(), c);
    iteron_test_support::record!(
        "P9",
        serde_json::json!({"max_egress_rules": MAX_EGRESS_RULES}),
    );
}

/// Issuers and resources are identifiers compared as strings: a configuration keeps them
/// exactly as written (no `/` added to an origin, no case folded), while endpoints are stored
/// normalized; both still pass the endpoint rules.
#[test]
fn oauth_issuers_and_resources_are_kept_exactly_as_written() {
    let server = |oauth: &str| {
        doc_with(&format!(
            r#""mcp_servers": [{{"name": "a", "transport": "http", "url": "https://a.example/mcp", "oauth": {{{oauth}}}}}]"#
        ))
    };
    for (written, key) in [
        ("https://as.example", "issuer"),
        ("https://as.example/", "issuer"),
        ("https://AS.example:443/tenant", "issuer"),
        ("http://127.0.0.1:8080", "issuer"),
        ("https://a.example", "resource"),
        ("https://a.example/", "resource"),
        ("https://idp.example", "idp_issuer"),
    ] {
        let extra = if key == "idp_issuer" {
            r#", "grant": "id_jag", "issuer": "https://as.example", "client_id": "c", "idp_client_id": "i", "identity_token_env": "T""#
        } else {
            ""
        };
        let c = parse(&server(&format!(r#""{key}": "{written}"{extra}"#)))
            .unwrap_or_else(|e| panic!("{written}: {e}"));
        let Transport::Http(h) = &c.mcp_servers[0].transport else {
            panic!("http")
        };
        let o = h.oauth.as_ref().unwrap();
        let got = match key {
            "issuer" => o.issuer.as_ref(),
            "resource" => o.resource.as_ref(),
            _ => o.idp_issuer.as_ref(),
        }
        .unwrap();
        assert_eq!(got.as_str(), written);
        let json = c.to_json_pretty();
        assert!(json.contains(&format!("\"{written}\"")), "{json}");
        assert_eq!(parse(&json).unwrap(), c, "{written}");
    }
    // Still checked like every URL: no userinfo, no plain http off loopback.
    for bad in ["https://u@as.example", "http://as.example"] {
        let e = error(&server(&format!(r#""issuer": "{bad}""#)));
        assert_eq!(
            e.path.to_string(),
            "$.mcp_servers[0].oauth.issuer",
            "{bad}: {e}"
        );
    }
}
