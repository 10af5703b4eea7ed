//! The MCP client against real stdio child processes: the echo fixture and a scripted server
//! that misbehaves on request. Runs the library directly (the CLI side is covered by
//! `iteron mcp test` tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;

use iteron_broker::mcp::client::{Client, McpError, Options};
use iteron_broker::mcp::elicit::AcceptDefaults;
use iteron_broker::mcp::jsonrpc::Certainty;
use iteron_broker::mcp::version::Version;
use iteron_broker::mcp::{TransportError, TransportErrorKind};
use iteron_broker::spawn::{ChildSpec, EnvValue, child_env};
use iteron_policy::names::EnvName;
use serde_json::{Map, Value, json};

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/stdio")
        .join(name)
        .canonicalize()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

fn spec(script: &str, args: &[&str], env: Vec<(OsString, OsString)>) -> ChildSpec {
    let mut full = vec![fixture(script)];
    full.extend(args.iter().map(|a| (*a).to_owned()));
    let (mut base, _) = child_env(&[], None, |_| None);
    base.extend(env.into_iter().map(|(k, v)| (k, EnvValue::new(v))));
    ChildSpec {
        command: "/usr/bin/python3".into(),
        args: full,
        env: base,
        confine: None,
        egress: None,
    }
}

fn text_args(t: &str) -> Map<String, Value> {
    json!({"text": t}).as_object().unwrap().clone()
}

#[tokio::test]
async fn a_legacy_stdio_server_is_reached_after_the_modern_probe_is_refused() {
    let c = Client::connect_stdio(spec("echo_server.py", &[], vec![]), Options::default())
        .await
        .unwrap();
    assert_eq!(c.era().version(), Version::V2025_11_25);
    assert_eq!(c.server_info().unwrap().0, "iteron-echo-fixture");
    let tools = c.list_tools().await.unwrap();
    assert_eq!(tools.len(), 1);
    let out = c.call_tool("echo", text_args("hello")).await.unwrap();
    assert_eq!(out.text, "hello");
    assert!(!out.is_error);
    c.close().await;
}

#[tokio::test]
async fn only_named_variables_reach_the_child() {
    // The echo fixture reports whether the variable named by its argument is present.
    let secret = OsString::from("CANARYvalue42");
    let lookup = |k: &str| (k == "ITERON_NAMED").then(|| secret.clone());
    let (env, missing) = child_env(
        &[
            EnvName::parse("ITERON_NAMED").unwrap(),
            EnvName::parse("ITERON_UNSET").unwrap(),
        ],
        None,
        lookup,
    );
    assert_eq!(missing, vec![EnvName::parse("ITERON_UNSET").unwrap()]);
    for (probe, want) in [
        ("ITERON_NAMED", "present"),
        ("HOME", "absent"),
        ("CARGO", "absent"),
    ] {
        let s = ChildSpec {
            command: "/usr/bin/python3".into(),
            args: vec![fixture("echo_server.py"), probe.into()],
            env: env.clone(),
            confine: None,
            egress: None,
        };
        let c = Client::connect_stdio(s, Options::default()).await.unwrap();
        let out = c.call_tool("echo", text_args("x")).await.unwrap();
        assert_eq!(out.text, format!("x [{probe} {want}]"));
        c.close().await;
    }
}

#[tokio::test]
async fn a_modern_stdio_server_gets_the_envelope() {
    let c = Client::connect_stdio(
        spec("scripted_server.py", &["modern"], vec![]),
        Options::default(),
    )
    .await
    .unwrap();
    assert_eq!(c.era().version(), Version::V2026_07_28);
    let out = c.call_tool("echo", text_args("m")).await.unwrap();
    assert_eq!(out.text, "m");
    c.close().await;
}

#[tokio::test]
async fn a_server_that_negotiates_a_refused_version_is_refused_by_name() {
    let e = Client::connect_stdio(
        spec("scripted_server.py", &["old-version"], vec![]),
        Options::default(),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(e, McpError::UnsupportedVersion("2025-03-26".into()));
    assert!(e.to_string().contains("2025-03-26"));
}

#[tokio::test]
async fn notifications_and_a_server_request_with_id_zero_before_the_answer_are_handled() {
    let dir = std::env::temp_dir().join(format!("iteron-chatty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("chatty.log");
    let env = vec![(OsString::from("SCRIPT_LOG"), log.clone().into_os_string())];
    let c = Client::connect_stdio(
        spec("scripted_server.py", &["chatty"], env),
        Options::default(),
    )
    .await
    .unwrap();
    let tools = c.list_tools().await.unwrap();
    assert_eq!(tools[0].name, "echo");
    c.close().await;
    // The ping with id 0 was answered (with an empty result), not mistaken for anything else.
    let seen: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        seen.contains(&json!({"jsonrpc": "2.0", "id": 0, "result": {}})),
        "{seen:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_server_that_dies_during_a_call_yields_maybe_applied_and_no_retry() {
    let dir = std::env::temp_dir().join(format!("iteron-stdio-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("crash.log");
    let _ = std::fs::remove_file(&log);
    let env = vec![(OsString::from("SCRIPT_LOG"), log.clone().into_os_string())];
    let c = Client::connect_stdio(
        spec("scripted_server.py", &["crash-on-call"], env),
        Options::default(),
    )
    .await
    .unwrap();
    let e = c.call_tool("echo", text_args("boom")).await.unwrap_err();
    assert_eq!(e.certainty(), Certainty::MaybeApplied, "{e}");
    assert!(e.to_string().contains("may have been applied"), "{e}");
    let calls = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| l.contains("tools/call"))
        .count();
    assert_eq!(calls, 1, "the call was sent exactly once");
    // The next request starts the server again (supervised restart) — it does not resend
    // the call.
    assert_eq!(c.list_tools().await.unwrap().len(), 1);
    assert_eq!(c.restarts(), 1);
    // Every call kills it; restarts stop at the cap.
    for _ in 0..3 {
        let _ = c.call_tool("echo", text_args("boom")).await;
    }
    let e = c.call_tool("echo", text_args("boom")).await.unwrap_err();
    assert_eq!(e.certainty(), Certainty::NotSent, "{e}");
    assert!(e.to_string().contains("restarted 3 times"), "{e}");
    let calls = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| l.contains("tools/call"))
        .count();
    assert_eq!(calls, 4, "one call per live server, none resent");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_line_over_the_limit_ends_the_connection() {
    let over = (iteron_broker::mcp::stdio::MAX_LINE_BYTES + 10).to_string();
    let c = Client::connect_stdio(
        spec("scripted_server.py", &["long-line", &over], vec![]),
        Options::default(),
    )
    .await
    .unwrap();
    let e = c.list_tools().await.unwrap_err();
    assert!(
        matches!(&e, McpError::Transport(TransportError { kind: TransportErrorKind::Closed(why), .. }) if why.contains("longer than the limit")),
        "{e}"
    );
}

/// Accepts with defaults and counts how often the operator was asked.
#[derive(Default)]
struct Counting {
    asked: std::sync::atomic::AtomicUsize,
}

impl iteron_broker::mcp::elicit::Elicitor for Counting {
    fn ask(
        &self,
        request: iteron_broker::mcp::elicit::FormRequest,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = iteron_broker::mcp::elicit::FormAnswer> + Send>,
    > {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        AcceptDefaults.ask(request)
    }
}

#[tokio::test]
async fn mrtr_answers_through_the_elicitor_echo_state_and_bound_rounds() {
    let opts = Options {
        elicitor: Some(Arc::new(AcceptDefaults)),
        ..Options::default()
    };
    let c = Client::connect_stdio(
        spec("scripted_server.py", &["mrtr", "1"], vec![]),
        opts.clone(),
    )
    .await
    .unwrap();
    let out = c.call_tool("echo", Map::new()).await.unwrap();
    let echoed: Value = serde_json::from_str(&out.text).unwrap();
    assert_eq!(echoed["requestState"], json!("opaque-\u{e9}-state"));
    assert_eq!(
        echoed["inputResponses"],
        json!({"confirm": {"action": "accept", "content": {"ok": true}}})
    );
    c.close().await;
    // Five rounds asked, four allowed: the operator is asked exactly four times.
    let counter = Arc::new(Counting::default());
    let counted = Options {
        elicitor: Some(counter.clone()),
        ..Options::default()
    };
    let c = Client::connect_stdio(spec("scripted_server.py", &["mrtr", "5"], vec![]), counted)
        .await
        .unwrap();
    let e = c.call_tool("echo", Map::new()).await.unwrap_err();
    // Five rounds reached the server: whatever stopped the call, it may have been applied.
    assert_eq!(e.certainty(), Certainty::MaybeApplied, "{e}");
    assert!(
        matches!(&e, McpError::AfterInputRounds { rounds: 5, error } if matches!(**error, McpError::Limit { max: 4, .. })),
        "{e}"
    );
    assert_eq!(counter.asked.load(std::sync::atomic::Ordering::SeqCst), 4);
    c.close().await;
    let _ = opts;
    // Noninteractive: fails closed.
    let c = Client::connect_stdio(
        spec("scripted_server.py", &["mrtr", "1"], vec![]),
        Options::default(),
    )
    .await
    .unwrap();
    let e = c.call_tool("echo", Map::new()).await.unwrap_err();
    // The first round reached the server (it answered input_required): maybe applied.
    assert_eq!(e.certainty(), Certainty::MaybeApplied, "{e}");
    assert!(
        matches!(&e, McpError::AfterInputRounds { rounds: 1, error } if matches!(**error, McpError::InputRefused(_))),
        "{e}"
    );
    c.close().await;
}

#[tokio::test]
async fn a_server_that_ignores_stdin_eof_and_term_is_still_reaped() {
    let c = Client::connect_stdio(
        spec("scripted_server.py", &["ignore-eof", "deaf"], vec![]),
        Options::default(),
    )
    .await
    .unwrap();
    c.list_tools().await.unwrap();
    // close() walks EOF → TERM → KILL and reports the rung that ended the child.
    assert_eq!(c.close().await, Some(iteron_broker::spawn::Ended::OnKill));
}

#[tokio::test]
async fn a_call_past_its_deadline_is_cancelled_and_reported_maybe_applied() {
    let dir = std::env::temp_dir().join(format!("iteron-hang-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("hang.log");
    let env = vec![(OsString::from("SCRIPT_LOG"), log.clone().into_os_string())];
    let opts = Options {
        tool_call_deadline: std::time::Duration::from_millis(300),
        ..Options::default()
    };
    let c = Client::connect_stdio(spec("scripted_server.py", &["hang"], env), opts)
        .await
        .unwrap();
    let e = c.call_tool("echo", text_args("slow")).await.unwrap_err();
    assert!(
        matches!(
            e,
            McpError::Transport(TransportError {
                kind: TransportErrorKind::Timeout,
                certainty: Certainty::MaybeApplied
            })
        ),
        "{e}"
    );
    // The server is told, with the id of the abandoned call; nothing is resent.
    c.list_tools().await.unwrap();
    let seen: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let call = seen.iter().find(|m| m["method"] == "tools/call").unwrap();
    let cancel = seen
        .iter()
        .find(|m| m["method"] == "notifications/cancelled")
        .expect("a cancellation notification");
    assert_eq!(cancel["params"]["requestId"], call["id"]);
    assert_eq!(
        seen.iter().filter(|m| m["method"] == "tools/call").count(),
        1
    );
    c.close().await;
    std::fs::remove_dir_all(&dir).unwrap();
}
