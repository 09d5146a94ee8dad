//! The Llama forward pass over a batch of sequences, with K/V read and written through
//! block tables of the engine's shared block pool.
//!
//! One call computes every scheduled sequence of a step — prefill chunks and single decode
//! tokens alike — as one batch of `T` token rows: each weight matrix is read once per step
//! for all `T` rows. Per layer:
//!
//! ```text
//! h = x + Wo · attn(rope(Wq·n), rope(Wk·n), Wv·n)      n = rmsnorm(x)·attn_norm
//! x = h + Wdown · (silu(Wgate·m) ⊙ Wup·m)               m = rmsnorm(h)·ffn_norm
//! ```
//!
//! Attention is grouped-query (`n_heads / n_kv_heads` query heads share a K/V head). The K/V
//! of token position `p` of a sequence lives in slot `p % block_size` of block
//! `block_table[p / block_size]` of [`KvStore`]; a step first writes its new tokens' K/V,
//! then each token attends to positions `0..=p` through the table. Blocks shared through the
//! prefix cache are simply read by several sequences.

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use super::gguf::{GgmlType, GgufError, GgufFile};
use super::quant::{dequantize_row, QuantError};
use super::simd::{attend_rows, dot_row, dot_rows_tokens, AttnShape, Kernel, KvRows, QuantizedActs};
use super::tp::{add_parts, sum_parts, CommError, Communicator, TpDims, TpPlan};
use crate::kv::BlockId;
use crate::tokenizer::TokenId;

/// How rotary embeddings pair the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i+1)` — GGUF llama files (the converter permuted Q/K rows for it).
    Interleaved,
    /// Pairs `(i, i + d/2)` — HF checkpoints.
    NeoX,
}

/// Shape and constants of a Llama model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Hidden size.
    pub dim: usize,
    /// MLP inner size.
    pub ffn_dim: usize,
    /// Query heads.
    pub n_heads: usize,
    /// K/V heads.
    pub n_kv_heads: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest context.
    pub max_ctx: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// RoPE pairing.
    pub rope: RopeStyle,
}

impl LlamaConfig {
    /// Dimensions per head.
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// The heads attention runs over.
    pub fn attn_shape(&self) -> AttnShape {
        AttnShape { n_heads: self.n_heads, n_kv_heads: self.n_kv_heads, head_dim: self.head_dim() }
    }

    /// Floats of K (or of V) per token per layer.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim()
    }
}

/// Why a model cannot be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file is unreadable or malformed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A tensor is missing or has the wrong shape.
    #[error("tensor `{name}`: {reason}")]
    Tensor {
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A hyperparameter is missing or unusable.
    #[error("model config `{key}`: {reason}")]
    Config {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A kernel rejected a weight.
    #[error(transparent)]
    Quant(#[from] QuantError),
    /// A tensor-parallel collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Raw bytes of a weight: a range of a shared buffer (a mapped file or an owned vector).
#[derive(Clone)]
pub struct Matrix {
    buf: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    /// Element type.
    pub ty: GgmlType,
    /// Output rows.
    pub rows: usize,
    /// Weights per row.
    pub cols: usize,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Matrix({} × {} {})", self.rows, self.cols, self.ty)
    }
}

impl Matrix {
    /// A matrix over `buf[start..]`; `buf` must hold `rows` rows of `cols` weights of `ty`.
    pub fn new(
        buf: Arc<dyn AsRef<[u8]> + Send + Sync>,
        start: usize,
        ty: GgmlType,
        rows: usize,
        cols: usize,
    ) -> Result<Self, QuantError> {
        let need = ty.bytes_for(cols) * rows;
        let have = (*buf).as_ref().len().saturating_sub(start);
        if !cols.is_multiple_of(ty.block_len()) || need > have {
            return Err(QuantError::Shape { ty, row: cols, bytes: have, n: need });
        }
        Ok(Self { buf, start, ty, rows, cols })
    }

    fn row_bytes(&self) -> usize {
        self.ty.bytes_for(self.cols)
    }

    /// The bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        let all: &[u8] = (*self.buf).as_ref();
        &all[self.start + r * n..self.start + (r + 1) * n]
    }

    /// The bytes of rows `r..r + n`.
    pub fn rows_bytes(&self, r: usize, n: usize) -> &[u8] {
        let b = self.row_bytes();
        let all: &[u8] = (*self.buf).as_ref();
        &all[self.start + r * b..self.start + (r + n) * b]
    }

    /// Row `r` as f32.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) -> Result<(), QuantError> {
        dequantize_row(self.ty, self.row(r), out)
    }

    /// Rows `r` as a matrix over the same buffer (no copy).
    pub fn row_range(&self, r: Range<usize>) -> Matrix {
        debug_assert!(r.end <= self.rows);
        Matrix { start: self.start + r.start * self.row_bytes(), rows: r.len(), ..self.clone() }
    }

    /// Columns `c` of every row, copied into a new buffer; `c` must fall on quantization
    /// blocks.
    pub fn col_range(&self, c: Range<usize>) -> Result<Matrix, QuantError> {
        let (b0, b1) = (self.ty.bytes_for(c.start), self.ty.bytes_for(c.end));
        if !c.start.is_multiple_of(self.ty.block_len()) || !c.end.is_multiple_of(self.ty.block_len()) {
            return Err(QuantError::Shape { ty: self.ty, row: c.len(), bytes: b1 - b0, n: b1 - b0 });
        }
        let mut out = Vec::with_capacity(self.rows * (b1 - b0));
        for r in 0..self.rows {
            out.extend_from_slice(&self.row(r)[b0..b1]);
        }
        Matrix::new(Arc::new(out), 0, self.ty, self.rows, c.len())
    }
}

/// Weights of one transformer block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection (`dim × dim`).
    pub wq: Matrix,
    /// Key projection (`kv_dim × dim`).
    pub wk: Matrix,
    /// Value projection (`kv_dim × dim`).
    pub wv: Matrix,
    /// Output projection (`dim × dim`).
    pub wo: Matrix,
    /// RMSNorm weight before the MLP.
    pub ffn_norm: Vec<f32>,
    /// Gate projection (`ffn × dim`).
    pub w_gate: Matrix,
    /// Up projection (`ffn × dim`).
    pub w_up: Matrix,
    /// Down projection (`dim × ffn`).
    pub w_down: Matrix,
}

/// What one file format calls the tensors of a block (the part of the name that varies).
#[derive(Debug, Clone, Copy)]
pub struct LayerNames {
    /// RMSNorm before attention.
    pub attn_norm: &'static str,
    /// Query projection.
    pub q: &'static str,
    /// Key projection.
    pub k: &'static str,
    /// Value projection.
    pub v: &'static str,
    /// Attention output projection.
    pub o: &'static str,
    /// RMSNorm before the MLP.
    pub ffn_norm: &'static str,
    /// Gate projection.
    pub gate: &'static str,
    /// Up projection.
    pub up: &'static str,
    /// Down projection.
    pub down: &'static str,
}

/// A file format's matrix lookup: `(name, rows, cols)` → the checked matrix.
pub type MatrixLookup<'a> = dyn Fn(&str, usize, usize) -> Result<Matrix, ModelError> + 'a;
/// A file format's vector lookup: `(name, len)` → the values as f32.
pub type VectorLookup<'a> = dyn Fn(&str, usize) -> Result<Vec<f32>, ModelError> + 'a;

impl LayerWeights {
    /// Load one block through a file format's lookups: `name(part)` is the full tensor name of
    /// a part of `names`; `matrix(name, rows, cols)` and `vector(name, n)` fetch and check it.
    /// The shapes every format must have are stated here, once.
    pub fn load(
        cfg: &LlamaConfig,
        name: impl Fn(&str) -> String,
        names: &LayerNames,
        matrix: &MatrixLookup<'_>,
        vector: &VectorLookup<'_>,
    ) -> Result<Self, ModelError> {
        let (d, kv, f) = (cfg.dim, cfg.kv_dim(), cfg.ffn_dim);
        Ok(LayerWeights {
            attn_norm: vector(&name(names.attn_norm), d)?,
            wq: matrix(&name(names.q), d, d)?,
            wk: matrix(&name(names.k), kv, d)?,
            wv: matrix(&name(names.v), kv, d)?,
            wo: matrix(&name(names.o), d, d)?,
            ffn_norm: vector(&name(names.ffn_norm), d)?,
            w_gate: matrix(&name(names.gate), f, d)?,
            w_up: matrix(&name(names.up), f, d)?,
            w_down: matrix(&name(names.down), d, f)?,
        })
    }
}

/// A loaded Llama model.
#[derive(Debug, Clone)]
pub struct Llama {
    /// Shape.
    pub cfg: LlamaConfig,
    /// Token embeddings (`vocab × dim`).
    pub embed: Matrix,
    /// Blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight.
    pub norm: Vec<f32>,
    /// LM head (`vocab × dim`); the embedding when tied.
    pub lm_head: Matrix,
    /// Per block: O and down cut into column segments (see [`RowParallel`]).
    pub row_parallel: Vec<RowParallel>,
    inv_freq: Vec<f32>,
}

/// A block's row-parallel matrices (O, down) as column segments, each a copy of its
/// columns. Their partial outputs are summed in segment order, on one rank or across a
/// tensor-parallel group ([`super::tp`]), so any TP size that splits at segment boundaries
/// gives the bits of TP 1. The segment count is the least common multiple of the TP sizes
/// that fit the model ([`TpPlan::valid_sizes`]): 3 for SmolLM2-135M.
#[derive(Debug, Clone)]
pub struct RowParallel {
    /// O's segments (each `dim × (attention width / S)`).
    pub wo: Vec<Matrix>,
    /// Down's segments (each `dim × (MLP width / S)`).
    pub down: Vec<Matrix>,
}

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

    /// Offset of position `pos` of a sequence with `table`.
    fn slot(&self, table: &[BlockId], pos: usize) -> usize {
        (table[pos / self.block_size] as usize * self.block_size + pos % self.block_size) * self.kv_dim
    }
}

/// One sequence of a batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    /// The tokens to compute this step.
    pub tokens: &'a [TokenId],
    /// Position of `tokens[0]` (tokens before it are already in the cache).
    pub start: usize,
    /// Block table covering `start + tokens.len()` positions.
    pub block_table: &'a [BlockId],
    /// Whether to return logits for the last token.
    pub logits: bool,
}

fn cfg_err(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Config { key: key.to_string(), reason: reason.into() }
}

impl Llama {
    /// Load a GGUF llama model.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let h = &file.header;
        let arch = h.str("general.architecture")?;
        if arch != "llama" {
            return Err(cfg_err("general.architecture", format!("{arch} (only llama is supported)")));
        }
        let count = |key: &str| -> Result<usize, ModelError> {
            let v = h.u64(&format!("llama.{key}"))?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| cfg_err(key, format!("{v} is not a positive count")))
        };
        let dim = count("embedding_length")?;
        let n_heads = count("attention.head_count")?;
        let n_kv_heads = count("attention.head_count_kv").unwrap_or(n_heads);
        if !dim.is_multiple_of(n_heads) || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(cfg_err("attention.head_count", format!("{dim} dims, {n_heads} heads, {n_kv_heads} kv heads")));
        }
        let map = file.map();
        let buf: Arc<dyn AsRef<[u8]> + Send + Sync> = map;
        let embed_info =
            h.tensor("token_embd.weight").ok_or_else(|| tensor_err("token_embd.weight", "missing"))?.clone();
        let vocab = embed_info.rows();
        let cfg = LlamaConfig {
            n_layers: count("block_count")?,
            dim,
            ffn_dim: count("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            vocab,
            max_ctx: count("context_length")?,
            rope_theta: h.f64("llama.rope.freq_base").unwrap_or(10000.0) as f32,
            eps: h.f64("llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f32,
            rope: RopeStyle::Interleaved,
        };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Matrix, ModelError> {
            let t = h.tensor(name).ok_or_else(|| tensor_err(name, "missing"))?;
            if t.dims.len() != 2 || t.row_len() != cols || t.rows() != rows {
                return Err(tensor_err(name, format!("shape {:?}, expected [{cols}, {rows}]", t.dims)));
            }
            Ok(Matrix::new(buf.clone(), t.start, t.ty, rows, cols)?)
        };
        let vector = |name: &str, n: usize| -> Result<Vec<f32>, ModelError> {
            let t = h.tensor(name).ok_or_else(|| tensor_err(name, "missing"))?;
            if t.elements() != n {
                return Err(tensor_err(name, format!("{} elements, expected {n}", t.elements())));
            }
            let mut out = vec![0.0; n];
            dequantize_row(t.ty, file.data(t), &mut out)?;
            Ok(out)
        };
        const GGUF_LAYER: LayerNames = LayerNames {
            attn_norm: "attn_norm",
            q: "attn_q",
            k: "attn_k",
            v: "attn_v",
            o: "attn_output",
            ffn_norm: "ffn_norm",
            gate: "ffn_gate",
            up: "ffn_up",
            down: "ffn_down",
        };
        let layers = (0..cfg.n_layers)
            .map(|i| LayerWeights::load(&cfg, |part| format!("blk.{i}.{part}.weight"), &GGUF_LAYER, &matrix, &vector))
            .collect::<Result<Vec<_>, ModelError>>()?;
        let embed = matrix("token_embd.weight", vocab, dim)?;
        let lm_head =
            if h.tensor("output.weight").is_some() { matrix("output.weight", vocab, dim)? } else { embed.clone() };
        let norm = vector("output_norm.weight", dim)?;
        Ok(Self::assemble(cfg, embed, layers, norm, lm_head))
    }

    /// Put a model together from its parts (loaders and tests).
    pub fn assemble(
        cfg: LlamaConfig,
        embed: Matrix,
        layers: Vec<LayerWeights>,
        norm: Vec<f32>,
        lm_head: Matrix,
    ) -> Self {
        let hd = cfg.head_dim();
        let inv_freq = (0..hd / 2).map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / hd as f32)).collect();
        let whole =
            layers.iter().map(|l| RowParallel { wo: vec![l.wo.clone()], down: vec![l.w_down.clone()] }).collect();
        let mut m = Self { cfg, embed, layers, norm, lm_head, row_parallel: whole, inv_freq };
        let sizes = TpPlan::valid_sizes(m.tp_dims());
        let segments = sizes.iter().fold(1, |a, &b| a / gcd(a, b) * b);
        // Segments that do not fall on quantization blocks (possible only for exotic
        // shapes): keep the matrices whole; then only TP 1 runs (`shard` says why).
        if let Ok(rp) = m.layers.iter().map(|l| Self::segment(l, segments)).collect::<Result<Vec<_>, _>>() {
            m.row_parallel = rp;
        }
        m
    }

    fn segment(l: &LayerWeights, k: usize) -> Result<RowParallel, QuantError> {
        let cut = |w: &Matrix| -> Result<Vec<Matrix>, QuantError> {
            if k == 1 {
                return Ok(vec![w.clone()]);
            }
            let width = w.cols / k;
            if width * k != w.cols {
                return Err(QuantError::Shape { ty: w.ty, row: w.cols, bytes: 0, n: k });
            }
            (0..k).map(|j| w.col_range(j * width..(j + 1) * width)).collect()
        };
        Ok(RowParallel { wo: cut(&l.wo)?, down: cut(&l.w_down)? })
    }

    /// The dimensions a tensor-parallel split must respect.
    pub fn tp_dims(&self) -> TpDims {
        let c = &self.cfg;
        let block = |m: Option<&Matrix>| m.map_or(1, |m| m.ty.block_len());
        TpDims {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim(),
            ffn_dim: c.ffn_dim,
            vocab: c.vocab,
            o_block: block(self.layers.first().map(|l| &l.wo)),
            down_block: block(self.layers.first().map(|l| &l.w_down)),
        }
    }

    /// The part of this model that rank `plan.rank` owns ([`super::tp`]): its heads' rows
    /// of Q/K/V, its rows of gate/up and its vocabulary rows of the LM head (views, no
    /// copy), its share of O's and down's column segments ([`RowParallel`]); embedding and
    /// norms whole. (`LayerWeights::wo`/`w_down` stay whole: only their type is read.)
    pub fn shard(&self, plan: &TpPlan) -> Result<Llama, ModelError> {
        let hd = self.cfg.head_dim();
        let scaled = |r: &Range<usize>| r.start * hd..r.end * hd;
        let (q, kv, f) = (scaled(&plan.heads), scaled(&plan.kv_heads), plan.ffn.clone());
        let layers = self
            .layers
            .iter()
            .map(|l| LayerWeights {
                wq: l.wq.row_range(q.clone()),
                wk: l.wk.row_range(kv.clone()),
                wv: l.wv.row_range(kv.clone()),
                w_gate: l.w_gate.row_range(f.clone()),
                w_up: l.w_up.row_range(f.clone()),
                ..l.clone()
            })
            .collect();
        // This rank's columns of O and down are its share of the segments.
        let segments = self.row_parallel.first().map_or(1, |rp| rp.wo.len());
        if !segments.is_multiple_of(plan.size) {
            return Err(cfg_err(
                "tensor_parallel_size",
                format!("{} ranks do not split the {segments} row-parallel segments of this model", plan.size),
            ));
        }
        let per = segments / plan.size;
        let mine = plan.rank * per..(plan.rank + 1) * per;
        let row_parallel = self
            .row_parallel
            .iter()
            .map(|rp| RowParallel { wo: rp.wo[mine.clone()].to_vec(), down: rp.down[mine.clone()].to_vec() })
            .collect();
        let lm_head = self.lm_head.row_range(plan.vocab.clone());
        Ok(Llama { layers, lm_head, row_parallel, ..self.clone() })
    }

    /// K/V storage for this model (or rank: its K/V heads only).
    pub fn kv_store(&self, num_blocks: usize, block_size: usize) -> KvStore {
        let kv_dim = self.layers.first().map_or(self.cfg.kv_dim(), |l| l.wk.rows);
        KvStore::with_kv_dim(self.cfg.n_layers, kv_dim, num_blocks, block_size)
    }

    /// Run one step over `seqs`, updating `kv`. Returns the logits (`vocab` floats) of the
    /// last token of every sequence that asked for them, in order.
    pub fn forward(&self, kv: &mut KvStore, seqs: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_rank(kv, seqs, None)
    }

    /// [`Self::forward`] for one rank of a tensor-parallel group (`self` a [`Self::shard`]):
    /// the partial outputs of O and down are summed over `comm`, and rank 0 gathers the
    /// logits (other ranks return none). `None`: the whole model, no collectives.
    pub fn forward_rank(
        &self,
        kv: &mut KvStore,
        seqs: &[SeqInput<'_>],
        comm: Option<(&dyn Communicator, usize)>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.cfg;
        let Some(l0) = self.layers.first() else { return Err(cfg_err("block_count", "the model has no blocks")) };
        // This rank's widths (the whole model's without TP): attention, K/V, MLP, vocabulary.
        let (dim, qd, kvd, ffn, vocab) = (c.dim, l0.wq.rows, l0.wk.rows, l0.w_gate.rows, self.lm_head.rows);
        if kv.kv_dim != kvd {
            return Err(cfg_err("kv_cache", format!("holds {} floats per token, the model needs {kvd}", kv.kv_dim)));
        }
        // Row r of the batch: (sequence index, position).
        let rows: Vec<(usize, usize)> =
            seqs.iter().enumerate().flat_map(|(s, q)| (0..q.tokens.len()).map(move |i| (s, q.start + i))).collect();
        let t = rows.len();
        for (s, q) in seqs.iter().enumerate() {
            let need = (q.start + q.tokens.len()).div_ceil(kv.block_size);
            if q.block_table.len() < need {
                return Err(cfg_err(
                    "block_table",
                    format!("sequence {s} needs {need} blocks, has {}", q.block_table.len()),
                ));
            }
        }
        let mut x = vec![0f32; t * dim];
        for (row, &tok) in x.chunks_exact_mut(dim).zip(seqs.iter().flat_map(|q| q.tokens)) {
            if tok as usize >= c.vocab {
                return Err(cfg_err("token", format!("id {tok} is outside the vocabulary of {}", c.vocab)));
            }
            self.embed.row_f32(tok as usize, row)?;
        }
        let mut scratch = Scratch::default();
        let mut n = vec![0f32; t * dim];
        let (mut q, mut k, mut v) = (vec![0f32; t * qd], vec![0f32; t * kvd], vec![0f32; t * kvd]);
        let mut att = vec![0f32; t * qd];
        let mut o = vec![0f32; t * dim];
        let (mut g, mut u) = (vec![0f32; t * ffn], vec![0f32; t * ffn]);
        // Where each row's positions 0..=pos live in the cache: the same in every layer.
        let slots: Vec<Vec<usize>> =
            rows.iter().map(|&(s, pos)| (0..=pos).map(|p| kv.slot(seqs[s].block_table, p)).collect()).collect();
        let lens: Vec<usize> = slots.iter().map(Vec::len).collect();
        // Attention tiles: up to 4 consecutive rows of one sequence (they share K/V reads).
        let mut tiles: Vec<(usize, usize)> = Vec::new();
        for (r, &(s, _)) in rows.iter().enumerate() {
            match tiles.last_mut() {
                Some((r0, n)) if rows[*r0].0 == s && *n < 4 => *n += 1,
                _ => tiles.push((r, 1)),
            }
        }
        for (li, (l, rp)) in self.layers.iter().zip(&self.row_parallel).enumerate() {
            rmsnorm(&x, &l.attn_norm, c.eps, &mut n);
            matmul(&[&l.wq, &l.wk, &l.wv], &[&n], &mut [&mut q, &mut k, &mut v], &mut scratch)?;
            for (r, &(_, pos)) in rows.iter().enumerate() {
                self.rope(&mut q[r * qd..(r + 1) * qd], pos);
                self.rope(&mut k[r * kvd..(r + 1) * kvd], pos);
            }
            // Write this step's K/V first: a token attends to itself and to the earlier
            // tokens of its own chunk.
            for (r, row_slots) in slots.iter().enumerate() {
                let at = row_slots[row_slots.len() - 1];
                kv.k[li][at..at + kvd].copy_from_slice(&k[r * kvd..(r + 1) * kvd]);
                kv.v[li][at..at + kvd].copy_from_slice(&v[r * kvd..(r + 1) * kvd]);
            }
            let (kc, vc) = (&kv.k[li], &kv.v[li]);
            let (kernel, hd) = (scratch.kernel, c.head_dim());
            let shape = AttnShape { n_heads: qd / hd, n_kv_heads: kvd / hd, head_dim: hd };
            let group = shape.n_heads / shape.n_kv_heads;
            // One job per tile, except that a lone row (a decode) is split by K/V head so one
            // sequence's attention still spreads over the pool. Heads are independent: a
            // head's result is the same bits either way.
            let mut rest: &mut [f32] = &mut att;
            let mut jobs = Vec::with_capacity(tiles.len() * shape.n_kv_heads);
            for &(r0, n) in &tiles {
                let (out, tail) = rest.split_at_mut(n * qd);
                rest = tail;
                if n == 1 {
                    jobs.extend(out.chunks_exact_mut(group * hd).enumerate().map(|(h, o)| (r0, 1, Some(h), o)));
                } else {
                    jobs.push((r0, n, None, out));
                }
            }
            jobs.into_par_iter().for_each_init(Vec::new, |scores, (r0, n, head, out)| {
                let (rows, slots, lens) = (&q[r0 * qd..(r0 + n) * qd], &slots[r0 + n - 1], &lens[r0..r0 + n]);
                match head {
                    None => attend_rows(kernel, shape, rows, out, KvRows { k: kc, v: vc, slots }, lens, scores),
                    Some(h) => {
                        // K/V head `h` alone: its rows start `h · hd` into each cached slot.
                        let one = AttnShape { n_heads: group, n_kv_heads: 1, head_dim: hd };
                        let kv = KvRows { k: &kc[h * hd..], v: &vc[h * hd..], slots };
                        attend_rows(kernel, one, &rows[h * group * hd..(h + 1) * group * hd], out, kv, lens, scores);
                    }
                }
            });
            row_parallel(&rp.wo, &att, t, &mut o, &mut scratch, comm)?;
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            rmsnorm(&x, &l.ffn_norm, c.eps, &mut n);
            matmul(&[&l.w_gate, &l.w_up], &[&n], &mut [&mut g, &mut u], &mut scratch)?;
            g.iter_mut().zip(&u).for_each(|(a, b)| *a = *a / (1.0 + (-*a).exp()) * b);
            row_parallel(&rp.down, &g, t, &mut o, &mut scratch, comm)?;
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
        // Logits only for the last token of the sequences that sample.
        let mut last = Vec::new();
        let mut end = 0;
        for q in seqs {
            end += q.tokens.len();
            if q.logits && !q.tokens.is_empty() {
                last.extend_from_slice(&x[(end - 1) * dim..end * dim]);
            }
        }
        let m = last.len() / dim;
        let mut normed = vec![0f32; last.len()];
        rmsnorm(&last, &self.norm, c.eps, &mut normed);
        let mut logits = vec![0f32; m * vocab];
        matmul(&[&self.lm_head], &[&normed], &mut [&mut logits], &mut scratch)?;
        let Some((comm, rank)) = comm else {
            return Ok(logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect());
        };
        // Vocabulary-parallel head: row i of the logits is every rank's row i, in rank order.
        let parts = comm.gather_to_first(rank, &logits)?;
        if rank != 0 {
            return Ok(Vec::new());
        }
        Ok((0..m)
            .map(|i| {
                let mut row = Vec::with_capacity(c.vocab);
                for p in &parts {
                    let w = p.len() / m.max(1);
                    row.extend_from_slice(&p[i * w..(i + 1) * w]);
                }
                row
            })
            .collect())
    }

    fn rope(&self, v: &mut [f32], pos: usize) {
        let hd = self.cfg.head_dim();
        for head in v.chunks_exact_mut(hd) {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let (sin, cos) = (pos as f32 * f).sin_cos();
                let (a, b) = match self.cfg.rope {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::NeoX => (i, i + hd / 2),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

fn tensor_err(name: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Tensor { name: name.to_string(), reason: reason.into() }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `out[t] = x[t] / rms(x[t]) · w` for every row `t`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        or.iter_mut().zip(xr.iter().zip(w)).for_each(|(o, (a, b))| *o = a * inv * b);
    }
}

/// Reusable buffers of [`matmul`] and [`row_parallel`].
struct Scratch {
    kernel: Kernel,
    acts: Vec<QuantizedActs>,
    yt: Vec<f32>,
    partials: Vec<f32>,
    /// [`MAX_PARTIALS`], smaller in tests.
    max_partials: usize,
}

impl Default for Scratch {
    fn default() -> Self {
        Self {
            kernel: Kernel::detect(),
            acts: Vec::new(),
            yt: Vec::new(),
            partials: Vec::new(),
            max_partials: MAX_PARTIALS,
        }
    }
}

/// `ys[i][t] = ws[i] · x[t]` for every row `t` of the input (`T × cols`; `ys[i]`: `T ×
/// ws[i].rows`). `xs` holds one input that every matrix reads, or one input per matrix.
/// Matrices that read the same input (Q, K and V; gate and up) go in one call: the
/// activations are quantized once and one parallel pass covers all their rows, split over
/// the rayon pool in strips of output rows (each strip within one matrix).
fn matmul(ws: &[&Matrix], xs: &[&[f32]], ys: &mut [&mut [f32]], scratch: &mut Scratch) -> Result<(), ModelError> {
    debug_assert!(xs.len() == 1 || xs.len() == ws.len());
    let input = |i: usize| if xs.len() == 1 { 0 } else { i };
    let t = xs[0].len() / ws[0].cols;
    if t == 0 {
        return Ok(());
    }
    let kernel = scratch.kernel;
    // Quantize every activation row once (quantized weights meet Q8 activations).
    if scratch.acts.len() < xs.len() {
        scratch.acts.resize_with(xs.len(), QuantizedActs::default);
    }
    for (j, x) in xs.iter().enumerate() {
        let mut readers = ws.iter().enumerate().filter(|(i, _)| input(*i) == j).map(|(_, w)| w);
        if let Some(w) = readers.clone().find(|w| w.ty.block_len() == super::quant::QK) {
            debug_assert!(readers.all(|r| r.cols == w.cols) && x.len() == t * w.cols);
            scratch.acts[j].quantize(kernel, x, w.cols);
        }
    }
    let acts = &scratch.acts;
    // Strips of output rows: small enough for every thread to get several, large enough
    // (for long batches) that each strip's weights are reused across many tokens.
    let total: usize = ws.iter().map(|w| w.rows).sum();
    let threads = rayon::current_num_threads().max(1);
    let strip = (total / (threads * 8)).clamp(16, 256) / 4 * 4;
    // Output transposed (`rows × T`) so each strip owns a contiguous slice.
    scratch.yt.resize(total * t, 0.0);
    let mut tasks = Vec::with_capacity(total / strip + ws.len());
    let mut rest: &mut [f32] = &mut scratch.yt[..total * t];
    for (i, w) in ws.iter().enumerate() {
        for r0 in (0..w.rows).step_by(strip) {
            let n = strip.min(w.rows - r0);
            let (out, tail) = rest.split_at_mut(n * t);
            rest = tail;
            tasks.push((*w, input(i), r0, n, out));
        }
    }
    tasks.into_par_iter().try_for_each(|(w, j, r0, n, out)| {
        if w.ty.block_len() == super::quant::QK {
            let rows = w.rows_bytes(r0, n);
            return dot_rows_tokens(kernel, w.ty, rows, n, &acts[j], out);
        }
        let cols = w.cols;
        for (i, yr) in out.chunks_exact_mut(t).enumerate() {
            let wr = w.row(r0 + i);
            for (tt, y) in yr.iter_mut().enumerate() {
                *y = dot_row(kernel, w.ty, wr, &xs[j][tt * cols..(tt + 1) * cols], &[])?;
            }
        }
        Ok::<_, QuantError>(())
    })?;
    // Back to token-major, token rows in parallel.
    let mut base = 0;
    for (w, y) in ws.iter().zip(ys.iter_mut()) {
        debug_assert_eq!(y.len(), t * w.rows);
        if w.rows == 0 {
            continue;
        }
        let yt = &scratch.yt[base * t..(base + w.rows) * t];
        y.par_chunks_mut(w.rows).enumerate().for_each(|(tt, yr)| {
            yr.iter_mut().enumerate().for_each(|(r, v)| *v = yt[r * t + tt]);
        });
        base += w.rows;
    }
    Ok(())
}

/// A row-parallel layer (O, down) over `t` input rows: column segment `j` of `x` meets
/// `parts[j]`, and the partial outputs are summed in segment order into `out` — across the
/// group when there is one ([`Communicator::all_reduce_sum`]), locally otherwise. Either way
/// the same additions in the same order, so every tensor-parallel size gives the same bits.
fn row_parallel(
    parts: &[Matrix],
    x: &[f32],
    t: usize,
    out: &mut [f32],
    scratch: &mut Scratch,
    comm: Option<(&dyn Communicator, usize)>,
) -> Result<(), ModelError> {
    let (k, cols, rows) = (parts.len(), parts[0].cols, parts[0].rows);
    let width = k * cols;
    let segment = |j: usize| -> Vec<f32> {
        (0..t).flat_map(|r| &x[r * width + j * cols..r * width + (j + 1) * cols]).copied().collect()
    };
    let mut partials = std::mem::take(&mut scratch.partials);
    // Segments computed together in one parallel pass, as many as fit in `MAX_PARTIALS`
    // floats (a long prefill of a wide model would otherwise hold S full outputs). Across
    // a group every rank hands over all of its S / N partials at once.
    let group = if comm.is_some() { k } else { (scratch.max_partials / (t * rows).max(1)).clamp(1, k) };
    let mut result = Ok(());
    for g0 in (0..k).step_by(group) {
        let n = group.min(k - g0);
        let xs: Vec<Vec<f32>> = if k == 1 { Vec::new() } else { (g0..g0 + n).map(segment).collect() };
        let inputs: Vec<&[f32]> = if k == 1 { vec![x] } else { xs.iter().map(Vec::as_slice).collect() };
        partials.resize(n * t * rows, 0.0);
        let mut ys: Vec<&mut [f32]> = partials.chunks_exact_mut(t * rows).collect();
        let ws: Vec<&Matrix> = parts[g0..g0 + n].iter().collect();
        if let Err(e) = matmul(&ws, &inputs, &mut ys, scratch) {
            result = Err(e);
            break;
        }
        match comm {
            Some((comm, rank)) => result = comm.all_reduce_sum(rank, &partials, out).map_err(ModelError::from),
            // The same order as one pass: ((p0 + p1) + p2) + …
            None if g0 == 0 => sum_parts(&partials, out),
            None => add_parts(&partials, out),
        }
    }
    scratch.partials = partials;
    result
}

/// Floats of partial outputs [`row_parallel`] keeps at once on one rank (16 MiB).
const MAX_PARTIALS: usize = 4 << 20;

#[cfg(test)]
mod tests;
