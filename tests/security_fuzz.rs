//! Every parser that reads untrusted input, fuzzed on stable Rust with proptest: IPC frames and
//! requests, SSE streams, JSON-RPC messages, frontmatter (skills and agent definitions), the
//! configuration, `WWW-Authenticate` challenges, endpoint URLs and the strict JSON reader.
//! Each target runs a fixed number of generated inputs; a panic is a crash and fails the test.
//! The executions are written to the security report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const CASES: u32 = 4000;

/// Run `f` over `CASES` inputs from `strategy`; record the executions.
fn fuzz<S: Strategy>(target: &str, strategy: S, f: impl Fn(S::Value))
where
    S::Value: std::fmt::Debug,
{
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    });
    let executions = std::sync::atomic::AtomicU64::new(0);
    runner
        .run(&strategy, |v| {
            executions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            f(v);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{target}: {e}"));
    // Each target is named after the test that fuzzes it, which calls this helper.
    iteron_test_support::record!(
        "P10",
        name = target,
        serde_json::json!({"executions": executions.into_inner(), "crashes": 0}),
    );
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        "\\PC{0,200}".prop_map(String::into_bytes),
        // Near-valid JSON objects with random keys and values.
        (
            "[a-z_]{1,10}",
            prop_oneof![
                Just("1".to_owned()),
                Just("\"x\"".to_owned()),
                Just("[]".to_owned()),
                Just("{}".to_owned()),
                "\\PC{0,20}".prop_map(|s| format!("{s:?}"))
            ]
        )
            .prop_map(
                |(k, v)| format!("{{\"{k}\": {v}, \"id\": 1, \"method\": \"{k}\"}}").into_bytes()
            ),
    ]
}

#[test]
fn ipc_frames_and_requests() {
    use iteron_broker::ipc::{frame, proto};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    fuzz("ipc_frames_and_requests", bytes(), |b| {
        let mut input = &b[..];
        let _ = rt.block_on(frame::read_frame(
            &mut input,
            256,
            std::time::Duration::from_secs(1),
        ));
        for role in [proto::Role::Agent, proto::Role::Operator] {
            for state in [proto::State::AwaitingHello, proto::State::Open] {
                if let Err(f) = proto::decode(role, state, &b) {
                    assert!(f.refusal.message().len() <= 512);
                }
            }
        }
    });
}

#[test]
fn sse_streams() {
    use iteron_broker::mcp::sse::{SseLimits, SseParser};
    fuzz("sse_streams", (bytes(), 1usize..64), |(b, chunk)| {
        let mut p = SseParser::new(SseLimits::default());
        let mut out = Vec::new();
        for c in b.chunks(chunk) {
            if p.feed(c, &mut out).is_err() {
                return;
            }
        }
        let _ = p.finish();
    });
}

#[test]
fn jsonrpc_messages() {
    fuzz("jsonrpc_messages", bytes(), |b| {
        let _ = iteron_broker::mcp::jsonrpc::parse_incoming(&b);
    });
}

#[test]
fn frontmatter_skills_and_agents() {
    use iteron_policy::{agentdef, frontmatter, skill};
    fuzz(
        "frontmatter_skills_and_agents",
        prop_oneof![
            bytes(),
            "\\PC{0,300}".prop_map(|s| format!("---\nname: x\n{s}\n---\nbody").into_bytes()),
        ],
        |b| {
            if let Ok(s) = std::str::from_utf8(&b) {
                let _ = frontmatter::parse(s);
            }
            let _ = skill::parse(&b, "x");
            let _ = agentdef::parse(&b, agentdef::Tier::Repository);
        },
    );
}

#[test]
fn configuration() {
    fuzz(
        "configuration",
        prop_oneof![
            bytes(),
            "\\PC{0,200}".prop_map(|s| {
                format!(r#"{{"schema_version": 2, "mcp_servers": [{{"name": "a", "command": "/x", "args": [{s:?}]}}]}}"#).into_bytes()
            }),
        ],
        |b| {
            let _ = iteron_policy::config::Config::parse(&b);
            let _ = iteron_policy::json::parse(&b);
        },
    );
}

#[test]
fn www_authenticate_challenges() {
    fuzz(
        "www_authenticate_challenges",
        prop_oneof![
            "\\PC{0,200}",
            "[a-zA-Z]{0,8}( [a-z_]{1,12}=(\"[^\"]{0,20}\"|[a-z0-9]{0,8}),?){0,6}",
        ],
        |s| {
            let _ = iteron_broker::oauth::parse_challenge(&s);
        },
    );
}

#[test]
fn endpoint_urls() {
    fuzz(
        "endpoint_urls",
        prop_oneof![
            "\\PC{0,120}",
            "(https?|ftp)://[a-z0-9.@:%\\[\\]-]{0,40}(/[a-z0-9%./?#=]{0,30})?",
        ],
        |s| {
            let _ = iteron_policy::url::EndpointUrl::parse(&s);
        },
    );
}
