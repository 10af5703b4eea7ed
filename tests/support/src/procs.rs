//! Processes: the test's own privilege, peers on PATH, children and their sockets.

use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The uid a confined child of a root broker runs as by default (`sandbox.run_as`).
pub const CHILD_UID: u32 = 65534;

/// How long [`wait_child`] lets a child run.
const CHILD_DEADLINE: Duration = Duration::from_secs(60);

/// How often the waits poll.
const POLL: Duration = Duration::from_millis(20);

/// Whether the tests run as root (as in CI): only then can they drop to another uid.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Whether process `pid` exists at all (a zombie does: its `/proc` entry stays until reaped).
pub fn process_exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// `node` from the test's PATH, as an absolute path (the broker gives children a fixed PATH).
pub fn node() -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("node"))
                .find(|c| c.is_file())
        })
        .expect("node is not on PATH")
}

/// Bytes a child wrote, as text (invalid UTF-8 replaced).
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Wait for `c` to end (at most 60 s, else the test fails) and collect what it wrote.
pub fn wait_child(mut c: Child) -> Output {
    let deadline = Instant::now() + CHILD_DEADLINE;
    while c.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "a child did not finish in 60 s");
        std::thread::sleep(POLL);
    }
    c.wait_with_output().unwrap()
}

/// Wait until each of `sockets` accepts a connection (a broker has started): true then, false
/// once `within` has passed.
pub fn wait_listening(sockets: &[&Path], within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if sockets
            .iter()
            .all(|s| std::os::unix::net::UnixStream::connect(s).is_ok())
        {
            return true;
        }
        std::thread::sleep(POLL);
    }
    false
}

/// How often [`wait_pending`] asks the broker.
const PENDING_POLL: Duration = Duration::from_millis(50);

/// Ask `pending` (what `iteron approvals list` shows waiting) until it holds exactly `n` items
/// and return them; the test fails once `within` has passed.
pub fn wait_pending(
    n: usize,
    within: Duration,
    mut pending: impl FnMut() -> Vec<Value>,
) -> Vec<Value> {
    let deadline = Instant::now() + within;
    loop {
        let p = pending();
        if p.len() == n {
            return p;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} pending, have {p:?}"
        );
        std::thread::sleep(PENDING_POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_listening_sees_every_socket_or_gives_up_at_its_deadline() {
        let dir =
            std::env::temp_dir().join(format!("iteron-support-listen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
        let _la = std::os::unix::net::UnixListener::bind(&a).unwrap();
        let started = Instant::now();
        assert!(!wait_listening(&[&a, &b], Duration::from_millis(200)));
        assert!(started.elapsed() >= Duration::from_millis(200));
        let _lb = std::os::unix::net::UnixListener::bind(&b).unwrap();
        assert!(wait_listening(&[&a, &b], Duration::from_secs(5)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn wait_child_collects_the_output() {
        let c = std::process::Command::new("/bin/sh")
            .args(["-c", "printf out; printf err >&2; exit 3"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_child(c);
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(
            (text(&out.stdout), text(&out.stderr)),
            ("out".into(), "err".into())
        );
    }

    #[test]
    fn wait_pending_returns_when_the_count_is_reached() {
        let mut asked = 0;
        let got = wait_pending(2, Duration::from_secs(5), || {
            asked += 1;
            vec![Value::from(1); asked.min(3)]
        });
        assert_eq!((got.len(), asked), (2, 2));
    }

    #[test]
    #[should_panic(expected = "expected 1 pending, have []")]
    fn wait_pending_fails_the_test_at_its_deadline() {
        wait_pending(1, Duration::from_millis(100), Vec::new);
    }
}
