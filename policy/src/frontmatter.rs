//! The frontmatter of `SKILL.md` and agent-definition files: a strict, small subset of YAML.
//!
//! ```text
//! ---
//! name: reviewer
//! description: "Reviews one bounded source area."
//! tools: [read_file, grep, git_diff]
//! maxTurns: 8
//! ---
//! body…
//! ```
//!
//! The file must start with a `---` line and the frontmatter ends at the next `---` line. Each
//! line between is `key: value`, a `#` comment or blank. A value is a plain scalar, a single- or
//! double-quoted scalar, or a flow list `[a, "b", 'c']` of scalars. Nothing else of YAML exists
//! here (no block lists, nested maps, anchors, tags or multi-line scalars): anything else is an
//! error with its line number. A duplicate key is an error. Errors never quote the file's text:
//! it is untrusted and may be hostile.

use std::fmt;

/// Most bytes of frontmatter (between the `---` lines).
pub const MAX_FRONTMATTER: usize = 8 * 1024;
/// Most keys.
pub const MAX_KEYS: usize = 32;
/// Most items in one list.
pub const MAX_LIST: usize = 64;

/// A value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// A scalar; `quoted` says whether it was written in quotes (then it is always a string).
    Scalar {
        /// The text (unescaped).
        text: String,
        /// Written in quotes.
        quoted: bool,
    },
    /// A flow list of scalars.
    List(Vec<String>),
}

/// One `key: value` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The key.
    pub key: String,
    /// The value.
    pub value: Value,
    /// Its 1-based line number in the file.
    pub line: usize,
}

/// A parsed document: the entries in file order, and the body after the closing `---`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// The entries.
    pub entries: Vec<Entry>,
    /// The body.
    pub body: String,
    /// The 1-based line where the body starts.
    pub body_line: usize,
}

/// What is wrong, and on which line (never the text itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// 1-based line (0: the whole file).
    pub line: usize,
    /// What.
    pub kind: ErrorKind,
}

/// The kinds of error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    /// The file does not start with a `---` line.
    NoOpening,
    /// No closing `---` line.
    NoClosing,
    /// The frontmatter is over [`MAX_FRONTMATTER`] bytes.
    TooLarge,
    /// Over [`MAX_KEYS`] keys or [`MAX_LIST`] list items.
    TooMany,
    /// Not `key: value`.
    NotKeyValue,
    /// A key outside `[A-Za-z][A-Za-z0-9_-]*` (at most 64 bytes).
    BadKey,
    /// The same key twice.
    DuplicateKey,
    /// `key:` with nothing after it (block values are not supported).
    NoValue,
    /// A quoted scalar without its closing quote, or text after it.
    BadQuote,
    /// A list without `]`, with an empty item, or a nested structure.
    BadList,
    /// A plain scalar starting with a YAML indicator (`{`, `&`, `*`, `!`, `|`, `>`, `%`, `@`,
    /// `` ` ``) or containing ` #` or `: `.
    UnsupportedSyntax,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match &self.kind {
            ErrorKind::NoOpening => "the file must start with a --- line",
            ErrorKind::NoClosing => "the frontmatter has no closing --- line",
            ErrorKind::TooLarge => "the frontmatter is over 8 KiB",
            ErrorKind::TooMany => "too many keys or list items",
            ErrorKind::NotKeyValue => "expected key: value",
            ErrorKind::BadKey => "a key may only use ASCII letters, digits, _ and -",
            ErrorKind::DuplicateKey => "duplicate key",
            ErrorKind::NoValue => "the key has no value (block values are not supported)",
            ErrorKind::BadQuote => "unterminated or malformed quoted value",
            ErrorKind::BadList => "malformed list (use [a, b, c] with scalar items)",
            ErrorKind::UnsupportedSyntax => "YAML syntax beyond key: value is not supported",
        };
        if self.line == 0 {
            f.write_str(what)
        } else {
            write!(f, "line {}: {what}", self.line)
        }
    }
}

impl std::error::Error for Error {}

fn err(line: usize, kind: ErrorKind) -> Error {
    Error { line, kind }
}

fn parse_quoted(s: &str, line: usize) -> Result<(String, &str), Error> {
    let mut chars = s.char_indices();
    let Some((_, q)) = chars.next() else {
        return Err(err(line, ErrorKind::BadQuote));
    };
    let mut out = String::new();
    let mut escaped = false;
    while let Some((i, c)) = chars.next() {
        if q == '"' {
            if escaped {
                match c {
                    '"' | '\\' => out.push(c),
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    _ => return Err(err(line, ErrorKind::BadQuote)),
                }
                escaped = false;
                continue;
            }
            if c == '\\' {
                escaped = true;
                continue;
            }
            if c == '"' {
                return Ok((out, &s[i + 1..]));
            }
        } else if c == '\'' {
            // '' is an escaped single quote.
            if s[i + 1..].starts_with('\'') {
                out.push('\'');
                chars.next();
                continue;
            }
            return Ok((out, &s[i + 1..]));
        }
        out.push(c);
    }
    Err(err(line, ErrorKind::BadQuote))
}

fn plain_ok(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with([
            '{', '}', '&', '*', '!', '|', '>', '%', '@', '`', ']', ',', '?',
        ])
        && s != "-"
        && !s.starts_with("- ")
        && !s.contains(" #")
        && !s.contains(": ")
        && !s.ends_with(':')
}

fn parse_scalar(s: &str, line: usize) -> Result<Value, Error> {
    if s.starts_with('"') || s.starts_with('\'') {
        let (text, rest) = parse_quoted(s, line)?;
        if !rest.trim().is_empty() {
            return Err(err(line, ErrorKind::BadQuote));
        }
        return Ok(Value::Scalar { text, quoted: true });
    }
    // A lone "-" or "- x" would be a block list item.
    if s == "-" || s.starts_with("- ") || !plain_ok(s) {
        return Err(err(line, ErrorKind::UnsupportedSyntax));
    }
    Ok(Value::Scalar {
        text: s.to_owned(),
        quoted: false,
    })
}

fn parse_list(s: &str, line: usize) -> Result<Value, Error> {
    let inner = s
        .strip_prefix('[')
        .and_then(|r| r.trim_end().strip_suffix(']'))
        .ok_or_else(|| err(line, ErrorKind::BadList))?;
    let mut items = Vec::new();
    let mut rest = inner.trim();
    if rest.is_empty() {
        return Ok(Value::List(items));
    }
    loop {
        if items.len() >= MAX_LIST {
            return Err(err(line, ErrorKind::TooMany));
        }
        let (item, after) = if rest.starts_with('"') || rest.starts_with('\'') {
            parse_quoted(rest, line)?
        } else {
            let end = rest.find(',').unwrap_or(rest.len());
            let item = rest[..end].trim();
            if item.is_empty()
                || item.starts_with(['[', '{'])
                || item.contains([']', '[', '{', '}'])
                || !plain_ok(item)
            {
                return Err(err(line, ErrorKind::BadList));
            }
            (item.to_owned(), &rest[end..])
        };
        items.push(item);
        let after = after.trim_start();
        if after.is_empty() {
            return Ok(Value::List(items));
        }
        rest = after
            .strip_prefix(',')
            .ok_or_else(|| err(line, ErrorKind::BadList))?
            .trim_start();
        if rest.is_empty() {
            return Err(err(line, ErrorKind::BadList));
        }
    }
}

fn key_ok(k: &str) -> bool {
    let b = k.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_alphabetic()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || *c == b'_' || *c == b'-')
}

/// Why untrusted bytes could not even be parsed as a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// Over the caller's size bound.
    TooLarge,
    /// Not UTF-8.
    NotUtf8,
    /// A bidi, invisible or other unsafe character anywhere in the file.
    UnsafeText(crate::text::UnsafeChar),
    /// Malformed frontmatter.
    Frontmatter(Error),
}

/// Decode a whole untrusted file of at most `max` bytes: UTF-8, CRLF normalised to LF, no
/// character [`crate::text::check_untrusted`] refuses anywhere (line feeds and tabs allowed),
/// then [`parse`].
pub fn decode(bytes: &[u8], max: usize) -> Result<Document, DecodeError> {
    if bytes.len() > max {
        return Err(DecodeError::TooLarge);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| DecodeError::NotUtf8)?;
    // `\r` is refused by the text check; normalise CRLF files first.
    let normalised;
    let text = if text.contains("\r\n") {
        normalised = text.replace("\r\n", "\n");
        normalised.as_str()
    } else {
        text
    };
    crate::text::check_untrusted(text, true).map_err(DecodeError::UnsafeText)?;
    parse(text).map_err(DecodeError::Frontmatter)
}

/// Parse a document. Lines may end in `\n` or `\r\n`.
pub fn parse(text: &str) -> Result<Document, Error> {
    let mut lines = text.split_inclusive('\n');
    let first = lines.next().unwrap_or("");
    if first.trim_end_matches(['\n', '\r']) != "---" {
        return Err(err(1, ErrorKind::NoOpening));
    }
    let mut consumed = first.len();
    let mut entries: Vec<Entry> = Vec::new();
    let mut line_no = 1;
    for raw in lines {
        line_no += 1;
        consumed += raw.len();
        let line = raw.trim_end_matches('\n').trim_end_matches('\r');
        if line == "---" {
            return Ok(Document {
                entries,
                body: text[consumed..].to_owned(),
                body_line: line_no + 1,
            });
        }
        if consumed - first.len() > MAX_FRONTMATTER {
            return Err(err(0, ErrorKind::TooLarge));
        }
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if line.starts_with([' ', '\t']) {
            // Indentation means a nested or block structure.
            return Err(err(line_no, ErrorKind::UnsupportedSyntax));
        }
        let Some((key, value)) = line.split_once(':') else {
            return Err(err(line_no, ErrorKind::NotKeyValue));
        };
        if !key_ok(key) {
            return Err(err(line_no, ErrorKind::BadKey));
        }
        if entries.iter().any(|e| e.key == key) {
            return Err(err(line_no, ErrorKind::DuplicateKey));
        }
        if entries.len() >= MAX_KEYS {
            return Err(err(line_no, ErrorKind::TooMany));
        }
        if !value.is_empty() && !value.starts_with([' ', '\t']) {
            return Err(err(line_no, ErrorKind::NotKeyValue));
        }
        let value = value.trim();
        if value.is_empty() {
            return Err(err(line_no, ErrorKind::NoValue));
        }
        let value = if value.starts_with('[') {
            parse_list(value, line_no)?
        } else {
            parse_scalar(value, line_no)?
        };
        entries.push(Entry {
            key: key.to_owned(),
            value,
            line: line_no,
        });
    }
    Err(err(0, ErrorKind::NoClosing))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scalar(s: &str) -> Value {
        Value::Scalar {
            text: s.into(),
            quoted: false,
        }
    }

    #[test]
    fn the_product_page_example_parses() {
        let doc = parse(
            "---\nname: reviewer\ndescription: Reviews one bounded source area.\ntools: [read_file, grep, git_diff]\nmodel: inherit\nmaxTurns: 8\nmaxTokens: 12000\nmaxWallSecs: 90\nmaxConsecutiveToolErrors: 2\n---\nReview the assigned area.\n",
        )
        .unwrap();
        assert_eq!(doc.entries.len(), 8);
        assert_eq!(doc.entries[0].value, scalar("reviewer"));
        assert_eq!(
            doc.entries[2].value,
            Value::List(vec!["read_file".into(), "grep".into(), "git_diff".into()])
        );
        assert_eq!(doc.body, "Review the assigned area.\n");
        assert_eq!(doc.body_line, 11);
    }

    #[test]
    fn quoting_and_lists() {
        let doc = parse(
            "---\na: \"x: \\\"y\\\" # z\"\nb: 'it''s'\nc: [\"a, b\", 'c', d]\nd: []\n# comment\n\ne: 1.5\n---\n",
        )
        .unwrap();
        assert_eq!(
            doc.entries[0].value,
            Value::Scalar {
                text: "x: \"y\" # z".into(),
                quoted: true
            }
        );
        assert_eq!(
            doc.entries[1].value,
            Value::Scalar {
                text: "it's".into(),
                quoted: true
            }
        );
        assert_eq!(
            doc.entries[2].value,
            Value::List(vec!["a, b".into(), "c".into(), "d".into()])
        );
        assert_eq!(doc.entries[3].value, Value::List(vec![]));
        assert_eq!(doc.entries[4].value, scalar("1.5"));
        assert_eq!(doc.body, "");
    }

    #[test]
    fn everything_else_is_an_error_with_its_line() {
        let cases: &[(&str, usize, ErrorKind)] = &[
            ("name: x\n---\n", 1, ErrorKind::NoOpening),
            ("---\nname: x\n", 0, ErrorKind::NoClosing),
            ("---\nname: x\nname: y\n---\n", 3, ErrorKind::DuplicateKey),
            ("---\nname\n---\n", 2, ErrorKind::NotKeyValue),
            ("---\n9name: x\n---\n", 2, ErrorKind::BadKey),
            ("---\ntools:\n  - a\n---\n", 2, ErrorKind::NoValue),
            ("---\n  name: x\n---\n", 2, ErrorKind::UnsupportedSyntax),
            ("---\na: \"x\n---\n", 2, ErrorKind::BadQuote),
            ("---\na: \"x\" y\n---\n", 2, ErrorKind::BadQuote),
            ("---\na: [x, [y]]\n---\n", 2, ErrorKind::BadList),
            ("---\na: [x,]\n---\n", 2, ErrorKind::BadList),
            ("---\na: [x\n---\n", 2, ErrorKind::BadList),
            ("---\na: &anchor x\n---\n", 2, ErrorKind::UnsupportedSyntax),
            ("---\na: |\n---\n", 2, ErrorKind::UnsupportedSyntax),
            ("---\na: {b: c}\n---\n", 2, ErrorKind::UnsupportedSyntax),
            (
                "---\na: x # comment\n---\n",
                2,
                ErrorKind::UnsupportedSyntax,
            ),
            ("---\na:b\n---\n", 2, ErrorKind::NotKeyValue),
            ("---\na: - x\n---\n", 2, ErrorKind::UnsupportedSyntax),
        ];
        for (text, line, kind) in cases {
            let e = parse(text).unwrap_err();
            assert_eq!((e.line, &e.kind), (*line, kind), "{text:?}");
        }
        let big = format!("---\na: {}\n---\n", "x".repeat(MAX_FRONTMATTER));
        assert_eq!(parse(&big).unwrap_err().kind, ErrorKind::TooLarge);
        let fits = format!("---\na: {}\n---\n", "x".repeat(MAX_FRONTMATTER - 10));
        assert!(parse(&fits).is_ok());
        iteron_test_support::record!("P5", serde_json::json!({}),);
    }

    #[test]
    fn errors_never_quote_the_text() {
        for text in [
            "---\nSECRET_KEY\n---\n",
            "---\nk: \"SECRET\n---\n",
            "---\nk: [SECRET\n---\n",
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(!e.contains("SECRET"), "{e}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        #[test]
        fn arbitrary_text_never_panics(s in "\\PC{0,300}") {
            let _ = parse(&s);
            let _ = parse(&format!("---\n{s}"));
            let _ = parse(&format!("---\n{s}\n---\nbody"));
        }

        #[test]
        fn generated_documents_round_trip(
            entries in prop::collection::btree_map("[a-z][a-zA-Z0-9_]{0,10}", "[a-zA-Z0-9][a-zA-Z0-9 ._/]{0,20}[a-zA-Z0-9]", 0..10),
            body in "\\PC{0,100}",
        ) {
            let mut text = String::from("---\n");
            for (k, v) in &entries {
                text.push_str(&format!("{k}: {v}\n"));
            }
            text.push_str("---\n");
            text.push_str(&body);
            let doc = parse(&text).unwrap();
            prop_assert_eq!(doc.entries.len(), entries.len());
            for (e, (k, v)) in doc.entries.iter().zip(&entries) {
                prop_assert_eq!(&e.key, k);
                prop_assert_eq!(&e.value, &scalar(v));
            }
            prop_assert_eq!(doc.body, body);
        }
    }
}
