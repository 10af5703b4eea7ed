//! A strict JSON reader that keeps positions.
//!
//! `serde_json` accepts duplicate object keys (the last one silently wins) and reports no
//! position for a value once it has been parsed, so a configuration error could neither be
//! detected nor located. This reader is deliberately small: it parses RFC 8259 JSON into a tree
//! where every value and key carries its 1-based line and column, and it refuses
//!
//! - duplicate keys in one object (reported at the second occurrence, naming the first);
//! - nesting deeper than [`MAX_DEPTH`];
//! - input that is not UTF-8, a byte-order mark, raw control characters inside strings, lone
//!   surrogate escapes, and anything after the top-level value.
//!
//! Error texts never quote the document: they name the JSON path (with untrusted key names
//! escaped to printable ASCII) and the position, so a value that happens to be a secret cannot
//! leak through an error message.

use std::collections::HashMap;
use std::fmt;

/// Deepest nesting of arrays and objects accepted.
pub const MAX_DEPTH: usize = 64;

/// A 1-based position in the document. Columns count characters, not bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pos {
    /// Line, starting at 1.
    pub line: u32,
    /// Column in characters, starting at 1.
    pub column: u32,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}, column {}", self.line, self.column)
    }
}

/// A value with the position of its first character.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// Where the value starts.
    pub pos: Pos,
    /// The value.
    pub value: Value,
}

/// An object member: the key (with its position) and the value.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    /// The decoded key.
    pub key: String,
    /// Where the key's opening quote is.
    pub key_pos: Pos,
    /// The value.
    pub node: Node,
}

/// A JSON value. Objects keep their members in document order; keys are unique.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `null`
    Null,
    /// `true` or `false`
    Bool(bool),
    /// A number, kept as its source text so no precision is lost before the caller decides.
    Number(String),
    /// A string, decoded.
    String(String),
    /// An array.
    Array(Vec<Node>),
    /// An object with unique keys.
    Object(Vec<Member>),
}

impl Value {
    /// The JSON type name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "boolean",
            Value::Number(_) => "number",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::Object(_) => "object",
        }
    }
}

/// One step of a JSON path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// An object member.
    Key(String),
    /// An array element.
    Index(usize),
}

/// A JSON path such as `$.mcp_servers[0].env[2]`, built while walking a document.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Path(Vec<Segment>);

impl Path {
    /// The document root, `$`.
    pub fn root() -> Self {
        Path(Vec::new())
    }

    /// This path extended by an object key.
    pub fn key(&self, key: &str) -> Self {
        let mut segs = self.0.clone();
        segs.push(Segment::Key(key.to_owned()));
        Path(segs)
    }

    /// This path extended by an array index.
    pub fn index(&self, index: usize) -> Self {
        let mut segs = self.0.clone();
        segs.push(Segment::Index(index));
        Path(segs)
    }
}

impl fmt::Display for Path {
    /// Keys made of ASCII letters, digits, `_` and `-` print as `.key`; any other key prints as
    /// `["…"]` with every character outside printable ASCII escaped as `\u{…}`, so an untrusted
    /// key can never carry a control or bidirectional character to a terminal.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("$")?;
        for seg in &self.0 {
            match seg {
                Segment::Index(i) => write!(f, "[{i}]")?,
                Segment::Key(k) => {
                    let plain = !k.is_empty()
                        && k.len() <= 64
                        && k.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if plain {
                        write!(f, ".{k}")?;
                    } else {
                        f.write_str("[\"")?;
                        write_escaped_key(f, k)?;
                        f.write_str("\"]")?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Longest key text shown inside a path, in characters; longer keys are cut with `…`.
const MAX_KEY_DISPLAY_CHARS: usize = 48;

fn write_escaped_key(f: &mut fmt::Formatter<'_>, key: &str) -> fmt::Result {
    for (n, c) in key.chars().enumerate() {
        if n == MAX_KEY_DISPLAY_CHARS {
            return f.write_str("...");
        }
        match c {
            '"' => f.write_str("\\\"")?,
            '\\' => f.write_str("\\\\")?,
            ' '..='~' => write!(f, "{c}")?,
            other => write!(f, "\\u{{{:x}}}", u32::from(other))?,
        }
    }
    Ok(())
}

/// What was wrong with the document's syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyntaxError {
    /// The input is not valid UTF-8.
    NotUtf8,
    /// The input starts with a byte-order mark.
    ByteOrderMark,
    /// The input ended inside a value.
    UnexpectedEnd,
    /// A character that cannot start or continue a value here. Only printable ASCII is named.
    UnexpectedChar(Option<char>),
    /// A raw control character inside a string.
    ControlInString,
    /// A backslash escape that JSON does not define.
    InvalidEscape,
    /// A `\u` escape that is not four hex digits, or a lone surrogate.
    InvalidUnicodeEscape,
    /// A number that does not follow the JSON grammar.
    InvalidNumber,
    /// Nesting deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A key that already appeared in the same object.
    DuplicateKey {
        /// Where the first occurrence is.
        first: Pos,
    },
    /// Characters after the top-level value.
    TrailingCharacters,
}

impl fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyntaxError::NotUtf8 => f.write_str("the file is not valid UTF-8"),
            SyntaxError::ByteOrderMark => f.write_str("the file starts with a byte-order mark"),
            SyntaxError::UnexpectedEnd => f.write_str("unexpected end of input"),
            SyntaxError::UnexpectedChar(Some(c)) => write!(f, "unexpected character '{c}'"),
            SyntaxError::UnexpectedChar(None) => f.write_str("unexpected character"),
            SyntaxError::ControlInString => {
                f.write_str("raw control character in a string (escape it)")
            }
            SyntaxError::InvalidEscape => f.write_str("invalid escape sequence in a string"),
            SyntaxError::InvalidUnicodeEscape => {
                f.write_str("invalid \\u escape (four hex digits, surrogates paired)")
            }
            SyntaxError::InvalidNumber => f.write_str("invalid number"),
            SyntaxError::TooDeep => write!(f, "nesting deeper than {MAX_DEPTH} levels"),
            SyntaxError::DuplicateKey { first } => {
                write!(f, "duplicate key (first defined at {first})")
            }
            SyntaxError::TrailingCharacters => f.write_str("characters after the JSON value"),
        }
    }
}

/// A syntax error with its place in the document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError {
    /// The path of the value being read when the error was found.
    pub path: Path,
    /// Where the error was found.
    pub pos: Pos,
    /// What was wrong.
    pub kind: SyntaxError,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.path, self.pos, self.kind)
    }
}

impl std::error::Error for JsonError {}

/// Parse a whole document. The caller bounds the input size before calling.
pub fn parse(input: &[u8]) -> Result<Node, JsonError> {
    let text = match std::str::from_utf8(input) {
        Ok(t) => t,
        Err(e) => {
            let good = &input[..e.valid_up_to()];
            // The prefix is valid UTF-8 by construction, so this never falls back.
            let prefix = std::str::from_utf8(good).unwrap_or("");
            let mut r = Reader::new(prefix);
            r.skip_to_end();
            return Err(r.error_here(SyntaxError::NotUtf8));
        }
    };
    let mut r = Reader::new(text);
    if text.starts_with('\u{feff}') {
        return Err(r.error_here(SyntaxError::ByteOrderMark));
    }
    r.skip_ws();
    let node = r.value(0)?;
    r.skip_ws();
    if r.peek().is_some() {
        return Err(r.error_here(SyntaxError::TrailingCharacters));
    }
    Ok(node)
}

struct Reader<'a> {
    text: &'a str,
    at: usize,
    line: u32,
    column: u32,
    path: Vec<Segment>,
}

impl<'a> Reader<'a> {
    fn new(text: &'a str) -> Self {
        Reader {
            text,
            at: 0,
            line: 1,
            column: 1,
            path: Vec::new(),
        }
    }

    fn pos(&self) -> Pos {
        Pos {
            line: self.line,
            column: self.column,
        }
    }

    fn error_here(&self, kind: SyntaxError) -> JsonError {
        self.error_at(self.pos(), kind)
    }

    fn error_at(&self, pos: Pos, kind: SyntaxError) -> JsonError {
        JsonError {
            path: Path(self.path.clone()),
            pos,
            kind,
        }
    }

    fn peek(&self) -> Option<char> {
        self.text[self.at..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.at += c.len_utf8();
        if c == '\n' {
            self.line = self.line.saturating_add(1);
            self.column = 1;
        } else {
            self.column = self.column.saturating_add(1);
        }
        Some(c)
    }

    fn skip_to_end(&mut self) {
        while self.bump().is_some() {}
    }

    fn skip_ws(&mut self) {
        while let Some(' ' | '\t' | '\n' | '\r') = self.peek() {
            self.bump();
        }
    }

    fn unexpected(&self) -> JsonError {
        match self.peek() {
            None => self.error_here(SyntaxError::UnexpectedEnd),
            Some(c) if c.is_ascii_graphic() => {
                self.error_here(SyntaxError::UnexpectedChar(Some(c)))
            }
            Some(_) => self.error_here(SyntaxError::UnexpectedChar(None)),
        }
    }

    fn expect(&mut self, want: char) -> Result<(), JsonError> {
        if self.peek() == Some(want) {
            self.bump();
            Ok(())
        } else {
            Err(self.unexpected())
        }
    }

    fn value(&mut self, depth: usize) -> Result<Node, JsonError> {
        let pos = self.pos();
        let value = match self.peek() {
            Some('{') => self.object(depth)?,
            Some('[') => self.array(depth)?,
            Some('"') => Value::String(self.string()?),
            Some('t') => self.literal("true", Value::Bool(true))?,
            Some('f') => self.literal("false", Value::Bool(false))?,
            Some('n') => self.literal("null", Value::Null)?,
            Some('-' | '0'..='9') => Value::Number(self.number()?),
            _ => return Err(self.unexpected()),
        };
        Ok(Node { pos, value })
    }

    fn literal(&mut self, word: &str, value: Value) -> Result<Value, JsonError> {
        for want in word.chars() {
            if self.peek() != Some(want) {
                return Err(self.unexpected());
            }
            self.bump();
        }
        Ok(value)
    }

    fn enter(&self, depth: usize) -> Result<usize, JsonError> {
        if depth >= MAX_DEPTH {
            Err(self.error_here(SyntaxError::TooDeep))
        } else {
            Ok(depth + 1)
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, JsonError> {
        let depth = self.enter(depth)?;
        self.expect('[')?;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(']') {
            self.bump();
            return Ok(Value::Array(items));
        }
        loop {
            self.skip_ws();
            self.path.push(Segment::Index(items.len()));
            let node = self.value(depth)?;
            self.path.pop();
            items.push(node);
            self.skip_ws();
            match self.peek() {
                Some(',') => {
                    self.bump();
                }
                Some(']') => {
                    self.bump();
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.unexpected()),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, JsonError> {
        let depth = self.enter(depth)?;
        self.expect('{')?;
        let mut members: Vec<Member> = Vec::new();
        // Key → position of its first occurrence, so duplicate detection stays linear even for
        // an object with a hundred thousand keys.
        let mut seen: HashMap<String, Pos> = HashMap::new();
        self.skip_ws();
        if self.peek() == Some('}') {
            self.bump();
            return Ok(Value::Object(members));
        }
        loop {
            self.skip_ws();
            let key_pos = self.pos();
            if self.peek() != Some('"') {
                return Err(self.unexpected());
            }
            let key = self.string()?;
            self.path.push(Segment::Key(key.clone()));
            if let Some(first) = seen.get(&key) {
                let first = *first;
                return Err(self.error_at(key_pos, SyntaxError::DuplicateKey { first }));
            }
            seen.insert(key.clone(), key_pos);
            self.skip_ws();
            self.expect(':')?;
            self.skip_ws();
            let node = self.value(depth)?;
            self.path.pop();
            members.push(Member { key, key_pos, node });
            self.skip_ws();
            match self.peek() {
                Some(',') => {
                    self.bump();
                }
                Some('}') => {
                    self.bump();
                    return Ok(Value::Object(members));
                }
                _ => return Err(self.unexpected()),
            }
        }
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let mut v = 0u32;
        for _ in 0..4 {
            let digit = self.peek().and_then(|c| c.to_digit(16));
            match digit {
                Some(d) => {
                    self.bump();
                    v = v * 16 + d;
                }
                None => return Err(self.error_here(SyntaxError::InvalidUnicodeEscape)),
            }
        }
        Ok(v)
    }

    fn string(&mut self) -> Result<String, JsonError> {
        self.expect('"')?;
        let mut out = String::new();
        loop {
            let Some(c) = self.peek() else {
                return Err(self.error_here(SyntaxError::UnexpectedEnd));
            };
            match c {
                '"' => {
                    self.bump();
                    return Ok(out);
                }
                '\\' => {
                    self.bump();
                    let Some(e) = self.peek() else {
                        return Err(self.error_here(SyntaxError::UnexpectedEnd));
                    };
                    let decoded = match e {
                        '"' => '"',
                        '\\' => '\\',
                        '/' => '/',
                        'b' => '\u{8}',
                        'f' => '\u{c}',
                        'n' => '\n',
                        'r' => '\r',
                        't' => '\t',
                        'u' => {
                            self.bump();
                            let c = self.unicode_escape()?;
                            out.push(c);
                            continue;
                        }
                        _ => return Err(self.error_here(SyntaxError::InvalidEscape)),
                    };
                    self.bump();
                    out.push(decoded);
                }
                c if u32::from(c) < 0x20 => {
                    return Err(self.error_here(SyntaxError::ControlInString));
                }
                c => {
                    self.bump();
                    out.push(c);
                }
            }
        }
    }

    /// Called after `\u`; reads the code unit and, for a high surrogate, its low partner.
    fn unicode_escape(&mut self) -> Result<char, JsonError> {
        let first = self.hex4()?;
        let code = if (0xD800..0xDC00).contains(&first) {
            if self.peek() != Some('\\') {
                return Err(self.error_here(SyntaxError::InvalidUnicodeEscape));
            }
            self.bump();
            if self.peek() != Some('u') {
                return Err(self.error_here(SyntaxError::InvalidUnicodeEscape));
            }
            self.bump();
            let second = self.hex4()?;
            if !(0xDC00..0xE000).contains(&second) {
                return Err(self.error_here(SyntaxError::InvalidUnicodeEscape));
            }
            0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00)
        } else {
            first
        };
        char::from_u32(code).ok_or_else(|| self.error_here(SyntaxError::InvalidUnicodeEscape))
    }

    fn digits(&mut self) -> usize {
        let mut n = 0;
        while let Some('0'..='9') = self.peek() {
            self.bump();
            n += 1;
        }
        n
    }

    fn number(&mut self) -> Result<String, JsonError> {
        let start = self.at;
        let start_pos = self.pos();
        if self.peek() == Some('-') {
            self.bump();
        }
        match self.peek() {
            Some('0') => {
                self.bump();
                if let Some('0'..='9') = self.peek() {
                    return Err(self.error_at(start_pos, SyntaxError::InvalidNumber));
                }
            }
            Some('1'..='9') => {
                self.digits();
            }
            _ => return Err(self.error_at(start_pos, SyntaxError::InvalidNumber)),
        }
        if self.peek() == Some('.') {
            self.bump();
            if self.digits() == 0 {
                return Err(self.error_at(start_pos, SyntaxError::InvalidNumber));
            }
        }
        if let Some('e' | 'E') = self.peek() {
            self.bump();
            if let Some('+' | '-') = self.peek() {
                self.bump();
            }
            if self.digits() == 0 {
                return Err(self.error_at(start_pos, SyntaxError::InvalidNumber));
            }
        }
        Ok(self.text[start..self.at].to_owned())
    }
}

#[cfg(test)]
mod tests;
