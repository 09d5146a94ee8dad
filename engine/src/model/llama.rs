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
//! `block_table[p / block_size]` of the `cpu` backend's [`KvStore`]; a step first writes its
//! new tokens' K/V, then each token attends to positions `0..=p` through the table. Blocks
//! shared through the prefix cache are simply read by several sequences.
//!
//! [`Llama::forward_rank`] runs in named steps: embed, then per block the attention block and
//! the MLP block, then gather the logits. The weights' type is [`Matrix`] (`tensor.rs`); the
//! GGUF loader is `gguf_loader.rs`, the HF one `hf.rs`.

use std::ops::Range;

use rayon::prelude::*;

use super::gguf::GgufError;
use super::quant::QuantError;
use super::simd::{attend_rows, dot_row, dot_rows_tokens, AttnShape, Kernel, KvRows, QuantizedActs};
pub use super::tensor::Matrix;
use super::tp::{add_parts, sum_parts, CommError, Communicator, TpDims, TpPlan};
pub use crate::backend::cpu::kv_store::KvStore;
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
    /// Return instead the sum over this step's tokens of the final hidden state (after the
    /// model's last norm; `dim` floats): a pooling request's share of its mean.
    pub pool: bool,
}

pub(super) fn cfg_err(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Config { key: key.to_string(), reason: reason.into() }
}

impl Llama {
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
    /// last token of every sequence that asked for them, or its pooled sum (`dim` floats)
    /// for a pooling sequence, in order.
    pub fn forward(&self, kv: &mut KvStore, seqs: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_rank(kv, seqs, None)
    }

    /// [`Self::forward`] for one rank of a tensor-parallel group (`self` a [`Self::shard`]):
    /// the partial outputs of O and down are summed over `comm`, and rank 0 gathers the
    /// logits (other ranks return none). `None`: the whole model, no collectives.
    ///
    /// The steps: `embed` the tokens, then per block `attention_block` and `mlp_block`
    /// (each adds its output to the residual stream), then `gather_logits`.
    pub fn forward_rank(
        &self,
        kv: &mut KvStore,
        seqs: &[SeqInput<'_>],
        comm: Option<(&dyn Communicator, usize)>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let Some(l0) = self.layers.first() else { return Err(cfg_err("block_count", "the model has no blocks")) };
        // This rank's widths (the whole model's without TP): attention, K/V, MLP.
        let (qd, kvd, ffn) = (l0.wq.rows, l0.wk.rows, l0.w_gate.rows);
        if kv.kv_dim() != kvd {
            return Err(cfg_err("kv_cache", format!("holds {} floats per token, the model needs {kvd}", kv.kv_dim())));
        }
        let rows = StepRows::new(seqs, kv)?;
        let mut x = self.embed(seqs)?;
        let mut act = Activations::new(rows.len(), self.cfg.dim, qd, kvd, ffn);
        for (li, (l, rp)) in self.layers.iter().zip(&self.row_parallel).enumerate() {
            self.attention_block(li, l, rp, &rows, kv, &mut x, &mut act, comm)?;
            self.mlp_block(l, rp, &mut x, &mut act, comm)?;
        }
        self.gather_logits(&x, seqs, &mut act.scratch, comm)
    }

    /// The embedding of every token of the step, one row of `dim` per token.
    fn embed(&self, seqs: &[SeqInput<'_>]) -> Result<Vec<f32>, ModelError> {
        let (dim, vocab) = (self.cfg.dim, self.cfg.vocab);
        let t: usize = seqs.iter().map(|q| q.tokens.len()).sum();
        let mut x = vec![0f32; t * dim];
        for (row, &tok) in x.chunks_exact_mut(dim).zip(seqs.iter().flat_map(|q| q.tokens)) {
            if tok as usize >= vocab {
                return Err(cfg_err("token", format!("id {tok} is outside the vocabulary of {vocab}")));
            }
            self.embed.row_f32(tok as usize, row)?;
        }
        Ok(x)
    }

    /// `x += Wo · attn(rope(Wq·n), rope(Wk·n), Wv·n)`, `n = rmsnorm(x)·attn_norm`, for block
    /// `li`: this step's K/V are written to the cache first (a token attends to itself and to
    /// the earlier tokens of its own chunk).
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        li: usize,
        l: &LayerWeights,
        rp: &RowParallel,
        rows: &StepRows,
        kv: &mut KvStore,
        x: &mut [f32],
        act: &mut Activations,
        comm: Option<(&dyn Communicator, usize)>,
    ) -> Result<(), ModelError> {
        let (qd, kvd) = (act.qd, act.kvd);
        rmsnorm(x, &l.attn_norm, self.cfg.eps, &mut act.n);
        matmul(&[&l.wq, &l.wk, &l.wv], &[&act.n], &mut [&mut act.q, &mut act.k, &mut act.v], &mut act.scratch)?;
        for (r, &(_, pos)) in rows.rows.iter().enumerate() {
            self.rope(&mut act.q[r * qd..(r + 1) * qd], pos);
            self.rope(&mut act.k[r * kvd..(r + 1) * kvd], pos);
        }
        {
            let (kc, vc) = kv.layer_mut(li);
            for (r, row_slots) in rows.slots.iter().enumerate() {
                let at = row_slots[row_slots.len() - 1];
                kc[at..at + kvd].copy_from_slice(&act.k[r * kvd..(r + 1) * kvd]);
                vc[at..at + kvd].copy_from_slice(&act.v[r * kvd..(r + 1) * kvd]);
            }
        }
        let (kc, vc) = kv.layer(li);
        let hd = self.cfg.head_dim();
        let shape = AttnShape { n_heads: qd / hd, n_kv_heads: kvd / hd, head_dim: hd };
        attention(act.scratch.kernel, shape, rows, &act.q, kc, vc, &mut act.att);
        row_parallel(&rp.wo, &act.att, rows.len(), &mut act.o, &mut act.scratch, comm)?;
        x.iter_mut().zip(&act.o).for_each(|(a, b)| *a += b);
        Ok(())
    }

    /// `x += Wdown · (silu(Wgate·m) ⊙ Wup·m)`, `m = rmsnorm(x)·ffn_norm`.
    fn mlp_block(
        &self,
        l: &LayerWeights,
        rp: &RowParallel,
        x: &mut [f32],
        act: &mut Activations,
        comm: Option<(&dyn Communicator, usize)>,
    ) -> Result<(), ModelError> {
        rmsnorm(x, &l.ffn_norm, self.cfg.eps, &mut act.n);
        matmul(&[&l.w_gate, &l.w_up], &[&act.n], &mut [&mut act.g, &mut act.u], &mut act.scratch)?;
        act.g.iter_mut().zip(&act.u).for_each(|(a, b)| *a = *a / (1.0 + (-*a).exp()) * b);
        let t = x.len() / self.cfg.dim;
        row_parallel(&rp.down, &act.g, t, &mut act.o, &mut act.scratch, comm)?;
        x.iter_mut().zip(&act.o).for_each(|(a, b)| *a += b);
        Ok(())
    }

    /// The logits of the last token of every sequence that samples: final norm and LM head;
    /// with a group, this rank's vocabulary rows gathered on rank 0 (the others return none).
    /// A pooling sequence gets the sum of its tokens' normed hidden states instead (the
    /// residual stream is whole on every rank, so no collective is needed for it).
    fn gather_logits(
        &self,
        x: &[f32],
        seqs: &[SeqInput<'_>],
        scratch: &mut Scratch,
        comm: Option<(&dyn Communicator, usize)>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let (dim, vocab) = (self.cfg.dim, self.lm_head.rows);
        let mut last = Vec::new();
        let mut pooled = Vec::new();
        let mut end = 0;
        for q in seqs {
            let begin = end;
            end += q.tokens.len();
            if q.pool {
                let rows = &x[begin * dim..end * dim];
                let mut normed = vec![0f32; rows.len()];
                rmsnorm(rows, &self.norm, self.cfg.eps, &mut normed);
                let mut sum = vec![0f32; dim];
                for row in normed.chunks_exact(dim) {
                    sum.iter_mut().zip(row).for_each(|(s, v)| *s += v);
                }
                pooled.push(sum);
            } else if q.logits && !q.tokens.is_empty() {
                last.extend_from_slice(&x[(end - 1) * dim..end * dim]);
            }
        }
        let m = last.len() / dim;
        let mut normed = vec![0f32; last.len()];
        rmsnorm(&last, &self.norm, self.cfg.eps, &mut normed);
        let mut logits = vec![0f32; m * vocab];
        matmul(&[&self.lm_head], &[&normed], &mut [&mut logits], scratch)?;
        let logits: Vec<Vec<f32>> = match comm {
            None => logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect(),
            Some((comm, rank)) => {
                // Vocabulary-parallel head: row i of the logits is every rank's row i, in rank order.
                let parts = comm.gather_to_first(rank, &logits)?;
                if rank != 0 {
                    return Ok(Vec::new());
                }
                (0..m)
                    .map(|i| {
                        let mut row = Vec::with_capacity(self.cfg.vocab);
                        for p in &parts {
                            let w = p.len() / m.max(1);
                            row.extend_from_slice(&p[i * w..(i + 1) * w]);
                        }
                        row
                    })
                    .collect()
            }
        };
        // One row per sequence that asked, in order.
        let (mut logits, mut pooled) = (logits.into_iter(), pooled.into_iter());
        Ok(seqs
            .iter()
            .filter_map(|q| match (q.pool, q.logits && !q.tokens.is_empty()) {
                (true, _) => pooled.next(),
                (false, true) => logits.next(),
                (false, false) => None,
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

/// The rows of one step: row `r` is position `rows[r].1` of sequence `rows[r].0`; `slots[r]`
/// are the cache offsets of that sequence's positions `0..=pos` (the same in every layer),
/// `lens[r]` their count; `tiles` group up to 4 consecutive rows of one sequence, which share
/// their K/V reads in attention.
struct StepRows {
    rows: Vec<(usize, usize)>,
    slots: Vec<Vec<usize>>,
    lens: Vec<usize>,
    tiles: Vec<(usize, usize)>,
}

impl StepRows {
    /// The rows of `seqs`, whose block tables must cover their positions in `kv`.
    fn new(seqs: &[SeqInput<'_>], kv: &KvStore) -> Result<Self, ModelError> {
        for (s, q) in seqs.iter().enumerate() {
            let need = (q.start + q.tokens.len()).div_ceil(kv.block_size());
            if q.block_table.len() < need {
                return Err(cfg_err(
                    "block_table",
                    format!("sequence {s} needs {need} blocks, has {}", q.block_table.len()),
                ));
            }
        }
        let rows: Vec<(usize, usize)> =
            seqs.iter().enumerate().flat_map(|(s, q)| (0..q.tokens.len()).map(move |i| (s, q.start + i))).collect();
        let slots: Vec<Vec<usize>> =
            rows.iter().map(|&(s, pos)| (0..=pos).map(|p| kv.slot(seqs[s].block_table, p)).collect()).collect();
        let lens = slots.iter().map(Vec::len).collect();
        let mut tiles: Vec<(usize, usize)> = Vec::new();
        for (r, &(s, _)) in rows.iter().enumerate() {
            match tiles.last_mut() {
                Some((r0, n)) if rows[*r0].0 == s && *n < 4 => *n += 1,
                _ => tiles.push((r, 1)),
            }
        }
        Ok(StepRows { rows, slots, lens, tiles })
    }

    /// Rows in the step.
    fn len(&self) -> usize {
        self.rows.len()
    }
}

/// The step's activations (`T` rows each), reused by every block, and the matmul scratch.
struct Activations {
    /// This rank's query and K/V widths.
    qd: usize,
    kvd: usize,
    n: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    scratch: Scratch,
}

impl Activations {
    fn new(t: usize, dim: usize, qd: usize, kvd: usize, ffn: usize) -> Self {
        Activations {
            qd,
            kvd,
            n: vec![0f32; t * dim],
            q: vec![0f32; t * qd],
            k: vec![0f32; t * kvd],
            v: vec![0f32; t * kvd],
            att: vec![0f32; t * qd],
            o: vec![0f32; t * dim],
            g: vec![0f32; t * ffn],
            u: vec![0f32; t * ffn],
            scratch: Scratch::default(),
        }
    }
}

/// Attention of every row of the step (`q`) over one layer's cache (`kc`, `vc`) into `att`,
/// on the rayon pool: one job per tile, except that a lone row (a decode) is split by K/V head
/// so one sequence's attention still spreads over the pool. Heads are independent: a head's
/// result is the same bits either way.
fn attention(kernel: Kernel, shape: AttnShape, rows: &StepRows, q: &[f32], kc: &[f32], vc: &[f32], att: &mut [f32]) {
    let hd = shape.head_dim;
    let (qd, group) = (shape.n_heads * hd, shape.n_heads / shape.n_kv_heads);
    let mut rest: &mut [f32] = att;
    let mut jobs = Vec::with_capacity(rows.tiles.len() * shape.n_kv_heads);
    for &(r0, n) in &rows.tiles {
        let (out, tail) = rest.split_at_mut(n * qd);
        rest = tail;
        if n == 1 {
            jobs.extend(out.chunks_exact_mut(group * hd).enumerate().map(|(h, o)| (r0, 1, Some(h), o)));
        } else {
            jobs.push((r0, n, None, out));
        }
    }
    jobs.into_par_iter().for_each_init(Vec::new, |scores, (r0, n, head, out)| {
        let (q, slots, lens) = (&q[r0 * qd..(r0 + n) * qd], &rows.slots[r0 + n - 1], &rows.lens[r0..r0 + n]);
        match head {
            None => attend_rows(kernel, shape, q, out, KvRows { k: kc, v: vc, slots }, lens, scores),
            Some(h) => {
                // K/V head `h` alone: its rows start `h · hd` into each cached slot.
                let one = AttnShape { n_heads: group, n_kv_heads: 1, head_dim: hd };
                let kv = KvRows { k: &kc[h * hd..], v: &vc[h * hd..], slots };
                attend_rows(kernel, one, &q[h * group * hd..(h + 1) * group * hd], out, kv, lens, scores);
            }
        }
    });
}

pub(super) fn tensor_err(name: &str, reason: impl Into<String>) -> ModelError {
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
