//! Paged KV block pool with prefix caching.
//!
//! The KV cache is cut into `num_blocks` fixed-size blocks of `block_size` token slots.
//! A request owns a *block table*: the list of block ids that hold its tokens' keys and
//! values, grown one block at a time as tokens are computed. This pool only does the
//! bookkeeping — which block is free, who shares it, which prefix it caches; the bytes
//! live in the backend (or nowhere, for `sim`).
//!
//! ## Prefix caching (vLLM's "automatic prefix caching")
//! A *full* block is identified by a chained hash `hash(parent_hash, block_tokens)`
//! ([`hash_block`]), so equal hashes mean equal whole prefixes, not just equal blocks.
//! When a full block is computed its owner registers it with [`BlockPool::cache_block`].
//! A new request looks up its prompt's chain with [`BlockPool::find_cached_prefix`] and
//! [`BlockPool::touch`]es the hits, which bumps their reference counts instead of
//! recomputing them. The scheduler does none of this itself: it asks the
//! [`KvCacheManager`](super::KvCacheManager), which does.
//!
//! ## Free queue and eviction
//! Blocks whose reference count drops to zero go to the tail of one free queue (an
//! intrusive doubly-linked list, O(1) removal from the middle when a cached block is hit
//! again). They *keep their hash*: a freed cached block can still be hit until it is
//! reused. [`BlockPool::allocate`] takes blocks from the head — least recently freed
//! first — and only then forgets the hash (eviction). Cached-but-free blocks therefore
//! count as free: `usage = 1 - free / total`, exactly vLLM's `kv_cache_usage_perc`.
//! [`BlockPool::free`] releases a request's blocks in reverse order, so that the tail of a
//! sequence (least likely shared) is evicted before its root.
//!
//! The pool is pure: no clock, no I/O, no locks. `check_invariants` verifies every
//! structural invariant and is what the property test runs after each operation.

use std::collections::HashMap;

/// Index of a block in the pool, `0..num_blocks`.
pub type BlockId = u32;

/// Chained hash of a full block: covers the block's tokens and every block before it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockHash(pub u64);

/// Hash of a full block given the hash of the block before it (`None` for the first).
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    use xxhash_rust::xxh3::Xxh3;
    let mut h = Xxh3::with_seed(0x5357_4954_4348_5944); // "SWITCHYD"
    match parent {
        Some(p) => h.update(&p.0.to_le_bytes()),
        None => h.update(b"root"),
    }
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    BlockHash(h.digest())
}

/// Hashes of every full block of `tokens`, chained, starting after `known` hashes of
/// earlier blocks (which must be the hashes of `tokens`' first blocks).
pub fn extend_block_hashes(known: &mut Vec<BlockHash>, tokens: &[u32], block_size: usize) {
    let full = tokens.len() / block_size;
    for i in known.len()..full {
        let parent = i.checked_sub(1).map(|p| known[p]);
        known.push(hash_block(parent, &tokens[i * block_size..(i + 1) * block_size]));
    }
}

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct BlockMeta {
    ref_count: u32,
    hash: Option<BlockHash>,
    in_free_queue: bool,
    prev: u32,
    next: u32,
}

/// Not enough free blocks for an allocation; nothing was allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV cache exhausted: {requested} blocks requested, {free} free")]
pub struct PoolExhausted {
    /// Blocks asked for.
    pub requested: usize,
    /// Blocks that were free.
    pub free: usize,
}

/// The block pool. See the module documentation.
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    prefix_caching: bool,
    blocks: Vec<BlockMeta>,
    free_head: u32,
    free_tail: u32,
    num_free: usize,
    cached: HashMap<BlockHash, BlockId>,
    /// Hashes evicted since the last [`take_evicted`](Self::take_evicted), when recorded.
    evicted: Option<Vec<BlockHash>>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens each.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        assert!(num_blocks < NIL as usize, "too many blocks");
        assert!(block_size > 0, "block_size must be > 0");
        let mut pool = BlockPool {
            block_size,
            prefix_caching,
            blocks: vec![
                BlockMeta { ref_count: 0, hash: None, in_free_queue: false, prev: NIL, next: NIL };
                num_blocks
            ],
            free_head: NIL,
            free_tail: NIL,
            num_free: 0,
            cached: HashMap::new(),
            evicted: None,
        };
        for id in 0..num_blocks as u32 {
            pool.push_free_tail(id);
        }
        pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks with no owner (including cached ones that may still be hit).
    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// Whether prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// `1 - free / total`, in 0..=1.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.num_free as f64 / self.blocks.len() as f64
    }

    /// Number of blocks needed to hold `tokens` token slots.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The longest run of `hashes` (from the start) that is cached, as block ids.
    /// Takes no reference: call [`touch`](Self::touch) on the result to keep them.
    pub fn find_cached_prefix(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        if !self.prefix_caching {
            return Vec::new();
        }
        hashes.iter().map_while(|h| self.cached.get(h).copied()).collect()
    }

    /// Take one more reference on each block (a prefix-cache hit), removing blocks
    /// that were free from the free queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            let meta = &self.blocks[b as usize];
            if meta.ref_count == 0 {
                self.unlink_free(b);
            }
            self.blocks[b as usize].ref_count += 1;
        }
    }

    /// Allocate `n` fresh blocks (reference count 1), all or nothing. Blocks come
    /// from the head of the free queue; a cached block taken this way is evicted.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, PoolExhausted> {
        if n > self.num_free {
            return Err(PoolExhausted { requested: n, free: self.num_free });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.free_head;
            self.unlink_free(b);
            let meta = &mut self.blocks[b as usize];
            if let Some(h) = meta.hash.take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                    if let Some(evicted) = &mut self.evicted {
                        evicted.push(h);
                    }
                }
            }
            meta.ref_count = 1;
            out.push(b);
        }
        Ok(out)
    }

    /// Drop one reference on each block of a block table. Blocks reaching zero join
    /// the free-queue tail in reverse table order (the sequence's tail is evicted first).
    pub fn free(&mut self, table: &[BlockId]) {
        for &b in table.iter().rev() {
            let meta = &mut self.blocks[b as usize];
            assert!(meta.ref_count > 0, "double free of block {b}");
            meta.ref_count -= 1;
            if meta.ref_count == 0 {
                self.push_free_tail(b);
            }
        }
    }

    /// Register a computed full block under its chained hash, so later requests can hit
    /// it; true when it was registered. No-op (false) when prefix caching is off, when the
    /// block already carries a hash, or when another block already caches this hash (this
    /// one stays a private copy).
    pub fn cache_block(&mut self, block: BlockId, hash: BlockHash) -> bool {
        if !self.prefix_caching || self.blocks[block as usize].hash.is_some() {
            return false;
        }
        match self.cached.entry(hash) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(block);
                self.blocks[block as usize].hash = Some(hash);
                true
            }
            std::collections::hash_map::Entry::Occupied(_) => false,
        }
    }

    /// Forget every cached hash (vLLM's `reset_prefix_cache`): only while no block is held
    /// (a held block's hash may be in use by its request); `Err` with the held count otherwise.
    pub fn reset_prefix_cache(&mut self) -> Result<(), usize> {
        let held = self.blocks.len() - self.num_free;
        if held > 0 {
            return Err(held);
        }
        self.cached.clear();
        for meta in &mut self.blocks {
            meta.hash = None;
        }
        Ok(())
    }

    /// Record the hashes [`allocate`](Self::allocate) evicts from now on (KV events).
    pub fn record_evictions(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// The hashes evicted since the last call (empty unless recording).
    pub fn take_evicted(&mut self) -> Vec<BlockHash> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Every hash the pool caches now (what a consumer of its events should hold).
    pub fn cached_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.cached.keys().copied()
    }

    /// Reference count of a block (for tests and metrics).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks[block as usize].ref_count
    }

    /// The hash a block is cached under, if any.
    pub fn cached_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.blocks[block as usize].hash
    }

    /// Free blocks from the next-to-evict to the last-to-evict.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut b = self.free_head;
        while b != NIL {
            out.push(b);
            b = self.blocks[b as usize].next;
        }
        out
    }

    /// Verify every structural invariant; `Err` names the first one broken.
    pub fn check_invariants(&self) -> Result<(), String> {
        let queue = self.free_queue();
        if queue.len() != self.num_free {
            return Err(format!("free count {} != queue length {}", self.num_free, queue.len()));
        }
        let mut seen = vec![false; self.blocks.len()];
        let mut prev = NIL;
        for &b in &queue {
            let m = &self.blocks[b as usize];
            if seen[b as usize] {
                return Err(format!("block {b} twice in the free queue"));
            }
            seen[b as usize] = true;
            if m.ref_count != 0 || !m.in_free_queue {
                return Err(format!("block {b} in free queue with ref_count {}", m.ref_count));
            }
            if m.prev != prev {
                return Err(format!("block {b} has a broken back link"));
            }
            prev = b;
        }
        if prev != self.free_tail {
            return Err("free tail does not end the queue".into());
        }
        for (id, m) in self.blocks.iter().enumerate() {
            if !seen[id] && (m.ref_count == 0 || m.in_free_queue) {
                return Err(format!("block {id} is neither owned nor free (ref {})", m.ref_count));
            }
            if let Some(h) = m.hash {
                if self.cached.get(&h) != Some(&(id as u32)) {
                    return Err(format!("block {id} carries a hash the cache map does not point back to"));
                }
            }
        }
        for (h, &b) in &self.cached {
            if self.blocks[b as usize].hash != Some(*h) {
                return Err(format!("cache map entry for block {b} does not match the block's hash"));
            }
        }
        Ok(())
    }

    fn push_free_tail(&mut self, b: BlockId) {
        let tail = self.free_tail;
        {
            let m = &mut self.blocks[b as usize];
            m.prev = tail;
            m.next = NIL;
            m.in_free_queue = true;
        }
        if tail == NIL {
            self.free_head = b;
        } else {
            self.blocks[tail as usize].next = b;
        }
        self.free_tail = b;
        self.num_free += 1;
    }

    fn unlink_free(&mut self, b: BlockId) {
        let (prev, next) = {
            let m = &mut self.blocks[b as usize];
            debug_assert!(m.in_free_queue);
            m.in_free_queue = false;
            let pn = (m.prev, m.next);
            m.prev = NIL;
            m.next = NIL;
            pn
        };
        if prev == NIL {
            self.free_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.free_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(tokens: &[u32], bs: usize) -> Vec<BlockHash> {
        let mut v = Vec::new();
        extend_block_hashes(&mut v, tokens, bs);
        v
    }

    #[test]
    fn allocates_in_lru_order_and_conserves_blocks() {
        let mut p = BlockPool::new(4, 16, true);
        assert_eq!(p.allocate(2).unwrap(), vec![0, 1]);
        assert_eq!(p.num_free_blocks(), 2);
        assert_eq!(p.usage(), 0.5);
        p.free(&[0, 1]);
        // reverse order: 1 is evicted before 0
        assert_eq!(p.free_queue(), vec![2, 3, 1, 0]);
        assert_eq!(p.allocate(5), Err(PoolExhausted { requested: 5, free: 4 }));
        p.check_invariants().unwrap();
    }

    #[test]
    fn freed_cached_block_is_hit_until_evicted() {
        let mut p = BlockPool::new(3, 2, true);
        let toks = [1, 2, 3, 4];
        let hs = hashes(&toks, 2);
        let t = p.allocate(2).unwrap();
        p.cache_block(t[0], hs[0]);
        p.cache_block(t[1], hs[1]);
        p.free(&t);
        assert_eq!(p.find_cached_prefix(&hs), t);
        p.touch(&t[..1]);
        assert_eq!(p.ref_count(t[0]), 1);
        assert_eq!(p.num_free_blocks(), 2);
        // allocate everything: block 2 first (never used), then t[1] (evicted)
        let fresh = p.allocate(2).unwrap();
        assert_eq!(fresh, vec![2, t[1]]);
        assert_eq!(p.find_cached_prefix(&hs), vec![t[0]]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn chain_hash_depends_on_parent() {
        let a = hashes(&[1, 2, 3, 4], 2);
        let b = hashes(&[9, 9, 3, 4], 2);
        assert_ne!(a[1], b[1], "same block tokens under different prefixes must differ");
        assert_eq!(hashes(&[1, 2, 3], 2).len(), 1, "only full blocks are hashed");
    }

    #[test]
    fn disabled_prefix_caching_never_hits() {
        let mut p = BlockPool::new(2, 2, false);
        let hs = hashes(&[1, 2], 2);
        let t = p.allocate(1).unwrap();
        p.cache_block(t[0], hs[0]);
        assert!(p.find_cached_prefix(&hs).is_empty());
    }
}
