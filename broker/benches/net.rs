//! Benchmark of the network layer, against reference measurements taken in the same run:
//!
//! 1. zone classification throughput (addresses per second, mixed IPv4/IPv6);
//! 2. a keep-alive HTTPS request through a [`ZoneClient`] (pinned resolver, zone checks, no
//!    proxy, pinned roots) against the same request through a plain reqwest client (static
//!    name override, same roots), interleaved on one loopback server; reported as a ratio;
//! 3. one resolve-and-judge through the pinned resolver against a bare hickory lookup of the
//!    same name on the same DNS server.
//!
//! Run: `cargo bench -p iteron-broker --bench net` (`-- --write-docs` regenerates the table in
//! docs/benchmarks.md).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark harness: any failure should abort loudly"
)]

#[allow(
    dead_code,
    unreachable_pub,
    reason = "shared test fixtures; the bench uses a subset"
)]
#[path = "../tests/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Instant;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use iteron_broker::net::{Dns, Net, NetConfig, PinnedResolver, Request};
use iteron_policy::url::EndpointUrl;
use iteron_policy::zone::{self, Zone};
use reqwest::Method;
use support::{DnsServer, Listener, Reply, TestCa};

const START: &str = "<!-- bench:net:start -->";
const END: &str = "<!-- bench:net:end -->";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn classification_rate() -> f64 {
    // A deterministic mix: xorshift over both families.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut addrs = Vec::with_capacity(1 << 16);
    for i in 0..(1 << 16) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i % 2 == 0 {
            addrs.push(IpAddr::V4(Ipv4Addr::from(x as u32)));
        } else {
            addrs.push(IpAddr::V6(Ipv6Addr::from(
                u128::from(x) << 64 | u128::from(x >> 3),
            )));
        }
    }
    let rounds = 64;
    let start = Instant::now();
    let mut public = 0usize;
    for _ in 0..rounds {
        for a in &addrs {
            if matches!(zone::classify(black_box(*a)), Ok(Zone::Public)) {
                public += 1;
            }
        }
    }
    black_box(public);
    (addrs.len() * rounds) as f64 / start.elapsed().as_secs_f64()
}

fn bare_hickory(dns: SocketAddr) -> TokioResolver {
    let mut udp = ConnectionConfig::udp();
    udp.port = dns.port();
    let config =
        ResolverConfig::from_name_servers(vec![NameServerConfig::new(dns.ip(), true, vec![udp])]);
    TokioResolver::builder_with_config(config, TokioRuntimeProvider::default())
        .build()
        .unwrap()
}

async fn run(requests: usize) -> String {
    let dns = DnsServer::start().await;
    let ca = TestCa::new();
    let server_ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let listener = Listener::https(
        server_ip,
        Reply::ok(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}"),
        ca.server_config(&["bench.test"]),
    )
    .await;
    let port = listener.port();
    dns.answer("bench.test", &[server_ip]);
    let url = format!("https://bench.test:{port}/mcp");

    let net = Net::new(NetConfig {
        dns: dns.dns(),
        extra_roots_pem: Some(ca.pem()),
        ..NetConfig::default()
    })
    .unwrap();
    let ours = net.client(Zone::Loopback).unwrap();
    let plain = reqwest::Client::builder()
        .no_proxy()
        .tls_certs_only(reqwest::Certificate::from_pem_bundle(&ca.pem()).unwrap())
        .resolve("bench.test", SocketAddr::new(server_ip, port))
        .build()
        .unwrap();
    let endpoint = EndpointUrl::parse(&url).unwrap();

    // Warm both pools, then interleave so drift affects both sides alike.
    for _ in 0..50 {
        ours.send(Request::new(Method::GET, endpoint.clone()))
            .await
            .unwrap()
            .body(1 << 20)
            .await
            .unwrap();
        plain.get(&url).send().await.unwrap().bytes().await.unwrap();
    }
    let (mut t_ours, mut t_plain) = (Vec::new(), Vec::new());
    for _ in 0..requests {
        let s = Instant::now();
        let b = ours
            .send(Request::new(Method::GET, endpoint.clone()))
            .await
            .unwrap()
            .body(1 << 20)
            .await
            .unwrap();
        t_ours.push(s.elapsed().as_secs_f64() * 1e6);
        black_box(b);
        let s = Instant::now();
        let b = plain.get(&url).send().await.unwrap().bytes().await.unwrap();
        t_plain.push(s.elapsed().as_secs_f64() * 1e6);
        black_box(b);
    }
    let (m_ours, m_plain) = (median(t_ours), median(t_plain));

    // Resolve + judge against a bare lookup (TTL 0 answers: every lookup asks the server).
    let pinned =
        PinnedResolver::new(&Dns::Nameservers(vec![dns_addr(&dns)]), Zone::Loopback).unwrap();
    let bare = bare_hickory(dns_addr(&dns));
    let (mut t_pinned, mut t_bare) = (Vec::new(), Vec::new());
    for _ in 0..200 {
        let s = Instant::now();
        black_box(pinned.resolve_checked("bench.test").await.unwrap());
        t_pinned.push(s.elapsed().as_secs_f64() * 1e6);
        let s = Instant::now();
        black_box(bare.lookup_ip("bench.test.").await.unwrap());
        t_bare.push(s.elapsed().as_secs_f64() * 1e6);
    }
    let (m_pinned, m_bare) = (median(t_pinned), median(t_bare));
    let rate = classification_rate();

    let mut t = String::new();
    t.push_str(&format!(
        "{requests} interleaved keep-alive HTTPS requests per client on loopback after 50 \
         warm-up requests each; 200 lookups per resolver.\n\n"
    ));
    t.push_str("| measurement | Iteron | reference (same run) | ratio |\n|---|---|---|---|\n");
    t.push_str(&format!(
        "| keep-alive HTTPS request, median | {m_ours:.1} µs (`ZoneClient`) | {m_plain:.1} µs (plain reqwest) | {:.3}× |\n",
        m_ours / m_plain
    ));
    t.push_str(&format!(
        "| DNS lookup, median | {m_pinned:.1} µs (resolve + judge) | {m_bare:.1} µs (bare hickory) | {:.3}× |\n",
        m_pinned / m_bare
    ));
    t.push_str(&format!(
        "| zone classification | {:.1} M addresses/s | – | – |\n",
        rate / 1e6
    ));
    t
}

fn dns_addr(dns: &DnsServer) -> SocketAddr {
    match dns.dns() {
        Dns::Nameservers(v) => v[0],
        Dns::System => unreachable!("the test DNS server names itself"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let write_docs = args.iter().any(|a| a == "--write-docs");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let table = rt.block_on(run(2000));
    println!("{table}");
    if write_docs {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/benchmarks.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let (a, b) = (doc.find(START).unwrap(), doc.find(END).unwrap());
        let updated = format!("{}{START}\n{table}{}", &doc[..a], &doc[b..]);
        std::fs::write(&path, updated).unwrap();
    }
}
