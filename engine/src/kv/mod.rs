//! KV cache bookkeeping: the block pool and prefix caching.

pub mod block_pool;

pub use block_pool::{extend_block_hashes, hash_block, BlockHash, BlockId, BlockPool, PoolExhausted};
