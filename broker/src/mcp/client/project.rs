//! Projecting a result's content to text for the agent.

use serde_json::Value;

use iteron_policy::text;

/// A tool call's result, projected to text for the agent.
#[derive(Debug, Clone, PartialEq)]
pub struct Projected {
    /// The text content, joined.
    pub text: String,
    /// Whether the server flagged the result as an error.
    pub is_error: bool,
    /// Notes on what was dropped (images, audio, …).
    pub notes: Vec<String>,
    /// The raw result (for the conformance client and diagnostics).
    pub raw: Value,
}

/// Project a `CallToolResult`/`GetPromptResult`-style content list to text. Text items are
/// kept; embedded text resources are kept; images and audio are dropped with a note.
pub fn project(result: &Value) -> Projected {
    let mut parts = Vec::new();
    let mut notes = Vec::new();
    let items = result
        .get("content")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for item in &items {
        match item.get("type").and_then(Value::as_str) {
            Some("text") => {
                if let Some(t) = item.get("text").and_then(Value::as_str) {
                    parts.push(t.to_owned());
                }
            }
            Some(kind @ ("image" | "audio")) => {
                let mime = item
                    .get("mimeType")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown type");
                notes.push(text::single_line_capped(
                    &format!(
                        "{kind} content ({mime}) dropped: iteron projects results to text only"
                    ),
                    200,
                ));
            }
            Some("resource") => {
                match item
                    .get("resource")
                    .and_then(|r| r.get("text"))
                    .and_then(Value::as_str)
                {
                    Some(t) => parts.push(t.to_owned()),
                    None => notes.push("binary embedded resource dropped".into()),
                }
            }
            Some("resource_link") => {
                let uri = item.get("uri").and_then(Value::as_str).unwrap_or("");
                parts.push(format!(
                    "[resource link: {}]",
                    text::single_line_capped(uri, 300)
                ));
            }
            _ => notes.push("content of an unknown type dropped".into()),
        }
    }
    if parts.is_empty()
        && let Some(s) = result.get("structuredContent")
    {
        parts.push(s.to_string());
    }
    Projected {
        text: parts.join("\n"),
        is_error: result
            .get("isError")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        notes,
        raw: result.clone(),
    }
}
