//! 100,000 seeded random operations on the block pool, checked after every one against a
//! reference model: no block is ever handed to two owners, blocks are conserved, every
//! cached hash is the chained hash of its block's tokens under its parent, and eviction
//! follows LRU order exactly.

use std::collections::{HashMap, VecDeque};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use switchyard_engine::kv::{hash_block, BlockHash, BlockId, BlockPool};

const NUM_BLOCKS: usize = 64;
const BLOCK_SIZE: usize = 4;

/// An owner: a sequence of blocks with the token chain they hold.
struct Owner {
    blocks: Vec<BlockId>,
    /// Which chain (prompt family) it holds, and hashes of its cached blocks.
    chain: usize,
}

struct Model {
    free: VecDeque<BlockId>,
    refs: Vec<u32>,
    cached: HashMap<BlockHash, BlockId>,
    block_hash: Vec<Option<BlockHash>>,
}

fn chain_tokens(chain: usize, block: usize) -> Vec<u32> {
    // Chains 0..8 share their first block per pair, so sharing and divergence both happen.
    let family = if block == 0 { chain / 2 } else { chain };
    (0..BLOCK_SIZE as u32).map(|i| (family as u32) * 1000 + block as u32 * 10 + i).collect()
}

fn chain_hashes(chain: usize, n: usize) -> Vec<(Option<BlockHash>, Vec<u32>, BlockHash)> {
    let mut out = Vec::new();
    let mut parent = None;
    for b in 0..n {
        let toks = chain_tokens(chain, b);
        let h = hash_block(parent, &toks);
        out.push((parent, toks, h));
        parent = Some(h);
    }
    out
}

#[test]
fn block_pool_keeps_its_invariants_over_100k_random_operations() {
    let mut rng = StdRng::seed_from_u64(0x5EED);
    let mut pool = BlockPool::new(NUM_BLOCKS, BLOCK_SIZE, true);
    let mut model = Model {
        free: (0..NUM_BLOCKS as u32).collect(),
        refs: vec![0; NUM_BLOCKS],
        cached: HashMap::new(),
        block_hash: vec![None; NUM_BLOCKS],
    };
    let mut owners: Vec<Owner> = Vec::new();
    let mut provenance: HashMap<BlockHash, (Option<BlockHash>, Vec<u32>)> = HashMap::new();
    let (mut allocs, mut hits, mut evictions) = (0, 0, 0);

    for step in 0..100_000 {
        match rng.random_range(0..10) {
            // Allocate fresh blocks for a new owner.
            0..=2 => {
                let n = rng.random_range(1..=6);
                let got = pool.allocate(n);
                if n > model.free.len() {
                    assert!(got.is_err(), "step {step}: allocation beyond free must fail");
                    continue;
                }
                let got = got.unwrap();
                let expect: Vec<_> = model.free.drain(..n).collect();
                assert_eq!(got, expect, "step {step}: allocation must follow LRU order");
                for &b in &got {
                    assert_eq!(model.refs[b as usize], 0, "step {step}: block {b} double-allocated");
                    model.refs[b as usize] = 1;
                    if let Some(h) = model.block_hash[b as usize].take() {
                        model.cached.remove(&h);
                        evictions += 1;
                    }
                }
                allocs += 1;
                owners.push(Owner { blocks: got, chain: rng.random_range(0..8) });
            }
            // Register an owner's blocks under its chain's hashes.
            3..=4 if !owners.is_empty() => {
                let o = &owners[rng.random_range(0..owners.len())];
                for (i, (parent, toks, h)) in chain_hashes(o.chain, o.blocks.len()).into_iter().enumerate() {
                    let b = o.blocks[i];
                    pool.cache_block(b, h);
                    if model.block_hash[b as usize].is_none() && !model.cached.contains_key(&h) {
                        model.cached.insert(h, b);
                        model.block_hash[b as usize] = Some(h);
                    }
                    provenance.insert(h, (parent, toks));
                }
            }
            // Free an owner.
            5..=7 if !owners.is_empty() => {
                let o = owners.swap_remove(rng.random_range(0..owners.len()));
                pool.free(&o.blocks);
                for &b in o.blocks.iter().rev() {
                    model.refs[b as usize] -= 1;
                    if model.refs[b as usize] == 0 {
                        model.free.push_back(b);
                    }
                }
            }
            // Look a chain up and share its cached prefix.
            _ => {
                let chain = rng.random_range(0..8);
                let hs: Vec<_> = chain_hashes(chain, rng.random_range(1..=6)).into_iter().map(|x| x.2).collect();
                let found = pool.find_cached_prefix(&hs);
                let expect: Vec<_> = hs.iter().map_while(|h| model.cached.get(h).copied()).collect();
                assert_eq!(found, expect, "step {step}: prefix lookup");
                if found.is_empty() {
                    continue;
                }
                pool.touch(&found);
                for &b in &found {
                    if model.refs[b as usize] == 0 {
                        model.free.retain(|&f| f != b);
                    }
                    model.refs[b as usize] += 1;
                }
                hits += found.len();
                owners.push(Owner { blocks: found, chain });
            }
        }
        pool.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
        assert_eq!(pool.free_queue(), Vec::from(model.free.clone()), "step {step}: free queue order");
        let owned: u32 = model.refs.iter().sum();
        let held: usize = owners.iter().map(|o| o.blocks.len()).sum();
        assert_eq!(owned as usize, held, "step {step}: every reference belongs to one owner");
        assert_eq!(pool.num_free_blocks() + model.refs.iter().filter(|&&r| r > 0).count(), NUM_BLOCKS);
        for b in 0..NUM_BLOCKS as u32 {
            assert_eq!(pool.ref_count(b), model.refs[b as usize], "step {step}: ref count of {b}");
            if let Some(h) = pool.cached_hash(b) {
                let (parent, toks) = &provenance[&h];
                assert_eq!(hash_block(*parent, toks), h, "step {step}: hash chain of {b}");
                assert_eq!(model.block_hash[b as usize], Some(h));
            }
        }
    }
    // The run exercised every path.
    assert!(allocs > 5_000 && hits > 10_000 && evictions > 1_000, "{allocs} {hits} {evictions}");
}
