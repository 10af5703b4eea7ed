#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Adversarial fixtures for the OAuth validation rules (issue 5, items 2–5). Every refusal is
//! proven by what a recording server on loopback did NOT receive — no request, or no connection
//! at all — and not only by the error that came back.
//!
//! The pieces: a scripted HTTP/1.1 server that records every connection and request (one per
//! connection, `Connection: close`); the DNS responder from `support` for names; and a stand-in
//! for the operator's browser that records each authorization URL it is shown and sends the
//! authorization response to the loopback callback itself, forged where the test needs it.
//! Everything listens on 127.0.0.0/8.

#[allow(dead_code)]
#[path = "support/mod.rs"]
mod support;

#[allow(dead_code)]
#[path = "support/scripted.rs"]
mod scripted;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use iteron_broker::net::{Net, NetConfig, NetError, ZoneClient};
use iteron_broker::oauth::flow::{self, ClientKind, ClientSettings, Mode, OAuthClient, TokenAuth};
use iteron_broker::oauth::login::{self, LoginOutcome, LoginRequest, Previous};
use iteron_broker::oauth::metadata::{self, ServerMetadata};
use iteron_broker::oauth::{Challenge, ExposeSecret, OAuthError, SecretString};
use iteron_policy::url::EndpointUrl;
use iteron_policy::zone::Zone;
use scripted::{CLIENT_ID, FromBase, Reply, Script, Seen, Server, enc, v4};
use serde_json::{Value, json};
use support::{A, DnsServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A login that has not finished by then is stuck waiting for a callback nobody will send.
const LOGIN_LIMIT: Duration = Duration::from_secs(30);
/// A client secret that must never reach a server it is not meant for.
const SECRET: &str = "pre-registered-s3cret";

fn ep(s: &str) -> EndpointUrl {
    EndpointUrl::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// Documents and a scripted MCP server + authorization server
// ---------------------------------------------------------------------------------------------

fn mcp_url(base: &str) -> String {
    format!("{base}/mcp")
}

fn prm_doc(resource: &str, issuer: &str) -> Value {
    json!({ "resource": resource, "authorization_servers": [issuer] })
}

/// Authorization-server metadata for an issuer at `base`, every endpoint on its own origin.
fn as_doc(base: &str) -> Value {
    json!({
        "issuer": base,
        "authorization_endpoint": format!("{base}/authorize"),
        "token_endpoint": format!("{base}/token"),
        "registration_endpoint": format!("{base}/register"),
        "revocation_endpoint": format!("{base}/revoke"),
        "response_types_supported": ["code"],
        "code_challenge_methods_supported": ["S256"],
    })
}

fn token_doc() -> Value {
    json!({
        "access_token": "at-1",
        "token_type": "Bearer",
        "expires_in": 3600,
        "refresh_token": "rt-1",
    })
}

/// Routes of an MCP server's protected-resource metadata and an authorization server:
/// metadata documents (404 where `None`), a token endpoint that always issues, a registration
/// endpoint that always registers, a revocation endpoint that always accepts.
fn provider(prm: Option<Value>, meta: Option<Value>) -> Script {
    Arc::new(move |req: &Seen| match (req.method.as_str(), req.path()) {
        (
            "GET",
            "/.well-known/oauth-protected-resource/mcp" | "/.well-known/oauth-protected-resource",
        ) => prm.clone().map_or_else(Reply::not_found, Reply::json),
        ("GET", "/.well-known/oauth-authorization-server") => {
            meta.clone().map_or_else(Reply::not_found, Reply::json)
        }
        ("POST", "/token") => Reply::json(token_doc()),
        ("POST", "/register") => Reply::status(201, json!({ "client_id": "dyn-client" })),
        ("POST", "/revoke") => Reply::json(json!({})),
        _ => Reply::not_found(),
    })
}

/// A provider on one origin (MCP server, its metadata and the authorization server), with the
/// authorization-server metadata changed by `tweak`.
async fn provider_with(tweak: impl FnOnce(&str, &mut Value)) -> Server {
    Server::start(|base| {
        let mut meta = as_doc(base);
        tweak(base, &mut meta);
        provider(Some(prm_doc(&mcp_url(base), base)), Some(meta))
    })
    .await
}

/// Metadata the flow functions take, built directly (the fields are the validated result).
fn server_metadata(issuer: &str, token: &str, revocation: Option<&str>) -> ServerMetadata {
    ServerMetadata {
        issuer: issuer.into(),
        authorization_endpoint: Some(ep(&format!("{issuer}/authorize"))),
        token_endpoint: ep(token),
        registration_endpoint: None,
        revocation_endpoint: revocation.map(ep),
        token_endpoint_auth_methods: vec![],
        scopes_supported: vec![],
        cimd_supported: false,
        iss_parameter_supported: false,
        grant_types_supported: vec![],
    }
}

fn public_client(issuer: &str) -> OAuthClient {
    OAuthClient {
        id: CLIENT_ID.into(),
        secret: None,
        key: None,
        dpop: None,
        auth: TokenAuth::None,
        kind: ClientKind::PreRegistered,
        issuer: issuer.into(),
    }
}

fn confidential_client(issuer: &str, auth: TokenAuth) -> OAuthClient {
    OAuthClient {
        id: CLIENT_ID.into(),
        secret: Some(SecretString::from(SECRET.to_owned())),
        key: None,
        dpop: None,
        auth,
        kind: ClientKind::PreRegistered,
        issuer: issuer.into(),
    }
}

fn secret(s: &str) -> SecretString {
    SecretString::from(s.to_owned())
}

// ---------------------------------------------------------------------------------------------
// The network layer
// ---------------------------------------------------------------------------------------------

fn net_with(dns: &DnsServer) -> Net {
    Net::new(NetConfig {
        dns: dns.dns(),
        ..NetConfig::default()
    })
    .unwrap()
}

fn assert_above(e: &OAuthError, zone: Zone, what: &str) {
    assert!(
        matches!(
            e,
            OAuthError::Net(NetError::AboveZone { zone: z, binding: Zone::Public, .. }) if *z == zone
        ),
        "{what}: expected a refusal of a {zone} address under the public binding, got {e:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// The operator's browser
// ---------------------------------------------------------------------------------------------

/// One authorization URL as `present` showed it.
#[derive(Debug, Clone)]
struct Shown {
    url: url::Url,
    may_open: bool,
}

impl Shown {
    fn param(&self, k: &str) -> Option<String> {
        self.url
            .query_pairs()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.into_owned())
    }

    fn state(&self) -> String {
        self.param("state")
            .expect("the authorization URL has a state")
    }

    fn callback(&self) -> url::Url {
        url::Url::parse(&self.param("redirect_uri").expect("a redirect_uri")).unwrap()
    }

    /// The request line (without the version) of a GET of the callback with `query`.
    fn get(&self, query: &str) -> String {
        format!("GET {}?{query}", self.callback().path())
    }

    /// A correct answer: a code with this attempt's state, plus `extra`.
    fn code(&self, extra: &str) -> String {
        self.get(&format!("code=c0de&state={}{extra}", self.state()))
    }
}

type Answer = Arc<dyn Fn(usize, &Shown) -> Vec<String> + Send + Sync>;

/// Stands in for the operator's browser. `answer(n, shown)` gives, for the n-th URL shown
/// (from 0), the request lines sent to its loopback callback, each on its own connection, in
/// order.
struct Browser {
    shown: Arc<Mutex<Vec<Shown>>>,
    responses: Arc<Mutex<Vec<String>>>,
    answer: Answer,
}

impl Browser {
    fn new(answer: impl Fn(usize, &Shown) -> Vec<String> + Send + Sync + 'static) -> Browser {
        Browser {
            shown: Arc::default(),
            responses: Arc::default(),
            answer: Arc::new(answer),
        }
    }

    /// For logins that must stop before anything is shown. Should it be shown a URL anyway, it
    /// answers with an error so that the login ends at once (and the test fails on `shown`).
    fn never() -> Browser {
        Browser::new(|_, s| vec![s.get(&format!("error=access_denied&state={}", s.state()))])
    }

    fn present(&self) -> impl Fn(&str, bool) + '_ {
        move |url: &str, may_open: bool| {
            let shown = Shown {
                url: url::Url::parse(url).unwrap(),
                may_open,
            };
            let n = {
                let mut all = self.shown.lock().unwrap();
                all.push(shown.clone());
                all.len() - 1
            };
            let requests = (self.answer)(n, &shown);
            let port = shown.callback().port().expect("the callback has a port");
            let responses = self.responses.clone();
            tokio::spawn(async move {
                for line in requests {
                    let got = send_raw(port, &line).await;
                    responses.lock().unwrap().push(got);
                }
            });
        }
    }

    fn shown(&self) -> Vec<Shown> {
        self.shown.lock().unwrap().clone()
    }

    fn responses(&self) -> Vec<String> {
        self.responses.lock().unwrap().clone()
    }
}

/// Send one raw request to the loopback callback and read the whole answer.
async fn send_raw(port: u16, line: &str) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let req = format!("{line} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    let _ = s.write_all(req.as_bytes()).await;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A login to the MCP server at `<server>/mcp` with a public pre-registered client.
fn request(server: &Server) -> LoginRequest {
    LoginRequest {
        server: ep(&mcp_url(&server.base())),
        resource: None,
        issuer: None,
        operator_scopes: None,
        configured_scopes: None,
        previous_scopes: vec![],
        previous: None,
        mode: Mode::Auto,
        client: ClientSettings {
            client_id: Some(CLIENT_ID.into()),
            ..ClientSettings::default()
        },
        dpop: false,
    }
}

/// Run a login under the loopback binding (every scripted server is on loopback).
async fn run_login(
    req: &LoginRequest,
    challenge: Option<&Challenge>,
    browser: &Browser,
) -> Result<LoginOutcome, OAuthError> {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let http = net.client(Zone::Loopback).unwrap();
    tokio::time::timeout(
        LOGIN_LIMIT,
        login::login(&http, Zone::Loopback, req, challenge, browser.present()),
    )
    .await
    .expect("the login hung waiting for a callback")
}

fn refused(r: Result<LoginOutcome, OAuthError>) -> OAuthError {
    match r {
        Ok(_) => panic!("the login succeeded"),
        Err(e) => e,
    }
}

fn is_callback_refusal(e: &OAuthError) -> bool {
    matches!(e, OAuthError::Callback(_))
}

// ---------------------------------------------------------------------------------------------
// The control: what a correct login sends (so that "nothing was sent" below means something)
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_well_formed_login_redeems_the_code_once_with_pkce_state_and_resource() {
    let srv = provider_with(|_, _| {}).await;
    let base = srv.base();
    let browser = Browser::new(|_, s| vec![s.code("")]);
    let out = run_login(&request(&srv), None, &browser)
        .await
        .unwrap_or_else(|e| panic!("the control login failed: {e}"));
    assert_eq!(out.tokens.access.expose_secret(), "at-1");
    assert_eq!(out.resource, mcp_url(&base));
    assert_eq!(out.server.issuer, base);

    let shown = browser.shown();
    assert_eq!(shown.len(), 1);
    let s = &shown[0];
    assert!(s.may_open, "a loopback login page under a loopback binding");
    assert_eq!(s.url.path(), "/authorize");
    assert_eq!(s.param("response_type").as_deref(), Some("code"));
    assert_eq!(s.param("code_challenge_method").as_deref(), Some("S256"));
    assert_eq!(s.param("client_id").as_deref(), Some(CLIENT_ID));
    assert_eq!(s.param("resource"), Some(mcp_url(&base)));
    assert!(s.state().len() >= 32, "a random state");
    let cb = s.callback();
    assert_eq!(
        (cb.scheme(), cb.host_str(), cb.path()),
        ("http", Some("127.0.0.1"), "/callback")
    );

    let tokens = srv.to("/token");
    assert_eq!(tokens.len(), 1, "exactly one code exchange");
    let form = tokens[0].form();
    assert_eq!(form["grant_type"], "authorization_code");
    assert_eq!(form["code"], "c0de");
    assert_eq!(form["resource"], mcp_url(&base));
    assert_eq!(
        Some(&form["redirect_uri"]),
        s.param("redirect_uri").as_ref()
    );
    assert_eq!(
        Some(flow::s256(&form["code_verifier"])),
        s.param("code_challenge"),
        "the verifier matches the S256 challenge"
    );
    // A public pre-registered client: nothing was registered.
    assert!(srv.to("/register").is_empty());
}

// ---------------------------------------------------------------------------------------------
// Authorization-server metadata: exact issuer, PKCE S256, endpoint rules
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn metadata_naming_another_issuer_is_refused_before_any_endpoint_it_names_is_used() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let http = net.client(Zone::Loopback).unwrap();
    // (what differs, the issuer the document claims given the real one, whether only the
    // OpenID discovery document exists)
    let cases: [(&str, FromBase, bool); 6] = [
        ("another origin", |_| "https://as.example".into(), false),
        ("a trailing slash", |b| format!("{b}/"), false),
        ("a longer path", |b| format!("{b}/tenant"), false),
        (
            "an upper-case spelling",
            |b| b.replace("http", "HTTP"),
            false,
        ),
        ("another port", |b| format!("{b}0"), false),
        (
            "OpenID discovery naming another origin",
            |_| "https://as.example".into(),
            true,
        ),
    ];
    for (what, claimed, openid_only) in cases {
        let srv = Server::start(|base| {
            let mut doc = as_doc(base);
            doc["issuer"] = json!(claimed(base));
            Arc::new(move |req: &Seen| match (req.method.as_str(), req.path()) {
                ("GET", "/.well-known/oauth-authorization-server") if !openid_only => {
                    Reply::json(doc.clone())
                }
                ("GET", "/.well-known/openid-configuration") if openid_only => {
                    Reply::json(doc.clone())
                }
                ("POST", _) => Reply::json(token_doc()),
                _ => Reply::not_found(),
            })
        })
        .await;
        let got = metadata::discover_server(&http, &srv.base()).await;
        assert_eq!(got, Err(OAuthError::IssuerMismatch), "{what}");
        assert!(!srv.seen().is_empty(), "{what}: the document was fetched");
        srv.assert_only_discovery(what);
    }
}

#[tokio::test]
async fn a_login_stops_at_an_issuer_mismatch_without_registering_or_showing_a_url() {
    let srv = provider_with(|base, m| m["issuer"] = json!(format!("{base}/"))).await;
    let mut req = request(&srv);
    // No client: a login that went on would register dynamically.
    req.client = ClientSettings::default();
    let browser = Browser::never();
    let e = refused(run_login(&req, None, &browser).await);
    assert_eq!(e, OAuthError::IssuerMismatch);
    assert!(browser.shown().is_empty(), "no authorization URL was shown");
    srv.assert_only_discovery("issuer mismatch");
    assert!(srv.to("/register").is_empty());
}

#[tokio::test]
async fn without_pkce_s256_the_login_stops_before_registration_or_the_browser() {
    let cases: [(&str, Option<Value>); 5] = [
        ("absent", None),
        ("plain only", Some(json!(["plain"]))),
        ("empty", Some(json!([]))),
        ("a lower-case s256", Some(json!(["plain", "s256"]))),
        ("a string instead of a list", Some(json!("S256"))),
    ];
    for (what, methods) in cases {
        let srv = provider_with(|_, m| match methods {
            None => {
                m.as_object_mut()
                    .unwrap()
                    .remove("code_challenge_methods_supported");
            }
            Some(v) => m["code_challenge_methods_supported"] = v,
        })
        .await;
        let mut req = request(&srv);
        req.mode = Mode::Dcr;
        req.client = ClientSettings::default();
        let browser = Browser::never();
        let e = refused(run_login(&req, None, &browser).await);
        assert_eq!(e, OAuthError::NoPkce, "{what}");
        assert!(browser.shown().is_empty(), "{what}: nothing was shown");
        srv.assert_only_discovery(what);
        assert!(srv.to("/register").is_empty(), "{what}: nothing registered");
    }
}

#[tokio::test]
async fn token_registration_and_revocation_endpoints_breaking_the_url_rules_are_never_used() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let http = net.client(Zone::Loopback).unwrap();
    // Each form points back at the scripted server itself where it can, so a use would show.
    let forms: [(&str, FromBase); 6] = [
        ("userinfo", |b| {
            format!("{}/x", b.replace("http://", "http://user:pw@"))
        }),
        ("a user name only", |b| {
            format!("{}/x", b.replace("http://", "http://user@"))
        }),
        ("a fragment", |b| format!("{b}/x#frag")),
        ("an empty fragment", |b| format!("{b}/x#")),
        ("plain http to a name", |b| {
            format!("{}/x", b.replace("127.0.0.1", "as.test"))
        }),
        ("plain http to a private address", |_| {
            "http://10.0.0.1/x".into()
        }),
    ];
    for which in [
        "token_endpoint",
        "registration_endpoint",
        "revocation_endpoint",
    ] {
        for (form, bad) in forms {
            let what = format!("{which} with {form}");
            let srv = Server::start(|base| {
                let mut meta = as_doc(base);
                meta[which] = json!(bad(base));
                provider(None, Some(meta))
            })
            .await;
            let got = metadata::discover_server(&http, &srv.base()).await;
            assert!(
                matches!(&got, Err(OAuthError::BadEndpoint { which: w, .. }) if *w == which),
                "{what}: {got:?}"
            );
            srv.assert_only_discovery(&what);
        }
    }
}

#[tokio::test]
async fn a_login_never_registers_at_an_endpoint_with_userinfo() {
    let srv = provider_with(|base, m| {
        m["registration_endpoint"] = json!(format!(
            "{}/register",
            base.replace("http://", "http://user:pw@")
        ));
    })
    .await;
    let mut req = request(&srv);
    req.mode = Mode::Dcr;
    req.client = ClientSettings::default();
    let browser = Browser::never();
    let e = refused(run_login(&req, None, &browser).await);
    assert!(
        matches!(
            e,
            OAuthError::BadEndpoint {
                which: "registration_endpoint",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(browser.shown().is_empty());
    assert!(srv.to("/register").is_empty(), "nothing was registered");
    srv.assert_only_discovery("registration endpoint with userinfo");
}

// ---------------------------------------------------------------------------------------------
// Protected-resource metadata: the resource must identify the server
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_resource_that_does_not_identify_the_server_stops_the_login_before_the_authorization_server()
 {
    let auth = Server::start(|base| provider(None, Some(as_doc(base)))).await;
    let elsewhere = Server::silent_on(v4(127, 0, 0, 1)).await;
    let (issuer, other) = (auth.base(), elsewhere.base());
    // (what, the resource the metadata names given the server's base and another origin,
    // the resource the operator pinned)
    type Named = fn(&str, &str) -> String;
    let cases: [(&str, Named, Option<Named>); 8] = [
        ("another port", |_, o| mcp_url(o), None),
        (
            "another host",
            |_, _| "https://mcp.example/mcp".into(),
            None,
        ),
        (
            "another scheme",
            |b, _| mcp_url(&b.replace("http", "https")),
            None,
        ),
        (
            "the same origin, another path",
            |b, _| format!("{b}/other"),
            None,
        ),
        (
            "the same origin, a partial segment",
            |b, _| format!("{b}/mc"),
            None,
        ),
        (
            "the same origin, a deeper path",
            |b, _| format!("{b}/mcp/tools"),
            None,
        ),
        (
            "the same origin, a fragment",
            |b, _| format!("{b}/mcp#x"),
            None,
        ),
        (
            "a pinned resource differing by a trailing slash",
            |b, _| mcp_url(b),
            Some(|b, _| format!("{b}/mcp/")),
        ),
    ];
    for (what, named, pinned) in cases {
        let rs = Server::start(|base| provider(Some(prm_doc(&named(base, &other), &issuer)), None))
            .await;
        let mut req = request(&rs);
        req.resource = pinned.map(|p| p(&rs.base(), &other));
        let browser = Browser::never();
        let e = refused(run_login(&req, None, &browser).await);
        assert_eq!(e, OAuthError::ResourceMismatch, "{what}");
        assert!(browser.shown().is_empty(), "{what}: nothing was shown");
        rs.assert_only_discovery(what);
        assert!(!rs.seen().is_empty(), "{what}: the metadata was fetched");
    }
    auth.assert_untouched("the authorization server of a mismatched resource")
        .await;
    elsewhere
        .assert_untouched("the origin the resource named")
        .await;
}

#[tokio::test]
async fn a_resource_on_the_servers_origin_root_or_path_or_pinned_exactly_is_accepted() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let http = net.client(Zone::Loopback).unwrap();
    let cases: [(&str, FromBase, Option<FromBase>); 5] = [
        ("the origin root", |b| b.to_owned(), None),
        ("the origin root with a slash", |b| format!("{b}/"), None),
        ("the path itself", mcp_url, None),
        (
            "the path with another query",
            |b| format!("{b}/mcp?x=2"),
            None,
        ),
        (
            "another origin, pinned exactly",
            |_| "https://resource.example/r".into(),
            Some(|_| "https://resource.example/r".into()),
        ),
    ];
    for (what, named, pinned) in cases {
        let rs =
            Server::start(|base| provider(Some(prm_doc(&named(base), "https://as.example")), None))
                .await;
        let server = ep(&format!("{}/mcp?tenant=1", rs.base()));
        let pinned = pinned.map(|p| p(&rs.base()));
        let got = metadata::discover_resource(&http, &server, None, pinned.as_deref())
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(got.resource, named(&rs.base()), "{what}");
    }
}

#[tokio::test]
async fn a_pinned_issuer_the_resource_does_not_list_is_never_contacted() {
    let listed = Server::start(|base| provider(None, Some(as_doc(base)))).await;
    let pinned = Server::start(|base| provider(None, Some(as_doc(base)))).await;
    let listed_issuer = listed.base();
    let rs =
        Server::start(|base| provider(Some(prm_doc(&mcp_url(base), &listed_issuer)), None)).await;
    let mut req = request(&rs);
    req.issuer = Some(pinned.base());
    let browser = Browser::never();
    let e = refused(run_login(&req, None, &browser).await);
    assert!(
        matches!(
            e,
            OAuthError::BadEndpoint {
                which: "issuer",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(browser.shown().is_empty());
    pinned.assert_untouched("the pinned issuer").await;
    listed.assert_untouched("the listed issuer").await;
}

/// Issue 14 item 1: an explicit re-login stays on the issuer and the resource its credential is
/// bound to. A server that now names another authorization server, or another resource, gets a
/// refusal naming both — before any authorization server is contacted and before the browser —
/// and the login goes on only where the operator names the new one.
#[tokio::test]
async fn a_relogin_whose_server_now_names_another_issuer_or_resource_is_refused_naming_both() {
    // The issuer moved: the old one and the new one hear nothing from the refused re-login.
    let old = Server::start(|base| provider(None, Some(as_doc(base)))).await;
    let new = provider_with(|_, _| {}).await;
    let (old_issuer, new_issuer) = (old.base(), new.base());
    let rs = Server::start({
        let new_issuer = new_issuer.clone();
        move |base| provider(Some(prm_doc(&mcp_url(base), &new_issuer)), None)
    })
    .await;
    let mut req = request(&rs);
    req.previous = Some(Previous {
        resource: mcp_url(&rs.base()),
        issuer: old_issuer.clone(),
    });
    let browser = Browser::never();
    let e = refused(run_login(&req, None, &browser).await);
    let line = e.to_string();
    assert!(matches!(e, OAuthError::Moved { .. }), "{e:?}");
    assert!(
        line.contains(&format!("authorization server \"{new_issuer}\""))
            && line.contains(&format!("authorization server \"{old_issuer}\""))
            && line.contains("--oauth-issuer")
            && !line.contains('\n'),
        "{line}"
    );
    assert!(browser.shown().is_empty());
    old.assert_untouched("the old issuer").await;
    assert!(
        new.seen().is_empty(),
        "the new issuer heard from a refused re-login"
    );
    // A server that still lists the old issuer (beside a new one first) keeps the login there.
    let both = Server::start({
        let (old_issuer, new_issuer) = (old_issuer.clone(), new_issuer.clone());
        move |base| {
            provider(
                Some(json!({"resource": mcp_url(base), "authorization_servers": [new_issuer, old_issuer]})),
                None,
            )
        }
    })
    .await;
    let mut stay = request(&both);
    stay.previous = Some(Previous {
        resource: mcp_url(&both.base()),
        issuer: old_issuer.clone(),
    });
    stay.client.client_id = Some(CLIENT_ID.into());
    let browser = Browser::new(|_, s| vec![s.code("")]);
    let out = run_login(&stay, None, &browser).await.unwrap();
    assert_eq!(out.server.issuer, old_issuer);
    assert!(new.seen().is_empty());
    // Named by the operator, the login moves.
    req.issuer = Some(new_issuer.clone());
    let browser = Browser::new(|_, s| vec![s.code("")]);
    let out = run_login(&req, None, &browser).await.unwrap();
    assert_eq!(out.server.issuer, new_issuer);
    assert_eq!(new.to("/token").len(), 1);

    // The resource moved (from the endpoint to the origin root, which alone would be legal).
    let srv = Server::start(|base| provider(Some(prm_doc(base, base)), Some(as_doc(base)))).await;
    let base = srv.base();
    let mut req = request(&srv);
    req.previous = Some(Previous {
        resource: mcp_url(&base),
        issuer: base.clone(),
    });
    let browser = Browser::never();
    let e = refused(run_login(&req, None, &browser).await);
    let line = e.to_string();
    assert!(
        line.contains(&format!("resource \"{base}\""))
            && line.contains(&format!("resource \"{}\"", mcp_url(&base)))
            && line.contains("--oauth-resource"),
        "{line}"
    );
    assert!(browser.shown().is_empty());
    assert!(
        srv.seen().iter().all(|s| s
            .path()
            .starts_with("/.well-known/oauth-protected-resource")),
        "only the resource metadata was read: {:?}",
        srv.seen().iter().map(Seen::path).collect::<Vec<_>>()
    );
    req.resource = Some(base.clone());
    let browser = Browser::new(|_, s| vec![s.code("")]);
    let out = run_login(&req, None, &browser).await.unwrap();
    assert_eq!(out.resource, base);
    iteron_test_support::record!(
        "P12",
        json!({"moved": ["authorization server", "resource"], "contacted_before_refusal": 0}),
    );
}

// ---------------------------------------------------------------------------------------------
// The cross-origin authorization endpoint
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_cross_origin_authorization_endpoint_without_rfc_9207_is_refused_before_the_browser() {
    let login_page = Server::silent_on(v4(127, 0, 0, 1)).await;
    let page = login_page.base();
    let srv = provider_with(|_, m| {
        m["authorization_endpoint"] = json!(format!("{page}/authorize"));
    })
    .await;
    let mut req = request(&srv);
    req.mode = Mode::Dcr;
    req.client = ClientSettings::default();
    let browser = Browser::never();
    let e = refused(run_login(&req, None, &browser).await);
    assert!(
        matches!(
            e,
            OAuthError::BadEndpoint {
                which: "authorization_endpoint",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(browser.shown().is_empty(), "the URL was never shown");
    srv.assert_only_discovery("cross-origin authorization endpoint");
    login_page.assert_untouched("the login page").await;
}

#[tokio::test]
async fn a_cross_origin_authorization_endpoint_is_accepted_with_rfc_9207_or_on_the_token_endpoints_origin()
 {
    // With RFC 9207: the login goes through, and the answer must carry the issuer.
    let login_page = Server::silent_on(v4(127, 0, 0, 1)).await;
    let page = login_page.base();
    let srv = provider_with(|_, m| {
        m["authorization_endpoint"] = json!(format!("{page}/authorize"));
        m["authorization_response_iss_parameter_supported"] = json!(true);
    })
    .await;
    let issuer = srv.base();
    let browser = Browser::new(move |_, s| vec![s.code(&format!("&iss={}", enc(&issuer)))]);
    run_login(&request(&srv), None, &browser)
        .await
        .unwrap_or_else(|e| panic!("with RFC 9207: {e}"));
    assert_eq!(
        browser.shown()[0].url.origin().ascii_serialization(),
        login_page.base()
    );
    assert_eq!(srv.to("/token").len(), 1);

    // Sharing the token endpoint's origin (both away from the issuer): accepted without it.
    let tokens = Server::start(|_| provider(None, None)).await;
    let t = tokens.base();
    let srv = provider_with(|_, m| {
        m["authorization_endpoint"] = json!(format!("{t}/authorize"));
        m["token_endpoint"] = json!(format!("{t}/token"));
    })
    .await;
    let browser = Browser::new(|_, s| vec![s.code("")]);
    run_login(&request(&srv), None, &browser)
        .await
        .unwrap_or_else(|e| panic!("on the token endpoint's origin: {e}"));
    assert_eq!(tokens.to("/token").len(), 1);
    assert!(srv.to("/token").is_empty());
}

// ---------------------------------------------------------------------------------------------
// The authorization response: state and RFC 9207 iss
// ---------------------------------------------------------------------------------------------

/// A login against a provider on one origin that does or does not promise `iss`, answered with
/// `query(state, issuer)` on the callback.
async fn login_answering(
    promise_iss: bool,
    query: impl Fn(&str, &str) -> String + Send + Sync + 'static,
) -> (Result<LoginOutcome, OAuthError>, Server, Browser) {
    let srv = provider_with(|_, m| {
        m["authorization_response_iss_parameter_supported"] = json!(promise_iss);
    })
    .await;
    let issuer = srv.base();
    let browser = Browser::new(move |_, s| vec![s.get(&query(&s.state(), &issuer))]);
    let got = run_login(&request(&srv), None, &browser).await;
    (got, srv, browser)
}

#[tokio::test]
async fn an_iss_other_than_the_issuer_is_never_redeemed() {
    let forged: [(&str, FromBase); 5] = [
        ("another origin", |_| "https://evil.example".into()),
        ("a trailing slash", |i| format!("{i}/")),
        ("an upper-case spelling", |i| i.replace("http", "HTTP")),
        ("an empty value", |_| String::new()),
        ("the issuer with a path", |i| format!("{i}/as")),
    ];
    for promise in [true, false] {
        for (what, iss) in forged {
            let what = format!("{what} (iss promised: {promise})");
            let (got, srv, browser) = login_answering(promise, move |state, issuer| {
                format!("code=c0de&state={state}&iss={}", enc(&iss(issuer)))
            })
            .await;
            let e = refused(got);
            assert!(is_callback_refusal(&e), "{what}: {e:?}");
            assert_eq!(browser.shown().len(), 1, "{what}");
            assert!(srv.to("/token").is_empty(), "{what}: the code was redeemed");
            srv.assert_only_discovery(&what);
        }
    }
}

#[tokio::test]
async fn a_duplicated_iss_is_never_redeemed() {
    let (got, srv, _) = login_answering(true, |state, issuer| {
        format!(
            "code=c0de&state={state}&iss={}&iss={}",
            enc(issuer),
            enc("https://evil.example")
        )
    })
    .await;
    assert!(is_callback_refusal(&refused(got)));
    assert!(srv.to("/token").is_empty(), "the code was redeemed");
}

#[tokio::test]
async fn a_missing_iss_is_never_redeemed_when_the_server_promised_it() {
    let (got, srv, browser) =
        login_answering(true, |state, _| format!("code=c0de&state={state}")).await;
    let e = refused(got);
    assert!(is_callback_refusal(&e), "{e:?}");
    assert_eq!(browser.shown().len(), 1);
    assert!(srv.to("/token").is_empty(), "the code was redeemed");

    // The control: the same answer with the right iss is redeemed.
    let (got, srv, _) = login_answering(true, |state, issuer| {
        format!("code=c0de&state={state}&iss={}", enc(issuer))
    })
    .await;
    got.unwrap_or_else(|e| panic!("with the right iss: {e}"));
    assert_eq!(srv.to("/token").len(), 1);
}

#[tokio::test]
async fn a_callback_with_another_state_is_answered_ignored_and_never_redeemed() {
    let cases: [(&str, FromBase); 6] = [
        ("another state", |_| "code=forged&state=forged".into()),
        ("no state", |_| "code=forged".into()),
        ("an empty state", |_| "code=forged&state=".into()),
        ("a truncated state", |s| {
            format!("code=forged&state={}", &s[1..])
        }),
        ("the state twice", |s| {
            format!("code=forged&state={s}&state={s}")
        }),
        ("the state but neither code nor error", |s| {
            format!("state={s}&other=forged")
        }),
    ];
    for (what, query) in cases {
        let srv = provider_with(|_, _| {}).await;
        // The stray request first, then the real answer: the stray is answered with an error
        // page and changes nothing; the login goes on and redeems only the real code.
        let browser = Browser::new(move |_, s| {
            vec![
                s.get(&query(&s.state())),
                s.get(&format!("code=good&state={}", s.state())),
            ]
        });
        run_login(&request(&srv), None, &browser)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let responses = browser.responses();
        assert_eq!(responses.len(), 2, "{what}");
        assert!(
            responses[0].starts_with("HTTP/1.1 400"),
            "{what}: {}",
            responses[0]
        );
        assert!(responses[1].starts_with("HTTP/1.1 200"), "{what}");
        let tokens = srv.to("/token");
        assert_eq!(tokens.len(), 1, "{what}: exactly one exchange");
        assert_eq!(tokens[0].form()["code"], "good", "{what}");
    }
    iteron_test_support::record!("P12", json!({"cases": cases.len()}),);
}

#[tokio::test]
async fn a_repeated_code_with_the_right_state_is_never_redeemed() {
    // It carries this login's state, so it ends the login — but no code is redeemed.
    let (got, srv, browser) = login_answering(false, |state, _| {
        format!("code=c0de&code=other&state={state}")
    })
    .await;
    assert!(is_callback_refusal(&refused(got)));
    assert_eq!(browser.shown().len(), 1);
    assert!(srv.to("/token").is_empty(), "the code was redeemed");
}

#[tokio::test]
async fn only_a_get_of_exactly_the_callback_path_is_taken_as_the_authorization_response() {
    let srv = provider_with(|_, _| {}).await;
    let browser = Browser::new(|_, s| {
        let port = s.callback().port().unwrap();
        let evil = format!("code=evil&state={}", s.state());
        vec![
            format!("POST /callback?{evil}"),
            format!("GET /callback/?{evil}"),
            format!("GET /callbackx?{evil}"),
            format!("GET /CALLBACK?{evil}"),
            format!("GET /x/callback?{evil}"),
            format!("GET http://127.0.0.1:{port}/callback?{evil}"),
            s.get(&format!("code=good&state={}", s.state())),
        ]
    });
    run_login(&request(&srv), None, &browser)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let responses = browser.responses();
    assert_eq!(responses.len(), 7);
    for r in &responses[..6] {
        assert!(
            r.starts_with("HTTP/1.1 404"),
            "a stray request was answered: {r}"
        );
    }
    assert!(responses[6].starts_with("HTTP/1.1 200"));
    let tokens = srv.to("/token");
    assert_eq!(tokens.len(), 1, "exactly one exchange");
    assert_eq!(tokens[0].form()["code"], "good");
}

#[tokio::test]
async fn an_oversized_callback_request_is_never_redeemed() {
    let srv = provider_with(|_, _| {}).await;
    let browser = Browser::new(|_, s| {
        vec![
            s.code(&format!(
                "&pad={}",
                "a".repeat(login::MAX_CALLBACK_HEAD + 1)
            )),
            s.get(&format!("code=good&state={}", s.state())),
        ]
    });
    run_login(&request(&srv), None, &browser)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(browser.responses()[0].starts_with("HTTP/1.1 431"));
    let tokens = srv.to("/token");
    assert_eq!(tokens.len(), 1);
    assert_eq!(
        tokens[0].form()["code"],
        "good",
        "the oversized one was redeemed"
    );
}

// ---------------------------------------------------------------------------------------------
// Client secrets and clients across issuers
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_client_secret_never_goes_to_a_token_or_revocation_endpoint_off_the_issuers_origin() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let http = net.client(Zone::Loopback).unwrap();
    let home = Server::start(|_| provider(None, None)).await;
    let elsewhere = Server::start(|_| provider(None, None)).await;
    let (h, e) = (home.base(), elsewhere.base());
    let away = server_metadata(&h, &format!("{e}/token"), Some(&format!("{e}/revoke")));
    for auth in [TokenAuth::Basic, TokenAuth::Post] {
        let client = confidential_client(&h, auth);
        let attempt = flow::start(
            &away,
            &client,
            "http://127.0.0.1:9/callback",
            "https://r.example/mcp",
            None,
        )
        .unwrap();
        let got = flow::exchange(&http, &away, &client, &attempt, secret("c0de"))
            .await
            .unwrap_err();
        assert!(
            matches!(
                got,
                OAuthError::BadEndpoint {
                    which: "token_endpoint",
                    ..
                }
            ),
            "{auth:?} exchange: {got:?}"
        );
        let got = flow::refresh(
            &http,
            &away,
            &client,
            &secret("rt-1"),
            "https://r.example/mcp",
        )
        .await
        .unwrap_err();
        assert!(
            matches!(
                got,
                OAuthError::BadEndpoint {
                    which: "token_endpoint",
                    ..
                }
            ),
            "{auth:?} refresh: {got:?}"
        );
        let got = flow::revoke(&http, &away, &client, &secret("rt-1"), "refresh_token")
            .await
            .unwrap_err();
        assert!(
            matches!(
                got,
                OAuthError::BadEndpoint {
                    which: "revocation_endpoint",
                    ..
                }
            ),
            "{auth:?} revoke: {got:?}"
        );
    }
    elsewhere
        .assert_untouched("token and revocation endpoints off the issuer's origin")
        .await;

    // The control: at the issuer's own origin the same clients do send their secret.
    let at_home = server_metadata(&h, &format!("{h}/token"), Some(&format!("{h}/revoke")));
    for auth in [TokenAuth::Basic, TokenAuth::Post] {
        let client = confidential_client(&h, auth);
        flow::refresh(
            &http,
            &at_home,
            &client,
            &secret("rt-1"),
            "https://r.example/mcp",
        )
        .await
        .unwrap();
        assert_eq!(
            flow::revoke(&http, &at_home, &client, &secret("rt-1"), "refresh_token")
                .await
                .unwrap(),
            flow::Revocation::Accepted
        );
    }
    let tokens = home.to("/token");
    assert_eq!(tokens.len(), 2);
    assert!(tokens.iter().all(|s| s.carries(SECRET)));
    assert!(
        tokens[0]
            .header("authorization")
            .is_some_and(|v| v.starts_with("Basic "))
    );
    assert_eq!(tokens[1].form()["client_secret"], SECRET);
    assert_eq!(home.to("/revoke").len(), 2);
}

#[tokio::test]
async fn a_login_with_a_pre_registered_secret_never_sends_it_off_the_pinned_issuers_origin() {
    let elsewhere = Server::start(|_| provider(None, None)).await;
    let e = elsewhere.base();
    let srv = provider_with(|_, m| m["token_endpoint"] = json!(format!("{e}/token"))).await;
    let mut req = request(&srv);
    req.issuer = Some(srv.base());
    req.client.client_secret = Some(secret(SECRET));
    let browser = Browser::new(|_, s| vec![s.code("")]);
    let got = refused(run_login(&req, None, &browser).await);
    assert!(
        matches!(
            got,
            OAuthError::BadEndpoint {
                which: "token_endpoint",
                ..
            }
        ),
        "{got:?}"
    );
    elsewhere
        .assert_untouched("a token endpoint off the pinned issuer's origin")
        .await;
    assert!(srv.seen().iter().all(|s| !s.carries(SECRET)));

    // The control: on the pinned issuer's own origin the secret is used.
    let srv = provider_with(|_, _| {}).await;
    let mut req = request(&srv);
    req.issuer = Some(srv.base());
    req.client.client_secret = Some(secret(SECRET));
    let browser = Browser::new(|_, s| vec![s.code("")]);
    run_login(&req, None, &browser)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let tokens = srv.to("/token");
    assert_eq!(tokens.len(), 1);
    assert!(tokens[0].carries(SECRET));
}

/// A confidential login against a provider whose metadata puts the token endpoint at
/// `token`, stopped before the browser (see [`Browser::never`]).
async fn confidential_login_stops_before_the_browser(srv: &Server, req: &LoginRequest, what: &str) {
    let browser = Browser::never();
    let got = refused(run_login(req, None, &browser).await);
    assert!(
        matches!(
            got,
            OAuthError::BadEndpoint {
                which: "token_endpoint",
                ..
            }
        ),
        "{what}: {got:?}"
    );
    let line = iteron_policy::text::single_line(&got.to_string());
    assert!(
        line.contains("refused token_endpoint (host ") && line.contains("issuer's own origin"),
        "{what}: the reason is named: {line}"
    );
    assert!(!line.contains("[REDACTED]"), "{what}: {line}");
    assert!(
        browser.shown().is_empty(),
        "{what}: the operator was sent to authorize"
    );
    assert!(srv.to("/token").is_empty(), "{what}");
    assert!(srv.seen().iter().all(|s| !s.carries(SECRET)), "{what}");
}

#[tokio::test]
async fn a_confidential_client_whose_token_endpoint_is_on_another_origin_stops_before_the_browser()
{
    let elsewhere = Server::start(|_| provider(None, None)).await;
    let e = elsewhere.base();
    // Other origins of the issuer http://127.0.0.1:<p>: another port, another host spelling
    // (a name against the address it resolves to), another scheme.
    type TokenAt = Box<dyn Fn(u16) -> String>;
    let foreign: [(&str, TokenAt); 3] = [
        ("another port", Box::new(move |_| format!("{e}/token"))),
        (
            "localhost for 127.0.0.1",
            Box::new(|p| format!("http://localhost:{p}/token")),
        ),
        (
            "https for http",
            Box::new(|p| format!("https://127.0.0.1:{p}/token")),
        ),
    ];
    for (what, token) in &foreign {
        // A pre-registered secret, with the issuer pinned.
        let srv = Server::start(|base| {
            let port: u16 = base.rsplit(':').next().unwrap().parse().unwrap();
            let mut meta = as_doc(base);
            meta["token_endpoint"] = json!(token(port));
            provider(Some(prm_doc(&mcp_url(base), base)), Some(meta))
        })
        .await;
        let mut req = request(&srv);
        req.issuer = Some(srv.base());
        req.client.client_secret = Some(secret(SECRET));
        confidential_login_stops_before_the_browser(&srv, &req, &format!("pre-registered, {what}"))
            .await;
        assert!(srv.to("/register").is_empty(), "{what}: registered anyway");

        // A dynamically registered client that the server made confidential.
        let srv = Server::start(|base| {
            let port: u16 = base.rsplit(':').next().unwrap().parse().unwrap();
            let mut meta = as_doc(base);
            meta["token_endpoint"] = json!(token(port));
            meta["token_endpoint_auth_methods_supported"] = json!(["client_secret_basic"]);
            let inner = provider(Some(prm_doc(&mcp_url(base), base)), Some(meta));
            Arc::new(move |req: &Seen| {
                if req.method == "POST" && req.path() == "/register" {
                    return Reply::status(
                        201,
                        json!({
                            "client_id": "dyn-confidential",
                            "client_secret": SECRET,
                            "token_endpoint_auth_method": "client_secret_basic",
                        }),
                    );
                }
                inner(req)
            })
        })
        .await;
        let mut req = request(&srv);
        req.client = ClientSettings::default();
        confidential_login_stops_before_the_browser(&srv, &req, &format!("dynamic, {what}")).await;
    }
    assert!(
        elsewhere.to("/token").is_empty(),
        "the foreign token endpoint was used"
    );

    // The control: the same origin with another path, and another spelling of the same IPv4
    // address (the URL parser makes it canonical), are the issuer's own origin.
    for spelled in [
        |p: u16| format!("http://127.0.0.1:{p}/oauth2/token"),
        |p: u16| format!("http://0x7f.0.0.1:{p}/token"),
    ] {
        let srv = Server::start(move |base| {
            let port: u16 = base.rsplit(':').next().unwrap().parse().unwrap();
            let mut meta = as_doc(base);
            meta["token_endpoint"] = json!(spelled(port));
            let inner = provider(Some(prm_doc(&mcp_url(base), base)), Some(meta));
            Arc::new(move |req: &Seen| {
                if req.method == "POST" && req.path() == "/oauth2/token" {
                    return Reply::json(token_doc());
                }
                inner(req)
            })
        })
        .await;
        let mut req = request(&srv);
        req.issuer = Some(srv.base());
        req.client.client_secret = Some(secret(SECRET));
        let browser = Browser::new(|_, s| vec![s.code("")]);
        run_login(&req, None, &browser)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(browser.shown().len(), 1);
        assert!(srv.seen().iter().any(|s| s.carries(SECRET)));
    }
    iteron_test_support::record!(
        "P12",
        json!({"foreign_origins": foreign.len(), "registrations": ["pre_registered", "dynamic"]}),
    );
}

#[tokio::test]

async fn a_pre_registered_secret_is_never_sent_when_the_operator_pinned_no_issuer() {
    // The MCP server's metadata names an authorization server the operator never chose; its
    // token endpoint is on its own origin, so only the operator's pin could vouch for it.
    let srv = provider_with(|_, _| {}).await;
    let mut req = request(&srv);
    assert!(req.issuer.is_none());
    req.client.client_secret = Some(secret(SECRET));
    let browser = Browser::new(|_, s| vec![s.code("")]);
    let _ = run_login(&req, None, &browser).await;
    let carrying: Vec<String> = srv
        .seen()
        .iter()
        .filter(|s| s.carries(SECRET))
        .map(|s| format!("{} {}", s.method, s.target))
        .collect();
    assert!(
        carrying.is_empty(),
        "the client secret reached an issuer nobody pinned: {carrying:?}"
    );
}

#[tokio::test]
async fn a_client_of_one_issuer_is_never_used_at_another() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let http = net.client(Zone::Loopback).unwrap();
    let srv = Server::start(|_| provider(None, None)).await;
    let b = srv.base();
    let meta = server_metadata(&b, &format!("{b}/token"), Some(&format!("{b}/revoke")));
    for client in [
        public_client("https://old-issuer.example"),
        confidential_client("https://old-issuer.example", TokenAuth::Basic),
        public_client(&format!("{b}/")),
    ] {
        let what = format!("{client:?}");
        let attempt = flow::start(
            &meta,
            &client,
            "http://127.0.0.1:9/callback",
            "https://r.example",
            None,
        )
        .unwrap();
        let got = flow::exchange(&http, &meta, &client, &attempt, secret("c0de")).await;
        assert!(
            matches!(got, Err(OAuthError::NoRegistration(_))),
            "{what}: {got:?}"
        );
        let got = flow::refresh(&http, &meta, &client, &secret("rt-1"), "https://r.example").await;
        assert!(
            matches!(got, Err(OAuthError::NoRegistration(_))),
            "{what}: {got:?}"
        );
        let got = flow::revoke(&http, &meta, &client, &secret("rt-1"), "refresh_token").await;
        assert!(
            matches!(got, Err(OAuthError::NoRegistration(_))),
            "{what}: {got:?}"
        );
    }
    srv.assert_untouched("an issuer the clients were not registered with")
        .await;
}

// ---------------------------------------------------------------------------------------------
// Registration modes
// ---------------------------------------------------------------------------------------------

fn registration_metadata(base: &str, dcr: bool, cimd: bool) -> ServerMetadata {
    ServerMetadata {
        registration_endpoint: dcr.then(|| ep(&format!("{base}/register"))),
        cimd_supported: cimd,
        ..server_metadata(base, &format!("{base}/token"), None)
    }
}

fn cimd_settings() -> ClientSettings {
    ClientSettings {
        cimd_url: Some("https://client.example/iteron.json".into()),
        client_name: "Iteron".into(),
        ..ClientSettings::default()
    }
}

#[tokio::test]
async fn forced_cimd_never_falls_back_to_dynamic_registration() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let http = net.client(Zone::Loopback).unwrap();
    let srv = Server::start(|_| provider(None, None)).await;
    let b = srv.base();
    let cases = [
        (
            "the server offers only DCR",
            registration_metadata(&b, true, false),
            cimd_settings(),
        ),
        (
            "the server offers CIMD but no CIMD URL is set",
            registration_metadata(&b, true, true),
            ClientSettings {
                client_id: Some(CLIENT_ID.into()),
                ..ClientSettings::default()
            },
        ),
    ];
    for (what, meta, settings) in cases {
        let got = flow::register(
            &http,
            &meta,
            &Mode::Cimd,
            &settings,
            "http://127.0.0.1:9/callback",
        )
        .await;
        assert!(
            matches!(got, Err(OAuthError::NoRegistration(_))),
            "{what}: {got:?}"
        );
    }
    srv.assert_untouched("the registration endpoint under forced CIMD")
        .await;

    // The control: where CIMD is offered, forced CIMD uses it and still posts nothing.
    let c = flow::register(
        &http,
        &registration_metadata(&b, true, true),
        &Mode::Cimd,
        &cimd_settings(),
        "http://127.0.0.1:9/callback",
    )
    .await
    .unwrap();
    assert_eq!(c.kind, ClientKind::Cimd);
    assert_eq!(c.id, "https://client.example/iteron.json");
    srv.assert_untouched("the registration endpoint under forced CIMD")
        .await;
}

#[tokio::test]
async fn forced_dcr_never_falls_back_to_a_client_id_metadata_document() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let http = net.client(Zone::Loopback).unwrap();
    let srv = Server::start(|_| provider(None, None)).await;
    let b = srv.base();
    let got = flow::register(
        &http,
        &registration_metadata(&b, false, true),
        &Mode::Dcr,
        &cimd_settings(),
        "http://127.0.0.1:9/callback",
    )
    .await;
    assert!(matches!(got, Err(OAuthError::NoRegistration(_))), "{got:?}");
    srv.assert_untouched("a server offering only CIMD").await;

    // Where both are offered, forced DCR registers (a native client that may refresh), and
    // never turns into the CIMD client.
    let c = flow::register(
        &http,
        &registration_metadata(&b, true, true),
        &Mode::Dcr,
        &cimd_settings(),
        "http://127.0.0.1:9/callback",
    )
    .await
    .unwrap();
    assert_eq!((c.kind, c.id.as_str()), (ClientKind::Dynamic, "dyn-client"));
    let posts = srv.to("/register");
    assert_eq!(posts.len(), 1);
    let body = posts[0].json();
    assert_eq!(body["application_type"], "native");
    assert_eq!(
        body["grant_types"],
        json!(["authorization_code", "refresh_token"])
    );
    assert_eq!(
        body["redirect_uris"],
        json!(["http://127.0.0.1:9/callback"])
    );
}

// ---------------------------------------------------------------------------------------------
// Redirects
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn metadata_registration_and_token_redirects_are_never_followed() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let http = net.client(Zone::Loopback).unwrap();
    // Where every redirect points: a provider that would answer everything correctly.
    let target =
        Server::start(|base| provider(Some(prm_doc(&mcp_url(base), base)), Some(as_doc(base))))
            .await;
    let t = target.base();
    let srv = Server::start(move |_| {
        Arc::new(move |req: &Seen| {
            let status = if req.method == "GET" { 302 } else { 307 };
            Reply::redirect(status, &format!("{t}{}", req.target))
        })
    })
    .await;
    let b = srv.base();
    let got = metadata::discover_resource(&http, &ep(&mcp_url(&b)), None, None).await;
    assert_eq!(got, Err(OAuthError::NoResourceMetadata));
    let got = metadata::discover_server(&http, &b).await;
    assert_eq!(got, Err(OAuthError::NoServerMetadata));
    let meta = ServerMetadata {
        registration_endpoint: Some(ep(&format!("{b}/register"))),
        ..server_metadata(&b, &format!("{b}/token"), None)
    };
    let client = public_client(&b);
    let attempt = flow::start(&meta, &client, "http://127.0.0.1:9/callback", "r", None).unwrap();
    let got = flow::exchange(&http, &meta, &client, &attempt, secret("c0de")).await;
    assert!(
        matches!(
            got,
            Err(OAuthError::Net(NetError::Redirect { status: 307, .. }))
        ),
        "{got:?}"
    );
    let got = flow::register(
        &http,
        &meta,
        &Mode::Dcr,
        &ClientSettings::default(),
        "http://127.0.0.1:9/callback",
    )
    .await;
    assert!(
        matches!(
            got,
            Err(OAuthError::Net(NetError::Redirect { status: 307, .. }))
        ),
        "{got:?}"
    );
    // Two candidates of each metadata kind, one exchange, one registration: each asked once.
    assert_eq!(srv.seen().len(), 6, "{:?}", srv.seen());
    target.assert_untouched("the redirect target").await;
}

// ---------------------------------------------------------------------------------------------
// Zones: a public binding never reaches loopback, private or link-local addresses
// ---------------------------------------------------------------------------------------------

/// Metadata of a public-looking issuer whose token, registration and revocation endpoints are
/// at `endpoints` — a valid document: only the zone check stands in the way.
fn steered_metadata(endpoints: &str) -> ServerMetadata {
    let doc = json!({
        "issuer": "https://as.example",
        "authorization_endpoint": "https://as.example/authorize",
        "token_endpoint": format!("{endpoints}/token"),
        "registration_endpoint": format!("{endpoints}/register"),
        "revocation_endpoint": format!("{endpoints}/revoke"),
        "code_challenge_methods_supported": ["S256"],
    });
    metadata::validate_server("https://as.example", &doc)
        .unwrap_or_else(|e| panic!("{endpoints}: the document itself is valid: {e}"))
}

/// Exchange, refresh, revocation and dynamic registration against `meta` under `http`: each
/// must be refused as a `zone` address.
async fn assert_every_request_refused(
    http: &ZoneClient,
    meta: &ServerMetadata,
    zone: Zone,
    what: &str,
) {
    let client = public_client(&meta.issuer);
    let attempt = flow::start(
        meta,
        &client,
        "http://127.0.0.1:9/callback",
        "https://mcp.example/mcp",
        None,
    )
    .unwrap();
    let e = flow::exchange(http, meta, &client, &attempt, secret("c0de"))
        .await
        .unwrap_err();
    assert_above(&e, zone, &format!("{what}: exchange"));
    let e = flow::refresh(
        http,
        meta,
        &client,
        &secret("rt-1"),
        "https://mcp.example/mcp",
    )
    .await
    .unwrap_err();
    assert_above(&e, zone, &format!("{what}: refresh"));
    let e = flow::revoke(http, meta, &client, &secret("rt-1"), "refresh_token")
        .await
        .unwrap_err();
    assert_above(&e, zone, &format!("{what}: revoke"));
    let e = flow::register(
        http,
        meta,
        &Mode::Dcr,
        &ClientSettings::default(),
        "http://127.0.0.1:9/callback",
    )
    .await
    .unwrap_err();
    assert_above(&e, zone, &format!("{what}: register"));
}

#[tokio::test]
async fn a_public_binding_never_sends_oauth_requests_to_loopback_literals() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let public = net.client(Zone::Public).unwrap();
    let target = Server::silent_on(v4(127, 0, 0, 1)).await;
    let p = target.port();
    for host in [
        "127.0.0.1",
        "127.1",
        "2130706433",
        "0x7f000001",
        "[::ffff:127.0.0.1]",
    ] {
        let meta = steered_metadata(&format!("https://{host}:{p}"));
        assert_every_request_refused(&public, &meta, Zone::Loopback, host).await;
    }
    target
        .assert_untouched("loopback literals under a public binding")
        .await;
}

#[tokio::test]
async fn a_public_binding_never_sends_oauth_requests_to_names_resolving_to_loopback_or_private_addresses()
 {
    let dns = DnsServer::start().await;
    dns.answer("as.test", &[v4(127, 0, 0, 2)]);
    dns.answer("mixed.test", &[v4(93, 184, 216, 34), v4(127, 0, 0, 2)]);
    dns.answer("corp.test", &[v4(10, 0, 0, 1)]);
    let net = net_with(&dns);
    let public = net.client(Zone::Public).unwrap();
    let target = Server::silent_on(v4(127, 0, 0, 2)).await;
    let p = target.port();
    for (name, zone) in [
        ("as.test", Zone::Loopback),
        ("mixed.test", Zone::Loopback),
        ("corp.test", Zone::Private),
    ] {
        let meta = steered_metadata(&format!("https://{name}:{p}"));
        assert_every_request_refused(&public, &meta, zone, name).await;
        assert!(
            dns.queries(name, A) > 0,
            "{name}: refused after resolving, not before"
        );
    }
    target
        .assert_untouched("names resolving to loopback under a public binding")
        .await;
}

#[tokio::test]
async fn a_public_binding_never_reaches_the_cloud_metadata_address() {
    let dns = DnsServer::start().await;
    dns.answer("metadata.test", &[v4(169, 254, 169, 254)]);
    let net = net_with(&dns);
    let public = net.client(Zone::Public).unwrap();
    for base in [
        "https://169.254.169.254",
        "https://0xa9fea9fe",
        "https://[::ffff:169.254.169.254]",
        "https://metadata.test",
    ] {
        let meta = steered_metadata(&format!("{base}/latest/api"));
        assert_every_request_refused(&public, &meta, Zone::LinkLocal, base).await;
        // Discovery pointed there is refused the same way.
        let e = metadata::discover_server(&public, base).await.unwrap_err();
        assert_above(
            &e,
            Zone::LinkLocal,
            &format!("{base}: authorization-server metadata"),
        );
        let challenge = Challenge {
            resource_metadata: Some(format!("{base}/latest/meta-data/iam/security-credentials/")),
            ..Challenge::default()
        };
        let e = metadata::discover_resource(
            &public,
            &ep("https://mcp.example/mcp"),
            Some(&challenge),
            None,
        )
        .await
        .unwrap_err();
        assert_above(
            &e,
            Zone::LinkLocal,
            &format!("{base}: protected-resource metadata"),
        );
    }
    assert!(dns.queries("metadata.test", A) > 0);
}

#[tokio::test]
async fn a_public_server_cannot_steer_discovery_to_a_loopback_provider() {
    let dns = DnsServer::start().await;
    dns.answer("as.test", &[v4(127, 0, 0, 1)]);
    let net = net_with(&dns);
    let public = net.client(Zone::Public).unwrap();
    let loopback = net.client(Zone::Loopback).unwrap();
    // A provider that answers correctly to anyone who reaches it.
    let srv = provider_with(|_, _| {}).await;
    let b = srv.base();
    let p = srv.port();
    // The control: the loopback binding reaches it.
    metadata::discover_server(&loopback, &b).await.unwrap();
    let before = srv.connections_settled().await;
    assert!(before > 0);

    for issuer in [
        b.clone(),
        format!("http://localhost:{p}"),
        format!("https://as.test:{p}"),
    ] {
        let e = metadata::discover_server(&public, &issuer)
            .await
            .unwrap_err();
        assert_above(&e, Zone::Loopback, &issuer);
    }
    // A challenge of a public MCP server naming the loopback metadata: the login stops there.
    let challenge = Challenge {
        resource_metadata: Some(format!("{b}/.well-known/oauth-protected-resource/mcp")),
        ..Challenge::default()
    };
    let req = LoginRequest {
        server: ep("https://mcp.example/mcp"),
        ..request(&srv)
    };
    let browser = Browser::never();
    let e = match tokio::time::timeout(
        LOGIN_LIMIT,
        login::login(
            &public,
            Zone::Public,
            &req,
            Some(&challenge),
            browser.present(),
        ),
    )
    .await
    .expect("the login hung")
    {
        Ok(_) => panic!("the login succeeded"),
        Err(e) => e,
    };
    assert_above(&e, Zone::Loopback, "login");
    assert!(browser.shown().is_empty());
    assert_eq!(
        srv.connections_settled().await,
        before,
        "the public binding reached the loopback provider"
    );
}

#[tokio::test]
async fn refresh_and_revocation_are_checked_again_against_the_binding_zone() {
    let dns = DnsServer::start().await;
    let net = net_with(&dns);
    let srv = Server::start(|_| provider(None, None)).await;
    let b = srv.base();
    let meta = server_metadata(&b, &format!("{b}/token"), Some(&format!("{b}/revoke")));
    let client = public_client(&b);
    // Bound to loopback (as recorded at login): both work.
    let loopback = net.client(Zone::Loopback).unwrap();
    flow::refresh(&loopback, &meta, &client, &secret("rt-1"), "r")
        .await
        .unwrap();
    assert_eq!(
        flow::revoke(&loopback, &meta, &client, &secret("rt-1"), "refresh_token")
            .await
            .unwrap(),
        flow::Revocation::Accepted
    );
    let before = srv.connections_settled().await;
    assert_eq!(before, 2);
    // The same metadata under a public binding: both refused, nothing sent.
    let public = net.client(Zone::Public).unwrap();
    let e = flow::refresh(&public, &meta, &client, &secret("rt-1"), "r")
        .await
        .unwrap_err();
    assert_above(&e, Zone::Loopback, "refresh");
    let e = flow::revoke(&public, &meta, &client, &secret("rt-1"), "refresh_token")
        .await
        .unwrap_err();
    assert_above(&e, Zone::Loopback, "revoke");
    assert_eq!(srv.connections_settled().await, before);
}

// ---------------------------------------------------------------------------------------------
// Scopes rejected by the provider
// ---------------------------------------------------------------------------------------------

/// A provider whose resource metadata lists scopes, so that the login discovers them.
async fn scoped_provider() -> Server {
    Server::start(|base| {
        let mut prm = prm_doc(&mcp_url(base), base);
        prm["scopes_supported"] = json!(["mcp:read", "mcp:write"]);
        provider(Some(prm), Some(as_doc(base)))
    })
    .await
}

fn invalid_scope(s: &Shown) -> String {
    s.get(&format!("error=invalid_scope&state={}", s.state()))
}

#[tokio::test]
async fn discovered_scopes_rejected_by_the_provider_get_exactly_one_retry_without_scope() {
    let srv = scoped_provider().await;
    let browser = Browser::new(|n, s| vec![if n == 0 { invalid_scope(s) } else { s.code("") }]);
    let out = run_login(&request(&srv), None, &browser)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let shown = browser.shown();
    assert_eq!(shown.len(), 2, "one retry");
    assert_eq!(
        shown[0].param("scope").as_deref(),
        Some("mcp:read mcp:write")
    );
    assert_eq!(
        shown[1].param("scope"),
        None,
        "the retry has no scope at all"
    );
    assert_ne!(shown[0].state(), shown[1].state(), "a fresh state");
    assert_eq!(out.requested, None);
    assert_eq!(srv.to("/token").len(), 1);
}

#[tokio::test]
async fn a_second_invalid_scope_ends_the_login_without_a_third_attempt() {
    let srv = scoped_provider().await;
    let browser = Browser::new(|_, s| vec![invalid_scope(s)]);
    let e = refused(run_login(&request(&srv), None, &browser).await);
    assert!(is_callback_refusal(&e), "{e:?}");
    assert_eq!(browser.shown().len(), 2);
    assert!(srv.to("/token").is_empty());
}

#[tokio::test]
async fn operator_scopes_rejected_by_the_provider_are_never_retried_or_edited() {
    let srv = scoped_provider().await;
    let mut req = request(&srv);
    req.operator_scopes = Some("mcp:admin".into());
    let browser = Browser::new(|n, s| vec![if n == 0 { invalid_scope(s) } else { s.code("") }]);
    let e = refused(run_login(&req, None, &browser).await);
    assert!(is_callback_refusal(&e), "{e:?}");
    let shown = browser.shown();
    assert_eq!(shown.len(), 1, "no retry");
    assert_eq!(shown[0].param("scope").as_deref(), Some("mcp:admin"));
    assert!(srv.to("/token").is_empty());
}

#[tokio::test]

async fn configured_scopes_rejected_by_the_provider_are_never_retried_or_edited() {
    let srv = scoped_provider().await;
    let mut req = request(&srv);
    req.configured_scopes = Some("mcp:admin".into());
    let browser = Browser::new(|n, s| vec![if n == 0 { invalid_scope(s) } else { s.code("") }]);
    let _ = run_login(&req, None, &browser).await;
    let shown = browser.shown();
    assert_eq!(shown[0].param("scope").as_deref(), Some("mcp:admin"));
    assert_eq!(
        shown.len(),
        1,
        "the operator's configured scopes were dropped and the login retried without them"
    );
    assert!(srv.to("/token").is_empty());
}

#[tokio::test]

async fn an_invalid_scope_error_failing_the_state_or_iss_check_is_not_acted_on() {
    // (what, whether iss is promised, the forged first answer given the attempt)
    type Forged = fn(&Shown) -> String;
    let cases: [(&str, bool, Forged); 3] = [
        ("another state", false, |s| {
            s.get("error=invalid_scope&state=forged")
        }),
        ("no state", false, |s| s.get("error=invalid_scope")),
        ("a promised iss missing", true, invalid_scope),
    ];
    for (what, promise, forged) in cases {
        let srv = Server::start(|base| {
            let mut prm = prm_doc(&mcp_url(base), base);
            prm["scopes_supported"] = json!(["mcp:read", "mcp:write"]);
            let mut meta = as_doc(base);
            meta["authorization_response_iss_parameter_supported"] = json!(promise);
            provider(Some(prm), Some(meta))
        })
        .await;
        let issuer = srv.base();
        // The forged answer, then the real one for the same attempt. Should a retry happen
        // anyway, answer it correctly so the login ends at once.
        let browser = Browser::new(move |n, s| {
            let real = s.code(&format!("&iss={}", enc(&issuer)));
            if n == 0 {
                vec![forged(s), real]
            } else {
                vec![real]
            }
        });
        let got = run_login(&request(&srv), None, &browser).await;
        assert_eq!(
            browser.shown().len(),
            1,
            "{what}: a forged response made the login drop its scopes and ask again"
        );
        if promise {
            // It carries the state: it ends the login, unredeemed.
            assert!(is_callback_refusal(&refused(got)), "{what}");
            assert!(srv.to("/token").is_empty(), "{what}");
            continue;
        }
        // It does not: it is ignored, and the real answer is redeemed with the scopes asked.
        let out = got.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(
            out.requested.as_deref(),
            Some("mcp:read mcp:write"),
            "{what}"
        );
        assert_eq!(srv.to("/token").len(), 1, "{what}");
    }
}
