//! Safe handling of untrusted text.
//!
//! Text that reaches Iteron from outside (configuration files, server responses, repository
//! files, error messages of other programs) is attacker-influenced. This module guards against
//! three ways such text can hurt the operator or an agent:
//!
//! * **Deceptive Unicode** ("Trojan Source" style attacks): bidirectional controls that reorder
//!   what is displayed, invisible (default-ignorable) characters that make two different
//!   identifiers look identical, format and private-use characters, unassigned code points and
//!   line/paragraph separators. [`check_untrusted`] rejects identifiers and display strings that
//!   contain any of them.
//! * **Terminal injection**: control characters (ESC sequences, carriage returns, NUL, DEL, C1
//!   controls such as NEL) that rewrite or hide what the operator sees, and newlines that forge
//!   extra log lines. [`single_line`] and [`single_line_capped`] render any string as one line of
//!   plain, visible text of bounded size.
//! * **Credential leaks**: tokens and passwords embedded in URLs, headers or error text that would
//!   otherwise be shown to an operator or handed to an agent. [`redact`] replaces them with
//!   `[REDACTED]`; the single-line renderers always redact first.
//!
//! # Character classes
//!
//! [`check_untrusted`] classifies each character in this order, reporting the first that
//! matches (so U+202E is a [`UnsafeKind::BidiControl`] and U+200B an [`UnsafeKind::Invisible`]):
//!
//! 1. `Bidi_Control` → [`UnsafeKind::BidiControl`];
//! 2. `Default_Ignorable_Code_Point` → [`UnsafeKind::Invisible`] (this includes ZWJ and variation
//!    selectors, so emoji *sequences* are rejected while single emoji pass);
//! 3. `General_Category`: `Cc` → [`UnsafeKind::Control`] (`'\n'` and `'\t'` are exempt when
//!    newlines are allowed, `'\r'` never is), `Cf` → [`UnsafeKind::Format`], `Co` →
//!    [`UnsafeKind::PrivateUse`], `Cn` (and `Cs`, which a `&str` cannot hold) →
//!    [`UnsafeKind::Unassigned`], `Zl`/`Zp` → [`UnsafeKind::LineSeparator`].
//!
//! # Redaction rules
//!
//! [`redact`] scans plain bytes (no regular expressions) and replaces each match with
//! `[REDACTED]`. *Token characters* are ASCII alphanumerics and `- _ . ~ + / =`.
//!
//! 1. **Key/value pairs**: `key=value`, `key: value`, `key = "value"`, `"key":"value"` and the
//!    backslash-escaped JSON form `\"key\":\"value\"`. The key is the run of ASCII alphanumerics,
//!    `_`, `-` and `.` before the separator (so URL query parameters and `--flag=value` are
//!    covered). It is sensitive when, lowercased with `_`, `-` and `.` removed, it contains one
//!    of `token`, `secret`, `password`, `passwd`, `passphrase`, `pwd`, `apikey`, `authorization`,
//!    `credential`, `privatekey`, `session`, `cookie`, `codeverifier`, `clientsecret`,
//!    `refresh` or `accesskey` (so `api_key`, `api-key`, `x_api_key`, `privateKey`,
//!    `ITERON_MCP_ACCESS_TOKEN` all match), or when one of its segments (split at punctuation,
//!    lower→upper case changes and letter/digit changes) is exactly `auth`.
//!    * An unquoted value ends at ASCII whitespace, `&`, `,`, `;`, a quote or the end; a quoted
//!      value runs to its closing quote (honouring backslash escapes) or the end of the line, so
//!      quoted passphrases with spaces are covered whole.
//!    * For header-like keys (containing `authorization` or `cookie`) written `Key: value`, the
//!      unquoted value runs to the end of the line, so every cookie of a `Cookie:` header goes.
//!    * For authorization keys (containing `authorization`, or with an `auth` segment) a leading
//!      scheme word (`Bearer`, `Basic`, `Digest`, `Token`, `Negotiate`, `NTLM`) is kept and the
//!      credential after it is redacted.
//!    * A value starting with `{` is left alone (its nested keys are judged on their own); a
//!      key matched only through the plural `tokens` (`max_tokens`, `prompt_tokens`) keeps a
//!      purely numeric value, because that is a count; `tokenizer`/`tokenise`/`tokenization`
//!      are not credentials at all.
//!    * `a::b`, `scheme://`, `==`, `!=`, `<=` and `>=` are not separators.
//! 2. **Authorization schemes anywhere**: `Bearer <token>` and `Basic <token>` (scheme word
//!    case-insensitive) keep the scheme word and redact the token run after it, unless that
//!    run is an ordinary prose word (only letters, nothing uppercase after the first, shorter
//!    than 20, ignoring trailing `=`), so "Bearer tokens are..." or `Bearer realm="x"` stay.
//! 3. **URL userinfo**: `scheme://user:pass@host` becomes `scheme://[REDACTED]@host`. A userinfo
//!    without `:` (`ssh://git@host`) is kept: it names an account, not a secret.
//! 4. **Well-known token shapes**, starting at the beginning of a token run or after a
//!    non-alphanumeric character inside one, and redacted to the end of the run: `ghp_`, `gho_`,
//!    `ghu_`, `ghs_`, `ghr_`, `github_pat_` (each + ≥ 16 word characters); `glpat-` (+ ≥ 16);
//!    `xoxb-`/`xoxp-`/`xoxa-`/`xoxr-` (+ ≥ 10); `sk-` + ≥ 16 token characters (covers `sk-ant-`,
//!    `sk-proj-`, `sk-live-`); `AKIA`/`ASIA` + 16 uppercase letters or digits; `npm_` + 36
//!    alphanumerics; `AIza` + 35 characters; JWT-like `eyJ…`.`…`.`…` (three base64url
//!    segments, the third possibly empty).
//! 5. **Random blobs**: any other run of ≥ 40 token characters (split at `=` so `KEY=value`
//!    keeps its key; trailing `=` padding stays with the blob) that contains both letters and
//!    digits *and* changes character class (lowercase / uppercase / digit) between neighbours at
//!    least once per four characters. That cheap entropy test catches base64 and hex secrets
//!    (including 40-hex commit ids, which look exactly like legacy tokens) but keeps paths such
//!    as `/usr/local/lib/x86_64-linux-gnu/libssl.so.3`, dotted names and UUIDs (36 characters)
//!    visible.
//!
//! A trailing `.` is never part of a token-shaped match (it ends sentences). Overlapping or
//! adjacent matches collapse into one `[REDACTED]`. Redaction is repeated until nothing more
//! matches (bounded), so `redact(redact(x)) == redact(x)`.
//!
//! **`auth` versus `author`**: `auth` is only sensitive as a whole key segment (`auth`,
//! `x-auth`, `AUTH_HEADER`, `authKey`), never as a substring, so `author: Jane`,
//! `authority=...` and `authentication: failed` are left intact. `authorization` is matched as
//! a substring as usual.
//!
//! # Escape scheme
//!
//! [`single_line_capped`] escapes, after redaction, using Rust-like ASCII escapes:
//! `\` → `\\`, line feed → `\n`, carriage return → `\r`, tab → `\t`, and every other character
//! [`check_untrusted`] rejects (with newlines disallowed) → `\u{hex}` with lowercase hex and no
//! leading zeros (`\u{1b}`, `\u{202e}`, `\u{e0041}`). Because `\` itself is escaped, the
//! rendering is unambiguous. When the line is too long it is cut between two escape units and
//! ends with `…` (U+2026).
//!
//! Nothing here performs I/O.

use std::borrow::Cow;
use std::fmt;

use icu_properties::props::{BidiControl, DefaultIgnorableCodePoint, GeneralCategory};
use icu_properties::{
    CodePointMapData, CodePointMapDataBorrowed, CodePointSetData, CodePointSetDataBorrowed,
};

/// Hard cap on any rendered single line (refusal reasons, error lines), in bytes.
pub const MAX_LINE_BYTES: usize = 512;

/// Smallest cap [`single_line_capped`] accepts; smaller requests are raised to this.
const MIN_LINE_BYTES: usize = 16;

/// Replacement text for redacted material.
const REDACTED: &str = "[REDACTED]";

/// Marks a truncated line.
const ELLIPSIS: &str = "\u{2026}";

/// Upper bound on redaction rounds; each round after the first only runs when the previous one
/// changed the text, and in practice the second round finds nothing.
const MAX_REDACTION_ROUNDS: usize = 8;

const BIDI_CONTROL: CodePointSetDataBorrowed<'static> = CodePointSetData::new::<BidiControl>();
const DEFAULT_IGNORABLE: CodePointSetDataBorrowed<'static> =
    CodePointSetData::new::<DefaultIgnorableCodePoint>();
const GENERAL_CATEGORY: CodePointMapDataBorrowed<'static, GeneralCategory> =
    CodePointMapData::<GeneralCategory>::new();

/// Why a character is unsafe to show or to accept in an identifier or display string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnsafeKind {
    /// `Bidi_Control`: reorders displayed text (RLO, RLI, LRM, ALM, ...).
    BidiControl,
    /// `Default_Ignorable_Code_Point`: normally rendered as nothing (ZWSP, ZWJ, BOM, soft hyphen,
    /// variation selectors, tag characters, Hangul fillers, ...).
    Invisible,
    /// General category `Control` (C0, DEL, C1 including NEL U+0085).
    Control,
    /// General category `Format` that is not already bidi or default-ignorable.
    Format,
    /// General category `Private_Use`: meaning depends on the font.
    PrivateUse,
    /// General category `Unassigned` (including noncharacters): meaning may change later.
    Unassigned,
    /// U+2028 LINE SEPARATOR or U+2029 PARAGRAPH SEPARATOR.
    LineSeparator,
}

impl UnsafeKind {
    fn describe(self) -> &'static str {
        match self {
            Self::BidiControl => "bidirectional control",
            Self::Invisible => "invisible character",
            Self::Control => "control character",
            Self::Format => "format character",
            Self::PrivateUse => "private-use character",
            Self::Unassigned => "unassigned code point",
            Self::LineSeparator => "line or paragraph separator",
        }
    }
}

/// The first unsafe character found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnsafeChar {
    /// Byte offset of the character in the checked string.
    pub offset: usize,
    /// The character's code point.
    pub code_point: u32,
    /// Why it is unsafe.
    pub kind: UnsafeKind,
}

impl fmt::Display for UnsafeChar {
    /// Names the kind, code point and byte offset, e.g. `bidirectional control U+202E at byte 4`;
    /// never prints the character itself.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} U+{:04X} at byte {}",
            self.kind.describe(),
            self.code_point,
            self.offset
        )
    }
}

impl std::error::Error for UnsafeChar {}

/// Classifies one character; `None` means it is safe to show.
fn classify(c: char, allow_newlines: bool) -> Option<UnsafeKind> {
    if (' '..='~').contains(&c) || (allow_newlines && (c == '\n' || c == '\t')) {
        return None;
    }
    if BIDI_CONTROL.contains(c) {
        return Some(UnsafeKind::BidiControl);
    }
    if DEFAULT_IGNORABLE.contains(c) {
        return Some(UnsafeKind::Invisible);
    }
    match GENERAL_CATEGORY.get(c) {
        GeneralCategory::Control => Some(UnsafeKind::Control),
        GeneralCategory::Format => Some(UnsafeKind::Format),
        GeneralCategory::PrivateUse => Some(UnsafeKind::PrivateUse),
        // A `char` is never a surrogate; kept so the mapping stays total.
        GeneralCategory::Unassigned | GeneralCategory::Surrogate => Some(UnsafeKind::Unassigned),
        GeneralCategory::LineSeparator | GeneralCategory::ParagraphSeparator => {
            Some(UnsafeKind::LineSeparator)
        }
        _ => None,
    }
}

/// Reject untrusted text containing any `Bidi_Control`, `Default_Ignorable_Code_Point`, or
/// character of general category Control, Format, Private_Use, Unassigned, Surrogate, or
/// Line/Paragraph separator.
///
/// Checks run in that order (bidi, then default-ignorable, then category), so U+202E reports
/// [`UnsafeKind::BidiControl`] and U+200B reports [`UnsafeKind::Invisible`]. When
/// `allow_newlines` is false, `'\n'`, `'\r'` and `'\t'` are [`UnsafeKind::Control`] errors; when
/// it is true, `'\n'` and `'\t'` are allowed (`'\r'` never is). The error carries the byte offset
/// of the first offending character.
pub fn check_untrusted(s: &str, allow_newlines: bool) -> Result<(), UnsafeChar> {
    for (offset, c) in s.char_indices() {
        if let Some(kind) = classify(c, allow_newlines) {
            return Err(UnsafeChar {
                offset,
                code_point: u32::from(c),
                kind,
            });
        }
    }
    Ok(())
}

/// Render any string as ONE terminal-safe line of at most `max` bytes (`max` is raised to 16 if
/// smaller).
///
/// The text is first [`redact`]ed; then `\` becomes `\\`, line feed, carriage return and tab
/// become `\n`, `\r`, `\t`, and every other character [`check_untrusted`] rejects becomes
/// `\u{hex}` (lowercase, no leading zeros), so all escapes are plain ASCII. If the result exceeds
/// `max` bytes it is cut between two characters/escapes (never inside an escape) and ends with
/// `…` (U+2026), the total staying within `max`.
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

/// `value` as JSON (indented when `pretty`) that is also terminal-safe: every character
/// [`check_untrusted`] rejects — bidirectional controls, C1 controls, DEL, invisible, format,
/// private-use and unassigned characters, line separators — is written as a `\uXXXX` escape
/// (a UTF-16 surrogate pair above U+FFFF), so the text parses back to exactly `value` while a
/// terminal shows only visible characters. `serde_json` itself escapes only `"`, `\` and
/// U+0000–U+001F.
///
/// Why escaping the serialized text is enough: outside string literals `serde_json` writes only
/// ASCII (punctuation, digits, the letters of literals, spaces and line feeds), so every
/// character at or above U+007F stands inside a string, where `\uXXXX` denotes that very
/// character; C0 controls inside strings are already escaped.
pub fn terminal_safe_json(value: &serde_json::Value, pretty: bool) -> String {
    // Serializing a `Value` cannot fail: its map keys are strings and its numbers finite.
    let raw = if pretty {
        serde_json::to_string_pretty(value)
    } else {
        serde_json::to_string(value)
    }
    .unwrap_or_default();
    json_terminal_safe(&raw)
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

/// Make serialized JSON safe to print on a terminal without changing its value: every
/// character [`check_untrusted`] rejects that serde_json writes raw (C1 controls such as
/// U+009B CSI and U+0085 NEL, bidi controls, invisible, format and private-use characters,
/// separators) becomes a JSON `\uXXXX` escape (a surrogate pair above U+FFFF). C0 controls
/// inside strings are already escaped by the serializer; line feeds, carriage returns and tabs
/// outside strings (pretty printing) are kept. Parsing the result gives the same value.
pub fn json_terminal_safe(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if matches!(c, '\n' | '\r' | '\t') || classify(c, false).is_none() {
            out.push(c);
            continue;
        }
        let mut units = [0u16; 2];
        for u in c.encode_utf16(&mut units) {
            out.push_str(&format!("\\u{u:04x}"));
        }
    }
    out
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

/// Redact credential-looking material (see the module documentation for the rules), replacing
/// each match with `[REDACTED]`. Returns the input unchanged (`Cow::Borrowed`) when nothing
/// matched. Idempotent: redacting the output again changes nothing.
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

// ---------------------------------------------------------------------------------------------
// Rule 1: key/value pairs.

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

fn key_value_ranges(b: &[u8], out: &mut Vec<(usize, usize)>) {
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

// ---------------------------------------------------------------------------------------------
// Rule 2: `Bearer <token>` / `Basic <token>` anywhere.

fn scheme_ranges(b: &[u8], out: &mut Vec<(usize, usize)>) {
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

// ---------------------------------------------------------------------------------------------
// Rule 3: URL userinfo.

fn is_authority_end(c: u8) -> bool {
    c.is_ascii_whitespace()
        || matches!(
            c,
            b'/' | b'?' | b'#' | b'\\' | b'"' | b'\'' | b'<' | b'>' | b'`'
        )
}

fn userinfo_ranges(b: &[u8], out: &mut Vec<(usize, usize)>) {
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

// ---------------------------------------------------------------------------------------------
// Rule 4: well-known token shapes.

fn token_shape_ranges(b: &[u8], out: &mut Vec<(usize, usize)>) {
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

// ---------------------------------------------------------------------------------------------
// Rule 5: long random-looking runs.

/// Token bytes except `=`, which only trails a blob as padding.
fn is_blob_byte(c: u8) -> bool {
    c != b'=' && is_token_byte(c)
}

/// Blob ranges outside the (sorted, merged) `taken` ranges; those act as run breaks.
fn random_blob_ranges(b: &[u8], taken: &[(usize, usize)]) -> Vec<(usize, usize)> {
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
    use super::*;
    use proptest::prelude::*;

    fn kind_of(s: &str) -> Option<UnsafeKind> {
        check_untrusted(s, false).err().map(|e| e.kind)
    }

    fn assert_kind(chars: &[char], kind: UnsafeKind) {
        for &c in chars {
            let s = format!("ab{c}cd");
            let err = check_untrusted(&s, true).expect_err("must be rejected");
            assert_eq!(err.kind, kind, "U+{:04X}", u32::from(c));
            assert_eq!(err.offset, 2);
            assert_eq!(err.code_point, u32::from(c));
        }
    }

    // ----- check_untrusted ---------------------------------------------------------------

    #[test]
    fn bidi_controls_are_reported_as_bidi_control() {
        assert_kind(
            &[
                '\u{202E}', '\u{2067}', '\u{200E}', '\u{061C}', '\u{202A}', '\u{2069}',
            ],
            UnsafeKind::BidiControl,
        );
    }

    #[test]
    fn default_ignorable_characters_are_reported_as_invisible() {
        assert_kind(
            &[
                '\u{200B}',
                '\u{200D}',
                '\u{FEFF}',
                '\u{00AD}',
                '\u{FE0F}',
                '\u{E0041}',
                '\u{3164}',
                '\u{2060}',
            ],
            UnsafeKind::Invisible,
        );
    }

    #[test]
    fn control_characters_are_reported_as_control() {
        assert_kind(
            &['\u{1B}', '\0', '\u{7F}', '\u{85}', '\r'],
            UnsafeKind::Control,
        );
    }

    #[test]
    fn private_use_is_reported() {
        assert_kind(
            &['\u{E000}', '\u{F8FF}', '\u{10FFFD}'],
            UnsafeKind::PrivateUse,
        );
    }

    #[test]
    fn unassigned_code_points_are_reported() {
        assert_kind(
            &['\u{0378}', '\u{FFFF}', '\u{FDD0}'],
            UnsafeKind::Unassigned,
        );
    }

    #[test]
    fn line_and_paragraph_separators_are_reported() {
        assert_kind(&['\u{2028}', '\u{2029}'], UnsafeKind::LineSeparator);
    }

    #[test]
    fn format_characters_that_are_visible_elsewhere_are_reported_as_format() {
        // U+0600 ARABIC NUMBER SIGN is Cf but neither bidi control nor default-ignorable.
        assert_kind(&['\u{0600}', '\u{FFF9}'], UnsafeKind::Format);
    }

    #[test]
    fn ordinary_text_passes() {
        for s in [
            "",
            "plain ASCII with punctuation !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
            "Crème brûlée à la française, Ærøskøbing, Łódź",
            "中文字符 日本語 한국어",
            "emoji \u{1F600} \u{1F383}",
            "Ελληνικά и кириллица",
        ] {
            assert_eq!(check_untrusted(s, false), Ok(()), "{s}");
        }
    }

    #[test]
    fn newline_and_tab_are_allowed_only_when_requested() {
        assert_eq!(check_untrusted("a\nb\tc", true), Ok(()));
        let err = check_untrusted("a\nb", false).expect_err("newline rejected");
        assert_eq!(
            (err.kind, err.offset, err.code_point),
            (UnsafeKind::Control, 1, 0x0A)
        );
        let err = check_untrusted("ab\tc", false).expect_err("tab rejected");
        assert_eq!((err.kind, err.offset), (UnsafeKind::Control, 2));
    }

    #[test]
    fn carriage_return_is_rejected_even_when_newlines_are_allowed() {
        let err = check_untrusted("line\r\n", true).expect_err("CR rejected");
        assert_eq!((err.kind, err.offset), (UnsafeKind::Control, 4));
    }

    #[test]
    fn offsets_are_byte_offsets_of_the_first_unsafe_char() {
        let err = check_untrusted("é中\u{202E}\u{200B}", false).expect_err("rejected");
        assert_eq!(err.offset, 5);
        assert_eq!(err.kind, UnsafeKind::BidiControl);
    }

    #[test]
    fn display_names_the_code_point_without_printing_it() {
        let err = check_untrusted("abcd\u{202E}x", false).expect_err("rejected");
        let shown = err.to_string();
        assert_eq!(shown, "bidirectional control U+202E at byte 4");
        assert!(!shown.contains('\u{202E}'));
        let err = check_untrusted("\u{E0041}", false).expect_err("rejected");
        assert_eq!(err.to_string(), "invisible character U+E0041 at byte 0");
        let boxed: Box<dyn std::error::Error> = Box::new(err);
        assert!(boxed.to_string().starts_with("invisible"));
    }

    #[test]
    fn zwj_emoji_sequences_are_rejected_but_single_emoji_pass() {
        assert_eq!(
            kind_of("\u{1F468}\u{200D}\u{1F4BB}"),
            Some(UnsafeKind::Invisible)
        );
        assert_eq!(kind_of("\u{1F468}\u{1F4BB}"), None);
    }

    // ----- redact: positives -------------------------------------------------------------

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

    // ----- redact: negatives -------------------------------------------------------------

    #[test]
    fn nothing_matched_returns_the_input_borrowed() {
        let s = "all fine: nothing to see here";
        assert!(matches!(redact(s), Cow::Borrowed(b) if b == s));
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

    // ----- single_line -------------------------------------------------------------------

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
    fn json_is_made_terminal_safe_without_changing_its_value() {
        let hostile = "\u{1b}[2J\r\u{9b}31m\u{85}\u{202e}\u{2066}\u{200b}\u{e000}\u{e0041}é日本";
        let v = serde_json::json!({"k": hostile, "list": [hostile]});
        let pretty = serde_json::to_string_pretty(&v).unwrap();
        assert!(
            pretty.contains('\u{9b}') && pretty.contains('\u{202e}'),
            "serde writes these raw"
        );
        let safe = json_terminal_safe(&pretty);
        for c in safe.chars() {
            assert!(
                c == '\n' || classify(c, false).is_none(),
                "U+{:04X} left raw",
                u32::from(c)
            );
        }
        assert!(
            safe.contains("\\u009b") && safe.contains("\\udb40\\udc41"),
            "{safe}"
        );
        assert!(safe.contains("é日本"), "ordinary text is kept: {safe}");
        let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
        assert_eq!(back, v);
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
        crate::test_report::record(
            "P14",
            "policy/src/text.rs::a_cut_is_reported_by_what_was_cut_not_by_comparing_lengths",
            serde_json::json!({"cap": 4096, "hidden_bytes": hidden.len()}),
        );
    }

    #[test]
    fn json_output_escapes_bidi_c1_and_del() {
        let v = serde_json::json!({
            "name": "a\u{202e}b",
            "description": "c1 \u{85}\u{9f} del \u{7f} zwsp \u{200b} tag \u{e0041} ok é ✓",
            "\u{202e}key": ["\u{2028}", 1, true, null],
        });
        for pretty in [false, true] {
            let out = terminal_safe_json(&v, pretty);
            assert_eq!(check_untrusted(&out, true), Ok(()), "{out}");
            for esc in [
                "\\u202e",
                "\\u0085",
                "\\u009f",
                "\\u007f",
                "\\u200b",
                "\\udb40\\udc41",
                "\\u2028",
            ] {
                assert!(out.contains(esc), "{esc} missing from {out}");
            }
            // Visible characters stay as they are; the text is the same JSON value.
            assert!(out.contains("ok é ✓"));
            assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), v);
        }
        // serde_json alone leaves them raw (what this writer is for).
        assert!(serde_json::to_string(&v).unwrap().contains('\u{202e}'));
        crate::test_report::record(
            "P8",
            "policy/src/text.rs::json_output_escapes_bidi_c1_and_del",
            serde_json::json!({"escaped": ["U+202E", "U+0085", "U+009F", "U+007F", "U+200B", "U+E0041", "U+2028"]}),
        );
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

    // ----- properties --------------------------------------------------------------------

    const NASTY: &[char] = &[
        '\u{202E}',
        '\u{2067}',
        '\u{200E}',
        '\u{061C}',
        '\u{200B}',
        '\u{200D}',
        '\u{FEFF}',
        '\u{00AD}',
        '\u{FE0F}',
        '\u{E0041}',
        '\u{3164}',
        '\u{2060}',
        '\u{1B}',
        '\0',
        '\u{7F}',
        '\u{85}',
        '\u{E000}',
        '\u{0378}',
        '\u{2028}',
        '\u{2029}',
        '\u{0600}',
        '\n',
        '\r',
        '\t',
        '\\',
        '"',
        '\'',
        '=',
        ':',
        '@',
        '/',
        ' ',
        'a',
        'Z',
        '7',
        '…',
        'é',
        '中',
        '\u{1F600}',
        '\u{0301}',
        '\u{10FFFF}',
    ];

    const FRAGMENTS: &[&str] = &[
        "token=",
        "password: ",
        "Authorization: ",
        "Cookie: ",
        "Bearer ",
        "basic ",
        "://",
        "user:pw@",
        "@",
        "[REDACTED]",
        "ghp_",
        "sk-",
        "AKIA",
        "eyJ",
        "0123456789abcdef",
        "ABCDEFGHIJKLMNOP",
        "aB3",
        "xY9z",
        ".",
        "/",
        "=",
        "==",
        ":",
        " ",
        "\"",
        "'",
        "\\\"",
        "\\",
        "&",
        ";",
        ",",
        "\n",
        "{",
        "auth",
        "tokens",
        "author",
        "é",
        "\u{202E}",
        "-",
        "_",
        "https://",
        "?",
        "#",
    ];

    fn nasty_string() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(NASTY), 0..300)
            .prop_map(|cs| cs.into_iter().collect())
    }

    fn secretish_string() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(FRAGMENTS), 0..40).prop_map(|fs| fs.concat())
    }

    fn any_text() -> impl Strategy<Value = String> {
        prop_oneof![any::<String>(), nasty_string(), secretish_string()]
    }

    fn check_rendered(s: &str, max: usize) -> Result<(), TestCaseError> {
        let out = single_line_capped(s, max);
        prop_assert!(out.len() <= max.max(16), "{} > {}", out.len(), max);
        prop_assert!(!out.contains('\n') && !out.contains('\r'));
        prop_assert_eq!(check_untrusted(&out, false), Ok(()));
        Ok(())
    }

    fn any_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any_text().prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::from),
                prop::collection::vec((any_text(), inner), 0..8)
                    .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
            ]
        })
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
        fn json_output_is_terminal_safe_and_the_same_value(v in any_json(), pretty in any::<bool>()) {
            let out = terminal_safe_json(&v, pretty);
            prop_assert_eq!(check_untrusted(&out, true), Ok(()));
            prop_assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), v);
        }
    }

    proptest! {
        #[test]
        fn rendered_lines_are_bounded_single_and_safe(s in any_text(), max in 0usize..700) {
            check_rendered(&s, max)?;
        }

        #[test]
        fn default_rendering_is_bounded_single_and_safe(s in any_text()) {
            check_rendered(&s, MAX_LINE_BYTES)?;
        }

        #[test]
        fn check_untrusted_never_panics_and_reports_a_real_char(s in any_text(), nl in any::<bool>()) {
            if let Err(e) = check_untrusted(&s, nl) {
                let c = s[e.offset..].chars().next();
                prop_assert_eq!(c.map(u32::from), Some(e.code_point));
                prop_assert!(!e.to_string().is_empty());
            }
        }

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
