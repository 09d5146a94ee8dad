//! A seeded random workload over a [`KvCacheManager`]: requests admitted with their prefix
//! hits (prompts from a few families, so they share prefixes), grown by decoded tokens,
//! finished or preempted. The KV-event property tests drive a manager with it, here and in
//! the end-to-end tests, where the gateway's index is checked against the manager's pool.

use std::collections::HashMap;

use super::{ComputedBlocks, KvCacheManager};
use crate::scheduler::RequestId;
use crate::tokenizer::TokenId;

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct RandomWorkload {
    rng: u64,
    live: HashMap<RequestId, Vec<TokenId>>,
    families: u64,
    max_prompt: u64,
    max_growth: u64,
}

impl RandomWorkload {
    /// Up to 8 concurrent requests; prompts of 1..=`max_prompt` tokens from `families`
    /// families; a growing request gains 1..=`max_growth` tokens.
    pub fn new(seed: u64, families: u64, max_prompt: u64, max_growth: u64) -> Self {
        RandomWorkload { rng: seed, live: HashMap::new(), families, max_prompt, max_growth }
    }

    fn next(&mut self, n: u64) -> u64 {
        self.rng = self.rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.rng >> 33) % n
    }

    /// One operation on `m` (`step` makes the tokens a request grows by unique).
    pub fn step(&mut self, m: &mut KvCacheManager, step: u64) {
        let id = self.next(8);
        let op = self.next(4);
        if !self.live.contains_key(&id) {
            let family = self.next(self.families) as u32 * 10_000;
            let len = 1 + self.next(self.max_prompt) as u32;
            let tokens: Vec<TokenId> = (0..len).map(|t| family + t).collect();
            let hit = m.get_computed_blocks(id, &tokens);
            if m.allocate_slots(id, tokens.len(), &hit).is_ok() {
                m.cache_full_blocks(id, &tokens, tokens.len());
                self.live.insert(id, tokens);
            } else {
                m.free_block_hashes(id);
            }
        } else if op < 2 {
            let grow = 1 + self.next(self.max_growth) as u32;
            let tokens = self.live.get_mut(&id).expect("live");
            tokens.extend((0..grow).map(|t| 500_000 + step as u32 * 32 + t));
            if m.allocate_slots(id, tokens.len(), &ComputedBlocks::default()).is_ok() {
                m.cache_full_blocks(id, tokens, tokens.len());
            }
        } else {
            // Finished or preempted: the blocks go back, cached ones stay hittable.
            m.free(id);
            m.free_block_hashes(id);
            self.live.remove(&id);
        }
    }
}
