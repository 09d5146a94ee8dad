//! AVX-512 VNNI tiles: `R` weight rows × `N` tokens per pass, two 32-weight blocks per
//! 512-bit vector.
//!
//! The 256-bit batched kernels spend most of their instructions on per-block bookkeeping
//! rather than on products. Here each pass over a pair of blocks unpacks `R` weight pairs
//! once and meets them with `N` token pairs already laid out for the kernel ([`PairBlock`],
//! built once per matmul): one `vpdpbusd`, one convert and one scale multiply per 64 weights.
//!
//! Lane layout of a pair of blocks `a`, `b` (16 i32 lanes of 4 bytes): `a` in the low 256
//! bits, `b` in the high 256 bits. The float accumulation then runs on 256-bit halves, block
//! `a` before block `b`, exactly as the one-block-at-a-time kernels (and llama.cpp's
//! `vec_dot`) do: every (row, token) result is bit-identical to theirs, whatever `R`, `N`
//! and the rest of the batch.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::super::gguf::GgmlType;
use super::super::quant::{Q8Block, QK};

/// One token's activations for one pair of blocks, laid out for the kernel.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct PairBlock {
    /// Quantized values: block `a`, then block `b`.
    qs: [i8; 64],
    /// Each lane's block scale.
    d: [f32; 16],
}

impl PairBlock {
    /// The pair `a`, `b` (`b` absent past an odd block count: zeros, contributing nothing).
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

/// Activations laid out for [`gemm`]: `t` tokens of `blocks.div_ceil(2)` pairs, and every
/// block's `d·Σq` block-major (`s[block · t + token]`, zero past an odd count) so that a
/// tile's tokens load theirs as one vector.
#[derive(Default)]
pub struct Panel {
    pairs: Vec<PairBlock>,
    s: Vec<f32>,
    t: usize,
}

impl Panel {
    /// Lay out `xq` (`t` tokens × `blocks` blocks), tokens in parallel on the rayon pool.
    pub fn build(&mut self, xq: &[Q8Block], blocks: usize) {
        let blocks = blocks.max(1);
        let (t, pairs) = (xq.len() / blocks, blocks.div_ceil(2));
        self.t = t;
        let empty = PairBlock { qs: [0; 64], d: [0.0; 16] };
        self.pairs.resize(t * pairs, empty);
        self.pairs.par_chunks_mut(pairs).zip(xq.par_chunks(blocks)).for_each(|(out, tok)| {
            out.iter_mut().zip(tok.chunks(2)).for_each(|(o, c)| *o = PairBlock::new(&c[0], c.get(1)));
        });
        self.s.clear();
        self.s.resize(pairs * 2 * t, 0.0);
        for (j, tok) in xq.chunks_exact(blocks).enumerate() {
            for (b, blk) in tok.iter().enumerate() {
                self.s[b * t + j] = blk.s;
            }
        }
    }

    /// Whether this panel holds `t` tokens of `blocks` blocks.
    pub fn fits(&self, t: usize, blocks: usize) -> bool {
        self.t == t && self.pairs.len() == t * blocks.div_ceil(2)
    }
}

/// Bytes of one block of `ty`, and whether its weights are signed (`Q4_0`, `Q8_0`).
const fn layout(ty: u8) -> (usize, bool) {
    match ty {
        Q4_1 => (20, false),
        Q4_0 => (18, true),
        _ => (34, true),
    }
}

/// Const-generic names of the weight types.
pub const Q4_1: u8 = 0;
/// See [`Q4_1`].
pub const Q4_0: u8 = 1;
/// See [`Q4_1`].
pub const Q8_0: u8 = 2;

/// The const-generic name of `ty`, if a tile kernel serves it.
pub fn type_id(ty: GgmlType) -> Option<u8> {
    match ty {
        GgmlType::Q4_1 => Some(Q4_1),
        GgmlType::Q4_0 => Some(Q4_0),
        GgmlType::Q8_0 => Some(Q8_0),
        _ => None,
    }
}

/// One weight pair unpacked: unsigned values in the lane layout, and `[d_a, m_a, d_b, m_b]`
/// (`m` = 0 for types without a min). `single`: block `b` is past the row's end.
///
/// # Safety
/// `p` points at block `a`, with one whole block readable (two unless `single`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack<const TY: u8>(p: *const u8, single: bool) -> (__m512i, __m128) {
    let (bytes, _) = layout(TY);
    // SAFETY (every read below): within block `a`, or within block `b` when `!single`.
    unsafe {
        let head = |q: *const u8| -> i32 {
            if TY == Q4_1 {
                (q as *const i32).read_unaligned()
            } else {
                i32::from((q as *const u16).read_unaligned())
            }
        };
        let hb = if single { 0 } else { head(p.add(bytes)) };
        let scales = _mm_cvtph_ps(_mm_set_epi32(0, 0, hb, head(p)));
        let w = if TY == Q8_0 {
            let part = |q: *const u8| _mm_loadu_si128(q as *const __m128i);
            let zero = _mm_setzero_si128();
            let (b0, b1) = if single { (zero, zero) } else { (part(p.add(36)), part(p.add(52))) };
            let lo = _mm256_set_m128i(part(p.add(18)), part(p.add(2)));
            let hi = _mm256_set_m128i(b1, b0);
            let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            _mm512_xor_si512(v, _mm512_set1_epi8(-128))
        } else {
            let off = if TY == Q4_1 { 4 } else { 2 };
            let a = _mm_loadu_si128(p.add(off) as *const __m128i);
            let b = if single { _mm_setzero_si128() } else { _mm_loadu_si128(p.add(bytes + off) as *const __m128i) };
            let y = _mm256_set_m128i(b, a);
            let m = _mm256_set1_epi8(0x0f);
            let lo = _mm256_and_si256(y, m);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(y), m);
            // [lo_a, lo_b, hi_a, hi_b] → [lo_a, hi_a, lo_b, hi_b]: block a's 32 values, then b's.
            let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            _mm512_shuffle_i64x2::<0b11_01_10_00>(v, v)
        };
        // `head` read [d, m] for Q4_1 and [d, 0] otherwise: lanes are [d_a, m_a, d_b, m_b].
        (w, scales)
    }
}

/// The high 256 bits (AVX-512 F only: `extractf32x8` would need DQ).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn high(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

/// `out[i * stride + j] = row_i · token_j` for `R` rows from `w` (`row_bytes` apart) and
/// `N` tokens from `x` (`pairs` [`PairBlock`]s apart; their `d·Σq` at `s`, `t` apart per block).
///
/// # Safety
/// `w` holds `R` rows of `row_bytes` (= the bytes of `2·pairs − odd` blocks); `x` holds `N ×
/// pairs` blocks; `s` holds `2·pairs` blocks of `t` values from the tile's first token; `out`
/// has room for `(R − 1)·stride + N` values; `N` ≤ 4.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const TY: u8, const R: usize, const N: usize>(
    w: *const u8,
    row_bytes: usize,
    x: *const PairBlock,
    pairs: usize,
    odd: bool,
    s: *const f32,
    t: usize,
    out: *mut f32,
    stride: usize,
) {
    let (bytes, signed) = layout(TY);
    let idx_d = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    // The Q4_1 min term, one lane per token (the scalar sum of the one-block kernels).
    let mut mins = [_mm_setzero_ps(); R];
    for p in 0..pairs {
        let single = odd && p + 1 == pairs;
        // SAFETY: blocks 2p and 2p + 1 of the tile's tokens are within `s`.
        let load_s = |b: usize| unsafe {
            if N == 4 {
                _mm_loadu_ps(s.add(b * t))
            } else {
                _mm_load_ss(s.add(b * t))
            }
        };
        let (sa, sb) =
            if TY == Q4_1 { (load_s(2 * p), load_s(2 * p + 1)) } else { (_mm_setzero_ps(), _mm_setzero_ps()) };
        // Signed weights are read as unsigned (+8 for Q4_0, +128 for Q8_0): each token's
        // accumulator starts at −offset × (the sum of each lane's 4 values), exact in i32.
        let init: [__m512i; N] = std::array::from_fn(|j| {
            if !signed {
                return _mm512_setzero_si512();
            }
            // SAFETY: token `j`, pair `p` is within `x`; `PairBlock` is 64-byte aligned.
            let xv = unsafe { _mm512_load_si512((*x.add(j * pairs + p)).qs.as_ptr() as *const _) };
            let offset = _mm512_set1_epi8(if TY == Q4_0 { 8 } else { -128 });
            _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, xv))
        });
        for (i, acc_i) in acc.iter_mut().enumerate() {
            // SAFETY: row `i`, pair `p` is within `w` (caller's contract).
            let (wv, ws) = unsafe { unpack::<TY>(w.add(i * row_bytes + p * 2 * bytes), single) };
            let wd = _mm512_permutexvar_ps(idx_d, _mm512_castps128_ps512(ws));
            for (j, a) in acc_i.iter_mut().enumerate() {
                // SAFETY: token `j`, pair `p` is within `x`; `PairBlock` is 64-byte aligned.
                let xb = unsafe { &*x.add(j * pairs + p) };
                let xv = unsafe { _mm512_load_si512(xb.qs.as_ptr() as *const _) };
                let dp = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init[j], wv, xv));
                let sc = _mm512_mul_ps(wd, unsafe { _mm512_load_ps(xb.d.as_ptr()) });
                *a = _mm256_fmadd_ps(_mm512_castps512_ps256(sc), _mm512_castps512_ps256(dp), *a);
                *a = _mm256_fmadd_ps(high(sc), high(dp), *a);
            }
            if TY == Q4_1 {
                // `ws` is [d_a, m_a, d_b, m_b]: the same products and sums as the one-block
                // kernels' `mins += m · s`, block a then block b.
                let (ma, mb) = (_mm_permute_ps::<0b01_01_01_01>(ws), _mm_permute_ps::<0b11_11_11_11>(ws));
                mins[i] = _mm_add_ps(mins[i], _mm_mul_ps(ma, sa));
                mins[i] = _mm_add_ps(mins[i], _mm_mul_ps(mb, sb));
            }
        }
    }
    for (i, acc_i) in acc.iter().enumerate() {
        let mut m = [0f32; 4];
        // SAFETY: `m` has room for 4 floats.
        unsafe { _mm_storeu_ps(m.as_mut_ptr(), mins[i]) };
        for (j, a) in acc_i.iter().enumerate() {
            // SAFETY: within `out` (caller's contract).
            unsafe { *out.add(i * stride + j) = super::avx2::hsum(*a) + m[j] };
        }
    }
}

/// `out[r * t + j] = row_r · token_j` for the `rows` rows of `w` and the `t` tokens of `x`
/// (`blocks` blocks per row), in tiles of 4 rows × 4 tokens (then remainders).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are available; `w` is exactly `rows` rows of
/// `blocks` blocks of type `TY`; `x` [`fits`](Panel::fits) `t` tokens of `blocks`; `out` is
/// `rows × t`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn gemm<const TY: u8>(w: &[u8], rows: usize, blocks: usize, x: &Panel, out: &mut [f32]) {
    let (bytes, _) = layout(TY);
    let row_bytes = blocks * bytes;
    let pairs = blocks.div_ceil(2);
    let t = x.t;
    debug_assert_eq!(w.len(), rows * row_bytes);
    debug_assert!(x.fits(out.len() / rows.max(1), blocks));
    let odd = blocks % 2 == 1;
    let (wp, xp, sp, op) = (w.as_ptr(), x.pairs.as_ptr(), x.s.as_ptr(), out.as_mut_ptr());
    // Tokens outer, rows inner: a group of tokens stays in L1 while the rows stream past it.
    let mut j = 0;
    while j < t {
        let n = if t - j >= 4 { 4 } else { 1 };
        let mut i = 0;
        while i < rows {
            let r = if rows - i >= 4 { 4 } else { 1 };
            // SAFETY: rows `i..i + r` and tokens `j..j + n` are within the extents above.
            unsafe {
                let (wi, xj, sj, o) = (wp.add(i * row_bytes), xp.add(j * pairs), sp.add(j), op.add(i * t + j));
                match (r, n) {
                    (4, 4) => tile::<TY, 4, 4>(wi, row_bytes, xj, pairs, odd, sj, t, o, t),
                    (4, _) => tile::<TY, 4, 1>(wi, row_bytes, xj, pairs, odd, sj, t, o, t),
                    (_, 4) => tile::<TY, 1, 4>(wi, row_bytes, xj, pairs, odd, sj, t, o, t),
                    _ => tile::<TY, 1, 1>(wi, row_bytes, xj, pairs, odd, sj, t, o, t),
                }
            }
            i += r;
        }
        j += n;
    }
}
