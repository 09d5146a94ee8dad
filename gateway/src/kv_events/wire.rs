//! Decoding vLLM's KV-event batches (the third frame of its ZMQ messages), whatever vLLM
//! version sent them. Pure: bytes in, a batch or an error out.
//!
//! What arrives (docs/design/KV-EVENTS-AND-EPP.md, A1; fixtures generated with msgspec and
//! vLLM's struct definitions in `gateway/tests/fixtures/kv_events/`):
//!
//! - the batch: a positional array `[ts, events, data_parallel_rank]` (vLLM 0.9: `[ts,
//!   events]`), or a map with those keys;
//! - each event: a map tagged by `"type"` (current vLLM) or a positional array with the tag
//!   first (older vLLM, every field present, nil when unset; vLLM 0.9 had fewer fields);
//! - block hashes: a msgpack uint64 (values above `i64::MAX` occur), an int64, or a 32-byte
//!   digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). All become the `u64` vLLM itself sends
//!   by default: the same 64 bits for an integer, the last 8 bytes big-endian for a digest.
//!
//! Unknown fields, extra trailing array elements and unknown event types are ignored (a later
//! vLLM may add them); a malformed known event makes the whole batch an error, so a consumer
//! never applies half a batch.

/// Payloads larger than this are refused before decoding (a batch is one scheduler step:
/// kilobytes).
pub const MAX_PAYLOAD_BYTES: usize = 4 * 1024 * 1024;
/// Deepest nesting accepted (a batch is 4 levels deep; extra keys a few more).
const MAX_DEPTH: usize = 16;
// The batch, its event list, an event and a list in it are walked by structure, each a level.
const _: () = assert!(MAX_DEPTH > 4);

/// One scheduler step's events.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// When the engine published it (Unix seconds).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<Event>,
    /// The data-parallel rank that sent it, when the batch says.
    pub data_parallel_rank: Option<i64>,
}

/// One event, as far as routing needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Blocks newly cached.
    BlockStored {
        /// Their hashes, in sequence order.
        block_hashes: Vec<u64>,
        /// The hash of the block before the first; `None` for a sequence's block 0.
        parent_block_hash: Option<u64>,
        /// Every token of those blocks, contiguous.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Storage tier (`"GPU"`, `"CPU"`, …) when sent.
        medium: Option<String>,
        /// The LoRA adapter the blocks belong to, when sent.
        lora_name: Option<String>,
    },
    /// Cached blocks evicted.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
        /// Storage tier, when sent.
        medium: Option<String>,
    },
    /// The engine's whole prefix cache was reset.
    AllBlocksCleared,
}

/// Why a payload is not a batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not msgpack, or nested too deep.
    #[error("not a msgpack value: {0}")]
    Msgpack(String),
    /// Larger than [`MAX_PAYLOAD_BYTES`].
    #[error("payload of {0} bytes is larger than the limit")]
    TooLarge(usize),
    /// Msgpack, but not the shape of an event batch.
    #[error("not a KV event batch: {0}")]
    Shape(String),
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// Decode one payload (its first msgpack value; bytes after it are ignored).
///
/// Read once, in place: the containers of the batch, its event list and each event are
/// walked by structure, and every other value is checked whole as it is passed (well-formed,
/// nested at most [`MAX_DEPTH`] deep counting from the batch) — so a payload that is not
/// msgpack anywhere is a [`DecodeError::Msgpack`], as if checked first, and no value is
/// walked twice. The fields routing needs are decoded from their bytes, everything else is
/// skipped, no document tree is built (a tree of `rmpv::Value`s cost 12k instructions per
/// proxied request with `kv_events` on, a check-then-read of the same bytes 8k:
/// `loadtest/bench/profile_gateway.sh`).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut c = Cursor::new(payload);
    // The depth left for the batch's own values: the batch is one level.
    let d = MAX_DEPTH - 1;
    // Each field's value as it was read; the events already decoded, or why they are not.
    let mut ts: Option<&[u8]> = None;
    let mut events: Option<Result<Vec<Event>, DecodeError>> = None;
    let mut rank: Option<&[u8]> = None;
    if let Some(n) = c.array_len() {
        for i in 0..n {
            match i {
                0 => ts = Some(c.checked(d)?),
                1 => events = Some(decode_events(&mut c, d)?),
                2 => rank = Some(c.checked(d)?),
                _ => {
                    c.checked(d)?;
                }
            }
        }
    } else if let Some(n) = c.map_len() {
        for _ in 0..n {
            match str_bytes(c.checked(d)?) {
                Some(b"ts") if ts.is_none() => ts = Some(c.checked(d)?),
                Some(b"events") if events.is_none() => events = Some(decode_events(&mut c, d)?),
                Some(b"data_parallel_rank") if rank.is_none() => rank = Some(c.checked(d)?),
                _ => {
                    c.checked(d)?;
                }
            }
        }
    } else {
        // Msgpack first: a payload that is not msgpack says so.
        c.checked(MAX_DEPTH)?;
        return Err(shape("the batch is neither an array nor a map"));
    }
    let ts = ts.and_then(number).ok_or_else(|| shape("no timestamp"))?;
    let events = events.ok_or_else(|| shape("no event list"))??;
    let data_parallel_rank = match rank {
        None => None,
        Some(v) if is_nil(v) => None,
        Some(v) => Some(as_i64(v).ok_or_else(|| shape("data_parallel_rank is not an integer"))?),
    };
    Ok(EventBatch { ts, events, data_parallel_rank })
}

/// The event list at `c` (consumed), a value with `depth` levels left: the known events, or
/// why the list is not one.
fn decode_events(c: &mut Cursor<'_>, depth: usize) -> Result<Result<Vec<Event>, DecodeError>, DecodeError> {
    let Some(n) = c.array_len() else {
        c.checked(depth)?;
        return Ok(Err(shape("no event list")));
    };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        match decode_event(c, depth - 1)? {
            Ok(Some(event)) => out.push(event),
            Ok(None) => {}
            Err(err) => {
                // The rest of the list is read past: a later error names its own event.
                for _ in i + 1..n {
                    c.checked(depth - 1)?;
                }
                return Ok(Err(shape(format!("event {i}: {err}"))));
            }
        }
    }
    Ok(Ok(out))
}

/// Field positions of the array layout, after the tag (vLLM's declaration order).
const STORED_FIELDS: [&[u8]; 7] =
    [b"block_hashes", b"parent_block_hash", b"token_ids", b"block_size", b"lora_id", b"medium", b"lora_name"];
const REMOVED_FIELDS: [&[u8]; 2] = [b"block_hashes", b"medium"];

/// An event's fields as read (the first of a key given twice, as a lookup in a decoded map
/// would find): lists decoded on the way, since the tag that says whether they matter may
/// come last; their errors count only for an event that needs them.
#[derive(Default)]
struct Fields<'a> {
    tag: Option<&'a [u8]>,
    block_hashes: Option<Result<Vec<u64>, String>>,
    parent_block_hash: Option<&'a [u8]>,
    token_ids: Option<Result<Vec<u32>, &'static str>>,
    block_size: Option<&'a [u8]>,
    medium: Option<&'a [u8]>,
    lora_name: Option<&'a [u8]>,
}

impl<'a> Fields<'a> {
    /// Read the value of field `name` (its bytes: a key that is not UTF-8 names no field) at
    /// `c` (consumed), a value with `depth` levels left.
    fn read(&mut self, name: &[u8], c: &mut Cursor<'a>, depth: usize) -> Result<(), DecodeError> {
        match name {
            b"block_hashes" if self.block_hashes.is_none() => {
                self.block_hashes = Some(read_list(c, depth, hash, || NO_HASHES.to_string())?);
            }
            b"token_ids" if self.token_ids.is_none() => {
                let token = |v: &[u8]| as_u64(v).and_then(|t| u32::try_from(t).ok()).ok_or("a token id is not a u32");
                self.token_ids = Some(read_list(c, depth, token, || NO_TOKENS)?);
            }
            _ => {
                let v = c.checked(depth)?;
                let slot = match name {
                    b"type" => &mut self.tag,
                    b"parent_block_hash" => &mut self.parent_block_hash,
                    b"block_size" => &mut self.block_size,
                    b"medium" => &mut self.medium,
                    b"lora_name" => &mut self.lora_name,
                    _ => return Ok(()),
                };
                slot.get_or_insert(v);
            }
        }
        Ok(())
    }
}

/// What an event without a usable list says.
const NO_HASHES: &str = "no block_hashes";
const NO_TOKENS: &str = "BlockStored without token_ids";

/// The list at `c` (consumed), a value with `depth` levels left, each item through `item`
/// (the first error kept); `not_a_list()` when it is not one.
fn read_list<T, E>(
    c: &mut Cursor<'_>,
    depth: usize,
    item: impl Fn(&[u8]) -> Result<T, E>,
    not_a_list: impl FnOnce() -> E,
) -> Result<Result<Vec<T>, E>, DecodeError> {
    let Some(n) = c.array_len() else {
        c.checked(depth)?;
        return Ok(Err(not_a_list()));
    };
    let mut out = Vec::with_capacity(n);
    let mut failed = None;
    for _ in 0..n {
        let v = c.checked(depth - 1)?;
        if failed.is_none() {
            match item(v) {
                Ok(t) => out.push(t),
                Err(e) => failed = Some(e),
            }
        }
    }
    Ok(failed.map_or(Ok(out), Err))
}

/// The event at `c` (consumed), a value with `depth` levels left; `Ok(None)` for a type
/// this gateway does not know.
fn decode_event(c: &mut Cursor<'_>, depth: usize) -> Result<Result<Option<Event>, String>, DecodeError> {
    let mut f = Fields::default();
    let d = depth - 1;
    let tag = if let Some(n) = c.map_len() {
        for _ in 0..n {
            let key = c.checked(d)?;
            match str_bytes(key) {
                Some(name) => f.read(name, c, d)?,
                None => {
                    c.checked(d)?;
                }
            }
        }
        match f.tag.and_then(as_str) {
            Some(tag) => tag,
            None => return Ok(Err("a map event without a \"type\"".into())),
        }
    } else if let Some(n) = c.array_len() {
        let tag = if n > 0 { as_str(c.checked(d)?) } else { None };
        let names: &[&[u8]] = match tag {
            Some("BlockStored") => &STORED_FIELDS,
            Some("BlockRemoved") => &REMOVED_FIELDS,
            _ => &[],
        };
        for i in 1..n {
            match names.get(i - 1) {
                Some(name) => f.read(name, c, d)?,
                None => {
                    c.checked(d)?;
                }
            }
        }
        match tag {
            Some(tag) => tag,
            None => return Ok(Err("an array event without a tag".into())),
        }
    } else {
        c.checked(depth)?;
        return Ok(Err("an event is neither a map nor an array".into()));
    };
    Ok(event_of(tag, f))
}

fn event_of(tag: &str, f: Fields<'_>) -> Result<Option<Event>, String> {
    let text = |v: Option<&[u8]>| v.and_then(as_str).map(str::to_string);
    let hashes = |h: Option<Result<Vec<u64>, String>>| h.unwrap_or_else(|| Err(NO_HASHES.to_string()));
    match tag {
        "BlockStored" => {
            let block_hashes = hashes(f.block_hashes)?;
            let parent_block_hash = match f.parent_block_hash {
                None => None,
                Some(v) if is_nil(v) => None,
                Some(v) => Some(hash(v)?),
            };
            let token_ids = f.token_ids.unwrap_or(Err(NO_TOKENS))?;
            let block_size = f
                .block_size
                .and_then(as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or("BlockStored without a block_size")?;
            Ok(Some(Event::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium: text(f.medium),
                lora_name: text(f.lora_name),
            }))
        }
        "BlockRemoved" => {
            Ok(Some(Event::BlockRemoved { block_hashes: hashes(f.block_hashes)?, medium: text(f.medium) }))
        }
        "AllBlocksCleared" => Ok(Some(Event::AllBlocksCleared)),
        _ => Ok(None),
    }
}

/// A block hash as the `u64` vLLM sends by default (see the module documentation).
fn hash(v: &[u8]) -> Result<u64, String> {
    if let Some(i) = int(v) {
        return Ok(match i {
            Int::Unsigned(u) => u,
            Int::Negative(n) => n as u64,
        });
    }
    match bin(v) {
        Some(b) if b.len() >= 8 => Ok(u64::from_be_bytes(b[b.len() - 8..].try_into().expect("eight bytes"))),
        _ => Err("a block hash is neither an integer nor a digest of at least 8 bytes".into()),
    }
}

// Msgpack, read in place. `Cursor::value` checks a whole value; the readers below take the
// bytes of one checked value and say what it is (`None` when it is another type).

/// Reads msgpack values from a byte slice.
#[derive(Clone)]
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, at: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or("truncated")?;
        let bytes = &self.buf[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    fn byte(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    /// A big-endian length of `n` bytes.
    fn len(&mut self, n: usize) -> Result<usize, String> {
        let b = self.take(n)?;
        let v = b.iter().fold(0u64, |v, &b| (v << 8) | u64::from(b));
        usize::try_from(v).map_err(|_| "a length beyond memory".to_string())
    }

    /// The bytes of the next value, checked whole: well-formed, nested at most `depth` deep.
    fn value(&mut self, depth: usize) -> Result<&'a [u8], String> {
        let start = self.at;
        let marker = self.byte()?;
        let (skip, items) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * usize::from(marker & 0x0f)),
            0x90..=0x9f => (0, usize::from(marker & 0x0f)),
            0xa0..=0xbf => (usize::from(marker & 0x1f), 0),
            0xc1 => return Err("reserved marker 0xc1".into()),
            0xc4 | 0xd9 => (self.len(1)?, 0),
            0xc5 | 0xda => (self.len(2)?, 0),
            0xc6 | 0xdb => (self.len(4)?, 0),
            0xc7 => (self.len(1)? + 1, 0),
            0xc8 => (self.len(2)? + 1, 0),
            0xc9 => (self.len(4)? + 1, 0),
            0xca | 0xce | 0xd2 => (4, 0),
            0xcb | 0xcf | 0xd3 => (8, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (0, self.len(2)?),
            0xdd => (0, self.len(4)?),
            0xde => (0, 2 * self.len(2)?),
            0xdf => (0, self.len(4)?.checked_mul(2).ok_or("a map beyond memory")?),
        };
        self.take(skip)?;
        if items > 0 {
            if depth == 0 {
                return Err(format!("nested deeper than {MAX_DEPTH}"));
            }
            for _ in 0..items {
                self.value(depth - 1)?;
            }
        }
        Ok(&self.buf[start..self.at])
    }

    /// The bytes of the next value, checked whole with `depth` levels of nesting left.
    fn checked(&mut self, depth: usize) -> Result<&'a [u8], DecodeError> {
        self.value(depth).map_err(DecodeError::Msgpack)
    }

    /// The item count of the array at the cursor, its header consumed; `None` (nothing
    /// consumed) for another type.
    fn array_len(&mut self) -> Option<usize> {
        self.header(0x90, 0xdc, 0xdd)
    }

    /// The entry count of the map at the cursor, like [`Self::array_len`].
    fn map_len(&mut self) -> Option<usize> {
        self.header(0x80, 0xde, 0xdf)
    }

    fn header(&mut self, fix: u8, n16: u8, n32: u8) -> Option<usize> {
        let mut c = self.clone();
        let n = match c.byte().ok()? {
            m if m & 0xf0 == fix => usize::from(m & 0x0f),
            m if m == n16 => c.len(2).ok()?,
            m if m == n32 => c.len(4).ok()?,
            _ => return None,
        };
        *self = c;
        Some(n)
    }
}

fn is_nil(v: &[u8]) -> bool {
    v.first() == Some(&0xc0)
}

/// A msgpack integer: non-negative ones (whichever marker carried them) as `Unsigned`.
enum Int {
    Unsigned(u64),
    Negative(i64),
}

fn int(v: &[u8]) -> Option<Int> {
    let (&marker, rest) = v.split_first()?;
    let be = |n: usize| rest.get(..n).map(|b| b.iter().fold(0u64, |v, &b| (v << 8) | u64::from(b)));
    let signed = |i: i64| if i >= 0 { Int::Unsigned(i as u64) } else { Int::Negative(i) };
    Some(match marker {
        0x00..=0x7f => Int::Unsigned(u64::from(marker)),
        0xe0..=0xff => Int::Negative(i64::from(marker as i8)),
        0xcc => Int::Unsigned(be(1)?),
        0xcd => Int::Unsigned(be(2)?),
        0xce => Int::Unsigned(be(4)?),
        0xcf => Int::Unsigned(be(8)?),
        0xd0 => signed(i64::from(be(1)? as u8 as i8)),
        0xd1 => signed(i64::from(be(2)? as u16 as i16)),
        0xd2 => signed(i64::from(be(4)? as u32 as i32)),
        0xd3 => signed(be(8)? as i64),
        _ => return None,
    })
}

fn as_u64(v: &[u8]) -> Option<u64> {
    match int(v)? {
        Int::Unsigned(u) => Some(u),
        Int::Negative(_) => None,
    }
}

fn as_i64(v: &[u8]) -> Option<i64> {
    match int(v)? {
        Int::Unsigned(u) => i64::try_from(u).ok(),
        Int::Negative(i) => Some(i),
    }
}

/// A float, or an integer as one.
fn number(v: &[u8]) -> Option<f64> {
    match v.split_first()? {
        (0xca, b) => Some(f64::from(f32::from_be_bytes(b.get(..4)?.try_into().ok()?))),
        (0xcb, b) => Some(f64::from_be_bytes(b.get(..8)?.try_into().ok()?)),
        _ => match int(v)? {
            Int::Unsigned(u) => Some(u as f64),
            Int::Negative(i) => Some(i as f64),
        },
    }
}

/// A string's or a binary's bytes (both: the length header, then the bytes).
fn payload(v: &[u8], fix: Option<(u8, u8)>, m8: u8, m16: u8, m32: u8) -> Option<&[u8]> {
    let mut c = Cursor::new(v);
    let marker = c.byte().ok()?;
    let n = match (marker, fix) {
        (m, Some((lo, hi))) if (lo..=hi).contains(&m) => usize::from(m & 0x1f),
        (m, _) if m == m8 => c.len(1).ok()?,
        (m, _) if m == m16 => c.len(2).ok()?,
        (m, _) if m == m32 => c.len(4).ok()?,
        _ => return None,
    };
    c.take(n).ok()
}

/// A string's bytes, unchecked: enough to compare with a known key.
fn str_bytes(v: &[u8]) -> Option<&[u8]> {
    payload(v, Some((0xa0, 0xbf)), 0xd9, 0xda, 0xdb)
}

/// A string, when it is valid UTF-8.
fn as_str(v: &[u8]) -> Option<&str> {
    std::str::from_utf8(str_bytes(v)?).ok()
}

fn bin(v: &[u8]) -> Option<&[u8]> {
    payload(v, None, 0xc4, 0xc5, 0xc6)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    /// Every payload the generator wrote (msgspec, vLLM's struct definitions, each layout and
    /// hash encoding) decodes to what expected.json says.
    #[test]
    fn payloads_from_every_vllm_layout_decode_alike() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kv_events");
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/expected.json")).unwrap()).unwrap();
        let expected = expected.as_object().unwrap();
        assert!(expected.len() >= 11, "the generator's payloads are all there");
        for (name, want) in expected {
            let got = decode_batch(&std::fs::read(format!("{dir}/{name}")).unwrap())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(got.ts, want["ts"].as_f64().unwrap(), "{name}");
            assert_eq!(got.data_parallel_rank, want["data_parallel_rank"].as_i64(), "{name}");
            let events: Vec<serde_json::Value> = got.events.iter().map(as_json).collect();
            assert_eq!(&serde_json::Value::from(events), &want["events"], "{name}");
        }
    }

    fn as_json(e: &Event) -> serde_json::Value {
        match e {
            Event::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, .. } => serde_json::json!({
                "type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent_block_hash,
                "token_ids": token_ids, "block_size": block_size,
            }),
            Event::BlockRemoved { block_hashes, .. } => {
                serde_json::json!({"type": "BlockRemoved", "block_hashes": block_hashes})
            }
            Event::AllBlocksCleared => serde_json::json!({"type": "AllBlocksCleared"}),
        }
    }

    #[test]
    fn what_is_not_a_batch_is_an_error_and_unknown_types_are_skipped() {
        let encode = |v: &Value| {
            let mut out = Vec::new();
            rmpv::encode::write_value(&mut out, v).unwrap();
            out
        };
        let batch = |events: Vec<Value>| Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::from(0)]);
        let unknown = Value::Map(vec![(Value::from("type"), Value::from("BlockOffloaded"))]);
        assert_eq!(decode_batch(&encode(&batch(vec![unknown]))).unwrap().events, vec![]);
        let bad_hash = Value::Map(vec![
            (Value::from("type"), Value::from("BlockRemoved")),
            (Value::from("block_hashes"), Value::Array(vec![Value::from("abc")])),
        ]);
        assert!(matches!(decode_batch(&encode(&batch(vec![bad_hash]))), Err(DecodeError::Shape(_))));
        assert!(matches!(decode_batch(b"\x93\x01"), Err(DecodeError::Msgpack(_))), "truncated");
        assert!(matches!(decode_batch(&encode(&Value::from(3))), Err(DecodeError::Shape(_))));
        // Nesting past the depth limit is refused, not recursed into.
        let mut deep = vec![0x91u8; 10_000];
        deep.push(0xc0);
        assert!(matches!(decode_batch(&deep), Err(DecodeError::Msgpack(_))));
        assert!(matches!(decode_batch(&vec![0; MAX_PAYLOAD_BYTES + 1]), Err(DecodeError::TooLarge(_))));
    }

    /// Every msgpack width of the same values decodes alike: integers in signed markers,
    /// negative hashes as their bits, 16/32-bit container headers, str8 tags; a key given
    /// twice counts its first value; bytes after the batch are ignored; a tag that is not
    /// UTF-8 is an error.
    #[test]
    fn every_msgpack_width_decodes_alike() {
        // A batch [1, [event], nil] whose event map (5 entries, "type" spliced in last) has
        // `block_size` twice.
        let stored = |block_size: &[u8], hash: &[u8]| {
            let mut p = vec![0x93, 0x01, 0xdc, 0x00, 0x01, 0xdf, 0, 0, 0, 5];
            for (k, v) in [
                (&b"block_hashes"[..], [&[0x91u8][..], hash].concat()),
                (b"token_ids", vec![0x92, 0xd0, 0x05, 0xcd, 0x01, 0x00]),
                (b"block_size", block_size.to_vec()),
                (b"block_size", vec![0x07]),
            ] {
                p.push(0xa0 | k.len() as u8);
                p.extend_from_slice(k);
                p.extend_from_slice(&v);
            }
            p.extend_from_slice(&[0xc0, 0xff, 0xff]); // data_parallel_rank nil, then trailing bytes
            p
        };
        let tag = [&[0xd9, 11][..], b"BlockStored"].concat();
        let want = Event::BlockStored {
            block_hashes: vec![u64::MAX],
            parent_block_hash: None,
            token_ids: vec![5, 256],
            block_size: 2,
            medium: None,
            lora_name: None,
        };
        for (size, hash) in [
            (&[0x02u8][..], &[0xffu8][..]),
            (&[0xd2, 0, 0, 0, 2], &[0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
        ] {
            let with_tag_last = {
                let mut q = stored(size, hash);
                let end = q.len() - 3;
                q.splice(end..end, [&[0xa4][..], b"type", &tag].concat());
                q
            };
            let batch = decode_batch(&with_tag_last).unwrap();
            assert_eq!((batch.ts, batch.data_parallel_rank), (1.0, None));
            assert_eq!(batch.events, vec![want.clone()]);
        }
        let bad_tag = {
            let mut q = stored(&[0x02], &[0x01]);
            let end = q.len() - 3;
            q.splice(end..end, [&[0xa4][..], b"type", &[0xa2, 0xff, 0xfe]].concat());
            q
        };
        assert!(matches!(decode_batch(&bad_tag), Err(DecodeError::Shape(_))));
    }

    /// The engine's own encoder (what `switchyard-engine --kv-events-config` sends) decodes.
    #[test]
    fn a_switchyard_engine_batch_decodes() {
        // `encode_batch` of one BlockStored and one BlockRemoved, bytes from the engine's test.
        let mut payload = vec![0x93, 0xcb];
        payload.extend_from_slice(&2.0f64.to_be_bytes());
        payload.push(0x91);
        payload.push(0x83);
        for s in ["type", "BlockRemoved", "block_hashes"] {
            payload.push(0xa0 | s.len() as u8);
            payload.extend_from_slice(s.as_bytes());
        }
        payload.extend_from_slice(&[0x91, 0x07]);
        for s in ["medium", "GPU"] {
            payload.push(0xa0 | s.len() as u8);
            payload.extend_from_slice(s.as_bytes());
        }
        payload.push(0x00);
        let got = decode_batch(&payload).unwrap();
        assert_eq!(got.events, vec![Event::BlockRemoved { block_hashes: vec![7], medium: Some("GPU".into()) }]);
    }

    /// Read in one walk, a payload is a msgpack error exactly when checking it whole first
    /// (at most [`MAX_DEPTH`] deep) fails, and otherwise decodes as it did after that check:
    /// over the fixtures cut, spliced and with bytes changed, and with an unknown field nested
    /// up to and past the limit.
    #[test]
    fn one_walk_refuses_what_a_whole_check_refuses() {
        use rand::{Rng, SeedableRng};
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kv_events");
        let fixtures: Vec<Vec<u8>> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "msgpack"))
            .map(|p| std::fs::read(p).unwrap())
            .collect();
        let agree = |p: &[u8]| {
            let whole = Cursor::new(p).value(MAX_DEPTH);
            let got = decode_batch(p);
            match whole {
                Err(_) => assert!(matches!(got, Err(DecodeError::Msgpack(_))), "{p:02x?}: {got:?}"),
                Ok(_) => assert!(!matches!(got, Err(DecodeError::Msgpack(_))), "{p:02x?}: {got:?}"),
            }
            got.is_ok()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (mut ok, mut refused) = (0, 0);
        for _ in 0..20_000 {
            let mut p = fixtures[rng.random_range(0..fixtures.len())].clone();
            match rng.random_range(0..3) {
                0 => p.truncate(rng.random_range(0..p.len())),
                1 => {
                    let at = rng.random_range(0..p.len());
                    p[at] = rng.random();
                }
                _ => {
                    let other = &fixtures[rng.random_range(0..fixtures.len())];
                    let at = rng.random_range(0..p.len());
                    p.splice(at.., other[rng.random_range(0..other.len())..].iter().copied());
                }
            }
            if agree(&p) {
                ok += 1;
            } else {
                refused += 1;
            }
        }
        assert!(ok > 1_000 && refused > 1_000, "{ok} decoded, {refused} refused");
        // [ts, [ {type: BlockRemoved, block_hashes: [1], x: [[…nil…]]} ], 0] with `x` k deep:
        // the batch, its list and the event take 3 levels of the 16.
        for k in 10..=16 {
            let mut p = vec![0x93, 0x01, 0x91, 0x83];
            for (key, v) in [(&b"type"[..], &b"\xacBlockRemoved"[..]), (b"block_hashes", b"\x91\x01")] {
                p.push(0xa0 | key.len() as u8);
                p.extend_from_slice(key);
                p.extend_from_slice(v);
            }
            p.extend_from_slice(b"\xa1x");
            p.extend(std::iter::repeat_n(0x91, k));
            p.extend_from_slice(&[0xc0, 0x00]);
            assert_eq!(agree(&p), k <= 13, "nested {k} deep");
        }
    }
}
