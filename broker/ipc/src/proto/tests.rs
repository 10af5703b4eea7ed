use super::*;
use proptest::prelude::*;
use serde_json::Map;

fn agent_open(body: &str) -> Result<(u64, &'static Entry, Request), Fatal> {
    decode(Role::Agent, State::Open, body.as_bytes())
}

#[test]
fn every_method_has_exactly_one_row_per_socket() {
    for e in TABLE {
        let same: Vec<_> = TABLE
            .iter()
            .filter(|x| x.kind.role() == e.kind.role() && x.method() == e.method())
            .collect();
        assert_eq!(same.len(), 1, "{}", e.method());
    }
    // Operator control is not reachable from the agent socket, and the reverse.
    for m in [
        "status", "cancel", "restart", "stop", "logout", "pending", "decide", "answer", "show",
    ] {
        assert!(lookup(Role::Agent, m).is_none(), "{m}");
    }
    for m in [
        "list_tools",
        "call_tool",
        "end_session",
        "list_skills",
        "use_skill",
        "resolve_agent",
        "submit_prompt",
    ] {
        assert!(lookup(Role::Operator, m).is_none(), "{m}");
    }
}

#[test]
fn requests_decode_strictly() {
    let (id, e, r) = agent_open(
        r#"{"id":7,"method":"call_tool","params":{"server":"s","tool":"t","arguments":{"a":1}}}"#,
    )
    .unwrap();
    assert_eq!((id, e.kind), (7, Kind::Agent(AgentMethod::CallTool)));
    assert!(
        matches!(r, Request::Agent(AgentRequest::CallTool(c)) if c.server == "s" && c.arguments["a"] == 1)
    );
    assert_eq!(
        agent_open(r#"{"id":1,"method":"list_tools"}"#).unwrap().2,
        Request::Agent(AgentRequest::ListTools)
    );
    for bad in [
        r#"{"id":1,"method":"list_tools","params":{"x":1}}"#,
        r#"{"id":1,"method":"list_tools","extra":1}"#,
        r#"{"id":1,"id":2,"method":"list_tools"}"#,
        r#"{"id":1,"method":"call_tool","params":{"server":"s","server":"t","tool":"x"}}"#,
        r#"{"id":1,"method":"call_tool","params":{"server":"s"}}"#,
        r#"{"id":1,"method":"call_tool","params":{"server":"s","tool":"t","arguments":[]}}"#,
        r#"{"id":-1,"method":"list_tools"}"#,
        r#"{"id":1,"method":"status"}"#,
        r#"{"id":1,"method":"hello","params":{"protocol":1}}"#,
        r#"{"method":"list_tools"}"#,
        r#"[1,2]"#,
        "\u{feff}{}",
        "",
    ] {
        let err = agent_open(bad).unwrap_err();
        assert_eq!(err.refusal.code, Code::Protocol, "{bad}");
    }
    let early = decode(
        Role::Agent,
        State::AwaitingHello,
        br#"{"id":3,"method":"call_tool","params":{"server":"s","tool":"t"}}"#,
    )
    .unwrap_err();
    assert_eq!(early.id, Some(3));
    assert!(early.refusal.message().contains("before hello"));
}

#[test]
fn decide_takes_one_id_or_a_bounded_list() {
    let op = |params: &str| {
        decode(
            Role::Operator,
            State::Open,
            format!(r#"{{"id":1,"method":"decide","params":{params}}}"#).as_bytes(),
        )
    };
    assert!(op(r#"{"id":3,"approve":true}"#).is_ok());
    assert!(op(r#"{"ids":[3,4],"approve":false}"#).is_ok());
    let max: Vec<String> = (0..MAX_DECIDE_IDS).map(|i| i.to_string()).collect();
    assert!(op(&format!(r#"{{"ids":[{}],"approve":true}}"#, max.join(","))).is_ok());
    let over: Vec<String> = (0..=MAX_DECIDE_IDS).map(|i| i.to_string()).collect();
    for bad in [
        format!(r#"{{"ids":[{}],"approve":true}}"#, over.join(",")),
        r#"{"id":3,"ids":[4],"approve":true}"#.to_owned(),
        r#"{"approve":true}"#.to_owned(),
        r#"{"ids":[],"approve":true}"#.to_owned(),
    ] {
        assert_eq!(op(&bad).unwrap_err().refusal.code, Code::Protocol, "{bad}");
    }
}

#[test]
fn show_takes_one_id_and_an_optional_offset() {
    let op = |params: &str| {
        decode(
            Role::Operator,
            State::Open,
            format!(r#"{{"id":1,"method":"show","params":{params}}}"#).as_bytes(),
        )
    };
    assert_eq!(
        op(r#"{"id":3}"#).unwrap().2,
        Request::Operator(OperatorRequest::Show(Show { id: 3, offset: 0 }))
    );
    assert_eq!(
        op(r#"{"id":3,"offset":262144}"#).unwrap().2,
        Request::Operator(OperatorRequest::Show(Show {
            id: 3,
            offset: 262_144
        }))
    );
    for bad in [
        "{}",
        r#"{"ids":[3]}"#,
        r#"{"id":3,"offset":-1}"#,
        r#"{"id":3,"x":1}"#,
    ] {
        assert_eq!(op(bad).unwrap_err().refusal.code, Code::Protocol, "{bad}");
    }
    assert!(lookup(Role::Agent, "show").is_none());
}

#[test]
fn resource_and_prompt_requests_are_strict() {
    let agent = |method: &str, params: &str| {
        agent_open(&format!(
            r#"{{"id":1,"method":"{method}","params":{params}}}"#
        ))
    };
    assert!(agent("list_resources", r#"{"server":"s"}"#).is_ok());
    assert!(agent("list_prompts", r#"{"server":"s"}"#).is_ok());
    assert!(agent("read_resource", r#"{"server":"s","uri":"file:///x"}"#).is_ok());
    assert!(agent("get_prompt", r#"{"server":"s","name":"p"}"#).is_ok());
    assert!(
        agent(
            "get_prompt",
            r#"{"server":"s","name":"p","arguments":{"a":"b"}}"#
        )
        .is_ok()
    );
    for (method, bad) in [
        ("list_resources", r#"{}"#),
        ("list_resources", r#"{"server":"s","cursor":"c"}"#),
        ("read_resource", r#"{"server":"s"}"#),
        ("read_resource", r#"{"server":"s","uri":7}"#),
        (
            "get_prompt",
            r#"{"server":"s","name":"p","arguments":{"a":1}}"#,
        ),
        ("get_prompt", r#"{"server":"s","name":"p","arguments":[]}"#),
    ] {
        let e = agent(method, bad).unwrap_err();
        assert_eq!(e.refusal.code, Code::Protocol, "{method} {bad}");
    }
    assert!(lookup(Role::Operator, "read_resource").is_none());
}

#[test]
fn pending_waits_at_most_thirty_seconds() {
    let op = |params: String| {
        decode(
            Role::Operator,
            State::Open,
            format!(r#"{{"id":1,"method":"pending","params":{params}}}"#).as_bytes(),
        )
    };
    assert!(op("{}".into()).is_ok());
    assert!(op(format!(r#"{{"wait_ms":{MAX_PENDING_WAIT_MS}}}"#)).is_ok());
    let over = op(format!(r#"{{"wait_ms":{}}}"#, MAX_PENDING_WAIT_MS + 1)).unwrap_err();
    assert_eq!(over.refusal.code, Code::Protocol);
    assert_eq!(over.refusal.message(), "pending takes wait_ms 0-30000");
    assert!(op(r#"{"wait_ms":-1}"#.into()).is_err());
    iteron_test_support::record!("P5", json!({"max_wait_ms": MAX_PENDING_WAIT_MS}),);
}

#[test]
fn refusals_are_single_line_capped_and_redacted() {
    let r = Refusal::new(
        Code::Refused,
        &format!(
            "line one\nline two Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123456789 {}",
            "x".repeat(900)
        ),
    );
    assert!(!r.message().contains('\n'));
    assert!(r.message().len() <= MAX_REASON);
    assert!(!r.message().contains("abcdefghijklmnop"));
}

#[test]
fn protocol_errors_never_quote_the_callers_text() {
    for bad in [
        r#"{"id":1,"method":"list_tools","params":{"CANARY_KEY":1}}"#,
        r#"{"id":1,"method":"call_tool","params":{"server":"s","tool":"CANARY_VALUE_not_ok"}}"#,
        r#"{"id":1,"method":"call_tool","params":{"server":["CANARY_VALUE"],"tool":"t"}}"#,
        r#"{"id":1,"method":"hello","params":{"protocol":"CANARY_VALUE"}}"#,
        r#"{"id":1,"method":"CANARY_METHOD"}"#,
        r#"{"id":"CANARY_ID","method":"list_tools"}"#,
    ] {
        let msg = match decode(Role::Agent, State::Open, bad.as_bytes()) {
            Err(f) => f.refusal.message().to_owned(),
            Ok(_) => continue,
        };
        assert!(!msg.contains("CANARY"), "{msg}");
    }
}

/// The nodes decoding builds for `v` (see [`MAX_NODES`]).
fn nodes(v: &Value) -> usize {
    match v {
        Value::Object(m) => 1 + m.values().map(|x| 1 + nodes(x)).sum::<usize>(),
        Value::Array(a) => 1 + a.iter().map(nodes).sum::<usize>(),
        _ => 1,
    }
}

fn call_frame(arguments: &str) -> String {
    format!(
        r#"{{"id":5,"method":"call_tool","params":{{"server":"s","tool":"t","arguments":{arguments}}}}}"#
    )
}

#[test]
fn params_are_bounded_in_nodes_at_the_limit_and_one_over() {
    // params = {"server":"s","tool":"t","arguments":{"a":[…]}} is 9 nodes around the list.
    let empties = |k: usize| call_frame(&format!(r#"{{"a":[{}]}}"#, vec!["{}"; k].join(",")));
    let at = empties(MAX_NODES - 9);
    let Request::Agent(AgentRequest::CallTool(c)) = agent_open(&at).unwrap().2 else {
        panic!("not a call");
    };
    let decoded = json!({"server": c.server, "tool": c.tool, "arguments": c.arguments});
    assert_eq!(nodes(&decoded), MAX_NODES);
    let Err(over) = agent_open(&empties(MAX_NODES - 8)) else {
        panic!("one node over the bound was decoded");
    };
    assert_eq!(over.id, Some(5));
    assert_eq!(over.refusal.code, Code::Protocol);
    assert_eq!(
        over.refusal.message(),
        "params hold more than 65536 JSON nodes"
    );
    // The red team's frame: 1 MiB of empty objects, about 48 MB once decoded.
    let k = (super::super::frame::MAX_FRAME - empties(0).len()) / 3;
    let big = empties(k);
    assert!(big.len() <= super::super::frame::MAX_FRAME && k > 300_000);
    assert!(matches!(agent_open(&big), Err(f) if f.refusal.code == Code::Protocol));
    // Keys, strings, numbers and literals count as well as containers; one node over the
    // bound is refused whatever the nodes are.
    for unit in ["null", "1", "-2.5e3", "true", r#""x""#, r#""\"\\""#, "[]"] {
        let list = |k: usize| call_frame(&format!(r#"{{"a":[{}]}}"#, vec![unit; k].join(",")));
        assert!(agent_open(&list(MAX_NODES - 9)).is_ok(), "{unit}");
        assert!(agent_open(&list(MAX_NODES - 8)).is_err(), "{unit}");
    }
    let keys = |k: usize| {
        let members: Vec<String> = (0..k).map(|i| format!(r#""k{i}":0"#)).collect();
        call_frame(&format!("{{{}}}", members.join(",")))
    };
    // 7 nodes around the object, 2 per member.
    assert!(agent_open(&keys((MAX_NODES - 7) / 2)).is_ok());
    assert!(agent_open(&keys((MAX_NODES - 7) / 2 + 1)).is_err());
    // The operator's frames are decoded under the same bound (a form's content).
    let answer = |k: usize| {
        format!(
            r#"{{"id":2,"method":"answer","params":{{"id":1,"action":"accept","content":{{"a":[{}]}}}}}}"#,
            vec!["0"; k].join(",")
        )
    };
    // {"id":1,"action":"accept","content":{"a":[…]}}: 9 nodes around the list.
    let op = |b: String| {
        decode(Role::Operator, State::Open, b.as_bytes())
            .err()
            .map(|f| f.refusal.message().to_owned())
    };
    assert_eq!(op(answer(MAX_NODES - 9)), None);
    assert_eq!(
        op(answer(MAX_NODES - 8)).as_deref(),
        Some("params hold more than 65536 JSON nodes")
    );
    iteron_test_support::record!(
        "P5",
        json!({"max_nodes": MAX_NODES, "red_team_frame_bytes": big.len()}),
    );
}

fn any_json() -> impl Strategy<Value = Value> {
    let text = prop_oneof![
        any::<String>(),
        "[a-z\"\\\\{}\\[\\],: \u{e9}\u{202e}\u{7f}\n]{0,12}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        text.clone().prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 120, 10, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..10).prop_map(Value::from),
            prop::collection::vec((text.clone(), inner), 0..10)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]
    #[test]
    fn the_node_scan_counts_exactly_what_decoding_builds(v in any_json()) {
        let compact = serde_json::to_string(&v).unwrap();
        let pretty = serde_json::to_string_pretty(&v).unwrap();
        prop_assert_eq!(count_nodes(compact.as_bytes(), usize::MAX), nodes(&v));
        prop_assert_eq!(count_nodes(pretty.as_bytes(), usize::MAX), nodes(&v));
    }

    #[test]
    fn decoded_frames_never_exceed_the_node_bound(v in any_json(), max in 0usize..160) {
        let arguments = json!({"x": v});
        let body = call_frame(&serde_json::to_string(&arguments).unwrap());
        let sent = nodes(&json!({"server": "s", "tool": "t", "arguments": arguments}));
        match decode_bounded(Role::Agent, State::Open, body.as_bytes(), max) {
            Ok((_, _, Request::Agent(AgentRequest::CallTool(c)))) => {
                let decoded = json!({"server": c.server, "tool": c.tool, "arguments": c.arguments});
                prop_assert!(nodes(&decoded) <= max);
                prop_assert_eq!(nodes(&decoded), sent);
            }
            Ok(_) => prop_assert!(false, "decoded as another request"),
            Err(f) => {
                prop_assert!(sent > max, "refused within the bound: {}", f.refusal);
                prop_assert_eq!(f.refusal.message(), format!("params hold more than {max} JSON nodes"));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]
    #[test]
    fn arbitrary_bodies_never_panic_and_errors_are_bounded(body in prop::collection::vec(any::<u8>(), 0..300), open in any::<bool>(), agent in any::<bool>()) {
        let role = if agent { Role::Agent } else { Role::Operator };
        let state = if open { State::Open } else { State::AwaitingHello };
        if let Err(f) = decode(role, state, &body) {
            prop_assert_eq!(f.refusal.code, Code::Protocol);
            prop_assert!(f.refusal.message().len() <= MAX_REASON);
            prop_assert!(!f.refusal.message().contains('\n'));
        }
    }

    #[test]
    fn structured_garbage_is_refused_not_accepted(method in "[a-z_]{0,12}", key in "[a-z]{1,8}", v in any::<i64>()) {
        let body = format!(r#"{{"id":1,"method":"{method}","params":{{"{key}":{v}}}}}"#);
        if let Ok((_, e, _)) = decode(Role::Agent, State::Open, body.as_bytes()) {
            // Only a real method with a real parameter name can pass.
            prop_assert!(e.method() == method);
            prop_assert!(key == "server" || key == "tool" || key == "arguments");
        }
    }
}

/// The golden exchanges (`fixtures/ipc/exchanges.json`, replayed against a real broker by
/// tests/broker.rs): every request decodes to its typed request and encodes back to the very
/// same frame, or, marked `invalid`, is refused by decoding with exactly the golden error
/// frame; every answer parses as a [`Reply`] and is written back unchanged; every method of
/// both sockets appears.
#[test]
fn golden_exchanges_round_trip_and_cover_every_method() {
    let golden = include_str!("../../../../fixtures/ipc/exchanges.json");
    let doc: Value = serde_json::from_str(golden).unwrap();
    let mut covered = std::collections::HashSet::new();
    let mut last: Option<&str> = None;
    let mut state = State::AwaitingHello;
    for (n, e) in doc["exchanges"].as_array().unwrap().iter().enumerate() {
        let role = match e["socket"].as_str().unwrap() {
            "agent" => Role::Agent,
            "operator" => Role::Operator,
            other => panic!("exchange {n}: socket {other}"),
        };
        let connection = e["connection"].as_str();
        if connection != last {
            state = State::AwaitingHello;
            last = connection;
        }
        let request = &e["request"];
        let answer = &e["answer"];
        let body = serde_json::to_vec(request).unwrap();
        match decode(role, state, &body) {
            Ok((id, entry, typed)) => {
                assert!(
                    e.get("invalid").is_none(),
                    "exchange {n} decoded: {request}"
                );
                assert_eq!(typed.kind(), entry.kind, "exchange {n}");
                assert_eq!(&typed.frame(id).unwrap(), request, "exchange {n}");
                covered.insert((entry.kind.role() == Role::Agent, entry.method()));
                if answer.get("result").is_some() {
                    state = State::Open;
                }
            }
            Err(f) => {
                assert_eq!(e["invalid"], true, "exchange {n} refused: {}", f.refusal);
                assert_eq!(&error_frame(f.id, &f.refusal), answer, "exchange {n}");
            }
        }
        let reply = Reply::parse(answer).unwrap_or_else(|| panic!("exchange {n}: {answer}"));
        assert_eq!(&reply.to_value(), answer, "exchange {n}");
        if let Err(w) = &reply.outcome {
            assert!(
                Code::parse(&w.code).is_some(),
                "exchange {n}: code {}",
                w.code
            );
        }
    }
    for entry in TABLE {
        let key = (entry.kind.role() == Role::Agent, entry.method());
        assert!(covered.contains(&key), "no golden exchange for {key:?}");
    }
}

#[test]
fn replies_are_read_strictly() {
    let ok = json!({"id": 1, "result": {}});
    assert_eq!(Reply::parse(&ok).unwrap().outcome, Ok(json!({})));
    let fatal = json!({"id": null, "error": {"code": "protocol", "message": "m"}});
    assert_eq!(Reply::parse(&fatal).unwrap().id, None);
    for bad in [
        json!({"id": null, "result": {}}),
        json!({"id": 1, "result": []}),
        json!({"id": 1, "result": {}, "extra": 1}),
        json!({"id": 1}),
        json!({"id": -1, "result": {}}),
        json!({"id": 1, "error": {"code": "Protocol", "message": "m"}}),
        json!({"id": 1, "error": {"code": "p".repeat(MAX_WORD + 1), "message": "m"}}),
        json!({"id": 1, "error": {"code": "protocol"}}),
        json!({"id": 1, "error": {"code": "protocol", "message": "m", "why": "x"}}),
        json!({"id": 1, "error": {"code": "failed", "message": "m", "certainty": "maybe applied"}}),
        json!([1]),
    ] {
        assert!(Reply::parse(&bad).is_none(), "{bad}");
    }
    let word = json!({"id": 1, "error": {"code": "p".repeat(MAX_WORD), "message": "m"}});
    assert!(Reply::parse(&word).is_some());
}

#[test]
fn typed_requests_encode_to_frames_the_broker_decodes_alike() {
    let requests: Vec<Request> = vec![
        AgentRequest::Hello(Hello {
            protocol: PROTOCOL_VERSION,
            client: "c".into(),
            agent_type: Some("reviewer".into()),
            model: Some("inherit".into()),
        })
        .into(),
        AgentRequest::CallTool(CallTool {
            server: "s".into(),
            tool: "t".into(),
            arguments: Map::new(),
        })
        .into(),
        OperatorRequest::Decide(Decide {
            id: None,
            ids: vec![1, 2],
            approve: false,
            args_sha256: None,
        })
        .into(),
        OperatorRequest::Pending(PendingArg { wait_ms: 0 }).into(),
        OperatorRequest::Status(StatusArg::default()).into(),
    ];
    for r in requests {
        let frame = r.frame(9).unwrap();
        let (role, state) = match (&r, r.kind()) {
            (Request::Agent(_), Kind::Agent(AgentMethod::Hello)) => {
                (Role::Agent, State::AwaitingHello)
            }
            (Request::Agent(_), _) => (Role::Agent, State::Open),
            (Request::Operator(_), _) => (Role::Operator, State::Open),
        };
        let (id, _, back) = decode(role, state, &serde_json::to_vec(&frame).unwrap()).unwrap();
        assert_eq!((id, &back), (9, &r), "{frame}");
    }
}
