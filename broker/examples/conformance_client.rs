//! The client the official MCP conformance suite drives (`tests/mcp_conformance/run.py`).
//!
//! Contract (from the suite's runner): the server URL is the last argument;
//! `MCP_CONFORMANCE_SCENARIO` names the scenario, `MCP_CONFORMANCE_PROTOCOL_VERSION` the version
//! under test, and `MCP_CONFORMANCE_CONTEXT` (JSON) carries scenario data. It uses Iteron's own
//! client exactly as the broker does — the same network layer (loopback zone), the same
//! negotiation, envelope, headers and MRTR code — with the version pinned to the one under test
//! and an elicitor that accepts forms with their defaults (the suite's scenarios expect that).
//! Exit code 0 when the scenario's client side completed, 1 otherwise.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test driver: any failure is reported and exits non-zero"
)]

use std::sync::Arc;

use iteron_broker::mcp::client::{Client, Options};
use iteron_broker::mcp::elicit::AcceptDefaults;
use iteron_broker::mcp::version::{Version, VersionPolicy};
use iteron_broker::net::{Net, NetConfig};
use iteron_policy::url::EndpointUrl;
use iteron_policy::zone::Zone;
use reqwest::header::HeaderMap;
use serde_json::{Map, Value, json};

fn args(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

async fn run(
    url: &str,
    scenario: &str,
    version: Option<Version>,
    context: Value,
) -> Result<(), String> {
    let net = Net::new(NetConfig::default()).map_err(|e| e.to_string())?;
    let client = net.client(Zone::Loopback).map_err(|e| e.to_string())?;
    let url = EndpointUrl::parse(url).map_err(|e| e.to_string())?;
    let opts = Options {
        version: version.map_or(VersionPolicy::Auto, VersionPolicy::Pin),
        name: "iteron-conformance-client".into(),
        elicitor: Some(Arc::new(AcceptDefaults)),
        ..Options::default()
    };
    let mcp = Client::connect_http(client, url, HeaderMap::new(), opts)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let e = |what: &str| {
        let what = what.to_owned();
        move |err: iteron_broker::mcp::client::McpError| format!("{what}: {err}")
    };
    match scenario {
        "initialize" => {}
        "tools_call" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            mcp.call_tool("add_numbers", args(json!({"a": 5, "b": 3})))
                .await
                .map_err(e("tools/call"))?;
        }
        "elicitation-sep1034-client-defaults" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            mcp.call_tool("test_client_elicitation_defaults", Map::new())
                .await
                .map_err(e("tools/call"))?;
        }
        "sep-2322-client-request-state" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            for tool in [
                "test_mrtr_echo_state",
                "test_mrtr_unrelated",
                "test_mrtr_no_state",
                "test_mrtr_no_result_type",
            ] {
                mcp.call_tool(tool, Map::new()).await.map_err(e(tool))?;
            }
        }
        "http-standard-headers" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            for tool in ["test_headers", "my-hyphenated-tool"] {
                mcp.call_tool(tool, Map::new()).await.map_err(e(tool))?;
            }
            for uri in [
                "file:///path/to/file%20name.txt",
                "https://example.com/resource?id=123",
            ] {
                mcp.read_resource(uri).await.map_err(e("resources/read"))?;
            }
            mcp.get_prompt("test_prompt", Map::new())
                .await
                .map_err(e("prompts/get"))?;
        }
        "http-custom-headers" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            let calls = context
                .get("toolCalls")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for call in calls {
                let name = call
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                let arguments = call
                    .get("arguments")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                mcp.call_tool(&name, arguments)
                    .await
                    .map_err(e("tools/call"))?;
            }
        }
        "http-invalid-tool-headers" => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
            mcp.call_tool("valid_tool", Map::new())
                .await
                .map_err(e("tools/call"))?;
        }
        "json-schema-2020-12-preservation" => {
            let tools = mcp.list_tools().await.map_err(e("tools/list"))?;
            let schema = tools
                .iter()
                .find(|t| t.name == "json_schema_2020_12_tool")
                .map(|t| t.input_schema.clone())
                .ok_or("json_schema_2020_12_tool is not listed")?;
            mcp.call_tool("json_schema_echo", args(json!({"schema": schema})))
                .await
                .map_err(e("tools/call"))?;
        }
        // request-metadata, json-schema-ref-no-deref and anything else: list the tools.
        _ => {
            mcp.list_tools().await.map_err(e("tools/list"))?;
        }
    }
    mcp.close().await;
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let url = std::env::args().next_back().unwrap_or_default();
    let scenario = std::env::var("MCP_CONFORMANCE_SCENARIO").unwrap_or_default();
    let version = std::env::var("MCP_CONFORMANCE_PROTOCOL_VERSION")
        .ok()
        .and_then(|v| Version::parse(&v));
    let context: Value = std::env::var("MCP_CONFORMANCE_CONTEXT")
        .ok()
        .and_then(|c| serde_json::from_str(&c).ok())
        .unwrap_or(Value::Null);
    match run(&url, &scenario, version, context).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("conformance client: {scenario}: {why}");
            std::process::ExitCode::FAILURE
        }
    }
}
