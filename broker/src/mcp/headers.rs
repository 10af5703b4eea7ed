//! 2026-07-28 request headers: `Mcp-Method`, `Mcp-Name` and the `Mcp-Param-*` headers that
//! mirror tool arguments marked `x-mcp-header` in a tool's input schema.
//!
//! A tool whose annotations break the rules is dropped from the catalog (it could never be
//! called correctly). Values that are not plain visible ASCII travel in the sentinel form
//! `=?base64?<base64 of the UTF-8 bytes>?=`, so nothing a server puts in an argument can inject
//! a header line. `$ref` is never followed: a property reached through `$ref` simply is not
//! reachable through `properties`, which makes its annotation invalid.

use std::collections::HashSet;

use base64::Engine;
use reqwest::header::{HeaderName, HeaderValue};
use serde_json::{Map, Value};

/// JavaScript's largest safe integer.
const MAX_SAFE_INTEGER: i64 = (1 << 53) - 1;

/// One mirrored parameter: the argument path (through `properties`) and the header suffix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamHeader {
    /// Property names from the root of the arguments object.
    pub path: Vec<String>,
    /// The `x-mcp-header` value (the header is `Mcp-Param-<name>`).
    pub name: String,
    /// `string`, `integer` or `boolean`.
    pub kind: &'static str,
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Why a tool's header annotations are invalid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InvalidHeader {
    /// Empty value.
    Empty,
    /// A character outside the HTTP token set.
    Charset,
    /// The same name twice (case-insensitively).
    Duplicate,
    /// On a property that is not a string, integer or boolean.
    NotPrimitive,
    /// Not reachable from the root through `properties` only.
    Unreachable,
}

/// Find the annotations of one input schema, or say why the tool must be dropped.
pub fn param_headers(schema: &Value) -> Result<Vec<ParamHeader>, InvalidHeader> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    walk(schema, &mut Vec::new(), true, &mut out, &mut seen)?;
    Ok(out)
}

fn walk(
    node: &Value,
    path: &mut Vec<String>,
    reachable: bool,
    out: &mut Vec<ParamHeader>,
    seen: &mut HashSet<String>,
) -> Result<(), InvalidHeader> {
    match node {
        Value::Object(obj) => {
            if let Some(h) = obj.get("x-mcp-header") {
                if !reachable || path.is_empty() {
                    return Err(InvalidHeader::Unreachable);
                }
                let name = h.as_str().ok_or(InvalidHeader::Charset)?;
                if name.is_empty() {
                    return Err(InvalidHeader::Empty);
                }
                if !name.bytes().all(is_tchar) {
                    return Err(InvalidHeader::Charset);
                }
                if !seen.insert(name.to_ascii_lowercase()) {
                    return Err(InvalidHeader::Duplicate);
                }
                let kind = match obj.get("type").and_then(Value::as_str) {
                    Some("string") => "string",
                    Some("integer") => "integer",
                    Some("boolean") => "boolean",
                    _ => return Err(InvalidHeader::NotPrimitive),
                };
                out.push(ParamHeader {
                    path: path.clone(),
                    name: name.to_owned(),
                    kind,
                });
            }
            for (k, v) in obj {
                if k == "properties" {
                    if let Value::Object(props) = v {
                        for (pname, pschema) in props {
                            path.push(pname.clone());
                            walk(pschema, path, reachable, out, seen)?;
                            path.pop();
                        }
                    }
                } else if k != "x-mcp-header"
                    && k != "const"
                    && k != "default"
                    && k != "enum"
                    && k != "examples"
                {
                    // Any other keyword (items, anyOf, $defs, if/then/else, …) leads somewhere
                    // that is not reachable through properties alone.
                    walk(v, path, false, out, seen)?;
                }
            }
            Ok(())
        }
        Value::Array(items) => {
            for i in items {
                walk(i, path, false, out, seen)?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Encode a header value: plain when it is visible ASCII with no leading/trailing whitespace and
/// does not look like the sentinel; otherwise `=?base64?…?=`.
pub fn encode_value(s: &str) -> String {
    let visible = s.bytes().all(|b| (0x20..0x7f).contains(&b));
    let padded = s.starts_with(' ') || s.ends_with(' ');
    let sentinel_like = s.starts_with("=?") && s.ends_with("?=");
    if visible && !padded && !sentinel_like {
        s.to_owned()
    } else {
        format!(
            "=?base64?{}?=",
            base64::engine::general_purpose::STANDARD.encode(s.as_bytes())
        )
    }
}

fn lookup<'a>(args: &'a Map<String, Value>, path: &[String]) -> Option<&'a Value> {
    let (first, rest) = path.split_first()?;
    let mut cur = args.get(first)?;
    for p in rest {
        cur = cur.as_object()?.get(p)?;
    }
    Some(cur)
}

/// The `Mcp-Param-*` headers for one call. Null or absent arguments omit their header; a value
/// of the wrong type is not mirrored.
pub fn param_values(
    headers: &[ParamHeader],
    args: &Map<String, Value>,
) -> Vec<(HeaderName, HeaderValue)> {
    let mut out = Vec::new();
    for h in headers {
        let Some(v) = lookup(args, &h.path) else {
            continue;
        };
        let text = match (h.kind, v) {
            ("string", Value::String(s)) => encode_value(s),
            ("integer", Value::Number(n)) => match n.as_i64() {
                Some(i) if i.abs() <= MAX_SAFE_INTEGER => i.to_string(),
                _ => continue,
            },
            ("boolean", Value::Bool(b)) => b.to_string(),
            _ => continue,
        };
        let name = format!("mcp-param-{}", h.name.to_ascii_lowercase());
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(&text),
        ) {
            out.push((n, v));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn valid_annotations_are_found_through_properties() {
        let schema = json!({"type": "object", "properties": {
            "region": {"type": "string", "x-mcp-header": "Region"},
            "n": {"type": "integer", "x-mcp-header": "Priority"},
            "nested": {"type": "object", "properties": {"flag": {"type": "boolean", "x-mcp-header": "Flag"}}},
            "plain": {"type": "number"}
        }});
        let h = param_headers(&schema).unwrap();
        assert_eq!(h.len(), 3);
        assert_eq!(h[2].path, vec!["nested".to_owned(), "flag".to_owned()]);
    }

    #[test]
    fn invalid_annotations_drop_the_tool() {
        let cases = [
            (
                json!({"properties": {"a": {"type": "string", "x-mcp-header": ""}}}),
                InvalidHeader::Empty,
            ),
            (
                json!({"properties": {"a": {"type": "string", "x-mcp-header": "A B"}}}),
                InvalidHeader::Charset,
            ),
            (
                json!({"properties": {"a": {"type": "string", "x-mcp-header": "A:B"}}}),
                InvalidHeader::Charset,
            ),
            (
                json!({"properties": {"a": {"type": "string", "x-mcp-header": "Région"}}}),
                InvalidHeader::Charset,
            ),
            (
                json!({"properties": {"a": {"type": "string", "x-mcp-header": "Region\t1"}}}),
                InvalidHeader::Charset,
            ),
            (
                json!({"properties": {"a": {"type": "string", "x-mcp-header": "X"}, "b": {"type": "string", "x-mcp-header": "x"}}}),
                InvalidHeader::Duplicate,
            ),
            (
                json!({"properties": {"a": {"type": "object", "x-mcp-header": "X"}}}),
                InvalidHeader::NotPrimitive,
            ),
            (
                json!({"properties": {"a": {"type": "array", "x-mcp-header": "X"}}}),
                InvalidHeader::NotPrimitive,
            ),
            (
                json!({"properties": {"a": {"type": "null", "x-mcp-header": "X"}}}),
                InvalidHeader::NotPrimitive,
            ),
            (
                json!({"properties": {"a": {"type": "number", "x-mcp-header": "X"}}}),
                InvalidHeader::NotPrimitive,
            ),
            (
                json!({"properties": {"a": {"type": "array", "items": {"type": "string", "x-mcp-header": "X"}}}}),
                InvalidHeader::Unreachable,
            ),
            (
                json!({"anyOf": [{"properties": {"a": {"type": "string", "x-mcp-header": "X"}}}]}),
                InvalidHeader::Unreachable,
            ),
        ];
        for (schema, want) in cases {
            assert_eq!(param_headers(&schema), Err(want), "{schema}");
        }
    }

    #[test]
    fn values_are_encoded_safely() {
        assert_eq!(encode_value("us-west1"), "us-west1");
        assert_eq!(encode_value("us west 1"), "us west 1");
        assert_eq!(
            encode_value("Hello, 世界"),
            "=?base64?SGVsbG8sIOS4lueVjA==?="
        );
        assert_eq!(encode_value(" padded "), "=?base64?IHBhZGRlZCA=?=");
        assert_eq!(encode_value("line1\nline2"), "=?base64?bGluZTEKbGluZTI=?=");
        assert_eq!(encode_value("\tindented"), "=?base64?CWluZGVudGVk?=");
        assert!(encode_value("=?base64?abc?=").starts_with("=?base64?PT9i"));
        let headers = param_headers(&json!({"properties": {
            "region": {"type": "string", "x-mcp-header": "Region"},
            "verbose": {"type": "boolean", "x-mcp-header": "Verbose"},
            "n": {"type": "integer", "x-mcp-header": "N"}}}))
        .unwrap();
        let args = json!({"region": "eu", "verbose": null, "n": 42});
        let v = param_values(&headers, args.as_object().unwrap());
        let names: Vec<&str> = v.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, vec!["mcp-param-region", "mcp-param-n"]);
    }
}
