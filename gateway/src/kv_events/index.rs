//! The precise block index: which engine holds which prompt prefix, built from the engines'
//! own KV events ([`super::wire`]). Pure: events in, matched prefix lengths out; no clock, no
//! I/O, so every gateway replica fed the same events holds the same index.
//!
//! **Keys are ours.** A block's key is a content hash of its token ids chained from its
//! parent's key ([`block_key`]), never the engine's hash: engines hash with a per-process seed
//! (`PYTHONHASHSEED`) and different algorithms, so their hashes cannot be recomputed from a
//! request. Per engine the index maps the engine's hash to our key, so `BlockRemoved` and a
//! `BlockStored`'s parent resolve; the map keeps hashes of blocks that were evicted too (a
//! later block may name one as its parent), under the same memory bound.
//!
//! **What an event does.** `BlockStored` (tier `GPU` or unset; a block size other than the
//! index's is skipped, as is an event whose token count is not hashes × block size, or whose
//! parent this engine never stored) marks each block's key held by the engine. `BlockRemoved`
//! unmarks. `AllBlocksCleared` forgets the engine. Sequence numbers: the next expected one is
//! applied; one that goes back (an engine restart) forgets the engine first; one that skips
//! ahead is a gap — [`KvIndex::apply`] says so, so the subscriber can replay the missing
//! batches, and [`KvIndex::forget_engine`] is what it does when it cannot (stale entries would
//! route wrongly; missing ones only cost a cache hit).
//!
//! **Memory** is charged per entry at what the maps really take (measured by
//! `gateway/tests/kv_index_memory.rs` with a counting allocator) and bounded: past
//! `max_bytes` the least recently stored or matched blocks go first.

// Keyed with a per-process seed, a few instructions per lookup where SipHash takes ~140: the
// keys are hashes already, and the subscriber looks up several per event.
use foldhash::HashMap;
use lru::LruCache;

use super::wire::{Event, EventBatch};

/// Our key of a block (see the module documentation).
pub type BlockKey = u64;
/// An engine's place in the index: 0..[`MAX_ENGINES`].
pub type EngineSlot = u8;
/// Engines one index tracks (a bit each per block).
pub const MAX_ENGINES: usize = 64;

/// The seed of [`block_key`]'s hash ("KV-INDEX").
const KEY_SEED: u64 = 0x4b56_2d49_4e44_4558;
/// Bytes [`block_key`] hashes in one call from the stack: the parent's key and 62 token ids
/// (blocks of up to 62 tokens; longer ones are hashed in chunks of this size).
const KEY_BUF: usize = 256;

/// Key of a block of `tokens` after the block keyed `parent` (`None`: the prompt's first):
/// xxh3 over the parent key's 8 bytes (or `root`) and the ids, each 4 bytes little-endian.
/// One hash call over a stack buffer, not one streaming update per id (~60 instructions
/// each): the subscriber keys every block an engine stores, and every request its prompt.
pub fn block_key(parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
    use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};
    let mut buf = [0u8; KEY_BUF];
    let head = match parent {
        Some(p) => {
            buf[..8].copy_from_slice(&p.to_le_bytes());
            8
        }
        None => {
            buf[..4].copy_from_slice(b"root");
            4
        }
    };
    let put = |buf: &mut [u8], ids: &[u32]| {
        for (out, t) in buf.chunks_exact_mut(4).zip(ids) {
            out.copy_from_slice(&t.to_le_bytes());
        }
    };
    if head + 4 * tokens.len() <= KEY_BUF {
        put(&mut buf[head..], tokens);
        return xxh3_64_with_seed(&buf[..head + 4 * tokens.len()], KEY_SEED);
    }
    // Streaming gives the same hash as one call over the whole input.
    let mut h = Xxh3::with_seed(KEY_SEED);
    h.update(&buf[..head]);
    for chunk in tokens.chunks(KEY_BUF / 4) {
        put(&mut buf, chunk);
        h.update(&buf[..4 * chunk.len()]);
    }
    h.digest()
}

/// The keys of every full block of a prompt's `tokens`, in order.
pub fn prompt_keys(tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    let mut keys = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = None;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let k = block_key(parent, block);
        keys.push(k);
        parent = Some(k);
    }
    keys
}

/// What [`KvIndex::apply`] did with a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The expected batch, applied.
    InOrder,
    /// The sequence went back (the engine restarted): its entries were forgotten, then the
    /// batch applied.
    Restarted,
    /// Batches `missing` never arrived; this one was not applied. Replay them and apply them
    /// in order (then this one), or [`KvIndex::forget_engine`] and apply this one.
    Gap {
        /// The sequence numbers missing.
        missing: std::ops::Range<u64>,
    },
    /// Already applied (a replay overlapping what arrived live): ignored.
    Duplicate,
}

/// Per-engine counters (for `/admin/backends` and metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Last sequence applied.
    pub last_seq: Option<u64>,
    /// Blocks it holds now.
    pub held_blocks: usize,
    /// Events skipped (unknown parent, other block size or tier, bad token count).
    pub skipped_events: u64,
    /// Times its entries were forgotten (restart, unrecoverable gap, clear).
    pub resets: u64,
}

#[derive(Debug, Default)]
struct Engine {
    /// The engine's hash → our key, for what it stored (held or since evicted).
    keys: HashMap<u64, BlockKey>,
    /// The timestamp of the last batch applied: a sequence that goes back with a later
    /// timestamp is a restart, with an earlier or equal one a replayed duplicate.
    last_ts: f64,
    stats: EngineStats,
}

/// Bytes one block key costs: its list node in the LRU (key, holders, two links: 32) and its
/// map slot (a pointer each way, plus a control byte, in a table between 7/16 and 7/8 full).
/// Checked against a counting allocator in `gateway/tests/kv_index_memory.rs`.
pub const BYTES_PER_BLOCK: usize = 64;
/// Bytes one engine-hash mapping costs (a `HashMap<u64, u64>` slot at 7/8 load).
pub const BYTES_PER_MAPPING: usize = 24;

/// The index. See the module documentation.
#[derive(Debug)]
pub struct KvIndex {
    block_size: usize,
    max_bytes: usize,
    /// Per block key: bit `s` set when engine slot `s` holds it; least recently stored or
    /// matched first (a map into a linked list: a use moves a block to the back in O(1)).
    blocks: LruCache<BlockKey, u64, foldhash::fast::RandomState>,
    engines: Vec<Option<Engine>>,
}

impl KvIndex {
    /// An empty index for engines with `block_size`-token blocks, within `max_bytes`.
    pub fn new(block_size: usize, max_bytes: usize) -> Self {
        KvIndex {
            block_size: block_size.max(1),
            max_bytes,
            blocks: LruCache::unbounded_with_hasher(foldhash::fast::RandomState::default()),
            engines: (0..MAX_ENGINES).map(|_| None).collect(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes charged now (see [`BYTES_PER_BLOCK`], [`BYTES_PER_MAPPING`]).
    pub fn charged_bytes(&self) -> usize {
        let mappings: usize = self.engines.iter().flatten().map(|e| e.keys.len()).sum();
        self.blocks.len() * BYTES_PER_BLOCK + mappings * BYTES_PER_MAPPING
    }

    /// An engine's counters (`None` when the slot was never used).
    pub fn stats(&self, slot: EngineSlot) -> Option<&EngineStats> {
        self.engines.get(slot as usize)?.as_ref().map(|e| &e.stats)
    }

    /// Apply batch `seq` from the engine in `slot`.
    pub fn apply(&mut self, slot: EngineSlot, seq: u64, batch: &EventBatch) -> Applied {
        let (last, last_ts) = {
            let e = self.engine(slot);
            (e.stats.last_seq, e.last_ts)
        };
        let outcome = match last {
            None => Applied::InOrder,
            Some(l) if seq == l + 1 => Applied::InOrder,
            Some(l) if seq > l + 1 => return Applied::Gap { missing: l + 1..seq },
            // Back to an earlier number: a restart (time moved on) or a replayed duplicate.
            Some(_) if batch.ts > last_ts => {
                self.forget_engine(slot);
                Applied::Restarted
            }
            Some(_) => return Applied::Duplicate,
        };
        for event in &batch.events {
            self.apply_event(slot, event);
        }
        let e = self.engine(slot);
        e.stats.last_seq = Some(seq);
        e.last_ts = batch.ts;
        self.enforce_bound();
        outcome
    }

    /// Forget everything the engine in `slot` holds (restart, unrecoverable gap, engine gone).
    pub fn forget_engine(&mut self, slot: EngineSlot) {
        let bit = 1u64 << slot;
        let engine = self.engine(slot);
        let keys: Vec<BlockKey> = engine.keys.drain().map(|(_, k)| k).collect();
        engine.stats.held_blocks = 0;
        engine.stats.resets += 1;
        engine.stats.last_seq = None;
        for k in keys {
            self.unhold(k, bit);
        }
    }

    /// Drop the engine in `slot` entirely (it left the cluster); the slot may be reused.
    pub fn remove_engine(&mut self, slot: EngineSlot) {
        self.forget_engine(slot);
        self.engines[slot as usize] = None;
    }

    /// How many of `keys` (a prompt's block keys, in order), from the first, the engine in
    /// `slot` holds.
    pub fn matched_blocks(&self, slot: EngineSlot, keys: &[BlockKey]) -> usize {
        let bit = 1u64 << slot;
        keys.iter().take_while(|k| self.blocks.peek(k).is_some_and(|h| h & bit != 0)).count()
    }

    /// The engine's own hashes of the blocks the index says the engine in `slot` holds (to
    /// compare with what the engine caches).
    pub fn held_engine_hashes(&self, slot: EngineSlot) -> std::collections::HashSet<u64> {
        let bit = 1u64 << slot;
        let Some(Some(engine)) = self.engines.get(slot as usize) else { return Default::default() };
        engine.keys.iter().filter(|(_, k)| self.blocks.peek(k).is_some_and(|h| h & bit != 0)).map(|(h, _)| *h).collect()
    }

    /// Count `keys` as just used (the prefix a request was routed on): they are evicted last.
    pub fn touch(&mut self, keys: &[BlockKey]) {
        for &key in keys {
            self.bump(key, 0);
        }
    }

    /// Make `key` the most recently used, adding the holders in `bits`; false when the
    /// index has no entry for it.
    fn bump(&mut self, key: BlockKey, bits: u64) -> bool {
        // `get_mut` moves the entry to the back of the order.
        let Some(holders) = self.blocks.get_mut(&key) else { return false };
        *holders |= bits;
        true
    }

    fn engine(&mut self, slot: EngineSlot) -> &mut Engine {
        self.engines[slot as usize].get_or_insert_with(Engine::default)
    }

    fn apply_event(&mut self, slot: EngineSlot, event: &Event) {
        let bit = 1u64 << slot;
        let bs = self.block_size;
        match event {
            Event::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, .. } => {
                let engine = self.engine(slot);
                let parent = match parent_block_hash {
                    None => Some(None),
                    Some(h) => engine.keys.get(h).map(|k| Some(*k)),
                };
                let usable = *block_size as usize == bs
                    && token_ids.len() == block_hashes.len() * bs
                    && medium.as_deref().is_none_or(|m| m == "GPU");
                let (true, Some(mut parent)) = (usable, parent) else {
                    engine.stats.skipped_events += 1;
                    return;
                };
                for (h, tokens) in block_hashes.iter().zip(token_ids.chunks_exact(bs)) {
                    let key = block_key(parent, tokens);
                    let newly = self.engine(slot).keys.insert(*h, key) != Some(key)
                        || self.blocks.peek(&key).is_none_or(|h| h & bit == 0);
                    if newly {
                        self.engine(slot).stats.held_blocks += 1;
                    }
                    self.hold(key, bit);
                    parent = Some(key);
                }
            }
            Event::BlockRemoved { block_hashes, medium } => {
                if medium.as_deref().is_some_and(|m| m != "GPU") {
                    return;
                }
                for h in block_hashes {
                    let Some(&key) = self.engine(slot).keys.get(h) else { continue };
                    if self.blocks.peek(&key).is_some_and(|h| h & bit != 0) {
                        self.unhold(key, bit);
                        let stats = &mut self.engine(slot).stats;
                        stats.held_blocks = stats.held_blocks.saturating_sub(1);
                    }
                }
            }
            Event::AllBlocksCleared => self.forget_engine(slot),
        }
    }

    fn hold(&mut self, key: BlockKey, bit: u64) {
        if !self.bump(key, bit) {
            self.blocks.put(key, bit);
        }
    }

    /// The engine's bit off `key` (its place in the order unchanged); a block no engine
    /// holds is dropped.
    fn unhold(&mut self, key: BlockKey, bit: u64) {
        if let Some(holders) = self.blocks.peek_mut(&key) {
            *holders &= !bit;
            if *holders == 0 {
                self.blocks.pop(&key);
            }
        }
    }

    /// Past `max_bytes`, evict the least recently used blocks down to 7/8 of it (so the
    /// engine-hash mappings of evicted blocks are purged in one pass now and then, not per
    /// block).
    fn enforce_bound(&mut self) {
        if self.charged_bytes() <= self.max_bytes {
            return;
        }
        let target = self.max_bytes / 8 * 7;
        let mut charge = self.charged_bytes();
        while charge > target {
            let Some((_, holders)) = self.blocks.pop_lru() else { break };
            // The block and (about) one mapping per engine that held it.
            charge = charge.saturating_sub(BYTES_PER_BLOCK + holders.count_ones() as usize * BYTES_PER_MAPPING);
            for slot in 0..MAX_ENGINES {
                if holders & (1 << slot) != 0 {
                    if let Some(engine) = self.engines[slot].as_mut() {
                        engine.stats.held_blocks = engine.stats.held_blocks.saturating_sub(1);
                    }
                }
            }
        }
        let blocks = &self.blocks;
        for engine in self.engines.iter_mut().flatten() {
            engine.keys.retain(|_, k| blocks.contains(k));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(events: Vec<Event>) -> EventBatch {
        EventBatch { ts: 0.0, events, data_parallel_rank: Some(0) }
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>) -> Event {
        Event::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.collect(),
            block_size: 4,
            medium: Some("GPU".into()),
            lora_name: None,
        }
    }

    fn removed(hashes: &[u64]) -> Event {
        Event::BlockRemoved { block_hashes: hashes.to_vec(), medium: Some("GPU".into()) }
    }

    const BIG: usize = 1 << 30;

    /// The definition of a block's key, one streaming update per id: what [`block_key`]
    /// computes in one call (or in chunks, past its buffer).
    fn block_key_by_definition(parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(KEY_SEED);
        match parent {
            Some(p) => h.update(&p.to_le_bytes()),
            None => h.update(b"root"),
        }
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.digest()
    }

    #[test]
    fn block_keys_are_their_definition_at_every_block_size() {
        let ids: Vec<u32> = (0..300u32).map(|i| i.wrapping_mul(2_654_435_761) ^ (i << 7)).collect();
        for len in (0..=70).chain([126, 127, 128, 129, 255, 300]) {
            for parent in [None, Some(0), Some(0x0123_4567_89ab_cdef)] {
                assert_eq!(
                    block_key(parent, &ids[..len]),
                    block_key_by_definition(parent, &ids[..len]),
                    "{len} {parent:?}"
                );
            }
        }
        assert_ne!(block_key(None, &[1, 2]), block_key(Some(0), &[1, 2]));
    }

    #[test]
    fn stored_chains_match_prompts_by_our_own_keys_whatever_the_engine_hashes() {
        let mut ix = KvIndex::new(4, BIG);
        let prompt: Vec<u32> = (0..12).collect();
        let keys = prompt_keys(&prompt, 4);
        // Engine 0 and engine 1 hash the same blocks differently (their own seeds).
        assert_eq!(ix.apply(0, 0, &batch(vec![stored(&[11, 12], None, 0..8)])), Applied::InOrder);
        assert_eq!(ix.apply(0, 1, &batch(vec![stored(&[13], Some(12), 8..12)])), Applied::InOrder);
        assert_eq!(ix.apply(1, 0, &batch(vec![stored(&[901], None, 0..4)])), Applied::InOrder);
        assert_eq!((ix.matched_blocks(0, &keys), ix.matched_blocks(1, &keys)), (3, 1));
        // A different prompt sharing the first block.
        let other = prompt_keys(&[0, 1, 2, 3, 9, 9, 9, 9], 4);
        assert_eq!(ix.matched_blocks(0, &other), 1);
        // Eviction on engine 0 of its middle block: the match stops there.
        ix.apply(0, 2, &batch(vec![removed(&[12])]));
        assert_eq!(ix.matched_blocks(0, &keys), 1);
        assert_eq!(ix.stats(0).unwrap().held_blocks, 2);
        // A child of the evicted block can still be stored (its hash is remembered).
        ix.apply(0, 3, &batch(vec![stored(&[12], Some(11), 4..8)]));
        assert_eq!(ix.matched_blocks(0, &keys), 3);
    }

    #[test]
    fn unusable_events_are_skipped_and_counted() {
        let mut ix = KvIndex::new(4, BIG);
        let events = vec![
            stored(&[1], Some(999), 0..4), // a parent never stored
            stored(&[2, 3], None, 0..4),   // 4 tokens for 2 blocks
            Event::BlockStored {
                block_hashes: vec![4],
                parent_block_hash: None,
                token_ids: (0..8).collect(),
                block_size: 8, // another block size
                medium: None,
                lora_name: None,
            },
            Event::BlockStored {
                block_hashes: vec![5],
                parent_block_hash: None,
                token_ids: (0..4).collect(),
                block_size: 4,
                medium: Some("CPU".into()), // another tier
                lora_name: None,
            },
        ];
        ix.apply(0, 0, &batch(events));
        assert_eq!(ix.stats(0).unwrap().skipped_events, 4);
        assert_eq!(ix.matched_blocks(0, &prompt_keys(&(0..8).collect::<Vec<_>>(), 4)), 0);
    }

    #[test]
    fn sequence_gaps_restarts_and_duplicates() {
        let at = |ts: f64, events: Vec<Event>| EventBatch { ts, events, data_parallel_rank: Some(0) };
        let mut ix = KvIndex::new(4, BIG);
        let keys = prompt_keys(&(0..4).collect::<Vec<_>>(), 4);
        // The first batch seen may have any number (the engine published before we came).
        assert_eq!(ix.apply(0, 5, &at(1.0, vec![stored(&[1], None, 0..4)])), Applied::InOrder);
        assert_eq!(ix.apply(0, 8, &at(4.0, vec![])), Applied::Gap { missing: 6..8 });
        assert_eq!(ix.apply(0, 6, &at(2.0, vec![])), Applied::InOrder);
        // A replay overlapping what arrived: same or earlier time.
        assert_eq!(ix.apply(0, 6, &at(2.0, vec![])), Applied::Duplicate);
        assert_eq!(ix.matched_blocks(0, &keys), 1);
        // Back to 0 later in time: the engine restarted, its old entries are gone.
        assert_eq!(ix.apply(0, 0, &at(9.0, vec![])), Applied::Restarted);
        assert_eq!(ix.matched_blocks(0, &keys), 0);
        assert_eq!(ix.stats(0).unwrap().resets, 1);
        // AllBlocksCleared forgets too; removing an engine frees its slot.
        ix.apply(0, 1, &at(10.0, vec![stored(&[1], None, 0..4), Event::AllBlocksCleared]));
        assert_eq!(ix.matched_blocks(0, &keys), 0);
        ix.apply(1, 0, &at(10.0, vec![stored(&[1], None, 0..4)]));
        ix.remove_engine(1);
        assert_eq!((ix.matched_blocks(1, &keys), ix.charged_bytes()), (0, 0));
    }

    #[test]
    fn the_memory_bound_evicts_the_least_recently_used_blocks_first() {
        // Room for about 10 blocks with their mappings.
        let mut ix = KvIndex::new(4, 10 * (BYTES_PER_BLOCK + BYTES_PER_MAPPING));
        let hot = prompt_keys(&(1000..1004).collect::<Vec<_>>(), 4);
        ix.apply(0, 0, &batch(vec![stored(&[1000], None, 1000..1004)]));
        for i in 1..100u32 {
            ix.apply(0, u64::from(i), &batch(vec![stored(&[u64::from(i)], None, i * 4..i * 4 + 4)]));
            // The hot prefix is matched between arrivals: it stays.
            assert_eq!(ix.matched_blocks(0, &hot), 1, "after {i} other blocks");
            ix.touch(&hot);
            assert!(ix.charged_bytes() <= 10 * (BYTES_PER_BLOCK + BYTES_PER_MAPPING));
        }
        let oldest = prompt_keys(&(4..8).collect::<Vec<_>>(), 4);
        assert_eq!(ix.matched_blocks(0, &oldest), 0, "the least recently used went first");
        let newest = prompt_keys(&(396..400).collect::<Vec<_>>(), 4);
        assert_eq!(ix.matched_blocks(0, &newest), 1);
    }

    /// Two replicas fed the same batches agree on every match (no per-replica state).
    #[test]
    fn replicas_fed_the_same_events_agree() {
        let feed = |ix: &mut KvIndex| {
            // Chains of five blocks over consecutive tokens, spread over three engines.
            for i in 0..50u32 {
                let parent = (i % 5 != 0).then(|| u64::from(i - 1));
                let event = stored(&[u64::from(i)], parent, i * 4..i * 4 + 4);
                ix.apply((i % 3) as u8, u64::from(i / 3), &batch(vec![event]));
            }
        };
        let (mut a, mut b) = (KvIndex::new(4, 4096), KvIndex::new(4, 4096));
        feed(&mut a);
        feed(&mut b);
        for p in 0..60u32 {
            let keys = prompt_keys(&(p * 4..p * 4 + 12).collect::<Vec<_>>(), 4);
            for slot in 0..3 {
                assert_eq!(a.matched_blocks(slot, &keys), b.matched_blocks(slot, &keys));
            }
        }
    }
}
