//! Version negotiation: the 2026-07-28 probe, the fall-back to the stateful `initialize` only on
//! an explicit legacy signal, and the capabilities the client advertises.

use std::sync::atomic::Ordering;

use reqwest::header::HeaderMap;
use serde_json::{Map, Value, json};

use iteron_policy::text;

use super::{
    Client, Era, LEGACY_SIGNATURE_STATUS, META_SERVER_INFO, McpError, Options, Transport,
    protocol_error,
};
use crate::mcp::jsonrpc::{Certainty, RpcError, codes};
use crate::mcp::version::{self, REFUSED, Version};
use crate::mcp::{TransportError, TransportErrorKind};

pub(super) fn capabilities(opts: &Options, era: Era, _http: bool) -> Value {
    let mut caps = Map::new();
    if opts.elicitor.is_some() {
        // Server requests are routed to the elicitor on every transport (the stdio reader
        // answers them while a call is in flight), so every era advertises forms.
        match era {
            Era::Legacy(Version::V2025_06_18) => {
                caps.insert("elicitation".into(), json!({}));
            }
            _ => {
                caps.insert("elicitation".into(), json!({"form": {}}));
            }
        }
    }
    Value::Object(caps)
}

impl Client {
    pub(super) fn set_era(&self, era: Era) {
        if let Ok(mut e) = self.era.lock() {
            *e = era;
        }
    }

    fn record_server_info(&self, info: Option<&Value>) {
        let Some(info) = info else { return };
        let name = info.get("name").and_then(Value::as_str).unwrap_or("");
        let version = info.get("version").and_then(Value::as_str).unwrap_or("");
        if let Ok(mut s) = self.server_info.lock() {
            *s = Some((
                text::single_line_capped(name, 100),
                text::single_line_capped(version, 50),
            ));
        }
    }

    /// Probe 2026-07-28 with `server/discover`; fall back only on an explicit legacy signal.
    pub(super) async fn negotiate(&self) -> Result<(), McpError> {
        let outcome = self
            .exchange(
                "server/discover",
                Map::new(),
                None,
                self.opts.request_deadline,
                false,
            )
            .await;
        match outcome {
            Ok(result) => {
                let supported: Vec<String> = result
                    .get("supportedVersions")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|v| v.as_str().map(str::to_owned))
                            .collect()
                    })
                    .ok_or_else(|| {
                        protocol_error(
                            "server/discover result has no supportedVersions",
                            Certainty::Applied,
                        )
                    })?;
                self.record_server_info(
                    result
                        .get("_meta")
                        .and_then(|m| m.get(META_SERVER_INFO))
                        .or_else(|| result.get("serverInfo")),
                );
                match version::best_common(&supported) {
                    Some(v) if v.is_modern() => {
                        self.set_era(Era::Modern(v));
                        Ok(())
                    }
                    Some(v) => self.initialize(v).await,
                    None => Err(McpError::NoCommonVersion),
                }
            }
            Err(McpError::Rpc { error, .. }) => {
                let legacy = match error.code {
                    codes::METHOD_NOT_FOUND => true,
                    codes::UNSUPPORTED_VERSION => {
                        // exchange() already retried with any modern version on offer; what
                        // remains is a list of 2025 versions (legacy) or nothing we speak.
                        let supported = supported_list(&error);
                        match version::best_common(&supported) {
                            Some(v) if !v.is_modern() => return self.initialize(v).await,
                            _ => return Err(McpError::NoCommonVersion),
                        }
                    }
                    codes::HEADER_MISMATCH | codes::MISSING_CAPABILITY | codes::INVALID_PARAMS => {
                        false
                    }
                    // On HTTP any other JSON-RPC error to the probe that came with a 400 Bad
                    // Request (e.g. -32000 "Server not initialized", -32600 "Missing session
                    // ID") is the legacy signature the spec names; errors with any other status
                    // (404, 429, a 5xx, a 2xx) are failures, reported as such.
                    _ => self.http_transport && error.http_status == Some(LEGACY_SIGNATURE_STATUS),
                };
                if legacy {
                    self.initialize(Version::LATEST_LEGACY).await
                } else {
                    Err(McpError::Rpc {
                        error,
                        certainty: Certainty::NotSent,
                    })
                }
            }
            Err(McpError::Transport(TransportError {
                kind: TransportErrorKind::Status { status, .. },
                ..
            })) if self.http_transport && status == LEGACY_SIGNATURE_STATUS => {
                self.initialize(Version::LATEST_LEGACY).await
            }
            Err(other) => Err(other),
        }
    }

    /// The stateful handshake.
    pub(super) async fn initialize(&self, offer: Version) -> Result<(), McpError> {
        let era = Era::Legacy(offer);
        self.set_era(era);
        if let Transport::Http(h) = &*self.transport() {
            h.set_protocol_header(None);
            h.clear_session();
        }
        let params = json!({
            "protocolVersion": offer.as_str(),
            "capabilities": capabilities(&self.opts, era, self.http_transport),
            "clientInfo": {"name": self.opts.name, "version": self.opts.version_string},
        });
        let id = self.fresh_id();
        let result = self
            .raw(
                &id,
                "initialize",
                Some(params),
                HeaderMap::new(),
                self.opts.request_deadline,
                true,
            )
            .await?
            .map_err(|error| McpError::Rpc {
                certainty: if error.is_rejection() {
                    Certainty::NotSent
                } else {
                    Certainty::Applied
                },
                error,
            })?;
        let negotiated = result
            .get("protocolVersion")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                protocol_error(
                    "initialize result has no protocolVersion",
                    Certainty::Applied,
                )
            })?;
        let v = match Version::parse(negotiated) {
            Some(v) if !v.is_modern() => v,
            _ => {
                let shown = if REFUSED.contains(&negotiated) {
                    negotiated.to_owned()
                } else {
                    text::single_line_capped(negotiated, 40)
                };
                return Err(McpError::UnsupportedVersion(shown));
            }
        };
        self.record_server_info(result.get("serverInfo"));
        self.set_era(Era::Legacy(v));
        if let Transport::Http(h) = &*self.transport() {
            h.set_protocol_header(Some(v.as_str()));
        }
        self.notify("notifications/initialized").await?;
        if let Transport::Http(h) = &*self.transport() {
            h.open_listener().await;
        }
        self.session_lost.store(false, Ordering::SeqCst);
        Ok(())
    }
}

pub(super) fn supported_list(error: &RpcError) -> Vec<String> {
    error
        .data
        .as_ref()
        .and_then(|d| d.get("supported"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}
