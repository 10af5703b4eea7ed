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
            auth,
            kind: ClientKind::PreRegistered,
            issuer: base.to_owned(),
        },
        kind: Kind::ClientCredentials,
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
    report::record(
        "P16",
        "broker/tests/oauth_grants.rs::the_clients_credentials_never_leave_the_pinned_issuers_origin_and_a_refusal_is_final",
        json!({"methods": ["client_secret_basic", "client_secret_post", "private_key_jwt"]}),
    );
}
