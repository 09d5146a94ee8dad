//! The activations of one matrix product laid out for the AVX-512 VNNI kernel
//! (`vnni512::gemm`) and its portable model (`vnni_model`): a 512-bit register holds 64
//! activations, two 32-value blocks — of one token (decode), or the same block of two tokens.
//!
//! Plain Rust, no SIMD: built on every CPU, so the model's tests check this layout too.

use rayon::prelude::*;

use super::super::quant::{Q8Block, QK};

/// 64 activations laid out for the kernel: two 32-value blocks (of one token, or the same
/// block of two tokens) and each lane's block scale.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct PairBlock {
    /// Quantized values: block `a`, then block `b`.
    pub(super) qs: [i8; 64],
    /// Each lane's block scale.
    pub(super) d: [f32; 16],
}

impl PairBlock {
    pub(super) const EMPTY: PairBlock = PairBlock { qs: [0; 64], d: [0.0; 16] };

    /// `a` then `b` (absent: zeros, contributing nothing).
    pub fn new(a: &Q8Block, b: Option<&Q8Block>) -> Self {
        let zero = Q8Block { d: 0.0, s: 0.0, qs: [0; QK] };
        let b = b.unwrap_or(&zero);
        let mut p = PairBlock { qs: [0; 64], d: [a.d; 16] };
        p.qs[..32].copy_from_slice(&a.qs);
        p.qs[32..].copy_from_slice(&b.qs);
        p.d[8..].fill(b.d);
        p
    }
}

/// Activations laid out for `vnni512::gemm` (see the module docs): `pairs` holds, for one token,
/// its blocks two by two; for more, token pairs (`t.div_ceil(2)` of them, the last padded with
/// zeros) each with all their blocks. `s` holds every block's `d·Σq`, block-major with
/// `stride` (`t` rounded up to 8) values per block and 8 values of padding, so a tile's
/// tokens load theirs as one vector.
#[derive(Default)]
pub struct Panel {
    pub(super) pairs: Vec<PairBlock>,
    pub(super) s: Vec<f32>,
    pub(super) t: usize,
    pub(super) blocks: usize,
    pub(super) stride: usize,
}

impl Panel {
    /// Lay out `xq` (`t` tokens × `blocks` blocks), on the rayon pool.
    pub fn build(&mut self, xq: &[Q8Block], blocks: usize) {
        let blocks = blocks.max(1);
        let t = xq.len() / blocks;
        (self.t, self.blocks, self.stride) = (t, blocks, t.next_multiple_of(8));
        if t == 1 {
            let pairs = blocks.div_ceil(2);
            self.pairs.resize(pairs, PairBlock::EMPTY);
            self.pairs.iter_mut().zip(xq.chunks(2)).for_each(|(o, c)| *o = PairBlock::new(&c[0], c.get(1)));
        } else {
            self.pairs.resize(t.div_ceil(2) * blocks, PairBlock::EMPTY);
            self.pairs.par_chunks_mut(blocks).zip(xq.par_chunks(2 * blocks)).for_each(|(out, two)| {
                let (a, b) = two.split_at(blocks);
                for (i, o) in out.iter_mut().enumerate() {
                    *o = PairBlock::new(&a[i], b.get(i));
                }
            });
        }
        self.s.clear();
        self.s.resize(blocks.div_ceil(2) * 2 * self.stride + 8, 0.0);
        for (j, tok) in xq.chunks_exact(blocks).enumerate() {
            for (b, blk) in tok.iter().enumerate() {
                self.s[b * self.stride + j] = blk.s;
            }
        }
    }

    /// Whether this panel holds `t` tokens of `blocks` blocks.
    pub fn fits(&self, t: usize, blocks: usize) -> bool {
        let pairs = if t == 1 { blocks.div_ceil(2) } else { t.div_ceil(2) * blocks };
        self.t == t && self.blocks == blocks && self.pairs.len() == pairs
    }
}
