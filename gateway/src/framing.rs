//! An HTTP/1.1 message body's framing, decoded incrementally (RFC 9112 §6–7): an engine's
//! response body ([`crate::upstream`]) and a client's request body ([`crate::downstream`]).
//!
//! [`BodyDecoder::decode`] takes whatever bytes have arrived, moves the body's data into the
//! client-bound buffer and keeps the framing (chunk sizes, CRLFs, trailers) to itself; bytes
//! that cannot be decoded yet (half a chunk-size line) stay in the input for the next read.
//! Pure: no I/O, so every split of the input is testable.

use bytes::{Buf, Bytes, BytesMut};

/// The longest chunk-size line (size, extensions) or trailer line accepted.
const MAX_LINE: usize = 4096;
/// The most trailer bytes accepted (trailers are read and dropped).
const MAX_TRAILERS: usize = 16 * 1024;

/// How the body's end is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `Content-Length`.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the engine closes the connection (HTTP/1.0 style; never reusable).
    UntilClose,
}

/// A body the engine framed wrongly.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BodyError {
    #[error("invalid chunk size line")]
    ChunkSize,
    #[error("a chunk's data is not followed by CRLF")]
    ChunkEnd,
    #[error("chunk size or trailer line longer than {MAX_LINE} bytes")]
    LineTooLong,
    #[error("trailers longer than {MAX_TRAILERS} bytes")]
    TrailersTooLong,
    #[error("the connection closed {0} bytes before the body's end")]
    Truncated(u64),
    #[error("the connection closed inside a chunk")]
    TruncatedChunk,
}

/// Where a chunked body's decoding stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(u64),
    /// After a chunk's data, at its CRLF.
    DataEnd,
    /// After the last chunk, in the trailer section (bytes of it seen so far).
    Trailers(usize),
}

/// Where the body stands after a [`BodyDecoder::decode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// More is to come.
    More,
    /// The body ended (the framing said so).
    Ended,
}

/// Decodes one response body.
#[derive(Debug)]
pub struct BodyDecoder {
    state: State,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Length(u64),
    Chunked(Chunk),
    UntilClose,
    Done,
}

impl BodyDecoder {
    /// A decoder for a body framed by `framing`.
    pub fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(Chunk::Size),
            Framing::UntilClose => State::UntilClose,
        };
        BodyDecoder { state }
    }

    /// Whether the body has ended.
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Move the body data `input` holds into `out`, consuming the framing; what cannot be
    /// decoded yet stays in `input`. Bytes after the body's end stay in `input` too.
    pub fn decode(&mut self, input: &mut BytesMut, out: &mut BytesMut) -> Result<Progress, BodyError> {
        // Decoded from a slice, `input` advanced once by what was used (also on an error).
        let mut used = 0;
        let progress = self.decode_slice(input, &mut used, out);
        input.advance(used);
        progress
    }

    fn decode_slice(&mut self, input: &[u8], used: &mut usize, out: &mut BytesMut) -> Result<Progress, BodyError> {
        loop {
            let rest = &input[*used..];
            match self.state {
                State::Done => return Ok(Progress::Ended),
                State::UntilClose => {
                    out.extend_from_slice(rest);
                    *used = input.len();
                    return Ok(Progress::More);
                }
                State::Length(left) => {
                    let n = take(rest, out, left);
                    *used += n as usize;
                    if n < left {
                        // `input` is used up: the rest is still to come.
                        self.state = State::Length(left - n);
                        return Ok(Progress::More);
                    }
                    self.state = State::Done;
                }
                // The usual case, a whole chunk in the buffer (an SSE event): one step.
                State::Chunked(Chunk::Size) if let Some(n) = whole_chunk(rest, out) => *used += n,
                State::Chunked(chunk) => match self.chunked(chunk, rest, out)? {
                    Some((next, n)) => {
                        self.state = next;
                        *used += n;
                    }
                    None => return Ok(Progress::More),
                },
            }
        }
    }

    /// A body framed by its length whose rest is all in `input` (a request body that
    /// arrived with its head): split off whole, sharing `input`'s memory instead of copying
    /// it. `None` when there is more to come or another framing: [`Self::decode`] then.
    pub fn take_whole(&mut self, input: &mut BytesMut) -> Option<Bytes> {
        let State::Length(left) = self.state else { return None };
        let n = usize::try_from(left).ok().filter(|&n| n <= input.len())?;
        self.state = State::Done;
        Some(input.split_to(n).freeze())
    }

    /// The engine closed the connection: fine for a body read until close (then it has
    /// ended), an error for a body whose framing says more was to come.
    pub fn eof(&mut self) -> Result<(), BodyError> {
        match self.state {
            State::Done => Ok(()),
            State::UntilClose => {
                self.state = State::Done;
                Ok(())
            }
            State::Length(left) => Err(BodyError::Truncated(left)),
            State::Chunked(_) => Err(BodyError::TruncatedChunk),
        }
    }

    /// One step of chunked decoding from `chunk` at the front of `input`: the next state and
    /// the bytes it used, or `None` when `input` holds too little to go on.
    fn chunked(&mut self, chunk: Chunk, input: &[u8], out: &mut BytesMut) -> Result<Option<(State, usize)>, BodyError> {
        Ok(Some(match chunk {
            Chunk::Size => {
                let Some(line) = line(input)? else { return Ok(None) };
                let size = chunk_size(&input[..line])?;
                (State::Chunked(if size == 0 { Chunk::Trailers(0) } else { Chunk::Data(size) }), line + 2)
            }
            Chunk::Data(left) => {
                if input.is_empty() {
                    return Ok(None);
                }
                let n = take(input, out, left);
                (State::Chunked(if n == left { Chunk::DataEnd } else { Chunk::Data(left - n) }), n as usize)
            }
            Chunk::DataEnd => {
                if input.len() < 2 {
                    if input.first().is_some_and(|&b| b != b'\r') {
                        return Err(BodyError::ChunkEnd);
                    }
                    return Ok(None);
                }
                if &input[..2] != b"\r\n" {
                    return Err(BodyError::ChunkEnd);
                }
                (State::Chunked(Chunk::Size), 2)
            }
            Chunk::Trailers(seen) => {
                let Some(line) = line(input)? else { return Ok(None) };
                let state = if line == 0 {
                    State::Done
                } else if seen + line + 2 > MAX_TRAILERS {
                    return Err(BodyError::TrailersTooLong);
                } else {
                    State::Chunked(Chunk::Trailers(seen + line + 2))
                };
                (state, line + 2)
            }
        }))
    }
}

/// A whole data chunk at the front of `input` (size line, data, CRLF): its data copied to
/// `out` and the bytes it took; `None` when it is not all there, or is the last chunk, or
/// its size line is more than bare hex digits, or its data does not end in CRLF (the
/// step-by-step decoder takes those, and the error).
///
/// The size is read digit by digit up to its CRLF, one pass over the two or three bytes an
/// SSE event's size takes, instead of finding the line's end first and parsing it second.
fn whole_chunk(input: &[u8], out: &mut BytesMut) -> Option<usize> {
    let mut size = 0u64;
    let mut digits = 0;
    while let Some(v) = input.get(digits).and_then(|&b| hex_digit(b)) {
        if digits == 15 {
            return None;
        }
        size = (size << 4) | u64::from(v);
        digits += 1;
    }
    if digits == 0 || size == 0 || input.get(digits..digits + 2) != Some(b"\r\n") {
        return None;
    }
    let start = digits + 2;
    let end = usize::try_from(size).ok()?.checked_add(start)?;
    if input.get(end..end + 2) != Some(b"\r\n") {
        return None;
    }
    out.extend_from_slice(&input[start..end]);
    Some(end + 2)
}

/// Copy up to `left` bytes from the front of `input` to `out`; how many.
fn take(input: &[u8], out: &mut BytesMut, left: u64) -> u64 {
    let n = input.len().min(usize::try_from(left).unwrap_or(usize::MAX));
    out.extend_from_slice(&input[..n]);
    n as u64
}

/// The length of the CRLF-terminated line at the front of `input` (without its CRLF), or
/// `None` when its end has not arrived.
fn line(input: &[u8]) -> Result<Option<usize>, BodyError> {
    match memchr::memchr(b'\n', input) {
        Some(0) => Err(BodyError::ChunkSize),
        Some(i) if input[i - 1] == b'\r' => Ok(Some(i - 1)),
        Some(_) => Err(BodyError::ChunkSize),
        None if input.len() > MAX_LINE => Err(BodyError::LineTooLong),
        None => Ok(None),
    }
}

/// A chunk-size line's size: hex digits, then optional whitespace and `;extensions` of
/// visible characters, spaces and tabs — no control character (a bare CR in an extension is
/// where another parser may see the line end: RFC 9112 §7.1.1).
fn chunk_size(line: &[u8]) -> Result<u64, BodyError> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 15 {
        return Err(BodyError::ChunkSize);
    }
    let rest = &line[digits..];
    let rest_ok = rest.iter().position(|&b| b != b' ' && b != b'\t').is_none_or(|i| rest[i] == b';')
        && rest.iter().all(|&b| b == b'\t' || (b' '..=b'~').contains(&b));
    if !rest_ok {
        return Err(BodyError::ChunkSize);
    }
    // At most 15 hex digits: 60 bits, no overflow.
    Ok(line[..digits].iter().fold(0u64, |n, &b| (n << 4) | u64::from(hex_digit(b).unwrap_or(0))))
}

/// An ASCII hex digit's value; `None` for any other byte. One table lookup: this runs for
/// every digit of every chunk size an engine sends.
fn hex_digit(b: u8) -> Option<u8> {
    const NOT_HEX: u8 = 0xFF;
    const VALUES: [u8; 256] = {
        let mut t = [NOT_HEX; 256];
        let mut i = 0;
        while i < 10 {
            t[b'0' as usize + i] = i as u8;
            i += 1;
        }
        let mut i = 0;
        while i < 6 {
            t[b'a' as usize + i] = 10 + i as u8;
            t[b'A' as usize + i] = 10 + i as u8;
            i += 1;
        }
        t
    };
    match VALUES[b as usize] {
        NOT_HEX => None,
        v => Some(v),
    }
}

/// A `Content-Length` value: digits only, at most 19 of them (RFC 9112 §6.3). Rust's
/// `parse::<u64>` would also take `+350`, which another parser on the way may read otherwise.
pub(crate) fn content_length(value: &[u8]) -> Option<u64> {
    (!value.is_empty() && value.len() <= 19 && value.iter().all(u8::is_ascii_digit))
        .then(|| value.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_digits_are_exactly_the_sixteen_in_either_case() {
        for b in 0..=255u8 {
            let expected = (b as char).to_digit(16).map(|v| v as u8);
            assert_eq!(hex_digit(b), expected, "byte {b}");
        }
    }

    #[test]
    fn chunk_sizes_are_hex_of_at_most_fifteen_digits() {
        assert_eq!(chunk_size(b"0"), Ok(0));
        assert_eq!(chunk_size(b"1aF ; ext=1"), Ok(0x1af));
        assert_eq!(chunk_size(b"fffffffffffffff"), Ok((1 << 60) - 1));
        // A control character in an extension (a bare CR, where another parser may end the
        // line) is refused; tabs and spaces are whitespace.
        assert_eq!(chunk_size(b"1;a=\"b c\"\t;d"), Ok(1));
        for bad in
            [&b""[..], b"g", b"1g", b"ffffffffffffffff", b" 1", b"1 x", b"1;a\rb", b"1;\x00", b"1;a=\x7f", b"1;\x0b"]
        {
            assert_eq!(chunk_size(bad), Err(BodyError::ChunkSize), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    /// Decode `wire` fed in pieces of `step` bytes: the data, and whether it ended.
    fn decode_in_steps(framing: Framing, wire: &[u8], step: usize) -> (Vec<u8>, Result<Progress, BodyError>, usize) {
        let mut d = BodyDecoder::new(framing);
        let (mut input, mut out) = (BytesMut::new(), BytesMut::new());
        let mut last = Ok(Progress::More);
        for piece in wire.chunks(step.max(1)) {
            input.extend_from_slice(piece);
            last = d.decode(&mut input, &mut out);
            if last.is_err() {
                break;
            }
        }
        (out.to_vec(), last, input.len())
    }

    #[test]
    fn chunked_bodies_decode_the_same_however_they_are_split() {
        let wire =
            b"5\r\nhello\r\n7;ext=1\r\n, world\r\n1A \r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-trailer: 1\r\n\r\n";
        for step in 1..wire.len() + 1 {
            let (data, progress, left) = decode_in_steps(Framing::Chunked, wire, step);
            assert_eq!(data, b"hello, worldabcdefghijklmnopqrstuvwxyz", "step {step}");
            assert_eq!(progress, Ok(Progress::Ended), "step {step}");
            assert_eq!(left, 0);
        }
    }

    /// The one-pass path for a whole chunk and the step-by-step decoder agree: random bodies
    /// whose size lines take every shape (bare hex in either case, leading zeros, the 15-digit
    /// limit, whitespace and extensions the fast path leaves to the other), fed whole and in
    /// random pieces, decode to the same data and end.
    #[test]
    fn chunk_size_lines_of_every_shape_decode_alike_whole_or_split() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..2000 {
            let (mut wire, mut data) = (Vec::new(), Vec::new());
            for _ in 0..rng.random_range(0..6) {
                let chunk: Vec<u8> = (0..rng.random_range(1..300)).map(|_| rng.random_range(b' '..=b'~')).collect();
                let hex = format!("{:x}", chunk.len());
                let hex = if rng.random_bool(0.5) { hex.to_uppercase() } else { hex };
                let zeros = "0".repeat(rng.random_range(0..=15 - hex.len()));
                let tail = ["", "", " ", "\t", ";ext=1", " ; a=b"][rng.random_range(0..6)];
                wire.extend_from_slice(format!("{zeros}{hex}{tail}\r\n").as_bytes());
                wire.extend_from_slice(&chunk);
                wire.extend_from_slice(b"\r\n");
                data.extend_from_slice(&chunk);
            }
            wire.extend_from_slice(b"0\r\n\r\n");
            for step in [wire.len(), rng.random_range(1..wire.len())] {
                let (got, progress, left) = decode_in_steps(Framing::Chunked, &wire, step);
                let wire = String::from_utf8_lossy(&wire);
                assert_eq!(
                    (got.as_slice(), progress, left),
                    (&data[..], Ok(Progress::Ended), 0),
                    "step {step}: {wire:?}"
                );
            }
        }
        // Sixteen digits are refused, whichever path reads them.
        let wire = b"0000000000000001\r\nx\r\n0\r\n\r\n";
        for step in [1, wire.len()] {
            assert_eq!(decode_in_steps(Framing::Chunked, wire, step).1, Err(BodyError::ChunkSize));
        }
    }

    #[test]
    fn bytes_after_the_body_stay_in_the_input() {
        let (data, progress, left) = decode_in_steps(Framing::Chunked, b"2\r\nhi\r\n0\r\n\r\nHTTP/1.1 200", 64);
        assert_eq!((data.as_slice(), progress, left), (&b"hi"[..], Ok(Progress::Ended), 12));
        let (data, progress, left) = decode_in_steps(Framing::Length(3), b"abcdef", 64);
        assert_eq!((data.as_slice(), progress, left), (&b"abc"[..], Ok(Progress::Ended), 3));
    }

    #[test]
    fn a_whole_length_framed_body_is_split_off_and_anything_else_is_left() {
        let mut d = BodyDecoder::new(Framing::Length(5));
        let mut input = BytesMut::from(&b"hel"[..]);
        assert_eq!(d.take_whole(&mut input), None, "not all there yet");
        input.extend_from_slice(b"loGET /");
        assert_eq!(d.take_whole(&mut input).as_deref(), Some(&b"hello"[..]));
        assert!(d.is_done());
        assert_eq!(&input[..], b"GET /", "what follows the body stays");
        assert_eq!(d.take_whole(&mut input), None, "nothing after the end");
        let mut input = BytesMut::from(&b"5\r\nhello\r\n0\r\n\r\n"[..]);
        assert_eq!(BodyDecoder::new(Framing::Chunked).take_whole(&mut input), None);
        assert_eq!(BodyDecoder::new(Framing::UntilClose).take_whole(&mut input), None);
        assert_eq!(input.len(), 15);
    }

    #[test]
    fn length_and_close_framed_bodies() {
        for step in 1..8 {
            let (data, progress, _) = decode_in_steps(Framing::Length(7), b"1234567", step);
            assert_eq!((data.as_slice(), progress), (&b"1234567"[..], Ok(Progress::Ended)));
        }
        let d = BodyDecoder::new(Framing::Length(0));
        assert!(d.is_done());
        let mut d = BodyDecoder::new(Framing::UntilClose);
        let (mut input, mut out) = (BytesMut::from(&b"abc"[..]), BytesMut::new());
        assert_eq!(d.decode(&mut input, &mut out), Ok(Progress::More));
        assert_eq!(d.eof(), Ok(()));
        assert!(d.is_done());
        assert_eq!(&out[..], b"abc");
    }

    #[test]
    fn a_body_cut_short_is_an_error_at_eof() {
        let mut d = BodyDecoder::new(Framing::Length(10));
        let (mut input, mut out) = (BytesMut::from(&b"abc"[..]), BytesMut::new());
        assert_eq!(d.decode(&mut input, &mut out), Ok(Progress::More));
        assert_eq!(d.eof(), Err(BodyError::Truncated(7)));
        let mut d = BodyDecoder::new(Framing::Chunked);
        let (mut input, mut out) = (BytesMut::from(&b"5\r\nab"[..]), BytesMut::new());
        assert_eq!(d.decode(&mut input, &mut out), Ok(Progress::More));
        assert_eq!(d.eof(), Err(BodyError::TruncatedChunk));
    }

    #[test]
    fn malformed_framing_is_refused() {
        for (wire, err) in [
            (&b"zz\r\n"[..], BodyError::ChunkSize),
            (b"\r\n", BodyError::ChunkSize),
            (b"5\n", BodyError::ChunkSize),
            (b"5 x\r\n", BodyError::ChunkSize),
            (b"1234567890abcdef0\r\n", BodyError::ChunkSize),
            (b"2\r\nhiX", BodyError::ChunkEnd),
            (b"2\r\nhi\rX", BodyError::ChunkEnd),
        ] {
            let (_, progress, _) = decode_in_steps(Framing::Chunked, wire, 64);
            assert_eq!(progress, Err(err), "{:?}", String::from_utf8_lossy(wire));
        }
        let long = vec![b'1'; MAX_LINE + 1];
        assert_eq!(decode_in_steps(Framing::Chunked, &long, MAX_LINE + 1).1, Err(BodyError::LineTooLong));
        let mut trailers = b"0\r\n".to_vec();
        for _ in 0..1000 {
            trailers.extend_from_slice(b"x-filler: 0123456789\r\n");
        }
        assert_eq!(decode_in_steps(Framing::Chunked, &trailers, 4096).1, Err(BodyError::TrailersTooLong));
    }
}
