//! HTTP connections: the configured headers, the bearer header and the client of the
//! endpoint's binding zone.

use std::ffi::OsString;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

use iteron_policy::config::{NetworkConfig, ServerConfig, Transport};

use super::{ConnectError, SpawnContext, connect};
use crate::mcp::client::{Client, Options};
use crate::net::{Net, NetConfig, endpoint_zone};

fn secret_header(value: OsString, name: &str) -> Result<HeaderValue, ConnectError> {
    let s = zeroize::Zeroizing::new(
        value
            .into_string()
            .map_err(|_| ConnectError::BadHeaderValue(name.to_owned()))?,
    );
    let mut v = HeaderValue::from_str(s.as_str())
        .map_err(|_| ConnectError::BadHeaderValue(name.to_owned()))?;
    v.set_sensitive(true);
    Ok(v)
}

pub(super) fn bearer_header(
    token: &crate::oauth::SecretString,
    what: &str,
) -> Result<HeaderValue, ConnectError> {
    use secrecy::ExposeSecret;
    secret_header(
        OsString::from(format!("Bearer {}", token.expose_secret())),
        what,
    )
}

/// The headers the configuration names (`header_env`), with their values from `lookup`.
pub(super) fn configured_headers(
    h: &iteron_policy::config::HttpServer,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
) -> Result<HeaderMap, ConnectError> {
    let mut headers = HeaderMap::new();
    for (header, var) in &h.header_env {
        let value =
            lookup(var.as_str()).ok_or_else(|| ConnectError::MissingVariable(var.to_string()))?;
        let name = HeaderName::from_bytes(header.as_str().as_bytes())
            .map_err(|_| ConnectError::BadHeaderValue(var.to_string()))?;
        headers.insert(name, secret_header(value, var.as_str())?);
    }
    Ok(headers)
}

/// Connect to an HTTP server through the client of its binding zone.
pub(super) async fn connect_http_with(
    h: &iteron_policy::config::HttpServer,
    network: &NetworkConfig,
    headers: HeaderMap,
    opts: Options,
) -> Result<Client, ConnectError> {
    let zone = endpoint_zone(&h.url).map_err(ConnectError::Net)?;
    let net = Net::new(NetConfig::from_operator(network).map_err(ConnectError::Net)?)
        .map_err(ConnectError::Net)?;
    let client = net.client(zone).map_err(ConnectError::Net)?;
    Client::connect_http(client, h.url.clone(), headers, opts)
        .await
        .map_err(ConnectError::Mcp)
}

/// Connect with the stored credential's token source in `opts`: the transport asks it for the
/// token before every request (no token rides in the fixed headers, where it would outlive its
/// expiry or a logout).
pub(super) async fn connect_bearer(
    server: &ServerConfig,
    network: &NetworkConfig,
    lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    opts: Options,
    ctx: &SpawnContext,
) -> Result<Client, ConnectError> {
    let Transport::Http(h) = &server.transport else {
        return connect(server, network, lookup, opts, ctx).await;
    };
    let headers = configured_headers(h, lookup)?;
    connect_http_with(h, network, headers, opts).await
}
