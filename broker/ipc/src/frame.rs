//! Frames: a 4-byte big-endian length, then that many bytes of JSON. The length is checked
//! against the hard maximum before a single body byte is read or buffered.

use std::fmt;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The hard maximum size of one frame's body (DESIGN §11: 1 MiB).
pub const MAX_FRAME: usize = 1 << 20;

/// Why a frame could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The peer closed the connection in the middle of a frame.
    Truncated,
    /// A zero-length frame.
    Empty,
    /// The announced length is over the maximum (the body is never read).
    Oversized {
        /// The announced length.
        len: u64,
        /// The maximum.
        max: usize,
    },
    /// The body did not arrive within the deadline.
    Timeout,
    /// The socket failed.
    Io(std::io::ErrorKind),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::Truncated => f.write_str("the connection closed in the middle of a frame"),
            FrameError::Empty => f.write_str("empty frame"),
            FrameError::Oversized { len, max } => {
                write!(f, "frame of {len} bytes is over the maximum of {max} bytes")
            }
            FrameError::Timeout => f.write_str("the frame did not arrive in time"),
            FrameError::Io(kind) => write!(f, "socket error: {kind}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Read one frame. `Ok(None)` is a clean end of stream (the peer closed between frames). Once
/// the first byte of a frame has arrived, the rest must follow within `body_deadline`.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    body_deadline: Duration,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut first = [0u8; 1];
    match r.read(&mut first).await {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(FrameError::Io(e.kind())),
    }
    match tokio::time::timeout(body_deadline, read_rest(r, first[0], max)).await {
        Ok(out) => out.map(Some),
        Err(_) => Err(FrameError::Timeout),
    }
}

async fn read_rest<R: AsyncRead + Unpin>(
    r: &mut R,
    first: u8,
    max: usize,
) -> Result<Vec<u8>, FrameError> {
    let mut rest = [0u8; 3];
    r.read_exact(&mut rest).await.map_err(eof_is_truncated)?;
    let len = u32::from_be_bytes([first, rest[0], rest[1], rest[2]]);
    let len_usize = usize::try_from(len).unwrap_or(usize::MAX);
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len_usize > max {
        return Err(FrameError::Oversized {
            len: u64::from(len),
            max,
        });
    }
    let mut body = vec![0u8; len_usize];
    r.read_exact(&mut body).await.map_err(eof_is_truncated)?;
    Ok(body)
}

fn eof_is_truncated(e: std::io::Error) -> FrameError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        FrameError::Truncated
    } else {
        FrameError::Io(e.kind())
    }
}

/// Encode a frame (length prefix + body). Refuses a body over `max` or empty.
pub fn encode(body: &[u8], max: usize) -> Result<Vec<u8>, FrameError> {
    if body.is_empty() {
        return Err(FrameError::Empty);
    }
    if body.len() > max {
        return Err(FrameError::Oversized {
            len: body.len() as u64,
            max,
        });
    }
    let len = u32::try_from(body.len()).map_err(|_| FrameError::Oversized {
        len: body.len() as u64,
        max,
    })?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

/// Write one frame and flush.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    body: &[u8],
    max: usize,
) -> Result<(), FrameError> {
    let frame = encode(body, max)?;
    w.write_all(&frame)
        .await
        .map_err(|e| FrameError::Io(e.kind()))?;
    w.flush().await.map_err(|e| FrameError::Io(e.kind()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const D: Duration = Duration::from_secs(5);

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    async fn read_all(mut input: &[u8], max: usize) -> Vec<Result<Option<Vec<u8>>, FrameError>> {
        let mut out = Vec::new();
        loop {
            let r = read_frame(&mut input, max, D).await;
            let stop = !matches!(r, Ok(Some(_)));
            out.push(r);
            if stop {
                return out;
            }
        }
    }

    #[test]
    fn frames_round_trip_and_the_edges_hold() {
        rt().block_on(async {
            let mut wire = encode(b"{}", 8).unwrap();
            wire.extend(encode(b"12345678", 8).unwrap());
            let got = read_all(&wire, 8).await;
            assert_eq!(got[0], Ok(Some(b"{}".to_vec())));
            assert_eq!(got[1], Ok(Some(b"12345678".to_vec())));
            assert_eq!(got[2], Ok(None));
            // One byte over the maximum: refused from the header alone.
            let mut over = 9u32.to_be_bytes().to_vec();
            over.extend([b'x'; 9]);
            assert_eq!(
                read_all(&over, 8).await[0],
                Err(FrameError::Oversized { len: 9, max: 8 })
            );
            assert_eq!(
                encode(b"123456789", 8),
                Err(FrameError::Oversized { len: 9, max: 8 })
            );
            assert_eq!(read_all(&[0, 0, 0, 0], 8).await[0], Err(FrameError::Empty));
            assert_eq!(read_all(&[0, 0], 8).await[0], Err(FrameError::Truncated));
            assert_eq!(
                read_all(&[0, 0, 0, 5, b'a'], 8).await[0],
                Err(FrameError::Truncated)
            );
            // A 4 GiB announcement allocates nothing.
            assert_eq!(
                read_all(&[0xff; 4], MAX_FRAME).await[0],
                Err(FrameError::Oversized {
                    len: u64::from(u32::MAX),
                    max: MAX_FRAME
                })
            );
        });
        iteron_test_support::record!("P5", serde_json::json!({}),);
    }

    #[test]
    fn a_stalled_body_times_out() {
        rt().block_on(async {
            let (mut a, mut b) = tokio::io::duplex(64);
            a.write_all(&[0, 0, 0, 10, b'{']).await.unwrap();
            let r = read_frame(&mut b, 64, Duration::from_millis(50)).await;
            assert_eq!(r, Err(FrameError::Timeout));
        });
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Arbitrary bytes never panic the reader, every frame it returns is within the bound,
        /// and the frames it returns are exactly the input's prefix.
        #[test]
        fn arbitrary_bytes_never_break_the_reader(input in prop::collection::vec(any::<u8>(), 0..256), max in 1usize..64) {
            let got = rt().block_on(read_all(&input, max));
            let mut consumed = 0;
            for r in &got {
                if let Ok(Some(body)) = r {
                    prop_assert!(!body.is_empty() && body.len() <= max);
                    prop_assert_eq!(&input[consumed + 4..consumed + 4 + body.len()], &body[..]);
                    consumed += 4 + body.len();
                }
            }
            prop_assert!(!matches!(got.last(), Some(Ok(Some(_)))));
        }

        #[test]
        fn encoded_frames_decode_to_themselves(bodies in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..100), 0..8)) {
            let mut wire = Vec::new();
            for b in &bodies {
                wire.extend(encode(b, 100).unwrap());
            }
            let got = rt().block_on(read_all(&wire, 100));
            prop_assert_eq!(got.len(), bodies.len() + 1);
            for (b, r) in bodies.iter().zip(&got) {
                prop_assert_eq!(r, &Ok(Some(b.clone())));
            }
        }
    }
}
