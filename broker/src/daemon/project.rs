//! What the agent gets back from a server's answer: scrubbed, terminal-safe where it is only
//! read, exact where it is sent back, and bounded to [`MAX_RESULT_TEXT`] bytes of JSON.

use super::MAX_RESULT_TEXT;
use super::listing::MAX_LISTED;
use crate::ipc::proto::{self};
use crate::servers::KnownSecrets;
use iteron_policy::text;
use serde_json::{Value, json};

/// An untrusted string field of a server's answer, scrubbed and made terminal-safe.
pub(super) fn field(v: &Value, key: &str, secrets: &KnownSecrets, max: usize) -> Value {
    match v.get(key).and_then(Value::as_str) {
        Some(t) => Value::String(text::escape_capped(&secrets.scrub(t), max)),
        None => Value::Null,
    }
}

/// `t` scrubbed and cut to what is left of `*used`'s budget of [`MAX_RESULT_TEXT`] bytes of
/// JSON, which it then uses up.
pub(super) fn budgeted_text(
    t: &str,
    secrets: &KnownSecrets,
    used: &mut usize,
    notes: &mut Vec<String>,
) -> String {
    let mut t = secrets.scrub(t);
    if cut_escaped(&mut t, MAX_RESULT_TEXT.saturating_sub(*used)) {
        notes.push(format!(
            "the answer was cut to {MAX_RESULT_TEXT} bytes (as JSON text)"
        ));
    }
    *used += serde_json::to_string(&t).map_or(t.len(), |j| j.len().saturating_sub(2));
    t
}

/// The room the fields of one entry need besides its text (its other strings and the JSON
/// around them), charged before the text so that the whole answer stays bounded.
pub(super) fn charge(entry: &Value, used: &mut usize) -> bool {
    let size = serde_json::to_vec(entry).map_or(usize::MAX, |v| v.len());
    if used.saturating_add(size) > MAX_RESULT_TEXT {
        return false;
    }
    *used += size;
    true
}

/// A `resources/read` answer as the agent gets it: text contents scrubbed, bounded together
/// (text and the other fields) to [`MAX_RESULT_TEXT`] bytes; binary contents named in a note.
pub(super) fn project_contents(v: &Value, secrets: &KnownSecrets) -> Value {
    let mut notes = Vec::new();
    let mut used = 0usize;
    let mut contents = Vec::new();
    let all: &[Value] = v
        .get("contents")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice);
    for c in all.iter().take(MAX_LISTED) {
        if let Some(t) = c.get("text").and_then(Value::as_str) {
            let mut entry = json!({
                "uri": field(c, "uri", secrets, proto::MAX_RESOURCE_URI),
                "mime_type": field(c, "mimeType", secrets, 128),
                "text": "",
            });
            if !charge(&entry, &mut used) {
                notes.push(format!(
                    "the answer was cut to {MAX_RESULT_TEXT} bytes (as JSON text)"
                ));
                break;
            }
            entry["text"] = Value::String(budgeted_text(t, secrets, &mut used, &mut notes));
            contents.push(entry);
        } else if let Some(b) = c.get("blob").and_then(Value::as_str) {
            notes.push(format!(
                "a binary content of {} bytes (base64) was left out",
                b.len()
            ));
        } else {
            notes.push("a content without text was left out".to_owned());
        }
    }
    if all.len() > MAX_LISTED {
        notes.push(format!("{MAX_LISTED} of {} contents are shown", all.len()));
    }
    notes.truncate(MAX_NOTES);
    notes.dedup();
    json!({"contents": contents, "notes": notes})
}

/// Most notes in one answer.
pub(super) const MAX_NOTES: usize = 32;

/// A `prompts/get` answer as the agent gets it: text messages (and an embedded resource's
/// text) scrubbed and bounded like [`project_contents`]; other content named in a note, in a
/// fixed vocabulary (the server's own `type` string is never echoed).
pub(super) fn project_prompt(v: &Value, secrets: &KnownSecrets) -> Value {
    let mut notes = Vec::new();
    let description = field(v, "description", secrets, 2048);
    let mut used = serde_json::to_vec(&description).map_or(0, |d| d.len());
    let mut messages = Vec::new();
    let all: &[Value] = v
        .get("messages")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice);
    for m in all.iter().take(MAX_LISTED) {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                notes.push("a message with an unknown role was left out".to_owned());
                continue;
            }
        };
        let content = m.get("content").unwrap_or(&Value::Null);
        let kind = content.get("type").and_then(Value::as_str);
        let text = match kind {
            Some("text") => content.get("text").and_then(Value::as_str),
            Some("resource") => content
                .get("resource")
                .and_then(|r| r.get("text"))
                .and_then(Value::as_str),
            _ => None,
        };
        let Some(t) = text else {
            notes.push(
                match kind {
                    Some("image") => "an image content was left out",
                    Some("audio") => "an audio content was left out",
                    Some("resource_link") => "a resource link was left out",
                    Some("resource") => "a binary embedded resource was left out",
                    _ => "a non-text content was left out",
                }
                .to_owned(),
            );
            continue;
        };
        let mut entry = json!({"role": role, "text": ""});
        if !charge(&entry, &mut used) {
            notes.push(format!(
                "the answer was cut to {MAX_RESULT_TEXT} bytes (as JSON text)"
            ));
            break;
        }
        entry["text"] = Value::String(budgeted_text(t, secrets, &mut used, &mut notes));
        messages.push(entry);
    }
    if all.len() > MAX_LISTED {
        notes.push(format!("{MAX_LISTED} of {} messages are shown", all.len()));
    }
    notes.truncate(MAX_NOTES);
    notes.dedup();
    json!({
        "description": description,
        "messages": messages,
        "notes": notes,
    })
}

/// Cut `text` so that its JSON-escaped form is at most `max` bytes (control characters take six
/// bytes escaped, so the raw length alone could still overflow a frame). Returns whether it cut.
pub(super) fn cut_escaped(text: &mut String, max: usize) -> bool {
    let mut size = 0usize;
    for (i, c) in text.char_indices() {
        size += match c {
            '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
            c if (c as u32) < 0x20 => 6,
            c => c.len_utf8(),
        };
        if size > max {
            text.truncate(i);
            return true;
        }
    }
    false
}
