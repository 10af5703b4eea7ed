//! Incremental parser for Server-Sent Events, the body format of MCP Streamable HTTP responses
//! (WHATWG HTML, "interpreting an event stream"), for streams written by untrusted servers.
//!
//! What it guards against:
//! - **Unbounded buffering.** Nothing grows without a bound: an event's data may not exceed
//!   [`SseLimits::max_event_bytes`], and neither may any other line (an `event:` or `id:` value, a
//!   comment, an unknown field), whether or not its line end has arrived yet. A line that never
//!   ends fails on the byte that makes it too long; it is not buffered until a newline shows up.
//!   The carried-over partial line is therefore at most `max_event_bytes` plus the six bytes of
//!   `data: `.
//! - **Endless streams.** [`SseLimits::max_total_bytes`] counts every byte fed and
//!   [`SseLimits::max_events`] every dispatched block, including the empty-data ones that are not
//!   returned; keep-alive comments count only towards the byte total. Every bound fails one
//!   byte (or one event) over it.
//! - **Chunking games.** The outcome depends only on the bytes, never on where the transport
//!   split them: a line may span any number of chunks, a CR ending one chunk and an LF starting the
//!   next are one line end, a byte order mark may arrive split, and a bound fails at the same place
//!   in the stream (with the same events delivered before it) however the stream was chunked.
//!   Long lines fed byte by byte cost linear time, not quadratic.
//! - **Non-text payloads.** Returned data and event types are UTF-8 or the stream fails with
//!   [`SseError::InvalidUtf8`]; an `id` that is not UTF-8 (or contains NUL) is ignored.
//! - **Resuming past an event that never arrived.** As in the specification, an `id` becomes the
//!   Last-Event-ID only when the blank line ending its event arrives: an event cut off by the end
//!   of the stream is discarded together with its id, so a resumed stream replays it.
//! - **Absurd reconnection delays.** `retry:` saturates at [`MAX_RETRY`].
//! - **Use after failure.** After any error the parser is poisoned and repeats that error.
//!
//! One deliberate difference from the specification, for MCP: a block whose data is empty after
//! removing its final newline (a Streamable HTTP "priming" event, `id: X` with an empty `data:`)
//! is not returned, though its `id` and `retry` take effect. An `id:` with an empty value clears
//! the Last-Event-ID, as the specification says.

use std::fmt;
use std::mem;
use std::time::Duration;

use memchr::{memchr, memchr2};

/// Longest reconnection time a `retry:` field can set; larger values saturate to it.
pub const MAX_RETRY: Duration = Duration::from_secs(24 * 60 * 60);

/// [`MAX_RETRY`] in milliseconds, the unit of `retry:`.
const MAX_RETRY_MS: u64 = 24 * 60 * 60 * 1000;

/// The UTF-8 byte order mark, skipped once at the very start of a stream.
const BOM: [u8; 3] = [0xEF, 0xBB, 0xBF];

/// Length of `data: `: how much longer than `max_event_bytes` a data line may be while its value
/// still fits, hence the most a carried-over partial line can exceed that bound.
const DATA_PREFIX: usize = 6;

/// Capacity of the partial-line buffer kept between lines; a larger one is released.
const RETAINED_LINE_CAPACITY: usize = 64 * 1024;

/// Bounds, all enforced one byte / one event over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SseLimits {
    /// Most bytes of data in one event (after joining its `data:` lines with `\n`), and the
    /// longest any other line may be.
    pub max_event_bytes: usize,
    /// Most dispatched blocks (those with at least one field, returned or not).
    pub max_events: usize,
    /// Most bytes fed over the whole stream.
    pub max_total_bytes: u64,
}

impl Default for SseLimits {
    /// 8 MiB per event, 10 000 events, 64 MiB per stream.
    fn default() -> Self {
        SseLimits {
            max_event_bytes: 8 * 1024 * 1024,
            max_events: 10_000,
            max_total_bytes: 64 * 1024 * 1024,
        }
    }
}

/// One event returned by the parser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` type, `None` when absent or empty (the specification's default, "message").
    pub event: Option<String>,
    /// The data lines joined with `\n`; never empty.
    pub data: String,
    /// The Last-Event-ID in force when the event was dispatched (its own `id:` or an earlier one).
    pub id: Option<String>,
}

/// Why a stream was refused. Texts are single lines that never quote stream content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseError {
    /// An event's data, or another line, exceeded [`SseLimits::max_event_bytes`].
    EventTooLarge {
        /// The bound that was exceeded, in bytes.
        limit: usize,
    },
    /// The stream dispatched more than [`SseLimits::max_events`] blocks.
    TooManyEvents {
        /// The bound that was exceeded, in events.
        limit: usize,
    },
    /// The stream exceeded [`SseLimits::max_total_bytes`].
    StreamTooLarge {
        /// The bound that was exceeded, in bytes.
        limit: u64,
    },
    /// A returned event's data or type is not UTF-8.
    InvalidUtf8,
}

impl fmt::Display for SseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SseError::EventTooLarge { limit } => {
                write!(f, "server-sent event exceeds the limit of {limit} bytes")
            }
            SseError::TooManyEvents { limit } => {
                write!(f, "event stream exceeds the limit of {limit} events")
            }
            SseError::StreamTooLarge { limit } => {
                write!(f, "event stream exceeds the limit of {limit} bytes")
            }
            SseError::InvalidUtf8 => write!(f, "server-sent event is not valid UTF-8"),
        }
    }
}

impl std::error::Error for SseError {}

/// What the current block's `id:` lines did to the Last-Event-ID, applied at dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdUpdate {
    /// No usable `id:` line yet.
    Keep,
    /// Set it to `id_buf`.
    Set,
    /// Clear it (`id:` with an empty value).
    Clear,
}

/// Parses one event stream incrementally; see the module documentation.
pub struct SseParser {
    limits: SseLimits,
    /// Bytes of the stream's leading byte order mark matched so far; `None` once past the start.
    bom_matched: Option<usize>,
    /// The previous chunk ended with CR: an LF starting the next one belongs to that line end.
    after_cr: bool,
    /// Unterminated line carried over from earlier chunks.
    line: Vec<u8>,
    /// Position of the first `:` in `line`, kept up to date so checks stay O(1) per chunk.
    line_colon: Option<usize>,
    /// The current block has had a field line (comments and blank lines are not fields).
    block_has_field: bool,
    /// The current block's data lines, each followed by `\n`.
    data: Vec<u8>,
    /// The current block's event type (bytes; checked at dispatch).
    event_type: Vec<u8>,
    id_update: IdUpdate,
    /// The current block's pending id, when `id_update` is `Set`.
    id_buf: String,
    last_id: Option<String>,
    retry: Option<Duration>,
    events_dispatched: usize,
    bytes_seen: u64,
    poisoned: Option<SseError>,
}

impl fmt::Debug for SseParser {
    /// Counters and bounds only: buffered stream content may hold anything, secrets included.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SseParser")
            .field("limits", &self.limits)
            .field("events_dispatched", &self.events_dispatched)
            .field("bytes_seen", &self.bytes_seen)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

impl SseParser {
    /// A parser at the start of a stream, enforcing `limits`.
    pub fn new(limits: SseLimits) -> Self {
        SseParser {
            limits,
            bom_matched: Some(0),
            after_cr: false,
            line: Vec::new(),
            line_colon: None,
            block_has_field: false,
            data: Vec::new(),
            event_type: Vec::new(),
            id_update: IdUpdate::Keep,
            id_buf: String::new(),
            last_id: None,
            retry: None,
            events_dispatched: 0,
            bytes_seen: 0,
            poisoned: None,
        }
    }

    /// Feed bytes; push every completed non-empty event to `out`. After an error the parser is
    /// poisoned: every later call returns the same error.
    ///
    /// Events completed before the failing byte are still pushed, so what `out` receives does not
    /// depend on how the stream was split into chunks.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if let Some(err) = &self.poisoned {
            return Err(err.clone());
        }
        let result = self.feed_unpoisoned(chunk, out);
        if let Err(err) = &result {
            self.poisoned = Some(err.clone());
        }
        result
    }

    /// End of stream. Discards an unterminated event (and its id, which never took effect).
    ///
    /// The parser is then at the start of a new stream (a reconnection): the Last-Event-ID, the
    /// reconnection time, the counters and so the cumulative bounds carry over.
    pub fn finish(&mut self) -> Result<(), SseError> {
        if let Some(err) = &self.poisoned {
            return Err(err.clone());
        }
        self.bom_matched = Some(0);
        self.after_cr = false;
        self.line = Vec::new();
        self.line_colon = None;
        self.block_has_field = false;
        self.data = Vec::new();
        self.event_type = Vec::new();
        self.id_update = IdUpdate::Keep;
        Ok(())
    }

    /// The id to send as `Last-Event-ID` when resuming (`None` if the server never gave one, or
    /// cleared it with an empty `id:`).
    pub fn last_event_id(&self) -> Option<&str> {
        self.last_id.as_deref()
    }

    /// The reconnection time the server asked for with `retry:`, at most [`MAX_RETRY`].
    pub fn retry(&self) -> Option<Duration> {
        self.retry
    }

    /// Blank-line-terminated blocks that had any field, including skipped empty-data ones.
    pub fn events_dispatched(&self) -> usize {
        self.events_dispatched
    }

    /// Bytes fed so far (saturating).
    pub fn bytes_seen(&self) -> u64 {
        self.bytes_seen
    }

    fn feed_unpoisoned(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let limit = self.limits.max_total_bytes;
        let room = limit.saturating_sub(self.bytes_seen);
        let len = u64::try_from(chunk.len()).unwrap_or(u64::MAX);
        self.bytes_seen = self.bytes_seen.saturating_add(len);
        if len <= room {
            return self.scan(chunk, out);
        }
        // Parse the part that still fits before refusing, so that the refusal happens at the same
        // byte of the stream however it was chunked. `room < len`, so it fits in a usize.
        let fits = usize::try_from(room).unwrap_or(0);
        self.scan(chunk.get(..fits).unwrap_or_default(), out)?;
        Err(SseError::StreamTooLarge { limit })
    }

    fn event_too_large(&self) -> SseError {
        SseError::EventTooLarge {
            limit: self.limits.max_event_bytes,
        }
    }

    /// Splits `bytes` into lines and handles each one.
    fn scan(&mut self, mut rest: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if let Some(matched) = self.bom_matched {
            rest = self.skip_bom(rest, matched);
        }
        if self.after_cr {
            match rest.split_first() {
                None => return Ok(()),
                Some((&b'\n', tail)) => rest = tail,
                Some(_) => {}
            }
            self.after_cr = false;
        }
        if !self.line.is_empty() {
            let Some(end) = memchr2(b'\n', b'\r', rest) else {
                return self.carry(rest);
            };
            let (head, tail) = rest.split_at(end);
            self.append_to_line(head)?;
            let line = mem::take(&mut self.line);
            let result = self.handle_line(&line, out);
            self.line = line;
            self.line.clear();
            self.line_colon = None;
            if self.line.capacity() > RETAINED_LINE_CAPACITY {
                self.line = Vec::new();
            }
            result?;
            rest = self.skip_line_end(tail);
        }
        while let Some(end) = memchr2(b'\n', b'\r', rest) {
            let (line, tail) = rest.split_at(end);
            self.handle_line(line, out)?;
            rest = self.skip_line_end(tail);
        }
        if rest.is_empty() {
            Ok(())
        } else {
            self.carry(rest)
        }
    }

    /// Consumes what matches the byte order mark at the start of the stream. Bytes that turn out
    /// not to be one are given back as the start of the first line.
    fn skip_bom<'a>(&mut self, mut rest: &'a [u8], mut matched: usize) -> &'a [u8] {
        while let Some(&expected) = BOM.get(matched) {
            match rest.split_first() {
                None => {
                    self.bom_matched = Some(matched);
                    return rest;
                }
                Some((&byte, tail)) if byte == expected => {
                    matched += 1;
                    rest = tail;
                }
                Some(_) => {
                    // At most two bytes, far below any bound on the line.
                    self.line
                        .extend_from_slice(BOM.get(..matched).unwrap_or_default());
                    self.line_colon = None;
                    break;
                }
            }
        }
        self.bom_matched = None;
        rest
    }

    /// `rest` starts with the CR or LF that ended a line: returns what follows the line end.
    fn skip_line_end<'a>(&mut self, rest: &'a [u8]) -> &'a [u8] {
        match rest.split_first() {
            Some((&b'\r', tail)) => match tail.split_first() {
                Some((&b'\n', after)) => after,
                Some(_) => tail,
                None => {
                    self.after_cr = true;
                    tail
                }
            },
            Some((_, tail)) => tail,
            None => rest,
        }
    }

    /// Adds bytes to the carried-over line, refusing to let it outgrow what any acceptable line
    /// could be.
    fn append_to_line(&mut self, part: &[u8]) -> Result<(), SseError> {
        let cap = self.limits.max_event_bytes.saturating_add(DATA_PREFIX);
        if part.len() > cap.saturating_sub(self.line.len()) {
            return Err(self.event_too_large());
        }
        if self.line_colon.is_none()
            && let Some(colon) = memchr(b':', part)
        {
            self.line_colon = Some(self.line.len() + colon);
        }
        self.line.extend_from_slice(part);
        Ok(())
    }

    /// Keeps the unterminated end of a chunk, failing as soon as the line is certain to break a
    /// bound once it ends (the same verdict [`Self::handle_line`] would reach, only earlier).
    fn carry(&mut self, part: &[u8]) -> Result<(), SseError> {
        self.append_to_line(part)?;
        let max = self.limits.max_event_bytes;
        let doomed = match self.line_colon {
            Some(colon) if self.line.get(..colon) == Some(b"data".as_slice()) => {
                let value = strip_space(self.line.get(colon + 1..).unwrap_or_default());
                self.data.len().saturating_add(value.len()) > max
            }
            Some(_) => self.line.len() > max,
            // Still a prefix of "data" (the field may yet be data): undecided.
            None => self.line.len() > max && !b"data".starts_with(&self.line),
        };
        if doomed {
            return Err(self.event_too_large());
        }
        Ok(())
    }

    /// One complete line, without its line end.
    fn handle_line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let Some(&first) = line.first() else {
            return self.dispatch(out);
        };
        let (name, value) = match memchr(b':', line) {
            Some(colon) => (
                line.get(..colon).unwrap_or_default(),
                strip_space(line.get(colon + 1..).unwrap_or_default()),
            ),
            None => (line, &[][..]),
        };
        if name == b"data" {
            return self.append_data(value);
        }
        if line.len() > self.limits.max_event_bytes {
            return Err(self.event_too_large());
        }
        if first == b':' {
            return Ok(()); // a comment
        }
        self.block_has_field = true;
        match name {
            b"event" => {
                self.event_type.clear();
                self.event_type.extend_from_slice(value);
            }
            b"id" => self.set_id(value),
            b"retry" => {
                if let Some(ms) = parse_retry(value) {
                    self.retry = Some(Duration::from_millis(ms));
                }
            }
            _ => {} // unknown fields are ignored
        }
        Ok(())
    }

    fn append_data(&mut self, value: &[u8]) -> Result<(), SseError> {
        self.block_has_field = true;
        // `data` holds the lines so far, each with its `\n`: joined with this one it is this long.
        if self.data.len().saturating_add(value.len()) > self.limits.max_event_bytes {
            return Err(self.event_too_large());
        }
        if self.data.is_empty() {
            // The usual event has one data line: allocate exactly once, with room for the `\n`.
            self.data.reserve_exact(value.len().saturating_add(1));
        }
        self.data.extend_from_slice(value);
        self.data.push(b'\n');
        Ok(())
    }

    fn set_id(&mut self, value: &[u8]) {
        if memchr(0, value).is_some() {
            return;
        }
        let Ok(id) = std::str::from_utf8(value) else {
            return;
        };
        if id.is_empty() {
            self.id_update = IdUpdate::Clear;
        } else {
            self.id_buf.clear();
            self.id_buf.push_str(id);
            self.id_update = IdUpdate::Set;
        }
    }

    /// A blank line: ends the current block.
    fn dispatch(&mut self, out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if !self.block_has_field {
            return Ok(()); // nothing but comments, or consecutive blank lines
        }
        self.block_has_field = false;
        let limit = self.limits.max_events;
        if self.events_dispatched >= limit {
            return Err(SseError::TooManyEvents { limit });
        }
        self.events_dispatched += 1;
        match mem::replace(&mut self.id_update, IdUpdate::Keep) {
            IdUpdate::Keep => {}
            IdUpdate::Clear => self.last_id = None,
            IdUpdate::Set => match &mut self.last_id {
                Some(id) => {
                    id.clear();
                    id.push_str(&self.id_buf);
                }
                None => self.last_id = Some(self.id_buf.clone()),
            },
        }
        // Non-empty data always ends with `\n`; a lone one is empty data (a priming event).
        if self.data.len() <= 1 {
            self.data.clear();
            self.event_type.clear();
            return Ok(());
        }
        self.data.pop();
        let event = if self.event_type.is_empty() {
            None
        } else {
            let name = std::str::from_utf8(&self.event_type).map_err(|_| SseError::InvalidUtf8)?;
            Some(name.to_owned())
        };
        self.event_type.clear();
        let data =
            String::from_utf8(mem::take(&mut self.data)).map_err(|_| SseError::InvalidUtf8)?;
        out.push(SseEvent {
            event,
            data,
            id: self.last_id.clone(),
        });
        Ok(())
    }
}

/// The value after the field's colon, without its one optional leading space.
fn strip_space(value: &[u8]) -> &[u8] {
    match value.split_first() {
        Some((&b' ', rest)) => rest,
        _ => value,
    }
}

/// Milliseconds of a `retry:` value made only of ASCII digits, saturating at [`MAX_RETRY`].
fn parse_retry(value: &[u8]) -> Option<u64> {
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut ms: u64 = 0;
    for &digit in value {
        ms = ms
            .saturating_mul(10)
            .saturating_add(u64::from(digit - b'0'))
            .min(MAX_RETRY_MS);
    }
    Some(ms)
}

#[cfg(test)]
mod tests;
