//! The precise index charges what its maps really take (#19: the approximate index charged
//! its bound while RSS grew past it, the maps' overhead uncharged). A counting allocator
//! measures the heap the index holds against `KvIndex::charged_bytes` at several sizes.
//! (Its own binary: the global allocator counts every allocation of the process.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use switchyard_gateway::kv_events::index::KvIndex;
use switchyard_gateway::kv_events::wire::{Event, EventBatch};

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn the_charge_is_the_heap_the_index_holds() {
    for blocks in [20_000u64, 70_000, 150_000] {
        let before = LIVE.load(Ordering::Relaxed);
        let mut ix = KvIndex::new(4, usize::MAX);
        // Chains of 10 blocks, stored by two engines (shared blocks cost one entry, two mappings).
        for chain in 0..blocks / 10 {
            for slot in 0..2u8 {
                let first = chain * 10;
                let event = Event::BlockStored {
                    block_hashes: (first..first + 10).map(|h| h * 2 + u64::from(slot)).collect(),
                    parent_block_hash: None,
                    token_ids: (0..40).map(|t| (first as u32) * 40 + t).collect(),
                    block_size: 4,
                    medium: None,
                    lora_name: None,
                };
                ix.apply(slot, chain, &EventBatch { ts: chain as f64, events: vec![event], data_parallel_rank: None });
            }
        }
        let held = (LIVE.load(Ordering::Relaxed) - before) as f64;
        let charged = ix.charged_bytes() as f64;
        eprintln!(
            "{blocks} blocks: heap {:.1} MB, charged {:.1} MB ({:.2}×)",
            held / 1e6,
            charged / 1e6,
            held / charged
        );
        assert!((0.6..=1.4).contains(&(held / charged)), "the charge is off: heap {held}, charged {charged}");
        drop(ix);
    }
}
