//! Rule 5: long random-looking runs.

use super::{is_token_byte, trim_dots};

/// Token bytes except `=`, which only trails a blob as padding.
fn is_blob_byte(c: u8) -> bool {
    c != b'=' && is_token_byte(c)
}

/// Blob ranges outside the (sorted, merged) `taken` ranges; those act as run breaks.
pub(super) fn random_blob_ranges(b: &[u8], taken: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut t = 0;
    let mut i = 0;
    while i < b.len() {
        while t < taken.len() && taken[t].1 <= i {
            t += 1;
        }
        let limit = match taken.get(t) {
            Some(&(start, end)) if start <= i => {
                i = end;
                continue;
            }
            Some(&(start, _)) => start,
            None => b.len(),
        };
        if !is_blob_byte(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < limit && is_blob_byte(b[i]) {
            i += 1;
        }
        while i < limit && b[i] == b'=' {
            i += 1;
        }
        let end = trim_dots(b, start, i);
        if looks_random(&b[start..end]) {
            out.push((start, end));
        }
    }
    out
}

/// ≥ 40 bytes, letters and digits, and a lowercase/uppercase/digit class change between
/// neighbouring alphanumerics at least once per four bytes.
fn looks_random(run: &[u8]) -> bool {
    if run.len() < 40
        || !run.iter().any(u8::is_ascii_alphabetic)
        || !run.iter().any(u8::is_ascii_digit)
    {
        return false;
    }
    let class = |c: u8| {
        if c.is_ascii_lowercase() {
            1
        } else if c.is_ascii_uppercase() {
            2
        } else if c.is_ascii_digit() {
            3
        } else {
            0
        }
    };
    let changes = run
        .windows(2)
        .filter(|w| {
            let (a, b) = (class(w[0]), class(w[1]));
            a != 0 && b != 0 && a != b
        })
        .count();
    changes * 4 >= run.len()
}

#[cfg(test)]
mod tests {
    use crate::text::redact;
    use crate::text::redaction::REDACTED;

    #[test]
    fn long_random_blobs_are_redacted() {
        let b64 = "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MGFiY2RlZmdoaWprbG1ub3A=";
        assert_eq!(redact(&format!("blob {b64} end")), "blob [REDACTED] end");
        let hex = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
        assert_eq!(redact(&format!("digest {hex}")), "digest [REDACTED]");
        let aws = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
        assert_eq!(redact(aws), REDACTED);
        // The key survives when only the value is a blob.
        assert_eq!(redact(&format!("X_DATA={b64}")), "X_DATA=[REDACTED]");
    }
}
