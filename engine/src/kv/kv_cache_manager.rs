//! The KV cache manager: what the scheduler asks of the KV cache, per request (vLLM V1's
//! `KVCacheManager`).
//!
//! The scheduler speaks in requests and token counts; the manager turns that into blocks of
//! the [`BlockPool`] — reference counts, the free queue and hash chaining stay behind it:
//!
//! - [`get_computed_blocks`](KvCacheManager::get_computed_blocks): the longest cached prefix
//!   of a waiting request's tokens, in whole blocks and never including its last token (a
//!   step must compute at least one token, so that there are logits to sample). Takes no
//!   reference yet.
//! - [`allocate_slots`](KvCacheManager::allocate_slots): grow a request's block table to hold
//!   `num_tokens` tokens — first the prefix hits found above (their reference counts go up),
//!   then fresh blocks. All or nothing: when the pool cannot supply the fresh blocks nothing
//!   changes and the scheduler preempts. A hit that is itself free (cached, nobody holds it)
//!   cannot also serve as a fresh block, so it counts against the free blocks.
//! - [`cache_full_blocks`](KvCacheManager::cache_full_blocks): once tokens are computed, hash
//!   the request's newly full blocks as `hash(parent_hash, block_tokens)` and register them, so
//!   later requests can hit them.
//! - [`free`](KvCacheManager::free): release a request's blocks (finished, aborted or
//!   preempted) in reverse order, so its tail is evicted first. Its block hashes are kept until
//!   [`free_block_hashes`](KvCacheManager::free_block_hashes), so a preempted request does not
//!   hash its prompt again.
//!
//! Pure, like the pool: no clock, no I/O, no locks.

use std::collections::HashMap;

use super::block_pool::{extend_block_hashes, BlockHash, BlockId, BlockPool, PoolExhausted};
use super::events::KvEvent;
use crate::scheduler::RequestId;
use crate::tokenizer::TokenId;

/// A waiting request's prefix-cache hits ([`KvCacheManager::get_computed_blocks`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ComputedBlocks {
    /// The cached blocks, in token order (no reference taken yet).
    pub blocks: Vec<BlockId>,
    /// Tokens they hold: `blocks.len() × block_size`.
    pub num_tokens: usize,
}

/// What the manager keeps per request.
#[derive(Debug, Clone, Default)]
struct RequestBlocks {
    /// Blocks holding the request's KV, in token order.
    table: Vec<BlockId>,
    /// Chained hashes of the request's full blocks, as far as known.
    hashes: Vec<BlockHash>,
    /// Leading blocks of `table` already offered to the prefix cache.
    num_cached_blocks: usize,
}

/// The KV cache manager. See the module documentation.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pool: BlockPool,
    requests: HashMap<RequestId, RequestBlocks>,
    /// KV events since the last [`take_events`](Self::take_events), when recorded.
    events: Option<Vec<KvEvent>>,
}

impl KvCacheManager {
    /// A manager over `pool`.
    pub fn new(pool: BlockPool) -> Self {
        KvCacheManager { pool, requests: HashMap::new(), events: None }
    }

    /// Record [`KvEvent`]s from now on: blocks cached, blocks evicted (see
    /// [`events`](super::events)).
    pub fn enable_events(&mut self) {
        self.pool.record_evictions();
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events since the last call, in the order they happened (empty unless recording).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.note_evictions();
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Forget the whole prefix cache (vLLM's `reset_prefix_cache`), recorded as
    /// `AllBlocksCleared`; refused (`Err` with the blocks held) while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> Result<(), usize> {
        self.pool.reset_prefix_cache()?;
        self.note_evictions();
        if let Some(events) = &mut self.events {
            events.push(KvEvent::AllBlocksCleared);
        }
        Ok(())
    }

    /// Move the pool's evictions into the event log, as one `BlockRemoved`.
    fn note_evictions(&mut self) {
        let evicted = self.pool.take_evicted();
        if let (Some(events), false) = (&mut self.events, evicted.is_empty()) {
            events.push(KvEvent::BlockRemoved { block_hashes: evicted.iter().map(|h| h.0).collect() });
        }
    }

    /// The block pool (read-only: usage, free blocks, invariants).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// `1 - free / total`, in 0..=1.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// The blocks holding request `id`'s KV, in token order (empty when it holds none).
    pub fn block_table(&self, id: RequestId) -> &[BlockId] {
        self.requests.get(&id).map_or(&[], |r| &r.table)
    }

    /// The longest cached prefix of `tokens` (request `id`'s prompt and any output so far),
    /// in whole blocks, never including the last token. Empty when prefix caching is off.
    pub fn get_computed_blocks(&mut self, id: RequestId, tokens: &[TokenId]) -> ComputedBlocks {
        if !self.pool.prefix_caching() || tokens.is_empty() {
            return ComputedBlocks::default();
        }
        let bs = self.pool.block_size();
        let req = self.requests.entry(id).or_default();
        extend_block_hashes(&mut req.hashes, tokens, bs);
        let max_blocks = ((tokens.len() - 1) / bs).min(req.hashes.len());
        let blocks = self.pool.find_cached_prefix(&req.hashes[..max_blocks]);
        ComputedBlocks { num_tokens: blocks.len() * bs, blocks }
    }

    /// Grow request `id`'s block table to hold `num_tokens` tokens: `computed` (a waiting
    /// request's hits from [`get_computed_blocks`](Self::get_computed_blocks); empty for a
    /// running one) joins the table first, then fresh blocks. All or nothing.
    pub fn allocate_slots(
        &mut self,
        id: RequestId,
        num_tokens: usize,
        computed: &ComputedBlocks,
    ) -> Result<(), PoolExhausted> {
        let have = self.block_table(id).len() + computed.blocks.len();
        let need = self.pool.blocks_for(num_tokens).saturating_sub(have);
        // Hits that are currently free cannot also serve as fresh blocks.
        let free_hits = computed.blocks.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
        let free = self.pool.num_free_blocks() - free_hits;
        if free < need {
            return Err(PoolExhausted { requested: need, free });
        }
        self.pool.touch(&computed.blocks);
        let fresh = self.pool.allocate(need).expect("checked free blocks");
        self.note_evictions();
        let req = self.requests.entry(id).or_default();
        if req.table.is_empty() {
            // The hits are cached already.
            req.num_cached_blocks = computed.blocks.len();
        }
        req.table.extend_from_slice(&computed.blocks);
        req.table.extend(fresh);
        Ok(())
    }

    /// Register request `id`'s blocks that its first `num_computed_tokens` tokens (of
    /// `tokens`) filled since the last call, each under `hash(parent_hash, block_tokens)`.
    /// No-op when prefix caching is off.
    pub fn cache_full_blocks(&mut self, id: RequestId, tokens: &[TokenId], num_computed_tokens: usize) {
        if !self.pool.prefix_caching() {
            return;
        }
        let Some(req) = self.requests.get_mut(&id) else { return };
        let bs = self.pool.block_size();
        let full = (num_computed_tokens / bs).min(req.table.len());
        extend_block_hashes(&mut req.hashes, &tokens[..full * bs], bs);
        // Each run of blocks this call registers is one `BlockStored` (a block another one
        // already caches is not registered, and splits the run).
        let mut run: Option<usize> = None;
        for b in req.num_cached_blocks..=full {
            let stored = b < full && self.pool.cache_block(req.table[b], req.hashes[b]);
            match (stored, run) {
                (true, None) => run = Some(b),
                (false, Some(first)) => {
                    if let Some(events) = &mut self.events {
                        events.push(KvEvent::BlockStored {
                            block_hashes: req.hashes[first..b].iter().map(|h| h.0).collect(),
                            parent_block_hash: first.checked_sub(1).map(|p| req.hashes[p].0),
                            token_ids: tokens[first * bs..b * bs].to_vec(),
                            block_size: bs as u32,
                        });
                    }
                    run = None;
                }
                _ => {}
            }
        }
        req.num_cached_blocks = req.num_cached_blocks.max(full);
    }

    /// Release request `id`'s blocks, tail first; its block hashes are kept (see the module
    /// documentation).
    pub fn free(&mut self, id: RequestId) {
        if let Some(req) = self.requests.get_mut(&id) {
            self.pool.free(&req.table);
            req.table.clear();
            req.num_cached_blocks = 0;
        }
    }

    /// Forget request `id`'s block hashes (it has ended). Its blocks must be freed already.
    pub fn free_block_hashes(&mut self, id: RequestId) {
        if let Some(req) = self.requests.remove(&id) {
            debug_assert!(req.table.is_empty(), "request {id} still holds blocks");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32, base: u32) -> Vec<TokenId> {
        (0..n).map(|t| base + t).collect()
    }

    #[test]
    fn slots_grow_one_block_at_a_time_and_allocation_is_all_or_nothing() {
        let mut m = KvCacheManager::new(BlockPool::new(3, 4, true));
        m.allocate_slots(1, 5, &ComputedBlocks::default()).unwrap();
        assert_eq!(m.block_table(1), [0, 1]);
        // Tokens 6..=8 still fit the second block.
        m.allocate_slots(1, 8, &ComputedBlocks::default()).unwrap();
        assert_eq!(m.block_table(1).len(), 2);
        // 13 tokens need 4 blocks: 2 more, 1 free — nothing changes.
        assert_eq!(m.allocate_slots(1, 13, &ComputedBlocks::default()), Err(PoolExhausted { requested: 2, free: 1 }));
        assert_eq!((m.block_table(1).len(), m.pool().num_free_blocks()), (2, 1));
        m.free(1);
        m.free_block_hashes(1);
        assert_eq!(m.pool().num_free_blocks(), 3);
        assert!(m.block_table(1).is_empty());
        m.pool().check_invariants().unwrap();
    }

    #[test]
    fn computed_blocks_are_full_cached_blocks_never_the_last_token() {
        let mut m = KvCacheManager::new(BlockPool::new(8, 4, true));
        let prompt = toks(8, 100);
        assert_eq!(m.get_computed_blocks(1, &prompt), ComputedBlocks::default());
        m.allocate_slots(1, 8, &ComputedBlocks::default()).unwrap();
        m.cache_full_blocks(1, &prompt, 8);
        let first = m.block_table(1).to_vec();
        m.free(1);
        m.free_block_hashes(1);
        // The same 8 tokens: only the first block may be reused (the last token is computed).
        let hit = m.get_computed_blocks(2, &prompt);
        assert_eq!(hit, ComputedBlocks { blocks: vec![first[0]], num_tokens: 4 });
        // 8 shared tokens and one more: both blocks hit.
        let mut longer = prompt.clone();
        longer.push(7);
        assert_eq!(m.get_computed_blocks(3, &longer).blocks, first);
        // A different first block changes every hash after it.
        let mut other = prompt.clone();
        other[0] = 9;
        other.push(7);
        assert!(m.get_computed_blocks(4, &other).blocks.is_empty());
    }

    #[test]
    fn hits_join_the_table_and_free_hits_count_against_fresh_blocks() {
        let mut m = KvCacheManager::new(BlockPool::new(3, 2, true));
        let prompt = toks(4, 100);
        m.allocate_slots(1, 4, &ComputedBlocks::default()).unwrap();
        m.cache_full_blocks(1, &prompt, 4);
        m.free(1);
        m.free_block_hashes(1);
        // Both cached blocks are free; a 7-token request hits the first two blocks (4 tokens)
        // and needs 2 fresh ones: 3 free blocks, but 2 of them are the hits — refused.
        let long: Vec<_> = prompt.iter().copied().chain([1, 2, 3]).collect();
        let hit = m.get_computed_blocks(2, &long);
        assert_eq!(hit.num_tokens, 4);
        assert_eq!(m.allocate_slots(2, 7, &hit), Err(PoolExhausted { requested: 2, free: 1 }));
        // 5 tokens need one fresh block: the hits are referenced, then one fresh block follows.
        m.allocate_slots(2, 5, &hit).unwrap();
        assert_eq!(&m.block_table(2)[..2], &hit.blocks[..]);
        assert_eq!(m.pool().num_free_blocks(), 0);
        assert!(hit.blocks.iter().all(|&b| m.pool().ref_count(b) == 1));
        m.pool().check_invariants().unwrap();
    }

    #[test]
    fn full_blocks_are_cached_once_as_they_fill() {
        let mut m = KvCacheManager::new(BlockPool::new(6, 2, true));
        let tokens = toks(5, 100);
        m.allocate_slots(1, 5, &ComputedBlocks::default()).unwrap();
        m.cache_full_blocks(1, &tokens, 3);
        let t = m.block_table(1).to_vec();
        assert!(m.pool().cached_hash(t[0]).is_some() && m.pool().cached_hash(t[1]).is_none());
        m.cache_full_blocks(1, &tokens, 5);
        assert!(m.pool().cached_hash(t[1]).is_some() && m.pool().cached_hash(t[2]).is_none());
        // A second request computing the same tokens keeps private copies (the hash is taken).
        m.allocate_slots(2, 5, &ComputedBlocks::default()).unwrap();
        m.cache_full_blocks(2, &tokens, 5);
        assert!(m.block_table(2).iter().all(|&b| m.pool().cached_hash(b).is_none()));
        m.pool().check_invariants().unwrap();
    }

    #[test]
    fn disabled_prefix_caching_never_hits_and_never_hashes() {
        let mut m = KvCacheManager::new(BlockPool::new(4, 2, false));
        let tokens = toks(5, 100);
        m.allocate_slots(1, 5, &ComputedBlocks::default()).unwrap();
        m.cache_full_blocks(1, &tokens, 5);
        assert!(m.block_table(1).iter().all(|&b| m.pool().cached_hash(b).is_none()));
        m.free(1);
        assert!(m.get_computed_blocks(2, &tokens).blocks.is_empty());
    }

    /// KV events (#19): replaying what the manager reported into a set of hashes gives
    /// exactly what the pool caches, after every one of 20,000 random operations with
    /// evictions; each `BlockStored` carries its blocks' tokens, chained from a parent the
    /// consumer has seen stored (or none for block 0; the parent may have been evicted since,
    /// as in vLLM), and its hashes are the chain over those tokens.
    #[test]
    fn replayed_events_hold_exactly_the_pools_cached_blocks() {
        use super::super::block_pool::hash_block;
        use std::collections::HashSet;
        let bs = 4;
        let mut m = KvCacheManager::new(BlockPool::new(24, bs, true));
        m.enable_events();
        let (mut replica, mut seen): (HashSet<u64>, HashSet<u64>) = (HashSet::new(), HashSet::new());
        let (mut stored, mut removed) = (0, 0);
        let mut workload = super::super::workload::RandomWorkload::new(7, 3, 24, 1);
        for step in 0..20_000u64 {
            workload.step(&mut m, step);
            for event in m.take_events() {
                match event {
                    KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => {
                        assert_eq!(token_ids.len(), block_hashes.len() * block_size as usize, "step {step}");
                        let mut parent = parent_block_hash.map(BlockHash);
                        if let Some(p) = parent {
                            // Stored once, maybe evicted since (as in vLLM): a consumer keeps the
                            // engine-hash → own-key map of what it has seen.
                            assert!(seen.contains(&p.0), "step {step}: a parent the consumer never saw");
                        }
                        for (h, chunk) in block_hashes.iter().zip(token_ids.chunks(bs)) {
                            let own = hash_block(parent, chunk);
                            assert_eq!(own.0, *h, "step {step}: the hash is the chain over the tokens");
                            assert!(replica.insert(*h), "step {step}: stored twice");
                            seen.insert(*h);
                            parent = Some(own);
                            stored += 1;
                        }
                    }
                    KvEvent::BlockRemoved { block_hashes } => {
                        for h in block_hashes {
                            assert!(replica.remove(&h), "step {step}: removed a block never stored");
                            removed += 1;
                        }
                    }
                    KvEvent::AllBlocksCleared => replica.clear(),
                }
            }
            let cached: HashSet<u64> = m.pool().cached_hashes().map(|h| h.0).collect();
            assert_eq!(replica, cached, "step {step}");
        }
        assert!(stored > 1000 && removed > 500, "the run exercised the cache: {stored} stored, {removed} removed");
    }

    #[test]
    fn a_reset_clears_the_cache_once_nothing_is_held_and_says_so() {
        let mut m = KvCacheManager::new(BlockPool::new(4, 2, true));
        m.enable_events();
        let tokens = toks(4, 100);
        m.allocate_slots(1, 4, &ComputedBlocks::default()).unwrap();
        m.cache_full_blocks(1, &tokens, 4);
        assert_eq!(m.reset_prefix_cache(), Err(2), "refused while a request holds blocks");
        m.free(1);
        m.free_block_hashes(1);
        let _ = m.take_events();
        m.reset_prefix_cache().unwrap();
        assert_eq!(m.take_events(), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(m.pool().cached_hashes().count(), 0);
        assert!(m.get_computed_blocks(2, &tokens).blocks.is_empty(), "no hit after the reset");
        m.pool().check_invariants().unwrap();
    }

    #[test]
    fn without_events_enabled_nothing_is_recorded() {
        let mut m = KvCacheManager::new(BlockPool::new(2, 2, true));
        let tokens = toks(4, 100);
        m.allocate_slots(1, 4, &ComputedBlocks::default()).unwrap();
        m.cache_full_blocks(1, &tokens, 4);
        m.free(1);
        m.allocate_slots(2, 4, &ComputedBlocks::default()).unwrap();
        assert!(m.take_events().is_empty());
    }

    /// 20,000 seeded random operations (admit with hits, grow, compute, preempt, finish):
    /// the pool's invariants hold after each, and every block comes back in the end.
    #[test]
    fn random_operations_conserve_blocks() {
        let mut m = KvCacheManager::new(BlockPool::new(24, 4, true));
        let mut rng = 99u64;
        let mut next = |n: u64| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 33) % n
        };
        // id → (tokens, computed tokens)
        let mut live: HashMap<RequestId, (Vec<TokenId>, usize)> = HashMap::new();
        for step in 0..20_000u64 {
            let id = next(8);
            match (live.get_mut(&id), next(4)) {
                (None, _) => {
                    // Prompts share prefixes: a few families of tokens.
                    let family = next(3) as u32 * 1000;
                    let tokens: Vec<_> = (0..1 + next(20) as u32).map(|t| family + t).collect();
                    let hit = m.get_computed_blocks(id, &tokens);
                    let n = hit.num_tokens + 1 + next((tokens.len() - hit.num_tokens) as u64) as usize;
                    if m.allocate_slots(id, n, &hit).is_ok() {
                        m.cache_full_blocks(id, &tokens, n);
                        live.insert(id, (tokens, n));
                    } else {
                        m.free_block_hashes(id);
                    }
                }
                (Some((tokens, done)), 0 | 1) => {
                    tokens.push(step as u32);
                    let n = tokens.len();
                    if m.allocate_slots(id, n, &ComputedBlocks::default()).is_ok() {
                        m.cache_full_blocks(id, tokens, n);
                        *done = n;
                    }
                }
                (Some(_), _) => {
                    m.free(id);
                    m.free_block_hashes(id);
                    live.remove(&id);
                }
            }
            m.pool().check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
            let held: usize = live.keys().map(|&id| m.block_table(id).len()).sum();
            assert!(held >= m.pool().num_blocks() - m.pool().num_free_blocks());
        }
        for id in live.into_keys() {
            m.free(id);
            m.free_block_hashes(id);
        }
        assert_eq!(m.pool().num_free_blocks(), m.pool().num_blocks());
        m.pool().check_invariants().unwrap();
    }
}
