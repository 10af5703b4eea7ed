//! The benchmarks' stdio MCP fixture: a minimal server (stateful 2025-11-25 handshake, one
//! `echo` tool) with no dependencies beyond serde_json, so a benchmark measures its client or
//! the broker, not a server. Benchmarks re-execute themselves with `--serve` to run it. Shared
//! by `broker/benches/stdio_call.rs` and `cli/benches/broker.rs`.

use std::io::{BufRead, Write};

use serde_json::{Value, json};

/// Serve on stdin/stdout until end of input.
pub(crate) fn serve() {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let Some(id) = msg.get("id").cloned() else {
            continue;
        };
        let method = msg.get("method").and_then(Value::as_str).unwrap_or("");
        let result = match method {
            "initialize" => json!({"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                                   "serverInfo": {"name": "bench-fixture", "version": "1"}}),
            "tools/list" => json!({"tools": [{"name": "echo", "description": "Echo.",
                "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}]}),
            "tools/call" => {
                let text = msg["params"]["arguments"]["text"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned();
                json!({"content": [{"type": "text", "text": text}], "isError": false})
            }
            _ => {
                let reply = json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "Method not found"}});
                writeln!(out, "{reply}").unwrap();
                out.flush().unwrap();
                continue;
            }
        };
        writeln!(
            out,
            "{}",
            json!({"jsonrpc": "2.0", "id": id, "result": result})
        )
        .unwrap();
        out.flush().unwrap();
    }
}
