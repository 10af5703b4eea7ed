//! Credential leaks: replacing tokens and passwords in text with `[REDACTED]` (the rules are
//! specified under "Redaction rules" in the parent module; each numbered rule has its own
//! submodule, and the byte classes they share are here).

use std::borrow::Cow;

mod blob;
mod key_value;
mod scheme;
mod shapes;
mod userinfo;

use blob::random_blob_ranges;
use key_value::key_value_ranges;
use scheme::scheme_ranges;
use shapes::token_shape_ranges;
use userinfo::userinfo_ranges;

/// Replacement text for redacted material.
const REDACTED: &str = "[REDACTED]";

/// Upper bound on redaction rounds; each round after the first only runs when the previous one
/// changed the text, and in practice the second round finds nothing.
const MAX_REDACTION_ROUNDS: usize = 8;

/// Redact credential-looking material (see the `text` module documentation for the rules),
/// replacing each match with `[REDACTED]`. Returns the input unchanged (`Cow::Borrowed`) when
/// nothing matched. Idempotent: redacting the output again changes nothing.
pub fn redact(s: &str) -> Cow<'_, str> {
    let Some(mut current) = redact_once(s) else {
        return Cow::Borrowed(s);
    };
    for _ in 1..MAX_REDACTION_ROUNDS {
        match redact_once(&current) {
            Some(next) => current = next,
            None => break,
        }
    }
    Cow::Owned(current)
}

/// One redaction round; `None` when nothing (new) matched.
fn redact_once(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut ranges = Vec::new();
    key_value_ranges(b, &mut ranges);
    scheme_ranges(b, &mut ranges);
    userinfo_ranges(b, &mut ranges);
    token_shape_ranges(b, &mut ranges);
    let mut ranges = merge(ranges);
    let blobs = random_blob_ranges(b, &ranges);
    if !blobs.is_empty() {
        ranges.extend(blobs);
        ranges = merge(ranges);
    }

    let mut out = String::with_capacity(s.len());
    let mut pos = 0;
    let mut changed = false;
    for (start, end) in ranges {
        // Every rule starts and ends ranges next to ASCII bytes; widening to char boundaries is
        // a guard that keeps the slicing below panic-free regardless.
        let mut start = start.min(s.len());
        let mut end = end.min(s.len());
        while start > 0 && !s.is_char_boundary(start) {
            start -= 1;
        }
        while end < s.len() && !s.is_char_boundary(end) {
            end += 1;
        }
        let start = start.max(pos);
        if start >= end || &s[start..end] == REDACTED {
            continue;
        }
        out.push_str(&s[pos..start]);
        out.push_str(REDACTED);
        pos = end;
        changed = true;
    }
    if !changed {
        return None;
    }
    out.push_str(&s[pos..]);
    Some(out)
}

/// Sorts ranges and joins overlapping or touching ones; drops empty ones.
fn merge(mut ranges: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    ranges.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        if start >= end {
            continue;
        }
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// ASCII alphanumerics plus `- _ . ~ + / =`.
fn is_token_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b'~' | b'+' | b'/' | b'=')
}

/// Characters allowed in a key of a key/value pair.
fn is_key_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.')
}

fn is_word_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn is_word_or_dash(c: u8) -> bool {
    is_word_byte(c) || c == b'-'
}

fn is_alnum_or_dash(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'-'
}

fn is_upper_or_digit(c: u8) -> bool {
    c.is_ascii_uppercase() || c.is_ascii_digit()
}

fn is_alnum(c: u8) -> bool {
    c.is_ascii_alphanumeric()
}

fn is_space_or_tab(c: u8) -> bool {
    c == b' ' || c == b'\t'
}

/// End of the token run starting at `from`.
fn token_run_end(b: &[u8], from: usize) -> usize {
    let mut end = from;
    while end < b.len() && is_token_byte(b[end]) {
        end += 1;
    }
    end
}

/// Moves `end` back over trailing dots, not below `start`.
fn trim_dots(b: &[u8], start: usize, mut end: usize) -> usize {
    while end > start && b[end - 1] == b'.' {
        end -= 1;
    }
    end
}

/// How many leading bytes of `s` satisfy `pred`, counting no further than `limit`.
fn count_while(s: &[u8], pred: fn(u8) -> bool, limit: usize) -> usize {
    s.iter().take(limit).take_while(|&&c| pred(c)).count()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// Position of `needle` in `b` at or after `from`.
fn find(b: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    b.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::MAX_LINE_BYTES;
    use crate::text::single_line;
    use crate::text::strategies::any_text;
    use proptest::prelude::*;

    #[test]
    fn the_canary_secret_disappears_everywhere() {
        let canary = "sk-live-CANARY0123456789abcdef";
        for text in [
            canary.to_string(),
            format!("error: invalid key {canary}"),
            format!("{{\"detail\":\"bad key {canary}\"}}"),
            format!("Authorization: Bearer {canary}"),
            format!("https://h/?key={canary}"),
            format!("prefix-{canary}"),
        ] {
            let out = redact(&text);
            assert!(!out.contains("CANARY"), "{text} -> {out}");
            assert!(out.contains(REDACTED));
            assert!(!single_line(&text).contains("CANARY"));
        }
    }

    #[test]
    fn nothing_matched_returns_the_input_borrowed() {
        let s = "all fine: nothing to see here";
        assert!(matches!(redact(s), Cow::Borrowed(b) if b == s));
    }

    #[test]
    fn ordinary_paths_ids_and_names_are_kept() {
        for s in [
            "/usr/local/bin/server",
            "/usr/local/lib/x86_64-linux-gnu/libssl.so.3",
            "/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/icu_properties-2.4.0/src/lib.rs",
            "request 123e4567-e89b-12d3-a456-426614174000 failed",
            "com.example.service.implementation.FactoryBuilderV2",
            "disk-partition-manager-v2-extended",
            "task-0123456789abcdefghij",
            "see https://example.com/docs/a/b?page=2#x",
            "a == token",
            "iteron::token::parse failed",
            "x = 1; y: 2",
        ] {
            assert_eq!(redact(s), s);
        }
    }

    #[test]
    fn redact_is_idempotent_on_examples() {
        for s in [
            "password=hunter2 Authorization: Bearer abc123 https://u:p@h/x ghp_0123456789abcdefghij",
            "Cookie: a=1; b=2",
            r#"{"token":"[REDACTED]"}"#,
            "https://u:ab/cd0123456789abcdefABCDEF0123456789abcdef@h",
            "[REDACTED][REDACTED] token=[REDACTED]x",
        ] {
            let once = redact(s).into_owned();
            assert_eq!(redact(&once), once, "{s}");
        }
    }

    #[test]
    fn already_redacted_text_is_returned_borrowed() {
        let s = "password=[REDACTED] Bearer [REDACTED] https://[REDACTED]@h";
        assert!(matches!(redact(s), Cow::Borrowed(_)));
    }

    #[test]
    fn pathological_inputs_are_processed_in_linear_time() {
        // Each would take minutes with a quadratic scan; together they finish in well under a
        // second when every rule is linear.
        for unit in [
            "sk-",
            "eyJ-",
            "eyJaaaaaaaaaa.",
            "token=",
            "a:",
            "://",
            "://a:b@",
            "Bearer ",
            "password: \"",
            "\\\"",
            "AKIA",
            "ghp_",
            "=",
            "aB3/",
        ] {
            let input = unit.repeat(200_000 / unit.len());
            let out = single_line(&input);
            assert!(out.len() <= MAX_LINE_BYTES, "{unit}");
            let once = redact(&input).into_owned();
            assert_eq!(redact(&once), once, "{unit}");
        }
    }

    proptest! {
        #[test]
        fn redact_is_idempotent(s in any_text()) {
            let once = redact(&s).into_owned();
            prop_assert_eq!(redact(&once), Cow::Borrowed(once.as_str()));
        }

        #[test]
        fn embedded_canary_never_survives(prefix in any_text(), suffix in any_text()) {
            let text = format!("{prefix} sk-live-CANARY0123456789abcdef {suffix}");
            let out = redact(&text);
            prop_assert!(!out.contains("CANARY0123456789abcdef"));
        }
    }
}
