#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The noninteractive OAuth paths (issue 13) against scripted servers on loopback: the
//! externally managed token's endpoints, the client-credentials and JWT-bearer grants, DPoP
//! and the enterprise-managed (ID-JAG) exchange. Every refusal is proven by what a recording
//! server did NOT receive, and every request by what it did.

#[allow(dead_code)]
#[path = "support/scripted.rs"]
mod scripted;

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
    connect_with(home, s, lookup, Options::default()).await
}

/// [`connect`] with the client `options`.
async fn connect_with(
    home: &Home,
    s: &ServerConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    options: Options,
) -> Result<iteron_broker::mcp::client::Client, ConnectError> {
    servers::connect_with_credentials(
        s,
        &Default::default(),
        lookup,
        options,
        home,
        servers::SpawnContext {
            home: home.dir().to_path_buf(),
            ceiling: Config::default().ceiling(),
            egress: None,
        },
        &LearnedSecrets::default(),
    )
    .await
}

/// Client options that speak MCP 2025-11-25 only.
fn pinned_2025_11_25() -> Options {
    use iteron_broker::mcp::version::{Version, VersionPolicy};
    Options {
        version: VersionPolicy::Pin(Version::V2025_11_25),
        ..Options::default()
    }
}

/// A reply with `status` and nothing else.
fn empty(status: u16) -> Reply {
    Reply {
        status,
        headers: Vec::new(),
        body: String::new(),
    }
}

/// The answer to the JSON-RPC `initialize` request `rpc` of a 2025-11-25 server with tools.
fn initialized(rpc: &Value, name: &str) -> Reply {
    Reply::json(json!({"jsonrpc": "2.0", "id": rpc["id"], "result": {
        "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
        "serverInfo": {"name": name, "version": "1"}}}))
}

/// Require a logout of an externally managed token to have come to `want` at `revoke_url`.
fn assert_revoked(
    out: &Result<servers::ExternalLogout, ConnectError>,
    want: iteron_broker::oauth::Revoked,
) {
    assert!(
        matches!(out, Ok(servers::ExternalLogout::Revoked(r)) if *r == want),
        "{:?}",
        out.as_ref().err().map(|e| e.to_string())
    );
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
    iteron_test_support::record!(
        "P16",
        json!({"refused_zone": "loopback", "binding": "public"}),
    );
}

#[tokio::test]
async fn an_external_tokens_revoke_url_obeys_the_binding_zone_of_its_server() {
    let auth = Server::start(|_| {
        Arc::new(|req: &Seen| match (req.method.as_str(), req.path()) {
            ("POST", "/revoke") => Reply::json(json!({})),
            _ => Reply::not_found(),
        })
    })
    .await;
    let block = |url: &str| {
        server(json!({
            "name": "ci-revoke", "transport": "http", "url": url,
            "oauth": {
                "access_token_env": "T", "refresh_token_env": "R",
                "refresh_url": format!("{}/token", auth.base()),
                "revoke_url": format!("{}/revoke", auth.base()),
                "client_id": "ci-client",
            },
        }))
    };
    let lookup = env(&[("T", "live-access"), ("R", "live-refresh")]);
    // A server on a public name: its loopback revoke_url is never contacted, and the logout
    // says the revocation failed (not that there is nothing to revoke).
    let public = block("https://mcp.example/mcp");
    let out = servers::logout_external(&public, &Default::default(), &lookup).await;
    assert_revoked(&out, iteron_broker::oauth::Revoked::Failed);
    auth.assert_untouched("a public server's revoke_url on loopback")
        .await;
    // The control: the same block for a loopback server revokes both tokens there.
    let local = block("http://127.0.0.1:9/mcp");
    let out = servers::logout_external(&local, &Default::default(), &lookup).await;
    assert_revoked(&out, iteron_broker::oauth::Revoked::Revoked);
    let seen = auth.to("/revoke");
    assert_eq!(seen.len(), 2, "{seen:?}");
    let tokens: Vec<String> = seen.iter().map(|r| r.form()["token"].clone()).collect();
    assert!(tokens.contains(&"live-refresh".to_owned()), "{tokens:?}");
    assert!(tokens.contains(&"live-access".to_owned()), "{tokens:?}");
    iteron_test_support::record!(
        "P16",
        json!({"refused_zone": "loopback", "binding": "public", "endpoint": "revoke_url"}),
    );
}

/// The bearer a request to the MCP endpoint carried (`Bearer <token>`), if any.
fn bearer_of(req: &Seen) -> Option<String> {
    req.header("authorization")
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned)
}

/// A stateful (2025-11-25) MCP server that is also the authorization server of its externally
/// managed token: `/token` issues `at-<n>` (living 1 s, inside the 30 s renewal margin, so every
/// request must be preceded by a renewal) with `rt-<n>`, `/revoke` accepts; at `/mcp` the
/// standalone `GET` stream ends at once (so it is reopened every second), and the answer to a
/// `tools/call` comes only on a resumption (`GET` with `Last-Event-ID`).
fn stateful_external(_base: &str) -> scripted::Script {
    let issued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let call_id = Arc::new(std::sync::Mutex::new(Value::Null));
    let sse = |body: String| Reply {
        status: 200,
        headers: vec![("Content-Type".into(), "text/event-stream".into())],
        body,
    };
    Arc::new(move |req: &Seen| {
        let rpc = req.json();
        match (req.method.as_str(), req.path(), rpc["method"].as_str()) {
            ("POST", "/token", _) => {
                let n = issued.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                Reply::json(
                    json!({"access_token": format!("at-{n}"), "token_type": "Bearer",
                    "expires_in": 1, "refresh_token": format!("rt-{n}")}),
                )
            }
            ("POST", "/revoke", _) => Reply::json(json!({})),
            ("POST", "/mcp", Some("initialize")) => {
                let mut r = initialized(&rpc, "stateful-external");
                r.headers.push(("Mcp-Session-Id".into(), "s1".into()));
                r
            }
            ("POST", "/mcp", Some("notifications/initialized")) => empty(202),
            ("POST", "/mcp", Some("tools/call")) => {
                *call_id.lock().unwrap() = rpc["id"].clone();
                sse("id: ev-1\nretry: 100\ndata: \n\n".into())
            }
            ("GET", "/mcp", _) if req.header("last-event-id").is_some() => {
                let answer = json!({"jsonrpc": "2.0", "id": *call_id.lock().unwrap(),
                    "result": {"content": [{"type": "text", "text": "resumed"}]}});
                sse(format!("event: message\nid: ev-2\ndata: {answer}\n\n"))
            }
            ("GET", "/mcp", _) => sse(": open\n\n".into()),
            ("DELETE", "/mcp", _) => Reply::json(json!({})),
            _ => Reply::not_found(),
        }
    })
}

#[tokio::test]
async fn no_request_of_a_stateful_session_carries_an_expired_or_revoked_external_token() {
    let t = TempHome::new("ext-stateful");
    let home = t.home();
    let s = Server::start(stateful_external).await;
    let cfg = server(json!({
        "name": "ext-stateful", "transport": "http", "url": format!("{}/mcp", s.base()),
        "oauth": {
            "access_token_env": "T", "expires_at_env": "E",
            "refresh_url": format!("{}/token", s.base()), "refresh_token_env": "R",
            "revoke_url": format!("{}/revoke", s.base()), "client_id": "ci-client",
        },
    }));
    let lookup = env(&[("T", "at-0"), ("E", &expired()), ("R", "rt-0")]);
    let client = connect_with(&home, &cfg, &lookup, pinned_2025_11_25())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let out = client
        .call_tool("echo", serde_json::Map::new())
        .await
        .unwrap();
    assert_eq!(out.text, "resumed");
    // The standalone stream ends at once and is reopened every second: wait for two reopenings,
    // then log out right after one (the next is a second away).
    let listener_gets = |s: &Server| {
        s.to("/mcp")
            .iter()
            .filter(|r| r.method == "GET" && r.header("last-event-id").is_none())
            .count()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while listener_gets(&s) < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "the stream was not reopened"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let out = servers::logout_external(&cfg, &Default::default(), &lookup).await;
    assert_revoked(&out, iteron_broker::oauth::Revoked::Revoked);
    let at_logout = s.to("/mcp").len();
    // Long enough for another reopening of the stream, then the session's DELETE.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    client.close().await;
    let mcp = s.to("/mcp");
    let revoked: Vec<String> = s
        .to("/revoke")
        .iter()
        .map(|r| r.form()["token"].clone())
        .collect();
    assert_eq!(revoked.len(), 2, "{revoked:?}");
    // Every token lives 1 s, inside the renewal margin: each request must carry one renewed
    // for it. A token seen before was reused at or past its expiry.
    let mut used: Vec<String> = Vec::new();
    for (i, req) in mcp.iter().enumerate() {
        let what = format!(
            "request {i} ({} {})",
            req.method,
            req.json()["method"]
                .as_str()
                .or(req.header("last-event-id").map(|_| "resumption"))
                .unwrap_or("stream")
        );
        let token = bearer_of(req).unwrap_or_else(|| panic!("{what} carried no token"));
        assert_ne!(token, "at-0", "{what} carried the expired token");
        assert!(
            !used.contains(&token),
            "{what} carried {token} again, past its expiry: {used:?}"
        );
        used.push(token);
    }
    let kinds = |pred: &dyn Fn(&Seen) -> bool| mcp.iter().filter(|r| pred(r)).count();
    assert!(kinds(&|r| r.method == "GET" && r.header("last-event-id").is_some()) >= 1);
    assert!(kinds(&|r| r.method == "GET" && r.header("last-event-id").is_none()) >= 3);
    // After the logout nothing carries a revoked token: the stream is not reopened with it,
    // and the session's DELETE is not sent with it (it is not sent at all).
    for req in &mcp[at_logout..] {
        let token = bearer_of(req);
        assert!(
            token.as_ref().is_none_or(|t| !revoked.contains(t)),
            "{} after the logout carried the revoked {token:?}",
            req.method
        );
    }
    assert!(
        mcp.iter().all(|r| r.method != "DELETE"),
        "the DELETE was sent without a token the source gives"
    );
    assert_eq!(mcp.len(), at_logout, "a request followed the logout");
    iteron_test_support::record!(
        "P16",
        json!({"requests": mcp.len(), "revoked": revoked.len()}),
    );
}

// ---------------------------------------------------------------------------------------------
// The client-credentials grant
// ---------------------------------------------------------------------------------------------

use iteron_broker::oauth::flow::{ClientKind, OAuthClient, TokenAuth};
use iteron_broker::oauth::grant::{self, GrantRequest, Kind};
use iteron_broker::oauth::jose::SigningKey;
use iteron_broker::oauth::{ExposeSecret, OAuthError, SecretString};
use iteron_policy::url::EndpointUrl;

const CC_SECRET: &str = "cc-s3cret/with+chars";
const KEY_PEM: &str = include_str!("../../fixtures/keys/p256-test-only.pem");

fn ep(s: &str) -> EndpointUrl {
    EndpointUrl::parse(s).unwrap()
}

/// PRM at `/.well-known/oauth-protected-resource/mcp` naming `issuer`; AS metadata for `base`
/// (its token endpoint at `token`, the listed grants, no authorization endpoint or PKCE); a
/// token endpoint answering with `token_reply`.
fn cc_provider(
    base: &str,
    token: String,
    grants: Value,
    token_reply: fn() -> Reply,
) -> scripted::Script {
    let prm = json!({"resource": format!("{base}/mcp"), "authorization_servers": [base],
        "scopes_supported": ["mcp:tools"]});
    let meta = json!({"issuer": base, "token_endpoint": token, "grant_types_supported": grants,
        "revocation_endpoint": format!("{base}/revoke")});
    Arc::new(move |req: &Seen| match (req.method.as_str(), req.path()) {
        ("GET", "/.well-known/oauth-protected-resource/mcp") => Reply::json(prm.clone()),
        ("GET", "/.well-known/oauth-authorization-server") => Reply::json(meta.clone()),
        ("POST", "/token") => token_reply(),
        ("POST", "/revoke") => Reply::json(json!({})),
        _ => Reply::not_found(),
    })
}

fn issued() -> Reply {
    Reply::json(json!({"access_token": "cc-access", "token_type": "Bearer", "expires_in": 60}))
}

fn cc_request(base: &str, auth: TokenAuth) -> GrantRequest {
    let key = (auth == TokenAuth::PrivateKeyJwt)
        .then(|| Arc::new(SigningKey::from_pem(KEY_PEM).unwrap()));
    let secret =
        (auth != TokenAuth::PrivateKeyJwt).then(|| SecretString::from(CC_SECRET.to_owned()));
    GrantRequest {
        server: ep(&format!("{base}/mcp")),
        resource: None,
        issuer: base.to_owned(),
        scopes: None,
        client: OAuthClient {
            id: "ci client".into(),
            secret,
            key,
            dpop: None,
            auth,
            kind: ClientKind::PreRegistered,
            issuer: base.to_owned(),
        },
        kind: Kind::ClientCredentials,
        identity: None,
        dpop: false,
        idp: None,
    }
}

fn loopback() -> iteron_broker::net::ZoneClient {
    iteron_broker::net::Net::new(Default::default())
        .unwrap()
        .client(iteron_policy::zone::Zone::Loopback)
        .unwrap()
}

/// Check an ES256 compact JWS against the public JWK of `key` (independently of the signer).
fn verifies(key: &SigningKey, jws: &str) -> bool {
    use base64::Engine;
    let jwk = key.public_jwk().unwrap();
    let d = |s: &str| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s)
            .unwrap()
    };
    let mut point = vec![4u8];
    point.extend(d(jwk["x"].as_str().unwrap()));
    point.extend(d(jwk["y"].as_str().unwrap()));
    let (input, sig) = jws.rsplit_once('.').unwrap();
    ring::signature::UnparsedPublicKey::new(&ring::signature::ECDSA_P256_SHA256_FIXED, &point)
        .verify(input.as_bytes(), &d(sig))
        .is_ok()
}

#[tokio::test]
async fn client_credentials_authenticates_with_basic_post_or_a_signed_assertion_and_sends_resource()
{
    for auth in [TokenAuth::Basic, TokenAuth::Post, TokenAuth::PrivateKeyJwt] {
        let s = Server::start(|base| {
            cc_provider(
                base,
                format!("{base}/token"),
                json!(["client_credentials"]),
                issued,
            )
        })
        .await;
        let out = grant::obtain(&loopback(), &cc_request(&s.base(), auth), None)
            .await
            .unwrap_or_else(|e| panic!("{auth:?}: {e}"));
        assert_eq!(out.tokens.access.expose_secret(), "cc-access");
        assert_eq!(out.resource, format!("{}/mcp", s.base()));
        assert_eq!(out.requested.as_deref(), Some("mcp:tools"));
        let seen = s.to("/token");
        assert_eq!(seen.len(), 1, "{auth:?}: one request, no retry");
        let form = seen[0].form();
        assert_eq!(form["grant_type"], "client_credentials");
        assert_eq!(form["resource"], format!("{}/mcp", s.base()));
        assert_eq!(form["scope"], "mcp:tools");
        match auth {
            TokenAuth::Basic => {
                use base64::Engine;
                // RFC 6749 §2.3.1: both parts form-encoded before base64.
                let want = base64::engine::general_purpose::STANDARD
                    .encode("ci+client:cc-s3cret%2Fwith%2Bchars");
                assert_eq!(
                    seen[0].header("authorization"),
                    Some(format!("Basic {want}").as_str())
                );
                assert!(!form.contains_key("client_secret"));
            }
            TokenAuth::Post => {
                assert_eq!(form["client_id"], "ci client");
                assert_eq!(form["client_secret"], CC_SECRET);
                assert!(seen[0].header("authorization").is_none());
            }
            _ => {
                assert!(seen[0].header("authorization").is_none());
                assert!(!seen[0].body.contains("s3cret"));
                assert_eq!(
                    form["client_assertion_type"],
                    "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
                );
                let jws = &form["client_assertion"];
                let key = SigningKey::from_pem(KEY_PEM).unwrap();
                assert!(verifies(&key, jws), "the assertion does not verify");
                let (h, c) = iteron_broker::oauth::jose::decode_unverified(jws).unwrap();
                assert_eq!(h["alg"], "ES256");
                assert_eq!(c["iss"], "ci client");
                assert_eq!(c["sub"], "ci client");
                assert_eq!(c["aud"], s.base());
                assert_eq!(
                    c["exp"].as_u64().unwrap() - c["iat"].as_u64().unwrap(),
                    iteron_broker::oauth::flow::CLIENT_ASSERTION_LIFETIME_SECS
                );
                assert!(c["jti"].as_str().is_some_and(|j| j.len() >= 32));
            }
        }
    }
}

#[tokio::test]
async fn the_clients_credentials_never_leave_the_pinned_issuers_origin_and_a_refusal_is_final() {
    // A token endpoint on another origin: neither the secret nor an assertion is sent at all.
    let elsewhere = Server::start(|_| Arc::new(|_: &Seen| issued())).await;
    let target = format!("{}/token", elsewhere.base());
    for auth in [TokenAuth::Basic, TokenAuth::Post, TokenAuth::PrivateKeyJwt] {
        let target = target.clone();
        let s = Server::start(move |base| {
            cc_provider(base, target, json!(["client_credentials"]), issued)
        })
        .await;
        let e = grant::obtain(&loopback(), &cc_request(&s.base(), auth), None)
            .await
            .err()
            .unwrap();
        assert!(
            matches!(
                e,
                OAuthError::BadEndpoint {
                    which: "token_endpoint",
                    ..
                }
            ),
            "{auth:?}: {e}"
        );
        s.assert_only_discovery("a cross-origin token endpoint");
    }
    elsewhere
        .assert_untouched("the other origin's token endpoint")
        .await;
    // Metadata that lists its grants without client_credentials: nothing is posted.
    let s = Server::start(|base| {
        cc_provider(
            base,
            format!("{base}/token"),
            json!(["authorization_code"]),
            issued,
        )
    })
    .await;
    let e = grant::obtain(&loopback(), &cc_request(&s.base(), TokenAuth::Basic), None)
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("grant_types_supported"), "{e}");
    s.assert_only_discovery("an unlisted grant");
    // A refusal is the answer: one request, never repeated.
    fn refused() -> Reply {
        Reply::status(401, json!({"error": "invalid_client"}))
    }
    let s = Server::start(|base| {
        cc_provider(
            base,
            format!("{base}/token"),
            json!(["client_credentials"]),
            refused,
        )
    })
    .await;
    let e = grant::obtain(&loopback(), &cc_request(&s.base(), TokenAuth::Basic), None)
        .await
        .err()
        .unwrap();
    assert_eq!(
        e.to_string(),
        "the authorization server answered 401 invalid_client"
    );
    assert_eq!(s.to("/token").len(), 1);
    // A public client cannot use the grant: nothing is sent.
    let s = Server::start(|base| {
        cc_provider(
            base,
            format!("{base}/token"),
            json!(["client_credentials"]),
            issued,
        )
    })
    .await;
    let mut public = cc_request(&s.base(), TokenAuth::None);
    public.client.secret = None;
    assert!(grant::obtain(&loopback(), &public, None).await.is_err());
    s.assert_only_discovery("a public client");
    iteron_test_support::record!(
        "P16",
        json!({"methods": ["client_secret_basic", "client_secret_post", "private_key_jwt"]}),
    );
}

// ---------------------------------------------------------------------------------------------
// Workload identity: the JWT-bearer grant
// ---------------------------------------------------------------------------------------------

use iteron_broker::oauth::grant::{IdentitySource, IdentityToken};

const JWT_BEARER: &str = "urn:ietf:params:oauth:grant-type:jwt-bearer";

/// A token endpoint that accepts every assertion except `refused-*` ones (`invalid_grant`).
fn judge() -> Reply {
    Reply::json(json!({"access_token": "wl-access", "token_type": "Bearer", "expires_in": 60}))
}

fn jb_provider(base: &str) -> scripted::Script {
    let prm = json!({"resource": format!("{base}/mcp"), "authorization_servers": [base]});
    let meta = json!({"issuer": base, "token_endpoint": format!("{base}/token"),
        "grant_types_supported": [JWT_BEARER]});
    Arc::new(move |req: &Seen| match (req.method.as_str(), req.path()) {
        ("GET", "/.well-known/oauth-protected-resource/mcp") => Reply::json(prm.clone()),
        ("GET", "/.well-known/oauth-authorization-server") => Reply::json(meta.clone()),
        ("POST", "/token") if req.form()["assertion"].starts_with("refused") => {
            Reply::status(400, json!({"error": "invalid_grant"}))
        }
        ("POST", "/token") => judge(),
        _ => Reply::not_found(),
    })
}

fn jb_request(base: &str, identity: IdentityToken, client_id: &str) -> GrantRequest {
    GrantRequest {
        server: ep(&format!("{base}/mcp")),
        resource: None,
        issuer: base.to_owned(),
        scopes: Some("mcp:tools".into()),
        client: OAuthClient {
            id: client_id.into(),
            secret: None,
            key: None,
            dpop: None,
            auth: TokenAuth::None,
            kind: ClientKind::PreRegistered,
            issuer: base.to_owned(),
        },
        kind: Kind::JwtBearer,
        identity: Some(identity),
        dpop: false,
        idp: None,
    }
}

fn write_token(path: &std::path::Path, token: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("{token}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

#[tokio::test]
async fn the_identity_token_is_reread_for_every_exchange_and_a_refused_one_is_never_presented_again()
 {
    let t = TempHome::new("wif");
    let file = t.0.join("token.jwt");
    let s = Server::start(jb_provider).await;
    let identity = IdentityToken::new(IdentitySource::File(file.clone()));
    let req = jb_request(&s.base(), identity.clone(), "workload-1");
    write_token(&file, "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ3bCJ9.c2ln");
    let out = grant::obtain(&loopback(), &req, None).await.unwrap();
    assert_eq!(out.tokens.access.expose_secret(), "wl-access");
    let form = s.to("/token")[0].form();
    assert_eq!(form["grant_type"], JWT_BEARER);
    assert_eq!(
        form["assertion"],
        "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ3bCJ9.c2ln"
    );
    assert_eq!(form["client_id"], "workload-1");
    assert_eq!(form["resource"], format!("{}/mcp", s.base()));
    assert_eq!(form["scope"], "mcp:tools");
    // The runtime rotates the file: the next exchange presents the new token.
    write_token(&file, "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ3bDIifQ.c2lnMg");
    grant::obtain(&loopback(), &req, None).await.unwrap();
    assert_eq!(
        s.to("/token")[1].form()["assertion"],
        "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ3bDIifQ.c2lnMg"
    );
    // Refused once: the same token is never presented again, by any clone of the request.
    write_token(&file, "refused-a.eyJzdWIiOiJ3bCJ9.c2ln");
    let e = grant::obtain(&loopback(), &req, None).await.err().unwrap();
    assert_eq!(
        e.to_string(),
        "the authorization server answered 400 invalid_grant"
    );
    assert_eq!(s.to("/token").len(), 3);
    let again = jb_request(&s.base(), identity.clone(), "workload-1");
    let e = grant::obtain(&loopback(), &again, None)
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("is not presented again"), "{e}");
    assert_eq!(
        s.to("/token").len(),
        3,
        "a refused identity token was presented again"
    );
    // A new token is tried.
    write_token(&file, "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ3bDMifQ.c2lnMw");
    grant::obtain(&loopback(), &req, None).await.unwrap();
    assert_eq!(s.to("/token").len(), 4);
    // Without a client id, none is sent.
    let anonymous = jb_request(&s.base(), identity, "");
    grant::obtain(&loopback(), &anonymous, None).await.unwrap();
    assert!(!s.to("/token")[4].form().contains_key("client_id"));
    iteron_test_support::record!("P16", json!({"exchanges": s.to("/token").len()}),);
}

#[tokio::test]
async fn a_refused_identity_token_is_not_presented_again_by_a_later_connect_of_the_same_server() {
    // The broker builds a new grant request at every connect: what the authorization server
    // refused must outlive the request, or a failing server would present the same refused
    // token at every retry of the registry.
    let t = TempHome::new("wif-reconnect");
    let file = t.0.join("token.jwt");
    let s = Server::start(jb_provider).await;
    write_token(&file, "refused-b.eyJzdWIiOiJ3bCJ9.c2ln");
    let cfg = server(
        json!({"name": "wif-reconnect", "transport": "http", "url": format!("{}/mcp", s.base()),
        "oauth": {"grant": "jwt_bearer", "issuer": s.base(), "client_id": "workload-1",
                  "identity_token_file": file.to_str().unwrap()}}),
    );
    let home = t.home();
    let first = connect(&home, &cfg, &env(&[])).await.err().unwrap();
    assert!(first.to_string().contains("invalid_grant"), "{first}");
    assert_eq!(s.to("/token").len(), 1);
    for _ in 0..3 {
        let again = connect(&home, &cfg, &env(&[])).await.err().unwrap();
        assert!(
            again.to_string().contains("is not presented again"),
            "{again}"
        );
    }
    assert_eq!(
        s.to("/token").len(),
        1,
        "a later connect presented the refused identity token again"
    );
    // Another server with the same token file has its own memory (its own authorization
    // server may accept the token).
    let other = server(
        json!({"name": "wif-reconnect-2", "transport": "http", "url": format!("{}/mcp", s.base()),
        "oauth": {"grant": "jwt_bearer", "issuer": s.base(), "client_id": "workload-1",
                  "identity_token_file": file.to_str().unwrap()}}),
    );
    let _ = connect(&home, &other, &env(&[])).await;
    assert_eq!(s.to("/token").len(), 2);
    // The runtime writes a new token: the next connect presents it.
    write_token(&file, "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ3bDQifQ.c2lnNA");
    let _ = connect(&home, &cfg, &env(&[])).await;
    assert_eq!(s.to("/token").len(), 3);
    assert_eq!(
        s.to("/token")[2].form()["assertion"],
        "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ3bDQifQ.c2lnNA"
    );
    iteron_test_support::record!("P16", json!({"exchanges": s.to("/token").len()}),);
}

#[tokio::test]
async fn an_identity_token_that_cannot_be_presented_sends_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let t = TempHome::new("wif-bad");
    let file = t.0.join("token.jwt");
    let s = Server::start(jb_provider).await;
    let max = iteron_broker::oauth::flow::MAX_TOKEN_BYTES;
    let third = "c".repeat(max - 8);
    let exact = format!("aaa.bbb.{third}");
    assert_eq!(exact.len(), max);
    let cases: Vec<(String, u32, &str)> = vec![
        (String::new(), 0o600, "is empty"),
        ("not-a-jwt".into(), 0o600, "is not one compact JWT"),
        ("a.b.c.d".into(), 0o600, "is not one compact JWT"),
        ("a.b c.d".into(), 0o600, "is not one compact JWT"),
        ("aaa.bbb.ccc".into(), 0o666, "writable by group or others"),
        (format!("{exact}c"), 0o600, "is longer than 16 KiB"),
        (format!("{exact}cc\n"), 0o600, "larger than 16385 bytes"),
    ];
    for (content, mode, why) in &cases {
        std::fs::write(&file, content).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(*mode)).unwrap();
        let req = jb_request(
            &s.base(),
            IdentityToken::new(IdentitySource::File(file.clone())),
            "w",
        );
        let e = grant::obtain(&loopback(), &req, None).await.err().unwrap();
        let line = e.to_string();
        assert!(line.contains(why), "{} bytes: {line}", content.len());
        assert!(
            !line.contains("aaa.bbb"),
            "the token reached the error: {line}"
        );
    }
    assert!(s.to("/token").is_empty(), "{:?}", s.to("/token"));
    // At the bound it is presented (16 KiB and a newline).
    std::fs::write(&file, format!("{exact}\n")).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let req = jb_request(
        &s.base(),
        IdentityToken::new(IdentitySource::File(file.clone())),
        "w",
    );
    grant::obtain(&loopback(), &req, None).await.unwrap();
    assert_eq!(s.to("/token")[0].form()["assertion"], exact);
    let missing = jb_request(
        &s.base(),
        IdentityToken::new(IdentitySource::File(t.0.join("absent"))),
        "w",
    );
    let e = grant::obtain(&loopback(), &missing, None)
        .await
        .err()
        .unwrap();
    assert!(
        e.to_string()
            .starts_with("the identity token file cannot be opened"),
        "{e}"
    );
    iteron_test_support::record!("P5", json!({"max_token_bytes": max}),);
}

// ---------------------------------------------------------------------------------------------
// DPoP at the token endpoint
// ---------------------------------------------------------------------------------------------

/// What the scripted token endpoint does with DPoP requests.
#[derive(Clone, Copy)]
enum AsMode {
    /// Wants the nonce `as-n1`, then issues a DPoP-bound token.
    Nonce,
    /// A new nonce every time: never satisfied.
    NeverSatisfied,
    /// Refuses the client, offering a nonce anyway.
    InvalidClient,
    /// Issues a Bearer token whatever the proof.
    Bearer,
}

fn dpop_provider(base: &str, mode: AsMode) -> scripted::Script {
    let prm = json!({"resource": format!("{base}/mcp"), "authorization_servers": [base]});
    let meta = json!({"issuer": base, "token_endpoint": format!("{base}/token"),
        "revocation_endpoint": format!("{base}/revoke"),
        "dpop_signing_alg_values_supported": ["ES256"]});
    Arc::new(move |req: &Seen| match (req.method.as_str(), req.path()) {
        ("GET", "/.well-known/oauth-protected-resource/mcp") => Reply::json(prm.clone()),
        ("GET", "/.well-known/oauth-authorization-server") => Reply::json(meta.clone()),
        ("POST", "/revoke") => Reply::json(json!({})),
        ("POST", "/token") => {
            let nonce = req
                .header("dpop")
                .and_then(iteron_broker::oauth::jose::decode_unverified)
                .and_then(|(_, c)| c["nonce"].as_str().map(str::to_owned));
            let challenge = |n: &str| {
                let mut r = Reply::status(400, json!({"error": "use_dpop_nonce"}));
                r.headers.push(("DPoP-Nonce".into(), n.into()));
                r
            };
            let bound = json!({"access_token": "bound-at", "token_type": "DPoP", "expires_in": 60});
            match mode {
                AsMode::Nonce if nonce.as_deref() == Some("as-n1") => Reply::json(bound),
                AsMode::Nonce => challenge("as-n1"),
                AsMode::NeverSatisfied => challenge(&format!("n{}", nonce.unwrap_or_default())),
                AsMode::InvalidClient => {
                    let mut r = Reply::status(401, json!({"error": "invalid_client"}));
                    r.headers.push(("DPoP-Nonce".into(), "as-n9".into()));
                    r
                }
                AsMode::Bearer => Reply::json(
                    json!({"access_token": "plain-at", "token_type": "Bearer", "expires_in": 60}),
                ),
            }
        }
        _ => Reply::not_found(),
    })
}

fn dpop_request(base: &str) -> GrantRequest {
    GrantRequest {
        dpop: true,
        ..cc_request(base, TokenAuth::Basic)
    }
}

#[tokio::test]
async fn a_dpop_token_request_answers_one_nonce_challenge_and_never_accepts_a_bearer_token() {
    let s = Server::start(|base| dpop_provider(base, AsMode::Nonce)).await;
    let out = grant::obtain(&loopback(), &dpop_request(&s.base()), None)
        .await
        .unwrap();
    assert_eq!(out.tokens.access.expose_secret(), "bound-at");
    let key = out
        .client
        .dpop
        .clone()
        .expect("the client holds its DPoP key");
    let seen = s.to("/token");
    assert_eq!(
        seen.len(),
        2,
        "refused for the nonce once, then sent with it"
    );
    let claims: Vec<Value> = seen
        .iter()
        .map(|r| {
            let (h, c) =
                iteron_broker::oauth::jose::decode_unverified(r.header("dpop").unwrap()).unwrap();
            assert_eq!(h["typ"], "dpop+jwt");
            assert!(h["jwk"].get("d").is_none());
            c
        })
        .collect();
    for c in &claims {
        assert_eq!(c["htm"], "POST");
        assert_eq!(c["htu"], format!("{}/token", s.base()));
        assert!(c.get("ath").is_none());
    }
    assert!(claims[0].get("nonce").is_none());
    assert_eq!(claims[1]["nonce"], "as-n1");
    assert_ne!(claims[0]["jti"], claims[1]["jti"]);
    assert_eq!(
        seen[0].form(),
        seen[1].form(),
        "the same grant, sent once more"
    );
    assert_eq!(key.as_nonce().as_deref(), Some("as-n1"));
    // Never satisfied: exactly one resend, then the refusal.
    let s = Server::start(|base| dpop_provider(base, AsMode::NeverSatisfied)).await;
    let e = grant::obtain(&loopback(), &dpop_request(&s.base()), None)
        .await
        .err()
        .unwrap();
    assert_eq!(
        e.to_string(),
        "the authorization server answered 400 use_dpop_nonce"
    );
    assert_eq!(s.to("/token").len(), 2);
    // Another refusal that offers a nonce is not a nonce challenge: no resend.
    let s = Server::start(|base| dpop_provider(base, AsMode::InvalidClient)).await;
    assert!(
        grant::obtain(&loopback(), &dpop_request(&s.base()), None)
            .await
            .is_err()
    );
    assert_eq!(s.to("/token").len(), 1);
    // A Bearer token where a DPoP-bound one was asked for is refused and revoked.
    let s = Server::start(|base| dpop_provider(base, AsMode::Bearer)).await;
    let e = grant::obtain(&loopback(), &dpop_request(&s.base()), None)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(e, OAuthError::UnusableTokens { why, .. } if why.contains("a DPoP-bound token was asked for")),
        "{e}"
    );
    let revoked = s.to("/revoke");
    assert_eq!(revoked.len(), 1);
    assert_eq!(revoked[0].form()["token"], "plain-at");
    iteron_test_support::record!("P16", json!({"resends_per_nonce_challenge": 1}),);
}

// ---------------------------------------------------------------------------------------------
// Enterprise-managed authorization (ID-JAG)
// ---------------------------------------------------------------------------------------------

use iteron_broker::oauth::grant::IdentityProvider;

const ID_TOKEN: &str = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ1c2VyIn0.aWQtdG9rZW4";
const ID_JAG: &str = "eyJ0eXAiOiJvYXV0aC1pZC1qYWcrand0In0.eyJzdWIiOiJ1c2VyIn0.amFn";
const IDP_SECRET: &str = "idp-s3cret";

/// An identity provider whose token endpoint answers the exchange with `answer`.
fn idp_script(base: &str, answer: fn() -> Reply) -> scripted::Script {
    let meta = json!({"issuer": base, "token_endpoint": format!("{base}/token"),
        "grant_types_supported": ["urn:ietf:params:oauth:grant-type:token-exchange"]});
    Arc::new(move |req: &Seen| match (req.method.as_str(), req.path()) {
        ("GET", "/.well-known/oauth-authorization-server") => Reply::json(meta.clone()),
        ("POST", "/token") => answer(),
        _ => Reply::not_found(),
    })
}

fn jag_issued() -> Reply {
    Reply::json(json!({"access_token": ID_JAG, "token_type": "N_A",
        "issued_token_type": "urn:ietf:params:oauth:token-type:id-jag"}))
}

fn jag_mislabelled() -> Reply {
    Reply::json(json!({"access_token": ID_JAG, "token_type": "Bearer",
        "issued_token_type": "urn:ietf:params:oauth:token-type:access_token"}))
}

fn jag_refused() -> Reply {
    Reply::status(400, json!({"error": "invalid_grant"}))
}

fn jag_request(as_base: &str, idp_base: &str, identity: IdentityToken) -> GrantRequest {
    GrantRequest {
        kind: Kind::IdJag,
        identity: Some(identity),
        scopes: None,
        idp: Some(IdentityProvider {
            issuer: idp_base.to_owned(),
            client: OAuthClient {
                id: "idp-client".into(),
                secret: Some(SecretString::from(IDP_SECRET.to_owned())),
                key: None,
                dpop: None,
                auth: TokenAuth::Basic,
                kind: ClientKind::PreRegistered,
                issuer: idp_base.to_owned(),
            },
        }),
        ..cc_request(as_base, TokenAuth::Basic)
    }
}

/// Require `ex` to be the exchange of the ID token for an ID-JAG addressed to the authorization
/// server `as_base`, for its resource `<as_base>/mcp`.
fn assert_id_jag_exchange(ex: &Seen, as_base: &str) {
    let form = ex.form();
    assert_eq!(
        form["grant_type"],
        "urn:ietf:params:oauth:grant-type:token-exchange"
    );
    assert_eq!(
        form["requested_token_type"],
        "urn:ietf:params:oauth:token-type:id-jag"
    );
    assert_eq!(form["subject_token"], ID_TOKEN);
    assert_eq!(
        form["subject_token_type"],
        "urn:ietf:params:oauth:token-type:id_token"
    );
    assert_eq!(
        form["audience"], as_base,
        "the ID-JAG is addressed to the AS issuer"
    );
    assert_eq!(form["resource"], format!("{as_base}/mcp"));
}

#[tokio::test]
async fn an_id_token_becomes_an_id_jag_at_the_identity_provider_and_only_then_an_access_token() {
    let auth = Server::start(jb_provider).await;
    let idp = Server::start(|base| idp_script(base, jag_issued)).await;
    let identity = IdentityToken::new(IdentitySource::Value(
        SecretString::from(ID_TOKEN.to_owned()),
        "named by ID_TOKEN".into(),
    ));
    let out = grant::obtain(
        &loopback(),
        &jag_request(&auth.base(), &idp.base(), identity),
        None,
    )
    .await
    .unwrap();
    assert_eq!(out.tokens.access.expose_secret(), "wl-access");
    let ex = idp.to("/token");
    assert_eq!(ex.len(), 1);
    assert_id_jag_exchange(&ex[0], &auth.base());
    assert!(
        ex[0]
            .header("authorization")
            .is_some_and(|h| h.starts_with("Basic "))
    );
    let grant_req = auth.to("/token");
    assert_eq!(grant_req.len(), 1);
    let form = grant_req[0].form();
    assert_eq!(form["grant_type"], JWT_BEARER);
    assert_eq!(form["assertion"], ID_JAG);
    assert!(
        !grant_req[0].carries(IDP_SECRET),
        "the IdP secret went to the AS"
    );
    assert!(
        !grant_req[0].body.contains(ID_TOKEN),
        "the ID token went to the AS"
    );
    // Not labelled an ID-JAG: nothing reaches the authorization server's token endpoint.
    let auth = Server::start(jb_provider).await;
    let idp = Server::start(|base| idp_script(base, jag_mislabelled)).await;
    let identity = IdentityToken::new(IdentitySource::Value(
        SecretString::from(ID_TOKEN.to_owned()),
        "named by ID_TOKEN".into(),
    ));
    let e = grant::obtain(
        &loopback(),
        &jag_request(&auth.base(), &idp.base(), identity),
        None,
    )
    .await
    .err()
    .unwrap();
    assert!(e.to_string().contains("is not an ID-JAG"), "{e}");
    assert!(auth.to("/token").is_empty());
    // The identity provider refuses the ID token: it is never presented again.
    let idp = Server::start(|base| idp_script(base, jag_refused)).await;
    let identity = IdentityToken::new(IdentitySource::Value(
        SecretString::from(ID_TOKEN.to_owned()),
        "named by ID_TOKEN".into(),
    ));
    let req = jag_request(&auth.base(), &idp.base(), identity);
    assert!(grant::obtain(&loopback(), &req, None).await.is_err());
    let e = grant::obtain(&loopback(), &req, None).await.err().unwrap();
    assert!(e.to_string().contains("is not presented again"), "{e}");
    assert_eq!(idp.to("/token").len(), 1);
    assert!(auth.to("/token").is_empty());
    iteron_test_support::record!("P16", json!({"steps": ["token_exchange", "jwt_bearer"]}),);
}

const AS_SECRET: &str = "as-s3cret";

/// `Authorization: Basic` of a client id and secret, form-encoded first (RFC 6749 §2.3.1).
fn basic(id: &str, secret: &str) -> String {
    use base64::Engine;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!(
            "{}:{}",
            scripted::enc(id),
            scripted::enc(secret)
        ))
    )
}

/// An authorization server that is also the MCP server it protects: it issues `wl-access` for
/// the ID-JAG alone and serves a stateless 2025-11-25 MCP endpoint to that token only.
fn jag_as_and_mcp(base: &str) -> scripted::Script {
    let prm = json!({"resource": format!("{base}/mcp"), "authorization_servers": [base]});
    let meta = json!({"issuer": base, "token_endpoint": format!("{base}/token"),
        "grant_types_supported": [JWT_BEARER]});
    let challenge =
        format!("Bearer resource_metadata=\"{base}/.well-known/oauth-protected-resource/mcp\"");
    Arc::new(move |req: &Seen| {
        let rpc = req.json();
        match (req.method.as_str(), req.path()) {
            ("GET", "/.well-known/oauth-protected-resource/mcp") => Reply::json(prm.clone()),
            ("GET", "/.well-known/oauth-authorization-server") => Reply::json(meta.clone()),
            ("POST", "/token") if req.form()["assertion"] == ID_JAG => judge(),
            ("POST", "/token") => Reply::status(400, json!({"error": "invalid_grant"})),
            (_, "/mcp") if req.header("authorization") != Some("Bearer wl-access") => Reply {
                status: 401,
                headers: vec![("WWW-Authenticate".into(), challenge.clone())],
                body: String::new(),
            },
            ("POST", "/mcp") => match rpc["method"].as_str() {
                Some("initialize") => initialized(&rpc, "jag-protected"),
                Some("tools/list") => Reply::json(json!({"jsonrpc": "2.0", "id": rpc["id"],
                    "result": {"tools": [{"name": "whoami", "inputSchema": {"type": "object"}}]}})),
                _ => empty(202),
            },
            _ => empty(405),
        }
    })
}

/// An `id_jag` server entry as the operator writes it, its secrets and ID token named by
/// variables.
fn jag_config(name: &str, as_base: &str, idp_base: &str) -> ServerConfig {
    server(json!({
        "name": name, "transport": "http", "url": format!("{as_base}/mcp"),
        "oauth": {
            "grant": "id_jag", "issuer": as_base,
            "client_id": "mcp-client", "client_secret_env": "AS_SECRET",
            "idp_issuer": idp_base, "idp_client_id": "idp-client",
            "idp_client_secret_env": "IDP_SECRET", "identity_token_env": "USER_ID_TOKEN",
        },
    }))
}

#[tokio::test]
async fn a_connect_configured_for_id_jag_exchanges_the_id_token_at_the_identity_provider_first() {
    let t = TempHome::new("id-jag-config");
    let home = t.home();
    let auth = Server::start(jag_as_and_mcp).await;
    let idp = Server::start(|base| idp_script(base, jag_issued)).await;
    let lookup = env(&[
        ("AS_SECRET", AS_SECRET),
        ("IDP_SECRET", IDP_SECRET),
        ("USER_ID_TOKEN", ID_TOKEN),
    ]);
    // The broker's path: no login stored, so the connection runs the grant its configuration
    // describes, stores the token and reaches the server with it.
    let cfg = jag_config("id-jag", &auth.base(), &idp.base());
    let client = connect_with(&home, &cfg, &lookup, pinned_2025_11_25())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let tools = client.list_tools().await.unwrap();
    assert_eq!(tools.len(), 1);
    // At the identity provider: the user's ID token from its variable, exchanged for an ID-JAG
    // addressed to the authorization server, with the provider's client secret in Basic.
    let ex = idp.to("/token");
    assert_eq!(ex.len(), 1, "{ex:?}");
    assert_id_jag_exchange(&ex[0], &auth.base());
    assert_eq!(
        ex[0].header("authorization"),
        Some(basic("idp-client", IDP_SECRET).as_str())
    );
    assert!(!ex[0].body.contains(AS_SECRET) && !ex[0].carries(AS_SECRET));
    // At the authorization server: only the ID-JAG, with the MCP client's own secret.
    let grant_req = auth.to("/token");
    assert_eq!(grant_req.len(), 1, "{grant_req:?}");
    let form = grant_req[0].form();
    assert_eq!(form["grant_type"], JWT_BEARER);
    assert_eq!(form["assertion"], ID_JAG);
    assert_eq!(
        grant_req[0].header("authorization"),
        Some(basic("mcp-client", AS_SECRET).as_str())
    );
    for leaked in [IDP_SECRET, ID_TOKEN] {
        assert!(
            !grant_req[0].body.contains(leaked)
                && grant_req[0]
                    .headers
                    .iter()
                    .all(|(_, v)| !v.contains(leaked)),
            "the authorization server received what belongs to the identity provider"
        );
    }
    assert!(
        auth.to("/mcp")
            .iter()
            .all(|r| r.header("authorization") == Some("Bearer wl-access")),
        "a request reached the server without the granted token"
    );
    // The identity provider refuses another server's ID token: a later connect of that server
    // does not present it again.
    let refusing = Server::start(|base| idp_script(base, jag_refused)).await;
    let cfg = jag_config("id-jag-refused", &auth.base(), &refusing.base());
    for said in ["invalid_grant", "is not presented again"] {
        let e = connect_with(&home, &cfg, &lookup, pinned_2025_11_25())
            .await
            .err()
            .unwrap();
        let line = e.to_string();
        assert!(line.contains(said) && !line.contains(ID_TOKEN), "{line}");
    }
    assert_eq!(refusing.to("/token").len(), 1);
    assert_eq!(
        auth.to("/token").len(),
        1,
        "a refused exchange reached the AS"
    );
    iteron_test_support::record!(
        "P16",
        json!({"steps": ["token_exchange", "jwt_bearer"], "from": "configuration"}),
    );
}
