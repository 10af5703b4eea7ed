//! Rule 2: `Bearer <token>` / `Basic <token>` anywhere.

use super::{is_space_or_tab, token_run_end, trim_dots};

pub(super) fn scheme_ranges(b: &[u8], out: &mut Vec<(usize, usize)>) {
    let mut i = 0;
    while i < b.len() {
        let at_boundary = i == 0 || !b[i - 1].is_ascii_alphanumeric();
        if at_boundary {
            let rest = &b[i..];
            let word_len = [&b"bearer"[..], &b"basic"[..]].iter().find_map(|w| {
                (rest.len() > w.len() && rest[..w.len()].eq_ignore_ascii_case(w)).then_some(w.len())
            });
            if let Some(word_len) = word_len {
                let mut t = i + word_len;
                if is_space_or_tab(b[t]) {
                    while t < b.len() && is_space_or_tab(b[t]) {
                        t += 1;
                    }
                    let end = trim_dots(b, t, token_run_end(b, t));
                    if end > t && !is_prose_word(&b[t..end]) {
                        out.push((t, end));
                        i = end;
                        continue;
                    }
                }
            }
        }
        i += 1;
    }
}

/// An ordinary word: letters only, nothing uppercase after the first, shorter than 20 bytes,
/// ignoring trailing `=`.
fn is_prose_word(tok: &[u8]) -> bool {
    let mut end = tok.len();
    while end > 0 && tok[end - 1] == b'=' {
        end -= 1;
    }
    let word = &tok[..end];
    !word.is_empty()
        && word.len() < 20
        && word.iter().all(u8::is_ascii_alphabetic)
        && word[1..].iter().all(u8::is_ascii_lowercase)
}

#[cfg(test)]
mod tests {
    use crate::text::redact;

    #[test]
    fn bearer_and_basic_tokens_are_redacted_keeping_the_scheme_word() {
        assert_eq!(
            redact("sent Bearer abc123.def-456 to the server"),
            "sent Bearer [REDACTED] to the server"
        );
        assert_eq!(
            redact("using bearer  Zm9vYmFy."),
            "using bearer  [REDACTED]."
        );
        assert_eq!(redact("BASIC dXNlcjpwYXNz"), "BASIC [REDACTED]");
    }

    #[test]
    fn prose_after_bearer_or_basic_is_kept() {
        for s in [
            "Bearer tokens are accepted",
            "basic stuff works",
            r#"WWW-Authenticate: Bearer realm="api""#,
            "Basic Authentication is disabled",
        ] {
            assert_eq!(redact(s), s);
        }
    }
}
