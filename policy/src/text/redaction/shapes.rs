//! Rule 4: well-known token shapes.

use super::{
    count_while, is_alnum, is_alnum_or_dash, is_token_byte, is_upper_or_digit, is_word_byte,
    is_word_or_dash, token_run_end, trim_dots,
};

pub(super) fn token_shape_ranges(b: &[u8], out: &mut Vec<(usize, usize)>) {
    let mut i = 0;
    while i < b.len() {
        if !is_token_byte(b[i]) {
            i += 1;
            continue;
        }
        let run_end = token_run_end(b, i);
        // JWT candidates before this position are known not to match (see `jwt_shape`).
        let mut jwt_skip = i;
        for p in i..run_end {
            if (p == 0 || !b[p - 1].is_ascii_alphanumeric())
                && shape_at(&b[p..run_end], p, &mut jwt_skip)
            {
                let end = trim_dots(b, p, run_end);
                if end > p {
                    out.push((p, end));
                }
                break;
            }
        }
        i = run_end;
    }
}

/// Whether the token run remainder `rest` (starting at byte `p`) begins with a known shape.
fn shape_at(rest: &[u8], p: usize, jwt_skip: &mut usize) -> bool {
    let body = |prefix: usize, pred: fn(u8) -> bool, min: usize| {
        count_while(&rest[prefix..], pred, min) >= min
    };
    if rest.starts_with(b"github_pat_") {
        return body(11, is_word_byte, 16);
    }
    if rest.len() >= 4
        && rest.starts_with(b"gh")
        && matches!(rest[2], b'p' | b'o' | b'u' | b's' | b'r')
        && rest[3] == b'_'
    {
        return body(4, is_word_byte, 16);
    }
    if rest.starts_with(b"glpat-") {
        return body(6, is_word_or_dash, 16);
    }
    if rest.len() >= 5
        && rest.starts_with(b"xox")
        && matches!(rest[3], b'b' | b'p' | b'a' | b'r')
        && rest[4] == b'-'
    {
        return body(5, is_alnum_or_dash, 10);
    }
    if rest.starts_with(b"sk-") {
        return rest.len() - 3 >= 16;
    }
    if rest.starts_with(b"AKIA") || rest.starts_with(b"ASIA") {
        return body(4, is_upper_or_digit, 16);
    }
    if rest.starts_with(b"npm_") {
        return body(4, is_alnum, 36);
    }
    if rest.starts_with(b"AIza") {
        return body(4, is_word_or_dash, 35);
    }
    if rest.starts_with(b"eyJ") && p >= *jwt_skip {
        return match jwt_shape(rest) {
            Ok(()) => true,
            Err(stopped) => {
                // Any later candidate before `stopped` shares the segment that failed.
                *jwt_skip = p + stopped;
                false
            }
        };
    }
    false
}

/// `eyJ<seg1>.<seg2>.<seg3>` with base64url segments: seg1 ≥ 10 bytes, seg2 ≥ 2, seg3 any.
/// On failure, the offset where scanning stopped.
fn jwt_shape(rest: &[u8]) -> Result<(), usize> {
    let seg1 = count_while(rest, is_word_or_dash, usize::MAX);
    if seg1 < 10 || rest.get(seg1) != Some(&b'.') {
        return Err(seg1.max(1));
    }
    let seg2 = count_while(&rest[seg1 + 1..], is_word_or_dash, usize::MAX);
    if seg2 < 2 || rest.get(seg1 + 1 + seg2) != Some(&b'.') {
        return Err(seg1 + 1 + seg2);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::text::redact;

    #[test]
    fn github_tokens_disappear() {
        for prefix in ["ghp_", "gho_", "ghu_", "ghs_", "ghr_"] {
            let token = format!("{prefix}A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8");
            let out = redact(&format!("token is {token}.")).into_owned();
            assert_eq!(out, "token is [REDACTED].", "{prefix}");
        }
        let pat = "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz";
        assert_eq!(redact(&format!("use {pat} now")), "use [REDACTED] now");
        assert_eq!(
            redact("https://x-access-token:ghs_0123456789abcdefABCDEF@github.com/o/r"),
            "https://[REDACTED]@github.com/o/r"
        );
    }

    #[test]
    fn vendor_token_shapes_disappear() {
        for token in [
            "glpat-0123456789abcdefghij",
            "xoxb-123456789012-abcdefghijkl",
            "xoxp-1234567890-abc",
            "xoxa-2-abcdefghij",
            "xoxr-abcdefghij12",
            "sk-0123456789abcdefXYZ",
            "sk-ant-api03-abcdefghijklmnop",
            "sk-proj-abcdefghijklmnop",
            "AKIAIOSFODNN7EXAMPLE",
            "ASIAIOSFODNN7EXAMPLE",
            "npm_abcdefghijklmnopqrstuvwxyz0123456789",
            "AIzaSyA-abcdefghijklmnopqrstuvwxyz01234",
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig-nature_x",
        ] {
            let out = redact(&format!("x {token} y")).into_owned();
            assert_eq!(out, "x [REDACTED] y", "{token}");
        }
    }
}
