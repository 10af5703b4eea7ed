//! JSON output that is also terminal-safe: the CLI's `--json` writer.

use super::unicode::classify;

/// `value` as JSON (indented when `pretty`) that is also terminal-safe: every character
/// [`check_untrusted`] rejects — bidirectional controls, C1 controls, DEL, invisible, format,
/// private-use and unassigned characters, line separators — is written as a `\uXXXX` escape
/// (a UTF-16 surrogate pair above U+FFFF), so the text parses back to exactly `value` while a
/// terminal shows only visible characters. `serde_json` itself escapes only `"`, `\` and
/// U+0000–U+001F.
///
/// Why escaping the serialized text is enough: outside string literals `serde_json` writes only
/// ASCII (punctuation, digits, the letters of literals, spaces and line feeds), so every
/// character at or above U+007F stands inside a string, where `\uXXXX` denotes that very
/// character; C0 controls inside strings are already escaped.
///
/// [`check_untrusted`]: super::check_untrusted
pub fn terminal_safe_json(value: &serde_json::Value, pretty: bool) -> String {
    // Serializing a `Value` cannot fail: its map keys are strings and its numbers finite.
    let raw = if pretty {
        serde_json::to_string_pretty(value)
    } else {
        serde_json::to_string(value)
    }
    .unwrap_or_default();
    json_terminal_safe(&raw)
}

/// Make serialized JSON safe to print on a terminal without changing its value: every
/// character [`check_untrusted`] rejects that serde_json writes raw (C1 controls such as
/// U+009B CSI and U+0085 NEL, bidi controls, invisible, format and private-use characters,
/// separators) becomes a JSON `\uXXXX` escape (a surrogate pair above U+FFFF). C0 controls
/// inside strings are already escaped by the serializer; line feeds, carriage returns and tabs
/// outside strings (pretty printing) are kept. Parsing the result gives the same value.
///
/// [`check_untrusted`]: super::check_untrusted
pub fn json_terminal_safe(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if matches!(c, '\n' | '\r' | '\t') || classify(c, false).is_none() {
            out.push(c);
            continue;
        }
        let mut units = [0u16; 2];
        for u in c.encode_utf16(&mut units) {
            out.push_str(&format!("\\u{u:04x}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::check_untrusted;
    use crate::text::strategies::any_text;
    use proptest::prelude::*;

    #[test]
    fn json_is_made_terminal_safe_without_changing_its_value() {
        let hostile = "\u{1b}[2J\r\u{9b}31m\u{85}\u{202e}\u{2066}\u{200b}\u{e000}\u{e0041}é日本";
        let v = serde_json::json!({"k": hostile, "list": [hostile]});
        let pretty = serde_json::to_string_pretty(&v).unwrap();
        assert!(
            pretty.contains('\u{9b}') && pretty.contains('\u{202e}'),
            "serde writes these raw"
        );
        let safe = json_terminal_safe(&pretty);
        for c in safe.chars() {
            assert!(
                c == '\n' || classify(c, false).is_none(),
                "U+{:04X} left raw",
                u32::from(c)
            );
        }
        assert!(
            safe.contains("\\u009b") && safe.contains("\\udb40\\udc41"),
            "{safe}"
        );
        assert!(safe.contains("é日本"), "ordinary text is kept: {safe}");
        let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn json_output_escapes_bidi_c1_and_del() {
        let v = serde_json::json!({
            "name": "a\u{202e}b",
            "description": "c1 \u{85}\u{9f} del \u{7f} zwsp \u{200b} tag \u{e0041} ok é ✓",
            "\u{202e}key": ["\u{2028}", 1, true, null],
        });
        for pretty in [false, true] {
            let out = terminal_safe_json(&v, pretty);
            assert_eq!(check_untrusted(&out, true), Ok(()), "{out}");
            for esc in [
                "\\u202e",
                "\\u0085",
                "\\u009f",
                "\\u007f",
                "\\u200b",
                "\\udb40\\udc41",
                "\\u2028",
            ] {
                assert!(out.contains(esc), "{esc} missing from {out}");
            }
            // Visible characters stay as they are; the text is the same JSON value.
            assert!(out.contains("ok é ✓"));
            assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), v);
        }
        // serde_json alone leaves them raw (what this writer is for).
        assert!(serde_json::to_string(&v).unwrap().contains('\u{202e}'));
        iteron_test_support::record!(
            "P8",
            serde_json::json!({"escaped": ["U+202E", "U+0085", "U+009F", "U+007F", "U+200B", "U+E0041", "U+2028"]}),
        );
    }

    fn any_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any_text().prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::from),
                prop::collection::vec((any_text(), inner), 0..8)
                    .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn json_output_is_terminal_safe_and_the_same_value(v in any_json(), pretty in any::<bool>()) {
            let out = terminal_safe_json(&v, pretty);
            prop_assert_eq!(check_untrusted(&out, true), Ok(()));
            prop_assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), v);
        }
    }
}
