//! KV cache bookkeeping: the block pool with prefix caching ([`block_pool`], pure and
//! property-tested) and, between it and the scheduler, the [`KvCacheManager`]
//! ([`kv_cache_manager`]), which speaks in requests and token counts; the [`events`] it
//! records for routers (vLLM's KV events).

pub mod block_pool;
pub mod events;
pub mod kv_cache_manager;
pub mod workload;

pub use block_pool::{extend_block_hashes, hash_block, BlockHash, BlockId, BlockPool, PoolExhausted};
pub use events::{encode_batch, KvEvent};
pub use kv_cache_manager::{ComputedBlocks, KvCacheManager};
