//! The elicitation seam: how a server's request for operator input reaches an operator, and only
//! an operator.
//!
//! An [`Elicitor`] is installed only by an interactive front end. Without one the client does
//! not advertise elicitation and refuses every input request (fail closed); a noninteractive
//! path never waits for a user who is not there. Before anything is shown, the requested form
//! schema must be one this client renders faithfully ([`check_form_schema`]): an object of flat
//! fields — strings (optionally with `enum`, `format`, length bounds), numbers, integers,
//! booleans, arrays of string enums, and single-select `oneOf` of `{const, title}`. Anything
//! else is refused before any answer is collected. Answers are checked against the schema
//! before they are sent, and they never go to events or logs.

use std::future::Future;
use std::pin::Pin;

use serde_json::{Map, Value};

/// Most fields in one form.
pub const MAX_FIELDS: usize = 32;
/// Largest serialized answer set, in bytes (per request).
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;
/// Most choices in one enum or `oneOf`.
pub const MAX_CHOICES: usize = 64;
/// Largest serialized form schema, in bytes.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// Longest message shown with a form, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024;

/// A form request, as checked.
#[derive(Debug, Clone, PartialEq)]
pub struct FormRequest {
    /// The server's message (untrusted; render it terminal-safe).
    pub message: String,
    /// The requested schema (checked by [`check_form_schema`]).
    pub schema: Value,
}

/// The operator's decision.
#[derive(Debug, Clone, PartialEq)]
pub enum FormAnswer {
    /// Accept with these field values.
    Accept(Map<String, Value>),
    /// Decline.
    Decline,
    /// Cancel.
    Cancel,
}

/// Installed by an interactive front end only.
pub trait Elicitor: Send + Sync {
    /// Ask the operator.
    fn ask(&self, request: FormRequest) -> Pin<Box<dyn Future<Output = FormAnswer> + Send>>;
}

fn field_ok(field: &Value) -> Result<(), String> {
    let Some(obj) = field.as_object() else {
        return Err("a field is not an object".into());
    };
    for key in ["enum", "oneOf"] {
        if obj
            .get(key)
            .and_then(Value::as_array)
            .is_some_and(|a| a.len() > MAX_CHOICES)
        {
            return Err(format!("a field offers more than {MAX_CHOICES} choices"));
        }
    }
    if let Some(options) = obj.get("oneOf") {
        let Some(options) = options.as_array() else {
            return Err("oneOf is not a list".into());
        };
        for o in options {
            let ok = o.as_object().is_some_and(|m| {
                m.get("const").is_some_and(Value::is_string)
                    && m.keys().all(|k| k == "const" || k == "title")
            });
            if !ok {
                return Err("oneOf options must be {const, title}".into());
            }
        }
        return Ok(());
    }
    let allowed_common = ["type", "title", "description", "default"];
    let ty = obj.get("type").and_then(Value::as_str).unwrap_or("");
    let extra: &[&str] = match ty {
        "string" => &["enum", "enumNames", "format", "minLength", "maxLength"],
        "number" | "integer" => &["minimum", "maximum"],
        "boolean" => &[],
        "array" => &["items", "minItems", "maxItems", "uniqueItems"],
        _ => {
            return Err(format!(
                "field type {} is not supported",
                if ty.is_empty() { "(none)" } else { "other" }
            ));
        }
    };
    for k in obj.keys() {
        if !allowed_common.contains(&k.as_str()) && !extra.contains(&k.as_str()) {
            return Err("a field uses an unsupported keyword".into());
        }
    }
    if let Some(f) = obj.get("format")
        && !f
            .as_str()
            .is_some_and(|f| ["email", "uri", "date", "date-time"].contains(&f))
    {
        return Err("a field uses a format this client cannot check".into());
    }
    if ty == "array" {
        let items_ok = obj
            .get("items")
            .and_then(Value::as_object)
            .is_some_and(|it| {
                it.get("type").and_then(Value::as_str) == Some("string")
                    && it
                        .get("enum")
                        .and_then(Value::as_array)
                        .is_some_and(|e| e.iter().all(Value::is_string))
                    && it.keys().all(|k| k == "type" || k == "enum")
            })
            || obj
                .get("items")
                .and_then(Value::as_object)
                .is_some_and(|it| {
                    it.get("anyOf")
                        .and_then(Value::as_array)
                        .is_some_and(|opts| {
                            opts.iter()
                                .all(|o| o.get("const").is_some_and(Value::is_string))
                        })
                });
        if !items_ok {
            return Err("arrays must be arrays of string enums".into());
        }
    }
    Ok(())
}

/// Whether this client can render the form faithfully. Refused schemas are refused before any
/// answer is collected.
pub fn check_form_schema(schema: &Value) -> Result<(), String> {
    if serde_json::to_vec(schema).map_or(usize::MAX, |v| v.len()) > MAX_SCHEMA_BYTES {
        return Err("the requested schema is too large".into());
    }
    let Some(obj) = schema.as_object() else {
        return Err("the requested schema is not an object".into());
    };
    if obj.get("type").and_then(Value::as_str) != Some("object") {
        return Err("the requested schema is not of type object".into());
    }
    for k in obj.keys() {
        if ![
            "type",
            "properties",
            "required",
            "title",
            "description",
            "$schema",
        ]
        .contains(&k.as_str())
        {
            return Err("the requested schema uses an unsupported keyword".into());
        }
    }
    let props = obj
        .get("properties")
        .and_then(Value::as_object)
        .ok_or("the requested schema has no properties")?;
    if props.len() > MAX_FIELDS {
        return Err(format!("the form has more than {MAX_FIELDS} fields"));
    }
    for field in props.values() {
        field_ok(field)?;
    }
    Ok(())
}

/// Check accepted answers against the schema: only declared fields, of the declared types,
/// enum values from the enum, every required field present, bounded size.
pub fn check_answers(schema: &Value, answers: &Map<String, Value>) -> Result<(), String> {
    let props = schema
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    if serde_json::to_vec(answers).map_or(usize::MAX, |v| v.len()) > MAX_ANSWER_BYTES {
        return Err("the answers are too large".into());
    }
    for (k, v) in answers {
        let Some(field) = props.get(k) else {
            return Err("an answer names a field the form does not have".into());
        };
        check_field(field, v).map_err(|why| {
            format!(
                "field {}: {why}",
                iteron_policy::text::single_line_capped(k, 64)
            )
        })?;
    }
    if let Some(required) = schema.get("required").and_then(Value::as_array) {
        for r in required.iter().filter_map(Value::as_str) {
            if !answers.contains_key(r) {
                return Err(format!(
                    "field {}: required, and has no answer",
                    iteron_policy::text::single_line_capped(r, 64)
                ));
            }
        }
    }
    Ok(())
}

/// A bound of the schema subset, as a number (`None`: absent or not a number).
fn bound(field: &Value, key: &str) -> Option<f64> {
    field.get(key).and_then(Value::as_f64)
}

/// A count bound (`minLength`, `maxItems`, …) as an integer.
fn count_bound(field: &Value, key: &str) -> Option<u64> {
    field.get(key).and_then(Value::as_u64)
}

/// Check one answer against its field: the type, and every constraint of the subset the form
/// accepts (`enum`/`oneOf`, `minimum`/`maximum`, `minLength`/`maxLength` in characters,
/// `format` email/uri/date/date-time, `minItems`/`maxItems` and the items' allowed values).
fn check_field(field: &Value, v: &Value) -> Result<(), String> {
    let ty = field
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("string");
    match ty {
        "string" => {
            let s = v.as_str().ok_or("must be a string")?;
            let allowed_enum = field
                .get("enum")
                .and_then(Value::as_array)
                .is_none_or(|e| e.iter().any(|x| x.as_str() == Some(s)));
            let allowed_one_of = field
                .get("oneOf")
                .and_then(Value::as_array)
                .is_none_or(|o| {
                    o.iter()
                        .any(|x| x.get("const").and_then(Value::as_str) == Some(s))
                });
            if !(allowed_enum && allowed_one_of) {
                return Err("not one of the allowed values".into());
            }
            let chars = s.chars().count() as u64;
            if let Some(min) = count_bound(field, "minLength")
                && chars < min
            {
                return Err(format!("shorter than {min} characters"));
            }
            if let Some(max) = count_bound(field, "maxLength")
                && chars > max
            {
                return Err(format!("longer than {max} characters"));
            }
            if let Some(format) = field.get("format").and_then(Value::as_str)
                && !format_ok(format, s)
            {
                return Err(format!(
                    "not a valid {}",
                    iteron_policy::text::single_line_capped(format, 32)
                ));
            }
            Ok(())
        }
        "number" | "integer" => {
            let n = v.as_f64().ok_or("must be a number")?;
            if ty == "integer" && !(v.is_i64() || v.is_u64()) {
                return Err("must be an integer".into());
            }
            if let Some(min) = bound(field, "minimum")
                && n < min
            {
                return Err(format!("below the minimum {min}"));
            }
            if let Some(max) = bound(field, "maximum")
                && n > max
            {
                return Err(format!("above the maximum {max}"));
            }
            Ok(())
        }
        "boolean" => v
            .as_bool()
            .map(|_| ())
            .ok_or_else(|| "must be true or false".into()),
        "array" => {
            let a = v.as_array().ok_or("must be a list")?;
            let allowed: Vec<&str> = field
                .get("items")
                .and_then(|it| {
                    it.get("enum")
                        .and_then(Value::as_array)
                        .map(|e| e.iter().filter_map(Value::as_str).collect())
                        .or_else(|| {
                            it.get("anyOf").and_then(Value::as_array).map(|o| {
                                o.iter()
                                    .filter_map(|x| x.get("const").and_then(Value::as_str))
                                    .collect()
                            })
                        })
                })
                .unwrap_or_default();
            if !a
                .iter()
                .all(|x| x.as_str().is_some_and(|s| allowed.contains(&s)))
            {
                return Err("holds a value that is not allowed".into());
            }
            if field.get("uniqueItems").and_then(Value::as_bool) == Some(true)
                && a.iter().enumerate().any(|(i, x)| a[..i].contains(x))
            {
                return Err("holds a value twice".into());
            }
            let n = a.len() as u64;
            if let Some(min) = count_bound(field, "minItems")
                && n < min
            {
                return Err(format!("fewer than {min} items"));
            }
            if let Some(max) = count_bound(field, "maxItems")
                && n > max
            {
                return Err(format!("more than {max} items"));
            }
            Ok(())
        }
        _ => Err("has a type the form cannot take".into()),
    }
}

/// The `format`s of the schema subset. An unknown format is refused (fail closed).
fn format_ok(format: &str, s: &str) -> bool {
    match format {
        "email" => email_ok(s),
        "uri" => uri_ok(s),
        "date" => date_ok(s),
        "date-time" => date_time_ok(s),
        _ => false,
    }
}

/// `local@domain`: one `@`, a non-empty local part, a domain of dot-separated labels, no
/// spaces or control characters.
fn email_ok(s: &str) -> bool {
    let Some((local, domain)) = s.split_once('@') else {
        return false;
    };
    !local.is_empty()
        && !domain.contains('@')
        && !s.chars().any(|c| c.is_whitespace() || c.is_control())
        && domain.contains('.')
        && domain
            .split('.')
            .all(|l| !l.is_empty() && l.chars().all(|c| c.is_alphanumeric() || c == '-'))
}

/// An absolute URI: a scheme (letter, then letters, digits, `+`, `-`, `.`), `:`, and a rest
/// without spaces or control characters.
fn uri_ok(s: &str) -> bool {
    let Some((scheme, rest)) = s.split_once(':') else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        && !rest.is_empty()
        && !s.chars().any(|c| c.is_whitespace() || c.is_control())
}

/// `YYYY-MM-DD`, a real calendar date.
fn date_ok(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return false;
    }
    let num = |r: std::ops::Range<usize>| s.get(r).and_then(|t| t.parse::<u32>().ok());
    let (Some(y), Some(m), Some(d)) = (num(0..4), num(5..7), num(8..10)) else {
        return false;
    };
    if !b
        .iter()
        .enumerate()
        .all(|(i, c)| i == 4 || i == 7 || c.is_ascii_digit())
    {
        return false;
    }
    iteron_policy::calendar::days_in_month(u64::from(y), u64::from(m))
        .is_some_and(|days| (1..=days).contains(&u64::from(d)))
}

/// RFC 3339 `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`.
fn date_time_ok(s: &str) -> bool {
    let Some((date, time)) = s.split_once(['T', 't']) else {
        return false;
    };
    if !date_ok(date) || time.len() < 9 {
        return false;
    }
    let (clock, zone) = if let Some(c) = time.strip_suffix(['Z', 'z']) {
        (c, None)
    } else {
        let Some(at) = time.rfind(['+', '-']) else {
            return false;
        };
        (&time[..at], Some(&time[at + 1..]))
    };
    let two = |t: &str, max: u32| {
        t.len() == 2
            && t.bytes().all(|c| c.is_ascii_digit())
            && t.parse::<u32>().is_ok_and(|n| n <= max)
    };
    let (hms, frac) = match clock.split_once('.') {
        Some((h, f)) => (h, Some(f)),
        None => (clock, None),
    };
    let parts: Vec<&str> = hms.split(':').collect();
    let clock_ok = parts.len() == 3 && two(parts[0], 23) && two(parts[1], 59) && two(parts[2], 60);
    let frac_ok = frac.is_none_or(|f| !f.is_empty() && f.bytes().all(|c| c.is_ascii_digit()));
    let zone_ok = zone.is_none_or(|z| {
        z.split_once(':')
            .is_some_and(|(h, m)| two(h, 23) && two(m, 59))
    });
    clock_ok && frac_ok && zone_ok
}

/// The `ElicitResult` to send for an answer.
pub fn result_value(answer: &FormAnswer) -> Value {
    match answer {
        FormAnswer::Accept(content) => {
            serde_json::json!({"action": "accept", "content": Value::Object(content.clone())})
        }
        FormAnswer::Decline => serde_json::json!({"action": "decline"}),
        FormAnswer::Cancel => serde_json::json!({"action": "cancel"}),
    }
}

/// An elicitor that accepts every form with the schema's defaults (the conformance client and
/// tests use it; no operator front end installs it).
pub struct AcceptDefaults;

impl Elicitor for AcceptDefaults {
    fn ask(&self, request: FormRequest) -> Pin<Box<dyn Future<Output = FormAnswer> + Send>> {
        let mut content = Map::new();
        if let Some(props) = request.schema.get("properties").and_then(Value::as_object) {
            for (k, f) in props {
                if let Some(d) = f.get("default") {
                    content.insert(k.clone(), d.clone());
                }
            }
        }
        Box::pin(async move { FormAnswer::Accept(content) })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn answers_are_checked_against_every_constraint_of_the_subset() {
        let schema = serde_json::json!({"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 1, "maximum": 10},
            "x": {"type": "number", "minimum": 0.5},
            "s": {"type": "string", "minLength": 2, "maxLength": 4},
            "e": {"type": "string", "format": "email"},
            "u": {"type": "string", "format": "uri"},
            "d": {"type": "string", "format": "date"},
            "t": {"type": "string", "format": "date-time"},
            "a": {"type": "array", "items": {"type": "string", "enum": ["p", "q", "r"]},
                  "minItems": 1, "maxItems": 2, "uniqueItems": true}
        }, "required": ["n"]});
        check_form_schema(&schema).unwrap();
        let check = |k: &str, v: Value| {
            let mut m = Map::new();
            m.insert("n".into(), serde_json::json!(5));
            m.insert(k.into(), v);
            check_answers(&schema, &m)
        };
        use serde_json::json;
        // At each bound and one over.
        for (k, good, bad) in [
            ("n", json!(1), json!(0)),
            ("n", json!(10), json!(11)),
            ("n", json!(3), json!(3.5)),
            ("x", json!(0.5), json!(0.49)),
            ("s", json!("ab"), json!("a")),
            ("s", json!("abéd"), json!("abcde")),
            ("e", json!("op@example.org"), json!("op@@example.org")),
            ("e", json!("a@b.c"), json!("no-at.example")),
            ("u", json!("https://example.org/x"), json!("not a uri")),
            ("d", json!("2024-02-29"), json!("2023-02-29")),
            ("d", json!("2026-12-02"), json!("2026-13-01")),
            (
                "t",
                json!("2026-12-02T07:30:00Z"),
                json!("2026-12-02 07:30:00"),
            ),
            (
                "t",
                json!("2026-12-02T07:30:00.5+01:00"),
                json!("2026-12-02T24:00:00Z"),
            ),
            ("a", json!(["p", "q"]), json!(["p", "q", "r"])),
            ("a", json!(["p"]), json!([])),
            ("a", json!(["q"]), json!(["q", "q"])),
        ] {
            assert!(check(k, good.clone()).is_ok(), "{k} {good}");
            let e = check(k, bad.clone()).unwrap_err();
            assert!(e.starts_with(&format!("field {k}: ")), "{k} {bad}: {e}");
        }
        let mut none = Map::new();
        none.insert("s".into(), json!("abc"));
        assert_eq!(
            check_answers(&schema, &none).unwrap_err(),
            "field n: required, and has no answer"
        );
        // A format this client cannot check is refused with the form, before any answer.
        let odd = json!({"type": "object", "properties": {"h": {"type": "string", "format": "hostname"}}});
        assert!(check_form_schema(&odd).is_err());
    }

    use super::*;
    use serde_json::json;

    #[test]
    fn basic_forms_are_accepted() {
        let schema = json!({"type": "object", "properties": {
            "name": {"type": "string", "title": "Name", "default": "x", "minLength": 1},
            "age": {"type": "integer", "minimum": 0, "default": 3},
            "ratio": {"type": "number", "default": 0.5},
            "ok": {"type": "boolean", "default": true},
            "color": {"type": "string", "enum": ["red", "green"], "default": "red"},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
            "pick": {"oneOf": [{"const": "x", "title": "X"}, {"const": "y", "title": "Y"}]}
        }, "required": ["name"]});
        check_form_schema(&schema).unwrap();
        let mut answers = Map::new();
        answers.insert("name".into(), json!("n"));
        answers.insert("color".into(), json!("green"));
        answers.insert("pick".into(), json!("y"));
        check_answers(&schema, &answers).unwrap();
    }

    #[test]
    fn other_schemas_are_refused_before_asking() {
        for bad in [
            json!({"type": "object", "properties": {"n": {"type": "object", "properties": {}}}}),
            json!({"type": "object", "properties": {"n": {"$ref": "#/defs/x"}}}),
            json!({"type": "object", "properties": {"n": {"type": "string", "pattern": "^a"}}}),
            json!({"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"}}}}),
            json!({"type": "array"}),
            json!({"type": "object", "properties": {}, "allOf": []}),
        ] {
            assert!(check_form_schema(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn answers_must_match_the_form() {
        let schema = json!({"type": "object", "properties": {
            "color": {"type": "string", "enum": ["red"]}, "n": {"type": "integer"}}, "required": ["n"]});
        let mut a = Map::new();
        a.insert("n".into(), json!(1));
        check_answers(&schema, &a).unwrap();
        a.insert("color".into(), json!("blue"));
        assert!(check_answers(&schema, &a).is_err());
        let mut b = Map::new();
        b.insert("extra".into(), json!(1));
        assert!(check_answers(&schema, &b).is_err());
        assert!(check_answers(&schema, &Map::new()).is_err());
    }
}
