//! Turning a configured server into a connected MCP client. Shared by the operator commands
//! (`iteron mcp test|status|doctor`) and, later, the broker daemon.
//!
//! Secrets enter here and nowhere else: the values of variables the operator named
//! (`env`, `header_env`, `oauth.access_token_env`) are read through the lookup the caller
//! passes, go straight into the child's environment or into sensitive header values, and are
//! never stored, logged or shown.

use std::ffi::OsString;
use std::fmt;

use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};

use iteron_policy::config::{NetworkConfig, ServerConfig, Transport};
use iteron_policy::zone::Zone;

use crate::mcp::client::{Client, McpError, Options};
use crate::net::{Net, NetConfig, NetError, PinnedResolver, TargetHost, judge_answer, target_host};
use crate::spawn::{ChildSpec, child_env};

/// Why a configured server could not be connected.
#[derive(Debug)]
pub enum ConnectError {
    /// The MCP layer failed.
    Mcp(McpError),
    /// The network layer refused or failed.
    Net(NetError),
    /// A variable the configuration names is not set.
    MissingVariable(String),
    /// A variable's value cannot be an HTTP header value (the value is not shown).
    BadHeaderValue(String),
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectError::Mcp(e) => e.fmt(f),
            ConnectError::Net(e) => e.fmt(f),
            ConnectError::MissingVariable(n) => {
                write!(
                    f,
                    "environment variable {n} (named in the configuration) is not set"
                )
            }
            ConnectError::BadHeaderValue(n) => write!(
                f,
                "the value of environment variable {n} is not a valid HTTP header value"
            ),
        }
    }
}

impl std::error::Error for ConnectError {}

fn secret_header(value: OsString, name: &str) -> Result<HeaderValue, ConnectError> {
    let s = value
        .into_string()
        .map_err(|_| ConnectError::BadHeaderValue(name.to_owned()))?;
    let mut v =
        HeaderValue::from_str(&s).map_err(|_| ConnectError::BadHeaderValue(name.to_owned()))?;
    v.set_sensitive(true);
    Ok(v)
}

/// The zone an HTTP server's endpoint is in now: a literal is classified; a name is resolved
/// once and judged whole. (The binding recorded at first login arrives with OAuth.)
pub async fn endpoint_zone(
    server_url: &iteron_policy::url::EndpointUrl,
    network: &NetworkConfig,
) -> Result<Zone, NetError> {
    match target_host(server_url) {
        TargetHost::Literal(ip) => judge_answer(&ip.to_string(), Zone::Loopback, &[ip]),
        TargetHost::Name(name) => {
            let cfg = NetConfig::from_operator(network)?;
            let resolver = PinnedResolver::new(&cfg.dns, Zone::Loopback)?;
            let addrs = resolver.resolve_checked(&name).await?;
            judge_answer(&name, Zone::Loopback, &addrs)
        }
        TargetHost::Missing => Err(NetError::Url("the URL has no host".into())),
    }
}

/// Connect to a configured server.
pub async fn connect(
    server: &ServerConfig,
    network: &NetworkConfig,
    lookup: &dyn Fn(&str) -> Option<OsString>,
    opts: Options,
) -> Result<Client, ConnectError> {
    match &server.transport {
        Transport::Stdio(st) => {
            let (env, _missing) = child_env(&st.env, None, lookup);
            let spec = ChildSpec {
                command: st.command.as_str().to_owned(),
                args: st.args.clone(),
                env,
            };
            Client::connect_stdio(spec, opts)
                .await
                .map_err(ConnectError::Mcp)
        }
        Transport::Http(h) => {
            let mut headers = HeaderMap::new();
            for (header, var) in &h.header_env {
                let value = lookup(var.as_str())
                    .ok_or_else(|| ConnectError::MissingVariable(var.to_string()))?;
                let name = HeaderName::from_bytes(header.as_str().as_bytes())
                    .map_err(|_| ConnectError::BadHeaderValue(var.to_string()))?;
                headers.insert(name, secret_header(value, var.as_str())?);
            }
            if let Some(var) = h.oauth.as_ref().and_then(|o| o.access_token_env.as_ref()) {
                let token = lookup(var.as_str())
                    .ok_or_else(|| ConnectError::MissingVariable(var.to_string()))?;
                let mut bearer = OsString::from("Bearer ");
                bearer.push(token);
                headers.insert(AUTHORIZATION, secret_header(bearer, var.as_str())?);
            }
            let zone = endpoint_zone(&h.url, network)
                .await
                .map_err(ConnectError::Net)?;
            let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
                .map_err(ConnectError::Net)?;
            let client = net.client(zone).map_err(ConnectError::Net)?;
            Client::connect_http(client, h.url.clone(), headers, opts)
                .await
                .map_err(ConnectError::Mcp)
        }
    }
}
