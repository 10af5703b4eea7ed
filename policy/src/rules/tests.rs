use super::*;
use proptest::prelude::*;
use serde_json::json;

const NOW: u64 = 1_800_000_000;
const UIDS: [u32; 3] = [0, 1000, 65534];
const DIGESTS: [&str; 2] = [
    "1111111111111111111111111111111111111111111111111111111111111111",
    "2222222222222222222222222222222222222222222222222222222222222222",
];

fn digest(i: usize) -> Sha256Hex {
    Sha256Hex::parse(DIGESTS[i]).unwrap()
}

fn rule(id: &str, effect: Effect, server: &str, tool: &str) -> Rule {
    Rule {
        id: RuleId::parse(id).unwrap(),
        effect,
        server: ServerName::parse(server).unwrap(),
        tool: RuleTool::parse(tool).unwrap(),
        arguments: None,
        args_sha256: None,
        agent_uids: Vec::new(),
        agent_identities: Vec::new(),
        max_calls_per_run: None,
        max_calls_per_session: None,
        expires: None,
    }
}

fn args(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => panic!("an object"),
    }
}

fn facts<'a>(server: &'a str, tool: &'a str, arguments: &'a Map<String, Value>) -> CallFacts<'a> {
    CallFacts {
        server,
        tool,
        arguments,
        args_sha256: DIGESTS[0],
        uid: 65534,
        identity: None,
        now: NOW,
    }
}

#[test]
fn expiry_times_are_strict_utc_seconds() {
    assert_eq!(Expiry::parse("1970-01-01T00:00:00Z").unwrap().unix(), 0);
    assert_eq!(
        Expiry::parse("2000-03-01T00:00:00Z").unwrap().unix(),
        951_868_800
    );
    assert_eq!(
        Expiry::parse("2024-02-29T23:59:59Z").unwrap().unix(),
        1_709_251_199
    );
    assert_eq!(
        Expiry::parse("9999-12-31T23:59:59Z").unwrap().unix(),
        253_402_300_799
    );
    for bad in [
        "",
        "2024-02-30T00:00:00Z",
        "2023-02-29T00:00:00Z",
        "2024-13-01T00:00:00Z",
        "2024-00-01T00:00:00Z",
        "2024-01-01T24:00:00Z",
        "2024-01-01T00:60:00Z",
        "2024-01-01T00:00:60Z",
        "2024-01-01 00:00:00Z",
        "2024-01-01T00:00:00",
        "2024-01-01T00:00:00+00:00",
        "2024-01-01T00:00:00.5Z",
        "1969-12-31T23:59:59Z",
        "+024-01-01T00:00:00Z",
        "2024-1-01T00:00:00Z ",
    ] {
        assert!(Expiry::parse(bad).is_none(), "{bad:?}");
    }
    let e = Expiry::parse("2030-01-01T00:00:00Z").unwrap();
    assert!(!e.passed(e.unix() - 1));
    assert!(e.passed(e.unix()));
}

#[test]
fn the_digest_is_of_the_canonical_form_and_changes_with_every_field() {
    let mut r = rule("ci-echo", Effect::Allow, "ev", "echo");
    let mut named = BTreeMap::new();
    named.insert("text".to_owned(), Constraint::Prefix("ci-".into()));
    named.insert("n".to_owned(), Constraint::Range { min: 1, max: 3 });
    r.arguments = Some(named);
    r.max_calls_per_run = Some(5);
    assert_eq!(
        r.canonical_json(),
        r#"{"id":"ci-echo","effect":"allow","server":"ev","tool":"echo","arguments":{"n":{"range":{"max":3,"min":1}},"text":{"prefix":"ci-"}},"max_calls_per_run":5}"#
    );
    let d = r.digest();
    assert_eq!(d.len(), RULE_DIGEST_HEX);
    assert!(
        d.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    let mut seen = vec![d];
    let mut changed = r.clone();
    changed.max_calls_per_run = Some(6);
    seen.push(changed.digest());
    let mut changed = r.clone();
    changed.agent_uids = vec![65534];
    seen.push(changed.digest());
    let mut changed = r.clone();
    changed.effect = Effect::Deny;
    changed.max_calls_per_run = None;
    seen.push(changed.digest());
    let mut changed = r.clone();
    changed.expires = Expiry::parse("2030-01-01T00:00:00Z");
    seen.push(changed.digest());
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 5);
}

#[test]
fn an_audit_detail_with_the_rule_id_and_digest_survives_redaction() {
    // The broker writes `rule <id> (digest <hex>)` into a record's detail, which is redacted:
    // ids and digests are short enough never to be taken for a random secret.
    for id in ["ci-echo", "a1b2c3d4e5f6a7b8c9d0a1b2c3d4e5f6", "R.9_x"] {
        let r = rule(id, Effect::Allow, "ev", "echo");
        let detail = format!("rule {} (digest {})", r.id, r.digest());
        assert_eq!(crate::text::single_line_capped(&detail, 200), detail);
    }
}

#[test]
fn deny_wins_over_any_allow_rule_in_any_order() {
    let a = args(json!({"text": "hi"}));
    let allow = rule("a", Effect::Allow, "ev", "echo");
    let deny = rule("d", Effect::Deny, "ev", "echo");
    for rules in [vec![allow.clone(), deny.clone()], vec![deny.clone(), allow]] {
        assert_eq!(
            decide(&rules, &facts("ev", "echo", &a), |_| Used::default()),
            Ruling::Deny(&deny)
        );
    }
}

#[test]
fn names_are_exact_and_an_uncovered_call_has_no_rule() {
    let rules = vec![rule("a", Effect::Allow, "ev", "echo")];
    let a = Map::new();
    for (s, t) in [
        ("EV", "echo"),
        ("ev", "Echo"),
        ("ev2", "echo"),
        ("ev", "echo2"),
    ] {
        assert_eq!(
            decide(&rules, &facts(s, t, &a), |_| Used::default()),
            Ruling::NoRule
        );
    }
    assert_eq!(
        decide(&rules, &facts("ev", "echo", &a), |_| Used::default()),
        Ruling::Approve(&rules[0])
    );
}

#[test]
fn each_constraint_refuses_with_its_own_reason_and_never_a_value() {
    let mut r = rule("c", Effect::Allow, "ev", "echo");
    let mut named = BTreeMap::new();
    named.insert(
        "mode".to_owned(),
        Constraint::OneOf(vec![Scalar::String("fast".into()), Scalar::Integer(2)]),
    );
    named.insert("path".to_owned(), Constraint::Prefix("/work/".into()));
    named.insert("n".to_owned(), Constraint::Range { min: 1, max: 10 });
    named.insert("flag".to_owned(), Constraint::Equals(Scalar::Bool(true)));
    named.insert("note".to_owned(), Constraint::Any);
    r.arguments = Some(named);
    r.agent_uids = vec![65534];
    r.max_calls_per_run = Some(2);
    r.max_calls_per_session = Some(1);
    let good = json!({"mode": "fast", "path": "/work/a", "n": 10, "flag": true, "note": [1]});
    let rules = vec![r];
    let check = |v: Value, uid: u32, used: Used| {
        let a = args(v);
        let mut f = facts("ev", "echo", &a);
        f.uid = uid;
        match decide(&rules, &f, |_| used) {
            Ruling::Approve(_) => None,
            Ruling::Unmatched { why, .. } => Some(why),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(check(good.clone(), 65534, Used::default()), None);
    let with = |k: &str, v: Value| {
        let mut g = good.clone();
        g[k] = v;
        g
    };
    let outside = |a: &str, kind: &'static str| {
        Some(Miss::Outside {
            argument: a.into(),
            kind,
        })
    };
    let secret = "canary-value-9f2e";
    let cases = [
        (with("mode", json!(secret)), outside("mode", "one_of")),
        (with("mode", json!(2.0)), outside("mode", "one_of")),
        (with("mode", json!("2")), outside("mode", "one_of")),
        (with("path", json!("/workx")), outside("path", "prefix")),
        (with("path", json!(["/work/"])), outside("path", "prefix")),
        (with("n", json!(11)), outside("n", "range")),
        (with("n", json!(0)), outside("n", "range")),
        (with("n", json!(5.5)), outside("n", "range")),
        (with("n", json!(1e1)), outside("n", "range")),
        (with("flag", json!("true")), outside("flag", "equals")),
        (
            with("canary", json!(secret)),
            Some(Miss::OtherArgument("canary".into())),
        ),
    ];
    for (v, want) in cases {
        let got = check(v.clone(), 65534, Used::default());
        assert_eq!(got, want, "{v}");
        assert!(!got.unwrap().to_string().contains(secret));
    }
    let mut missing = good.clone();
    missing.as_object_mut().unwrap().remove("note");
    assert_eq!(
        check(missing, 65534, Used::default()),
        Some(Miss::MissingArgument("note".into()))
    );
    assert_eq!(check(good.clone(), 0, Used::default()), Some(Miss::Uid));
    assert_eq!(
        check(good.clone(), 65534, Used { run: 2, session: 0 }),
        Some(Miss::RunSpent(2))
    );
    assert_eq!(
        check(good.clone(), 65534, Used { run: 1, session: 1 }),
        Some(Miss::SessionSpent(1))
    );
    // One under each count still approves.
    assert_eq!(check(good, 65534, Used { run: 1, session: 0 }), None);
}

#[test]
fn digest_identity_and_expiry_constraints_hold_exactly() {
    let a = Map::new();
    let mut r = rule("x", Effect::Allow, "ev", "echo");
    r.args_sha256 = Some(digest(1));
    let rules = vec![r.clone()];
    let mut f = facts("ev", "echo", &a);
    assert!(matches!(
        decide(&rules, &f, |_| Used::default()),
        Ruling::Unmatched {
            why: Miss::Digest,
            ..
        }
    ));
    f.args_sha256 = DIGESTS[1];
    assert_eq!(
        decide(&rules, &f, |_| Used::default()),
        Ruling::Approve(&rules[0])
    );

    r.args_sha256 = None;
    r.agent_identities = vec![digest(0)];
    let rules = vec![r.clone()];
    let mut f = facts("ev", "echo", &a);
    assert!(matches!(
        decide(&rules, &f, |_| Used::default()),
        Ruling::Unmatched {
            why: Miss::Identity,
            ..
        }
    ));
    f.identity = Some(DIGESTS[1]);
    assert!(matches!(
        decide(&rules, &f, |_| Used::default()),
        Ruling::Unmatched {
            why: Miss::Identity,
            ..
        }
    ));
    f.identity = Some(DIGESTS[0]);
    assert_eq!(
        decide(&rules, &f, |_| Used::default()),
        Ruling::Approve(&rules[0])
    );

    r.agent_identities = Vec::new();
    r.expires = Expiry::parse("2027-01-15T08:00:00Z");
    let at = r.expires.as_ref().unwrap().unix();
    let rules = vec![r];
    let mut f = facts("ev", "echo", &a);
    f.now = at - 1;
    assert_eq!(
        decide(&rules, &f, |_| Used::default()),
        Ruling::Approve(&rules[0])
    );
    f.now = at;
    assert!(matches!(
        decide(&rules, &f, |_| Used::default()),
        Ruling::Unmatched {
            why: Miss::Expired,
            ..
        }
    ));
    // An expired deny rule denies nothing.
    let mut deny = rule("d", Effect::Deny, "ev", "echo");
    deny.expires = Expiry::parse("2027-01-15T08:00:00Z");
    assert_eq!(decide(&[deny], &f, |_| Used::default()), Ruling::NoRule);
}

#[test]
fn the_first_matching_allow_rule_decides_and_the_closest_miss_is_named() {
    let a = args(json!({"text": "b"}));
    let mut first = rule("first", Effect::Allow, "ev", "echo");
    first.arguments = Some(BTreeMap::from([(
        "text".to_owned(),
        Constraint::Equals(Scalar::String("a".into())),
    )]));
    let second = rule("second", Effect::Allow, "ev", "echo");
    let rules = vec![first.clone(), second.clone()];
    assert_eq!(
        decide(&rules, &facts("ev", "echo", &a), |_| Used::default()),
        Ruling::Approve(&rules[1])
    );
    let mut spent = second;
    spent.max_calls_per_run = Some(1);
    let rules = vec![first, spent];
    assert_eq!(
        decide(&rules, &facts("ev", "echo", &a), |_| Used {
            run: 1,
            session: 0
        }),
        Ruling::Unmatched {
            rule: &rules[0],
            why: Miss::Outside {
                argument: "text".into(),
                kind: "equals"
            },
            others: 1
        }
    );
}

#[test]
fn the_outlook_says_rule_denied_or_nothing_per_session() {
    let mut allow = rule("a", Effect::Allow, "ev", "echo");
    allow.agent_uids = vec![65534];
    allow.max_calls_per_session = Some(1);
    allow.arguments = Some(BTreeMap::from([("text".to_owned(), Constraint::Any)]));
    let mut deny_args = rule("d1", Effect::Deny, "ev", "echo");
    deny_args.arguments = Some(BTreeMap::from([(
        "text".to_owned(),
        Constraint::Prefix("rm".into()),
    )]));
    let deny_all = rule("d2", Effect::Deny, "ev", "wipe");
    let rules = vec![allow, deny_args, deny_all];
    let o =
        |tool: &str, uid: u32, used: Used| outlook(&rules, "ev", tool, uid, None, NOW, |_| used);
    assert_eq!(o("echo", 65534, Used::default()), Outlook::Rule);
    assert_eq!(o("echo", 0, Used::default()), Outlook::NoRule);
    assert_eq!(
        o("echo", 65534, Used { run: 0, session: 1 }),
        Outlook::NoRule
    );
    assert_eq!(o("wipe", 65534, Used::default()), Outlook::Denied);
    assert_eq!(o("other", 65534, Used::default()), Outlook::NoRule);
}

#[test]
fn rules_that_can_never_match_are_found() {
    let config = Config::parse(
        br#"{
  "schema_version": 2,
  "mcp_servers": [
    {"name": "ev", "command": "/bin/ev", "tools": {"deny": ["wipe"]},
     "policy": {"tools": {"locked": []}}},
    {"name": "closed", "command": "/bin/c", "policy": {"capabilities": ["read_only"]}}
  ],
  "approvals": {"rules": [
    {"id": "ok", "effect": "allow", "server": "ev", "tool": "echo"},
    {"id": "gone", "effect": "allow", "server": "nope", "tool": "echo"},
    {"id": "filtered", "effect": "allow", "server": "ev", "tool": "wipe"},
    {"id": "locked", "effect": "allow", "server": "ev", "tool": "locked"},
    {"id": "old", "effect": "allow", "server": "ev", "tool": "echo", "expires": "2020-01-01T00:00:00Z"},
    {"id": "child", "effect": "allow", "server": "ev", "tool": "resources/read",
     "agent_identities": ["1111111111111111111111111111111111111111111111111111111111111111"]},
    {"id": "reads", "effect": "allow", "server": "closed", "tool": "prompts/get"},
    {"id": "block", "effect": "deny", "server": "ev", "tool": "add", "agent_uids": [65534]},
    {"id": "shadowed", "effect": "allow", "server": "ev", "tool": "add", "agent_uids": [65534]},
    {"id": "not-shadowed", "effect": "allow", "server": "ev", "tool": "add"}
  ]}
}"#,
    )
    .unwrap();
    let found: Vec<(String, &'static str)> = check(&config, NOW)
        .into_iter()
        .map(|(id, f)| (id.as_str().to_owned(), f.code()))
        .collect();
    let want: Vec<(String, &'static str)> = [
        ("gone", "unknown_server"),
        ("filtered", "hidden_by_policy"),
        ("locked", "hidden_by_policy"),
        ("old", "expired"),
        ("child", "identity_never_calls"),
        ("reads", "reads_not_offered"),
        ("shadowed", "shadowed_by_deny"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_owned(), b))
    .collect();
    assert_eq!(found, want);

    // Against a catalog: a tool the server does not list, an argument its schema lacks.
    let schema = json!({"type": "object", "properties": {"text": {"type": "string"}}});
    let catalog = [("echo", &schema)];
    let mut r = rule("r", Effect::Allow, "ev", "echo");
    r.arguments = Some(BTreeMap::from([
        ("text".to_owned(), Constraint::Any),
        ("txet".to_owned(), Constraint::Any),
    ]));
    assert_eq!(
        check_catalog(&r, catalog.iter().map(|(n, s)| (*n, *s))),
        vec![Finding::NoSuchArgument("txet".into())]
    );
    let other = rule("o", Effect::Allow, "ev", "ohce");
    assert_eq!(
        check_catalog(&other, catalog.iter().map(|(n, s)| (*n, *s))),
        vec![Finding::NotListed]
    );
    let mut read = rule("rd", Effect::Allow, "ev", "resources/read");
    read.arguments = Some(BTreeMap::from([
        ("uri".to_owned(), Constraint::Prefix("file:///w/".into())),
        ("path".to_owned(), Constraint::Any),
    ]));
    assert_eq!(
        check_catalog(&read, std::iter::empty()),
        vec![Finding::NoSuchArgument("path".into())]
    );
}

// ---------------------------------------------------------------------------------------------
// The property: no rule ever approves (or denies) a call that violates one of its constraints,
// checked against an oracle written independently of `miss`.

const KEYS: [&str; 4] = ["x", "y", "z", "w"];

fn arb_scalar() -> impl Strategy<Value = Scalar> {
    prop_oneof![
        prop::sample::select(vec!["", "a", "ab", "b", "/w/", "/w/x"])
            .prop_map(|s| Scalar::String(s.into())),
        (-3i64..13).prop_map(Scalar::Integer),
        any::<bool>().prop_map(Scalar::Bool),
    ]
}

fn arb_constraint() -> impl Strategy<Value = Constraint> {
    prop_oneof![
        Just(Constraint::Any),
        arb_scalar().prop_map(Constraint::Equals),
        prop::collection::vec(arb_scalar(), 1..4).prop_map(|mut v| {
            // Duplicate values are a schema error.
            let mut seen = Vec::new();
            v.retain(|x| {
                let fresh = !seen.contains(x);
                seen.push(x.clone());
                fresh
            });
            Constraint::OneOf(v)
        }),
        // An empty prefix is a schema error (it would accept every string).
        prop::sample::select(vec!["a", "/w/"]).prop_map(|p| Constraint::Prefix(p.into())),
        (-3i64..13, 0i64..8).prop_map(|(min, w)| Constraint::Range { min, max: min + w }),
    ]
}

fn arb_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec!["", "a", "ab", "b", "/w/", "/w/x", "A"]).prop_map(Value::from),
        (-4i64..14).prop_map(Value::from),
        any::<bool>().prop_map(Value::from),
        Just(Value::Null),
        Just(json!(1.0)),
        Just(json!(5.5)),
        Just(json!(u64::MAX)),
        Just(json!(["a"])),
        Just(json!({"a": 1})),
    ]
}

fn arb_rule(i: usize) -> impl Strategy<Value = Rule> {
    (
        any::<bool>(),
        prop::sample::select(vec!["s", "t"]),
        prop::sample::select(vec!["echo", "add"]),
        prop::option::of(prop::collection::btree_map(
            prop::sample::select(KEYS.to_vec()).prop_map(str::to_owned),
            arb_constraint(),
            0..3,
        )),
        prop::option::of(0usize..2),
        prop::sample::subsequence(UIDS.to_vec(), 0..=3),
        prop::sample::subsequence(vec![0usize, 1], 0..=2),
        prop::option::of(1u64..4),
        prop::option::of(1u64..4),
        prop::option::of(prop::bool::ANY),
    )
        .prop_map(
            move |(allow, server, tool, arguments, dig, uids, ids, run, session, expired)| {
                let effect = if allow { Effect::Allow } else { Effect::Deny };
                let mut r = rule(&format!("r{i}"), effect, server, tool);
                r.arguments = arguments;
                r.args_sha256 = dig.map(digest);
                r.agent_uids = uids;
                r.agent_identities = ids.into_iter().map(digest).collect();
                if allow {
                    r.max_calls_per_run = run;
                    r.max_calls_per_session = session;
                }
                r.expires = expired.map(|past| {
                    Expiry::parse(if past {
                        "2020-01-01T00:00:00Z"
                    } else {
                        "2099-01-01T00:00:00Z"
                    })
                    .unwrap()
                });
                r
            },
        )
}

fn arb_rules() -> impl Strategy<Value = Vec<Rule>> {
    (0usize..6).prop_flat_map(|n| (0..n).map(arb_rule).collect::<Vec<_>>())
}

/// A value that satisfies `c` (so that generated calls reach approvals often).
fn satisfying(c: &Constraint) -> BoxedStrategy<Value> {
    match c {
        Constraint::Any => arb_value().boxed(),
        Constraint::Equals(s) => Just(serde_json::to_value(s).unwrap()).boxed(),
        Constraint::OneOf(all) => prop::sample::select(all.clone())
            .prop_map(|s| serde_json::to_value(s).unwrap())
            .boxed(),
        Constraint::Prefix(p) => {
            let p = p.clone();
            prop::sample::select(vec!["", "x", "/../etc"])
                .prop_map(move |tail| Value::from(format!("{p}{tail}")))
                .boxed()
        }
        Constraint::Range { min, max } => (*min..=*max).prop_map(Value::from).boxed(),
    }
}

/// Which digest, uid and identity the call has.
type Who = (usize, u32, Option<usize>);
type Case = (
    Vec<Rule>,
    &'static str,
    &'static str,
    BTreeMap<String, Value>,
    Who,
);

fn arb_who() -> impl Strategy<Value = Who> {
    (
        0usize..2,
        prop::sample::select(UIDS.to_vec()),
        prop::option::of(0usize..2),
    )
}

/// Rules and a call: half the time aimed at one of the rules (its server and tool, arguments
/// that meet its argument constraints, sometimes with one more argument, and mostly a digest,
/// uid and identity it allows), otherwise anywhere.
fn arb_case() -> impl Strategy<Value = Case> {
    arb_rules().prop_flat_map(|rules| {
        let random = || {
            (
                prop::sample::select(vec!["s", "t"]),
                prop::sample::select(vec!["echo", "add"]),
                prop::collection::btree_map(
                    prop::sample::select(KEYS.to_vec()).prop_map(str::to_owned),
                    arb_value(),
                    0..4,
                ),
            )
        };
        let anywhere = {
            let rules = rules.clone();
            (random(), arb_who())
                .prop_map(move |((s, t, a), who)| (rules.clone(), s, t, a, who))
                .boxed()
        };
        if rules.is_empty() {
            return anywhere;
        }
        let aimed = (
            any::<prop::sample::Index>(),
            any::<bool>(),
            arb_value(),
            arb_who(),
            any::<bool>(),
        )
            .prop_flat_map(move |(pick, extra, noise, random_who, fit)| {
                let r = pick.get(&rules).clone();
                let server: &'static str = if r.server.as_str() == "s" { "s" } else { "t" };
                let tool: &'static str = if r.tool.as_str() == "echo" {
                    "echo"
                } else {
                    "add"
                };
                let rules = rules.clone();
                let args: BoxedStrategy<BTreeMap<String, Value>> = match &r.arguments {
                    None => random().prop_map(|(_, _, a)| a).boxed(),
                    Some(named) => {
                        let parts: Vec<BoxedStrategy<(String, Value)>> = named
                            .iter()
                            .map(|(k, c)| {
                                let k = k.clone();
                                satisfying(c).prop_map(move |v| (k.clone(), v)).boxed()
                            })
                            .collect();
                        parts
                            .prop_map(move |kv| {
                                let mut m: BTreeMap<String, Value> = kv.into_iter().collect();
                                if extra {
                                    m.insert("w".into(), noise.clone());
                                }
                                m
                            })
                            .boxed()
                    }
                };
                let who = if fit {
                    let dig = r
                        .args_sha256
                        .as_ref()
                        .and_then(|d| DIGESTS.iter().position(|x| *x == d.as_str()))
                        .unwrap_or(random_who.0);
                    let uid = r.agent_uids.first().copied().unwrap_or(random_who.1);
                    let identity = match r.agent_identities.first() {
                        Some(i) => DIGESTS.iter().position(|x| *x == i.as_str()),
                        None => random_who.2,
                    };
                    (dig, uid, identity)
                } else {
                    random_who
                };
                args.prop_map(move |a| (rules.clone(), server, tool, a, who))
            });
        prop_oneof![anywhere, aimed.boxed()].boxed()
    })
}

/// The oracle: does `v` satisfy `c`? Compared through JSON values, not through `Scalar::matches`.
fn oracle_holds(c: &Constraint, v: &Value) -> bool {
    let exact = |s: &Scalar| serde_json::to_value(s).unwrap() == *v;
    match c {
        Constraint::Any => true,
        Constraint::Equals(s) => exact(s),
        Constraint::OneOf(all) => all.iter().any(exact),
        Constraint::Prefix(p) => v
            .as_str()
            .is_some_and(|s| s.as_bytes().starts_with(p.as_bytes())),
        Constraint::Range { min, max } => {
            v.is_i64() && v.as_i64().is_some_and(|n| *min <= n && n <= *max)
        }
    }
}

/// Every constraint of `r` holds for the call (counts included for allow rules).
fn oracle_matches(r: &Rule, call: &CallFacts<'_>, used: Used) -> bool {
    let named_ok = match &r.arguments {
        None => true,
        Some(named) => {
            let mut call_keys: Vec<&String> = call.arguments.keys().collect();
            call_keys.sort();
            let rule_keys: Vec<&String> = named.keys().collect();
            call_keys == rule_keys
                && named
                    .iter()
                    .all(|(k, c)| oracle_holds(c, &call.arguments[k.as_str()]))
        }
    };
    let counts_ok = r.effect == Effect::Deny
        || (r.max_calls_per_run.is_none_or(|m| used.run < m)
            && r.max_calls_per_session.is_none_or(|m| used.session < m));
    r.server.as_str() == call.server
        && r.tool.as_str() == call.tool
        && r.expires.as_ref().is_none_or(|e| call.now < e.unix())
        && (r.agent_uids.is_empty() || r.agent_uids.contains(&call.uid))
        && (r.agent_identities.is_empty()
            || call
                .identity
                .is_some_and(|i| r.agent_identities.iter().any(|d| d.as_str() == i)))
        && r.args_sha256
            .as_ref()
            .is_none_or(|d| d.as_str() == call.args_sha256)
        && named_ok
        && counts_ok
}

/// Random cases the property is checked on.
const CASES: u32 = 4096;

#[test]
fn no_rule_approves_or_denies_a_call_that_violates_one_of_its_constraints() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(CASES));
    let strategy = (arb_case(), prop::collection::vec((0u64..5, 0u64..5), 6)).prop_map(
        |((rules, server, tool, arguments, (dig, uid, identity)), used)| {
            (rules, server, tool, arguments, dig, uid, identity, used)
        },
    );
    let approvals = std::cell::Cell::new(0u32);
    runner
        .run(
            &strategy,
            |(rules, server, tool, arguments, dig, uid, identity, used)| {
                let arguments: Map<String, Value> = arguments.into_iter().collect();
                let call = CallFacts {
                    server,
                    tool,
                    arguments: &arguments,
                    args_sha256: DIGESTS[dig],
                    uid,
                    identity: identity.map(|i| DIGESTS[i]),
                    now: NOW,
                };
                let used_of = |r: &Rule| {
                    let i: usize = r.id.as_str()[1..].parse().unwrap();
                    Used {
                        run: used[i].0,
                        session: used[i].1,
                    }
                };
                let any_deny = rules
                    .iter()
                    .any(|r| r.effect == Effect::Deny && oracle_matches(r, &call, used_of(r)));
                let first_allow = rules
                    .iter()
                    .find(|r| r.effect == Effect::Allow && oracle_matches(r, &call, used_of(r)));
                match decide(&rules, &call, used_of) {
                    Ruling::Approve(r) => {
                        approvals.set(approvals.get() + 1);
                        prop_assert_eq!(r.effect, Effect::Allow);
                        prop_assert!(oracle_matches(r, &call, used_of(r)), "approved by {:?}", r);
                        prop_assert!(!any_deny, "approved although a deny rule matched");
                        prop_assert_eq!(Some(r), first_allow);
                    }
                    Ruling::Deny(r) => {
                        prop_assert_eq!(r.effect, Effect::Deny);
                        prop_assert!(oracle_matches(r, &call, used_of(r)), "denied by {:?}", r);
                    }
                    Ruling::Unmatched { rule, others, .. } => {
                        prop_assert!(!any_deny && first_allow.is_none());
                        prop_assert!(rule.covers(server, tool) && rule.effect == Effect::Allow);
                        let covering = rules
                            .iter()
                            .filter(|r| r.effect == Effect::Allow && r.covers(server, tool))
                            .count();
                        prop_assert_eq!(others + 1, covering);
                    }
                    Ruling::NoRule => {
                        prop_assert!(!any_deny && first_allow.is_none());
                        prop_assert!(
                            !rules
                                .iter()
                                .any(|r| r.effect == Effect::Allow && r.covers(server, tool))
                        );
                    }
                }
                // What `miss` reports is exactly the oracle's verdict, rule by rule.
                for r in &rules {
                    let u = used_of(r);
                    if r.covers(server, tool) {
                        prop_assert_eq!(miss(r, &call, u).is_none(), oracle_matches(r, &call, u));
                    }
                }
                Ok(())
            },
        )
        .unwrap();
    // The generators must reach approvals, or the property says little.
    assert!(
        approvals.get() > CASES / 50,
        "{} approvals",
        approvals.get()
    );
    iteron_test_support::record!("P15", json!({"cases": CASES, "approvals": approvals.get()}),);
}

proptest! {
    #[test]
    fn a_rule_round_trips_through_the_configuration_file(rules in arb_rules()) {
        let mut config = Config::default();
        // Unique ids are a schema rule; arb_rules numbers them.
        config.approvals.rules = rules;
        config.approvals.deferred_secs = Some(30);
        let back = Config::parse(config.to_json_pretty().as_bytes()).unwrap();
        prop_assert_eq!(&back, &config);
        for (a, b) in back.approvals.rules.iter().zip(&config.approvals.rules) {
            prop_assert_eq!(a.digest(), b.digest());
        }
    }
}
