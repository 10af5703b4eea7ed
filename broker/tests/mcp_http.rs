//! Black-box tests of the Streamable HTTP transport against a scripted server on loopback:
//! SSE resumption with `Last-Event-ID` and `retry`, streams without ids, session loss,
//! negotiation signals, refused versions and result-type rules.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use iteron_broker::mcp::client::{Client, McpError, Options};
use iteron_broker::mcp::jsonrpc::Certainty;
use iteron_broker::mcp::version::{Version, VersionPolicy};
use iteron_broker::mcp::{TransportError, TransportErrorKind};
use iteron_broker::net::{Net, NetConfig};
use iteron_policy::url::EndpointUrl;
use iteron_policy::zone::Zone;
use reqwest::header::HeaderMap;
use serde_json::{Map, Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    headers: Vec<(String, String)>,
    body: Option<Value>,
    at: Instant,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn rpc_method(&self) -> Option<&str> {
        self.body.as_ref()?.get("method")?.as_str()
    }
}

enum Piece {
    Data(String),
    Sleep(Duration),
}

struct Reply {
    /// How long the server waits before it answers at all.
    before: Duration,
    status: u16,
    headers: Vec<(&'static str, String)>,
    pieces: Vec<Piece>,
}

impl Reply {
    fn json(v: Value) -> Reply {
        Reply {
            before: Duration::ZERO,
            status: 200,
            headers: vec![("Content-Type", "application/json".into())],
            pieces: vec![Piece::Data(v.to_string())],
        }
    }
    fn status(status: u16, v: Value) -> Reply {
        Reply {
            before: Duration::ZERO,
            status,
            headers: vec![("Content-Type", "application/json".into())],
            pieces: vec![Piece::Data(v.to_string())],
        }
    }
    fn sse(pieces: Vec<Piece>) -> Reply {
        Reply {
            before: Duration::ZERO,
            status: 200,
            headers: vec![("Content-Type", "text/event-stream".into())],
            pieces,
        }
    }
    fn empty(status: u16) -> Reply {
        Reply {
            before: Duration::ZERO,
            status,
            headers: vec![],
            pieces: vec![],
        }
    }
    fn after(mut self, wait: Duration) -> Reply {
        self.before = wait;
        self
    }
    fn with(mut self, k: &'static str, v: &str) -> Reply {
        self.headers.push((k, v.into()));
        self
    }
}

type Script = Arc<dyn Fn(&Seen, &[Seen]) -> Reply + Send + Sync>;

struct Server {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    async fn start(script: Script) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let script = script.clone();
                let log = log.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 8192];
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i;
                        }
                        let Ok(n) = stream.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                    let mut lines = head.split("\r\n");
                    let method = lines
                        .next()
                        .unwrap_or("")
                        .split(' ')
                        .next()
                        .unwrap_or("")
                        .to_owned();
                    let headers: Vec<(String, String)> = lines
                        .filter_map(|l| {
                            l.split_once(':')
                                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                        })
                        .collect();
                    let len: usize = headers
                        .iter()
                        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                        .and_then(|(_, v)| v.parse().ok())
                        .unwrap_or(0);
                    let mut body = buf[head_end + 4..].to_vec();
                    while body.len() < len {
                        let Ok(n) = stream.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            break;
                        }
                        body.extend_from_slice(&chunk[..n]);
                    }
                    let req = Seen {
                        method,
                        headers,
                        body: serde_json::from_slice(&body).ok(),
                        at: Instant::now(),
                    };
                    let reply = {
                        let mut all = log.lock().unwrap();
                        all.push(req.clone());
                        script(&req, &all)
                    };
                    tokio::time::sleep(reply.before).await;
                    let mut out = format!("HTTP/1.1 {} X\r\nConnection: close\r\n", reply.status);
                    for (k, v) in &reply.headers {
                        out.push_str(&format!("{k}: {v}\r\n"));
                    }
                    out.push_str("\r\n");
                    if stream.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                    for p in reply.pieces {
                        match p {
                            Piece::Data(d) => {
                                if stream.write_all(d.as_bytes()).await.is_err() {
                                    return;
                                }
                                let _ = stream.flush().await;
                            }
                            Piece::Sleep(t) => tokio::time::sleep(t).await,
                        }
                    }
                    let _ = stream.shutdown().await;
                });
            }
        });
        Server { addr, seen }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.addr.port())
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn count(&self, rpc: &str) -> usize {
        self.seen()
            .iter()
            .filter(|s| s.rpc_method() == Some(rpc))
            .count()
    }
}

fn id_of(req: &Seen) -> Value {
    req.body
        .as_ref()
        .and_then(|b| b.get("id"))
        .cloned()
        .unwrap_or(Value::Null)
}

fn ok(req: &Seen, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id_of(req), "result": result})
}

fn rpc_err(req: &Seen, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id_of(req), "error": {"code": code, "message": message}})
}

async fn connect(server: &Server, policy: VersionPolicy) -> Result<Client, McpError> {
    let net = Net::new(NetConfig::default()).unwrap();
    let client = net.client(Zone::Loopback).unwrap();
    let opts = Options {
        version: policy,
        ..Options::default()
    };
    Client::connect_http(
        client,
        EndpointUrl::parse(&server.url()).unwrap(),
        HeaderMap::new(),
        opts,
    )
    .await
}

/// A stateful 2025-11-25 server: initialize answers with session `s1`; GET is 405 unless it
/// carries Last-Event-ID; everything else goes to `rest`.
fn legacy(rest: impl Fn(&Seen, &[Seen]) -> Reply + Send + Sync + 'static) -> Script {
    Arc::new(
        move |req: &Seen, all: &[Seen]| match (req.method.as_str(), req.rpc_method()) {
            ("POST", Some("initialize")) => Reply::json(ok(
                req,
                json!({
            "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
            "serverInfo": {"name": "scripted-http", "version": "1"}}),
            ))
            .with("Mcp-Session-Id", "s1"),
            ("POST", Some("notifications/initialized")) => Reply::empty(202),
            ("GET", _) if req.header("last-event-id").is_none() => Reply::empty(405),
            ("DELETE", _) => Reply::empty(200),
            _ => rest(req, all),
        },
    )
}

fn call_text(v: &str) -> Value {
    json!({"content": [{"type": "text", "text": v}]})
}

#[tokio::test]
async fn a_broken_stream_with_event_ids_is_resumed_with_last_event_id_after_the_retry_delay() {
    let server = Server::start(legacy(|req, _| {
        match (req.method.as_str(), req.rpc_method()) {
            ("POST", Some("tools/call")) => Reply::sse(vec![
                Piece::Data("id: ev-1\nretry: 300\ndata: \n\n".into()),
                Piece::Sleep(Duration::from_millis(50)),
            ]),
            ("GET", _) => {
                assert_eq!(req.header("last-event-id"), Some("ev-1"));
                assert_eq!(req.header("mcp-session-id"), Some("s1"));
                // The answer to the tools/call (id 1 was initialize; the call is id 2).
                let id = json!(2);
                Reply::sse(vec![Piece::Data(format!(
                    "event: message\nid: ev-2\ndata: {}\n\n",
                    json!({"jsonrpc": "2.0", "id": id, "result": call_text("resumed")})
                ))])
            }
            _ => Reply::empty(500),
        }
    }))
    .await;
    let c = connect(&server, VersionPolicy::Pin(Version::V2025_11_25))
        .await
        .unwrap();
    let out = c.call_tool("echo", Map::new()).await.unwrap();
    assert_eq!(out.text, "resumed");
    let seen = server.seen();
    let post = seen
        .iter()
        .find(|s| s.rpc_method() == Some("tools/call"))
        .unwrap();
    let get = seen
        .iter()
        .find(|s| s.method == "GET" && s.header("last-event-id").is_some())
        .unwrap();
    assert!(
        get.at.duration_since(post.at) >= Duration::from_millis(300),
        "retry honoured"
    );
    assert_eq!(server.count("tools/call"), 1, "never resent");
}

/// The first request after the handshake waits until the server has answered the standalone
/// GET (a server may drop a request it sends there while no stream is open, as the TypeScript
/// SDK does), and a server that never answers costs at most `LISTENER_READY_WAIT`.
#[tokio::test]
async fn the_first_call_waits_for_the_listener_stream_but_never_longer_than_its_bound() {
    use iteron_broker::mcp::http::LISTENER_READY_WAIT;
    for (answer_after, waited) in [
        (Duration::from_millis(400), Duration::from_millis(400)),
        (Duration::from_secs(30), LISTENER_READY_WAIT),
    ] {
        let server = Server::start(Arc::new(move |req: &Seen, _: &[Seen]| {
            match (req.method.as_str(), req.rpc_method()) {
                ("POST", Some("initialize")) => Reply::json(ok(
                    req,
                    json!({"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                           "serverInfo": {"name": "slow-listener", "version": "1"}}),
                ))
                .with("Mcp-Session-Id", "s1"),
                ("POST", Some("notifications/initialized")) => Reply::empty(202),
                ("GET", _) => Reply::sse(vec![
                    Piece::Data(": open\n\n".into()),
                    Piece::Sleep(Duration::from_secs(60)),
                ])
                .after(answer_after),
                ("POST", Some("tools/call")) => Reply::json(ok(req, call_text("called"))),
                ("DELETE", _) => Reply::empty(200),
                _ => Reply::empty(500),
            }
        }))
        .await;
        let began = Instant::now();
        let c = connect(&server, VersionPolicy::Pin(Version::V2025_11_25))
            .await
            .unwrap();
        assert!(began.elapsed() < Duration::from_secs(10), "bounded");
        assert_eq!(
            c.call_tool("echo", Map::new()).await.unwrap().text,
            "called"
        );
        let seen = server.seen();
        let get = seen.iter().find(|s| s.method == "GET").unwrap();
        let call = seen
            .iter()
            .find(|s| s.rpc_method() == Some("tools/call"))
            .unwrap();
        let gap = call.at.duration_since(get.at);
        assert!(gap >= waited, "the call came {gap:?} after the GET");
        assert!(gap < waited + Duration::from_secs(5), "{gap:?}");
    }
}

#[tokio::test]
async fn a_broken_stream_without_event_ids_is_maybe_applied_and_not_resumed() {
    let server = Server::start(legacy(|req, _| match req.rpc_method() {
        Some("tools/call") => Reply::sse(vec![Piece::Data(": keep-alive\n\n".into())]),
        _ => Reply::empty(500),
    }))
    .await;
    let c = connect(&server, VersionPolicy::Pin(Version::V2025_11_25))
        .await
        .unwrap();
    let e = c.call_tool("echo", Map::new()).await.unwrap_err();
    assert_eq!(e.certainty(), Certainty::MaybeApplied, "{e}");
    assert_eq!(server.count("tools/call"), 1);
    assert!(
        !server
            .seen()
            .iter()
            .any(|s| s.header("last-event-id").is_some())
    );
}

#[tokio::test]
async fn a_lost_session_is_reported_and_the_next_request_starts_a_new_one_without_resending() {
    let server = Server::start(legacy(|req, all| {
        let calls = all
            .iter()
            .filter(|s| s.rpc_method() == Some("tools/call"))
            .count();
        let inits = all
            .iter()
            .filter(|s| s.rpc_method() == Some("initialize"))
            .count();
        match req.rpc_method() {
            // The first session expires at the first tools/call; 404 with a text body.
            Some("tools/call") if calls == 1 => Reply {
                before: Duration::ZERO,
                status: 404,
                headers: vec![("Content-Type", "text/plain".into())],
                pieces: vec![Piece::Data("Not Found: Session not found".into())],
            },
            Some("tools/list") if inits >= 2 => Reply::json(ok(req, json!({"tools": []}))),
            _ => Reply::empty(500),
        }
    }))
    .await;
    let c = connect(&server, VersionPolicy::Pin(Version::V2025_11_25))
        .await
        .unwrap();
    let e = c.call_tool("echo", Map::new()).await.unwrap_err();
    assert!(
        matches!(
            e,
            McpError::Transport(TransportError {
                kind: TransportErrorKind::SessionLost,
                certainty: Certainty::NotSent
            })
        ),
        "{e}"
    );
    c.list_tools().await.unwrap();
    assert_eq!(server.count("initialize"), 2, "re-initialized once");
    assert_eq!(server.count("tools/call"), 1, "the call was not resent");
}

#[tokio::test]
async fn a_server_that_negotiates_2024_11_05_over_http_is_refused() {
    let server = Server::start(Arc::new(|req: &Seen, _: &[Seen]| match req.rpc_method() {
        Some("initialize") => Reply::json(ok(req, json!({"protocolVersion": "2024-11-05", "capabilities": {}, "serverInfo": {"name": "old", "version": "1"}}))),
        _ => Reply::empty(202),
    }))
    .await;
    let e = connect(&server, VersionPolicy::Pin(Version::V2025_06_18))
        .await
        .err()
        .unwrap();
    assert_eq!(e, McpError::UnsupportedVersion("2024-11-05".into()));
}

#[tokio::test]
async fn a_legacy_http_signature_falls_back_but_an_auth_challenge_never_downgrades() {
    // server-everything's answer to a modern probe: 400 -32000 "Server not initialized".
    let server = Server::start(legacy(|req, _| match req.rpc_method() {
        Some("server/discover") => Reply::status(
            400,
            rpc_err(req, -32000, "Bad Request: Server not initialized"),
        ),
        Some("tools/list") => Reply::json(ok(req, json!({"tools": []}))),
        _ => Reply::empty(500),
    }))
    .await;
    let c = connect(&server, VersionPolicy::Auto).await.unwrap();
    assert_eq!(c.era().version(), Version::V2025_11_25);
    let discover = server
        .seen()
        .into_iter()
        .find(|s| s.rpc_method() == Some("server/discover"))
        .unwrap();
    assert_eq!(discover.header("mcp-protocol-version"), Some("2026-07-28"));
    assert_eq!(discover.header("mcp-method"), Some("server/discover"));

    let guarded = Server::start(Arc::new(|_: &Seen, _: &[Seen]| {
        Reply::empty(401).with("WWW-Authenticate", "Bearer error=\"invalid_token\", resource_metadata=\"http://x/.well-known/oauth-protected-resource\"")
    }))
    .await;
    let e = connect(&guarded, VersionPolicy::Auto).await.err().unwrap();
    assert!(
        matches!(
            e,
            McpError::Transport(TransportError {
                kind: TransportErrorKind::Unauthorized { status: 401, .. },
                ..
            })
        ),
        "{e}"
    );
    assert_eq!(
        guarded.count("initialize"),
        0,
        "no downgrade on an auth challenge"
    );

    let modern_error = Server::start(Arc::new(|req: &Seen, _: &[Seen]| {
        Reply::status(400, rpc_err(req, -32602, "missing _meta"))
    }))
    .await;
    assert!(connect(&modern_error, VersionPolicy::Auto).await.is_err());
    assert_eq!(
        modern_error.count("initialize"),
        0,
        "a recognised modern error never downgrades"
    );
}

fn modern(rest: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Script {
    Arc::new(move |req: &Seen, _: &[Seen]| match req.rpc_method() {
        Some("server/discover") => Reply::json(ok(
            req,
            json!({"supportedVersions": ["2026-07-28"], "capabilities": {"tools": {}, "resources": {}}, "resultType": "complete"}),
        )),
        _ => rest(req),
    })
}

#[tokio::test]
async fn input_required_outside_tools_call_and_unknown_result_types_are_protocol_errors() {
    let server = Server::start(modern(|req| match req.rpc_method() {
        Some("resources/read") => Reply::json(ok(
            req,
            json!({"resultType": "input_required", "requestState": "x"}),
        )),
        Some("prompts/get") => Reply::json(ok(
            req,
            json!({"resultType": "input_required", "inputRequests": {}}),
        )),
        Some("tools/call") => Reply::json(ok(req, json!({"resultType": "partial", "content": []}))),
        _ => Reply::empty(500),
    }))
    .await;
    let c = connect(&server, VersionPolicy::Auto).await.unwrap();
    assert_eq!(c.era().version(), Version::V2026_07_28);
    for e in [
        c.read_resource("file:///x").await.unwrap_err(),
        c.get_prompt("p", Map::new()).await.unwrap_err(),
        c.call_tool("t", Map::new()).await.unwrap_err(),
    ] {
        assert!(matches!(e, McpError::Protocol { .. }), "{e}");
    }
    let read = server
        .seen()
        .into_iter()
        .find(|s| s.rpc_method() == Some("resources/read"))
        .unwrap();
    assert_eq!(read.header("mcp-name"), Some("file:///x"));
    let meta = &read.body.as_ref().unwrap()["params"]["_meta"];
    assert_eq!(
        meta["io.modelcontextprotocol/protocolVersion"],
        "2026-07-28"
    );
}

#[tokio::test]
async fn every_request_accepts_both_media_types_and_errors_never_adopt_a_session() {
    let server = Server::start(Arc::new(|req: &Seen, all: &[Seen]| {
        let inits = all.iter().filter(|s| s.rpc_method() == Some("initialize")).count();
        match req.rpc_method() {
            // A first initialize that fails but hands out a session id: it must not be adopted.
            Some("initialize") if inits == 1 => {
                Reply::status(406, rpc_err(req, -32000, "Not Acceptable")).with("Mcp-Session-Id", "bogus")
            }
            // The second succeeds without any session (stateless).
            Some("initialize") => Reply::json(ok(req, json!({"protocolVersion": "2025-11-25", "capabilities": {}, "serverInfo": {"name": "s", "version": "1"}}))),
            Some("notifications/initialized") => Reply::empty(202),
            Some("tools/list") => Reply::json(ok(req, json!({"tools": []}))),
            _ => Reply::empty(405),
        }
    }))
    .await;
    assert!(
        connect(&server, VersionPolicy::Pin(Version::V2025_11_25))
            .await
            .is_err()
    );
    let c = connect(&server, VersionPolicy::Pin(Version::V2025_11_25))
        .await
        .unwrap();
    c.list_tools().await.unwrap();
    let seen = server.seen();
    assert!(seen.len() >= 4, "{seen:?}");
    assert!(
        seen.iter()
            .filter(|s| s.method == "POST")
            .all(|s| s.header("accept") == Some("application/json, text/event-stream"))
    );
    assert!(
        seen.iter().all(|s| s.header("mcp-session-id").is_none()),
        "the error's session id was never used"
    );
}

#[tokio::test]
async fn a_tools_call_whose_answer_post_fails_mid_stream_is_maybe_applied() {
    // The server sends a request on the call's stream; answering it fails (404), so the call's
    // outcome is unknown — never "not sent".
    let server = Server::start(legacy(|req, _| {
        match (req.method.as_str(), req.rpc_method()) {
            ("POST", Some("tools/call")) => Reply::sse(vec![Piece::Data(format!(
                "event: message\ndata: {}\n\n",
                json!({"jsonrpc": "2.0", "id": 77, "method": "ping"})
            ))]),
            ("POST", None) => Reply::empty(404),
            _ => Reply::empty(500),
        }
    }))
    .await;
    let c = connect(&server, VersionPolicy::Pin(Version::V2025_11_25))
        .await
        .unwrap();
    let e = c.call_tool("echo", Map::new()).await.unwrap_err();
    assert_eq!(e.certainty(), Certainty::MaybeApplied, "{e}");
    assert_eq!(server.count("tools/call"), 1);
}

#[tokio::test]
async fn a_redirect_answer_to_a_call_is_maybe_applied_and_not_followed() {
    let server = Server::start(legacy(|req, _| match req.rpc_method() {
        Some("tools/call") => Reply::empty(303).with("Location", "http://127.0.0.1:1/elsewhere"),
        _ => Reply::empty(500),
    }))
    .await;
    let c = connect(&server, VersionPolicy::Pin(Version::V2025_11_25))
        .await
        .unwrap();
    let e = c.call_tool("echo", Map::new()).await.unwrap_err();
    assert_eq!(e.certainty(), Certainty::MaybeApplied, "{e}");
    assert!(e.to_string().contains("redirect"), "{e}");
}

#[tokio::test]
async fn an_unrelated_error_to_the_probe_never_downgrades() {
    // -32603 in a 500 or a 200 is a failure, not a legacy signal.
    for status in [200u16, 500] {
        let server = Server::start(Arc::new(move |req: &Seen, _: &[Seen]| {
            Reply::status(status, rpc_err(req, -32603, "internal error"))
        }))
        .await;
        assert!(connect(&server, VersionPolicy::Auto).await.is_err());
        assert_eq!(server.count("initialize"), 0, "status {status}");
    }
}

#[tokio::test]
async fn list_results_are_cached_privately_for_their_ttl_only() {
    let server = Server::start(modern(|req| match req.rpc_method() {
        Some("tools/list") => Reply::json(ok(req, json!({"tools": [{"name": "t", "inputSchema": {"type": "object"}}], "resultType": "complete", "ttlMs": 60000, "cacheScope": "private"}))),
        Some("prompts/list") => Reply::json(ok(req, json!({"prompts": [], "resultType": "complete", "ttlMs": 0, "cacheScope": "public"}))),
        _ => Reply::empty(500),
    }))
    .await;
    let c = connect(&server, VersionPolicy::Auto).await.unwrap();
    c.list_tools().await.unwrap();
    c.list_tools().await.unwrap();
    assert_eq!(server.count("tools/list"), 1, "fresh for 60 s");
    c.list_prompts().await.unwrap();
    c.list_prompts().await.unwrap();
    assert_eq!(server.count("prompts/list"), 2, "ttlMs 0 is never cached");
}

#[tokio::test]
async fn pagination_is_bounded_and_a_repeated_cursor_is_refused() {
    let server = Server::start(modern(|req| {
        let cursor = req
            .body
            .as_ref()
            .and_then(|b| b["params"]["cursor"].as_str())
            .unwrap_or("0");
        let n: u64 = cursor.parse().unwrap_or(0);
        match req.rpc_method() {
            // An endless listing: every page points at a new one.
            Some("tools/list") => Reply::json(ok(
                req,
                json!({"tools": [], "resultType": "complete", "nextCursor": (n + 1).to_string()}),
            )),
            // A listing whose every page points at the same next page.
            Some("prompts/list") => Reply::json(ok(
                req,
                json!({"prompts": [], "resultType": "complete", "nextCursor": "1"}),
            )),
            _ => Reply::empty(500),
        }
    }))
    .await;
    let c = connect(&server, VersionPolicy::Auto).await.unwrap();
    let e = c.list_tools().await.unwrap_err();
    assert!(matches!(e, McpError::Limit { max: 64, .. }), "{e}");
    assert_eq!(server.count("tools/list"), 64);
    let e = c.list_prompts().await.unwrap_err();
    assert!(matches!(e, McpError::Protocol { .. }), "{e}");
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

/// A managed token that starts as `old` and becomes `new` after a forced refresh.
struct Rotating {
    refreshed: std::sync::atomic::AtomicUsize,
}

impl iteron_broker::mcp::client::TokenSource for Rotating {
    fn current(&self) -> iteron_broker::mcp::client::TokenFuture<'_> {
        let t = if self.refreshed.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            "old"
        } else {
            "new"
        };
        Box::pin(async move {
            Ok(iteron_broker::mcp::client::AccessToken::bearer(
                iteron_broker::oauth::SecretString::from(t.to_owned()),
            ))
        })
    }

    fn refresh(&self) -> iteron_broker::mcp::client::TokenFuture<'_> {
        self.refreshed
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async {
            Ok(iteron_broker::mcp::client::AccessToken::bearer(
                iteron_broker::oauth::SecretString::from("new".to_owned()),
            ))
        })
    }
}

#[tokio::test]
async fn a_401_refreshes_the_managed_token_once_and_a_403_never_does() {
    let server = Server::start(modern(|req| {
        let bearer = req.header("authorization").unwrap_or("");
        match req.rpc_method() {
            Some("tools/list") if bearer == "Bearer new" => {
                Reply::json(ok(req, json!({"tools": [], "resultType": "complete"})))
            }
            Some("tools/list") => {
                Reply::empty(401).with("WWW-Authenticate", "Bearer error=\"invalid_token\"")
            }
            Some("tools/call") => {
                Reply::empty(401).with("WWW-Authenticate", "Bearer error=\"invalid_token\"")
            }
            Some("prompts/list") => Reply::empty(403).with(
                "WWW-Authenticate",
                "Bearer error=\"insufficient_scope\", scope=\"x\"",
            ),
            _ => Reply::empty(500),
        }
    }))
    .await;
    let source = Arc::new(Rotating {
        refreshed: std::sync::atomic::AtomicUsize::new(0),
    });
    let net = Net::new(NetConfig::default()).unwrap();
    let opts = Options {
        version: VersionPolicy::Pin(Version::V2026_07_28),
        token: Some(source.clone()),
        ..Options::default()
    };
    let c = Client::connect_http(
        net.client(Zone::Loopback).unwrap(),
        EndpointUrl::parse(&server.url()).unwrap(),
        HeaderMap::new(),
        opts,
    )
    .await
    .unwrap();
    c.list_tools().await.unwrap();
    assert_eq!(
        source.refreshed.load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    assert_eq!(
        server.count("tools/list"),
        2,
        "refused once, then sent with the new token"
    );
    // An effect is sent once: refused, the token is refreshed for the next request, and the
    // call is reported, not sent again.
    let refreshed = source.refreshed.load(std::sync::atomic::Ordering::SeqCst);
    let e = c.call_tool("t", Map::new()).await.unwrap_err();
    assert!(
        matches!(
            e,
            McpError::Transport(TransportError {
                kind: TransportErrorKind::Unauthorized { status: 401, .. },
                certainty: Certainty::NotSent
            })
        ),
        "{e}"
    );
    assert_eq!(server.count("tools/call"), 1);
    assert_eq!(
        source.refreshed.load(std::sync::atomic::Ordering::SeqCst),
        refreshed + 1
    );
    // 403 insufficient_scope: never a refresh, never a replay.
    let before = source.refreshed.load(std::sync::atomic::Ordering::SeqCst);
    assert!(c.list_prompts().await.is_err());
    assert_eq!(server.count("prompts/list"), 1);
    assert_eq!(
        source.refreshed.load(std::sync::atomic::Ordering::SeqCst),
        before
    );
}

/// A DPoP-bound managed token; counts forced refreshes.
struct Bound {
    key: Arc<iteron_broker::oauth::dpop::DpopKey>,
    refreshed: std::sync::atomic::AtomicUsize,
}

impl iteron_broker::mcp::client::TokenSource for Bound {
    fn current(&self) -> iteron_broker::mcp::client::TokenFuture<'_> {
        let key = Arc::clone(&self.key);
        Box::pin(async move {
            Ok(iteron_broker::mcp::client::AccessToken {
                token: iteron_broker::oauth::SecretString::from("dpop-at".to_owned()),
                dpop: Some(key),
            })
        })
    }

    fn refresh(&self) -> iteron_broker::mcp::client::TokenFuture<'_> {
        self.refreshed
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.current()
    }
}

fn proof_claims(req: &Seen) -> Value {
    let proof = req.header("dpop").expect("a DPoP proof");
    iteron_broker::oauth::jose::decode_unverified(proof)
        .unwrap()
        .1
}

#[tokio::test]
async fn a_dpop_bound_token_carries_a_fresh_proof_and_a_nonce_challenge_is_answered_exactly_once() {
    let server = Server::start(modern(|req| {
        let nonce = req
            .header("dpop")
            .and_then(iteron_broker::oauth::jose::decode_unverified)
            .and_then(|(_, c)| c["nonce"].as_str().map(str::to_owned));
        let challenge = |n: &str| {
            Reply::empty(401)
                .with("WWW-Authenticate", "DPoP error=\"use_dpop_nonce\"")
                .with("DPoP-Nonce", n)
        };
        match req.rpc_method() {
            // Wants the nonce it gives.
            Some("tools/list") if nonce.as_deref() == Some("rs-n1") => {
                Reply::json(ok(req, json!({"tools": [], "resultType": "complete"})))
            }
            Some("tools/list") => challenge("rs-n1"),
            // An effect: wants a nonce of its own.
            Some("tools/call") if nonce.as_deref() == Some("rs-c1") => {
                Reply::json(ok(req, json!({"content": [], "resultType": "complete"})))
            }
            Some("tools/call") => challenge("rs-c1"),
            // Never satisfied: a new nonce every time.
            Some("resources/list") => challenge(&format!("n-{}", nonce.unwrap_or_default().len())),
            // Another refusal, with a nonce offered: not a nonce challenge.
            Some("prompts/list") => Reply::empty(401)
                .with("WWW-Authenticate", "DPoP error=\"invalid_token\"")
                .with("DPoP-Nonce", "rs-n2"),
            _ => Reply::empty(500),
        }
    }))
    .await;
    let source = Arc::new(Bound {
        key: Arc::new(iteron_broker::oauth::dpop::DpopKey::generate().unwrap()),
        refreshed: std::sync::atomic::AtomicUsize::new(0),
    });
    let net = Net::new(NetConfig::default()).unwrap();
    let opts = Options {
        version: VersionPolicy::Pin(Version::V2026_07_28),
        token: Some(source.clone()),
        ..Options::default()
    };
    let url = server.url();
    let c = Client::connect_http(
        net.client(Zone::Loopback).unwrap(),
        EndpointUrl::parse(&url).unwrap(),
        HeaderMap::new(),
        opts,
    )
    .await
    .unwrap();
    c.list_tools().await.unwrap();
    let lists: Vec<Seen> = server
        .seen()
        .into_iter()
        .filter(|s| s.rpc_method() == Some("tools/list"))
        .collect();
    assert_eq!(
        lists.len(),
        2,
        "refused for the nonce once, then sent with it"
    );
    for s in &lists {
        assert_eq!(s.header("authorization"), Some("DPoP dpop-at"));
        let claims = proof_claims(s);
        assert_eq!(claims["htm"], "POST");
        assert_eq!(claims["htu"], url.as_str());
        // base64url(SHA-256("dpop-at")), computed independently with Python's hashlib.
        assert_eq!(claims["ath"], "sMeKakNpn4RQrnvLVVSuc9JTeZdYUiHGuoSJjVa-avw");
    }
    assert_eq!(proof_claims(&lists[0]).get("nonce"), None);
    assert_eq!(proof_claims(&lists[1])["nonce"], "rs-n1");
    assert_ne!(
        proof_claims(&lists[0])["jti"],
        proof_claims(&lists[1])["jti"]
    );
    assert_eq!(
        lists[0].body, lists[1].body,
        "the same request, sent once more"
    );
    // A nonce that is never enough: one resend, then the refusal is reported (no loop, and
    // no token renewal for it).
    assert!(c.list_resources().await.is_err());
    assert_eq!(server.count("resources/list"), 2);
    // An effect is sent once, also on a nonce challenge: refused as not sent, with the nonce
    // kept, so the caller's next call carries it (the broker never sends a call twice).
    let e = c.call_tool("t", Map::new()).await.err().unwrap();
    assert_eq!(server.count("tools/call"), 1, "an effect was sent again");
    assert_eq!(e.certainty(), Certainty::NotSent, "{e}");
    assert!(e.to_string().contains("DPoP nonce"), "{e}");
    c.call_tool("t", Map::new()).await.unwrap();
    assert_eq!(server.count("tools/call"), 2);
    let calls: Vec<Seen> = server
        .seen()
        .into_iter()
        .filter(|s| s.rpc_method() == Some("tools/call"))
        .collect();
    assert_eq!(proof_claims(&calls[1])["nonce"], "rs-c1");
    // Any other 401 is not a nonce challenge: no resend by the transport (the client's one
    // token renewal still applies).
    assert!(c.list_prompts().await.is_err());
    assert_eq!(server.count("prompts/list"), 2);
    assert_eq!(
        source.refreshed.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "only the invalid_token refusal renewed the token"
    );
    // The nonce a refusal offered is kept for the next proof.
    let last = server.seen().pop().unwrap();
    assert_eq!(proof_claims(&last)["nonce"], "rs-n2");
    iteron_test_support::record!(
        "P16",
        json!({"resends_per_nonce_challenge": 1, "resends_of_an_effect": 0}),
    );
}

/// A call the server rejects before acting — an unsupported version (-32022) or a header
/// mismatch (-32020) — is reported `not_sent` and never sent again by the client; what would
/// make it work (the version, the catalog) is fixed for the next request.
#[tokio::test]
async fn an_effect_rejected_with_32022_or_32020_is_sent_once_and_reported_not_sent() {
    let server = Server::start(modern(|req| {
        let calls = req.body.as_ref().and_then(|b| b["params"]["arguments"]["n"].as_u64());
        match (req.rpc_method(), calls) {
            (Some("tools/list"), _) => Reply::json(ok(
                req,
                json!({"tools": [{"name": "t", "inputSchema": {"type": "object"}}], "resultType": "complete"}),
            )),
            (Some("tools/call"), Some(0)) => Reply::status(400, json!({"jsonrpc": "2.0", "id": id_of(req), "error": {
                "code": -32022, "message": "unsupported", "data": {"supported": ["2026-07-28"], "requested": "2026-07-28"}}})),
            (Some("tools/call"), Some(1)) => Reply::status(400, rpc_err(req, -32020, "header mismatch")),
            (Some("tools/call"), _) => Reply::json(ok(req, json!({"content": [], "resultType": "complete"}))),
            _ => Reply::empty(500),
        }
    }))
    .await;
    let c = connect(&server, VersionPolicy::Pin(Version::V2026_07_28))
        .await
        .unwrap();
    for (n, code) in [(0u64, -32022i64), (1, -32020)] {
        let mut args = Map::new();
        args.insert("n".into(), json!(n));
        let e = c.call_tool("t", args).await.unwrap_err();
        match e {
            McpError::Rpc { certainty, error } => {
                assert_eq!(certainty, Certainty::NotSent);
                assert_eq!(error.code, code);
            }
            other => panic!("{other}"),
        }
        assert_eq!(server.count("tools/call"), n as usize + 1, "sent once");
    }
    // The header mismatch re-listed the catalog for the next call, which goes through.
    assert!(server.count("tools/list") >= 1);
    let mut args = Map::new();
    args.insert("n".into(), json!(2));
    c.call_tool("t", args).await.unwrap();
    assert_eq!(server.count("tools/call"), 3);
    iteron_test_support::record!("P4", serde_json::json!({"codes": [-32022, -32020]}),);
}

/// Only a 400 Bad Request whose body is not a recognised modern error is the legacy signature:
/// a 404, a 429 or a 5xx to the first probe is reported as an error and never downgrades (no
/// `initialize` is sent).
#[tokio::test]
async fn a_404_429_or_5xx_to_the_probe_is_an_error_never_a_downgrade() {
    for status in [404u16, 405, 429, 500, 503] {
        for body in [true, false] {
            let server = Server::start(Arc::new(move |req: &Seen, _: &[Seen]| {
                if body {
                    Reply::status(status, rpc_err(req, -32000, "Server not initialized"))
                } else {
                    Reply::empty(status)
                }
            }))
            .await;
            let e = connect(&server, VersionPolicy::Auto).await.err();
            assert!(e.is_some(), "{status}: connected");
            assert_eq!(server.count("initialize"), 0, "{status} {body}: downgraded");
        }
    }
}
