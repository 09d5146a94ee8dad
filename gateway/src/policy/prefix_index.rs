//! Approximate prefix index: which backends have probably cached which prompt prefixes.
//!
//! The gateway cannot see the engines' KV caches (no event bus); it remembers what it sent
//! where. The canonical prompt text is cut into fixed-size blocks of `block_bytes` bytes
//! (about one KV block of tokens) and each block gets a chained hash
//! `h_i = hash(h_{i-1}, block_i)`, so equal hashes mean equal whole prefixes
//! (`block_hashes`, computed as the prompt renders by `request::canonical_prompt_blocks`). At dispatch the request's hashes are inserted for the chosen backend
//! ([`PrefixIndex::insert`]); a new request asks, per backend, how many of its leading
//! blocks that backend has seen ([`PrefixIndex::matches`]).
//!
//! **Bounded memory.** Every entry (hash + the backends that hold it) is charged
//! [`ENTRY_BYTES`] plus 4 bytes per backend, and the recency queue 16 bytes per slot. When
//! the total passes `max_bytes`, least recently used entries are evicted. The queue uses
//! lazy deletion (an entry remembers its latest stamp; stale queue slots are skipped) and is
//! compacted when it holds more than twice as many slots as entries, so every operation is
//! amortized O(blocks) and the bound holds at all times ([`PrefixIndex::approx_bytes`]).
//!
//! Pure: no clock (recency is an insertion counter), no I/O, no locks.

use std::collections::VecDeque;

use foldhash::{HashMap, HashMapExt};

/// Memory charged per entry besides its backend list (key, value, map overhead).
pub const ENTRY_BYTES: usize = 64;
/// Memory charged per recency-queue slot.
pub const SLOT_BYTES: usize = 16;

/// The seed of a prompt's first block hash.
pub const BLOCK_HASH_SEED: u64 = 0x5157_4954_4348_5944;

/// Chained 64-bit hashes of the full `block_bytes`-sized blocks of `text` (a trailing
/// partial block is not hashed: it cannot be a cached prefix yet). The request path hashes
/// as it renders ([`crate::request::canonical_prompt_blocks`]); this is the definition it is
/// checked against.
#[cfg(any(test, feature = "fuzzing"))]
pub fn block_hashes(text: &[u8], block_bytes: usize) -> Vec<u64> {
    assert!(block_bytes > 0, "block_bytes must be > 0");
    let mut out = Vec::with_capacity(text.len() / block_bytes);
    let mut parent = BLOCK_HASH_SEED;
    for block in text.chunks_exact(block_bytes) {
        parent = xxhash_rust::xxh3::xxh3_64_with_seed(block, parent);
        out.push(parent);
    }
    out
}

#[derive(Debug, Clone)]
struct Entry {
    backends: Vec<u32>,
    stamp: u64,
}

/// Blocks inserted between two evictions while one prompt goes in.
const EVICT_EVERY: u64 = 1024;

/// The index. See the module documentation.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    max_bytes: usize,
    entries: HashMap<u64, Entry>,
    recency: VecDeque<(u64, u64)>,
    backend_refs: usize,
    clock: u64,
}

impl PrefixIndex {
    /// An empty index that never holds more than `max_bytes` (as charged above).
    pub fn new(max_bytes: usize) -> Self {
        PrefixIndex { max_bytes, entries: HashMap::new(), recency: VecDeque::new(), backend_refs: 0, clock: 0 }
    }

    /// Memory charged now.
    pub fn approx_bytes(&self) -> usize {
        self.entries.len() * ENTRY_BYTES + self.backend_refs * 4 + self.recency.len() * SLOT_BYTES
    }

    /// Entries held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Record that `backend` now holds the prefixes `hashes` (a request was sent there).
    pub fn insert(&mut self, backend: u32, hashes: &[u64]) {
        for &h in hashes {
            self.clock += 1;
            let stamp = self.clock;
            let e = self.entries.entry(h).or_insert_with(|| Entry { backends: Vec::new(), stamp });
            e.stamp = stamp;
            if !e.backends.contains(&backend) {
                e.backends.push(backend);
                self.backend_refs += 1;
            }
            self.recency.push_back((h, stamp));
            // A long prompt is bounded while it goes in, not only once it is in: its
            // blocks would otherwise all be held before the first eviction.
            if self.clock.is_multiple_of(EVICT_EVERY) {
                self.evict();
            }
        }
        self.compact_if_sparse();
        self.evict();
    }

    /// For each backend that holds at least the first block: how many leading blocks of
    /// `hashes` it holds. Sorted by backend id.
    pub fn matches(&self, hashes: &[u64]) -> Vec<(u32, usize)> {
        let mut out: Vec<(u32, usize)> = Vec::new();
        for (depth, h) in hashes.iter().enumerate() {
            let Some(e) = self.entries.get(h) else { break };
            if depth == 0 {
                out = e.backends.iter().map(|&b| (b, 1)).collect();
            } else {
                let mut any = false;
                for m in out.iter_mut().filter(|m| m.1 == depth) {
                    if e.backends.contains(&m.0) {
                        m.1 += 1;
                        any = true;
                    }
                }
                if !any {
                    break;
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// Forget everything `backend` held (it was removed or restarted).
    pub fn remove_backend(&mut self, backend: u32) {
        let mut removed = 0;
        self.entries.retain(|_, e| {
            let before = e.backends.len();
            e.backends.retain(|&b| b != backend);
            removed += before - e.backends.len();
            !e.backends.is_empty()
        });
        self.backend_refs -= removed;
        self.compact_if_sparse();
    }

    fn compact_if_sparse(&mut self) {
        if self.recency.len() > 2 * self.entries.len() + 64 {
            let entries = &self.entries;
            self.recency.retain(|(h, s)| entries.get(h).is_some_and(|e| e.stamp == *s));
        }
    }

    fn evict(&mut self) {
        while self.approx_bytes() > self.max_bytes {
            let Some((h, stamp)) = self.recency.pop_front() else { break };
            if self.entries.get(&h).is_some_and(|e| e.stamp == stamp) {
                let e = self.entries.remove(&h).expect("present");
                self.backend_refs -= e.backends.len();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(text: &str) -> Vec<u64> {
        block_hashes(text.as_bytes(), 4)
    }

    #[test]
    fn chained_hashes_cover_whole_prefixes() {
        assert_eq!(hashes("abcdefgh").len(), 2);
        assert_eq!(hashes("abcdefg").len(), 1, "a partial block is not hashed");
        assert_ne!(hashes("xxxxefgh")[1], hashes("abcdefgh")[1], "same block under another prefix");
        assert_eq!(hashes("abcdefgh")[..1], hashes("abcdzzzz")[..1]);
    }

    #[test]
    fn longest_match_per_backend() {
        let mut idx = PrefixIndex::new(1 << 20);
        idx.insert(1, &hashes("systemprompt-aaaa"));
        idx.insert(2, &hashes("systemprompt-bbbb"));
        idx.insert(3, &hashes("other..."));
        // "syst" "empr" "ompt" "-aaa": backend 1 holds all 4, backend 2 the first 3.
        assert_eq!(idx.matches(&hashes("systemprompt-aaaa")), vec![(1, 4), (2, 3)]);
        assert_eq!(idx.matches(&hashes("nothing here")), vec![]);
        idx.remove_backend(1);
        assert_eq!(idx.matches(&hashes("systemprompt-aaaa")), vec![(2, 3)]);
    }

    #[test]
    fn least_recently_used_entries_go_first() {
        // 400 bytes: each entry with one backend costs 68, each recency slot 16.
        let max = 4 * (ENTRY_BYTES + 4 + 2 * SLOT_BYTES);
        let mut idx = PrefixIndex::new(max);
        idx.insert(0, &hashes("aaaabbbb")); // 2 entries, 2 slots: 168
        idx.insert(0, &hashes("ccccdddd")); // 4 entries, 4 slots: 336
        idx.insert(0, &hashes("aaaa")); // touch a: 5 slots, 352
        idx.insert(0, &hashes("eeee")); // 436 > 400: a's stale slot skipped, b evicted → 336
        assert_eq!(idx.matches(&hashes("aaaabbbb")), vec![(0, 1)], "b evicted, a kept (recently used)");
        assert_eq!(idx.matches(&hashes("ccccdddd")), vec![(0, 2)]);
        idx.insert(0, &hashes("ffff")); // 420 > 400: c, the oldest, goes → 336
        assert_eq!(idx.matches(&hashes("ccccdddd")), vec![], "the chain starts at c");
        assert_eq!(idx.approx_bytes(), 336);
    }

    #[test]
    fn the_memory_bound_holds_after_a_million_inserts() {
        let max = 256 * 1024;
        let mut idx = PrefixIndex::new(max);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for i in 0..1_000_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Mostly fresh prefixes, some shared ones, 8 backends.
            let h = if i % 4 == 0 { vec![i % 97, i % 89] } else { vec![x, x.rotate_left(7)] };
            idx.insert((x % 8) as u32, &h);
            assert!(idx.approx_bytes() <= max, "over the bound after {i} inserts: {}", idx.approx_bytes());
        }
        assert!(idx.len() > 1000, "the bound is used, not wasted: {} entries", idx.len());
    }
}
