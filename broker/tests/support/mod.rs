//! Loopback fixtures for the network tests: a UDP DNS responder, HTTP/1.1 listeners (plain and
//! TLS) that record what reached them, and a throwaway certificate authority.
//!
//! Everything binds to 127.0.0.0/8 only; nothing touches the system resolver configuration or
//! the process environment.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iteron_broker::net::Dns;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::ServerConfig;
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};
use tokio_rustls::TlsAcceptor;

/// DNS record type A.
pub(crate) const A: u16 = 1;
/// DNS record type AAAA.
pub(crate) const AAAA: u16 = 28;

// ---------------------------------------------------------------------------------------------
// DNS
// ---------------------------------------------------------------------------------------------

/// The answer sets still to give for one name, one queue per record type. hickory asks A and
/// AAAA in parallel for one lookup, so each type walks the sequence on its own: the n-th A
/// query and the n-th AAAA query see the same answer set.
#[derive(Default)]
struct Records {
    a: VecDeque<Vec<IpAddr>>,
    aaaa: VecDeque<Vec<IpAddr>>,
}

/// Pops the front answer set while more than one remains; the last one repeats forever.
fn next_set(queue: &mut VecDeque<Vec<IpAddr>>) -> Vec<IpAddr> {
    if queue.len() > 1 {
        queue.pop_front().unwrap_or_default()
    } else {
        queue.front().cloned().unwrap_or_default()
    }
}

type Table = Arc<Mutex<HashMap<String, Records>>>;
type Counts = Arc<Mutex<HashMap<(String, u16), usize>>>;

/// A DNS server on 127.0.0.1 answering A and AAAA questions from a table, with TTL 0.
/// Unknown names get NXDOMAIN; a known name without addresses of the asked type gets an empty
/// NOERROR answer.
pub(crate) struct DnsServer {
    addr: SocketAddr,
    table: Table,
    counts: Counts,
}

impl DnsServer {
    pub(crate) async fn start() -> DnsServer {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let table = Table::default();
        let counts = Counts::default();
        tokio::spawn(serve_dns(socket, table.clone(), counts.clone()));
        DnsServer {
            addr,
            table,
            counts,
        }
    }

    /// The resolver configuration that sends every question here.
    pub(crate) fn dns(&self) -> Dns {
        Dns::Nameservers(vec![self.addr])
    }

    /// Answer `name` with one fixed set of addresses.
    pub(crate) fn answer(&self, name: &str, addrs: &[IpAddr]) {
        self.answer_in_turn(name, &[addrs]);
    }

    /// Answer `name` with `sets` in turn (per record type), the last set repeating: an answer
    /// that changes between queries, as in DNS rebinding.
    pub(crate) fn answer_in_turn(&self, name: &str, sets: &[&[IpAddr]]) {
        let mut records = Records::default();
        for set in sets {
            records
                .a
                .push_back(set.iter().copied().filter(IpAddr::is_ipv4).collect());
            records
                .aaaa
                .push_back(set.iter().copied().filter(IpAddr::is_ipv6).collect());
        }
        self.table
            .lock()
            .unwrap()
            .insert(normalize_name(name), records);
    }

    /// How many questions of `qtype` about `name` arrived.
    pub(crate) fn queries(&self, name: &str, qtype: u16) -> usize {
        self.counts
            .lock()
            .unwrap()
            .get(&(normalize_name(name), qtype))
            .copied()
            .unwrap_or(0)
    }
}

fn normalize_name(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

async fn serve_dns(socket: UdpSocket, table: Table, counts: Counts) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((n, peer)) = socket.recv_from(&mut buf).await else {
            return;
        };
        if let Some(reply) = dns_reply(&buf[..n], &table, &counts) {
            let _ = socket.send_to(&reply, peer).await;
        }
    }
}

struct Question {
    name: String,
    qtype: u16,
    /// Offset just past QCLASS: the question is `msg[12..end]`.
    end: usize,
}

/// The header's question count must be 1; QNAME is read label by label (queries never use
/// compression). Additional records (EDNS OPT) are ignored.
fn parse_question(msg: &[u8]) -> Option<Question> {
    if msg.len() < 12 || u16::from_be_bytes([msg[4], msg[5]]) != 1 {
        return None;
    }
    let mut pos = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*msg.get(pos)?);
        pos += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        let label = std::str::from_utf8(msg.get(pos..pos + len)?).ok()?;
        labels.push(label.to_ascii_lowercase());
        pos += len;
    }
    let qtype = u16::from_be_bytes([*msg.get(pos)?, *msg.get(pos + 1)?]);
    let _qclass = msg.get(pos + 2..pos + 4)?;
    Some(Question {
        name: labels.join("."),
        qtype,
        end: pos + 4,
    })
}

fn dns_reply(query: &[u8], table: &Table, counts: &Counts) -> Option<Vec<u8>> {
    let q = parse_question(query)?;
    *counts
        .lock()
        .unwrap()
        .entry((q.name.clone(), q.qtype))
        .or_insert(0) += 1;
    // None: no such name.
    let answers: Option<Vec<IpAddr>> =
        table
            .lock()
            .unwrap()
            .get_mut(&q.name)
            .map(|records| match q.qtype {
                A => next_set(&mut records.a),
                AAAA => next_set(&mut records.aaaa),
                _ => Vec::new(),
            });
    let rcode = if answers.is_some() { 0 } else { 3 };
    let answers = answers.unwrap_or_default();

    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(&query[0..2]); // ID
    out.push(0x80 | 0x04 | (query[2] & 0x01)); // QR, AA, RD echoed, opcode QUERY
    out.push(0x80 | rcode); // RA, RCODE
    out.extend_from_slice(&1u16.to_be_bytes()); // QDCOUNT
    out.extend_from_slice(&u16::try_from(answers.len()).unwrap().to_be_bytes()); // ANCOUNT
    out.extend_from_slice(&[0, 0, 0, 0]); // NSCOUNT, ARCOUNT
    out.extend_from_slice(&query[12..q.end]); // the question, echoed
    for ip in answers {
        let (rtype, rdata) = match ip {
            IpAddr::V4(v4) => (A, v4.octets().to_vec()),
            IpAddr::V6(v6) => (AAAA, v6.octets().to_vec()),
        };
        out.extend_from_slice(&[0xc0, 0x0c]); // NAME: pointer to the question's name
        out.extend_from_slice(&rtype.to_be_bytes());
        out.extend_from_slice(&1u16.to_be_bytes()); // CLASS IN
        out.extend_from_slice(&0u32.to_be_bytes()); // TTL 0
        out.extend_from_slice(&u16::try_from(rdata.len()).unwrap().to_be_bytes());
        out.extend_from_slice(&rdata);
    }
    Some(out)
}

// ---------------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
enum Body {
    /// With `Content-Length`.
    Sized(Vec<u8>),
    /// With `Transfer-Encoding: chunked`, in pieces of at most 1000 bytes.
    Chunked(Vec<u8>),
    /// `total` bytes announced by `Content-Length`, sent one byte per `pause`.
    Drip { total: usize, pause: Duration },
    /// Nothing at all, not even a status line: the connection is held open.
    Silence,
}

/// What a listener answers to every request.
#[derive(Clone)]
pub(crate) struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Body,
}

impl Reply {
    /// 200 with this body and a `Content-Length`.
    pub(crate) fn ok(body: &[u8]) -> Reply {
        Reply {
            status: 200,
            headers: Vec::new(),
            body: Body::Sized(body.to_vec()),
        }
    }

    /// 200 with this body, chunked, no `Content-Length`.
    pub(crate) fn chunked(body: &[u8]) -> Reply {
        Reply {
            status: 200,
            headers: Vec::new(),
            body: Body::Chunked(body.to_vec()),
        }
    }

    /// A redirect with this `Location` and an empty body.
    pub(crate) fn redirect(status: u16, location: &str) -> Reply {
        Reply {
            status,
            headers: vec![("Location".into(), location.into())],
            body: Body::Sized(Vec::new()),
        }
    }

    /// 200 announcing `total` bytes, then one byte every `pause`.
    pub(crate) fn drip(total: usize, pause: Duration) -> Reply {
        Reply {
            status: 200,
            headers: Vec::new(),
            body: Body::Drip { total, pause },
        }
    }

    /// Read the request, never answer.
    pub(crate) fn silence() -> Reply {
        Reply {
            status: 0,
            headers: Vec::new(),
            body: Body::Silence,
        }
    }
}

#[derive(Default)]
struct Seen {
    connections: AtomicUsize,
    heads: Mutex<Vec<String>>,
}

/// An HTTP/1.1 listener (plain or TLS) that records every accepted TCP connection and the head
/// of every request, and answers each request with one fixed [`Reply`]. Connections are kept
/// alive unless the client asks to close, or the body is a drip.
pub(crate) struct Listener {
    addr: SocketAddr,
    seen: Arc<Seen>,
}

impl Listener {
    /// Bind `ip:port` (0 for any port); `tls` makes it HTTPS.
    pub(crate) async fn bind(
        ip: IpAddr,
        port: u16,
        reply: Reply,
        tls: Option<Arc<ServerConfig>>,
    ) -> io::Result<Listener> {
        let listener = TcpListener::bind(SocketAddr::new(ip, port)).await?;
        let addr = listener.local_addr()?;
        let seen = Arc::new(Seen::default());
        tokio::spawn(accept_loop(
            listener,
            Arc::new(reply),
            tls.map(TlsAcceptor::from),
            seen.clone(),
        ));
        Ok(Listener { addr, seen })
    }

    /// Plain HTTP on `ip`, any port.
    pub(crate) async fn http(ip: IpAddr, reply: Reply) -> Listener {
        Listener::bind(ip, 0, reply, None).await.unwrap()
    }

    /// HTTPS on `ip`, any port.
    pub(crate) async fn https(ip: IpAddr, reply: Reply, tls: Arc<ServerConfig>) -> Listener {
        Listener::bind(ip, 0, reply, Some(tls)).await.unwrap()
    }

    /// Two HTTPS listeners on `first` and `second` sharing one port number.
    pub(crate) async fn https_pair_on_one_port(
        first: (IpAddr, Reply),
        second: (IpAddr, Reply),
        tls: &Arc<ServerConfig>,
    ) -> (Listener, Listener) {
        for _ in 0..50 {
            let one = Listener::bind(first.0, 0, first.1.clone(), Some(tls.clone()))
                .await
                .unwrap();
            if let Ok(two) =
                Listener::bind(second.0, one.port(), second.1.clone(), Some(tls.clone())).await
            {
                return (one, two);
            }
        }
        panic!("no port was free on both {} and {}", first.0, second.0);
    }

    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }

    /// TCP connections accepted so far.
    pub(crate) fn connections(&self) -> usize {
        self.seen.connections.load(Ordering::SeqCst)
    }

    /// The head (request line and headers) of every request read so far.
    pub(crate) fn heads(&self) -> Vec<String> {
        self.seen.heads.lock().unwrap().clone()
    }
}

async fn accept_loop(
    listener: TcpListener,
    reply: Arc<Reply>,
    tls: Option<TlsAcceptor>,
    seen: Arc<Seen>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        seen.connections.fetch_add(1, Ordering::SeqCst);
        // Replies are written whole; Nagle plus delayed ACKs would otherwise add ~40 ms to a
        // keep-alive exchange and distort the benchmark that shares these fixtures.
        let _ = stream.set_nodelay(true);
        let reply = reply.clone();
        let seen = seen.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => serve_http(stream, &reply, &seen).await,
                Some(acceptor) => {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        serve_http(stream, &reply, &seen).await;
                    }
                }
            }
        });
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Reads until a complete request head is buffered; returns it and leaves what follows in
/// `buf`. `None` at end of stream or on error.
async fn read_head<S: AsyncRead + Unpin>(io: &mut S, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = find(buf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            buf.drain(..end + 4);
            return Some(head);
        }
        let mut chunk = [0u8; 4096];
        let n = io.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn header_value<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.split("\r\n").skip(1).find_map(|line| {
        let (k, v) = line.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

async fn serve_http<S: AsyncRead + AsyncWrite + Unpin>(mut io: S, reply: &Reply, seen: &Seen) {
    let mut buf = Vec::new();
    loop {
        let Some(head) = read_head(&mut io, &mut buf).await else {
            return;
        };
        let body_len: usize = header_value(&head, "content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < body_len {
            let mut chunk = [0u8; 4096];
            match io.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..body_len);
        let close =
            header_value(&head, "connection").is_some_and(|v| v.eq_ignore_ascii_case("close"));
        seen.heads.lock().unwrap().push(head);
        match write_reply(&mut io, reply).await {
            Ok(true) if !close => {}
            _ => {
                let _ = io.shutdown().await;
                return;
            }
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        301 => "Moved Permanently",
        302 => "Found",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        _ => "Whatever",
    }
}

/// Writes one reply; `Ok(true)` when the connection may serve another request.
async fn write_reply<S: AsyncWrite + Unpin>(io: &mut S, reply: &Reply) -> io::Result<bool> {
    if let Body::Silence = reply.body {
        std::future::pending::<()>().await;
    }
    let mut head = format!("HTTP/1.1 {} {}\r\n", reply.status, reason(reply.status));
    for (k, v) in &reply.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    match &reply.body {
        Body::Sized(body) => {
            head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
            let mut whole = head.into_bytes();
            whole.extend_from_slice(body);
            io.write_all(&whole).await?;
            io.flush().await?;
            Ok(true)
        }
        Body::Chunked(body) => {
            head.push_str("Transfer-Encoding: chunked\r\n\r\n");
            io.write_all(head.as_bytes()).await?;
            for piece in body.chunks(1000) {
                io.write_all(format!("{:x}\r\n", piece.len()).as_bytes())
                    .await?;
                io.write_all(piece).await?;
                io.write_all(b"\r\n").await?;
            }
            io.write_all(b"0\r\n\r\n").await?;
            io.flush().await?;
            Ok(true)
        }
        Body::Drip { total, pause } => {
            head.push_str(&format!("Content-Length: {total}\r\n\r\n"));
            io.write_all(head.as_bytes()).await?;
            io.flush().await?;
            for _ in 0..*total {
                io.write_all(b"x").await?;
                io.flush().await?;
                tokio::time::sleep(*pause).await;
            }
            Ok(false)
        }
        Body::Silence => Ok(false),
    }
}

// ---------------------------------------------------------------------------------------------
// TLS
// ---------------------------------------------------------------------------------------------

/// A throwaway certificate authority that issues server certificates.
pub(crate) struct TestCa {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl TestCa {
    pub(crate) fn new() -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(DnType::CommonName, "Iteron network tests CA");
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// The CA certificate, PEM: what an operator would configure as `extra_roots_pem`.
    pub(crate) fn pem(&self) -> Vec<u8> {
        self.cert_pem.clone().into_bytes()
    }

    /// A server configuration presenting a fresh leaf for `names` (DNS names or IP addresses).
    pub(crate) fn server_config(&self, names: &[&str]) -> Arc<ServerConfig> {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                .unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or("leaf"));
        let leaf = params.signed_by(&key, &self.issuer).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .unwrap();
        Arc::new(config)
    }
}
