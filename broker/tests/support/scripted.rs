//! A scripted HTTP/1.1 server on loopback for the OAuth tests: every accepted connection is
//! counted, every request recorded (one per connection, `Connection: close`), and each one
//! answered by a script. A barrier connection makes "nothing arrived" exact.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The request target the barrier uses; never recorded.
pub(crate) const BARRIER: &str = "/__barrier";
/// The pre-registered client id of the tests' confidential clients.
pub(crate) const CLIENT_ID: &str = "iteron-test";

pub(crate) fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::from([a, b, c, d])
}

pub(crate) fn enc(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}
/// One request as a scripted server saw it.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub(crate) method: String,
    pub(crate) target: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: String,
}

impl Seen {
    pub(crate) fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }

    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn form(&self) -> HashMap<String, String> {
        url::form_urlencoded::parse(self.body.as_bytes())
            .into_owned()
            .collect()
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    /// Whether the request carries `secret` in any form a client would send it: in the body
    /// (plain or form-encoded) or in HTTP Basic credentials.
    pub(crate) fn carries(&self, secret: &str) -> bool {
        use base64::Engine;
        let basic = base64::engine::general_purpose::STANDARD.encode(format!(
            "{}:{}",
            enc(CLIENT_ID),
            enc(secret)
        ));
        self.body.contains(secret)
            || self.body.contains(&enc(secret))
            || self
                .headers
                .iter()
                .any(|(_, v)| v.contains(secret) || v.contains(&basic))
    }
}

/// What a scripted server answers to one request.
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn json(v: Value) -> Reply {
        Reply::status(200, v)
    }

    pub(crate) fn status(status: u16, v: Value) -> Reply {
        Reply {
            status,
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: v.to_string(),
        }
    }

    pub(crate) fn not_found() -> Reply {
        Reply {
            status: 404,
            headers: Vec::new(),
            body: String::new(),
        }
    }

    pub(crate) fn redirect(status: u16, location: &str) -> Reply {
        Reply {
            status,
            headers: vec![("Location".into(), location.into())],
            body: String::new(),
        }
    }
}

pub(crate) type Script = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

/// A URL or value spelled from a server's base URL.
pub(crate) type FromBase = fn(&str) -> String;

/// An HTTP/1.1 server on loopback: every accepted connection is counted, every request is
/// recorded, and each one is answered by the script.
pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    connections: Arc<AtomicUsize>,
}

impl Server {
    /// On 127.0.0.1; `make` receives the server's base URL (`http://127.0.0.1:<port>`).
    pub(crate) async fn start(make: impl FnOnce(&str) -> Script) -> Server {
        Server::start_on(v4(127, 0, 0, 1), make).await
    }

    pub(crate) async fn start_on(ip: IpAddr, make: impl FnOnce(&str) -> Script) -> Server {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let script = make(&format!("http://{addr}"));
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let connections = Arc::new(AtomicUsize::new(0));
        let (log, count) = (seen.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve_one(
                    stream,
                    script.clone(),
                    log.clone(),
                    count.clone(),
                ));
            }
        });
        Server {
            addr,
            seen,
            connections,
        }
    }

    /// A listener where nothing may arrive: it answers 404 to anything.
    pub(crate) async fn silent_on(ip: IpAddr) -> Server {
        Server::start_on(ip, |_| Arc::new(|_: &Seen| Reply::not_found())).await
    }

    pub(crate) fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }

    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// The requests to exactly `path`.
    pub(crate) fn to(&self, path: &str) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| s.path() == path)
            .collect()
    }

    /// Connections accepted so far, counted only after every connection made before this call
    /// has been accepted: a barrier connection goes through the same accept queue, and the
    /// count is read once it has been answered.
    pub(crate) async fn connections_settled(&self) -> usize {
        let mut s = TcpStream::connect(self.addr).await.unwrap();
        s.write_all(format!("GET {BARRIER} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        assert!(
            out.starts_with(b"HTTP/1.1 204"),
            "the barrier was not answered"
        );
        self.connections.load(Ordering::SeqCst)
    }

    /// Nothing reached this server: not one TCP connection.
    pub(crate) async fn assert_untouched(&self, what: &str) {
        assert_eq!(
            self.connections_settled().await,
            0,
            "{what}: the server at {} saw {:?}",
            self.addr,
            self.seen()
                .iter()
                .map(|s| format!("{} {}", s.method, s.target))
                .collect::<Vec<_>>()
        );
    }

    /// Every request this server saw was a metadata GET: nothing was registered, redeemed,
    /// refreshed, revoked or posted.
    pub(crate) fn assert_only_discovery(&self, what: &str) {
        for s in self.seen() {
            assert!(
                s.method == "GET" && s.path().starts_with("/.well-known/"),
                "{what}: unexpected request {} {}",
                s.method,
                s.target
            );
        }
    }
}

async fn serve_one(
    mut stream: TcpStream,
    script: Script,
    log: Arc<Mutex<Vec<Seen>>>,
    count: Arc<AtomicUsize>,
) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > 64 * 1024 {
            return;
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let method = first.next().unwrap_or("").to_owned();
    let target = first.next().unwrap_or("").to_owned();
    if target == BARRIER {
        count.fetch_sub(1, Ordering::SeqCst);
        let _ = stream
            .write_all(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
            .await;
        let _ = stream.shutdown().await;
        return;
    }
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        })
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    let req = Seen {
        method,
        target,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    log.lock().unwrap().push(req.clone());
    let reply = script(&req);
    let mut out = format!(
        "HTTP/1.1 {} Scripted\r\nConnection: close\r\nContent-Length: {}\r\n",
        reply.status,
        reply.body.len()
    );
    for (k, v) in &reply.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&reply.body);
    let _ = stream.write_all(out.as_bytes()).await;
    let _ = stream.shutdown().await;
}
