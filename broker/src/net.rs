//! The one place that builds HTTP clients. Every byte the broker sends over a network goes
//! through a [`ZoneClient`] made here.
//!
//! What it guarantees, and why:
//! - **Zones.** A client is bound to a zone ([`iteron_policy::zone`]); it reaches that zone or
//!   lower, never upward. Host names are resolved by [`PinnedResolver`], which classifies
//!   *every* address of an answer and refuses the whole answer when any address is rejected,
//!   above the binding zone, or when the answer spans zones (hickory's own answer filter drops
//!   addresses silently instead). IP-literal hosts never reach a resolver in reqwest, so
//!   [`ZoneClient::check_target`] classifies them here, before any connection.
//! - **No rebinding window.** The addresses the resolver validated are exactly the ones reqwest
//!   connects to: there is no second lookup between check and connect.
//! - **One client per zone.** The connection pool is keyed by host, so a pooled connection made
//!   under one zone policy is never reused under another: [`Net::client`] keeps one reqwest client
//!   per binding zone and never shares it.
//! - **No environment.** No proxy (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY` are ignored), and a
//!   pinned root store: the web PKI roots compiled in plus an optional operator CA bundle — never
//!   `SSL_CERT_FILE`/`SSL_CERT_DIR` or the platform store.
//! - **No redirects.** A 3xx is returned to no one: it becomes [`NetError::Redirect`], which
//!   names the `Location` (redacted and made terminal-safe) and is never followed.
//! - **Bounds.** Connect, request and idle deadlines, and body readers with byte caps that fail
//!   one byte over.
//!
//! Error texts are single lines that say what was decided and contain no secret: URLs are shown
//! as `host:port`, never with a path or query.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{
    ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use iteron_policy::config::NetworkConfig;
use iteron_policy::text;
use iteron_policy::url::EndpointUrl;
use iteron_policy::zone::{self, Rejected, Zone};
use reqwest::header::HeaderMap;
use reqwest::{Method, StatusCode};

/// Connect deadline.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Whole-request deadline (headers and body).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest silence while reading a body.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default cap on a response body.
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Most addresses accepted in one DNS answer.
pub const MAX_ANSWER_ADDRESSES: usize = 32;
/// Longest `Location` shown in a redirect error, in bytes.
const MAX_LOCATION_SHOWN: usize = 200;

/// Where DNS questions go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dns {
    /// The system `resolv.conf`, and the hosts file first.
    System,
    /// Exactly these servers (UDP and TCP); the hosts file is not consulted. The RFC 6761
    /// special names are still answered by the resolver itself (`localhost`, `*.localhost` →
    /// loopback, then judged like any answer; `.invalid` → no such name).
    Nameservers(Vec<SocketAddr>),
}

impl Dns {
    /// The DNS servers the operator configured (`network.nameservers`), else the system's.
    pub fn of(network: &NetworkConfig) -> Dns {
        if network.nameservers.is_empty() {
            Dns::System
        } else {
            Dns::Nameservers(network.nameservers.iter().map(|n| n.0).collect())
        }
    }
}

/// Settings of the network layer. Build it from the operator configuration; tests build it
/// directly (the same public constructor, no test-only switch).
#[derive(Clone)]
pub struct NetConfig {
    /// DNS servers.
    pub dns: Dns,
    /// Extra trusted roots (PEM bundle contents), added to the built-in web PKI roots.
    pub extra_roots_pem: Option<Vec<u8>>,
    /// Connect deadline.
    pub connect_timeout: Duration,
    /// Whole-request deadline.
    pub request_timeout: Duration,
    /// Longest silence while reading a body.
    pub idle_timeout: Duration,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            dns: Dns::System,
            extra_roots_pem: None,
            connect_timeout: CONNECT_TIMEOUT,
            request_timeout: REQUEST_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
        }
    }
}

/// Largest operator CA bundle read, in bytes.
pub const MAX_CA_BUNDLE_BYTES: u64 = 1024 * 1024;

impl NetConfig {
    /// The settings the operator configured: nameservers (else the system configuration) and the
    /// CA bundle, read here once (a regular file, not a symlink, at most
    /// [`MAX_CA_BUNDLE_BYTES`]).
    pub fn from_operator(network: &NetworkConfig) -> Result<NetConfig, NetError> {
        let dns = Dns::of(network);
        let extra_roots_pem = match &network.ca_bundle {
            None => None,
            Some(path) => Some(read_ca_bundle(std::path::Path::new(path.as_str()))?),
        };
        Ok(NetConfig {
            dns,
            extra_roots_pem,
            ..NetConfig::default()
        })
    }
}

fn read_ca_bundle(path: &std::path::Path) -> Result<Vec<u8>, NetError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let shown = text::single_line_capped(&path.display().to_string(), 200);
    let fail = |why: String| NetError::Roots(format!("{shown}: {why}"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)
        .map_err(|e| fail(e.to_string()))?;
    let meta = file.metadata().map_err(|e| fail(e.to_string()))?;
    if !meta.is_file() {
        return Err(fail("not a regular file".into()));
    }
    let mut pem = Vec::new();
    file.take(MAX_CA_BUNDLE_BYTES + 1)
        .read_to_end(&mut pem)
        .map_err(|e| fail(e.to_string()))?;
    if pem.len() as u64 > MAX_CA_BUNDLE_BYTES {
        return Err(fail(format!("larger than {MAX_CA_BUNDLE_BYTES} bytes")));
    }
    Ok(pem)
}

/// Everything the network layer can refuse or fail with. `Display` is one line, no secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetError {
    /// An address is above the binding zone.
    AboveZone {
        /// The host name or literal.
        host: String,
        /// The address.
        addr: IpAddr,
        /// Its zone.
        zone: Zone,
        /// The client's binding zone.
        binding: Zone,
    },
    /// An address in a range that is never a destination.
    RejectedAddress {
        /// The host name or literal.
        host: String,
        /// The address.
        addr: IpAddr,
        /// Why.
        kind: Rejected,
    },
    /// One answer held addresses of different zones.
    MixedZones {
        /// The host name.
        host: String,
        /// The first address and its zone.
        first: (IpAddr, Zone),
        /// An address of another zone.
        other: (IpAddr, Zone),
    },
    /// More addresses than [`MAX_ANSWER_ADDRESSES`].
    TooManyAddresses {
        /// The host name.
        host: String,
    },
    /// The name did not resolve.
    Resolve {
        /// The host name.
        host: String,
        /// The resolver's reason, sanitized.
        reason: String,
    },
    /// The DNS configuration could not be loaded.
    DnsConfig(String),
    /// The URL is not acceptable for this client.
    Url(String),
    /// A 3xx answer; never followed.
    Redirect {
        /// The status code.
        status: u16,
        /// The origin (`scheme://host:port`) of the `Location` header, made terminal-safe; its
        /// path and query are never shown. `(none)` or `(unparsable)` otherwise.
        location: String,
    },
    /// The body exceeded its cap.
    BodyTooLarge {
        /// The cap in bytes.
        limit: usize,
    },
    /// A deadline passed.
    Timeout {
        /// Which one.
        phase: &'static str,
    },
    /// Connecting (TCP or TLS) failed.
    Connect {
        /// `host:port`.
        target: String,
        /// The reason, sanitized.
        reason: String,
    },
    /// The HTTP exchange failed after connecting.
    Http {
        /// The reason, sanitized.
        reason: String,
    },
    /// The TLS roots could not be loaded.
    Roots(String),
}

impl fmt::Display for NetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetError::AboveZone {
                host,
                addr,
                zone,
                binding,
            } => {
                if host == &addr.to_string() {
                    write!(f, "refused: {addr} is {zone}, above binding zone {binding}")
                } else {
                    write!(
                        f,
                        "refused: {host} resolved to {addr} ({zone}), above binding zone {binding}"
                    )
                }
            }
            NetError::RejectedAddress { host, addr, kind } => {
                if host == &addr.to_string() {
                    write!(f, "refused: {addr} is a {kind} address")
                } else {
                    write!(f, "refused: {host} resolved to {addr}, a {kind} address")
                }
            }
            NetError::MixedZones { host, first, other } => write!(
                f,
                "refused: {host} resolved to addresses in different zones ({} is {}, {} is {})",
                first.0, first.1, other.0, other.1
            ),
            NetError::TooManyAddresses { host } => write!(
                f,
                "refused: {host} resolved to more than {MAX_ANSWER_ADDRESSES} addresses"
            ),
            NetError::Resolve { host, reason } => {
                write!(f, "cannot resolve {host}: {reason}")
            }
            NetError::DnsConfig(r) => write!(f, "cannot load the DNS configuration: {r}"),
            NetError::Url(r) => write!(f, "refused URL: {r}"),
            NetError::Redirect { status, location } => write!(
                f,
                "refused redirect: the server answered {status} with a Location at {location} \
                 (path and query not shown); redirects are never followed"
            ),
            NetError::BodyTooLarge { limit } => {
                write!(f, "response body exceeds the {limit}-byte limit")
            }
            NetError::Timeout { phase } => write!(f, "deadline exceeded while {phase}"),
            NetError::Connect { target, reason } => {
                write!(f, "cannot connect to {target}: {reason}")
            }
            NetError::Http { reason } => write!(f, "HTTP exchange failed: {reason}"),
            NetError::Roots(r) => write!(f, "cannot load TLS roots: {r}"),
        }
    }
}

impl std::error::Error for NetError {}

fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Another component may have installed the same provider already; either way a process
        // default exists afterwards, which is all reqwest needs.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn load_roots(extra_pem: Option<&[u8]>) -> Result<Vec<reqwest::Certificate>, NetError> {
    let mut roots = Vec::with_capacity(webpki_root_certs::TLS_SERVER_ROOT_CERTS.len() + 4);
    for der in webpki_root_certs::TLS_SERVER_ROOT_CERTS {
        roots.push(
            reqwest::Certificate::from_der(der.as_ref())
                .map_err(|e| NetError::Roots(e.to_string()))?,
        );
    }
    if let Some(pem) = extra_pem {
        let extra = reqwest::Certificate::from_pem_bundle(pem)
            .map_err(|_| NetError::Roots("the operator CA bundle is not valid PEM".into()))?;
        if extra.is_empty() {
            return Err(NetError::Roots(
                "the operator CA bundle holds no certificate".into(),
            ));
        }
        roots.extend(extra);
    }
    Ok(roots)
}

/// The network layer: one shared DNS transport, the pinned roots, and one HTTP client per
/// binding zone.
pub struct Net {
    config: NetConfig,
    dns: TokioResolver,
    roots: Vec<reqwest::Certificate>,
    clients: Mutex<HashMap<Zone, ZoneClient>>,
}

impl Net {
    /// Build the network layer. Must be called inside a tokio runtime when `dns` is used.
    pub fn new(config: NetConfig) -> Result<Net, NetError> {
        install_crypto_provider();
        let roots = load_roots(config.extra_roots_pem.as_deref())?;
        let dns = build_hickory(&config.dns)?;
        Ok(Net {
            config,
            dns,
            roots,
            clients: Mutex::new(HashMap::new()),
        })
    }

    /// The client for requests bound to `binding`. The same zone always gets the same client;
    /// different zones never share one.
    pub fn client(&self, binding: Zone) -> Result<ZoneClient, NetError> {
        let mut clients = self.clients.lock().map_err(|_| NetError::Http {
            reason: "client table poisoned".into(),
        })?;
        if let Some(c) = clients.get(&binding) {
            return Ok(c.clone());
        }
        let resolver = PinnedResolver::with_inner(self.dns.clone(), binding);
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .tls_certs_only(self.roots.iter().cloned())
            .dns_resolver(resolver.clone())
            .connect_timeout(self.config.connect_timeout)
            .timeout(self.config.request_timeout)
            // reqwest's default policy resends a request (body included) that an HTTP/2
            // server refused or dropped at GOAWAY; a broker never resends anything on its own.
            .retry(reqwest::retry::never())
            // Shorter than common server keep-alive timeouts (Node: 5 s), so a request never
            // races a server closing an idle connection (which would make it maybe_applied).
            .pool_idle_timeout(Duration::from_secs(4))
            .user_agent(concat!("iteron/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| NetError::Http {
                reason: sanitize_reqwest(&e),
            })?;
        let client = ZoneClient {
            inner: Arc::new(ClientInner {
                binding,
                http,
                idle_timeout: self.config.idle_timeout,
            }),
        };
        clients.insert(binding, client.clone());
        Ok(client)
    }
}

struct ClientInner {
    binding: Zone,
    http: reqwest::Client,
    idle_timeout: Duration,
}

/// An HTTP client bound to one zone. Cheap to clone (clones share the connection pool, which is
/// only ever used under this one zone).
#[derive(Clone)]
pub struct ZoneClient {
    inner: Arc<ClientInner>,
}

/// A request: method, URL, headers and an optional body.
pub struct Request {
    /// The method.
    pub method: Method,
    /// The URL; it already passed the endpoint rules.
    pub url: EndpointUrl,
    /// Headers to send.
    pub headers: HeaderMap,
    /// The body.
    pub body: Option<Vec<u8>>,
    /// A whole-request deadline other than the client's (long-lived streams).
    pub timeout: Option<Duration>,
}

impl Request {
    /// A request with no headers and no body.
    pub fn new(method: Method, url: EndpointUrl) -> Request {
        Request {
            method,
            url,
            headers: HeaderMap::new(),
            body: None,
            timeout: None,
        }
    }
}

impl fmt::Debug for Response {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Response")
            .field("status", &self.inner.status())
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

/// A response whose status is not a redirect. Read the body with [`Response::body`] or
/// [`Response::next_chunk`], both bounded.
pub struct Response {
    inner: reqwest::Response,
    idle_timeout: Duration,
    target: String,
}

impl ZoneClient {
    /// The binding zone.
    pub fn binding(&self) -> Zone {
        self.inner.binding
    }

    /// Check a URL before any connection: the endpoint rules already hold (it is an
    /// [`EndpointUrl`]); an IP-literal host is classified here, because reqwest never asks the
    /// resolver about literals.
    pub fn check_target(&self, url: &EndpointUrl) -> Result<(), NetError> {
        match target_host(url) {
            TargetHost::Literal(ip) => {
                judge_answer(&ip.to_string(), self.inner.binding, &[ip]).map(|_| ())
            }
            TargetHost::Name(_) => Ok(()),
            TargetHost::Missing => Err(NetError::Url("the URL has no host".into())),
        }
    }

    /// Send one request. Never follows a redirect: any 3xx is [`NetError::Redirect`].
    pub async fn send(&self, req: Request) -> Result<Response, NetError> {
        self.check_target(&req.url)?;
        let target = target_of(&req.url);
        let mut builder = self
            .inner
            .http
            .request(req.method, req.url.as_url().clone())
            .headers(req.headers);
        if let Some(body) = req.body {
            builder = builder.body(body);
        }
        if let Some(t) = req.timeout {
            builder = builder.timeout(t);
        }
        let resp = builder
            .send()
            .await
            .map_err(|e| map_reqwest(&e, &target, "waiting for the response"))?;
        if resp.status().is_redirection() {
            // Only the origin of the Location is shown: its path and query may carry an
            // authorization code, a signature or a reset token.
            let location = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .map_or_else(
                    || "(none)".to_owned(),
                    |l| match req.url.as_url().join(&l) {
                        Ok(u) => {
                            let origin = match (u.host_str(), u.port_or_known_default()) {
                                (Some(h), Some(p)) => format!("{}://{h}:{p}", u.scheme()),
                                (Some(h), None) => format!("{}://{h}", u.scheme()),
                                _ => u.scheme().to_owned(),
                            };
                            text::single_line_capped(&origin, MAX_LOCATION_SHOWN)
                        }
                        Err(_) => "(unparsable)".to_owned(),
                    },
                );
            return Err(NetError::Redirect {
                status: resp.status().as_u16(),
                location,
            });
        }
        Ok(Response {
            inner: resp,
            idle_timeout: self.inner.idle_timeout,
            target,
        })
    }
}

impl Response {
    /// The status.
    pub fn status(&self) -> StatusCode {
        self.inner.status()
    }

    /// The headers.
    pub fn headers(&self) -> &HeaderMap {
        self.inner.headers()
    }

    /// Change the idle deadline of this body (long-lived streams whose server may be silent
    /// while it works; the whole-request deadline still applies).
    pub fn set_idle_timeout(&mut self, idle: Duration) {
        self.idle_timeout = idle;
    }

    /// The next piece of the body, waiting at most the idle deadline; `None` at the end.
    pub async fn next_chunk(&mut self) -> Result<Option<bytes::Bytes>, NetError> {
        match tokio::time::timeout(self.idle_timeout, self.inner.chunk()).await {
            Err(_) => Err(NetError::Timeout {
                phase: "reading the response body (idle)",
            }),
            Ok(r) => r.map_err(|e| map_reqwest(&e, &self.target, "reading the response body")),
        }
    }

    /// The whole body, at most `limit` bytes: one byte more fails with
    /// [`NetError::BodyTooLarge`] (a declared `Content-Length` over the limit fails before any
    /// byte is read).
    pub async fn body(mut self, limit: usize) -> Result<Vec<u8>, NetError> {
        if let Some(len) = self.inner.content_length()
            && len > u64::try_from(limit).unwrap_or(u64::MAX)
        {
            return Err(NetError::BodyTooLarge { limit });
        }
        let mut out = Vec::new();
        while let Some(chunk) = self.next_chunk().await? {
            if out.len() + chunk.len() > limit {
                return Err(NetError::BodyTooLarge { limit });
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }
}

/// The host of a URL as the connector will see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetHost {
    /// An IP literal: reqwest connects to it without asking any resolver.
    Literal(IpAddr),
    /// A name: it goes through the pinned resolver.
    Name(String),
    /// No host (cannot happen for an [`EndpointUrl`]; kept so the match is total).
    Missing,
}

/// The parsed host of `url` (never a reading of the string).
pub fn target_host(url: &EndpointUrl) -> TargetHost {
    match url.as_url().host() {
        Some(url::Host::Ipv4(v4)) => TargetHost::Literal(IpAddr::V4(v4)),
        Some(url::Host::Ipv6(v6)) => TargetHost::Literal(IpAddr::V6(v6)),
        Some(url::Host::Domain(d)) => TargetHost::Name(d.to_owned()),
        None => TargetHost::Missing,
    }
}

/// The binding zone of an HTTP server's endpoint: an IP literal is in its own zone, and
/// `localhost` is loopback; any other host name is bound to `public`, whatever its DNS answer
/// says today — so DNS can never move a server into a more privileged zone. (A binding recorded
/// at first login, or chosen by the operator, arrives with the credential store.)
pub fn endpoint_zone(server_url: &iteron_policy::url::EndpointUrl) -> Result<Zone, NetError> {
    match target_host(server_url) {
        TargetHost::Literal(ip) => judge_answer(&ip.to_string(), Zone::Loopback, &[ip]),
        TargetHost::Name(name) => {
            let bare = name.strip_suffix('.').unwrap_or(&name);
            Ok(if bare.eq_ignore_ascii_case("localhost") {
                Zone::Loopback
            } else {
                Zone::Public
            })
        }
        TargetHost::Missing => Err(NetError::Url("the URL has no host".into())),
    }
}

/// `host:port` of a URL: what errors may show (never the path or query).
fn target_of(url: &EndpointUrl) -> String {
    let u = url.as_url();
    let host = u.host_str().unwrap_or("?");
    match u.port_or_known_default() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_owned(),
    }
}

/// The innermost meaningful cause of a reqwest error, without the URL reqwest puts in its own
/// `Display` (a URL may carry a token in its query).
fn sanitize_reqwest(e: &reqwest::Error) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    let mut last = None;
    while let Some(s) = source {
        last = Some(s.to_string());
        source = s.source();
    }
    let reason = last.unwrap_or_else(|| {
        if e.is_body() {
            "malformed body".into()
        } else if e.is_decode() {
            "malformed response".into()
        } else {
            "request failed".into()
        }
    });
    text::single_line_capped(&reason, 200)
}

/// Map a reqwest error: our own resolver refusal comes back out typed; deadlines and connect
/// failures get their own variants.
fn map_reqwest(e: &reqwest::Error, target: &str, phase: &'static str) -> NetError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(refusal) = s.downcast_ref::<NetError>() {
            return refusal.clone();
        }
        source = s.source();
    }
    if e.is_timeout() {
        return NetError::Timeout {
            phase: if e.is_connect() { "connecting" } else { phase },
        };
    }
    if e.is_connect() {
        return NetError::Connect {
            target: target.to_owned(),
            reason: sanitize_reqwest(e),
        };
    }
    NetError::Http {
        reason: sanitize_reqwest(e),
    }
}

mod resolve;
pub use resolve::*;

#[cfg(test)]
mod tests;
