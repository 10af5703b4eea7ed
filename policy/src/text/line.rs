//! Terminal injection: rendering any string as one plain, visible line of bounded size (the
//! escapes are specified under "Escape scheme" in the parent module).

use super::redaction::redact;
use super::unicode::classify;

/// Hard cap on any rendered single line (refusal reasons, error lines), in bytes.
pub const MAX_LINE_BYTES: usize = 512;

/// Smallest cap [`single_line_capped`] accepts; smaller requests are raised to this.
const MIN_LINE_BYTES: usize = 16;

/// Marks a truncated line.
const ELLIPSIS: &str = "\u{2026}";

/// Render any string as ONE terminal-safe line of at most `max` bytes (`max` is raised to 16 if
/// smaller).
///
/// The text is first [`redact`]ed; then `\` becomes `\\`, line feed, carriage return and tab
/// become `\n`, `\r`, `\t`, and every other character [`check_untrusted`] rejects becomes
/// `\u{hex}` (lowercase, no leading zeros), so all escapes are plain ASCII. If the result exceeds
/// `max` bytes it is cut between two characters/escapes (never inside an escape) and ends with
/// `…` (U+2026), the total staying within `max`.
///
/// [`check_untrusted`]: super::check_untrusted
pub fn single_line_capped(s: &str, max: usize) -> String {
    escape_capped(&redact(s), max)
}

/// Like [`single_line_capped`] but without redaction: for showing the operator exactly what
/// an agent asked for (an approval must not hide part of what it approves), terminal-safe and
/// capped the same way.
pub fn escape_capped(s: &str, max: usize) -> String {
    escape_capped_counted(s, max).text
}

/// An [`escape_capped`] rendering and how much of its input it leaves out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capped {
    /// The terminal-safe text (ending with `…` when it was cut).
    pub text: String,
    /// Bytes of the input that `text` does not show: 0 exactly when `text` renders all of it.
    pub omitted: usize,
}

impl Capped {
    /// Whether the rendering was cut.
    pub fn is_cut(&self) -> bool {
        self.omitted > 0
    }
}

/// [`escape_capped`], also saying how many bytes of `s` were cut away. Whether a rendering is
/// whole comes from the cut itself, never from comparing the input's length with the escaped
/// text's (escaping grows text, so such a comparison can hide a cut).
pub fn escape_capped_counted(s: &str, max: usize) -> Capped {
    let max = max.max(MIN_LINE_BYTES);
    let budget = max - ELLIPSIS.len();
    let mut out = String::with_capacity(s.len().min(max));
    // Length of `out` at the last unit boundary that still leaves room for the ellipsis, and
    // how much of the input it renders.
    let mut fits = 0;
    let mut fits_input = 0;
    for (at, c) in s.char_indices() {
        push_escaped(&mut out, c);
        if out.len() > max {
            out.truncate(fits);
            out.push_str(ELLIPSIS);
            return Capped {
                text: out,
                omitted: s.len() - fits_input,
            };
        }
        if out.len() <= budget {
            fits = out.len();
            fits_input = at + c.len_utf8();
        }
    }
    Capped {
        text: out,
        omitted: 0,
    }
}

/// Cap a line that is already rendered — the output of [`single_line_capped`] or
/// [`escape_capped`], or fixed text joined with such output — without escaping it a second
/// time: what is already terminal-safe (including `\` and the escapes it starts) is kept as
/// it is, so a reason passed from layer to layer is escaped exactly once. Anything that is not
/// safe is still escaped (raw text can never slip through), and the line is redacted again
/// (redaction is idempotent). When it exceeds `max` bytes (raised to 16) it is cut between two
/// escape units — never inside `\u{…}` or between the two characters of `\\` — and ends with
/// `…`, the total staying within `max`.
pub fn cap_rendered(s: &str, max: usize) -> String {
    let max = max.max(MIN_LINE_BYTES);
    let budget = max - ELLIPSIS.len();
    let redacted = redact(s);
    let mut out = String::with_capacity(redacted.len().min(max));
    let mut fits = 0;
    let mut rest = redacted.as_ref();
    while let Some(c) = rest.chars().next() {
        // One unit: an escape this module writes, or one character (escaped if unsafe).
        let unit_len = if c == '\\' {
            rendered_escape_len(rest).unwrap_or(1)
        } else {
            c.len_utf8()
        };
        let (unit, tail) = rest.split_at(unit_len);
        if unit == "\\" {
            out.push('\\');
        } else if unit.len() > 1 && unit.starts_with('\\') {
            out.push_str(unit);
        } else {
            push_escaped_rendered(&mut out, c);
        }
        rest = tail;
        if out.len() > max {
            out.truncate(fits);
            out.push_str(ELLIPSIS);
            return out;
        }
        if out.len() <= budget {
            fits = out.len();
        }
    }
    out
}

/// The length of the escape at the start of `s` (which starts with `\`): `\\`, `\n`, `\r`,
/// `\t` or `\u{` + 1 to 6 hex digits + `}`; `None` when it is not one.
fn rendered_escape_len(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    match b.get(1)? {
        b'\\' | b'n' | b'r' | b't' => Some(2),
        b'u' if b.get(2) == Some(&b'{') => {
            let digits = b[3..].iter().take_while(|c| c.is_ascii_hexdigit()).count();
            ((1..=6).contains(&digits) && b.get(3 + digits) == Some(&b'}')).then_some(4 + digits)
        }
        _ => None,
    }
}

/// Like [`push_escaped`], except that a lone `\` (one that starts no escape) is kept: in a
/// rendered line it stands for itself.
fn push_escaped_rendered(out: &mut String, c: char) {
    if c == '\\' {
        out.push('\\');
    } else {
        push_escaped(out, c);
    }
}

/// `single_line_capped(s, MAX_LINE_BYTES)`.
pub fn single_line(s: &str) -> String {
    single_line_capped(s, MAX_LINE_BYTES)
}

/// Appends `c`, or its escape, to `out`.
fn push_escaped(out: &mut String, c: char) {
    match c {
        '\\' => out.push_str("\\\\"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        _ if classify(c, false).is_some() => {
            out.push_str("\\u{");
            let cp = u32::from(c);
            let mut started = false;
            for shift in (0..8u32).rev() {
                let nibble = (cp >> (shift * 4)) & 0xf;
                if nibble != 0 || started || shift == 0 {
                    started = true;
                    out.push(char::from_digit(nibble, 16).unwrap_or('?'));
                }
            }
            out.push('}');
        }
        _ => out.push(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::check_untrusted;
    use crate::text::strategies::any_text;
    use proptest::prelude::*;

    #[test]
    fn newlines_escape_sequences_and_bidi_are_escaped() {
        assert_eq!(single_line("a\nb\r\tc"), "a\\nb\\r\\tc");
        assert_eq!(single_line("\u{1B}[31mred"), "\\u{1b}[31mred");
        assert_eq!(single_line("ab\u{202E}cd"), "ab\\u{202e}cd");
        assert_eq!(single_line("\0\u{E0041}\u{85}"), "\\u{0}\\u{e0041}\\u{85}");
        assert_eq!(single_line("back\\slash"), "back\\\\slash");
        assert_eq!(single_line("Crème 中 \u{1F600}"), "Crème 中 \u{1F600}");
    }

    #[test]
    fn single_line_redacts_before_escaping() {
        assert_eq!(
            single_line("login failed\npassword=hunter2"),
            "login failed\\npassword=[REDACTED]"
        );
    }

    #[test]
    fn single_line_output_has_nothing_check_untrusted_rejects() {
        let nasty = "x\u{202E}\u{2067}\u{200B}\u{FEFF}\u{AD}\u{FE0F}\u{3164}\u{1B}\0\u{7F}\u{85}\u{E000}\u{378}\u{2028}\u{2029}\n\r\t";
        let out = single_line(nasty);
        assert_eq!(check_untrusted(&out, false), Ok(()));
        assert!(out.is_ascii());
    }

    #[test]
    fn output_never_exceeds_max_for_every_cap_from_16_to_600() {
        let input = "é\u{202E}中\n".repeat(200) + &"word ".repeat(100);
        for max in 16..600 {
            let out = single_line_capped(&input, max);
            assert!(out.len() <= max, "max {max}: {}", out.len());
            assert!(out.ends_with(ELLIPSIS));
            assert_eq!(check_untrusted(&out, false), Ok(()));
        }
    }

    #[test]
    fn caps_below_16_are_raised_to_16() {
        let out = single_line_capped(&"a".repeat(100), 0);
        assert_eq!(out, format!("{}{ELLIPSIS}", "a".repeat(13)));
    }

    #[test]
    fn short_text_is_not_truncated() {
        assert_eq!(
            single_line_capped("exactly sixteen!", 16),
            "exactly sixteen!"
        );
        assert_eq!(single_line(""), "");
    }

    #[test]
    fn ten_kib_input_is_capped_to_512_bytes_with_an_ellipsis() {
        let input = "lorem ipsum ".repeat(10 * 1024 / 12 + 1);
        assert!(input.len() >= 10 * 1024);
        let out = single_line(&input);
        assert!(out.len() <= MAX_LINE_BYTES);
        assert!(out.len() >= MAX_LINE_BYTES - 3);
        assert!(out.ends_with(ELLIPSIS));
        assert!(input.starts_with(out.trim_end_matches(ELLIPSIS)));
    }

    #[test]
    fn truncation_never_cuts_an_escape_in_half() {
        let input = "\u{202E}".repeat(100);
        for max in 16..120 {
            let out = single_line_capped(&input, max);
            assert!(out.len() <= max);
            let body = out.strip_suffix(ELLIPSIS).expect("truncated");
            assert_eq!(body.len() % "\\u{202e}".len(), 0, "max {max}: {out}");
            assert_eq!(body, "\\u{202e}".repeat(body.len() / 8));
        }
        let out = single_line_capped(&"\\".repeat(40), 16);
        assert_eq!(out, format!("{}{ELLIPSIS}", "\\\\".repeat(6)));
    }

    #[test]
    fn a_rendered_line_is_capped_without_being_escaped_again() {
        let raw = "C:\\dir \u{1b}[31mred\r\u{202e}x \\n";
        let once = single_line_capped(raw, 200);
        assert_eq!(once, "C:\\\\dir \\u{1b}[31mred\\r\\u{202e}x \\\\n");
        // Passed on, it stays as it is; the escaping path would double it.
        assert_eq!(cap_rendered(&once, 200), once);
        assert_eq!(
            cap_rendered(&format!("prefix: {once}"), 512),
            format!("prefix: {once}")
        );
        assert_ne!(single_line_capped(&once, 200), once);
        // Raw text never slips through.
        assert_eq!(
            cap_rendered(raw, 200),
            "C:\\dir \\u{1b}[31mred\\r\\u{202e}x \\n"
        );
        assert_eq!(cap_rendered("a\nb\u{85}", 64), "a\\nb\\u{85}");
        // It is cut between units: never inside \u{..} or a \\ pair.
        let units = "\\u{202e}".repeat(40);
        for max in 16..120 {
            let out = cap_rendered(&units, max);
            assert!(out.len() <= max, "{max}");
            let body = out.strip_suffix(ELLIPSIS).expect("cut");
            assert_eq!(body, "\\u{202e}".repeat(body.len() / 8), "{max}: {out}");
        }
        let pairs = "\\\\".repeat(40);
        for max in 16..60 {
            let body = cap_rendered(&pairs, max);
            let body = body.strip_suffix(ELLIPSIS).expect("cut");
            assert_eq!(body.len() % 2, 0, "{max}: a pair was split: {body}");
        }
        // Still redacted.
        assert_eq!(cap_rendered("token=abc123", 64), "token=[REDACTED]");
        // Not an escape: a lone backslash stays itself.
        assert_eq!(cap_rendered("\\u{zz} \\q", 64), "\\u{zz} \\q");
    }

    #[test]
    fn a_cut_is_reported_by_what_was_cut_not_by_comparing_lengths() {
        // 17.4: bidi controls triple in size when escaped, so a 1,811-byte text renders to
        // 4,800 bytes: over a 4,096-byte cap although the raw text is shorter than the cap.
        let hidden = format!("{}/etc/target", "\u{202e}".repeat(600));
        let c = escape_capped_counted(&hidden, 4096);
        assert!(hidden.len() < 4096);
        assert!(c.is_cut() && c.text.ends_with(ELLIPSIS));
        assert!(!c.text.contains("target"));
        let shown = c.text.strip_suffix(ELLIPSIS).unwrap();
        assert_eq!(
            shown,
            escape_capped(&hidden[..hidden.len() - c.omitted], usize::MAX)
        );
        assert_eq!(c.omitted, hidden.len() - shown.len() / 8 * 3);
        // At the cap exactly: whole, nothing omitted; one byte of input more: cut, and the
        // omitted count names every byte not shown.
        let at = "a".repeat(4096);
        assert_eq!(escape_capped_counted(&at, 4096).omitted, 0);
        assert_eq!(escape_capped_counted(&at, 4096).text, at);
        let over = "a".repeat(4097);
        let c = escape_capped_counted(&over, 4096);
        assert_eq!(c.text.len(), 4096);
        assert_eq!(c.omitted, 4097 - (4096 - ELLIPSIS.len()));
        iteron_test_support::record!(
            "P14",
            serde_json::json!({"cap": 4096, "hidden_bytes": hidden.len()}),
        );
    }

    fn check_rendered(s: &str, max: usize) -> Result<(), TestCaseError> {
        let out = single_line_capped(s, max);
        prop_assert!(out.len() <= max.max(16), "{} > {}", out.len(), max);
        prop_assert!(!out.contains('\n') && !out.contains('\r'));
        prop_assert_eq!(check_untrusted(&out, false), Ok(()));
        Ok(())
    }

    proptest! {
        #[test]
        fn a_capped_rendering_says_exactly_what_it_left_out(s in any_text(), max in 0usize..700) {
            let c = escape_capped_counted(&s, max);
            prop_assert_eq!(&c.text, &escape_capped(&s, max));
            prop_assert!(c.omitted <= s.len());
            let whole = escape_capped(&s, usize::MAX);
            if c.is_cut() {
                let shown = c.text.strip_suffix(ELLIPSIS).unwrap();
                prop_assert_eq!(shown, escape_capped(&s[..s.len() - c.omitted], usize::MAX));
                prop_assert_ne!(&c.text, &whole);
            } else {
                prop_assert_eq!(&c.text, &whole);
            }
        }

        #[test]
        fn rendered_lines_are_bounded_single_and_safe(s in any_text(), max in 0usize..700) {
            check_rendered(&s, max)?;
        }

        #[test]
        fn default_rendering_is_bounded_single_and_safe(s in any_text()) {
            check_rendered(&s, MAX_LINE_BYTES)?;
        }
    }
}
