use super::*;
use proptest::prelude::*;

fn err(input: &str) -> JsonError {
    parse(input.as_bytes()).unwrap_err()
}

#[test]
fn duplicate_key_is_rejected_at_its_second_occurrence() {
    let e = err("{\n  \"a\": 1,\n  \"b\": {\"x\": 1, \"x\": 2}\n}");
    assert_eq!(e.path.to_string(), "$.b.x");
    assert_eq!(
        e.pos,
        Pos {
            line: 3,
            column: 17
        }
    );
    assert_eq!(
        e.kind,
        SyntaxError::DuplicateKey {
            first: Pos { line: 3, column: 9 }
        }
    );
}

#[test]
fn keys_equal_after_unescaping_are_duplicates() {
    let e = err(r#"{"ab": 1, "a\u0062": 2}"#);
    assert!(matches!(e.kind, SyntaxError::DuplicateKey { .. }));
}

#[test]
fn same_key_in_sibling_objects_is_fine() {
    parse(br#"[{"a": 1}, {"a": 2}]"#).unwrap();
}

#[test]
fn positions_count_characters_not_bytes() {
    let e = err("{\"é\": tru}");
    assert_eq!(
        e.pos,
        Pos {
            line: 1,
            column: 10
        }
    );
    assert_eq!(e.kind, SyntaxError::UnexpectedChar(Some('}')));
}

#[test]
fn node_positions_point_at_the_value() {
    let n = parse(b"{\n \"k\": [1,\n  \"s\"]}").unwrap();
    let Value::Object(m) = n.value else { panic!() };
    assert_eq!(m[0].key_pos, Pos { line: 2, column: 2 });
    let Value::Array(items) = &m[0].node.value else {
        panic!()
    };
    assert_eq!(items[1].pos, Pos { line: 3, column: 3 });
}

#[test]
fn depth_limit_is_enforced_one_level_over() {
    let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
    parse(ok.as_bytes()).unwrap();
    let over = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
    assert_eq!(err(&over).kind, SyntaxError::TooDeep);
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

#[test]
fn strict_grammar_rejections() {
    let cases: &[(&str, SyntaxError)] = &[
        ("", SyntaxError::UnexpectedEnd),
        ("{", SyntaxError::UnexpectedEnd),
        ("[1,]", SyntaxError::UnexpectedChar(Some(']'))),
        ("{\"a\":1,}", SyntaxError::UnexpectedChar(Some('}'))),
        ("{'a':1}", SyntaxError::UnexpectedChar(Some('\''))),
        ("01", SyntaxError::InvalidNumber),
        ("1.", SyntaxError::InvalidNumber),
        ("-", SyntaxError::InvalidNumber),
        ("1e", SyntaxError::InvalidNumber),
        ("\"\\x\"", SyntaxError::InvalidEscape),
        ("\"\\ud800\"", SyntaxError::InvalidUnicodeEscape),
        ("\"\\udc00\"", SyntaxError::InvalidUnicodeEscape),
        ("\"\\u12\"", SyntaxError::InvalidUnicodeEscape),
        ("\"a\nb\"", SyntaxError::ControlInString),
        ("{} x", SyntaxError::TrailingCharacters),
        ("\u{feff}{}", SyntaxError::ByteOrderMark),
        ("NaN", SyntaxError::UnexpectedChar(Some('N'))),
        ("\u{202e}", SyntaxError::UnexpectedChar(None)),
    ];
    for (input, want) in cases {
        assert_eq!(&err(input).kind, want, "input {input:?}");
    }
}

#[test]
fn a_megabyte_object_of_distinct_keys_is_parsed_and_a_late_duplicate_found() {
    // ~95k keys: a per-key linear scan would take seconds; this must stay linear.
    let mut doc = String::from("{");
    let mut i = 0;
    while doc.len() < 1_000_000 {
        doc.push_str(&format!("\"k{i}\":1,"));
        i += 1;
    }
    let ok = format!("{}}}", doc.trim_end_matches(','));
    let Value::Object(m) = parse(ok.as_bytes()).unwrap().value else {
        panic!()
    };
    assert_eq!(m.len(), i);
    let dup = format!("{doc}\"k0\":2}}");
    assert!(matches!(
        err(&dup).kind,
        SyntaxError::DuplicateKey {
            first: Pos { line: 1, column: 2 }
        }
    ));
}

#[test]
fn invalid_utf8_is_located() {
    let e = parse(b"{\"a\":\n \"\xff\"}").unwrap_err();
    assert_eq!(e.kind, SyntaxError::NotUtf8);
    assert_eq!(e.pos, Pos { line: 2, column: 3 });
}

#[test]
fn surrogate_pairs_and_escapes_decode() {
    let n = parse(br#""\ud83d\ude00 \" \\ \/ \n""#).unwrap();
    assert_eq!(n.value, Value::String("\u{1F600} \" \\ / \n".into()));
}

#[test]
fn untrusted_keys_are_escaped_in_paths() {
    let p = Path::root().key("a\u{202e}b\"").index(3).key("ok_key-1");
    assert_eq!(p.to_string(), "$[\"a\\u{202e}b\\\"\"][3].ok_key-1");
    let long = "k".repeat(200) + " ";
    assert!(Path::root().key(&long).to_string().len() < 70);
}

fn to_json(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => Value::Number(n.to_string()),
        serde_json::Value::String(s) => Value::String(s.clone()),
        serde_json::Value::Array(a) => Value::Array(
            a.iter()
                .map(|x| Node {
                    pos: Pos { line: 0, column: 0 },
                    value: to_json(x),
                })
                .collect(),
        ),
        serde_json::Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| Member {
                    key: k.clone(),
                    key_pos: Pos { line: 0, column: 0 },
                    node: Node {
                        pos: Pos { line: 0, column: 0 },
                        value: to_json(x),
                    },
                })
                .collect(),
        ),
    }
}

fn strip(n: &Node) -> Value {
    match &n.value {
        Value::Array(a) => Value::Array(
            a.iter()
                .map(|x| Node {
                    pos: Pos { line: 0, column: 0 },
                    value: strip(x),
                })
                .collect(),
        ),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|m| Member {
                    key: m.key.clone(),
                    key_pos: Pos { line: 0, column: 0 },
                    node: Node {
                        pos: Pos { line: 0, column: 0 },
                        value: strip(&m.node),
                    },
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

fn arb_json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<String>().prop_map(serde_json::Value::String),
    ];
    leaf.prop_recursive(4, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            prop::collection::btree_map(any::<String>(), inner, 0..6)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #[test]
    fn never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse(&bytes);
    }

    #[test]
    fn agrees_with_serde_json_on_documents_without_duplicates(v in arb_json(), pretty in any::<bool>()) {
        let text = if pretty { serde_json::to_string_pretty(&v).unwrap() } else { serde_json::to_string(&v).unwrap() };
        let node = parse(text.as_bytes()).unwrap();
        prop_assert_eq!(strip(&node), to_json(&v));
    }

    #[test]
    fn a_repeated_key_is_always_rejected(v in arb_json(), key in any::<String>()) {
        let k = serde_json::to_string(&key).unwrap();
        let inner = serde_json::to_string(&v).unwrap();
        let doc = format!("{{{k}: {inner}, \"other\": 1, {k}: null}}");
        let e = parse(doc.as_bytes());
        let is_dup = matches!(e, Err(JsonError { kind: SyntaxError::DuplicateKey { .. }, .. }));
        prop_assert!(is_dup);
    }
}
