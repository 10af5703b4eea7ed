#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The noninteractive OAuth paths (issue 13) against scripted servers on loopback: the
//! externally managed token's endpoints, the client-credentials and JWT-bearer grants, DPoP
//! and the enterprise-managed (ID-JAG) exchange. Every refusal is proven by what a recording
//! server did NOT receive, and every request by what it did.

#[allow(dead_code)]
#[path = "support/scripted.rs"]
mod scripted;

#[path = "../../tests/support/report.rs"]
mod report;

use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::Arc;

use iteron_broker::mcp::client::Options;
use iteron_broker::servers::{self, ConnectError, LearnedSecrets};
use iteron_broker::store::Home;
use iteron_policy::config::{Config, ServerConfig};
use scripted::{Reply, Seen, Server};
use serde_json::{Value, json};

/// A throwaway operator home.
struct TempHome(std::path::PathBuf);

impl TempHome {
    fn new(tag: &str) -> TempHome {
        let p = std::env::temp_dir().join(format!("iteron-grants-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempHome(p)
    }

    fn home(&self) -> Home {
        Home::at(self.0.join("home")).unwrap()
    }
}

impl Drop for TempHome {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One HTTP server entry parsed from JSON (so every configuration rule applies).
fn server(entry: Value) -> ServerConfig {
    let doc = json!({"schema_version": 2, "mcp_servers": [entry]});
    let c = Config::parse(doc.to_string().as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    c.mcp_servers.into_iter().next().unwrap()
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> + Sync + use<> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |k: &str| map.get(k).map(OsString::from)
}

async fn connect(
    home: &Home,
    s: &ServerConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
) -> Result<iteron_broker::mcp::client::Client, ConnectError> {
    servers::connect_with_credentials(
        s,
        &Default::default(),
        lookup,
        Options::default(),
        home,
        Config::default().ceiling(),
        &LearnedSecrets::default(),
    )
    .await
}

fn expired() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    (now - 60).to_string()
}

fn token_endpoint() -> Arc<dyn Fn(&Seen) -> Reply + Send + Sync> {
    Arc::new(|req: &Seen| match (req.method.as_str(), req.path()) {
        ("POST", "/token") => Reply::json(json!({
            "access_token": "renewed-access",
            "token_type": "Bearer",
            "expires_in": 3600,
            "refresh_token": "rotated-refresh",
        })),
        _ => Reply::not_found(),
    })
}

#[tokio::test]
async fn an_external_tokens_refresh_url_obeys_the_binding_zone_of_its_server() {
    let t = TempHome::new("ext-zone");
    let home = t.home();
    let auth = Server::start(|_| token_endpoint()).await;
    let block = |url: &str| {
        server(json!({
            "name": "ci", "transport": "http", "url": url,
            "oauth": {
                "access_token_env": "T", "expires_at_env": "E",
                "refresh_url": format!("{}/token", auth.base()),
                "refresh_token_env": "R", "client_id": "ci-client",
            },
        }))
    };
    let lookup = env(&[
        ("T", "stale-access"),
        ("E", &expired()),
        ("R", "first-refresh"),
    ]);
    // A server on a public name: its loopback refresh_url is never contacted.
    let public = block("https://mcp.example/mcp");
    let err = connect(&home, &public, &lookup).await.err().unwrap();
    let line = err.to_string();
    assert!(
        line.contains("renewing the access token named by T") && line.contains("loopback"),
        "{line}"
    );
    auth.assert_untouched("a public server's refresh_url on loopback")
        .await;
    // The control: the same block for a loopback server renews at refresh_url (and then fails
    // to reach the MCP server, which does not exist; what matters is the refresh request).
    let local = block("http://127.0.0.1:9/mcp");
    let _ = connect(&home, &local, &lookup).await;
    let seen = auth.to("/token");
    assert_eq!(seen.len(), 1, "{seen:?}");
    let form = seen[0].form();
    assert_eq!(form["grant_type"], "refresh_token");
    assert_eq!(form["refresh_token"], "first-refresh");
    assert_eq!(form["client_id"], "ci-client");
    assert_eq!(form["resource"], "http://127.0.0.1:9/mcp");
    report::record(
        "P16",
        "broker/tests/oauth_grants.rs::an_external_tokens_refresh_url_obeys_the_binding_zone_of_its_server",
        json!({"refused_zone": "loopback", "binding": "public"}),
    );
}
