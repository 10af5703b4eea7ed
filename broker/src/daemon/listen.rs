//! The two sockets: their private paths, the peer-uid gate, the per-socket and per-uid
//! connection bounds, and the one error frame a refused connection gets.

use super::connection::connection;
use super::denial::Denial;
use super::{
    Broker, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID, MAX_REFUSED_RECORDS_PER_SEC, Peer,
    SHUTDOWN_GRACE, ServeError,
};
use crate::audit::Event;
use crate::audit::{Decision, Kind, Outcome};
use crate::ipc::frame::{self, MAX_FRAME};
use crate::ipc::proto::Reason;
use crate::ipc::proto::{self, Refusal, Role};
use std::collections::HashMap;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

/// One refused peer at second `now`: whether it gets its own record, and how many refusals
/// before it were counted instead. `w` is (second, records this second, not recorded).
pub(super) fn refused_step(w: &mut (u64, u32, u64), now: u64) -> (bool, u64) {
    if w.0 != now {
        w.0 = now;
        w.1 = 0;
    }
    if w.1 >= MAX_REFUSED_RECORDS_PER_SEC {
        w.2 += 1;
        return (false, 0);
    }
    w.1 += 1;
    (true, std::mem::take(&mut w.2))
}

/// Prepare a socket path: a private parent directory (created with `dir_mode` if missing; an
/// existing one must be ours and not writable by others), and no live socket at the path.
pub(super) fn prepare_socket(path: &Path, dir_mode: u32) -> Result<(), ServeError> {
    let fail = |what: &str| ServeError::Socket(format!("socket {}: {what}", path.display()));
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| fail("has no parent directory"))?;
    if !path.is_absolute() {
        return Err(fail("must be an absolute path"));
    }
    match std::fs::DirBuilder::new().mode(dir_mode).create(parent) {
        Ok(()) => {
            // The umask may have narrowed the mode; set exactly what was asked.
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(dir_mode))
                .map_err(|e| fail(&format!("cannot set the directory mode: {e}")))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(fail(&format!("cannot create the directory: {e}"))),
    }
    let meta = std::fs::symlink_metadata(parent)
        .map_err(|e| fail(&format!("cannot inspect the directory: {e}")))?;
    let euid = nix::unistd::geteuid().as_raw();
    if !meta.file_type().is_dir() {
        return Err(fail("the parent is not a directory"));
    }
    if meta.uid() != euid {
        return Err(fail("the parent directory is owned by another user"));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(fail("the parent directory is writable by group or others"));
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(fail(&format!("cannot inspect: {e}"))),
        Ok(m) if !m.file_type().is_socket() => Err(fail("exists and is not a socket")),
        Ok(_) => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(fail("another broker is listening on it"));
            }
            std::fs::remove_file(path)
                .map_err(|e| fail(&format!("cannot remove a stale socket: {e}")))
        }
    }
}

pub(super) fn bind(path: &Path, dir_mode: u32, sock_mode: u32) -> Result<UnixListener, ServeError> {
    prepare_socket(path, dir_mode)?;
    let listener = UnixListener::bind(path).map_err(|e| {
        ServeError::Socket(format!("socket {}: cannot listen: {e}", path.display()))
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(sock_mode)).map_err(|e| {
        ServeError::Socket(format!(
            "socket {}: cannot set its mode: {e}",
            path.display()
        ))
    })?;
    Ok(listener)
}

/// Answer a connection that is not served with one error frame (bounded to 1 s), then close.
pub(super) fn refuse_connection(mut stream: UnixStream, refusal: Refusal) {
    tokio::spawn(async move {
        let body = serde_json::to_vec(&proto::error_frame(None, &refusal)).unwrap_or_default();
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            frame::write_frame(&mut stream, &body, MAX_FRAME),
        )
        .await;
    });
}

pub(super) async fn accept_loop(
    broker: Arc<Broker>,
    listener: UnixListener,
    role: Role,
    allowed: Arc<Vec<u32>>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let per_uid: Arc<Mutex<HashMap<u32, usize>>> = Arc::new(Mutex::new(HashMap::new()));
    let mut shutdown = broker.shutdown.clone();
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.wait_for(|s| *s) => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let Ok((stream, _)) = accepted else {
            // Out of descriptors or similar: back off briefly instead of spinning.
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let peer = match stream.peer_cred() {
            Ok(c) => Peer {
                uid: c.uid(),
                pid: c.pid(),
            },
            Err(_) => continue,
        };
        if !allowed.contains(&peer.uid) {
            let (record, suppressed) = broker.refused_budget();
            if record {
                broker.audit(Event {
                    peer_uid: Some(peer.uid),
                    peer_pid: peer.pid,

                    detail: (suppressed > 0).then(|| {
                        format!("{suppressed} earlier refusals were not recorded one by one")
                    }),
                    ..Event::new(
                        if role == Role::Agent {
                            Kind::ConnectAgent
                        } else {
                            Kind::ConnectOperator
                        },
                        Decision::Refused,
                        Outcome::Because(Reason::PeerUidNotAllowed),
                    )
                });
            }
            refuse_connection(stream, Denial::PeerNotAllowed.refusal());
            continue;
        }
        let Some(mine) = UidConnection::take(&per_uid, peer.uid, MAX_CONNECTIONS_PER_UID) else {
            refuse_connection(stream, Denial::UidConnectionsFull.refusal());
            continue;
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            refuse_connection(stream, Denial::ConnectionsFull.refusal());
            continue;
        };
        let b = Arc::clone(&broker);
        conns.spawn(async move {
            connection(b, stream, role, peer).await;
            drop(permit);
            drop(mine);
        });
    }
    // Let every connection answer its in-flight requests `shutting_down`, then drop the rest.
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    conns.abort_all();
}

/// One of a uid's open connections, counted while it lives.
pub(super) struct UidConnection {
    pub(super) counts: Arc<Mutex<HashMap<u32, usize>>>,
    pub(super) uid: u32,
}

impl UidConnection {
    /// Count one more connection for `uid`, unless it already has `max`.
    pub(super) fn take(
        counts: &Arc<Mutex<HashMap<u32, usize>>>,
        uid: u32,
        max: usize,
    ) -> Option<Self> {
        let mut c = match counts.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let n = c.entry(uid).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(UidConnection {
            counts: Arc::clone(counts),
            uid,
        })
    }
}

impl Drop for UidConnection {
    fn drop(&mut self) {
        let mut c = match self.counts.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some(n) = c.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                c.remove(&self.uid);
            }
        }
    }
}
