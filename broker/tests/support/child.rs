//! A spawned child run to the end of its output, for the tests that start one.

use std::time::Duration;

use iteron_broker::spawn::{ChildProcess, ChildSpec, spawn};
use tokio::io::AsyncReadExt;

/// Spawn `spec` with its stdin closed, read its whole stdout and stop it (1 s grace): the
/// output, and the stopped child (for its stderr).
pub(crate) async fn stdout_of(spec: ChildSpec) -> (String, ChildProcess) {
    let mut child = spawn(spec).await.unwrap();
    drop(child.stdin.take());
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    child.shutdown(Duration::from_secs(1)).await;
    (out, child)
}
