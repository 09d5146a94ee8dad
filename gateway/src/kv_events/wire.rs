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

use rmpv::Value;

/// Payloads larger than this are refused before decoding (a batch is one scheduler step:
/// kilobytes; a decoded value costs ~32 bytes per msgpack byte at worst).
pub const MAX_PAYLOAD_BYTES: usize = 4 * 1024 * 1024;
/// Deepest nesting accepted (a batch is 4 levels deep; extra keys a few more).
const MAX_DEPTH: usize = 16;

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

/// Decode one payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut rd = payload;
    let value =
        rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (field(&value, "ts"), field(&value, "events"), field(&value, "data_parallel_rank")),
        _ => return Err(shape("the batch is neither an array nor a map")),
    };
    let ts = ts.and_then(number).ok_or_else(|| shape("no timestamp"))?;
    let events = events.and_then(Value::as_array).ok_or_else(|| shape("no event list"))?;
    let data_parallel_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| shape("data_parallel_rank is not an integer"))?),
    };
    let mut out = Vec::with_capacity(events.len());
    for (i, e) in events.iter().enumerate() {
        if let Some(event) = decode_event(e).map_err(|err| shape(format!("event {i}: {err}")))? {
            out.push(event);
        }
    }
    Ok(EventBatch { ts, events: out, data_parallel_rank })
}

/// A map's value for `key`.
fn field<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    map.as_map()?.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
}

fn number(v: &Value) -> Option<f64> {
    v.as_f64().or_else(|| v.as_i64().map(|i| i as f64)).or_else(|| v.as_u64().map(|u| u as f64))
}

/// Field positions of the array layout, after the tag (vLLM's declaration order).
const STORED_FIELDS: [&str; 7] =
    ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"];
const REMOVED_FIELDS: [&str; 2] = ["block_hashes", "medium"];

/// An event's fields, by name, in either layout.
enum Fields<'a> {
    Map(&'a Value),
    /// The items after the tag, and their names in vLLM's declaration order.
    Array(&'a [Value], &'static [&'static str]),
}

impl<'a> Fields<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        match self {
            Fields::Map(map) => field(map, key),
            Fields::Array(items, names) => names.iter().position(|n| *n == key).and_then(|i| items.get(i)),
        }
    }
}

/// One event; `None` for a type this gateway does not know.
fn decode_event(e: &Value) -> Result<Option<Event>, String> {
    let (tag, fields) = match e {
        Value::Map(_) => {
            let tag = field(e, "type").and_then(Value::as_str).ok_or("a map event without a \"type\"")?;
            (tag, Fields::Map(e))
        }
        Value::Array(items) => {
            let tag = items.first().and_then(Value::as_str).ok_or("an array event without a tag")?;
            let names: &'static [&'static str] = match tag {
                "BlockStored" => &STORED_FIELDS,
                "BlockRemoved" => &REMOVED_FIELDS,
                _ => &[],
            };
            (tag, Fields::Array(&items[1..], names))
        }
        _ => return Err("an event is neither a map nor an array".into()),
    };
    let get = |k: &str| fields.get(k);
    let text = |k: &str| get(k).and_then(Value::as_str).map(str::to_string);
    match tag {
        "BlockStored" => {
            let block_hashes = hash_list(get("block_hashes"))?;
            let parent_block_hash = match get("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(v) => Some(hash(v)?),
            };
            let token_ids = get("token_ids")
                .and_then(Value::as_array)
                .ok_or("BlockStored without token_ids")?
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or("a token id is not a u32"))
                .collect::<Result<Vec<_>, _>>()?;
            let block_size = get("block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or("BlockStored without a block_size")?;
            Ok(Some(Event::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium: text("medium"),
                lora_name: text("lora_name"),
            }))
        }
        "BlockRemoved" => {
            Ok(Some(Event::BlockRemoved { block_hashes: hash_list(get("block_hashes"))?, medium: text("medium") }))
        }
        "AllBlocksCleared" => Ok(Some(Event::AllBlocksCleared)),
        _ => Ok(None),
    }
}

fn hash_list(v: Option<&Value>) -> Result<Vec<u64>, String> {
    v.and_then(Value::as_array).ok_or("no block_hashes")?.iter().map(hash).collect()
}

/// A block hash as the `u64` vLLM sends by default (see the module documentation).
fn hash(v: &Value) -> Result<u64, String> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)).ok_or_else(|| "a bad hash".into()),
        Value::Binary(b) if b.len() >= 8 => Ok(u64::from_be_bytes(b[b.len() - 8..].try_into().expect("eight bytes"))),
        _ => Err("a block hash is neither an integer nor a digest of at least 8 bytes".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
