use super::*;
use proptest::prelude::*;

/// Everything observable after feeding a stream: the events delivered, the first error (the
/// feeding stops there), and the parser's state.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    events: Vec<SseEvent>,
    error: Option<SseError>,
    last_event_id: Option<String>,
    retry: Option<Duration>,
    dispatched: usize,
}

fn run(limits: SseLimits, pieces: &[&[u8]]) -> Outcome {
    let mut parser = SseParser::new(limits);
    let mut events = Vec::new();
    let mut error = None;
    for piece in pieces {
        if let Err(err) = parser.feed(piece, &mut events) {
            error = Some(err);
            break;
        }
    }
    if error.is_none() {
        error = parser.finish().err();
    }
    Outcome {
        events,
        error,
        last_event_id: parser.last_event_id().map(str::to_owned),
        retry: parser.retry(),
        dispatched: parser.events_dispatched(),
    }
}

fn split_at_all(stream: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut pieces = Vec::new();
    let mut start = 0;
    for &cut in cuts {
        let cut = cut.clamp(start, stream.len());
        pieces.push(stream[start..cut].to_vec());
        start = cut;
    }
    pieces.push(stream[start..].to_vec());
    pieces
}

fn run_split(limits: SseLimits, stream: &[u8], cuts: &[usize]) -> Outcome {
    let pieces = split_at_all(stream, cuts);
    let refs: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
    run(limits, &refs)
}

/// Parses `stream` whole, then checks that every two-way split and byte-by-byte feeding give
/// exactly the same outcome.
fn parse_with(limits: SseLimits, stream: &[u8]) -> Outcome {
    let whole = run(limits, &[stream]);
    for cut in 0..=stream.len() {
        assert_eq!(run_split(limits, stream, &[cut]), whole, "split at {cut}");
    }
    let bytes: Vec<&[u8]> = stream.chunks(1).collect();
    assert_eq!(run(limits, &bytes), whole, "byte by byte");
    whole
}

fn parse(stream: &[u8]) -> Outcome {
    parse_with(SseLimits::default(), stream)
}

fn events(stream: &[u8]) -> Vec<SseEvent> {
    let outcome = parse(stream);
    assert_eq!(outcome.error, None);
    outcome.events
}

fn ev(event: Option<&str>, data: &str, id: Option<&str>) -> SseEvent {
    SseEvent {
        event: event.map(str::to_owned),
        data: data.to_owned(),
        id: id.map(str::to_owned),
    }
}

fn data(d: &str) -> SseEvent {
    ev(None, d, None)
}

fn limits(max_event_bytes: usize, max_events: usize, max_total_bytes: u64) -> SseLimits {
    SseLimits {
        max_event_bytes,
        max_events,
        max_total_bytes,
    }
}

#[test]
fn the_defaults_are_the_design_bounds() {
    assert_eq!(
        SseLimits::default(),
        limits(8 * 1024 * 1024, 10_000, 64 * 1024 * 1024)
    );
}

#[test]
fn the_specification_examples_parse_as_specified_except_that_empty_data_is_skipped() {
    assert_eq!(
        events(b"data: YHOO\ndata: +2\ndata: 10\n\n"),
        vec![data("YHOO\n+2\n10")]
    );

    let out = parse(
            b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\ndata:  third event\n\n",
        );
    assert_eq!(
        out.events,
        vec![
            ev(None, "first event", Some("1")),
            data("second event"),
            data(" third event"),
        ]
    );
    assert_eq!((out.dispatched, out.last_event_id), (3, None));

    // The first block has empty data (skipped for MCP), the last is never terminated.
    let out = parse(b"data\n\ndata\ndata\n\ndata:");
    assert_eq!(out.events, vec![data("\n")]);
    assert_eq!(out.dispatched, 2);

    assert_eq!(
        events(b"data:test\n\ndata: test\n\n"),
        vec![data("test"), data("test")]
    );
}

#[test]
fn lf_crlf_and_a_lone_cr_all_end_lines_in_any_mix() {
    let expected = vec![data("a\nb"), data("c")];
    assert_eq!(events(b"data: a\ndata: b\n\ndata: c\n\n"), expected);
    assert_eq!(
        events(b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n"),
        expected
    );
    assert_eq!(events(b"data: a\rdata: b\r\rdata: c\r\r"), expected);
    assert_eq!(events(b"data: a\rdata: b\r\n\ndata: c\n\r\n"), expected);
    // LF CR is two line ends, so it dispatches.
    assert_eq!(
        events(b"data: a\n\rdata: b\r\n\n"),
        vec![data("a"), data("b")]
    );
}

#[test]
fn a_cr_ending_one_chunk_and_an_lf_starting_the_next_are_one_line_end() {
    let limits = SseLimits::default();
    let out = run(limits, &[b"data: a\r", b"\ndata: b\r\n\r\n"]);
    assert_eq!(out.events, vec![data("a\nb")]);
    // Also across an empty chunk in between.
    let out = run(limits, &[b"data: a\r", b"", b"\ndata: b\r", b"\n\r", b"\n"]);
    assert_eq!(out.events, vec![data("a\nb")]);
    // A CR followed by something else is still a line end.
    let out = run(limits, &[b"data: a\r", b"\r"]);
    assert_eq!(out.events, vec![data("a")]);
}

#[test]
fn a_byte_order_mark_is_skipped_once_at_the_stream_start_only() {
    assert_eq!(events("\u{FEFF}data: a\n\n".as_bytes()), vec![data("a")]);
    // A second one belongs to the field name, which is then unknown.
    let out = parse("\u{FEFF}\u{FEFF}data: a\n\n".as_bytes());
    assert_eq!((out.events, out.dispatched), (vec![], 1));
    // Inside the stream it is content.
    assert_eq!(
        events("data: a\n\ndata: \u{FEFF}b\n\n".as_bytes()),
        vec![data("a"), data("\u{FEFF}b")]
    );
    // A partial mark is not a mark: its bytes start the first line.
    let out = parse(b"\xEF\xBBdata: a\n\ndata: b\n\n");
    assert_eq!(out.events, vec![data("b")]);
    let out = parse(b"\xEF\n\ndata: b\n\n");
    assert_eq!(out.events, vec![data("b")]);
    // Split over chunks.
    let out = run(
        SseLimits::default(),
        &[b"\xEF", b"\xBB", b"\xBFdata: a\n\n"],
    );
    assert_eq!(out.events, vec![data("a")]);
}

#[test]
fn comments_are_ignored_and_comment_only_blocks_are_not_events() {
    let out = parse(b": keep-alive\n\n:\n\n\n\n: x\ndata: a\n: y\ndata: b\n\n");
    assert_eq!(out.events, vec![data("a\nb")]);
    assert_eq!(out.dispatched, 1);
}

#[test]
fn a_field_without_a_colon_has_an_empty_value() {
    assert_eq!(events(b"data\ndata\n\n"), vec![data("\n")]);
    assert_eq!(events(b"event: x\nevent\ndata: a\n\n"), vec![data("a")]);
    let out = parse(b"id: 1\ndata: a\n\nid\ndata: b\n\n");
    assert_eq!(out.events, vec![ev(None, "a", Some("1")), data("b")]);
    assert_eq!(out.last_event_id, None);
}

#[test]
fn only_one_leading_space_of_a_value_is_removed() {
    assert_eq!(
        events(b"data:x\n\ndata: x\n\ndata:  x\n\ndata:\tx\n\ndata: x \n\n"),
        vec![data("x"), data("x"), data(" x"), data("\tx"), data("x ")]
    );
    assert_eq!(
        events(b"event:  t\nid:  i\ndata: a:b: c\n\n"),
        vec![ev(Some(" t"), "a:b: c", Some(" i"))]
    );
}

#[test]
fn multi_line_data_is_joined_with_newlines() {
    assert_eq!(
        events(b"data: {\"a\":\ndata:1}\ndata:\ndata: end\n\n"),
        vec![data("{\"a\":\n1}\n\nend")]
    );
    // Trailing empty data lines keep all but the final newline.
    assert_eq!(events(b"data: a\ndata:\ndata:\n\n"), vec![data("a\n\n")]);
}

#[test]
fn a_priming_event_is_skipped_but_its_id_and_retry_take_effect() {
    let out = parse(b"id: prime-1\nretry: 1500\ndata:\n\nevent: message\ndata: {}\n\n");
    assert_eq!(out.events, vec![ev(Some("message"), "{}", Some("prime-1"))]);
    assert_eq!(out.last_event_id.as_deref(), Some("prime-1"));
    assert_eq!(out.retry, Some(Duration::from_millis(1500)));
    assert_eq!(out.dispatched, 2);
    // Without any data line, and with the id alone.
    let out = parse(b"id: 0/1\n\n");
    assert_eq!(
        (out.events, out.last_event_id.as_deref()),
        (vec![], Some("0/1"))
    );
}

#[test]
fn retry_sets_the_reconnection_time_in_milliseconds_saturating_at_a_day() {
    assert_eq!(
        parse(b"retry: 500\n\n").retry,
        Some(Duration::from_millis(500))
    );
    assert_eq!(parse(b"retry:0\n\n").retry, Some(Duration::ZERO));
    assert_eq!(parse(b"retry: 86400000\n\n").retry, Some(MAX_RETRY));
    assert_eq!(parse(b"retry: 86400001\n\n").retry, Some(MAX_RETRY));
    assert_eq!(
        parse(b"retry: 99999999999999999999999999999999\n\n").retry,
        Some(MAX_RETRY)
    );
    // It takes effect on its line, like the specification says, even in a cut-off event.
    assert_eq!(parse(b"retry: 7\n").retry, Some(Duration::from_millis(7)));
    assert_eq!(parse(b"retry: 7").retry, None);
}

#[test]
fn a_retry_that_is_not_all_ascii_digits_is_ignored() {
    for bad in [
        "5s", "-1", "+1", "1.5", "", " 5", "5 ", "1e3", "\u{0661}", "0x10",
    ] {
        let stream = format!("retry: 500\n\nretry: {bad}\n\n");
        assert_eq!(
            parse(stream.as_bytes()).retry,
            Some(Duration::from_millis(500)),
            "{bad:?}"
        );
    }
    assert_eq!(parse(b"retry\n\n").retry, None);
}

#[test]
fn an_id_containing_nul_or_not_utf8_is_ignored() {
    let out = parse(b"id: 1\ndata: a\n\nid: 2\0x\ndata: b\n\nid: \xFF\ndata: c\n\n");
    assert_eq!(
        out.events,
        vec![
            ev(None, "a", Some("1")),
            ev(None, "b", Some("1")),
            ev(None, "c", Some("1")),
        ]
    );
    assert_eq!(out.last_event_id.as_deref(), Some("1"));
}

#[test]
fn an_unterminated_event_is_discarded_at_the_end_with_its_id() {
    let out = parse(b"data: a\n\nid: 7\ndata: b\n");
    assert_eq!(out.events, vec![data("a")]);
    assert_eq!(out.last_event_id, None);
    assert_eq!(out.dispatched, 1);
    let out = parse(b"data: a\n\ndata: b");
    assert_eq!(out.events, vec![data("a")]);
}

#[test]
fn after_finish_a_new_stream_starts_and_keeps_the_last_event_id() {
    let mut parser = SseParser::new(SseLimits::default());
    let mut out = Vec::new();
    parser
        .feed(b"id: 1\ndata: a\n\nid: 2\ndata: cut", &mut out)
        .unwrap();
    parser.finish().unwrap();
    assert_eq!(parser.last_event_id(), Some("1"));
    parser
        .feed("\u{FEFF}data: b\r".as_bytes(), &mut out)
        .unwrap();
    parser.feed(b"\n\n", &mut out).unwrap();
    assert_eq!(
        out,
        vec![ev(None, "a", Some("1")), ev(None, "b", Some("1"))]
    );
    let fed = "id: 1\ndata: a\n\nid: 2\ndata: cut\u{FEFF}data: b\r\n\n".len() as u64;
    assert_eq!(parser.bytes_seen(), fed);
}

#[test]
fn data_may_come_before_the_id_and_the_event_carries_that_id() {
    assert_eq!(
        events(b"data: {\"jsonrpc\":\"2.0\"}\nid: 42\nevent: message\n\n"),
        vec![ev(Some("message"), "{\"jsonrpc\":\"2.0\"}", Some("42"))]
    );
}

#[test]
fn ids_are_arbitrary_strings_that_persist_until_replaced_or_cleared() {
    let uuid = "3f2b8c1e-9a4d-4c7b-8e21-5d6f0a9b7c34";
    let stream = format!("id: 0/1\ndata: a\n\ndata: b\n\nid: {uuid}\ndata: c\n\nid:\ndata: d\n\n");
    let out = parse(stream.as_bytes());
    assert_eq!(
        out.events,
        vec![
            ev(None, "a", Some("0/1")),
            ev(None, "b", Some("0/1")),
            ev(None, "c", Some(uuid)),
            ev(None, "d", None),
        ]
    );
    assert_eq!(out.last_event_id, None);
}

#[test]
fn the_event_type_is_none_when_absent_or_empty_and_resets_after_each_block() {
    assert_eq!(
            events(b"event: message\ndata: a\n\ndata: b\n\nevent:\ndata: c\n\nevent: x\nevent: y\ndata: d\n\n"),
            vec![ev(Some("message"), "a", None), data("b"), data("c"), ev(Some("y"), "d", None)]
        );
    // The type of a skipped block does not leak into the next.
    assert_eq!(events(b"event: x\n\ndata: a\n\n"), vec![data("a")]);
}

#[test]
fn unknown_fields_are_ignored_but_make_a_block() {
    let out = parse(b"foo: bar\n\ndata: a\nDATA: b\ndata : c\n\n");
    assert_eq!(out.events, vec![data("a")]);
    assert_eq!(out.dispatched, 2);
}

#[test]
fn data_or_an_event_type_that_is_not_utf8_fails_the_stream() {
    let out = parse(b"data: ok\n\ndata: \xC3\x28\n\ndata: never\n\n");
    assert_eq!(out.events, vec![data("ok")]);
    assert_eq!(out.error, Some(SseError::InvalidUtf8));
    let out = parse(b"event: \xFF\ndata: a\n\n");
    assert_eq!(out.error, Some(SseError::InvalidUtf8));
    // A split multi-byte character is fine.
    assert_eq!(events("data: é€😀\n\n".as_bytes()), vec![data("é€😀")]);
    // Invalid bytes in a block that is not returned are never looked at.
    assert_eq!(parse(b"event: \xFF\n\n").error, None);
}

#[test]
fn event_data_of_exactly_the_limit_passes_and_one_byte_more_fails() {
    let max = 16;
    let lim = limits(max, 100, 1 << 20);
    let at = format!("data: {}\n\n", "x".repeat(max));
    assert_eq!(
        parse_with(lim, at.as_bytes()).events,
        vec![data(&"x".repeat(max))]
    );
    let over = format!("data: ok\n\ndata: {}\n\n", "x".repeat(max + 1));
    let out = parse_with(lim, over.as_bytes());
    assert_eq!(out.events, vec![data("ok")]);
    assert_eq!(out.error, Some(SseError::EventTooLarge { limit: max }));
    // Joined lines count their newlines: 7 + 1 + 8 = 16 bytes.
    let joined = format!("data: {}\ndata:{}\n\n", "a".repeat(7), "b".repeat(8));
    assert_eq!(parse_with(lim, joined.as_bytes()).events.len(), 1);
    let joined = format!("data: {}\ndata:{}\n\n", "a".repeat(7), "b".repeat(9));
    assert_eq!(
        parse_with(lim, joined.as_bytes()).error,
        Some(SseError::EventTooLarge { limit: max })
    );
    // Other lines are bounded by the same number, whole.
    let id = format!("id:{}\n\n", "i".repeat(max - 3));
    assert_eq!(parse_with(lim, id.as_bytes()).error, None);
    let id = format!("id:{}\n\n", "i".repeat(max - 2));
    assert_eq!(
        parse_with(lim, id.as_bytes()).error,
        Some(SseError::EventTooLarge { limit: max })
    );
    let comment = format!(":{}\n", "c".repeat(max));
    assert_eq!(
        parse_with(lim, comment.as_bytes()).error,
        Some(SseError::EventTooLarge { limit: max })
    );
}

#[test]
fn a_huge_line_fails_as_soon_as_it_exceeds_the_limit_without_waiting_for_its_end() {
    let max = 1024;
    for prefix in [&b"data: "[..], b"data:", b"event: ", b"xxxx", b": comment"] {
        let mut parser = SseParser::new(limits(max, 100, u64::MAX));
        let mut out = Vec::new();
        parser.feed(prefix, &mut out).unwrap();
        let room = if prefix.starts_with(b"data") {
            max
        } else {
            max - prefix.len()
        };
        for _ in 0..room {
            parser.feed(b"x", &mut out).unwrap();
        }
        assert!(parser.line.len() <= max + DATA_PREFIX);
        assert_eq!(
            parser.feed(b"x", &mut out),
            Err(SseError::EventTooLarge { limit: max }),
            "{prefix:?}"
        );
        // A whole chunk of it is refused without being buffered.
        let mut parser = SseParser::new(limits(max, 100, u64::MAX));
        let huge = [b'x'; 64 * 1024];
        parser.feed(prefix, &mut out).unwrap();
        assert!(parser.feed(&huge, &mut out).is_err());
        assert!(parser.line.capacity() < 64 * 1024);
    }
}

#[test]
fn event_count_at_the_limit_passes_and_one_more_fails_counting_skipped_blocks() {
    let lim = limits(1024, 3, 1 << 20);
    let three = b"data: a\n\nid: p\ndata:\n\n: ping\n\nretry: 1\n\n";
    let out = parse_with(lim, three);
    assert_eq!((out.events.len(), out.dispatched, out.error), (1, 3, None));
    let four = b"data: a\n\nid: p\ndata:\n\n: ping\n\nretry: 1\n\nid: q\ndata: b\n\n";
    let out = parse_with(lim, four);
    assert_eq!(out.events, vec![data("a")]);
    assert_eq!(out.error, Some(SseError::TooManyEvents { limit: 3 }));
    assert_eq!(out.dispatched, 3);
    // The refused block's id never took effect.
    assert_eq!(out.last_event_id.as_deref(), Some("p"));
}

#[test]
fn stream_bytes_at_the_limit_pass_and_one_more_fails_after_the_events_before_it() {
    let stream = b"data: a\n\ndata: b\n\n";
    let n = stream.len() as u64;
    assert_eq!(parse_with(limits(1024, 100, n), stream).error, None);
    let out = parse_with(limits(1024, 100, n - 1), stream);
    assert_eq!(out.events, vec![data("a")]);
    assert_eq!(out.error, Some(SseError::StreamTooLarge { limit: n - 1 }));
    // Counted across chunks, empty ones included.
    let mut parser = SseParser::new(limits(1024, 100, 4));
    let mut out = Vec::new();
    parser.feed(b"", &mut out).unwrap();
    parser.feed(b"::", &mut out).unwrap();
    parser.feed(b"::", &mut out).unwrap();
    assert_eq!(parser.bytes_seen(), 4);
    assert_eq!(
        parser.feed(b"\n", &mut out),
        Err(SseError::StreamTooLarge { limit: 4 })
    );
    assert_eq!(parser.bytes_seen(), 5);
}

#[test]
fn after_an_error_every_call_repeats_it() {
    let mut parser = SseParser::new(limits(4, 100, 1 << 20));
    let mut out = Vec::new();
    let err = SseError::EventTooLarge { limit: 4 };
    assert_eq!(parser.feed(b"data: 12345\n\n", &mut out), Err(err.clone()));
    assert_eq!(parser.feed(b"data: 1\n\n", &mut out), Err(err.clone()));
    assert_eq!(parser.feed(b"", &mut out), Err(err.clone()));
    assert_eq!(parser.finish(), Err(err.clone()));
    assert_eq!(parser.feed(b"\n", &mut out), Err(err));
    assert!(out.is_empty());
}

#[test]
fn error_texts_are_single_lowercase_lines_that_quote_nothing() {
    let errors = [
        SseError::EventTooLarge { limit: 8 },
        SseError::TooManyEvents { limit: 10 },
        SseError::StreamTooLarge { limit: 64 },
        SseError::InvalidUtf8,
    ];
    for err in errors {
        let text = err.to_string();
        assert!(!text.contains('\n') && !text.contains('"'), "{text}");
        assert!(text.starts_with(char::is_lowercase), "{text}");
    }
    assert_eq!(
        SseError::EventTooLarge { limit: 8 }.to_string(),
        "server-sent event exceeds the limit of 8 bytes"
    );
}

#[test]
fn debug_output_shows_no_buffered_content() {
    let mut parser = SseParser::new(SseLimits::default());
    parser
        .feed(b"id: secret-id\ndata: secret-token", &mut Vec::new())
        .unwrap();
    let text = format!("{parser:?}");
    assert!(!text.contains("secret"), "{text}");
}

// ---- properties ----

/// Lines that look like SSE, with the usual traps: every field, odd spacing, colons and NUL
/// in values, non-ASCII and occasionally invalid bytes, all three line ends.
fn sse_line() -> impl Strategy<Value = Vec<u8>> {
    let name = prop_oneof![
        4 => Just("data"),
        2 => Just("event"),
        2 => Just("id"),
        1 => Just("retry"),
        1 => Just(""),
        1 => Just("dat"),
        1 => Just("foo"),
    ];
    let sep = prop_oneof![Just(":"), Just(": "), Just(":  "), Just("")];
    let value = prop_oneof![
        8 => "[ a-z0-9:é\u{0}\u{FEFF}]{0,10}".prop_map(String::into_bytes),
        2 => "[0-9]{0,6}".prop_map(String::into_bytes),
        1 => proptest::collection::vec(any::<u8>(), 0..4),
    ];
    let eol = prop_oneof![Just("\n"), Just("\r"), Just("\r\n")];
    prop_oneof![
        4 => (name, sep, value, eol.clone()).prop_map(|(n, s, v, e)| {
            let mut line = n.as_bytes().to_vec();
            line.extend_from_slice(s.as_bytes());
            line.extend_from_slice(&v);
            line.extend_from_slice(e.as_bytes());
            line
        }),
        2 => eol.prop_map(|e| e.as_bytes().to_vec()),
    ]
}

fn sse_stream() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<bool>(),
        proptest::collection::vec(sse_line(), 0..40),
        "[a-z: ]{0,6}",
    )
        .prop_map(|(bom, lines, tail)| {
            let mut stream = if bom {
                "\u{FEFF}".as_bytes().to_vec()
            } else {
                vec![]
            };
            stream.extend(lines.concat());
            stream.extend_from_slice(tail.as_bytes());
            stream
        })
}

fn any_limits() -> impl Strategy<Value = SseLimits> {
    prop_oneof![
        Just(SseLimits::default()),
        (0usize..24, 0usize..6, 0u64..400).prop_map(|(e, n, t)| limits(e, n, t)),
    ]
}

fn cuts(len: usize, raw: &[prop::sample::Index]) -> Vec<usize> {
    let mut cuts: Vec<usize> = raw.iter().map(|i| i.index(len + 1)).collect();
    cuts.sort_unstable();
    cuts
}

/// Serializes events as a server would, one line-end style per stream.
fn serialize(events: &[(Option<String>, String, Option<String>)], eol: &str) -> String {
    let mut text = String::new();
    for (event, data, id) in events {
        if let Some(event) = event {
            text.push_str(&format!("event: {event}{eol}"));
        }
        for line in data.split('\n') {
            text.push_str(&format!("data: {line}{eol}"));
        }
        if let Some(id) = id {
            text.push_str(&format!("id: {id}{eol}"));
        }
        text.push_str(eol);
    }
    text
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn chunking_never_changes_the_outcome(
        stream in sse_stream(),
        limits in any_limits(),
        raw_cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..10),
    ) {
        let whole = run(limits, &[&stream]);
        let split = run_split(limits, &stream, &cuts(stream.len(), &raw_cuts));
        prop_assert_eq!(&split, &whole);
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        prop_assert_eq!(&run(limits, &bytes), &whole);
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_never_outgrow_the_bounds(
        stream in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..2048),
            proptest::collection::vec(
                prop_oneof![
                    Just(b'\n'), Just(b'\r'), Just(b':'), Just(b' '), Just(b'd'), Just(b'a'),
                    Just(b't'), Just(b'i'), Just(0xEF), Just(0xBB), Just(0xBF), any::<u8>(),
                ],
                0..2048,
            ),
            sse_stream(),
        ],
        max_event in 0usize..64,
        max_events in 0usize..8,
        max_total in 0u64..4096,
        raw_cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..16),
    ) {
        let lim = limits(max_event, max_events, max_total);
        let mut parser = SseParser::new(lim);
        let mut out = Vec::new();
        let mut fed = 0u64;
        for piece in split_at_all(&stream, &cuts(stream.len(), &raw_cuts)) {
            let poisoned = parser.poisoned.is_some();
            let result = parser.feed(&piece, &mut out);
            if !poisoned {
                fed += piece.len() as u64;
            }
            prop_assert_eq!(parser.bytes_seen(), fed);
            prop_assert!(parser.line.len() <= max_event + DATA_PREFIX);
            prop_assert!(parser.data.len() <= max_event + 1);
            prop_assert!(parser.event_type.len() <= max_event);
            prop_assert!(parser.id_buf.len() <= max_event);
            prop_assert!(parser.events_dispatched() <= max_events);
            if result.is_err() {
                prop_assert_eq!(parser.feed(b"data: x\n\n", &mut out), result);
            }
        }
        let _ = parser.finish();
        prop_assert!(out.len() <= max_events);
        for event in &out {
            prop_assert!(!event.data.is_empty() && event.data.len() <= max_event);
        }
    }

    #[test]
    fn serialized_events_parse_back_to_themselves(
        input in proptest::collection::vec(
            (
                proptest::option::of("[^\r\n]{0,8}"),
                "[^\r]{0,40}",
                proptest::option::of("[^\r\n\u{0}]{0,12}"),
            ),
            0..12,
        ),
        eol in prop_oneof![Just("\n"), Just("\r\n"), Just("\r")],
        raw_cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let text = serialize(&input, eol);
        let mut expected = Vec::new();
        let mut last_id: Option<String> = None;
        for (event, data, id) in &input {
            if let Some(id) = id {
                last_id = Some(id.clone()).filter(|id| !id.is_empty());
            }
            if !data.is_empty() {
                expected.push(SseEvent {
                    event: event.clone().filter(|e| !e.is_empty()),
                    data: data.clone(),
                    id: last_id.clone(),
                });
            }
        }
        let out = run_split(SseLimits::default(), text.as_bytes(), &cuts(text.len(), &raw_cuts));
        prop_assert_eq!(out.error, None);
        prop_assert_eq!(out.events, expected);
        prop_assert_eq!(out.last_event_id, last_id);
        prop_assert_eq!(out.dispatched, input.len());
    }
}
