use super::*;

fn info() -> CallInfo {
    CallInfo {
        session: "s1".into(),
        peer_uid: 1000,
        peer_pid: Some(7),
        server: "srv".into(),
        tool: "t".into(),
        args_sha256: "00".into(),
        arguments: Arguments::from_canonical(Arc::from("{}")),
    }
}

async fn settle(a: &Approvals, n: usize) {
    for _ in 0..1000 {
        if a.list().len() == n {
            return;
        }
        tokio::task::yield_now().await;
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

#[test]
fn noninteractive_refuses_at_once_and_offers_no_forms() {
    let a = Approvals::new(false, DEFAULT_DEADLINE);
    assert_eq!(
        rt().block_on(a.approve_call(info())),
        Err(NotApproved::Noninteractive)
    );
    assert!(a.elicitor("srv", Arc::default()).is_none());
    assert!(a.list().is_empty());
}

#[test]
fn a_parked_call_is_approved_only_by_its_id_and_digest_within_its_time() {
    rt().block_on(async {
        let a = Approvals::new(false, DEFAULT_DEADLINE);
        let digest = "ab".repeat(32);
        let call = CallInfo {
            args_sha256: digest.clone(),
            ..info()
        };
        // Not parked: a noninteractive broker refuses at once.
        assert_eq!(
            a.approve_or_park(call.clone(), None).await,
            Err(NotApproved::Noninteractive)
        );
        let (item, waiter) = {
            let a2 = Arc::clone(&a);
            let c = call.clone();
            let w =
                tokio::spawn(
                    async move { a2.approve_or_park(c, Some(Duration::from_secs(5))).await },
                );
            settle(&a, 1).await;
            (a.list()[0].clone(), w)
        };
        assert_eq!(item["deferred"], true);
        assert_eq!(item["args_sha256"], digest.as_str());
        let id = item["id"].as_u64().unwrap();
        assert_eq!(a.decide_checked(id, true, None), Decided::DigestRequired);
        assert!(!a.decide(id, true));
        let wrong = "cd".repeat(32);
        assert_eq!(
            a.decide_checked(id, true, Some(&wrong)),
            Decided::DigestMismatch
        );
        assert_eq!(
            a.list().len(),
            1,
            "a refused decide leaves the call waiting"
        );
        assert_eq!(
            a.decide_checked(id + 1, true, Some(&digest)),
            Decided::NotWaiting
        );
        assert_eq!(a.decide_checked(id, true, Some(&digest)), Decided::Done);
        assert_eq!(waiter.await.unwrap(), Ok(()));

        // Denying a parked call needs no digest.
        let a2 = Arc::clone(&a);
        let c = call.clone();
        let waiter =
            tokio::spawn(async move { a2.approve_or_park(c, Some(Duration::from_secs(5))).await });
        settle(&a, 1).await;
        let id = a.list()[0]["id"].as_u64().unwrap();
        assert_eq!(a.decide_checked(id, false, None), Decided::Done);
        assert_eq!(waiter.await.unwrap(), Err(NotApproved::Denied));

        // Parked for a bounded time: unanswered, it is refused and leaves the list.
        assert_eq!(
            a.approve_or_park(call, Some(Duration::from_millis(30)))
                .await,
            Err(NotApproved::TimedOut)
        );
        assert!(a.list().is_empty());
        // Forms are still refused by a noninteractive broker.
        assert!(a.elicitor("srv", Arc::default()).is_none());
    });
    iteron_test_support::record!("P15", json!({}),);
}

#[test]
fn approve_deny_timeout_and_abandon() {
    rt().block_on(async {
        let a = Approvals::new(true, Duration::from_secs(5));
        let a2 = Arc::clone(&a);
        let waiter = tokio::spawn(async move { a2.approve_call(info()).await });
        settle(&a, 1).await;
        let id = a.list()[0]["id"].as_u64().unwrap();
        assert!(!a.decide(id + 100, true));
        assert!(a.decide(id, true));
        assert_eq!(waiter.await.unwrap(), Ok(()));
        assert!(a.list().is_empty());

        let a2 = Arc::clone(&a);
        let waiter = tokio::spawn(async move { a2.approve_call(info()).await });
        settle(&a, 1).await;
        let id = a.list()[0]["id"].as_u64().unwrap();
        assert!(a.decide(id, false));
        assert_eq!(waiter.await.unwrap(), Err(NotApproved::Denied));

        // The requester goes away: the item disappears.
        let a2 = Arc::clone(&a);
        let waiter = tokio::spawn(async move { a2.approve_call(info()).await });
        settle(&a, 1).await;
        assert_eq!(a.list().len(), 1);
        waiter.abort();
        let _ = waiter.await;
        settle(&a, 0).await;
        assert!(a.list().is_empty());

        let quick = Approvals::new(true, Duration::from_millis(20));
        assert_eq!(quick.approve_call(info()).await, Err(NotApproved::TimedOut));
        assert!(quick.list().is_empty());
    });
}

fn call_with(arguments: Value) -> CallInfo {
    let Value::Object(map) = arguments else {
        panic!("arguments are an object");
    };
    CallInfo {
        arguments: preview(&map),
        ..info()
    }
}

/// Wait for one call to be listed, then return it and its requester.
async fn one_waiting(
    a: &Arc<Approvals>,
    call: CallInfo,
) -> (Value, tokio::task::JoinHandle<Result<(), NotApproved>>) {
    let a2 = Arc::clone(a);
    let waiter = tokio::spawn(async move { a2.approve_call(call).await });
    settle(a, 1).await;
    (a.list()[0].clone(), waiter)
}

#[test]
fn a_preview_never_claims_to_be_whole_when_it_is_not() {
    rt().block_on(async {
        let a = Approvals::new(true, Duration::from_secs(5));
        // 17.4: 600 RLOs are 1,800 bytes raw but 4,800 escaped, so the target path fell
        // past the 4 KiB preview while `arguments_cut` (raw size > preview size) said false.
        let hidden = "\u{202e}".repeat(600);
        let (item, waiter) = one_waiting(
            &a,
            call_with(json!({"path": "/home/op/.ssh/id_ed25519", "pad": hidden})),
        )
        .await;
        let shown = item["arguments"].as_str().unwrap();
        assert!(item["arguments_bytes"].as_u64().unwrap() < MAX_PREVIEW as u64);
        assert!(!shown.contains("id_ed25519"), "{shown}");
        assert_eq!(item["arguments_cut"], true);
        // Keys are sorted (canonical JSON): "pad" comes first and hides "path".
        let full =
            r#"{"pad":""#.len() + hidden.len() + r#"","path":"/home/op/.ssh/id_ed25519"}"#.len();
        assert_eq!(item["arguments_bytes"], full);
        let omitted = item["arguments_omitted"].as_u64().unwrap() as usize;
        let whole = a.show(item["id"].as_u64().unwrap(), 0).unwrap();
        let text = whole["arguments"].as_str().unwrap();
        assert_eq!(text.len(), full);
        assert!(text.ends_with(r#""path":"/home/op/.ssh/id_ed25519"}"#));
        assert_eq!(
            shown.strip_suffix('\u{2026}').unwrap(),
            text::escape_capped(&text[..full - omitted], usize::MAX)
        );
        assert_eq!(
            crate::audit::sha256_hex(text.as_bytes()),
            crate::audit::sha256_hex(&crate::audit::canonical_json(
                &json!({"path": "/home/op/.ssh/id_ed25519", "pad": hidden})
            ))
        );
        assert!(whole["next_offset"].is_null());
        a.close();
        let _ = waiter.await;

        // Whole previews say so, at the limit exactly; one byte more is cut by one byte
        // plus the room the ellipsis takes.
        let a = Approvals::new(true, Duration::from_secs(5));
        let frame = r#"{"a":""}"#.len();
        let (item, waiter) =
            one_waiting(&a, call_with(json!({"a": "x".repeat(MAX_PREVIEW - frame)}))).await;
        assert_eq!(item["arguments_cut"], false);
        assert_eq!(item["arguments_omitted"], 0);
        assert_eq!(item["arguments"].as_str().unwrap().len(), MAX_PREVIEW);
        a.close();
        let _ = waiter.await;
        let a = Approvals::new(true, Duration::from_secs(5));
        let (item, waiter) = one_waiting(
            &a,
            call_with(json!({"a": "x".repeat(MAX_PREVIEW - frame + 1)})),
        )
        .await;
        assert_eq!(item["arguments_cut"], true);
        assert_eq!(item["arguments_omitted"], 1 + '\u{2026}'.len_utf8());
        assert_eq!(item["arguments"].as_str().unwrap().len(), MAX_PREVIEW);
        a.close();
        let _ = waiter.await;
    });
    iteron_test_support::record!("P14", json!({"max_preview": MAX_PREVIEW}),);
}

#[test]
fn show_gives_the_whole_arguments_in_bounded_chunks() {
    rt().block_on(async {
        let a = Approvals::new(true, Duration::from_secs(5));
        // Multi-byte characters straddle the chunk edges; quotes double when the chunk is
        // written as a JSON string.
        let big = "é\"".repeat(SHOW_CHUNK / 2);
        let args = json!({"b": big, "z": "end"});
        let (item, waiter) = one_waiting(&a, call_with(args.clone())).await;
        let id = item["id"].as_u64().unwrap();
        let mut text = String::new();
        let mut offset = 0;
        let mut answers = 0;
        loop {
            let part = a.show(id, offset).unwrap();
            answers += 1;
            assert_eq!(part["offset"], offset);
            assert_eq!(part["server"], "srv");
            assert_eq!(part["session"], "s1");
            assert_eq!(part["peer_uid"], 1000);
            assert_eq!(part["peer_pid"], 7);
            assert_eq!(part["args_sha256"], "00");
            let chunk = part["arguments"].as_str().unwrap();
            assert!(chunk.len() <= SHOW_CHUNK);
            assert!(serde_json::to_vec(&part).unwrap().len() < 2 * SHOW_CHUNK + 1024);
            text.push_str(chunk);
            match part["next_offset"].as_u64() {
                Some(n) => {
                    assert_eq!(n as usize, offset + chunk.len());
                    offset = n as usize;
                }
                None => break,
            }
        }
        assert!(answers >= 3);
        assert_eq!(text.as_bytes(), crate::audit::canonical_json(&args));
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), args);
        // An offset inside a character or past the end is refused; an unknown id, a form
        // or a decided call is not found.
        let inside = text.find('é').unwrap() + 1;
        assert!(matches!(
            a.show(id, inside),
            Err(ShowError::BadOffset { offset, .. }) if offset == inside
        ));
        assert!(matches!(
            a.show(id, text.len() + 1),
            Err(ShowError::BadOffset { .. })
        ));
        assert_eq!(a.show(id + 1, 0).unwrap_err(), ShowError::NotWaiting);
        assert!(a.decide(id, false));
        assert_eq!(a.show(id, 0).unwrap_err(), ShowError::NotWaiting);
        assert_eq!(waiter.await.unwrap(), Err(NotApproved::Denied));
    });
    iteron_test_support::record!("P14", json!({"chunk": SHOW_CHUNK}),);
}

#[test]
fn the_queue_is_bounded() {
    rt().block_on(async {
        let a = Approvals::new(true, Duration::from_secs(5));
        let mut waiters = Vec::new();
        for _ in 0..MAX_PENDING {
            let a2 = Arc::clone(&a);
            waiters.push(tokio::spawn(async move { a2.approve_call(info()).await }));
        }
        for _ in 0..1000 {
            if a.list().len() == MAX_PENDING {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(a.list().len(), MAX_PENDING);
        assert_eq!(a.approve_call(info()).await, Err(NotApproved::Full));
        a.close();
        for w in waiters {
            assert_eq!(w.await.unwrap(), Err(NotApproved::ShuttingDown));
        }
    });
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

#[test]
fn forms_have_their_own_smaller_share() {
    rt().block_on(async {
        let a = Approvals::new(true, Duration::from_secs(5));
        let calls = Arc::new(CallsInFlight::default());
        let _running = calls.begin(context());
        let el = a.elicitor("srv", calls).unwrap();
        let schema = json!({"type":"object","properties":{}});
        let mut asks = Vec::new();
        for _ in 0..MAX_PENDING_FORMS {
            asks.push(tokio::spawn(el.ask(FormRequest {
                message: "m".into(),
                schema: schema.clone(),
            })));
        }
        settle(&a, MAX_PENDING_FORMS).await;
        // One more form is cancelled at once; calls still have room.
        let extra = el
            .ask(FormRequest {
                message: "m".into(),
                schema: schema.clone(),
            })
            .await;
        assert_eq!(extra, FormAnswer::Cancel);
        let a2 = Arc::clone(&a);
        let call = tokio::spawn(async move { a2.approve_call(info()).await });
        settle(&a, MAX_PENDING_FORMS + 1).await;
        a.close();
        let _ = call.await;
        for t in asks {
            let _ = t.await;
        }
    });
}

#[test]
fn forms_are_checked_against_their_schema() {
    rt().block_on(async {
        let a = Approvals::new(true, Duration::from_secs(5));
        let calls = Arc::new(CallsInFlight::default());
        let _running = calls.begin(context());
        let el = a.elicitor("srv", calls).unwrap();
        let schema =
            json!({"type":"object","properties":{"name":{"type":"string"}},"required":["name"]});
        let ask = tokio::spawn(el.ask(FormRequest {
            message: "who?\u{202e}".into(),
            schema,
        }));
        settle(&a, 1).await;
        let listed = a.list();
        assert_eq!(listed[0]["kind"], "form");
        assert_eq!(
            listed[0]["during"],
            json!([{"session": "s1", "peer_uid": 1000, "tool": "t"}])
        );
        assert!(!listed[0]["message"].as_str().unwrap().contains('\u{202e}'));
        let id = listed[0]["id"].as_u64().unwrap();
        let mut wrong = Map::new();
        wrong.insert("name".into(), json!(5));
        assert!(a.answer(id, FormAnswer::Accept(wrong)).is_err());
        let mut right = Map::new();
        right.insert("name".into(), json!("op"));
        a.answer(id, FormAnswer::Accept(right.clone())).unwrap();
        assert_eq!(ask.await.unwrap(), FormAnswer::Accept(right));
    });
}

fn context() -> CallContext {
    CallContext {
        session: "s1".into(),
        peer_uid: 1000,
        tool: "t".into(),
    }
}

/// A form that comes while no approved call runs on its server never reaches the operator
/// (declined at once); one that comes during a call names it, and is not asked once the
/// call has ended.
#[test]
fn a_form_reaches_the_operator_only_during_a_call_it_names() {
    rt().block_on(async {
        let a = Approvals::new(true, Duration::from_secs(5));
        let calls = Arc::new(CallsInFlight::default());
        let el = a.elicitor("srv", Arc::clone(&calls)).unwrap();
        let form = || FormRequest {
            message: "m".into(),
            schema: json!({"type":"object","properties":{}}),
        };
        assert_eq!(el.ask(form()).await, FormAnswer::Decline);
        assert!(a.list().is_empty(), "never shown");
        let running = calls.begin(context());
        let ask = tokio::spawn(el.ask(form()));
        settle(&a, 1).await;
        assert_eq!(a.list()[0]["during"][0]["tool"], "t");
        let id = a.list()[0]["id"].as_u64().unwrap();
        a.answer(id, FormAnswer::Decline).unwrap();
        assert_eq!(ask.await.unwrap(), FormAnswer::Decline);
        drop(running);
        assert!(calls.now().is_empty());
        assert_eq!(el.ask(form()).await, FormAnswer::Decline);
        assert!(a.list().is_empty());
    });
    iteron_test_support::record!("P14", serde_json::json!({}),);
}
