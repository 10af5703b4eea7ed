//! Rule 1: key/value pairs whose key names a credential.

use super::{REDACTED, contains, find, is_key_byte, is_space_or_tab};

/// Key words matched against the lowercased key with `_`, `-` and `.` removed.
const SENSITIVE_KEY_WORDS: &[&[u8]] = &[
    b"secret",
    b"password",
    b"passwd",
    b"passphrase",
    b"pwd",
    b"apikey",
    b"authorization",
    b"credential",
    b"privatekey",
    b"session",
    b"cookie",
    b"codeverifier",
    b"clientsecret",
    b"refresh",
    b"accesskey",
];

/// Authorization scheme words kept in front of a redacted credential.
const SCHEME_WORDS: &[&[u8]] = &[
    b"bearer",
    b"basic",
    b"digest",
    b"token",
    b"negotiate",
    b"ntlm",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyClass {
    /// Not a credential key.
    Plain,
    /// Only matched through plural `tokens`: a purely numeric value is a count.
    CountOnly,
    /// A credential key.
    Secret,
}

#[derive(Debug, Clone, Copy)]
struct KeyInfo {
    class: KeyClass,
    /// `Key: value` runs to the end of the line (HTTP header style).
    header_like: bool,
    /// A leading authorization scheme word is kept.
    auth_like: bool,
}

fn classify_key(key: &[u8]) -> KeyInfo {
    let lower: Vec<u8> = key.iter().map(u8::to_ascii_lowercase).collect();
    let compact: Vec<u8> = lower
        .iter()
        .copied()
        .filter(|c| !matches!(c, b'_' | b'-' | b'.'))
        .collect();
    let authorization = contains(&compact, b"authorization");
    let auth_segment = has_auth_segment(key);
    let header_like = authorization || contains(&compact, b"cookie");
    let auth_like = authorization || auth_segment;

    let mut class = if auth_segment || SENSITIVE_KEY_WORDS.iter().any(|w| contains(&compact, w)) {
        KeyClass::Secret
    } else {
        KeyClass::Plain
    };
    if class == KeyClass::Plain {
        let mut from = 0;
        while let Some(p) = find(&lower, from, b"token") {
            let after = &lower[p + 5..];
            if after.starts_with(b"iz") || after.starts_with(b"is") {
                // tokenizer, tokenise, tokenization: not credentials.
            } else if after.starts_with(b"s") {
                class = KeyClass::CountOnly;
            } else {
                class = KeyClass::Secret;
                break;
            }
            from = p + 5;
        }
    }
    KeyInfo {
        class,
        header_like,
        auth_like,
    }
}

/// Whether one segment of `key` is exactly `auth` (case-insensitive). Segments are split at
/// non-alphanumerics, lower→upper case changes and letter/digit changes.
fn has_auth_segment(key: &[u8]) -> bool {
    let mut start = 0;
    for i in 0..=key.len() {
        let boundary = match (i.checked_sub(1).map(|p| key[p]), key.get(i).copied()) {
            (_, None) => true,
            (_, Some(c)) if !c.is_ascii_alphanumeric() => true,
            (Some(p), Some(c)) => {
                (p.is_ascii_lowercase() && c.is_ascii_uppercase())
                    || (p.is_ascii_alphabetic() && c.is_ascii_digit())
                    || (p.is_ascii_digit() && c.is_ascii_alphabetic())
            }
            (None, Some(_)) => false,
        };
        if boundary {
            if key[start..i].eq_ignore_ascii_case(b"auth") {
                return true;
            }
            start = if key.get(i).is_some_and(|c| !c.is_ascii_alphanumeric()) {
                i + 1
            } else {
                i
            };
        }
    }
    false
}

pub(super) fn key_value_ranges(b: &[u8], out: &mut Vec<(usize, usize)>) {
    // Separators before `resume` lie inside a value that is already redacted.
    let mut resume = 0;
    for (i, &c) in b.iter().enumerate() {
        if (c == b'=' || c == b':')
            && i >= resume
            && let Some((start, end)) = key_value_at(b, i)
        {
            out.push((start, end));
            resume = end;
        }
    }
}

/// The value range to redact for the separator at `sep`, if its key is sensitive.
fn key_value_at(b: &[u8], sep: usize) -> Option<(usize, usize)> {
    let c = b[sep];
    let prev = sep.checked_sub(1).map(|p| b[p]);
    let next = b.get(sep + 1).copied();
    if c == b':'
        && (prev == Some(b':')
            || next == Some(b':')
            || (next == Some(b'/') && b.get(sep + 2) == Some(&b'/')))
    {
        return None;
    }
    if c == b'=' && (matches!(prev, Some(b'=' | b'!' | b'<' | b'>')) || next == Some(b'=')) {
        return None;
    }

    let mut key_end = sep;
    while key_end > 0 && is_space_or_tab(b[key_end - 1]) {
        key_end -= 1;
    }
    if key_end > 0 && matches!(b[key_end - 1], b'"' | b'\'') {
        key_end -= 1;
        if key_end > 0 && b[key_end - 1] == b'\\' {
            key_end -= 1;
        }
    }
    let mut key_start = key_end;
    while key_start > 0 && is_key_byte(b[key_start - 1]) {
        key_start -= 1;
    }
    // `scheme://user:pass@host` belongs to the userinfo rule, which keeps the host visible.
    if key_start == key_end || b[..key_start].ends_with(b"://") {
        return None;
    }
    let info = classify_key(&b[key_start..key_end]);
    if info.class == KeyClass::Plain {
        return None;
    }

    let mut v = sep + 1;
    while v < b.len() && is_space_or_tab(b[v]) {
        v += 1;
    }
    let first = *b.get(v)?;
    let (mut start, end) = match first {
        b'{' => return None,
        b'"' | b'\'' => quoted_value(b, v + 1, first, false),
        b'\\' if matches!(b.get(v + 1), Some(b'"' | b'\'')) => {
            quoted_value(b, v + 2, b[v + 1], true)
        }
        _ => {
            let start = if info.auth_like { skip_scheme(b, v) } else { v };
            let end = if info.header_like && c == b':' {
                line_end(b, start)
            } else {
                unquoted_end(b, start)
            };
            (start, end)
        }
    };
    if info.auth_like && matches!(first, b'"' | b'\'' | b'\\') {
        let after = skip_scheme(b, start);
        if after < end {
            start = after;
        }
    }
    if start >= end {
        return None;
    }
    let value = &b[start..end];
    if value == REDACTED.as_bytes() || (info.class == KeyClass::CountOnly && is_count(value)) {
        return None;
    }
    Some((start, end))
}

/// A plain non-negative integer, possibly followed by JSON closers (`7}` in `{"n_tokens":7}`).
fn is_count(value: &[u8]) -> bool {
    let digits = value.iter().take_while(|c| c.is_ascii_digit()).count();
    digits > 0
        && value[digits..]
            .iter()
            .all(|c| matches!(c, b'}' | b']' | b')'))
}

/// Content range of a quoted value whose content starts at `start`. With `escaped`, the quote is
/// written `\"` (JSON inside a JSON string). Unterminated values end at the end of the line.
fn quoted_value(b: &[u8], start: usize, quote: u8, escaped: bool) -> (usize, usize) {
    let mut i = start;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' || c == b'\r' {
            break;
        }
        if c == b'\\' {
            if escaped && b.get(i + 1) == Some(&quote) {
                break;
            }
            i += 2;
            continue;
        }
        if !escaped && c == quote {
            break;
        }
        i += 1;
    }
    (start, i.min(b.len()))
}

fn unquoted_end(b: &[u8], from: usize) -> usize {
    let mut i = from;
    while i < b.len()
        && !(b[i].is_ascii_whitespace() || matches!(b[i], b'&' | b',' | b';' | b'"' | b'\''))
    {
        i += 1;
    }
    i
}

fn line_end(b: &[u8], from: usize) -> usize {
    let mut i = from;
    while i < b.len() && b[i] != b'\n' && b[i] != b'\r' {
        i += 1;
    }
    i
}

/// If an authorization scheme word followed by blanks and a credential starts at `at`, the
/// credential's position; otherwise `at`.
fn skip_scheme(b: &[u8], at: usize) -> usize {
    let mut word_end = at;
    while word_end < b.len() && b[word_end].is_ascii_alphabetic() {
        word_end += 1;
    }
    let word = &b[at..word_end];
    if !SCHEME_WORDS.iter().any(|w| word.eq_ignore_ascii_case(w)) {
        return at;
    }
    let mut cred = word_end;
    while cred < b.len() && is_space_or_tab(b[cred]) {
        cred += 1;
    }
    match b.get(cred) {
        Some(&c) if cred > word_end && !c.is_ascii_whitespace() && !matches!(c, b'"' | b'\'') => {
            cred
        }
        _ => at,
    }
}

#[cfg(test)]
mod tests {
    use crate::text::redact;

    #[test]
    fn authorization_header_value_is_redacted_after_the_scheme() {
        assert_eq!(
            redact("Authorization: Bearer abcdefghijklmnop"),
            "Authorization: Bearer [REDACTED]"
        );
        assert_eq!(
            redact("authorization: token opaquevalue\nnext line"),
            "authorization: token [REDACTED]\nnext line"
        );
        assert_eq!(
            redact(r#"{"Authorization":"Basic dXNlcjpwYXNz"}"#),
            r#"{"Authorization":"Basic [REDACTED]"}"#
        );
        assert_eq!(
            redact("Proxy-Authorization: Digest username=\"u\", response=\"x\""),
            "Proxy-Authorization: Digest [REDACTED]"
        );
    }

    #[test]
    fn key_value_forms_are_redacted() {
        assert_eq!(redact("password=hunter2 next"), "password=[REDACTED] next");
        assert_eq!(redact("password: hunter2"), "password: [REDACTED]");
        assert_eq!(
            redact("db_password = hunter2;x"),
            "db_password = [REDACTED];x"
        );
        assert_eq!(
            redact(r#"{"client_secret":"s3cr3t","id":"x"}"#),
            r#"{"client_secret":"[REDACTED]","id":"x"}"#
        );
        assert_eq!(
            redact(r#"{"apiKey" : "abc"}"#),
            r#"{"apiKey" : "[REDACTED]"}"#
        );
        assert_eq!(redact("x_api_key=abc"), "x_api_key=[REDACTED]");
        assert_eq!(redact("X-Api-Key: abc"), "X-Api-Key: [REDACTED]");
        assert_eq!(
            redact("ITERON_MCP_ACCESS_TOKEN=abc"),
            "ITERON_MCP_ACCESS_TOKEN=[REDACTED]"
        );
        assert_eq!(redact("--passwd=abc"), "--passwd=[REDACTED]");
        assert_eq!(redact("PWD=abc"), "PWD=[REDACTED]");
        assert_eq!(redact("privateKey: abc"), "privateKey: [REDACTED]");
        assert_eq!(redact("private_key='abc'"), "private_key='[REDACTED]'");
        assert_eq!(redact("session_id=abc,"), "session_id=[REDACTED],");
        assert_eq!(redact("code_verifier=abc"), "code_verifier=[REDACTED]");
        assert_eq!(redact("refresh_token=abc"), "refresh_token=[REDACTED]");
        assert_eq!(
            redact("aws_access_key_id=abc"),
            "aws_access_key_id=[REDACTED]"
        );
        assert_eq!(redact("credentials: abc"), "credentials: [REDACTED]");
        assert_eq!(redact("auth=abc"), "auth=[REDACTED]");
        assert_eq!(redact("x-auth: abc"), "x-auth: [REDACTED]");
        assert_eq!(redact("AUTH_HEADER=abc"), "AUTH_HEADER=[REDACTED]");
        assert_eq!(redact("authKey=abc"), "authKey=[REDACTED]");
    }

    #[test]
    fn quoted_values_are_redacted_whole_including_spaces() {
        assert_eq!(
            redact(r#"passphrase = "correct horse battery staple" ok"#),
            r#"passphrase = "[REDACTED]" ok"#
        );
        assert_eq!(
            redact(r#"{"password":"a \"quoted\" pass"}"#),
            r#"{"password":"[REDACTED]"}"#
        );
    }

    #[test]
    fn escaped_json_inside_a_string_is_redacted() {
        assert_eq!(
            redact(r#"body: "{\"token\":\"abc def\",\"n\":1}""#),
            r#"body: "{\"token\":\"[REDACTED]\",\"n\":1}""#
        );
    }

    #[test]
    fn cookie_headers_are_redacted_to_the_end_of_the_line() {
        assert_eq!(
            redact("Cookie: a=1; b=2\nHost: x"),
            "Cookie: [REDACTED]\nHost: x"
        );
        assert_eq!(
            redact("set-cookie=sid123; Path=/"),
            "set-cookie=[REDACTED]; Path=/"
        );
    }

    #[test]
    fn url_query_parameters_are_redacted() {
        assert_eq!(
            redact("GET https://api.example.com/v1?access_token=abc123&page=2 failed"),
            "GET https://api.example.com/v1?access_token=[REDACTED]&page=2 failed"
        );
        assert_eq!(
            redact("https://x.test/cb?code_verifier=v&client_secret=s&state=ok"),
            "https://x.test/cb?code_verifier=[REDACTED]&client_secret=[REDACTED]&state=ok"
        );
    }

    #[test]
    fn author_authority_and_authentication_are_not_auth() {
        for s in [
            "author: Jane Doe",
            "commit author=jane",
            "authority=example.com",
            "authentication: failed for user jane",
            "OAuth consent screen",
        ] {
            assert_eq!(redact(s), s);
        }
    }

    #[test]
    fn tokenizer_and_token_counts_are_not_credentials() {
        for s in [
            "the tokenizer failed on input",
            "tokenizer: bpe",
            "tokenization=fast",
            "max_tokens=4096",
            r#"{"prompt_tokens": 12, "completion_tokens":7}"#,
            "a token was rejected",
        ] {
            assert_eq!(redact(s), s);
        }
        assert_eq!(redact("tokens=abc"), "tokens=[REDACTED]");
    }

    #[test]
    fn comparisons_and_paths_are_not_separators() {
        assert_eq!(redact("if token != expected"), "if token != expected");
        assert_eq!(redact("token://weird"), "token://weird");
    }

    #[test]
    fn nested_objects_under_sensitive_keys_are_judged_by_their_own_keys() {
        assert_eq!(
            redact(r#"{"session": {"id": 1, "password": "x"}}"#),
            r#"{"session": {"id": 1, "password": "[REDACTED]"}}"#
        );
    }
}
