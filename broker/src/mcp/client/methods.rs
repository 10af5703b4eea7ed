//! The MCP methods the client offers: listings (paginated, bounded, through the private cache),
//! `tools/call` with MRTR, `resources/read` and `prompts/get`.

use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use iteron_policy::names::ToolName;
use iteron_policy::text;

use super::server_requests::ask;
use super::{
    CacheEntry, Client, MAX_CACHE_BYTES, MAX_CACHE_ENTRIES, MAX_LIST_BYTES, MAX_LIST_ITEMS,
    MAX_LIST_PAGES, MAX_MRTR_INPUT_BYTES, MAX_MRTR_INPUT_REQUESTS, MAX_MRTR_ROUNDS, MAX_TOOLS,
    McpError, Projected, Transport, project, protocol_error,
};
use crate::mcp::headers::{self, ParamHeader};
use crate::mcp::jsonrpc::Certainty;

/// A tool as listed, with its schema kept verbatim (never dereferenced).
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// The name (valid by the MCP grammar).
    pub name: String,
    /// The description, terminal-safe and bounded.
    pub description: String,
    /// The input schema exactly as the server sent it.
    pub input_schema: Value,
    pub(super) headers: Vec<ParamHeader>,
}

/// A tool dropped from the catalog, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedTool {
    /// The name as sent (terminal-safe).
    pub name: String,
    /// Why.
    pub reason: String,
}

impl Client {
    fn cache_get(&self, key: &str) -> Option<Value> {
        let cache = self.cache.lock().ok()?;
        cache
            .iter()
            .find(|e| e.key == key && Instant::now() < e.expires)
            .map(|e| e.value.clone())
    }

    fn cache_put(&self, key: String, value: &Value) {
        // Only the modern era sends caching hints; an absent or non-positive ttlMs means 0.
        let ttl = value.get("ttlMs").and_then(Value::as_f64).unwrap_or(0.0);
        if ttl.is_nan() || ttl <= 0.0 {
            return;
        }
        let ttl = Duration::from_millis(ttl.min(86_400_000.0) as u64);
        let bytes = serde_json::to_vec(value).map_or(usize::MAX, |v| v.len());
        if bytes > MAX_CACHE_BYTES / 4 {
            return;
        }
        if let Ok(mut cache) = self.cache.lock() {
            cache.retain(|e| e.key != key && Instant::now() < e.expires);
            while cache.len() >= MAX_CACHE_ENTRIES
                || cache.iter().map(|e| e.bytes).sum::<usize>() + bytes > MAX_CACHE_BYTES
            {
                if cache.pop_front().is_none() {
                    break;
                }
            }
            cache.push_back(CacheEntry {
                key,
                value: value.clone(),
                bytes,
                expires: Instant::now() + ttl,
            });
        }
    }

    fn list_changed(&self) -> bool {
        match &*self.transport() {
            Transport::Stdio(t) => t.take_list_changed(),
            Transport::Http(t) => t.take_list_changed(),
        }
    }

    /// Every page of a listing, bounded in pages and items, through the private cache.
    async fn list_all(&self, method: &str, field: &str) -> Result<Vec<Value>, McpError> {
        if self.list_changed()
            && let Ok(mut c) = self.cache.lock()
        {
            c.clear();
        }
        let mut items = Vec::new();
        let mut listed_bytes = 0usize;
        let mut cursor: Option<String> = None;
        let mut seen_cursors = std::collections::HashSet::new();
        for _ in 0..MAX_LIST_PAGES {
            let mut params = Map::new();
            if let Some(c) = &cursor {
                params.insert("cursor".into(), c.clone().into());
            }
            let key = format!(
                "{}|{method}|{}|{}",
                self.era().version(),
                cursor.as_deref().unwrap_or(""),
                self.opts.auth_context
            );
            let page = match self.cache_get(&key) {
                Some(v) => v,
                None => {
                    let v = self
                        .exchange(method, params, None, self.opts.request_deadline, false)
                        .await?;
                    self.check_result_type(&v, false)?;
                    self.cache_put(key, &v);
                    v
                }
            };
            let list = page.get(field).and_then(Value::as_array).ok_or_else(|| {
                protocol_error(
                    format!("{method} result has no {field} list"),
                    Certainty::Applied,
                )
            })?;
            listed_bytes += serde_json::to_vec(list).map_or(usize::MAX, |v| v.len());
            if listed_bytes > MAX_LIST_BYTES {
                return Err(McpError::Limit {
                    what: "bytes in one listing",
                    max: MAX_LIST_BYTES,
                });
            }
            if items.len() + list.len() > MAX_LIST_ITEMS {
                return Err(McpError::Limit {
                    what: "items in one listing",
                    max: MAX_LIST_ITEMS,
                });
            }
            items.extend(list.iter().cloned());
            match page.get("nextCursor").and_then(Value::as_str) {
                Some(next) if !next.is_empty() => {
                    if !seen_cursors.insert(next.to_owned()) {
                        return Err(protocol_error(
                            "the server repeated a list cursor",
                            Certainty::Applied,
                        ));
                    }
                    cursor = Some(next.to_owned());
                }
                _ => return Ok(items),
            }
        }
        Err(McpError::Limit {
            what: "pages in one listing",
            max: MAX_LIST_PAGES,
        })
    }

    /// `resultType`: absent is complete; an unknown value is invalid; `input_required` only
    /// where MRTR is allowed.
    fn check_result_type(&self, v: &Value, mrtr_allowed: bool) -> Result<bool, McpError> {
        if !self.era().version().is_modern() {
            return Ok(false);
        }
        match v.get("resultType").and_then(Value::as_str) {
            None | Some("complete") => Ok(false),
            Some("input_required") if mrtr_allowed => Ok(true),
            Some("input_required") => Err(protocol_error(
                "the server asked for input on a request that cannot take it",
                Certainty::Applied,
            )),
            Some(_) => Err(protocol_error(
                "the server sent an unknown resultType",
                Certainty::Applied,
            )),
        }
    }

    /// The tool catalog. Tools with invalid names or invalid header annotations (HTTP, 2026) are
    /// dropped and reported by [`Client::dropped_tools`].
    pub async fn list_tools(&self) -> Result<Vec<Tool>, McpError> {
        let raw = self.list_all("tools/list", "tools").await?;
        if raw.len() > MAX_TOOLS {
            return Err(McpError::Limit {
                what: "tools",
                max: MAX_TOOLS,
            });
        }
        let check_headers = self.http_transport && self.era().version().is_modern();
        let mut tools = Vec::new();
        let mut dropped = Vec::new();
        for t in raw {
            let name = t.get("name").and_then(Value::as_str).unwrap_or("");
            let shown = text::single_line_capped(name, 128);
            if ToolName::parse(name).is_err() {
                dropped.push(DroppedTool {
                    name: shown,
                    reason: "the name is outside the MCP tool-name grammar".into(),
                });
                continue;
            }
            let schema = t.get("inputSchema").cloned().unwrap_or(Value::Null);
            let hdrs = if check_headers {
                match headers::param_headers(&schema) {
                    Ok(h) => h,
                    Err(e) => {
                        dropped.push(DroppedTool {
                            name: shown,
                            reason: format!("invalid x-mcp-header annotation ({e:?})"),
                        });
                        continue;
                    }
                }
            } else {
                Vec::new()
            };
            tools.push(Tool {
                name: name.to_owned(),
                description: text::single_line_capped(
                    t.get("description").and_then(Value::as_str).unwrap_or(""),
                    1024,
                ),
                input_schema: schema,
                headers: hdrs,
            });
        }
        if let Ok(mut map) = self.tools.lock() {
            map.clear();
            for t in &tools {
                map.insert(t.name.clone(), t.clone());
            }
        }
        if let Ok(mut d) = self.dropped.lock() {
            *d = dropped;
        }
        Ok(tools)
    }

    /// Call a tool. MRTR input requests go to the elicitor (if any); the call is never repeated
    /// after an unknown outcome.
    pub async fn call_tool(
        &self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<Projected, McpError> {
        let mut params = Map::new();
        params.insert("name".into(), name.into());
        params.insert("arguments".into(), Value::Object(arguments));
        for round in 0..=MAX_MRTR_ROUNDS {
            // Once a round reached the server, no later failure can say "not sent".
            let after = |error: McpError| {
                if round == 0 {
                    error
                } else {
                    McpError::AfterInputRounds {
                        rounds: round,
                        error: Box::new(error),
                    }
                }
            };
            let result = self
                .exchange(
                    "tools/call",
                    params.clone(),
                    Some(name),
                    self.opts.tool_call_deadline,
                    true,
                )
                .await
                .map_err(after)?;
            if !self.check_result_type(&result, true).map_err(after)? {
                return Ok(project(&result));
            }
            if round == MAX_MRTR_ROUNDS {
                // Never ask the operator for input that could not be sent.
                break;
            }
            // This round's input_required reached us: what fails from here follows a round
            // the server ran.
            let ran = |error: McpError| McpError::AfterInputRounds {
                rounds: round + 1,
                error: Box::new(error),
            };
            let responses = self.answer_input_requests(&result).await.map_err(ran)?;
            // The retry carries exactly this round's answers and state; nothing else.
            params.remove("inputResponses");
            params.remove("requestState");
            if let Some(r) = responses {
                params.insert("inputResponses".into(), r);
            }
            if let Some(state) = result.get("requestState") {
                params.insert("requestState".into(), state.clone());
            }
        }
        Err(McpError::AfterInputRounds {
            rounds: MAX_MRTR_ROUNDS + 1,
            error: Box::new(McpError::Limit {
                what: "input rounds in one tool call",
                max: MAX_MRTR_ROUNDS,
            }),
        })
    }

    async fn answer_input_requests(&self, result: &Value) -> Result<Option<Value>, McpError> {
        let Some(requests) = result.get("inputRequests") else {
            return Ok(None);
        };
        let requests = requests
            .as_object()
            .ok_or_else(|| protocol_error("inputRequests is not an object", Certainty::Applied))?;
        if requests.len() > MAX_MRTR_INPUT_REQUESTS {
            return Err(McpError::Limit {
                what: "input requests in one round",
                max: MAX_MRTR_INPUT_REQUESTS,
            });
        }
        let Some(elicitor) = self.opts.elicitor.clone() else {
            return Err(McpError::InputRefused(
                "this client is noninteractive, so the call fails closed".into(),
            ));
        };
        let mut out = Map::new();
        for (key, req) in requests {
            let method = req.get("method").and_then(Value::as_str).unwrap_or("");
            if method != "elicitation/create" {
                return Err(McpError::InputRefused(format!(
                    "{} requests are not supported",
                    text::single_line_capped(method, 60)
                )));
            }
            let params = req.get("params").cloned().unwrap_or(Value::Null);
            let answer = ask(&elicitor, &params)
                .await
                .map_err(|(_, why)| McpError::InputRefused(why))?;
            out.insert(key.clone(), answer);
        }
        let value = Value::Object(out);
        if serde_json::to_vec(&value).map_or(usize::MAX, |v| v.len()) > MAX_MRTR_INPUT_BYTES {
            return Err(McpError::Limit {
                what: "input bytes in one round",
                max: MAX_MRTR_INPUT_BYTES,
            });
        }
        Ok(Some(value))
    }

    /// Every resource.
    pub async fn list_resources(&self) -> Result<Vec<Value>, McpError> {
        self.list_all("resources/list", "resources").await
    }

    /// Read one resource (no MRTR: `input_required` is a protocol error).
    pub async fn read_resource(&self, uri: &str) -> Result<Value, McpError> {
        let mut params = Map::new();
        params.insert("uri".into(), uri.into());
        let v = self
            .exchange(
                "resources/read",
                params,
                Some(uri),
                self.opts.request_deadline,
                false,
            )
            .await?;
        self.check_result_type(&v, false)?;
        Ok(v)
    }

    /// Every prompt.
    pub async fn list_prompts(&self) -> Result<Vec<Value>, McpError> {
        self.list_all("prompts/list", "prompts").await
    }

    /// Get one prompt (no MRTR).
    pub async fn get_prompt(
        &self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<Value, McpError> {
        let mut params = Map::new();
        params.insert("name".into(), name.into());
        params.insert("arguments".into(), Value::Object(arguments));
        let v = self
            .exchange(
                "prompts/get",
                params,
                Some(name),
                self.opts.request_deadline,
                false,
            )
            .await?;
        self.check_result_type(&v, false)?;
        Ok(v)
    }
}
