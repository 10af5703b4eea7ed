//! A root broker's pool of network namespaces takes back the namespace of a confined child
//! without `web_egress` once the child ended, and hands it to a later child instead of making
//! a new one. Alone in its test binary: the pool is the process's, and another test's starts
//! would change what it holds.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed setup should fail the test loudly"
)]

use std::time::{Duration, Instant};

use iteron_broker::confine::{DEFAULT_DATA_BYTES, DEFAULT_OPEN_FILES, Spec};
use iteron_broker::spawn::{ChildSpec, child_env};
use iteron_broker::sys;

#[path = "support/child.rs"]
mod child;
use child::stdout_of;

/// The network namespace (`net:[inode]`) a confined child without `web_egress` ran in.
async fn namespace_of_a_child(home: &std::path::Path) -> String {
    namespace_of_a_child_after(home, 0).await
}

/// The same, the child waiting `ms` milliseconds before it answers and ends.
async fn namespace_of_a_child_after(home: &std::path::Path, ms: u32) -> String {
    let (env, _) = child_env(&[], None, |_: &str| None);
    let (out, child) = stdout_of(ChildSpec {
        command: "sh".into(),
        args: vec![
            "-c".into(),
            format!(
                "sleep {}; readlink /proc/self/ns/net",
                f64::from(ms) / 1000.0
            ),
        ],
        env,
        confine: Some(Spec {
            deny: vec![home.to_path_buf()],
            open_files: DEFAULT_OPEN_FILES,
            data_bytes: DEFAULT_DATA_BYTES,
            ..Spec::default()
        }),
        egress: None,
    })
    .await;
    assert!(
        out.starts_with("net:["),
        "readlink printed {out:?}; stderr: {:?}",
        child.stderr_tail(5)
    );
    out.trim().to_owned()
}

async fn until(what: impl Fn() -> bool, within: Duration) -> bool {
    let end = Instant::now() + within;
    while !what() {
        if Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    true
}

#[test]
fn a_namespace_given_back_is_handed_to_the_next_child_and_the_hosts_is_never_used() {
    if !nix::unistd::geteuid().is_root() || sys::netns_support().is_err() {
        return; // the pool exists only under a root broker with network namespaces
    }
    let home = std::env::temp_dir().join(format!("iteron-netns-reuse-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let host = std::fs::read_link("/proc/self/ns/net")
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // The first start fills the pool; every later one joins a namespace from it.
        let first = namespace_of_a_child(&home).await;
        assert_ne!(first, host);
        // A child is given its namespace back only if it ends before the pool, refilling
        // once starts pause, has made up for the one it took: a few tries leave room for a
        // slow machine.
        let mut reused = None;
        for _ in 0..5 {
            assert!(until(sys::ready_namespaces_full, Duration::from_secs(2)).await);
            let before = sys::namespaces_reused();
            let a = namespace_of_a_child(&home).await;
            if until(
                || sys::namespaces_reused() > before,
                Duration::from_millis(500),
            )
            .await
            {
                reused = Some(a);
                break;
            }
        }
        let a = reused.expect("no namespace was given back and made ready again");
        // The next child joins the namespace given back last: the one `a` ran in.
        let b = namespace_of_a_child(&home).await;
        assert_eq!(a, b, "the namespace given back was not handed out again");
        assert_ne!(b, host);
        // The bound, at the limit and one over: a namespace given back while the pool already
        // holds all it keeps (it refilled while the child ran) is closed, not kept.
        assert!(until(sys::ready_namespaces_full, Duration::from_secs(2)).await);
        let (full, _) = sys::ready_namespaces();
        assert_eq!(full, sys::READY_NAMESPACES);
        let before = sys::namespaces_reused();
        let c = namespace_of_a_child_after(&home, 200).await;
        assert_ne!(c, host);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            sys::namespaces_reused(),
            before,
            "kept beyond the pool's bound"
        );
        assert_eq!(sys::ready_namespaces().0, sys::READY_NAMESPACES);
        // And the next child joins one of those, not the one closed.
        assert_ne!(namespace_of_a_child(&home).await, c);
    });
    iteron_test_support::record!("P9", serde_json::json!({"reused": true}));
    let _ = std::fs::remove_dir_all(&home);
}
