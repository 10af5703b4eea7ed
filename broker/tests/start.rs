//! The broker's start-up order as a library call: `iteron_broker::start` on a throwaway home
//! and socket paths, reached on both sockets, and stopped cleanly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use iteron_broker::daemon::Ready;
use iteron_broker::ipc::client::Connection;
use iteron_broker::ipc::proto::PROTOCOL_VERSION;
use iteron_broker::start::{self, StartError, StartOptions};
use iteron_broker::store::{Home, StoreError};
use iteron_broker::sys::Hardened;
use iteron_policy::config::{Command, ServerConfig, StdioServer, Transport};
use iteron_policy::names::ServerName;
use serde_json::json;
use tokio::sync::oneshot;

fn temp_base(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let base = std::env::temp_dir().join(format!(
        "iteron-start-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&base);
    fs::create_dir_all(&base).unwrap();
    base
}

/// Options with explicit sockets under `base/run` and an empty environment (no credentials
/// directory, no variables).
fn options(base: &std::path::Path) -> StartOptions {
    StartOptions {
        repo: None,
        agent_socket: Some(base.join("run").join("agent.sock")),
        operator_socket: Some(base.join("run").join("operator.sock")),
        allow_uids: Vec::new(),
        interactive: false,
        approval_deadline: Duration::from_secs(5),
        idle_deadline: Duration::from_secs(60),
        env: Arc::new(|_: &str| None),
    }
}

fn stdio_server(name: &str) -> ServerConfig {
    ServerConfig {
        name: ServerName::parse(name).unwrap(),
        transport: Transport::Stdio(StdioServer {
            command: Command::parse("/bin/true").unwrap(),
            args: vec![],
            env: vec![],
            sandbox: Default::default(),
        }),
        tools: Default::default(),
        policy: Default::default(),
    }
}

#[test]
fn start_serves_both_sockets_on_a_temporary_home_and_stops_cleanly() {
    let base = temp_base("serve");
    let home = Home::at(base.join("home")).unwrap();
    home.update(|c| {
        c.add_server(stdio_server("idle"))
            .map_err(|_| StoreError::RoundTrip)
    })
    .unwrap();
    let mut notices = Vec::new();
    let started = start::start(
        home.clone(),
        &Hardened::default(),
        options(&base),
        &mut |l| notices.push(l.to_owned()),
    )
    .unwrap();
    assert!(notices.is_empty(), "{notices:?}");
    assert!(!started.interactive());
    // Nothing listens before serve.
    assert!(!base.join("run").join("agent.sock").exists());

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (ready_tx, ready_rx) = oneshot::channel::<Ready>();
    let own = nix::unistd::geteuid().as_raw();
    let (served, (hello, status, sockets)) = rt.block_on(async {
        let serving = started.serve(
            async {
                let _ = stop_rx.await;
            },
            move |r| {
                let _ = ready_tx.send(r.clone());
            },
        );
        let client = async {
            let ready = tokio::time::timeout(Duration::from_secs(20), ready_rx)
                .await
                .expect("ready in time")
                .unwrap();
            let mut agent = Connection::connect(&ready.agent_socket).await.unwrap();
            let hello = agent
                .request(
                    "hello",
                    json!({"protocol": PROTOCOL_VERSION, "client": "start-test"}),
                )
                .await
                .unwrap();
            let mut operator = Connection::connect_as(&ready.operator_socket, own)
                .await
                .unwrap();
            operator.hello("start-test").await.unwrap();
            let status = operator.request("status", json!({})).await.unwrap();
            stop_tx.send(()).unwrap();
            (hello, status, ready)
        };
        tokio::join!(serving, client)
    });
    served.unwrap();
    assert!(hello.is_object(), "{hello}");
    assert_eq!(status["interactive"], false, "{status}");
    let servers = status["servers"].as_array().expect("servers");
    assert_eq!(servers.len(), 1, "{status}");
    assert_eq!(servers[0]["name"], "idle", "{status}");
    // Stopped cleanly: both sockets removed, and the log verifies with the run's start and stop.
    assert!(!sockets.agent_socket.exists());
    assert!(!sockets.operator_socket.exists());
    let mut kinds = Vec::new();
    iteron_broker::audit::visit(home.dir(), |r| {
        kinds.push(r["kind"].as_str().unwrap_or_default().to_owned())
    })
    .unwrap();
    assert_eq!(
        kinds.first().map(String::as_str),
        Some("broker_start"),
        "{kinds:?}"
    );
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("broker_stop"),
        "{kinds:?}"
    );
    fs::remove_dir_all(base).unwrap();
}

#[test]
fn start_refuses_bad_options_and_an_unreadable_configuration_before_anything_listens() {
    let base = temp_base("refuse");
    let home = Home::at(base.join("home")).unwrap();
    let no_notice = &mut |l: &str| panic!("unexpected notice {l}");

    // Another uid without an explicit agent socket: the default lies inside the private home.
    let mut o = options(&base);
    o.agent_socket = None;
    o.allow_uids = vec![65534];
    let e = start::start(home.clone(), &Hardened::default(), o, no_notice)
        .err()
        .expect("refused");
    assert!(matches!(e, StartError::Options(_)), "{e}");
    assert!(e.to_string().starts_with("--socket is required"), "{e}");

    // A --repo that names no directory.
    let mut o = options(&base);
    o.repo = Some(base.join("no-such-repo"));
    let e = start::start(home.clone(), &Hardened::default(), o, no_notice)
        .err()
        .expect("refused");
    assert!(
        e.to_string().starts_with("--repo names no directory"),
        "{e}"
    );

    // A configuration that does not parse: refused as the store refuses it, nothing created.
    home.update(|c| {
        c.add_server(stdio_server("a"))
            .map_err(|_| StoreError::RoundTrip)
    })
    .unwrap();
    fs::write(
        home.config_path(),
        b"{\"schema_version\": 2, \"mcp_servers\": [,]}",
    )
    .unwrap();
    let e = start::start(
        home.clone(),
        &Hardened::default(),
        options(&base),
        no_notice,
    )
    .err()
    .expect("refused");
    assert!(
        matches!(e, StartError::Config(StoreError::Invalid { .. })),
        "{e}"
    );
    assert!(!base.join("run").exists());
    assert!(!home.dir().join("audit").exists());
    fs::remove_dir_all(base).unwrap();
}
