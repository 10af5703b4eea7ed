//! Unit tests of the daemon's pure pieces and bounds.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::arguments::{ArgumentBudget, charge_step, json_nodes};
use super::connection::write_answers;
use super::listen::refused_step;
use super::listing::{exact, join_bounded, valid_name, valid_uri};
use super::project::{cut_escaped, project_contents, project_prompt};
use super::*;
use crate::ipc::{frame, proto};
use crate::servers::KnownSecrets;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn results_are_cut_by_their_escaped_size_at_the_limit_and_one_over() {
    let mut exact = "a".repeat(MAX_RESULT_TEXT);
    assert!(!cut_escaped(&mut exact, MAX_RESULT_TEXT));
    assert_eq!(exact.len(), MAX_RESULT_TEXT);
    let mut over = "a".repeat(MAX_RESULT_TEXT + 1);
    assert!(cut_escaped(&mut over, MAX_RESULT_TEXT));
    assert_eq!(over.len(), MAX_RESULT_TEXT);
    // Escapes count as they are sent: a control character is six bytes, a quote two.
    let mut ctl = format!("{}\u{1}", "a".repeat(MAX_RESULT_TEXT - 6));
    assert!(!cut_escaped(&mut ctl, MAX_RESULT_TEXT));
    let mut ctl = format!("{}\u{1}", "a".repeat(MAX_RESULT_TEXT - 5));
    assert!(cut_escaped(&mut ctl, MAX_RESULT_TEXT));
    assert_eq!(ctl.len(), MAX_RESULT_TEXT - 5);
    // Never inside a character.
    let mut wide = "é".repeat(MAX_RESULT_TEXT / 2 + 1);
    assert!(cut_escaped(&mut wide, MAX_RESULT_TEXT));
    assert_eq!(wide.len(), MAX_RESULT_TEXT);
    iteron_test_support::record!(
        "P5",
        serde_json::json!({"max_result_text": MAX_RESULT_TEXT}),
    );
}

fn canary_secrets() -> KnownSecrets {
    let learned = crate::servers::LearnedSecrets::default();
    assert!(learned.learn("canary-5e1f0a"));
    KnownSecrets::default().with_learned(learned)
}

#[test]
fn read_answers_are_bounded_scrubbed_and_never_echo_a_server_type() {
    let secrets = canary_secrets();
    // 1000 contents with the longest URIs and big texts: the answer stays in a frame.
    let long_uri = format!("demo://{}", "u".repeat(2040));
    let contents: Vec<Value> = (0..1200)
        .map(|i| json!({"uri": long_uri, "mimeType": "text/plain", "text": format!("{i} canary-5e1f0a {}", "t".repeat(4000))}))
        .collect();
    let v = project_contents(&json!({"contents": contents}), &secrets);
    let size = serde_json::to_vec(&v).unwrap().len();
    assert!(size <= MAX_RESULT_TEXT + 4096, "{size}");
    assert!(size <= frame::MAX_FRAME);
    assert!(!v.to_string().contains("canary-5e1f0a"));
    assert!(v["notes"].to_string().contains("cut"), "{}", v["notes"]);
    // A prompt: unknown content types are named in a fixed vocabulary.
    let v = project_prompt(
        &json!({"description": "d canary-5e1f0a", "messages": [
            {"role": "user", "content": {"type": "text", "text": "hello canary-5e1f0a"}},
            {"role": "user", "content": {"type": "canary-5e1f0a-evil\u{1b}[2J"}},
            {"role": "system", "content": {"type": "text", "text": "x"}},
            {"role": "assistant", "content": {"type": "image", "data": "AAAA"}}
        ]}),
        &secrets,
    );
    let shown = v.to_string();
    assert!(
        !shown.contains("canary") && !shown.contains("evil"),
        "{shown}"
    );
    assert_eq!(v["messages"].as_array().unwrap().len(), 1);
    assert_eq!(v["messages"][0]["text"], "hello [REDACTED]");
    let notes: Vec<&str> = v["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert_eq!(
        notes,
        [
            "a non-text content was left out",
            "a message with an unknown role was left out",
            "an image content was left out"
        ]
    );
}

/// Server answers shaped like `resources/read` and `prompts/get`: arbitrary strings where
/// the fields go, the configured secret planted in some of them (in every field that can
/// reach the agent), and arbitrary JSON in places.
fn arb_server_answer() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let text = || {
        prop_oneof![
            any::<String>(),
            any::<String>().prop_map(|s| format!("{s}canary-5e1f0a{s}")),
        ]
    };
    let content = (
        prop_oneof![Just("text"), Just("resource"), Just("image"), Just("x")],
        text(),
    )
        .prop_map(
            |(kind, t)| json!({"type": kind, "text": t, "resource": {"text": t}, "data": "AAAA"}),
        );
    let message = (
        prop_oneof![Just("user"), Just("assistant"), Just("system")],
        content,
    )
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    let item = (text(), text(), text(), any::<bool>()).prop_map(|(uri, mime, t, blob)| {
        if blob {
            json!({"uri": uri, "mimeType": mime, "blob": t})
        } else {
            json!({"uri": uri, "mimeType": mime, "text": t})
        }
    });
    (
        prop::collection::vec(item, 0..6),
        prop::collection::vec(message, 0..6),
        text(),
        any::<i64>(),
    )
        .prop_map(|(contents, messages, description, n)| {
            json!({"contents": contents, "messages": messages, "description": description, "noise": n})
        })
}

/// Any server answer, projected as a resource read or a prompt: never a panic, never the
/// configured secret, always within the answer's bound; names passed back exactly are
/// always usable. Counted for the security report.
#[test]
fn projections_fuzzed_record() {
    let secrets = canary_secrets();
    let mut runner =
        proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(512));
    let executions = std::cell::Cell::new(0u64);
    let redacted = std::cell::Cell::new(0u64);
    runner
        .run(&arb_server_answer(), |v| {
            executions.set(executions.get() + 1);
            for out in [project_contents(&v, &secrets), project_prompt(&v, &secrets)] {
                let shown = out.to_string();
                proptest::prop_assert!(!shown.contains("canary-5e1f0a"));
                proptest::prop_assert!(shown.len() <= MAX_RESULT_TEXT + 64 * 1024);
                if shown.contains("[REDACTED]") {
                    redacted.set(redacted.get() + 1);
                }
            }
            for item in v["contents"].as_array().into_iter().flatten() {
                if let Some(x) = exact(item, "uri", valid_uri, &secrets) {
                    proptest::prop_assert!(valid_uri(&x) && !x.contains("canary-5e1f0a"));
                }
            }
            Ok(())
        })
        .unwrap();
    // The secret did reach the projections (and was scrubbed) in many cases.
    assert!(redacted.get() > 50, "{}", redacted.get());
    let executions = executions.get();
    iteron_test_support::record!(
        "P10",
        serde_json::json!({"executions": executions, "crashes": 0}),
    );
}

#[test]
fn names_the_agent_sends_back_are_exact_or_left_out() {
    let secrets = canary_secrets();
    let item = |name: &str| json!({"name": name});
    let got = |name: &str| exact(&item(name), "name", valid_name, &secrets);
    assert_eq!(got("a\\b ü"), Some("a\\b ü".to_owned()));
    assert_eq!(
        got(&"n".repeat(MAX_PROMPT_NAME)),
        Some("n".repeat(MAX_PROMPT_NAME))
    );
    assert_eq!(got(&"n".repeat(MAX_PROMPT_NAME + 1)), None);
    assert_eq!(got("bell\u{7}"), None);
    assert_eq!(got(""), None);
    assert_eq!(got("has canary-5e1f0a"), None);
    let uri = |u: &str| exact(&json!({"uri": u}), "uri", valid_uri, &secrets);
    let max = format!("x://{}", "u".repeat(proto::MAX_RESOURCE_URI - 4));
    assert_eq!(uri(&max), Some(max.clone()));
    assert_eq!(uri(&format!("{max}u")), None);
}

#[test]
fn a_peer_that_stops_reading_is_given_up_after_the_write_deadline() {
    // The connection's writer runs `write_answers` with this deadline.
    assert_eq!(WRITE_DEADLINE, Duration::from_secs(30));
    let big = vec![b'x'; 64 * 1024];
    // A reader that starts draining within the deadline gets every frame (a generous
    // deadline: a loaded machine must not make this fail).
    let deadline = Duration::from_secs(3);
    rt().block_on(async {
        let (mut wr, mut rd) = tokio::io::duplex(1024);
        let (tx, mut rx) = mpsc::channel(4);
        tx.send(big.clone()).await.unwrap();
        tx.send(big.clone()).await.unwrap();
        drop(tx);
        let reader = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut got = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut rd, &mut got)
                .await
                .unwrap();
            got.len()
        });
        write_answers(&mut wr, &mut rx, deadline).await;
        drop(wr);
        assert_eq!(reader.await.unwrap(), 2 * (4 + big.len()));
    });
    // A reader that never reads: the writer stops at the deadline, leaving the rest queued.
    let deadline = Duration::from_millis(300);
    rt().block_on(async {
        let (mut wr, _rd) = tokio::io::duplex(1024);
        let (tx, mut rx) = mpsc::channel(4);
        tx.send(big.clone()).await.unwrap();
        tx.send(big.clone()).await.unwrap();
        let t = Instant::now();
        write_answers(&mut wr, &mut rx, deadline).await;
        let took = t.elapsed();
        assert!(took >= deadline, "{took:?}");
        assert!(took < deadline * 10, "{took:?}");
        assert!(rx.try_recv().is_ok(), "the second frame was not attempted");
    });
    iteron_test_support::record!(
        "P5",
        serde_json::json!({"write_deadline_s": WRITE_DEADLINE.as_secs()}),
    );
}

#[test]
fn argument_weight_is_bounded_per_uid_and_in_all_at_the_limit_and_one_over() {
    let mut w = (HashMap::new(), 0usize);
    assert!(charge_step(&mut w, 1, 10, 10, 15));
    // One over the uid's bound.
    assert!(!charge_step(&mut w, 1, 1, 10, 15));
    // Another uid, up to the total bound and one over.
    assert!(charge_step(&mut w, 2, 5, 10, 15));
    assert!(!charge_step(&mut w, 3, 1, 10, 15));
    let budget = ArgumentBudget::default();
    let a = budget.charge(7, MAX_ARGUMENT_WEIGHT_PER_UID).unwrap();
    assert!(budget.charge(7, 1).is_none());
    // A refused charge gives nothing back.
    assert_eq!(budget.lock().1, MAX_ARGUMENT_WEIGHT_PER_UID);
    drop(a);
    // Given back when the call ends.
    assert!(budget.charge(7, 1).is_some());
    assert!(budget.lock().0.is_empty());
    assert_eq!(json_nodes(&json!({"a": [{}, 1, "x"], "b": null})), 6);
    iteron_test_support::record!(
        "P5",
        serde_json::json!({"per_uid": MAX_ARGUMENT_WEIGHT_PER_UID, "total": MAX_ARGUMENT_WEIGHT}),
    );
}

#[test]
fn refused_peer_records_are_bounded_per_second_one_over() {
    let mut w = (0, 0, 0);
    for _ in 0..MAX_REFUSED_RECORDS_PER_SEC {
        assert_eq!(refused_step(&mut w, 7), (true, 0));
    }
    // One over: counted, not recorded.
    assert_eq!(refused_step(&mut w, 7), (false, 0));
    assert_eq!(refused_step(&mut w, 7), (false, 0));
    // The next second's first record carries the count.
    assert_eq!(refused_step(&mut w, 8), (true, 2));
    assert_eq!(refused_step(&mut w, 8), (true, 0));
    iteron_test_support::record!("P5", serde_json::json!({}),);
}

/// One of the listing scheduler's test futures while it is alive: counts how many are alive
/// now and the most ever alive at once.
struct Alive {
    now: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Alive {
    fn enter(
        now: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
        most: &std::sync::atomic::AtomicUsize,
    ) -> Alive {
        use std::sync::atomic::Ordering::SeqCst;
        most.fetch_max(now.fetch_add(1, SeqCst) + 1, SeqCst);
        Alive {
            now: std::sync::Arc::clone(now),
        }
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.now.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Issue 14.11: `list_tools` asks at most `MAX_LIST_PARALLEL` servers at once, in order, each
/// deadline starting with its turn: at the limit one round, one over two rounds (not one per
/// server); its whole bound answers with what is done and drops what is not, so whatever those
/// were starting is stopped.
#[test]
fn a_listing_asks_at_most_its_bound_at_once_and_stops_at_its_whole_bound() {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    type Ask = Pin<Box<dyn Future<Output = usize> + Send>>;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let each = Duration::from_secs(10);
    rt.block_on(async {
        let now = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let asks = |n: usize| -> Vec<Ask> {
            (0..n)
                .map(|i| {
                    let (now, most) = (Arc::clone(&now), Arc::clone(&most));
                    Box::pin(async move {
                        let _alive = Alive::enter(&now, &most);
                        tokio::time::sleep(each).await;
                        i
                    }) as Ask
                })
                .collect()
        };
        let rounds = |took: Duration| took.as_secs_f64() / each.as_secs_f64();
        let whole = Duration::from_secs(600);

        // At the limit: one round.
        let t = tokio::time::Instant::now();
        let out = join_bounded(asks(MAX_LIST_PARALLEL), MAX_LIST_PARALLEL, whole).await;
        let took = rounds(t.elapsed());
        assert!((1.0..1.1).contains(&took), "{took}");
        assert_eq!(out, (0..MAX_LIST_PARALLEL).map(Some).collect::<Vec<_>>());
        assert_eq!(most.load(SeqCst), MAX_LIST_PARALLEL);

        // One over: the last waits for a place, two rounds; never more than the bound at once.
        most.store(0, SeqCst);
        let t = tokio::time::Instant::now();
        let out = join_bounded(asks(MAX_LIST_PARALLEL + 1), MAX_LIST_PARALLEL, whole).await;
        let took = rounds(t.elapsed());
        assert!((2.0..2.1).contains(&took), "{took}");
        assert_eq!(out, (0..=MAX_LIST_PARALLEL).map(Some).collect::<Vec<_>>());
        assert_eq!(most.load(SeqCst), MAX_LIST_PARALLEL);

        // The whole bound ends the third round halfway: two rounds answered, the rest not,
        // and every future still running is dropped.
        let n = 2 * MAX_LIST_PARALLEL + 3;
        let t = tokio::time::Instant::now();
        let out = join_bounded(asks(n), MAX_LIST_PARALLEL, each * 5 / 2).await;
        let took = rounds(t.elapsed());
        assert!((2.5..2.6).contains(&took), "{took}");
        let answered: Vec<Option<usize>> = (0..2 * MAX_LIST_PARALLEL).map(Some).collect();
        assert_eq!(out[..2 * MAX_LIST_PARALLEL], answered[..]);
        assert!(
            out[2 * MAX_LIST_PARALLEL..].iter().all(Option::is_none),
            "{out:?}"
        );
        assert_eq!(now.load(SeqCst), 0, "a cut future is dropped");
        assert_eq!(most.load(SeqCst), MAX_LIST_PARALLEL);

        // Nothing to ask: done at once.
        assert!(
            join_bounded(asks(0), MAX_LIST_PARALLEL, whole)
                .await
                .is_empty()
        );
    });
}
