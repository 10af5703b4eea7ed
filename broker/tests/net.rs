#![allow(clippy::unwrap_used, clippy::expect_used)]
//! End-to-end tests of `iteron_broker::net` (issue 3): pinned DNS judged against network zones,
//! no rebinding window, IP-literal checks, redirects never followed, no proxy or TLS
//! environment, pinned roots, body caps and deadlines.
//!
//! Every server is on 127.0.0.0/8 and every name is answered by the DNS responder in
//! `support`, so nothing depends on the machine's resolver or network.

mod support;

use std::net::IpAddr;
use std::time::Duration;

use iteron_broker::net::{Net, NetConfig, NetError, PinnedResolver, Request, Response};
use iteron_policy::url::EndpointUrl;
use iteron_policy::zone::{Rejected, Zone};
use reqwest::Method;
use support::{A, DnsServer, Listener, Reply, TestCa};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn loopback(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

fn get(url: &str) -> Request {
    Request::new(Method::GET, EndpointUrl::parse(url).unwrap())
}

fn net_using(dns: &DnsServer) -> Net {
    Net::new(NetConfig {
        dns: dns.dns(),
        ..NetConfig::default()
    })
    .unwrap()
}

/// One GET through the client bound to `zone`.
async fn send(net: &Net, zone: Zone, url: &str) -> Result<Response, NetError> {
    net.client(zone).unwrap().send(get(url)).await
}

/// The error of a request that must fail (`Response` has no `Debug`).
fn refusal(result: Result<Response, NetError>) -> NetError {
    match result {
        Ok(resp) => panic!("expected an error, got status {}", resp.status()),
        Err(e) => e,
    }
}

async fn resolve(dns: &DnsServer, zone: Zone, name: &str) -> Result<Vec<IpAddr>, NetError> {
    PinnedResolver::new(&dns.dns(), zone)
        .unwrap()
        .resolve_checked(name)
        .await
}

// ---------------------------------------------------------------------------------------------
// The resolver judges whole answers
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_public_only_answer_is_returned_exactly_under_public() {
    let dns = DnsServer::start().await;
    dns.answer("public.test", &[ip("93.184.216.34")]);
    let got = resolve(&dns, Zone::Public, "public.test").await;
    assert_eq!(got, Ok(vec![ip("93.184.216.34")]));
}

#[tokio::test]
async fn a_public_and_private_mixed_answer_is_refused_as_above_zone_under_public() {
    let dns = DnsServer::start().await;
    dns.answer("mixed.test", &[ip("93.184.216.34"), ip("10.0.0.5")]);
    let got = resolve(&dns, Zone::Public, "mixed.test").await;
    assert_eq!(
        got,
        Err(NetError::AboveZone {
            host: "mixed.test".into(),
            addr: ip("10.0.0.5"),
            zone: Zone::Private,
            binding: Zone::Public,
        })
    );
    assert_eq!(
        got.unwrap_err().to_string(),
        "refused: mixed.test resolved to 10.0.0.5 (private), above binding zone public"
    );
    iteron_test_support::record!("P3", serde_json::json!({}),);
}

#[tokio::test]
async fn a_public_and_private_mixed_answer_is_refused_as_mixed_zones_under_private() {
    let dns = DnsServer::start().await;
    dns.answer("mixed.test", &[ip("93.184.216.34"), ip("10.0.0.5")]);
    let got = resolve(&dns, Zone::Private, "mixed.test").await;
    assert_eq!(
        got,
        Err(NetError::MixedZones {
            host: "mixed.test".into(),
            first: (ip("93.184.216.34"), Zone::Public),
            other: (ip("10.0.0.5"), Zone::Private),
        })
    );
}

#[tokio::test]
async fn an_aaaa_only_loopback_answer_is_refused_as_loopback_under_public() {
    let dns = DnsServer::start().await;
    dns.answer("six.test", &[ip("::1")]);
    let got = resolve(&dns, Zone::Public, "six.test").await;
    assert_eq!(
        got,
        Err(NetError::AboveZone {
            host: "six.test".into(),
            addr: ip("::1"),
            zone: Zone::Loopback,
            binding: Zone::Public,
        })
    );
}

#[tokio::test]
async fn a_v4_mapped_loopback_aaaa_answer_is_refused_as_loopback_under_public() {
    let dns = DnsServer::start().await;
    dns.answer("mapped.test", &[ip("::ffff:127.0.0.1")]);
    let got = resolve(&dns, Zone::Public, "mapped.test").await;
    assert_eq!(
        got,
        Err(NetError::AboveZone {
            host: "mapped.test".into(),
            addr: ip("::ffff:127.0.0.1"),
            zone: Zone::Loopback,
            binding: Zone::Public,
        })
    );
}

#[tokio::test]
async fn a_nat64_aaaa_answer_embedding_loopback_is_refused_as_loopback_under_public() {
    let dns = DnsServer::start().await;
    dns.answer("nat64.test", &[ip("64:ff9b::7f00:1")]);
    let got = resolve(&dns, Zone::Public, "nat64.test").await;
    assert_eq!(
        got,
        Err(NetError::AboveZone {
            host: "nat64.test".into(),
            addr: ip("64:ff9b::7f00:1"),
            zone: Zone::Loopback,
            binding: Zone::Public,
        })
    );
}

#[tokio::test]
async fn a_v4_mapped_metadata_address_is_refused_as_link_local_under_private() {
    let dns = DnsServer::start().await;
    dns.answer("metadata.test", &[ip("::ffff:169.254.169.254")]);
    let got = resolve(&dns, Zone::Private, "metadata.test").await;
    assert_eq!(
        got,
        Err(NetError::AboveZone {
            host: "metadata.test".into(),
            addr: ip("::ffff:169.254.169.254"),
            zone: Zone::LinkLocal,
            binding: Zone::Private,
        })
    );
}

#[tokio::test]
async fn a_multicast_answer_is_rejected_in_every_zone() {
    let dns = DnsServer::start().await;
    dns.answer("multicast.test", &[ip("224.0.0.251")]);
    for zone in Zone::ALL {
        let got = resolve(&dns, zone, "multicast.test").await;
        assert_eq!(
            got,
            Err(NetError::RejectedAddress {
                host: "multicast.test".into(),
                addr: ip("224.0.0.251"),
                kind: Rejected::Multicast,
            }),
            "under {zone}"
        );
    }
}

#[tokio::test]
async fn an_unknown_name_fails_to_resolve_as_no_such_name() {
    let dns = DnsServer::start().await;
    let got = resolve(&dns, Zone::Loopback, "absent.test").await;
    assert_eq!(
        got,
        Err(NetError::Resolve {
            host: "absent.test".into(),
            reason: "no such name".into(),
        })
    );
}

#[tokio::test]
async fn a_ttl_zero_answer_is_judged_afresh_on_every_lookup() {
    let dns = DnsServer::start().await;
    dns.answer_in_turn("flip.test", &[&[ip("93.184.216.34")], &[ip("127.0.0.1")]]);
    let resolver = PinnedResolver::new(&dns.dns(), Zone::Public).unwrap();
    assert_eq!(
        resolver.resolve_checked("flip.test").await,
        Ok(vec![ip("93.184.216.34")])
    );
    assert_eq!(
        resolver.resolve_checked("flip.test").await,
        Err(NetError::AboveZone {
            host: "flip.test".into(),
            addr: ip("127.0.0.1"),
            zone: Zone::Loopback,
            binding: Zone::Public,
        })
    );
    assert_eq!(dns.queries("flip.test", A), 2);
}

// ---------------------------------------------------------------------------------------------
// End to end through ZoneClient::send
// ---------------------------------------------------------------------------------------------

/// An HTTPS listener on 127.0.0.1 for `loop.test`, which the test DNS maps to 127.0.0.1, and a
/// network layer trusting its CA.
async fn loop_fixture(reply: Reply) -> (DnsServer, Listener, Net) {
    let dns = DnsServer::start().await;
    let ca = TestCa::new();
    let server = Listener::https(loopback(1), reply, ca.server_config(&["loop.test"])).await;
    dns.answer("loop.test", &[loopback(1)]);
    let net = Net::new(NetConfig {
        dns: dns.dns(),
        extra_roots_pem: Some(ca.pem()),
        ..NetConfig::default()
    })
    .unwrap();
    (dns, server, net)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_to_loopback_is_refused_under_public_and_the_listener_sees_nothing() {
    let (dns, server, net) = loop_fixture(Reply::ok(b"secret")).await;
    let url = format!("https://loop.test:{}/", server.port());
    let err = refusal(send(&net, Zone::Public, &url).await);
    assert_eq!(
        err,
        NetError::AboveZone {
            host: "loop.test".into(),
            addr: loopback(1),
            zone: Zone::Loopback,
            binding: Zone::Public,
        }
    );
    assert_eq!(
        err.to_string(),
        "refused: loop.test resolved to 127.0.0.1 (loopback), above binding zone public"
    );
    assert_eq!(server.connections(), 0);
    assert_eq!(dns.queries("loop.test", A), 1);
    iteron_test_support::record!("P3", serde_json::json!({}),);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_to_loopback_is_reached_under_loopback_and_its_body_read() {
    let (dns, server, net) = loop_fixture(Reply::ok(b"hello")).await;
    let url = format!("https://loop.test:{}/", server.port());
    let resp = send(&net, Zone::Loopback, &url).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.body(1024).await.unwrap(), b"hello");
    assert_eq!(server.connections(), 1);
    assert_eq!(dns.queries("loop.test", A), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn localhost_is_loopback_whatever_the_nameservers_say_and_is_refused_under_public() {
    // hickory answers `localhost` itself (RFC 6761: 127.0.0.1 and ::1) and never asks the
    // configured servers, so a nameserver claiming a public address for it changes nothing.
    let dns = DnsServer::start().await;
    dns.answer("localhost", &[ip("93.184.216.34")]);
    let origin = Listener::http(loopback(1), Reply::ok(b"secret")).await;
    let net = net_using(&dns);
    let url = format!("http://localhost:{}/", origin.port());
    let err = refusal(send(&net, Zone::Public, &url).await);
    let NetError::AboveZone {
        host,
        addr,
        zone,
        binding,
    } = &err
    else {
        panic!("expected a zone refusal, got {err:?}");
    };
    assert_eq!(host, "localhost");
    assert!(addr.is_loopback(), "{addr}");
    assert_eq!((*zone, *binding), (Zone::Loopback, Zone::Public));
    assert_eq!(origin.connections(), 0);
    assert_eq!(dns.queries("localhost", A), 0);

    let resp = send(&net, Zone::Loopback, &url).await.unwrap();
    assert_eq!(resp.body(1024).await.unwrap(), b"secret");
    assert_eq!(origin.connections(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_connects_to_exactly_the_validated_address_without_a_second_lookup() {
    let dns = DnsServer::start().await;
    let ca = TestCa::new();
    let tls = ca.server_config(&["rebind.test"]);
    let (validated, rebound) = Listener::https_pair_on_one_port(
        (loopback(2), Reply::ok(b"validated")),
        (loopback(3), Reply::ok(b"rebound")),
        &tls,
    )
    .await;
    dns.answer_in_turn("rebind.test", &[&[loopback(2)], &[loopback(3)]]);
    let net = Net::new(NetConfig {
        dns: dns.dns(),
        extra_roots_pem: Some(ca.pem()),
        ..NetConfig::default()
    })
    .unwrap();
    let url = format!("https://rebind.test:{}/", validated.port());
    let resp = send(&net, Zone::Loopback, &url).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.body(1024).await.unwrap(), b"validated");
    assert_eq!(validated.connections(), 1);
    assert_eq!(rebound.connections(), 0);
    assert_eq!(dns.queries("rebind.test", A), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_public_answer_that_rebinds_to_loopback_never_reaches_the_loopback_listener() {
    let dns = DnsServer::start().await;
    let ca = TestCa::new();
    let inside = Listener::https(
        loopback(1),
        Reply::ok(b"inside"),
        ca.server_config(&["flip.test"]),
    )
    .await;
    dns.answer_in_turn("flip.test", &[&[ip("1.1.1.1")], &[loopback(1)]]);
    let net = Net::new(NetConfig {
        dns: dns.dns(),
        extra_roots_pem: Some(ca.pem()),
        connect_timeout: Duration::from_millis(500),
        ..NetConfig::default()
    })
    .unwrap();
    let url = format!("https://flip.test:{}/", inside.port());
    let err = refusal(send(&net, Zone::Public, &url).await);
    assert!(
        matches!(err, NetError::Connect { .. } | NetError::Timeout { .. }),
        "{err:?}"
    );
    assert_eq!(inside.connections(), 0);
    assert_eq!(dns.queries("flip.test", A), 1);
    iteron_test_support::record!("P3", serde_json::json!({}),);
}

#[tokio::test]
async fn an_ipv4_literal_loopback_host_is_refused_under_public_without_connecting() {
    let dns = DnsServer::start().await;
    let origin = Listener::http(loopback(1), Reply::ok(b"secret")).await;
    let net = net_using(&dns);
    let url = format!("http://127.0.0.1:{}/", origin.port());
    let err = refusal(send(&net, Zone::Public, &url).await);
    assert_eq!(
        err,
        NetError::AboveZone {
            host: "127.0.0.1".into(),
            addr: loopback(1),
            zone: Zone::Loopback,
            binding: Zone::Public,
        }
    );
    assert_eq!(
        err.to_string(),
        "refused: 127.0.0.1 is loopback, above binding zone public"
    );
    assert_eq!(origin.connections(), 0);
    iteron_test_support::record!("P3", serde_json::json!({}),);
}

#[tokio::test]
async fn a_v4_mapped_ipv6_literal_loopback_host_is_refused_under_public_without_connecting() {
    let dns = DnsServer::start().await;
    let origin = Listener::http(loopback(1), Reply::ok(b"secret")).await;
    let net = net_using(&dns);
    let url = format!("http://[::ffff:127.0.0.1]:{}/", origin.port());
    let err = refusal(send(&net, Zone::Public, &url).await);
    assert_eq!(
        err,
        NetError::AboveZone {
            host: "::ffff:127.0.0.1".into(),
            addr: ip("::ffff:127.0.0.1"),
            zone: Zone::Loopback,
            binding: Zone::Public,
        }
    );
    assert_eq!(origin.connections(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_of_different_zones_never_share_a_pooled_connection() {
    let (dns, server, net) = loop_fixture(Reply::ok(b"pooled")).await;
    let url = format!("https://loop.test:{}/", server.port());
    // Loopback requests until one rides a kept-alive connection: from then on the process holds
    // a pooled connection to loop.test that a shared client would reuse without resolving.
    // (A connection returns to the pool asynchronously, so the first reuse is not always the
    // second request.)
    for _ in 0..50 {
        let resp = send(&net, Zone::Loopback, &url).await.unwrap();
        assert_eq!(resp.body(1024).await.unwrap(), b"pooled");
        if server.heads().len() > server.connections() {
            break;
        }
    }
    let connections = server.connections();
    let requests = server.heads().len();
    let lookups = dns.queries("loop.test", A);
    assert!(requests > connections, "no connection was ever reused");

    let err = refusal(send(&net, Zone::Public, &url).await);
    assert_eq!(
        err,
        NetError::AboveZone {
            host: "loop.test".into(),
            addr: loopback(1),
            zone: Zone::Loopback,
            binding: Zone::Public,
        }
    );
    assert_eq!(server.connections(), connections);
    assert_eq!(server.heads().len(), requests);
    // The refusal came from a fresh lookup, not from a pooled connection.
    assert_eq!(dns.queries("loop.test", A), lookups + 1);
}

// ---------------------------------------------------------------------------------------------
// Redirects
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_to_an_ip_literal_localhost_or_another_name_are_never_followed() {
    let dns = DnsServer::start().await;
    let target = Listener::http(loopback(1), Reply::ok(b"internal")).await;
    let q = target.port();
    dns.answer("other.test", &[loopback(1)]);
    let net = net_using(&dns);
    let client = net.client(Zone::Loopback).unwrap();
    // (Location, the origin the error names.)
    let locations = [
        (
            format!("http://127.0.0.1:{q}/internal"),
            format!("http://127.0.0.1:{q}"),
        ),
        (
            format!("http://localhost:{q}/x"),
            format!("http://localhost:{q}"),
        ),
        (
            format!("http://other.test:{q}/"),
            format!("http://other.test:{q}"),
        ),
    ];
    for status in [301u16, 302, 307, 308] {
        for (location, shown) in &locations {
            let origin = Listener::http(loopback(1), Reply::redirect(status, location)).await;
            let url = format!("http://127.0.0.1:{}/start", origin.port());
            let err = refusal(client.send(get(&url)).await);
            assert_eq!(
                err,
                NetError::Redirect {
                    status,
                    location: shown.clone(),
                },
                "{status} to {location}"
            );
            assert!(err.to_string().contains(shown.as_str()), "{err}");
            assert_eq!(origin.connections(), 1);
        }
    }
    assert_eq!(target.connections(), 0);
    iteron_test_support::record!("P3", serde_json::json!({}),);
}

#[tokio::test]
async fn a_redirect_error_never_shows_the_path_or_query_of_the_location() {
    let dns = DnsServer::start().await;
    let net = net_using(&dns);
    for location in [
        "https://idp.example/cb?code=AUTHCODE42&state=s",
        "/reset/AUTHCODE42",
        "https://a.example/x?X-Amz-Signature=AUTHCODE42",
        "::not a url AUTHCODE42",
    ] {
        let origin = Listener::http(loopback(1), Reply::redirect(302, location)).await;
        let url = format!("http://127.0.0.1:{}/", origin.port());
        let err = refusal(send(&net, Zone::Loopback, &url).await);
        assert!(
            matches!(err, NetError::Redirect { status: 302, .. }),
            "{err:?}"
        );
        assert!(!err.to_string().contains("AUTHCODE42"), "{err}");
        assert!(!format!("{err:?}").contains("AUTHCODE42"), "{err:?}");
    }
}

#[tokio::test]
async fn a_redirect_location_carrying_a_token_is_redacted_in_the_error() {
    let dns = DnsServer::start().await;
    let target = Listener::http(loopback(1), Reply::ok(b"internal")).await;
    let location = format!(
        "http://127.0.0.1:{}/callback?access_token=SECRET123",
        target.port()
    );
    let origin = Listener::http(loopback(1), Reply::redirect(302, &location)).await;
    let net = net_using(&dns);
    let url = format!("http://127.0.0.1:{}/", origin.port());
    let err = refusal(send(&net, Zone::Loopback, &url).await);
    let NetError::Redirect {
        status,
        location: shown,
    } = &err
    else {
        panic!("expected a redirect refusal, got {err:?}");
    };
    assert_eq!(*status, 302);
    assert!(!shown.contains("SECRET123"), "{shown}");
    assert!(!err.to_string().contains("SECRET123"), "{err}");
    assert!(!format!("{err:?}").contains("SECRET123"), "{err:?}");
    assert_eq!(target.connections(), 0);
}

// ---------------------------------------------------------------------------------------------
// No environment: proxies and TLS roots
// ---------------------------------------------------------------------------------------------

/// The name of the test below, for re-running it alone in a child process.
const ENV_TEST: &str = "proxy_and_tls_environment_variables_change_nothing";
/// Printed by a child when it has checked everything, so the parent knows the test ran.
const CHILD_DONE: &str = "iteron-net-child: all checks passed";

/// Re-runs this test binary, only [`ENV_TEST`], as a child whose proxy variables all point at
/// `proxy` and whose `SSL_CERT_FILE`/`SSL_CERT_DIR` name `ca`. `mode` selects what the child
/// does; `origin` and `tls_origin` are the URLs it talks to. Returns its stdout once it exited 0.
async fn run_env_child(
    mode: &str,
    proxy: &Listener,
    ca: &TestCa,
    origin: &str,
    tls_origin: &str,
) -> String {
    let dir = std::env::temp_dir().join(format!(
        "iteron-net-test-{}-{}",
        std::process::id(),
        proxy.port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();

    let proxy_url = format!("http://127.0.0.1:{}", proxy.port());
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", ENV_TEST, "--nocapture", "--test-threads=1"])
        .env("ITERON_NET_CHILD", mode)
        .env("ITERON_NET_CHILD_HTTP", origin)
        .env("ITERON_NET_CHILD_HTTPS", tls_origin)
        .env("SSL_CERT_FILE", &ca_file)
        .env("SSL_CERT_DIR", &dir)
        .env_remove("NO_PROXY")
        .env_remove("no_proxy");
    for var in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        cmd.env(var, &proxy_url);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{mode} child failed\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(CHILD_DONE),
        "the {mode} child did not run the test\n{stdout}"
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_and_tls_environment_variables_change_nothing() {
    match std::env::var("ITERON_NET_CHILD").as_deref() {
        Ok("net") => return env_child_net().await,
        Ok("control") => return env_child_control().await,
        _ => {}
    }
    let ca = TestCa::new();
    let origin = Listener::http(loopback(1), Reply::ok(b"origin")).await;
    let tls_origin = Listener::https(
        loopback(1),
        Reply::ok(b"tls origin"),
        ca.server_config(&["127.0.0.1"]),
    )
    .await;
    let origin_url = format!("http://127.0.0.1:{}/", origin.port());
    let tls_url = format!("https://127.0.0.1:{}/", tls_origin.port());

    // Control: in the same environment, a default reqwest client goes through the proxy, so
    // the environment the Net child gets really is a hostile one.
    let control_proxy = Listener::http(loopback(1), Reply::ok(b"proxy")).await;
    run_env_child("control", &control_proxy, &ca, &origin_url, &tls_url).await;
    assert_eq!(control_proxy.connections(), 1);
    let control_heads = control_proxy.heads();
    assert_eq!(control_heads.len(), 1);
    assert!(
        control_heads[0].starts_with(&format!("GET {origin_url}control HTTP/1.1\r\n")),
        "{control_heads:?}"
    );
    assert_eq!(origin.connections(), 0);

    let proxy = Listener::http(loopback(1), Reply::ok(b"proxy")).await;
    run_env_child("net", &proxy, &ca, &origin_url, &tls_url).await;
    assert_eq!(proxy.connections(), 0, "{:?}", proxy.heads());
    assert_eq!(origin.connections(), 1);
    // Origin-form request line: the origin was spoken to directly, not through a proxy.
    let heads = origin.heads();
    assert_eq!(heads.len(), 1);
    assert!(heads[0].starts_with("GET / HTTP/1.1\r\n"), "{heads:?}");
    // The TLS origin was reached directly too; the handshake failed on the client side.
    assert_eq!(tls_origin.connections(), 1);
    assert!(tls_origin.heads().is_empty());
    iteron_test_support::record!("P3", serde_json::json!({}),);
}

/// The Net child: the proxy variables and `SSL_CERT_FILE` point at the parent's listener and CA.
async fn env_child_net() {
    let http = std::env::var("ITERON_NET_CHILD_HTTP").unwrap();
    let https = std::env::var("ITERON_NET_CHILD_HTTPS").unwrap();
    // Only IP literals are used here; the DNS server keeps the system resolver out of it.
    let dns = DnsServer::start().await;
    let net = net_using(&dns);
    let client = net.client(Zone::Loopback).unwrap();

    let resp = client.send(get(&http)).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.body(1024).await.unwrap(), b"origin");

    // SSL_CERT_FILE names the CA that signed this server; it must not be trusted.
    let err = refusal(client.send(get(&https)).await);
    let NetError::Connect { target, reason } = &err else {
        panic!("expected a connect failure, got {err:?}");
    };
    assert_eq!(target, &https["https://".len()..https.len() - 1]);
    assert!(reason.to_lowercase().contains("certificate"), "{reason}");
    println!("{CHILD_DONE}");
}

/// The control child: a plain reqwest client in the same environment uses the proxy.
async fn env_child_control() {
    let http = std::env::var("ITERON_NET_CHILD_HTTP").unwrap();
    // Net::new installs the process's rustls crypto provider, which reqwest needs to build.
    let dns = DnsServer::start().await;
    let _net = net_using(&dns);
    let naive = reqwest::Client::builder().build().unwrap();
    let resp = naive.get(format!("{http}control")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.bytes().await.unwrap().as_ref(), b"proxy");
    println!("{CHILD_DONE}");
}

// ---------------------------------------------------------------------------------------------
// HTTPS with the operator CA, connecting to the pinned address
// ---------------------------------------------------------------------------------------------

async fn tls_fixture() -> (DnsServer, TestCa, Listener) {
    let dns = DnsServer::start().await;
    let ca = TestCa::new();
    let server = Listener::https(
        loopback(1),
        Reply::ok(b"mcp"),
        ca.server_config(&["mcp.test", "127.0.0.1"]),
    )
    .await;
    dns.answer("mcp.test", &[loopback(1)]);
    dns.answer("wrong.test", &[loopback(1)]);
    (dns, ca, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_to_a_pinned_name_verifies_the_operator_ca_and_the_host_name() {
    let (dns, ca, server) = tls_fixture().await;
    let net = Net::new(NetConfig {
        dns: dns.dns(),
        extra_roots_pem: Some(ca.pem()),
        ..NetConfig::default()
    })
    .unwrap();
    let url = format!("https://mcp.test:{}/", server.port());
    let resp = send(&net, Zone::Loopback, &url).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.body(1024).await.unwrap(), b"mcp");
    assert_eq!(server.connections(), 1);
    let heads = server.heads();
    assert_eq!(heads.len(), 1);
    let host = heads[0].split("\r\n").find_map(|l| {
        l.strip_prefix("host: ")
            .or_else(|| l.strip_prefix("Host: "))
    });
    assert_eq!(host, Some(format!("mcp.test:{}", server.port()).as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_to_a_name_the_certificate_does_not_cover_fails_to_connect() {
    let (dns, ca, server) = tls_fixture().await;
    let net = Net::new(NetConfig {
        dns: dns.dns(),
        extra_roots_pem: Some(ca.pem()),
        ..NetConfig::default()
    })
    .unwrap();
    let url = format!("https://wrong.test:{}/", server.port());
    let err = refusal(send(&net, Zone::Loopback, &url).await);
    let NetError::Connect { target, reason } = &err else {
        panic!("expected a connect failure, got {err:?}");
    };
    assert_eq!(target, &format!("wrong.test:{}", server.port()));
    let reason = reason.to_lowercase();
    assert!(reason.contains("certificate"), "{reason}");
    assert!(reason.contains("name"), "{reason}");
    assert!(server.heads().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_without_the_operator_ca_fails_to_connect() {
    let (dns, _ca, server) = tls_fixture().await;
    let net = net_using(&dns);
    let url = format!("https://mcp.test:{}/", server.port());
    let err = refusal(send(&net, Zone::Loopback, &url).await);
    let NetError::Connect { target, reason } = &err else {
        panic!("expected a connect failure, got {err:?}");
    };
    assert_eq!(target, &format!("mcp.test:{}", server.port()));
    assert!(reason.to_lowercase().contains("certificate"), "{reason}");
    assert!(server.heads().is_empty());
}

// ---------------------------------------------------------------------------------------------
// Body caps and deadlines
// ---------------------------------------------------------------------------------------------

const CAP: usize = 5000;

fn body_of(len: usize) -> Vec<u8> {
    (0..len).map(|i| b'a' + (i % 26) as u8).collect()
}

async fn read_capped(reply: Reply) -> Result<Vec<u8>, NetError> {
    let dns = DnsServer::start().await;
    let origin = Listener::http(loopback(1), reply).await;
    let net = net_using(&dns);
    let url = format!("http://127.0.0.1:{}/", origin.port());
    let resp = send(&net, Zone::Loopback, &url).await?;
    resp.body(CAP).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sized_body_of_exactly_the_cap_is_read_and_one_byte_more_fails() {
    assert_eq!(
        read_capped(Reply::ok(&body_of(CAP))).await,
        Ok(body_of(CAP))
    );
    assert_eq!(
        read_capped(Reply::ok(&body_of(CAP + 1))).await,
        Err(NetError::BodyTooLarge { limit: CAP })
    );
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_of_exactly_the_cap_is_read_and_one_byte_more_fails() {
    assert_eq!(
        read_capped(Reply::chunked(&body_of(CAP))).await,
        Ok(body_of(CAP))
    );
    let err = read_capped(Reply::chunked(&body_of(CAP + 1))).await;
    assert_eq!(err, Err(NetError::BodyTooLarge { limit: CAP }));
    assert_eq!(
        err.unwrap_err().to_string(),
        "response body exceeds the 5000-byte limit"
    );
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_drip_body_hits_the_idle_deadline() {
    let dns = DnsServer::start().await;
    let origin = Listener::http(loopback(1), Reply::drip(20, Duration::from_millis(400))).await;
    let net = Net::new(NetConfig {
        dns: dns.dns(),
        idle_timeout: Duration::from_millis(150),
        ..NetConfig::default()
    })
    .unwrap();
    let url = format!("http://127.0.0.1:{}/", origin.port());
    let resp = send(&net, Zone::Loopback, &url).await.unwrap();
    assert_eq!(resp.status(), 200);
    let err = resp.body(CAP).await.unwrap_err();
    let NetError::Timeout { phase } = err else {
        panic!("expected the idle deadline, got {err:?}");
    };
    assert!(phase.starts_with("reading the response body"), "{phase}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_hits_the_request_deadline() {
    let dns = DnsServer::start().await;
    let origin = Listener::http(loopback(1), Reply::silence()).await;
    let net = Net::new(NetConfig {
        dns: dns.dns(),
        request_timeout: Duration::from_millis(200),
        ..NetConfig::default()
    })
    .unwrap();
    let url = format!("http://127.0.0.1:{}/", origin.port());
    let err = refusal(send(&net, Zone::Loopback, &url).await);
    assert_eq!(
        err,
        NetError::Timeout {
            phase: "waiting for the response"
        }
    );
    assert_eq!(origin.heads().len(), 1);
}
