//! Proptest inputs shared by the text tests: arbitrary, hostile and secret-shaped strings.

use proptest::prelude::*;

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

/// Any string: arbitrary Unicode, hostile characters, or concatenated secret-shaped fragments.
pub(crate) fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![any::<String>(), nasty_string(), secretish_string()]
}
