//! Finding known secret values in text a server sends back, in every common encoding.
//!
//! A server may echo a forwarded secret as it is, JSON-escaped (once, or twice when it puts JSON
//! inside a JSON string), ASCII-escaped the way Python's `json.dumps` does, HTML-safe the way
//! Go's `encoding/json` does, in base64 (standard or URL-safe, at any byte alignment inside a
//! longer blob), or percent-encoded. [`Patterns`] holds every such form of every secret and
//! finds all of them at once: the matched ranges are merged before anything is replaced, so a
//! secret that contains another (or overlaps it) is redacted whole, whatever the order in which
//! they were learned. Forms are zeroized when dropped.
//!
//! Limits, stated: a base64 form matches the characters that depend only on the secret's own
//! bytes (at most the two or four bits of an edge character stay); encoded forms shorter than
//! [`MIN_ENCODED`] bytes are not looked for (they would mangle ordinary text); an encoding not
//! named here (say, every character `\u`-escaped at random, or hex) is not recognised in text
//! — but a JSON value is scrubbed after it is parsed ([`scrub_value`]), so escapes in
//! the JSON itself never hide a secret.
#![forbid(unsafe_code)]

use std::borrow::Cow;

use base64::Engine as _;
use serde_json::{Map, Value};
use zeroize::Zeroizing;

/// What a secret is replaced with.
pub const REDACTED: &str = "[REDACTED]";
/// Secrets shorter than this are not scrubbed (they protect nothing and would mangle text).
pub const MIN_SECRET: usize = 4;
/// Encoded forms shorter than this are not looked for.
pub const MIN_ENCODED: usize = 8;

/// How a JSON string escaper writes what it escapes.
#[derive(Clone, Copy)]
struct JsonStyle {
    /// Non-ASCII as `\uXXXX` (UTF-16, surrogate pairs).
    ascii: bool,
    /// Hex digits in upper case.
    upper: bool,
    /// `/` as `\/`.
    slash: bool,
    /// `<`, `>`, `&`, U+2028 and U+2029 as `\u` escapes (Go's HTML-safe default).
    html: bool,
}

const JSON_STYLES: [JsonStyle; 5] = [
    // serde_json, JavaScript's JSON.stringify.
    JsonStyle {
        ascii: false,
        upper: false,
        slash: false,
        html: false,
    },
    // Python's json.dumps (ensure_ascii).
    JsonStyle {
        ascii: true,
        upper: false,
        slash: false,
        html: false,
    },
    JsonStyle {
        ascii: true,
        upper: true,
        slash: false,
        html: false,
    },
    // Go's encoding/json.
    JsonStyle {
        ascii: false,
        upper: false,
        slash: false,
        html: true,
    },
    // PHP's json_encode.
    JsonStyle {
        ascii: true,
        upper: false,
        slash: true,
        html: false,
    },
];

fn json_escape(s: &str, style: JsonStyle) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len() + 8);
    let unit = |out: &mut String, u: u16| {
        if style.upper {
            let _ = write!(out, "\\u{u:04X}");
        } else {
            let _ = write!(out, "\\u{u:04x}");
        }
    };
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '/' if style.slash => out.push_str("\\/"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' if style.html => unit(&mut out, c as u16),
            c if (c as u32) < 0x20 => unit(&mut out, c as u16),
            c if style.ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    unit(&mut out, *u);
                }
            }
            c => out.push(c),
        }
    }
    out
}

/// The characters of a base64 encoding of `secret` that depend on the secret's bytes only, for
/// each of the three byte alignments it can have inside a longer encoded blob.
fn base64_cores(secret: &[u8], engine: &base64::engine::GeneralPurpose) -> Vec<String> {
    let mut out = Vec::new();
    for k in 0..3usize {
        let mut input = Zeroizing::new(vec![0u8; k]);
        input.extend_from_slice(secret);
        let encoded = Zeroizing::new(engine.encode(&input[..]));
        // Character i covers bits [6i, 6i + 6) of the input; the secret's bits are
        // [8k, 8(k + n)).
        let first = (8 * k).div_ceil(6);
        let end = (8 * (k + secret.len())) / 6;
        if let Some(core) = encoded.get(first..end) {
            out.push(core.to_owned());
        }
    }
    out
}

fn percent(secret: &[u8], upper: bool, plus: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(secret.len() * 3);
    for &b in secret {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char);
            }
            b' ' if plus => out.push('+'),
            b if upper => {
                let _ = write!(out, "%{b:02X}");
            }
            b => {
                let _ = write!(out, "%{b:02x}");
            }
        }
    }
    out
}

/// Every form in which `secret` is looked for (the secret itself first), without repeats.
pub fn forms(secret: &str) -> Vec<Zeroizing<String>> {
    let mut all: Vec<Zeroizing<String>> = vec![Zeroizing::new(secret.to_owned())];
    let mut encoded: Vec<Zeroizing<String>> = Vec::new();
    for style in JSON_STYLES {
        let once = Zeroizing::new(json_escape(secret, style));
        encoded.push(Zeroizing::new(json_escape(&once, JSON_STYLES[0])));
        encoded.push(once);
    }
    for engine in [
        &base64::engine::general_purpose::STANDARD_NO_PAD,
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ] {
        encoded.extend(
            base64_cores(secret.as_bytes(), engine)
                .into_iter()
                .map(Zeroizing::new),
        );
    }
    for (upper, plus) in [(true, false), (false, false), (true, true), (false, true)] {
        encoded.push(Zeroizing::new(percent(secret.as_bytes(), upper, plus)));
    }
    for form in encoded {
        if form.len() >= MIN_ENCODED && !all.iter().any(|f| f.as_str() == form.as_str()) {
            all.push(form);
        }
    }
    all
}

/// The forms of a set of secrets, found all at once.
#[derive(Default)]
pub struct Patterns {
    forms: Vec<Zeroizing<String>>,
    secrets: usize,
}

impl Patterns {
    /// Look for `secret` too (ignored when shorter than [`MIN_SECRET`]). Returns whether it
    /// was new.
    pub fn add(&mut self, secret: &str) -> bool {
        if secret.len() < MIN_SECRET || self.has(secret) {
            return false;
        }
        for form in forms(secret) {
            if !self.forms.iter().any(|f| f.as_str() == form.as_str()) {
                self.forms.push(form);
            }
        }
        self.secrets += 1;
        true
    }

    /// Whether `text` is already looked for (as a secret or one of its forms).
    pub fn has(&self, text: &str) -> bool {
        self.forms.iter().any(|f| f.as_str() == text)
    }

    /// How many secrets are looked for.
    pub fn secrets(&self) -> usize {
        self.secrets
    }

    /// Whether nothing is looked for.
    pub fn is_empty(&self) -> bool {
        self.forms.is_empty()
    }

    /// Add the byte ranges of every form found in `text` to `out`.
    pub fn find(&self, text: &str, out: &mut Vec<(usize, usize)>) {
        let hay = text.as_bytes();
        for form in &self.forms {
            let needle = form.as_bytes();
            if needle.len() > hay.len() {
                continue;
            }
            for at in memchr::memmem::find_iter(hay, needle) {
                out.push((at, at + needle.len()));
            }
        }
    }
}

/// `text` with each of `ranges` (merged where they overlap or touch) replaced by
/// [`REDACTED`]. Ranges are those of valid UTF-8 needles in valid UTF-8 text, so they lie on
/// character boundaries.
pub fn redact(text: &str, mut ranges: Vec<(usize, usize)>) -> Cow<'_, str> {
    if ranges.is_empty() {
        return Cow::Borrowed(text);
    }
    ranges.sort_unstable();
    let mut out = String::with_capacity(text.len());
    let mut at = 0usize;
    let mut i = 0usize;
    while i < ranges.len() {
        let (start, mut end) = ranges[i];
        i += 1;
        while i < ranges.len() && ranges[i].0 <= end {
            end = end.max(ranges[i].1);
            i += 1;
        }
        let start = start.max(at);
        // Both ends come from matches of whole UTF-8 needles, so they are boundaries; the
        // fallback keeps the text whole rather than panic if that ever were not so.
        match (text.get(at..start), text.get(start..end)) {
            (Some(before), Some(_)) => {
                out.push_str(before);
                out.push_str(REDACTED);
                at = end;
            }
            _ => return Cow::Owned(REDACTED.to_owned()),
        }
    }
    out.push_str(text.get(at..).unwrap_or(""));
    Cow::Owned(out)
}

/// Scrub every string of a JSON value, object keys included, with `scrub` (which returns
/// `None` when a string holds nothing to redact).
pub fn scrub_value(v: &mut Value, scrub: &dyn Fn(&str) -> Option<String>) {
    match v {
        Value::String(s) => {
            if let Some(clean) = scrub(s) {
                *s = clean;
            }
        }
        Value::Array(items) => {
            for item in items {
                scrub_value(item, scrub);
            }
        }
        Value::Object(map) => {
            if map.keys().any(|k| scrub(k).is_some()) {
                let old = std::mem::take(map);
                let mut fresh = Map::new();
                for (k, mut item) in old {
                    scrub_value(&mut item, scrub);
                    let key = scrub(&k).unwrap_or(k);
                    fresh.insert(key, item);
                }
                *map = fresh;
            } else {
                for item in map.values_mut() {
                    scrub_value(item, scrub);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scrub(p: &Patterns, t: &str) -> String {
        let mut r = Vec::new();
        p.find(t, &mut r);
        redact(t, r).into_owned()
    }

    fn patterns(secrets: &[&str]) -> Patterns {
        let mut p = Patterns::default();
        for s in secrets {
            p.add(s);
        }
        p
    }

    #[test]
    fn a_secret_inside_another_is_redacted_whole_in_either_order() {
        for order in [["abcd1234", "xxabcd1234yy"], ["xxabcd1234yy", "abcd1234"]] {
            let p = patterns(&order);
            assert_eq!(scrub(&p, "v=xxabcd1234yy."), "v=[REDACTED].");
            assert_eq!(scrub(&p, "v=abcd1234."), "v=[REDACTED].");
        }
        // Overlapping, neither inside the other.
        let p = patterns(&["abcdef12", "ef12ghij"]);
        assert_eq!(scrub(&p, "<abcdef12ghij>"), "<[REDACTED]>");
    }

    #[test]
    fn json_escaped_forms_are_found_once_and_twice() {
        let secret = "pa\"ss\\wo\nrd-é<&>";
        let p = patterns(&[secret]);
        let once = serde_json::to_string(secret).unwrap();
        let twice = serde_json::to_string(&once).unwrap();
        for shown in [&once, &twice] {
            let out = scrub(&p, shown);
            assert!(!out.contains("ss\\"), "{out}");
            assert!(out.contains(REDACTED), "{out}");
        }
        // Python's ensure_ascii, Go's HTML-safe escapes.
        let py = json_escape(secret, JSON_STYLES[1]);
        assert!(py.contains("\\u00e9"));
        assert_eq!(scrub(&p, &format!("x{py}y")), "x[REDACTED]y");
        let go = json_escape(secret, JSON_STYLES[3]);
        assert!(go.contains("\\u003c"));
        assert_eq!(scrub(&p, &format!("x{go}y")), "x[REDACTED]y");
    }

    #[test]
    fn base64_at_any_alignment_and_percent_encoding_are_found() {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE};
        let secret = "s3cr3t/+value?&=";
        let p = patterns(&[secret]);
        for prefix in ["", "a", "ab", "abc"] {
            for engine in [&STANDARD, &URL_SAFE] {
                let blob = engine.encode(format!("{prefix}{secret}tail"));
                let out = scrub(&p, &blob);
                assert!(out.contains(REDACTED), "{prefix:?} {blob} -> {out}");
                // All but the edge characters of the secret's part are gone.
                let kept = out.len() - REDACTED.len();
                assert!(
                    kept + secret.len() * 4 / 3 - 2 <= blob.len(),
                    "{blob} -> {out}"
                );
            }
        }
        for encoded in ["s3cr3t%2F%2Bvalue%3F%26%3D", "s3cr3t%2f%2bvalue%3f%26%3d"] {
            assert_eq!(scrub(&p, &format!("q={encoded}")), "q=[REDACTED]");
        }
        let p = patterns(&["two words here"]);
        assert_eq!(scrub(&p, "q=two+words+here&"), "q=[REDACTED]&");
    }

    #[test]
    fn short_secrets_and_short_forms_are_not_looked_for() {
        let mut p = Patterns::default();
        assert!(!p.add("abc"));
        assert!(p.is_empty());
        assert!(p.add("abcd"));
        assert!(!p.add("abcd"));
        assert_eq!(p.secrets(), 1);
        // Only the raw form (its encodings are under MIN_ENCODED or equal to it).
        assert_eq!(scrub(&p, "xabcdx YWJj"), "x[REDACTED]x YWJj");
    }

    #[test]
    fn values_are_scrubbed_in_keys_and_at_every_depth() {
        let p = patterns(&["canary-77"]);
        let f = |s: &str| {
            let mut r = Vec::new();
            p.find(s, &mut r);
            (!r.is_empty()).then(|| redact(s, r).into_owned())
        };
        let mut v = serde_json::json!({"a": [{"canary-77": "x canary-77"}], "b": 1});
        scrub_value(&mut v, &f);
        assert_eq!(
            v,
            serde_json::json!({"a": [{"[REDACTED]": "x [REDACTED]"}], "b": 1})
        );
    }

    fn special() -> impl Strategy<Value = String> {
        // Secrets with every kind of character a server might escape.
        proptest::collection::vec(
            prop_oneof![
                Just('"'),
                Just('\\'),
                Just('/'),
                Just('\n'),
                Just('\u{1}'),
                Just('<'),
                Just('&'),
                Just(' '),
                Just('+'),
                Just('%'),
                Just('é'),
                Just('\u{2028}'),
                Just('😀'),
                proptest::char::range('a', 'z'),
                proptest::char::range('0', '9'),
            ],
            MIN_SECRET..24,
        )
        .prop_map(|c| c.into_iter().collect())
    }

    proptest! {
        /// Any secret, in any of its forms, planted anywhere in any text: never left whole.
        #[test]
        fn every_form_of_every_secret_is_redacted(
            a in special(),
            b in special(),
            before in any::<String>(),
            after in any::<String>(),
            which in 0usize..64,
        ) {
            let inner = format!("{a}{b}");
            let p = patterns(&[&a, &inner]);
            for secret in [&a, &inner] {
                let all = forms(secret);
                let form = &all[which % all.len()];
                let out = scrub(&p, &format!("{before}{}{after}", form.as_str()));
                prop_assert!(!out.contains(form.as_str()));
                prop_assert!(!out.contains(secret.as_str()));
            }
        }

        /// Scrubbing text without secrets changes nothing.
        #[test]
        fn text_without_a_secret_is_unchanged(t in "[a-z ]{0,64}") {
            let p = patterns(&["Q9#Z!x_7"]);
            prop_assert_eq!(scrub(&p, &t), t);
        }
    }
}
