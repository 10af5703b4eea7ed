//! The client's unit tests: projection to text and the advertised capabilities.

use serde_json::json;

use super::negotiate::capabilities;
use super::*;
use crate::mcp::elicit;

#[test]
fn results_are_projected_to_text_with_notes() {
    let p = project(&json!({"content": [
        {"type": "text", "text": "hello"},
        {"type": "image", "data": "AAAA", "mimeType": "image/png"},
        {"type": "resource", "resource": {"uri": "file:///x", "text": "body"}},
        {"type": "resource_link", "uri": "file:///y", "name": "y"},
        {"type": "audio", "data": "AAAA", "mimeType": "audio/wav"}
    ], "isError": true}));
    assert_eq!(p.text, "hello\nbody\n[resource link: file:///y]");
    assert!(p.is_error);
    assert_eq!(p.notes.len(), 2);
    assert!(p.notes[0].contains("image content (image/png) dropped"));
    let s = project(&json!({"content": [], "structuredContent": {"sum": 3}}));
    assert_eq!(s.text, "{\"sum\":3}");
}

#[test]
fn capabilities_follow_era_transport_and_elicitor() {
    let mut opts = Options::default();
    assert_eq!(
        capabilities(&opts, Era::Modern(Version::V2026_07_28), true),
        json!({})
    );
    opts.elicitor = Some(Arc::new(elicit::AcceptDefaults));
    assert_eq!(
        capabilities(&opts, Era::Modern(Version::V2026_07_28), false),
        json!({"elicitation": {"form": {}}})
    );
    assert_eq!(
        capabilities(&opts, Era::Legacy(Version::V2025_11_25), false),
        json!({"elicitation": {"form": {}}})
    );
    assert_eq!(
        capabilities(&opts, Era::Legacy(Version::V2025_11_25), true),
        json!({"elicitation": {"form": {}}})
    );
    assert_eq!(
        capabilities(&opts, Era::Legacy(Version::V2025_06_18), true),
        json!({"elicitation": {}})
    );
}
