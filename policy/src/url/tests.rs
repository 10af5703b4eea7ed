use super::*;
use proptest::prelude::*;
use std::net::Ipv6Addr;

use HostKind::{Domain, LocalhostName, LoopbackIp, OtherIp};
use UrlError::{
    Fragment, Malformed, NoHost, PlainHttpNotLoopback, PortZero, Scheme, UnspecifiedHost, Userinfo,
};

fn invalid(offset: usize, character: char) -> UrlError {
    UrlError::InvalidCharacter { offset, character }
}

fn never(address: &str, rejected: Rejected) -> UrlError {
    UrlError::NotADestination {
        address: address.to_owned(),
        rejected,
    }
}

/// Each input with its expected outcome: the host judgment when accepted, or the exact error.
fn ssrf_corpus() -> Vec<(&'static str, Result<HostKind, UrlError>)> {
    vec![
        // Ordinary endpoints.
        ("https://mcp.example.com/mcp?x=1", Ok(Domain)),
        ("HTTPS://MCP.Example.COM/mcp", Ok(Domain)),
        ("https://mcp.example.com:8443/mcp", Ok(Domain)),
        ("https://bücher.example/mcp", Ok(Domain)),
        ("https://[2606:4700:4700::1111]/", Ok(OtherIp)),
        ("https://[::1]/", Ok(LoopbackIp)),
        // https to a private or link-local address is the operator's call.
        ("https://169.254.169.254/", Ok(OtherIp)),
        // Loopback IPv4 in every spelling the WHATWG parser folds to 127.0.0.1.
        ("http://127.0.0.1/", Ok(LoopbackIp)),
        ("http://127.0.0.1:8080/mcp", Ok(LoopbackIp)),
        ("http://127.255.255.254/", Ok(LoopbackIp)),
        ("http://2130706433/", Ok(LoopbackIp)),
        ("http://0x7f000001/", Ok(LoopbackIp)),
        ("http://0177.0.0.1/", Ok(LoopbackIp)),
        ("http://127.1/", Ok(LoopbackIp)),
        ("http://0x7f.1/", Ok(LoopbackIp)),
        ("http://127.0.0.1./", Ok(LoopbackIp)),
        ("http://%31%32%37.0.0.1/", Ok(LoopbackIp)),
        ("http://\u{FF11}\u{FF12}\u{FF17}.0.0.1/", Ok(LoopbackIp)),
        ("http://127\u{3002}0\u{3002}0\u{3002}1/", Ok(LoopbackIp)),
        // The same spellings of non-loopback addresses.
        ("http://167772161/", Err(PlainHttpNotLoopback)),
        ("http://0xa000001/", Err(PlainHttpNotLoopback)),
        ("http://012.0.0.1/", Err(PlainHttpNotLoopback)),
        ("http://%31%30.0.0.1/", Err(PlainHttpNotLoopback)),
        ("http://128.0.0.1/", Err(PlainHttpNotLoopback)),
        (
            "http://169.254.169.254/latest/meta-data/",
            Err(PlainHttpNotLoopback),
        ),
        ("http://10.0.0.1/", Err(PlainHttpNotLoopback)),
        // Unspecified ("any") addresses.
        ("http://0/", Err(PlainHttpNotLoopback)),
        ("http://0.0.0.0/", Err(PlainHttpNotLoopback)),
        ("http://[::]/", Err(PlainHttpNotLoopback)),
        ("https://0/", Err(UnspecifiedHost)),
        ("https://0.0.0.0:443/", Err(UnspecifiedHost)),
        ("https://[::]/", Err(UnspecifiedHost)),
        ("https://[::ffff:0.0.0.0]/", Err(UnspecifiedHost)),
        // IP literals that are never a destination, directly or embedded, and port 0.
        (
            "https://224.0.0.1/",
            Err(never("224.0.0.1", Rejected::Multicast)),
        ),
        (
            "https://239.255.255.250:1900/",
            Err(never("239.255.255.250", Rejected::Multicast)),
        ),
        (
            "https://[ff02::1]/",
            Err(never("[ff02::1]", Rejected::Multicast)),
        ),
        (
            "https://[::ffff:224.0.0.251]/",
            Err(never("[::ffff:e000:fb]", Rejected::Multicast)),
        ),
        (
            "https://192.0.2.10/mcp",
            Err(never("192.0.2.10", Rejected::Documentation)),
        ),
        (
            "https://198.51.100.7/",
            Err(never("198.51.100.7", Rejected::Documentation)),
        ),
        (
            "https://203.0.113.1/",
            Err(never("203.0.113.1", Rejected::Documentation)),
        ),
        (
            "https://[2001:db8::1]/",
            Err(never("[2001:db8::1]", Rejected::Documentation)),
        ),
        (
            "https://[64:ff9b::c000:201]/",
            Err(never("[64:ff9b::c000:201]", Rejected::Documentation)),
        ),
        (
            "https://[2002:cb00:7101::1]/",
            Err(never("[2002:cb00:7101::1]", Rejected::Documentation)),
        ),
        (
            "https://255.255.255.255/",
            Err(never("255.255.255.255", Rejected::Broadcast)),
        ),
        (
            "https://240.0.0.1/",
            Err(never("240.0.0.1", Rejected::Reserved)),
        ),
        (
            "https://198.18.0.1/",
            Err(never("198.18.0.1", Rejected::Benchmarking)),
        ),
        (
            "https://0.1.2.3/",
            Err(never("0.1.2.3", Rejected::Unspecified)),
        ),
        ("http://[::ffff:224.0.0.1]/", Err(PlainHttpNotLoopback)),
        ("https://a.example:0/", Err(PortZero)),
        ("https://a.example:00/mcp", Err(PortZero)),
        ("http://127.0.0.1:0/", Err(PortZero)),
        ("http://localhost:0/mcp", Err(PortZero)),
        ("https://[::1]:0/", Err(PortZero)),
        ("https://10.0.0.1:0/", Err(PortZero)),
        ("https://a.example:1/", Ok(Domain)),
        // IPv6 forms.
        ("http://[::1]/", Ok(LoopbackIp)),
        ("http://[::1]:3000/mcp", Ok(LoopbackIp)),
        ("http://[0:0:0:0:0:0:0:1]/", Ok(LoopbackIp)),
        ("http://[::ffff:127.0.0.1]/", Ok(LoopbackIp)),
        ("http://[::ffff:7f00:1]/", Ok(LoopbackIp)),
        (
            "http://[0:0:0:0:0:ffff:169.254.169.254]/",
            Err(PlainHttpNotLoopback),
        ),
        ("http://[::127.0.0.1]/", Err(PlainHttpNotLoopback)),
        ("http://[::7f00:1]/", Err(PlainHttpNotLoopback)),
        ("http://[64:ff9b::7f00:1]/", Err(PlainHttpNotLoopback)),
        ("http://[64:ff9b::127.0.0.1]/", Err(PlainHttpNotLoopback)),
        ("http://[fe80::1%25eth0]/", Err(Malformed)),
        ("http://[::1]:65536/", Err(Malformed)),
        // Names.
        ("http://localhost/", Ok(LocalhostName)),
        ("http://localhost:8080/mcp", Ok(LocalhostName)),
        ("http://localhost./", Ok(LocalhostName)),
        ("http://LOCALHOST/", Ok(LocalhostName)),
        ("http://LocalHost./", Ok(LocalhostName)),
        ("http://foo.localhost/", Err(PlainHttpNotLoopback)),
        ("http://localhost../", Err(PlainHttpNotLoopback)),
        ("http://localhost.localdomain/", Err(PlainHttpNotLoopback)),
        ("http://127.0.0.1.nip.io/", Err(PlainHttpNotLoopback)),
        ("http://example.com/", Err(PlainHttpNotLoopback)),
        // Userinfo and authority confusion.
        ("http://example.com@127.0.0.1/", Err(Userinfo)),
        ("https://user:pw@a.example/", Err(Userinfo)),
        ("https://user@a.example/", Err(Userinfo)),
        ("https://:pw@a.example/", Err(Userinfo)),
        ("http://@127.0.0.1/", Err(Userinfo)),
        ("https://:@a.example/", Err(Userinfo)),
        ("https://a.example@@b.example/", Err(Userinfo)),
        ("http://127.0.0.1\u{FF0F}@evil.example/", Err(Userinfo)),
        ("http://example.com\u{FF20}127.0.0.1/", Err(Malformed)),
        ("https://a.example\\@evil.example/", Err(Malformed)),
        // Fragments.
        ("http://127.0.0.1#@example.com/", Err(Fragment)),
        ("https://a.example/#", Err(Fragment)),
        ("https://a.example/#section", Err(Fragment)),
        ("https://a.example?x#", Err(Fragment)),
        // Schemes.
        ("ftp://ftp.example.com/file", Err(Scheme)),
        ("file:///etc/passwd", Err(Scheme)),
        ("javascript:alert(1)", Err(Scheme)),
        ("data:text/html,<script>alert(1)</script>", Err(Scheme)),
        ("ws://127.0.0.1/", Err(Scheme)),
        ("gopher://127.0.0.1:25/", Err(Scheme)),
        // Structure the parser would repair.
        ("https:///path", Err(Malformed)),
        ("https:////a.example/", Err(Malformed)),
        ("https://", Err(Malformed)),
        ("http:127.0.0.1/", Err(Malformed)),
        ("https:\\\\a.example/", Err(Malformed)),
        ("https://\\a.example/", Err(Malformed)),
        ("https://a.example\\mcp", Err(Malformed)),
        ("/relative/path", Err(Malformed)),
        ("", Err(Malformed)),
        // Characters the parser or IDNA would silently drop.
        (" https://a.example/", Err(invalid(0, ' '))),
        ("https://a.example/ ", Err(invalid(18, ' '))),
        ("https://a.ex\tample/", Err(invalid(12, '\t'))),
        ("https://a.example/\n", Err(invalid(18, '\n'))),
        ("https://a.example/\r\n", Err(invalid(18, '\r'))),
        ("https://a.example/\u{0}", Err(invalid(18, '\u{0}'))),
        ("https://a.example/\u{7F}", Err(invalid(18, '\u{7F}'))),
        ("https://a.example/\u{85}", Err(invalid(18, '\u{85}'))),
        ("https://exa\u{AD}mple.com/", Err(invalid(11, '\u{AD}'))),
        ("https://a.example\u{200B}/", Err(invalid(17, '\u{200B}'))),
        ("https://a.example/\u{202E}", Err(invalid(18, '\u{202E}'))),
        ("https://a.example/\u{3000}", Err(invalid(18, '\u{3000}'))),
        ("https://a.example/\u{FEFF}", Err(invalid(18, '\u{FEFF}'))),
        ("http://127.0.0.1/\u{2028}", Err(invalid(17, '\u{2028}'))),
    ]
}

#[test]
fn every_corpus_input_gets_its_expected_outcome() {
    let corpus = ssrf_corpus();
    assert!(
        corpus.len() >= 40,
        "corpus has only {} entries",
        corpus.len()
    );
    for (input, want) in corpus {
        let got = EndpointUrl::parse(input).map(|ok| {
            let host = ok.as_url().host();
            judge_host(&host.expect("accepted URLs have a host"))
        });
        assert_eq!(got, want, "input {input:?}");
    }
}

#[test]
fn error_messages_never_contain_the_input_and_are_one_lowercase_line() {
    for (input, want) in ssrf_corpus() {
        let Err(err) = want else { continue };
        let text = err.to_string();
        assert!(text.len() > 10, "{input:?}: {text:?}");
        assert!(
            !text.contains('\n') && !text.contains('\r'),
            "{input:?}: {text:?}"
        );
        assert!(
            text.starts_with(|c: char| c.is_ascii_lowercase()),
            "{text:?}"
        );
        if input.len() >= 8 {
            assert!(!text.contains(input), "{input:?}: {text:?}");
        }
    }
}

#[test]
fn every_error_variant_has_a_distinct_one_line_lowercase_message() {
    let all = [
        UrlError::TooLong { len: 4096 },
        invalid(3, '\t'),
        Malformed,
        Scheme,
        NoHost,
        Userinfo,
        Fragment,
        PlainHttpNotLoopback,
        UnspecifiedHost,
        never("224.0.0.1", Rejected::Multicast),
        PortZero,
    ];
    let mut seen = std::collections::HashSet::new();
    for err in all {
        let text = err.to_string();
        assert!(
            text.starts_with(|c: char| c.is_ascii_lowercase()),
            "{text:?}"
        );
        assert!(!text.contains('\n'), "{text:?}");
        assert!(seen.insert(text.clone()), "duplicate message {text:?}");
        let _: &dyn std::error::Error = &err;
    }
    assert!(UrlError::TooLong { len: 4096 }.to_string().contains("4096"));
    assert!(invalid(3, '\t').to_string().contains("U+0009"));
}

#[test]
fn never_a_destination_errors_name_the_rule_and_the_address() {
    for (input, rule) in [
        ("https://224.0.0.1/mcp", "224.0.0.1 is a multicast address"),
        ("https://[ff02::fb]/", "[ff02::fb] is a multicast address"),
        (
            "https://192.0.2.1/?token=abc",
            "192.0.2.1 is a documentation-only address",
        ),
        (
            "https://[2001:db8::5]:8443/",
            "[2001:db8::5] is a documentation-only address",
        ),
        (
            "https://0.0.0.7/",
            "0.0.0.7 is a this-network (0.0.0.0/8) address",
        ),
        ("https://mcp.example:0/mcp", "port is 0"),
    ] {
        let e = EndpointUrl::parse(input).unwrap_err().to_string();
        assert!(e.contains(rule), "{input}: {e}");
        assert!(!e.contains("token=abc") && !e.contains('\n'), "{e}");
        // Redaction keeps it whole: nothing here looks like a credential.
        assert_eq!(crate::text::single_line(&e), e);
    }
    iteron_test_support::record!("P12", serde_json::json!({}),);
}

#[test]
fn userinfo_errors_do_not_echo_the_password() {
    let err = EndpointUrl::parse("https://user:pw@a.example/").unwrap_err();
    assert_eq!(err, Userinfo);
    assert!(!err.to_string().contains("pw"));
    for input in [
        "https://u:hunter2@a.example/",
        "http://u:hunter2@10.0.0.1/",
        "ftp://u:hunter2@a.example/",
        "https://u:hunter2@a.example/#x",
        " https://u:hunter2@a.example/",
        "https://u:hunter2@[fe80::1%25eth0]/",
        "https://u:hunter2@0.0.0.0/",
    ] {
        let err = EndpointUrl::parse(input).unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{input:?}: {err}");
        assert!(
            !format!("{err:?}").contains("hunter2"),
            "{input:?}: {err:?}"
        );
    }
}

#[test]
fn plain_http_error_hints_at_https_and_loopback_hosts() {
    let text = PlainHttpNotLoopback.to_string();
    for hint in ["https", "127.0.0.1", "[::1]", "localhost"] {
        assert!(text.contains(hint), "{text:?} lacks {hint:?}");
    }
}

#[test]
fn a_url_of_exactly_the_limit_is_accepted_and_one_byte_more_is_too_long() {
    let prefix = "https://a.example/";
    let at_limit = format!("{prefix}{}", "a".repeat(MAX_URL_BYTES - prefix.len()));
    assert_eq!(at_limit.len(), 2048);
    let ok = EndpointUrl::parse(&at_limit).unwrap();
    assert_eq!(ok.as_str(), at_limit);

    let over = format!("{at_limit}a");
    assert_eq!(over.len(), 2049);
    assert_eq!(
        EndpointUrl::parse(&over),
        Err(UrlError::TooLong { len: 2049 })
    );
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

#[test]
fn a_url_whose_normalized_form_exceeds_the_limit_is_too_long() {
    // 'é' is two bytes as written and six ("%C3%A9") once percent-encoded.
    let input = format!("https://a.example/{}", "é".repeat(1000));
    assert!(input.len() <= MAX_URL_BYTES);
    let err = EndpointUrl::parse(&input).unwrap_err();
    assert_eq!(
        err,
        UrlError::TooLong {
            len: "https://a.example/".len() + 6000
        }
    );
}

#[test]
fn as_str_is_the_url_crate_normalization_with_lowercase_scheme_and_host() {
    let url = EndpointUrl::parse("HTTPS://MCP.Example.COM/mcp").unwrap();
    assert_eq!(url.as_str(), "https://mcp.example.com/mcp");
    assert_eq!(url.to_string(), "https://mcp.example.com/mcp");

    let url = EndpointUrl::parse("http://0x7f.1:8080/mcp").unwrap();
    assert_eq!(url.as_str(), "http://127.0.0.1:8080/mcp");

    let url = EndpointUrl::parse("http://[::ffff:127.0.0.1]/").unwrap();
    assert_eq!(url.as_str(), "http://[::ffff:7f00:1]/");

    let url = EndpointUrl::parse("https://mcp.example.com:443/a/../b?q=1").unwrap();
    assert_eq!(url.as_str(), "https://mcp.example.com/b?q=1");
    assert_eq!(url.as_url().query(), Some("q=1"));
}

#[test]
fn origin_display_is_scheme_host_and_non_default_port_only() {
    let cases = [
        (
            "https://mcp.example.com:8443/mcp?x=1",
            "https://mcp.example.com:8443",
        ),
        ("https://mcp.example.com:443/mcp", "https://mcp.example.com"),
        ("http://[::1]:3000/x", "http://[::1]:3000"),
        ("http://LOCALHOST./mcp", "http://localhost."),
        ("https://bücher.example/", "https://xn--bcher-kva.example"),
    ];
    for (input, origin) in cases {
        assert_eq!(EndpointUrl::parse(input).unwrap().origin_display(), origin);
    }
}

#[test]
fn is_loopback_http_is_true_only_for_plain_http() {
    assert!(
        EndpointUrl::parse("http://127.0.0.1/")
            .unwrap()
            .is_loopback_http()
    );
    assert!(
        EndpointUrl::parse("http://localhost/")
            .unwrap()
            .is_loopback_http()
    );
    assert!(
        !EndpointUrl::parse("https://[::1]/")
            .unwrap()
            .is_loopback_http()
    );
    assert!(
        !EndpointUrl::parse("https://a.example/")
            .unwrap()
            .is_loopback_http()
    );
}

#[test]
fn serializes_as_the_normalized_string() {
    let url = EndpointUrl::parse("HTTPS://MCP.Example.COM/mcp").unwrap();
    assert_eq!(
        serde_json::to_string(&url).unwrap(),
        "\"https://mcp.example.com/mcp\""
    );
}

#[test]
fn judge_host_unwraps_only_ipv4_mapped_addresses() {
    let v6 = |s: &str| judge_host(&Host::Ipv6(s.parse().unwrap()));
    assert_eq!(v6("::1"), LoopbackIp);
    assert_eq!(v6("::ffff:127.0.0.1"), LoopbackIp);
    assert_eq!(v6("::ffff:127.255.0.9"), LoopbackIp);
    assert_eq!(v6("::ffff:10.0.0.1"), OtherIp);
    // `to_ipv4()` would turn these into 127.0.0.1 / 0.0.0.1; they are not loopback.
    assert_eq!(v6("::127.0.0.1"), OtherIp);
    assert_eq!(v6("::"), OtherIp);
    assert_eq!(v6("64:ff9b::7f00:1"), OtherIp);
    assert_eq!(judge_host(&Host::Ipv4(Ipv4Addr::new(0, 0, 0, 1))), OtherIp);
}

#[test]
fn judge_host_allows_localhost_with_at_most_one_trailing_dot() {
    let name = |s: &str| judge_host(&Host::Domain(s));
    assert_eq!(name("localhost"), LocalhostName);
    assert_eq!(name("LocalHost"), LocalhostName);
    assert_eq!(name("localhost."), LocalhostName);
    assert_eq!(name("localhost.."), Domain);
    assert_eq!(name(".localhost"), Domain);
    assert_eq!(name("foo.localhost"), Domain);
    assert_eq!(name("localhost.example"), Domain);
    assert_eq!(name("localhos"), Domain);
    assert_eq!(name(""), Domain);
}

/// Invariants every accepted URL must satisfy.
fn check_accepted(url: &EndpointUrl) {
    let u = url.as_url();
    assert_eq!(u.username(), "");
    assert_eq!(u.password(), None);
    assert_eq!(u.fragment(), None);
    let host = u.host().expect("accepted URLs have a host");
    assert!(!is_unspecified(&host));
    assert_eq!(never_a_destination(&host), None);
    assert_ne!(u.port(), Some(0));
    let kind = judge_host(&host);
    match u.scheme() {
        "https" => assert!(!url.is_loopback_http()),
        "http" => {
            assert!(matches!(kind, LoopbackIp | LocalhostName), "{kind:?}");
            assert!(url.is_loopback_http());
        }
        other => panic!("scheme {other:?} accepted"),
    }
    assert!(url.as_str().len() <= MAX_URL_BYTES);
    // The stored form re-parses to the same value.
    assert_eq!(EndpointUrl::parse(url.as_str()).as_ref(), Ok(url));
    // The origin is a prefix of the URL, followed by the path.
    let origin = url.origin_display();
    assert!(url.as_str().starts_with(&origin));
    assert!(url.as_str()[origin.len()..].starts_with('/'));
}

/// Strings shaped like endpoint URLs, mostly well formed, with the tricks of the corpus mixed in.
fn url_like() -> impl Strategy<Value = String> {
    let scheme = prop_oneof![
        4 => Just("https"),
        4 => Just("http"),
        1 => Just("HTTP"),
        1 => Just("ftp"),
        1 => Just("file"),
        1 => Just("javascript"),
    ];
    let sep = prop_oneof![
        8 => Just("://"),
        1 => Just(":"),
        1 => Just(":///"),
        1 => Just(":\\\\"),
        1 => Just(":/\\"),
    ];
    let userinfo = prop_oneof![
        8 => Just(""),
        1 => Just("@"),
        1 => Just(":@"),
        1 => Just("u:p@"),
        1 => Just("a.example@"),
    ];
    let host = prop_oneof![
        Just("127.0.0.1".to_owned()),
        Just("localhost".to_owned()),
        Just("localhost.".to_owned()),
        Just("[::1]".to_owned()),
        Just("[::ffff:7f00:1]".to_owned()),
        Just("0".to_owned()),
        Just("[::]".to_owned()),
        "[0-9a-fx.]{1,16}",
        "[a-zA-Z0-9%.\u{FF10}-\u{FF19}\u{3002}-]{1,16}",
        "\\[[0-9a-f:.]{1,20}\\]",
    ];
    let port = prop_oneof![
        3 => Just(String::new()),
        1 => (0u32..70000).prop_map(|p| format!(":{p}")),
    ];
    let rest = prop_oneof![
        6 => "(/[a-z0-9%.]{0,6}){0,3}(\\?[a-z0-9=&%]{0,8})?",
        1 => "[/a-z0-9?#@%.\\\\ \t\u{AD}\u{200B}]{0,12}",
    ];
    (scheme, sep, userinfo, host, port, rest)
        .prop_map(|(s, sep, ui, h, p, r)| format!("{s}{sep}{ui}{h}{p}{r}"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn parse_never_panics_on_arbitrary_strings_and_upholds_the_rules(input in any::<String>()) {
        if let Ok(url) = EndpointUrl::parse(&input) {
            check_accepted(&url);
        }
    }

    #[test]
    fn every_accepted_url_like_string_upholds_the_rules(input in url_like()) {
        if let Ok(url) = EndpointUrl::parse(&input) {
            check_accepted(&url);
        }
    }

    #[test]
    fn an_ip_literal_is_accepted_exactly_when_the_zone_table_accepts_it(
        a in any::<Ipv4Addr>(),
        b in any::<Ipv6Addr>(),
    ) {
        let v4 = EndpointUrl::parse(&format!("https://{a}/"));
        let zone_ok = zone::classify_v4(a).is_ok();
        prop_assert_eq!(v4.is_ok(), zone_ok, "{} {:?}", a, v4);
        if !zone_ok {
            prop_assert!(
                matches!(v4, Err(UnspecifiedHost | UrlError::NotADestination { .. })),
                "{} {:?}", a, v4
            );
        }
        let v6 = EndpointUrl::parse(&format!("https://[{b}]/"));
        prop_assert_eq!(v6.is_ok(), zone::classify_v6(b).is_ok(), "{} {:?}", b, v6);
    }

    #[test]
    fn only_port_0_is_refused(port in 0u32..=65535, host in prop_oneof![
        Just("a.example"), Just("127.0.0.1"), Just("[::1]"), Just("10.1.2.3")
    ]) {
        let got = EndpointUrl::parse(&format!("https://{host}:{port}/mcp"));
        prop_assert_eq!(got.is_ok(), port != 0, "{} {:?}", port, got);
        if port == 0 {
            prop_assert_eq!(got.err(), Some(PortZero));
        }
        // Plain http: only loopback, and then the same port rule.
        let got = EndpointUrl::parse(&format!("http://{host}:{port}/mcp"));
        let loopback = matches!(host, "127.0.0.1" | "[::1]");
        let want = match (loopback, port) {
            (false, _) => Some(PlainHttpNotLoopback),
            (true, 0) => Some(PortZero),
            (true, _) => None,
        };
        prop_assert_eq!(got.err(), want);
    }

    #[test]
    fn an_ipv4_mapped_host_is_judged_like_its_ipv4_address(a in any::<Ipv4Addr>()) {
        for scheme in ["http", "https"] {
            let plain = EndpointUrl::parse(&format!("{scheme}://{a}/"));
            let mapped = EndpointUrl::parse(&format!("{scheme}://[::ffff:{a}]/"));
            prop_assert_eq!(plain.is_ok(), mapped.is_ok(), "{} {}", scheme, a);
            // The same verdict; a never-a-destination error names each as written.
            let verdict = |e: Option<UrlError>| e.map(|e| match e {
                UrlError::NotADestination { rejected, .. } => UrlError::NotADestination {
                    address: String::new(),
                    rejected,
                },
                other => other,
            });
            prop_assert_eq!(verdict(plain.err()), verdict(mapped.err()), "{} {}", scheme, a);
        }
        let expected = if a.is_loopback() { LoopbackIp } else { OtherIp };
        let mapped: Ipv6Addr = a.to_ipv6_mapped();
        prop_assert_eq!(judge_host(&Host::Ipv6(mapped)), expected);
        prop_assert_eq!(judge_host(&Host::Ipv4(a)), expected);
    }
}
