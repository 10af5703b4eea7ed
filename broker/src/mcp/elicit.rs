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
        let ty = field
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("string");
        let ok = match ty {
            "string" => v.as_str().is_some_and(|s| {
                field
                    .get("enum")
                    .and_then(Value::as_array)
                    .is_none_or(|e| e.iter().any(|x| x.as_str() == Some(s)))
                    && field
                        .get("oneOf")
                        .and_then(Value::as_array)
                        .is_none_or(|o| {
                            o.iter()
                                .any(|x| x.get("const").and_then(Value::as_str) == Some(s))
                        })
            }),
            "number" => v.is_number(),
            "integer" => v.is_i64() || v.is_u64(),
            "boolean" => v.is_boolean(),
            "array" => v.as_array().is_some_and(|a| {
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
                a.iter()
                    .all(|x| x.as_str().is_some_and(|s| allowed.contains(&s)))
            }),
            _ => false,
        };
        if !ok {
            return Err("an answer does not match its field".into());
        }
    }
    if let Some(required) = schema.get("required").and_then(Value::as_array) {
        for r in required.iter().filter_map(Value::as_str) {
            if !answers.contains_key(r) {
                return Err("a required field has no answer".into());
            }
        }
    }
    Ok(())
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
