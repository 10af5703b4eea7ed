//! Answering the server's requests: `ping`, and form elicitation through the elicitor.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::mcp::elicit::{self, Elicitor, FormAnswer, FormRequest};
use crate::mcp::jsonrpc::codes;
use crate::mcp::{Handler, HandlerFuture, Scrub};

/// Answers server requests: `ping`, and `elicitation/create` only through an installed elicitor.
pub(super) struct ServerRequests {
    pub(super) elicitor: Option<Arc<dyn Elicitor>>,
    pub(super) scrub: Option<Arc<dyn Scrub>>,
}

pub(super) async fn ask(
    elicitor: &Arc<dyn Elicitor>,
    params: &Value,
) -> Result<Value, (i64, String)> {
    let schema = params
        .get("requestedSchema")
        .cloned()
        .unwrap_or(Value::Null);
    if params
        .get("mode")
        .and_then(Value::as_str)
        .is_some_and(|m| m != "form")
    {
        return Err((
            codes::INVALID_PARAMS,
            "only form elicitation is supported".into(),
        ));
    }
    elicit::check_form_schema(&schema).map_err(|e| (codes::INVALID_PARAMS, e))?;
    let message = params.get("message").and_then(Value::as_str).unwrap_or("");
    if message.len() > elicit::MAX_MESSAGE_BYTES {
        return Err((codes::INVALID_PARAMS, "the form message is too long".into()));
    }
    let message = message.to_owned();
    let answer = elicitor
        .ask(FormRequest {
            message,
            schema: schema.clone(),
        })
        .await;
    if let FormAnswer::Accept(content) = &answer {
        elicit::check_answers(&schema, content).map_err(|e| (codes::INVALID_PARAMS, e))?;
    }
    Ok(elicit::result_value(&answer))
}

impl Handler for ServerRequests {
    fn scrub(&self, message: &mut Value) {
        if let Some(s) = &self.scrub {
            s.scrub_value(message);
        }
    }

    fn handle(&self, method: &str, params: Value) -> HandlerFuture {
        let elicitor = self.elicitor.clone();
        let method = method.to_owned();
        Box::pin(async move {
            match (method.as_str(), elicitor) {
                ("ping", _) => Ok(json!({})),
                ("elicitation/create", Some(e)) => ask(&e, &params).await,
                _ => Err((
                    codes::METHOD_NOT_FOUND,
                    "not supported by this client".into(),
                )),
            }
        })
    }
}
