//! A server's scrubber: the secret values its configuration names and the ones it learns while
//! it runs, redacted in every form from whatever the server sends back.

use std::ffi::OsString;

use iteron_policy::config::{ServerConfig, Transport};

use crate::scrub::Patterns;

/// The secret values a server's configuration names (forwarded variables, header values,
/// bearer tokens), held only to scrub them from any text a server sends back — a server that
/// echoes an API key in an error must not get it printed. Every form of every value is looked
/// for at once ([`crate::scrub`]): raw, JSON-escaped, base64, percent-encoded; a value that
/// contains another is redacted whole.
#[derive(Default)]
pub struct KnownSecrets {
    fixed: Patterns,
    learned: LearnedSecrets,
}

/// Most secrets one running server's scrubber learns. Beyond, its token source refuses to hand
/// out another (fail closed: nothing is forgotten, and a server cannot force endless
/// refreshes); restarting the server starts afresh.
pub const MAX_LEARNED_SECRETS: usize = 64;

/// Secret values learned while a server runs — every token and client secret its stored OAuth
/// credential holds whenever it is read, including ones a refresh rotated in or a new login
/// replaced — shared between the server's token source (which learns them) and its
/// [`KnownSecrets`] (which scrubs them).
#[derive(Clone, Default)]
pub struct LearnedSecrets(std::sync::Arc<std::sync::Mutex<Patterns>>);

impl LearnedSecrets {
    fn lock(&self) -> std::sync::MutexGuard<'_, Patterns> {
        match self.0.lock() {
            Ok(k) => k,
            Err(p) => p.into_inner(),
        }
    }

    /// Remember `value` (values shorter than 4 bytes are ignored, like configured ones).
    /// `false` when it is new and [`MAX_LEARNED_SECRETS`] are already known: the caller must
    /// not use it.
    pub fn learn(&self, value: &str) -> bool {
        if value.len() < crate::scrub::MIN_SECRET {
            return true;
        }
        let mut known = self.lock();
        if known.has(value) {
            return true;
        }
        if known.secrets() >= MAX_LEARNED_SECRETS {
            return false;
        }
        known.add(value);
        true
    }

    /// Learn every secret of a stored credential; `false` if one could not be learned.
    pub fn learn_credential(&self, cred: &crate::credentials::Credential) -> bool {
        use secrecy::ExposeSecret;
        let s = &cred.secrets;
        std::iter::once(&s.access_token)
            .chain(s.refresh_token.iter())
            .chain(s.client_secret.iter())
            .chain(s.dpop_key.iter())
            .all(|v| self.learn(v.expose_secret()))
    }
}

impl KnownSecrets {
    /// Collect the values of every variable `server` names (values shorter than 4 bytes are
    /// ignored: scrubbing them would mangle ordinary text and they protect nothing).
    pub fn of(
        server: &ServerConfig,
        lookup: &(dyn Fn(&str) -> Option<OsString> + Sync),
    ) -> KnownSecrets {
        let names: Vec<String> = match &server.transport {
            Transport::Stdio(st) => st.env.iter().map(|n| n.as_str().to_owned()).collect(),
            Transport::Http(h) => h
                .header_env
                .values()
                .map(|v| v.as_str().to_owned())
                .chain(h.oauth.iter().flat_map(|o| {
                    [
                        o.access_token_env.as_ref(),
                        o.refresh_token_env.as_ref(),
                        o.client_secret_env.as_ref(),
                    ]
                    .into_iter()
                    .flatten()
                    .map(|v| v.as_str().to_owned())
                }))
                .collect(),
        };
        let mut fixed = Patterns::default();
        for value in names.iter().filter_map(|n| lookup(n)) {
            if let Ok(v) = value.into_string() {
                let v = zeroize::Zeroizing::new(v);
                fixed.add(&v);
            }
        }
        KnownSecrets {
            fixed,
            learned: LearnedSecrets::default(),
        }
    }

    /// Also scrub what `learned` learns while the server runs.
    pub fn with_learned(mut self, learned: LearnedSecrets) -> KnownSecrets {
        self.learned = learned;
        self
    }

    /// Also scrub the secrets of a stored OAuth credential (tokens and a registered client's
    /// secret): a server that echoes its bearer token must not hand it to the agent.
    pub fn with_credential(mut self, cred: &crate::credentials::Credential) -> KnownSecrets {
        use secrecy::ExposeSecret;
        let s = &cred.secrets;
        for v in std::iter::once(&s.access_token)
            .chain(s.refresh_token.iter())
            .chain(s.client_secret.iter())
            .chain(s.dpop_key.iter())
        {
            self.fixed.add(v.expose_secret());
        }
        self
    }

    /// `text` with every known secret value, in any of its forms, replaced by `[REDACTED]`;
    /// `None` when there is nothing to replace.
    pub fn scrub_changed(&self, text: &str) -> Option<String> {
        let mut ranges = Vec::new();
        self.fixed.find(text, &mut ranges);
        self.learned.lock().find(text, &mut ranges);
        if ranges.is_empty() {
            return None;
        }
        Some(crate::scrub::redact(text, ranges).into_owned())
    }

    /// `text` with every known secret value, in any of its forms, replaced by `[REDACTED]`.
    pub fn scrub(&self, text: &str) -> String {
        self.scrub_changed(text).unwrap_or_else(|| text.to_owned())
    }

    /// Scrub every string of a JSON value (object keys included).
    pub fn scrub_json(&self, v: &mut serde_json::Value) {
        crate::scrub::scrub_value(v, &|s| self.scrub_changed(s));
    }
}

impl crate::mcp::Scrub for KnownSecrets {
    fn scrub_value(&self, v: &mut serde_json::Value) {
        self.scrub_json(v);
    }
    fn scrub_text(&self, t: &str) -> String {
        self.scrub(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arb_secret() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        proptest::collection::vec(
            prop_oneof![
                Just('"'),
                Just('\\'),
                Just('/'),
                Just('\n'),
                Just('\u{7}'),
                Just('<'),
                Just('&'),
                Just(' '),
                Just('+'),
                Just('%'),
                Just('é'),
                Just('\u{202e}'),
                Just('😀'),
                proptest::char::range('a', 'z'),
                proptest::char::range('0', '9'),
            ],
            8..20,
        )
        .prop_map(|c| c.into_iter().collect())
    }

    /// A server message with the secrets (one inside the other, every special character) in
    /// any of their forms planted in any string — keys included, at any depth — holds none of
    /// them, in no form, once scrubbed and serialized: what any field of it shows (a tool name,
    /// a description, a schema, a MIME type, structured content, an error) is clean.
    #[test]
    fn every_field_of_a_server_message_is_scrubbed_of_every_form_fuzzed_record() {
        use proptest::prelude::*;
        use serde_json::{Value, json};
        let strategy = (
            arb_secret(),
            arb_secret(),
            proptest::collection::vec((0usize..64, 0usize..8, any::<bool>()), 1..6),
        );
        let mut runner =
            proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(256));
        let executions = std::cell::Cell::new(0u64);
        runner
            .run(&strategy, |(a, b, plants)| {
                executions.set(executions.get() + 1);
                let outer = format!("{b}{a}{b}");
                let learned = LearnedSecrets::default();
                prop_assert!(learned.learn(&a) && learned.learn(&outer));
                let k = KnownSecrets::default().with_learned(learned);
                let mut msg = json!({"jsonrpc": "2.0", "id": 1, "result": {
                    "tools": [{"name": "t", "description": "d", "inputSchema": {"type": "object", "properties": {"p": {"description": "x"}}}}],
                    "content": [{"type": "image", "mimeType": "image/png", "data": "AAAA"}],
                    "structuredContent": {"k": ["v"]},
                    "error": {"message": "m"}
                }});
                let slots = [
                    "/result/tools/0/name", "/result/tools/0/description",
                    "/result/tools/0/inputSchema/properties/p/description",
                    "/result/content/0/mimeType", "/result/structuredContent/k/0",
                    "/result/error/message",
                ];
                for (which, slot, key) in &plants {
                    let secret = if which % 2 == 0 { &a } else { &outer };
                    let all = crate::scrub::forms(secret);
                    let form = all[which % all.len()].as_str().to_owned();
                    let path = slots[slot % slots.len()];
                    if *key {
                        // As an object key, next to the field.
                        let (parent, _) = path.rsplit_once('/').unwrap_or(("", ""));
                        if let Some(Value::Object(m)) = msg.pointer_mut(parent) {
                            m.insert(format!("k{form}k"), json!(1));
                        } else if let Some(Value::Array(v)) = msg.pointer_mut(parent) {
                            v.push(json!({ format!("k{form}k"): 1 }));
                        }
                    } else if let Some(v) = msg.pointer_mut(path) {
                        *v = Value::String(format!("{}{form}{}", "p".repeat(which * 7), "q"));
                    }
                }
                k.scrub_json(&mut msg);
                let shown = msg.to_string();
                for secret in [&a, &outer] {
                    for form in crate::scrub::forms(secret) {
                        prop_assert!(!shown.contains(form.as_str()));
                    }
                    // And as the strings themselves hold them (after JSON decoding).
                    let mut strings = Vec::new();
                    fn walk(v: &Value, out: &mut Vec<String>) {
                        match v {
                            Value::String(s) => out.push(s.clone()),
                            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
                            Value::Object(m) => m.iter().for_each(|(k, x)| {
                                out.push(k.clone());
                                walk(x, out)
                            }),
                            _ => {}
                        }
                    }
                    walk(&msg, &mut strings);
                    prop_assert!(!strings.iter().any(|s| s.contains(secret.as_str())));
                }
                Ok(())
            })
            .unwrap();
        iteron_test_support::record!(
            "P10",
            serde_json::json!({"executions": executions.get(), "crashes": 0}),
        );
    }
}
