//! The `cpu` backend's K/V cache: the keys and values of every block of the engine's block
//! pool, per layer, in host memory. Position `p` of a sequence lives in slot
//! `p % block_size` of block `block_table[p / block_size]`, so the scheduler's block tables
//! (prefix sharing and preemption included) index real tensors unchanged.

use crate::kv::BlockId;
use crate::model::llama::LlamaConfig;

/// K/V storage of every block of the pool, per layer: `[block][slot][kv_head][head_dim]`.
#[derive(Debug)]
pub struct KvStore {
    block_size: usize,
    kv_dim: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvStore {
    /// Storage for `num_blocks` blocks of `block_size` tokens of a model shaped like `cfg`.
    pub fn new(cfg: &LlamaConfig, num_blocks: usize, block_size: usize) -> Self {
        Self::with_kv_dim(cfg.n_layers, cfg.kv_dim(), num_blocks, block_size)
    }

    /// Storage for a model (or one tensor-parallel rank of it) with `kv_dim` floats of K per
    /// token per layer.
    pub fn with_kv_dim(n_layers: usize, kv_dim: usize, num_blocks: usize, block_size: usize) -> Self {
        let per_layer = num_blocks * block_size * kv_dim;
        Self {
            block_size,
            kv_dim,
            k: (0..n_layers).map(|_| vec![0.0; per_layer]).collect(),
            v: (0..n_layers).map(|_| vec![0.0; per_layer]).collect(),
        }
    }

    /// Bytes one token takes across all layers.
    pub fn bytes_per_token(cfg: &LlamaConfig) -> usize {
        2 * cfg.n_layers * cfg.kv_dim() * std::mem::size_of::<f32>()
    }

    /// Floats of K (or of V) per token per layer.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Offset of position `pos` of a sequence with `table`.
    pub(crate) fn slot(&self, table: &[BlockId], pos: usize) -> usize {
        (table[pos / self.block_size] as usize * self.block_size + pos % self.block_size) * self.kv_dim
    }

    /// Layer `li`'s K and V caches.
    pub(crate) fn layer(&self, li: usize) -> (&[f32], &[f32]) {
        (&self.k[li], &self.v[li])
    }

    /// Layer `li`'s K and V caches, to write.
    pub(crate) fn layer_mut(&mut self, li: usize) -> (&mut [f32], &mut [f32]) {
        (&mut self.k[li], &mut self.v[li])
    }
}
