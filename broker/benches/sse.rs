//! Throughput of the SSE parser on MCP Streamable HTTP traffic, against the floor of merely
//! finding the newlines in the same buffer, measured in the same run on one core.
//!
//! For each event data size, about 64 MiB of events shaped like a server's JSON-RPC responses
//! (`event: message`, a UUID-like `id`, one JSON line of `data`) is fed to one [`SseParser`] in
//! 64 KiB chunks, the way a response body arrives; the events are dropped after each chunk, as a
//! consumer would. The reference is `memchr::memchr_iter(b'\n', …).count()` over the same buffer.
//! Each figure is the median of several runs.
//!
//! Run: `cargo bench -p iteron-broker --bench sse` (`-- --write-docs` regenerates the table in
//! docs/benchmarks.md).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark harness")]

use std::fmt::Write as _;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use iteron_broker::mcp::sse::{SseLimits, SseParser};

const START: &str = "<!-- bench:sse:start -->";
const END: &str = "<!-- bench:sse:end -->";
const STREAM_BYTES: usize = 64 << 20;
const CHUNK_BYTES: usize = 64 << 10;
const DATA_SIZES: [usize; 3] = [256, 4096, 16384];
const RUNS: usize = 7;
const TARGET_GBPS: f64 = 1.0;

/// Deterministic xorshift, so every run parses the same bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn uuid_like(rng: &mut Rng) -> String {
    let (a, b) = (rng.next(), rng.next());
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        0x8000 | ((b >> 48) & 0x3fff),
        b & 0xffff_ffff_ffff
    )
}

/// One JSON-RPC response of exactly `size` bytes on one line: a tool result whose text is
/// mostly ASCII prose with escapes and the odd non-ASCII character.
fn json_line(size: usize, seq: u64, rng: &mut Rng) -> String {
    const WORDS: [&str; 12] = [
        "the", "file", "contains", "function", "return", "value", "error", "line", "module",
        "parser", "request", "result",
    ];
    let head =
        format!(r#"{{"jsonrpc":"2.0","id":{seq},"result":{{"content":[{{"type":"text","text":""#);
    let tail = r#""}],"isError":false}}"#;
    let room = size.saturating_sub(head.len() + tail.len());
    let mut text = String::with_capacity(room);
    while text.len() < room {
        let left = room - text.len();
        let piece = match rng.below(40) {
            0 => "\\n",
            1 => "\\\"",
            2 => "é",
            _ => WORDS[rng.below(WORDS.len() as u64) as usize],
        };
        if piece.len() < left {
            text.push_str(piece);
            text.push(' ');
        } else {
            text.extend(std::iter::repeat_n('x', left));
        }
    }
    let line = format!("{head}{text}{tail}");
    assert_eq!(line.len(), size.max(head.len() + tail.len()));
    line
}

/// About [`STREAM_BYTES`] of events whose data is `size` bytes; returns the stream and its
/// event count.
fn build_stream(size: usize) -> (Vec<u8>, usize) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ size as u64);
    let mut stream = Vec::with_capacity(STREAM_BYTES + size + 128);
    let mut events = 0;
    while stream.len() < STREAM_BYTES {
        let event = format!(
            "event: message\nid: {}\ndata: {}\n\n",
            uuid_like(&mut rng),
            json_line(size, events as u64, &mut rng)
        );
        stream.extend_from_slice(event.as_bytes());
        events += 1;
    }
    (stream, events)
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn parse_once(stream: &[u8], expected_events: usize) -> f64 {
    // Defaults, raised so that the whole stream fits exactly.
    let limits = SseLimits {
        max_events: expected_events,
        max_total_bytes: stream.len() as u64,
        ..SseLimits::default()
    };
    let mut parser = SseParser::new(limits);
    let mut out = Vec::with_capacity(512);
    let mut events = 0;
    let start = Instant::now();
    for chunk in stream.chunks(CHUNK_BYTES) {
        parser.feed(black_box(chunk), &mut out).unwrap();
        events += out.len();
        black_box(&out);
        out.clear();
    }
    parser.finish().unwrap();
    let seconds = start.elapsed().as_secs_f64();
    assert_eq!(events, expected_events);
    gbps(stream.len(), seconds)
}

fn newline_scan_once(stream: &[u8], expected_events: usize) -> f64 {
    let start = Instant::now();
    let newlines = memchr::memchr_iter(b'\n', black_box(stream)).count();
    let seconds = start.elapsed().as_secs_f64();
    assert_eq!(black_box(newlines), 4 * expected_events);
    gbps(stream.len(), seconds)
}

fn size_label(size: usize) -> String {
    if size >= 1024 {
        format!("{} KiB", size / 1024)
    } else {
        format!("{size} B")
    }
}

fn main() {
    let write_docs = std::env::args().any(|a| a == "--write-docs");
    let mut rows = Vec::new();
    for size in DATA_SIZES {
        let (stream, events) = build_stream(size);
        // Warm up (page in the buffer, grow the allocator's pools), then interleave the two
        // measurements so that drift affects both alike.
        parse_once(&stream, events);
        newline_scan_once(&stream, events);
        let (mut parser, mut scan) = (Vec::new(), Vec::new());
        for _ in 0..RUNS {
            parser.push(parse_once(&stream, events));
            scan.push(newline_scan_once(&stream, events));
        }
        let (parser, scan) = (median(parser), median(scan));
        eprintln!(
            "data {:>6}: {events} events, {:.1} MiB: parser {parser:.2} GB/s, newline scan {scan:.2} GB/s{}",
            size_label(size),
            stream.len() as f64 / (1 << 20) as f64,
            if parser >= TARGET_GBPS {
                ""
            } else {
                "  (below the 1 GB/s target)"
            }
        );
        rows.push((size, parser, scan));
    }

    let mut table =
        String::from("| event data size | parser GB/s | newline-scan GB/s |\n|---|---|---|\n");
    for (size, parser, scan) in &rows {
        writeln!(table, "| {} | {parser:.2} | {scan:.2} |", size_label(*size)).unwrap();
    }
    println!("{table}");

    if write_docs {
        let description = format!(
            "64 MiB of `event: message` / UUID `id` / one-line JSON `data` events per size, fed in \
             64 KiB chunks on one core; median of {RUNS} runs, interleaved with the reference runs.\n"
        );
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/benchmarks.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let body = format!("{START}\n{description}\n{table}{END}");
        let updated = match (doc.find(START), doc.find(END)) {
            (Some(a), Some(b)) if a < b => {
                format!("{}{body}{}", &doc[..a], &doc[b + END.len()..])
            }
            _ => {
                let mut doc = doc;
                if !doc.ends_with('\n') {
                    doc.push('\n');
                }
                format!(
                    "{doc}\n## SSE parser\n\n\
                     Reproduce (and regenerate this table):\n\n\
                     ```\ncargo bench -p iteron-broker --bench sse -- --write-docs\n```\n\n\
                     The parser reads MCP Streamable HTTP response bodies (`broker/src/mcp/sse.rs`) \
                     with every bound\nenforced; the reference only counts the newlines of the same \
                     buffer with `memchr`, a floor no line\nparser can reach. Target: parser ≥ \
                     {TARGET_GBPS} GB/s for every size.\n\n\
                     {body}\n"
                )
            }
        };
        std::fs::write(&path, updated).unwrap();
        eprintln!("updated {}", path.display());
    }
}
