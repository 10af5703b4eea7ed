//! Rule 3: URL userinfo.

use super::{REDACTED, find};

fn is_authority_end(c: u8) -> bool {
    c.is_ascii_whitespace()
        || matches!(
            c,
            b'/' | b'?' | b'#' | b'\\' | b'"' | b'\'' | b'<' | b'>' | b'`'
        )
}

pub(super) fn userinfo_ranges(b: &[u8], out: &mut Vec<(usize, usize)>) {
    let mut from = 0;
    while let Some(p) = find(b, from, b"://") {
        let start = p + 3;
        let mut end = start;
        let mut at = None;
        while end < b.len() && !is_authority_end(b[end]) {
            if b[end] == b'@' {
                at = Some(end);
            }
            end += 1;
        }
        if let Some(at) = at {
            let userinfo = &b[start..at];
            if let Some(colon) = userinfo.iter().position(|&c| c == b':')
                && &userinfo[colon + 1..] != REDACTED.as_bytes()
            {
                out.push((start, at));
            }
        }
        from = end.max(start);
    }
}

#[cfg(test)]
mod tests {
    use crate::text::redact;

    #[test]
    fn url_userinfo_is_redacted() {
        assert_eq!(
            redact("cloning https://user:pa55word@git.example.com/repo.git"),
            "cloning https://[REDACTED]@git.example.com/repo.git"
        );
        assert_eq!(
            redact("postgres://admin:p%40ss@db:5432/app"),
            "postgres://[REDACTED]@db:5432/app"
        );
    }

    #[test]
    fn userinfo_without_password_is_kept() {
        assert_eq!(
            redact("ssh://git@github.com/org/repo"),
            "ssh://git@github.com/org/repo"
        );
    }
}
