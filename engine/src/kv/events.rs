//! KV-cache events: what the prefix cache gained and lost, in vLLM's terms and encoding.
//!
//! A router that knows which blocks each engine really caches can route by the longest
//! cached prefix instead of guessing (precise prefix routing). vLLM publishes that knowledge
//! as *KV events*, one batch per scheduler step that changed the cache
//! (`vllm/distributed/kv_events.py`; the facts are in docs/design/KV-EVENTS-AND-EPP.md):
//!
//! - `BlockStored`: blocks newly registered in the prefix cache — their chained hashes, the
//!   hash of the block before the first of them (none when the first is the sequence's block
//!   0), and all their token ids, contiguous, so a consumer can compute its own keys. The
//!   parent was stored earlier but may have been evicted since (a request keeps its own copy
//!   of a block another one cached; that one can go first), as in vLLM: a consumer keeps a
//!   map from the engine's hashes to its own keys for what it has seen, not only for what is
//!   cached now;
//! - `BlockRemoved`: cached blocks evicted (reused for other tokens);
//! - `AllBlocksCleared`: the whole cache reset.
//!
//! [`KvCacheManager`](super::KvCacheManager) records them when asked to
//! ([`enable_events`](super::KvCacheManager::enable_events)); replaying a manager's events
//! into a set of hashes gives exactly the hashes its pool caches (a property test checks it).
//! [`encode_batch`] writes a batch as current vLLM does: msgpack, the batch a positional array
//! `[ts, events, data_parallel_rank]`, each event a map tagged by `"type"`, the fields without
//! a default always present (nil when unset). Pure: no clock, no I/O.

/// One change to the prefix cache. Hashes are the pool's 64-bit chained block hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks newly cached, in sequence order.
    BlockStored {
        /// Their chained hashes.
        block_hashes: Vec<u64>,
        /// The hash of the block before the first of them; `None` for a sequence's block 0.
        parent_block_hash: Option<u64>,
        /// Every token of those blocks, contiguous: `block_hashes.len() × block_size` ids.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
    },
    /// Cached blocks evicted.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
    },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

/// The storage tier of every block this engine caches (vLLM's `MEDIUM_GPU`, which the sim
/// models and which consumers filter on).
pub const MEDIUM: &str = "GPU";

/// A batch of events as vLLM's ZMQ publisher sends it (the payload frame): msgpack
/// `[ts, [event, …], data_parallel_rank]`, each event a map with `"type"` first.
pub fn encode_batch(ts: f64, events: &[KvEvent], data_parallel_rank: u32) -> Vec<u8> {
    use rmp::encode as mp;
    let mut out = Vec::with_capacity(64 + events.len() * 128);
    // Writing into a Vec cannot fail: the results are unwrapped through `ok()`.
    let _ = mp::write_array_len(&mut out, 3);
    let _ = mp::write_f64(&mut out, ts);
    let _ = mp::write_array_len(&mut out, events.len() as u32);
    for event in events {
        encode_event(&mut out, event);
    }
    let _ = mp::write_uint(&mut out, u64::from(data_parallel_rank));
    out
}

fn encode_event(out: &mut Vec<u8>, event: &KvEvent) {
    use rmp::encode as mp;
    let key = |out: &mut Vec<u8>, k: &str| {
        let _ = mp::write_str(out, k);
    };
    let hashes = |out: &mut Vec<u8>, hs: &[u64]| {
        let _ = mp::write_array_len(out, hs.len() as u32);
        for &h in hs {
            let _ = mp::write_uint(out, h);
        }
    };
    match event {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => {
            // vLLM's fields without a default, always present: type + 7.
            let _ = mp::write_map_len(out, 8);
            key(out, "type");
            key(out, "BlockStored");
            key(out, "block_hashes");
            hashes(out, block_hashes);
            key(out, "parent_block_hash");
            match parent_block_hash {
                Some(h) => {
                    let _ = mp::write_uint(out, *h);
                }
                None => {
                    let _ = mp::write_nil(out);
                }
            }
            key(out, "token_ids");
            let _ = mp::write_array_len(out, token_ids.len() as u32);
            for &t in token_ids {
                let _ = mp::write_uint(out, u64::from(t));
            }
            key(out, "block_size");
            let _ = mp::write_uint(out, u64::from(*block_size));
            key(out, "lora_id");
            let _ = mp::write_nil(out);
            key(out, "medium");
            key(out, MEDIUM);
            key(out, "lora_name");
            let _ = mp::write_nil(out);
        }
        KvEvent::BlockRemoved { block_hashes } => {
            let _ = mp::write_map_len(out, 3);
            key(out, "type");
            key(out, "BlockRemoved");
            key(out, "block_hashes");
            hashes(out, block_hashes);
            key(out, "medium");
            key(out, MEDIUM);
        }
        KvEvent::AllBlocksCleared => {
            let _ = mp::write_map_len(out, 1);
            key(out, "type");
            key(out, "AllBlocksCleared");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes msgspec writes for vLLM's structs (map layout, batch as an array), spelled
    /// out by hand from the msgpack spec.
    #[test]
    fn a_batch_is_encoded_as_vllm_encodes_it() {
        let events = [
            KvEvent::BlockStored {
                block_hashes: vec![u64::MAX - 1],
                parent_block_hash: None,
                token_ids: vec![1, 300],
                block_size: 2,
            },
            KvEvent::BlockRemoved { block_hashes: vec![7] },
            KvEvent::AllBlocksCleared,
        ];
        let got = encode_batch(1.5, &events, 0);
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93); // three events
        want.push(0x88); // BlockStored: a map of 8
        let s = |w: &mut Vec<u8>, t: &str| {
            w.push(0xa0 | t.len() as u8);
            w.extend_from_slice(t.as_bytes());
        };
        s(&mut want, "type");
        s(&mut want, "BlockStored");
        s(&mut want, "block_hashes");
        want.extend_from_slice(&[0x91, 0xcf]);
        want.extend_from_slice(&(u64::MAX - 1).to_be_bytes());
        s(&mut want, "parent_block_hash");
        want.push(0xc0);
        s(&mut want, "token_ids");
        want.extend_from_slice(&[0x92, 0x01, 0xcd, 0x01, 0x2c]);
        s(&mut want, "block_size");
        want.push(0x02);
        s(&mut want, "lora_id");
        want.push(0xc0);
        s(&mut want, "medium");
        s(&mut want, "GPU");
        s(&mut want, "lora_name");
        want.push(0xc0);
        want.push(0x83); // BlockRemoved: a map of 3
        s(&mut want, "type");
        s(&mut want, "BlockRemoved");
        s(&mut want, "block_hashes");
        want.extend_from_slice(&[0x91, 0x07]);
        s(&mut want, "medium");
        s(&mut want, "GPU");
        want.push(0x81); // AllBlocksCleared: a map of 1
        s(&mut want, "type");
        s(&mut want, "AllBlocksCleared");
        want.push(0x00); // data_parallel_rank
        assert_eq!(got, want);
    }
}
