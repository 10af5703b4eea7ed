//! The egress path of a stdio server admitted `web_egress`: its only way out of its own network
//! namespace.
//!
//! The child's namespace holds one listener, `127.0.0.1:`[`PROXY_PORT`], made by the child
//! before `exec` and handed to the broker ([`crate::sys`]); the broker serves it here as an
//! HTTP proxy: `CONNECT host:port` (a tunnel, for TLS) and plain-HTTP requests in absolute form
//! (`GET http://host/path`). The child's `HTTP_PROXY` and `HTTPS_PROXY` (and their
//! lower-case forms) point at it. Nothing else leaves the namespace: it has no other
//! interface.
//!
//! Every destination is judged before any connection, the way the broker judges its own:
//! a host name is resolved by the [`PinnedResolver`], whose whole answer must be one zone and
//! hold no address that is never a destination ([`judge_answer`]); an IP literal (in any of the
//! forms a URL parser accepts) is classified itself. The public zone is reachable; private,
//! link-local and loopback only when the server's `sandbox.egress` names the destination
//! ([`iteron_policy::egress`]). The connection then goes to exactly the addresses judged
//! (no second lookup). A refusal is answered `403` with a one-line reason, counted for the
//! server ([`Observer`], shown by `iteron broker status`) and audited with the destination's
//! host and port only — never a path, header or byte of payload — at most
//! [`MAX_REFUSAL_RECORDS_PER_SEC`] records a second per server (the rest are counted and
//! summarized in the next record).
#![forbid(unsafe_code)]

use crate::audit::{Decision, Kind, Outcome};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iteron_policy::egress::{self, EgressRule};
use iteron_policy::text;
use iteron_policy::zone::Zone;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::net::{Dns, NetError, PinnedResolver, judge_answer};
pub use crate::sys::PROXY_PORT;

/// Largest request head (request line and headers) the proxy reads, in bytes.
pub const MAX_REQUEST_HEAD: usize = 16 * 1024;
/// How long the proxy waits for a whole request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the proxy tries to connect to a judged destination (all its addresses).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections one server may have open through its egress path at once; beyond, a new one
/// waits in the listener's queue.
pub const MAX_EGRESS_CONNECTIONS: usize = 64;
/// Audit records of refused destinations per server and second; beyond, they are counted and
/// summarized in the next record.
pub const MAX_REFUSAL_RECORDS_PER_SEC: u32 = 20;
/// The proxy URL the child's environment names.
pub const PROXY_URL: &str = "http://127.0.0.1:3128";
/// Longest host shown in a refusal, in bytes.
const MAX_HOST_SHOWN: usize = 253;

/// The environment variables that point a child at its egress path (upper and lower case:
/// programs read one or the other), and `NODE_USE_ENV_PROXY=1`, without which Node's built-in
/// `fetch` ignores them. Not `ALL_PROXY`: every client that reads it prefers the two named
/// here for HTTP and HTTPS, the only protocols the path serves, and httpx (under the Python
/// MCP SDK and many servers) builds one more transport, with its own TLS context, for each
/// proxy variable set, on every client it makes (measured: about 20 ms each, see the egress
/// benchmark).
pub fn proxy_env() -> Vec<(&'static str, &'static str)> {
    let mut env: Vec<(&'static str, &'static str)> =
        ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"]
            .into_iter()
            .map(|k| (k, PROXY_URL))
            .collect();
    env.push(("NODE_USE_ENV_PROXY", "1"));
    env
}

/// Where refusals are audited: the daemon appends each record to its log.
pub type AuditSink = Arc<dyn Fn(crate::audit::Event) + Send + Sync>;

/// The refusals of one server's egress path: counted, the last one kept for `status`, each
/// audited (rate-limited). Shared by every start of the server.
pub struct Observer {
    server: String,
    refused: AtomicU64,
    last: Mutex<Option<String>>,
    /// (second, records this second, refusals counted but not recorded).
    window: Mutex<(u64, u32, u64)>,
    sink: Option<AuditSink>,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer")
            .field("server", &self.server)
            .field("refused", &self.refused())
            .finish_non_exhaustive()
    }
}

/// One refusal at second `now`: whether it gets its own record, and how many refusals before it
/// were counted instead. `w` is (second, records this second, not recorded).
fn refusal_step(w: &mut (u64, u32, u64), now: u64) -> (bool, u64) {
    if w.0 != now {
        w.0 = now;
        w.1 = 0;
    }
    if w.1 >= MAX_REFUSAL_RECORDS_PER_SEC {
        w.2 += 1;
        return (false, 0);
    }
    w.1 += 1;
    (true, std::mem::take(&mut w.2))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Observer {
    /// An observer for `server`, auditing through `sink` (none: counted only).
    pub fn new(server: &str, sink: Option<AuditSink>) -> Observer {
        Observer {
            server: server.to_owned(),
            refused: AtomicU64::new(0),
            last: Mutex::new(None),
            window: Mutex::new((0, 0, 0)),
            sink,
        }
    }

    /// Destinations refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    /// The last refusal (`host:port: reason`), if any.
    pub fn last_refusal(&self) -> Option<String> {
        lock(&self.last).clone()
    }

    /// What `iteron broker status` shows.
    pub fn status_json(&self) -> serde_json::Value {
        serde_json::json!({
            "refused": self.refused(),
            "last_refused": self.last_refusal(),
        })
    }

    fn refuse(&self, target: &str, why: &str) {
        self.refused.fetch_add(1, Ordering::SeqCst);
        let detail = text::single_line_capped(&format!("{target}: {why}"), 400);
        *lock(&self.last) = Some(detail.clone());
        let Some(sink) = &self.sink else {
            return;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let (record, left_out) = refusal_step(&mut lock(&self.window), now);
        if !record {
            return;
        }
        let detail = if left_out > 0 {
            format!("{detail} ({left_out} earlier refusals were counted, not recorded)")
        } else {
            detail
        };
        sink(crate::audit::Event {
            server: Some(self.server.clone()),
            detail: Some(detail),
            ..crate::audit::Event::new(Kind::EgressRefused, Decision::Refused, Outcome::Refused)
        });
    }
}

/// What a child's egress path needs besides its rules: the broker's DNS servers and where its
/// refusals are counted.
#[derive(Clone, Debug)]
pub struct Route {
    /// The DNS servers the pinned resolver asks.
    pub dns: Dns,
    /// The server's refusal counter and audit.
    pub observer: Arc<Observer>,
}

/// A running egress proxy; dropping it ends the proxy and every connection through it.
#[derive(Debug)]
pub struct ProxyHandle(tokio::task::AbortHandle);

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The pinned resolver of one egress path, built at its first host name (a path that only
/// sees IP literals never reads the DNS configuration).
pub struct LazyResolver {
    dns: Dns,
    cell: tokio::sync::OnceCell<PinnedResolver>,
}

impl LazyResolver {
    /// A resolver over `dns`, judging under the loopback ceiling (every answer whole).
    pub fn new(dns: Dns) -> LazyResolver {
        LazyResolver {
            dns,
            cell: tokio::sync::OnceCell::new(),
        }
    }

    async fn get(&self) -> Result<&PinnedResolver, NetError> {
        self.cell
            .get_or_try_init(|| async { PinnedResolver::new(&self.dns, Zone::Loopback) })
            .await
    }
}

struct Ctx {
    resolver: LazyResolver,
    rules: Vec<EgressRule>,
    observer: Arc<Observer>,
}

/// Judge `host` (as a URL parser read it) for a server whose `sandbox.egress` is `rules`: the
/// addresses to connect to, or why not. The whole answer must be one zone with no rejected
/// address ([`judge_answer`] under the loopback ceiling, so nothing is missed); above the public
/// zone only what `rules` name.
pub async fn judge(
    resolver: &LazyResolver,
    rules: &[EgressRule],
    host: &url::Host<String>,
) -> Result<Vec<IpAddr>, NetError> {
    let (shown, literal, addrs) = match host {
        url::Host::Ipv4(a) => (a.to_string(), true, vec![IpAddr::V4(*a)]),
        url::Host::Ipv6(a) => (a.to_string(), true, vec![IpAddr::V6(*a)]),
        url::Host::Domain(d) => (
            d.clone(),
            false,
            resolver.get().await?.resolve_checked(d).await?,
        ),
    };
    let zone = judge_answer(&shown, Zone::Loopback, &addrs)?;
    if zone == Zone::Public || egress::admits(rules, &shown, literal, &addrs) {
        return Ok(addrs);
    }
    // The refusal, as the broker words one for a client bound to the public zone.
    judge_answer(&shown, Zone::Public, &addrs).map(|_| addrs)
}

/// Serve `listener` (the child's proxy listener, from [`crate::sys::receive_proxy_listener`])
/// until the handle is dropped. Must be called inside a tokio runtime.
pub fn serve(
    listener: std::net::TcpListener,
    rules: Vec<EgressRule>,
    route: Route,
) -> std::io::Result<ProxyHandle> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let ctx = Arc::new(Ctx {
        resolver: LazyResolver::new(route.dns),
        rules,
        observer: route.observer,
    });
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_EGRESS_CONNECTIONS));
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
                return;
            };
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((conn, _)) => {
                        let ctx = Arc::clone(&ctx);
                        conns.spawn(async move {
                            handle(conn, &ctx).await;
                            drop(permit);
                        });
                    }
                    // A transient accept error (descriptors exhausted): wait, then go on.
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    });
    Ok(ProxyHandle(task.abort_handle()))
}

/// A parsed request head.
struct Head {
    /// `CONNECT` (a tunnel) or a plain-HTTP request to forward.
    tunnel: bool,
    host: url::Host<String>,
    port: u16,
    /// For a forwarded request: the head to send upstream (origin-form, `Connection: close`).
    upstream: Vec<u8>,
}

/// Why a request head is not served, with the status to answer.
struct Bad(u16, &'static str);

fn host_port(url: &url::Url) -> Result<(url::Host<String>, u16), Bad> {
    if !url.username().is_empty() || url.password().is_some() {
        return Err(Bad(400, "credentials in the target are not accepted"));
    }
    let host = url
        .host()
        .map(|h| h.to_owned())
        .ok_or(Bad(400, "the target has no host"))?;
    let port = url
        .port_or_known_default()
        .ok_or(Bad(400, "the target has no port"))?;
    if port == 0 {
        return Err(Bad(403, "port 0 is never a destination"));
    }
    Ok((host, port))
}

/// Headers a proxy consumes rather than forwards.
fn hop_by_hop(name: &str) -> bool {
    [
        "connection",
        "proxy-connection",
        "keep-alive",
        "proxy-authorization",
    ]
    .iter()
    .any(|h| name.eq_ignore_ascii_case(h))
}

fn parse_head(raw: &[u8]) -> Result<Head, Bad> {
    let text = std::str::from_utf8(raw).map_err(|_| Bad(400, "the request head is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let line = lines.next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Bad(400, "malformed request line"));
    };
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(Bad(505, "only HTTP/1.0 and HTTP/1.1 are served"));
    }
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(Bad(400, "malformed method"));
    }
    let mut headers = Vec::new();
    for h in lines.by_ref() {
        if h.is_empty() {
            break;
        }
        if h.starts_with([' ', '\t']) {
            return Err(Bad(400, "folded header lines are not accepted"));
        }
        let Some((name, value)) = h.split_once(':') else {
            return Err(Bad(400, "malformed header line"));
        };
        headers.push((name, value));
    }
    if method == "CONNECT" {
        // An authority alone: `host:port`, the port explicit.
        if target.is_empty() || target.contains(['/', '?', '#', '@']) || !target.contains(':') {
            return Err(Bad(400, "CONNECT needs host:port"));
        }
        let url = url::Url::parse(&format!("http://{target}/"))
            .map_err(|_| Bad(400, "CONNECT needs host:port"))?;
        if url.port().is_none() && !target.ends_with(":80") {
            return Err(Bad(400, "CONNECT needs host:port"));
        }
        let (host, port) = host_port(&url)?;
        return Ok(Head {
            tunnel: true,
            host,
            port,
            upstream: Vec::new(),
        });
    }
    if !target
        .get(..7)
        .is_some_and(|s| s.eq_ignore_ascii_case("http://"))
    {
        return Err(Bad(
            400,
            "only CONNECT and absolute http:// requests are served (https through CONNECT)",
        ));
    }
    let url = url::Url::parse(target).map_err(|_| Bad(400, "malformed request target"))?;
    let (host, port) = host_port(&url)?;
    let mut path = url.path().to_owned();
    if let Some(q) = url.query() {
        path.push('?');
        path.push_str(q);
    }
    let mut upstream = format!("{method} {path} {version}\r\n").into_bytes();
    for (name, value) in headers {
        if !hop_by_hop(name.trim()) {
            upstream.extend_from_slice(format!("{name}:{value}\r\n").as_bytes());
        }
    }
    upstream.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok(Head {
        tunnel: false,
        host,
        port,
        upstream,
    })
}

/// Read a request head: the bytes up to and including the blank line (at most
/// [`MAX_REQUEST_HEAD`] in all), and whatever followed it in the same reads.
async fn read_head(
    conn: &mut (impl tokio::io::AsyncRead + Unpin),
) -> Result<(Vec<u8>, Vec<u8>), Bad> {
    let mut buf = Vec::with_capacity(1024);
    let read = async {
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = memchr::memmem::find(&buf, b"\r\n\r\n") {
                if end + 4 > MAX_REQUEST_HEAD {
                    return Err(Bad(431, "the request head is too large"));
                }
                let rest = buf.split_off(end + 4);
                return Ok((std::mem::take(&mut buf), rest));
            }
            if buf.len() >= MAX_REQUEST_HEAD {
                return Err(Bad(431, "the request head is too large"));
            }
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return Err(Bad(400, "the request head ended early")),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    tokio::time::timeout(HEAD_TIMEOUT, read)
        .await
        .unwrap_or(Err(Bad(408, "the request head did not arrive in time")))
}

async fn answer(conn: &mut TcpStream, status: u16, why: &str) {
    let reason = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Error",
    };
    let body = format!("iteron egress: {why}\n");
    let msg = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.write_all(msg.as_bytes()).await;
    let _ = conn.shutdown().await;
}

fn shown_target(host: &url::Host<String>, port: u16) -> String {
    let h = match host {
        url::Host::Ipv6(a) => format!("[{a}]"),
        other => other.to_string(),
    };
    format!("{}:{port}", text::single_line_capped(&h, MAX_HOST_SHOWN))
}

async fn connect_any(addrs: &[IpAddr], port: u16) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other("no address");
    for ip in addrs {
        match TcpStream::connect(SocketAddr::new(*ip, port)).await {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

async fn handle(mut conn: TcpStream, ctx: &Ctx) {
    let _ = conn.set_nodelay(true);
    let (raw, rest) = match read_head(&mut conn).await {
        Ok(h) => h,
        Err(Bad(status, why)) => return answer(&mut conn, status, why).await,
    };
    let head = match parse_head(&raw) {
        Ok(h) => h,
        Err(Bad(status, why)) => return answer(&mut conn, status, why).await,
    };
    let target = shown_target(&head.host, head.port);
    let addrs = match judge(&ctx.resolver, &ctx.rules, &head.host).await {
        Ok(a) => a,
        Err(e @ (NetError::Resolve { .. } | NetError::DnsConfig(_))) => {
            return answer(&mut conn, 502, &format!("{target}: {e}")).await;
        }
        Err(e) => {
            let why = e.to_string();
            ctx.observer.refuse(&target, &why);
            return answer(
                &mut conn,
                403,
                &format!("{target}: {why}; only the public zone, and what sandbox.egress names, is reachable"),
            )
            .await;
        }
    };
    let upstream = tokio::time::timeout(CONNECT_TIMEOUT, connect_any(&addrs, head.port)).await;
    let mut upstream = match upstream {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            let why = text::single_line_capped(&e.to_string(), 160);
            return answer(
                &mut conn,
                502,
                &format!("cannot connect to {target}: {why}"),
            )
            .await;
        }
        Err(_) => {
            return answer(&mut conn, 504, &format!("{target}: connect timed out")).await;
        }
    };
    let _ = upstream.set_nodelay(true);
    let sent = if head.tunnel {
        conn.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
    } else {
        upstream.write_all(&head.upstream).await
    };
    if sent.is_err() || (!rest.is_empty() && upstream.write_all(&rest).await.is_err()) {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_records_are_rate_limited_per_server_at_the_limit_and_one_over() {
        let mut w = (0, 0, 0);
        for _ in 0..MAX_REFUSAL_RECORDS_PER_SEC {
            assert_eq!(refusal_step(&mut w, 7), (true, 0));
        }
        // One over the limit: counted, not recorded.
        assert_eq!(refusal_step(&mut w, 7), (false, 0));
        assert_eq!(refusal_step(&mut w, 7), (false, 0));
        // The next second's first record says how many were left out.
        assert_eq!(refusal_step(&mut w, 8), (true, 2));
        assert_eq!(refusal_step(&mut w, 8), (true, 0));
        // Through the observer: every refusal is counted, records stop at the limit.
        let records = Arc::new(Mutex::new(Vec::new()));
        let sink: AuditSink = {
            let r = Arc::clone(&records);
            Arc::new(move |e: crate::audit::Event| lock(&r).push(e))
        };
        let o = Observer::new("fetch", Some(sink));
        let n = MAX_REFUSAL_RECORDS_PER_SEC as usize + 5;
        let second = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
        };
        let before = second();
        for i in 0..n {
            o.refuse(&format!("10.0.0.{i}:80"), "refused: private");
        }
        let within_one_second = second() == before;
        assert_eq!(o.refused(), n as u64);
        let got = lock(&records).len();
        if within_one_second {
            assert_eq!(got, MAX_REFUSAL_RECORDS_PER_SEC as usize);
        } else {
            assert!(got <= n, "{got}");
        }
        let first = lock(&records)[0].clone();
        assert_eq!(first.kind, Kind::EgressRefused);
        assert_eq!(first.server.as_deref(), Some("fetch"));
        assert_eq!(
            first.detail.as_deref(),
            Some("10.0.0.0:80: refused: private")
        );
        assert_eq!(
            o.last_refusal().as_deref(),
            Some(format!("10.0.0.{}:80: refused: private", n - 1).as_str())
        );
        iteron_test_support::record!(
            "P9",
            serde_json::json!({"per_second": MAX_REFUSAL_RECORDS_PER_SEC}),
        );
    }

    #[tokio::test]
    async fn a_request_head_is_bounded_at_the_limit_and_one_over() {
        use tokio::io::AsyncWriteExt;
        // A head of exactly MAX_REQUEST_HEAD bytes (blank line included) is read whole, with
        // what follows it kept for the tunnel; one byte more is refused.
        let head_of = |len: usize| {
            let start = "CONNECT a.example:443 HTTP/1.1\r\nX: ";
            let pad = len - start.len() - 4;
            format!("{start}{}\r\n\r\n", "a".repeat(pad)).into_bytes()
        };
        for (len, ok) in [(MAX_REQUEST_HEAD, true), (MAX_REQUEST_HEAD + 1, false)] {
            let (mut client, mut server) = tokio::io::duplex(64 * 1024);
            let mut bytes = head_of(len);
            bytes.extend_from_slice(b"tls-bytes");
            client.write_all(&bytes).await.unwrap();
            match read_head(&mut server).await {
                Ok((head, rest)) => {
                    assert!(ok, "{len} bytes were accepted");
                    assert_eq!(head.len(), len);
                    // What followed in the same reads (the head may end at a read's end).
                    assert!(b"tls-bytes".starts_with(&rest), "{rest:?}");
                }
                Err(Bad(status, _)) => {
                    assert!(!ok, "{len} bytes were refused");
                    assert_eq!(status, 431);
                }
            }
        }
        // No blank line within the bound: refused once the bound is reached, not read on.
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        client
            .write_all(&vec![b'a'; MAX_REQUEST_HEAD + 100])
            .await
            .unwrap();
        assert!(matches!(read_head(&mut server).await, Err(Bad(431, _))));
        // A head that ends early.
        let (mut client, mut server) = tokio::io::duplex(1024);
        client
            .write_all(b"CONNECT a.example:443 HTTP/1.1\r\n")
            .await
            .unwrap();
        drop(client);
        assert!(matches!(read_head(&mut server).await, Err(Bad(400, _))));
        iteron_test_support::record!(
            "P9",
            serde_json::json!({"max_request_head": MAX_REQUEST_HEAD}),
        );
    }

    #[tokio::test]
    async fn connections_through_one_egress_path_are_bounded_at_the_limit_and_one_over() {
        use tokio::io::AsyncWriteExt;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let observer = Arc::new(Observer::new("bounded", None));
        let _proxy = serve(
            l,
            Vec::new(),
            Route {
                dns: Dns::Nameservers(vec!["127.0.0.1:9".parse().unwrap()]),
                observer: Arc::clone(&observer),
            },
        )
        .unwrap();
        // MAX_EGRESS_CONNECTIONS connections that say nothing yet hold every slot.
        let mut held = Vec::new();
        for _ in 0..MAX_EGRESS_CONNECTIONS {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        // One over: connected (the listener's queue) but not served while they are held.
        let mut over = TcpStream::connect(addr).await.unwrap();
        over.write_all(b"CONNECT 10.0.0.1:80 HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        let waited = tokio::time::timeout(Duration::from_millis(300), over.read(&mut buf)).await;
        assert!(
            waited.is_err(),
            "the connection one over the bound was served"
        );
        assert_eq!(observer.refused(), 0);
        // One held connection ends: the waiting one is served (and refused: private).
        drop(held.pop());
        let n = tokio::time::timeout(Duration::from_secs(5), over.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 403"), "{:?}", &buf[..n]);
        assert_eq!(observer.refused(), 1);
        iteron_test_support::record!(
            "P9",
            serde_json::json!({"max_connections": MAX_EGRESS_CONNECTIONS}),
        );
    }

    #[test]
    fn request_heads_parse_to_a_judged_target_and_nothing_else() {
        let head = |s: &str| parse_head(s.as_bytes());
        let h = head("CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
            .ok()
            .unwrap();
        assert!(h.tunnel);
        assert_eq!(h.host, url::Host::Domain("example.com".to_owned()));
        assert_eq!(h.port, 443);
        // IP literals in the forms a URL parser accepts become the address they mean.
        for (target, ip) in [
            ("127.0.0.1:22", "127.0.0.1"),
            ("2130706433:22", "127.0.0.1"),
            ("0x7f.1:22", "127.0.0.1"),
            ("[::ffff:169.254.169.254]:80", "::ffff:a9fe:a9fe"),
        ] {
            let h = head(&format!("CONNECT {target} HTTP/1.1\r\n\r\n"))
                .ok()
                .unwrap();
            let got = match h.host {
                url::Host::Ipv4(a) => IpAddr::V4(a),
                url::Host::Ipv6(a) => IpAddr::V6(a),
                url::Host::Domain(d) => panic!("{target} read as the name {d}"),
            };
            assert_eq!(got, ip.parse::<IpAddr>().unwrap(), "{target}");
        }
        // A forwarded request goes upstream in origin form, hop-by-hop headers replaced.
        let h = head(
            "GET http://Example.COM:8080/a/b?q=1 HTTP/1.1\r\nHost: example.com:8080\r\nProxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n",
        )
        .ok()
        .unwrap();
        assert!(!h.tunnel);
        assert_eq!(h.host, url::Host::Domain("example.com".to_owned()));
        assert_eq!(h.port, 8080);
        assert_eq!(
            String::from_utf8(h.upstream).unwrap(),
            "GET /a/b?q=1 HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        for (bad, status) in [
            ("CONNECT example.com HTTP/1.1\r\n\r\n", 400),
            ("CONNECT user@example.com:443 HTTP/1.1\r\n\r\n", 400),
            ("CONNECT example.com:0 HTTP/1.1\r\n\r\n", 403),
            ("GET /relative HTTP/1.1\r\n\r\n", 400),
            ("GET https://example.com/ HTTP/1.1\r\n\r\n", 400),
            ("GET http://u:p@example.com/ HTTP/1.1\r\n\r\n", 400),
            ("GET http://example.com/ HTTP/2\r\n\r\n", 505),
            ("GET  http://example.com/ HTTP/1.1\r\n\r\n", 400),
            ("get http://example.com/ HTTP/1.1\r\n\r\n", 400),
            (
                "GET http://example.com/ HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
                400,
            ),
        ] {
            match head(bad) {
                Ok(_) => panic!("{bad:?} was accepted"),
                Err(Bad(s, _)) => assert_eq!(s, status, "{bad:?}"),
            }
        }
        iteron_test_support::record!("P3", serde_json::json!({}),);
    }
}
