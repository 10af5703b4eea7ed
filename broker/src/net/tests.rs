use super::*;

#[test]
fn dns_never_chooses_the_binding_zone() {
    let z = |u: &str| endpoint_zone(&EndpointUrl::parse(u).unwrap()).unwrap();
    assert_eq!(z("https://mcp.example.com/mcp"), Zone::Public);
    assert_eq!(z("http://localhost:3000/mcp"), Zone::Loopback);
    assert_eq!(z("http://LOCALHOST./mcp"), Zone::Loopback);
    assert_eq!(z("http://127.0.0.1:8080/mcp"), Zone::Loopback);
    assert_eq!(z("https://10.0.0.5/mcp"), Zone::Private);
    assert_eq!(z("https://169.254.169.254/"), Zone::LinkLocal);
    // A literal that is never a destination does not even make an endpoint URL.
    assert!(EndpointUrl::parse("https://224.0.0.1/").is_err());
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn an_answer_is_judged_whole() {
    assert_eq!(
        judge_answer(
            "a.test",
            Zone::Public,
            &[ip("93.184.216.34"), ip("8.8.8.8")]
        ),
        Ok(Zone::Public)
    );
    let mixed = judge_answer(
        "a.test",
        Zone::Public,
        &[ip("93.184.216.34"), ip("10.0.0.1")],
    );
    assert_eq!(
        mixed.unwrap_err().to_string(),
        "refused: a.test resolved to 10.0.0.1 (private), above binding zone public"
    );
    let spans = judge_answer(
        "a.test",
        Zone::Private,
        &[ip("93.184.216.34"), ip("10.0.0.1")],
    );
    assert!(
        matches!(spans, Err(NetError::MixedZones { .. })),
        "{spans:?}"
    );
    let e = judge_answer("auth.example.com", Zone::Public, &[ip("10.0.0.5")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "refused: auth.example.com resolved to 10.0.0.5 (private), above binding zone public"
    );
    let e = judge_answer("m.test", Zone::Loopback, &[ip("224.0.0.1")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "refused: m.test resolved to 224.0.0.1, a multicast address"
    );
    assert!(matches!(
        judge_answer("e.test", Zone::Public, &[]),
        Err(NetError::Resolve { .. })
    ));
}

/// What the SSRF corpus expects of one input.
#[derive(Debug, PartialEq)]
enum Want {
    /// Refused by the endpoint rules (no connection is ever attempted).
    BadUrl,
    /// A literal host of this zone.
    Literal(Result<Zone, Rejected>),
    /// A literal host in a range that is never a destination: the endpoint rules refuse it
    /// with the zone table's verdict, before any connection could be attempted.
    Never(Rejected),
    /// A name, left to the pinned resolver.
    Name(&'static str),
}

fn outcome(input: &str) -> Want {
    let url = match EndpointUrl::parse(input) {
        Ok(url) => url,
        Err(iteron_policy::url::UrlError::NotADestination { rejected, .. }) => {
            return Want::Never(rejected);
        }
        Err(_) => return Want::BadUrl,
    };
    match target_host(&url) {
        TargetHost::Literal(ip) => Want::Literal(zone::classify(ip)),
        TargetHost::Name(n) => Want::Name(Box::leak(n.into_boxed_str())),
        TargetHost::Missing => Want::BadUrl,
    }
}

#[test]
fn the_ssrf_corpus_is_classified_on_the_parsed_host() {
    use Rejected::*;
    use Want::*;
    use Zone::*;
    let corpus: &[(&str, Want)] = &[
        // Numeric IPv4 spellings all parse to 127.0.0.1: plain http is allowed (loopback)
        // and the literal is judged loopback, never "a domain".
        ("http://2130706433/", Literal(Ok(Loopback))),
        ("http://0x7f000001/", Literal(Ok(Loopback))),
        ("http://0177.0.0.1/", Literal(Ok(Loopback))),
        ("http://127.1/", Literal(Ok(Loopback))),
        ("https://2130706433/", Literal(Ok(Loopback))),
        ("https://0x7f.0.0.1/", Literal(Ok(Loopback))),
        ("https://017700000001/", Literal(Ok(Loopback))),
        ("https://167772161/", Literal(Ok(Private))),
        ("https://0xa9fea9fe/", Literal(Ok(LinkLocal))),
        ("https://2852039166/", Literal(Ok(LinkLocal))),
        // Fullwidth digits, ideographic full stops, percent-encoding: IDNA runs first.
        (
            "http://\u{ff11}\u{ff12}\u{ff17}.0.0.1/",
            Literal(Ok(Loopback)),
        ),
        (
            "http://127\u{3002}0\u{3002}0\u{3002}1/",
            Literal(Ok(Loopback)),
        ),
        ("http://%31%32%37.0.0.1/", Literal(Ok(Loopback))),
        ("https://%31%36%39.254.169.254/", Literal(Ok(LinkLocal))),
        ("https://\u{ff11}\u{ff10}.0.0.1/", Literal(Ok(Private))),
        // Unspecified addresses.
        ("http://0/", BadUrl),
        ("https://0/", BadUrl),
        ("https://0.0.0.0/", BadUrl),
        ("https://[::]/", BadUrl),
        // IPv4-mapped and -compatible IPv6, NAT64, 6to4, Teredo.
        ("http://[::ffff:127.0.0.1]/", Literal(Ok(Loopback))),
        ("https://[::ffff:7f00:1]/", Literal(Ok(Loopback))),
        (
            "https://[0:0:0:0:0:ffff:169.254.169.254]/",
            Literal(Ok(LinkLocal)),
        ),
        ("https://[::ffff:10.0.0.1]/", Literal(Ok(Private))),
        ("http://[::127.0.0.1]/", BadUrl),
        ("https://[::127.0.0.1]/", Literal(Ok(Loopback))),
        ("https://[64:ff9b::7f00:1]/", Literal(Ok(Loopback))),
        ("https://[64:ff9b::a9fe:a9fe]/", Literal(Ok(LinkLocal))),
        ("https://[2002:7f00:1::1]/", Literal(Ok(Loopback))),
        ("https://[2002:a9fe:a9fe::1]/", Literal(Ok(LinkLocal))),
        (
            "https://[2001:0:808:808::80ff:fffe]/",
            Literal(Ok(Loopback)),
        ),
        ("https://[fd00:ec2::254]/", Literal(Ok(Private))),
        ("https://[fe80::1]/", Literal(Ok(LinkLocal))),
        ("https://[ff02::1]/", Never(Multicast)),
        ("https://[2001:db8::1]/", Never(Documentation)),
        ("https://[2606:4700:4700::1111]/", Literal(Ok(Public))),
        // IPv6 zone ids are parse errors.
        ("http://[fe80::1%25eth0]/", BadUrl),
        ("https://[fe80::1%eth0]/", BadUrl),
        // localhost spellings: only the exact name is a loopback name, and names go to the
        // pinned resolver (which judges the answer) — never trusted by spelling.
        ("http://localhost./", Name("localhost.")),
        ("http://LOCALHOST/", Name("localhost")),
        ("http://foo.localhost/", BadUrl),
        ("https://foo.localhost/", Name("foo.localhost")),
        ("http://localhost../", BadUrl),
        // Userinfo and fragment confusion: the parsed host decides, and both are refused.
        ("http://example.com@127.0.0.1/", BadUrl),
        ("https://127.0.0.1#@example.com/", BadUrl),
        ("https://example.com#@127.0.0.1/", BadUrl),
        ("https://user:pass@example.com/", BadUrl),
        ("https://example.com\\@127.0.0.1/", BadUrl),
        // Other ranges and ordinary names.
        ("https://100.64.0.1/", Literal(Ok(Private))),
        ("https://192.0.2.1/", Never(Documentation)),
        ("https://198.18.0.1/", Never(Benchmarking)),
        ("https://224.0.0.1/", Never(Multicast)),
        ("https://255.255.255.255/", Never(Broadcast)),
        ("https://240.0.0.1/", Never(Reserved)),
        ("https://93.184.216.34/", Literal(Ok(Public))),
        ("https://MCP.Example.COM/mcp", Name("mcp.example.com")),
        ("http://mcp.example.com/", BadUrl),
        ("ftp://127.0.0.1/", BadUrl),
    ];
    assert!(corpus.len() >= 40);
    for (input, want) in corpus {
        assert_eq!(&outcome(input), want, "{input}");
    }
    iteron_test_support::record!("P3", serde_json::json!({"cases": corpus.len()}),);
}

#[test]
fn operator_ca_bundle_is_read_bounded_and_must_hold_a_certificate() {
    use iteron_policy::config::{AbsolutePath, Nameserver};
    let dir = std::env::temp_dir().join(format!("iteron-net-ca-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let network = |file: &str| NetworkConfig {
        nameservers: vec![Nameserver::parse("127.0.0.1:5353").unwrap()],
        ca_bundle: Some(AbsolutePath::parse(dir.join(file).to_str().unwrap()).unwrap()),
    };
    let exact = dir.join("exact.pem");
    std::fs::write(&exact, vec![b'#'; MAX_CA_BUNDLE_BYTES as usize]).unwrap();
    let cfg = NetConfig::from_operator(&network("exact.pem")).unwrap();
    assert_eq!(
        cfg.dns,
        Dns::Nameservers(vec!["127.0.0.1:5353".parse().unwrap()])
    );
    // Read, but not a certificate: building the network layer refuses it.
    assert!(matches!(Net::new(cfg), Err(NetError::Roots(_))));
    std::fs::write(
        dir.join("over.pem"),
        vec![b'#'; MAX_CA_BUNDLE_BYTES as usize + 1],
    )
    .unwrap();
    let e = NetConfig::from_operator(&network("over.pem"))
        .err()
        .unwrap();
    assert!(e.to_string().contains("larger than"), "{e}");
    std::os::unix::fs::symlink(&exact, dir.join("link.pem")).unwrap();
    assert!(NetConfig::from_operator(&network("link.pem")).is_err());
    assert!(NetConfig::from_operator(&network("missing.pem")).is_err());
    let none = NetConfig::from_operator(&NetworkConfig::default()).unwrap();
    assert_eq!(none.dns, Dns::System);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn the_system_configuration_consults_the_hosts_file_and_judges_its_answer() {
    // /etc/hosts maps localhost on every machine of this kind; the answer is still judged.
    let loopback = PinnedResolver::new(&Dns::System, Zone::Loopback).unwrap();
    let addrs = loopback.resolve_checked("localhost").await.unwrap();
    assert!(addrs.iter().all(|a| a.is_loopback()), "{addrs:?}");
    let public = PinnedResolver::new(&Dns::System, Zone::Public).unwrap();
    let e = public.resolve_checked("localhost").await.unwrap_err();
    assert!(
        matches!(
            e,
            NetError::AboveZone {
                zone: Zone::Loopback,
                binding: Zone::Public,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn answer_size_is_bounded_one_over() {
    let many: Vec<IpAddr> = (1..=MAX_ANSWER_ADDRESSES as u8)
        .map(|i| IpAddr::from([93, 184, 216, i]))
        .collect();
    judge_answer("a.test", Zone::Public, &many).unwrap();
    let mut over = many.clone();
    over.push(ip("93.184.217.1"));
    assert!(matches!(
        judge_answer("a.test", Zone::Public, &over),
        Err(NetError::TooManyAddresses { .. })
    ));
    iteron_test_support::record!("P5", serde_json::json!({}),);
}
