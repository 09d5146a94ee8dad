//! AVX-512 VNNI matrix kernels: tiles of weight rows × token rows, 64 products per
//! `vpdpbusd`.
//!
//! The 256-bit one-row kernels spend most of their instructions on per-block bookkeeping
//! rather than on products. Here activations are laid out once per matmul ([`Panel`]) so that
//! a 512-bit register holds 64 of them, and each weight block is unpacked once per tile:
//!
//! - several tokens (`t ≥ 2`): a register holds the same block of two tokens; the weight
//!   block is broadcast to both halves. Tiles of 4 rows × 8 tokens.
//! - one token (decode): a register holds two consecutive blocks of the token; the weight
//!   pair is unpacked the same way. Tiles of 4 rows.
//!
//! Either way each token's 8-lane float accumulator takes its blocks in order — one FMA of
//! `d_w·d_x` and the block's 8 partial sums per block, the `m·s` term of Q4_1 summed apart,
//! then the same horizontal sum — exactly as the one-row kernels (and llama.cpp's `vec_dot`)
//! do: every result is bit-identical to theirs, whatever the tile and the rest of the batch.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::super::gguf::GgmlType;
use super::panel::{PairBlock, Panel};

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

/// A block's f16 scale and, for Q4_1, its f16 min, as the low and high halves of an i32.
///
/// # Safety
/// `p` points at a readable block.
#[inline]
unsafe fn head<const TY: u8>(p: *const u8) -> i32 {
    // SAFETY: every block starts with its 2-byte scale; Q4_1's is followed by its 2-byte min.
    unsafe {
        if TY == Q4_1 {
            (p as *const i32).read_unaligned()
        } else {
            i32::from((p as *const u16).read_unaligned())
        }
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
        let hb = if single { 0 } else { head::<TY>(p.add(bytes)) };
        let scales = _mm_cvtph_ps(_mm_set_epi32(0, 0, hb, head::<TY>(p)));
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

/// One weight block unpacked into both 256-bit halves (unsigned values), with
/// `[d, m, 0, 0]` (`m` = 0 for types without a min).
///
/// # Safety
/// `p` points at one whole readable block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack1<const TY: u8>(p: *const u8) -> (__m512i, __m128) {
    // SAFETY (every read below): within the block.
    unsafe {
        let scales = _mm_cvtph_ps(_mm_cvtsi32_si128(head::<TY>(p)));
        let w = if TY == Q8_0 {
            let v = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(2) as *const __m256i));
            _mm512_xor_si512(v, _mm512_set1_epi8(-128))
        } else {
            let off = if TY == Q4_1 { 4 } else { 2 };
            let q = _mm512_broadcast_i32x4(_mm_loadu_si128(p.add(off) as *const __m128i));
            let m = _mm512_set1_epi8(0x0f);
            let (lo, hi) = (_mm512_and_si512(q, m), _mm512_and_si512(_mm512_srli_epi16::<4>(q), m));
            // 128-bit lanes [lo, hi, lo, hi]: the block's 32 values in each half.
            _mm512_mask_blend_epi64(0b1100_1100, lo, hi)
        };
        (w, scales)
    }
}

/// The high 256 bits (AVX-512 F only: `extractf32x8` would need DQ).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn high(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

/// One token against `R` rows from `w` (`row_bytes` apart): `out[i * stride] = row_i · x`,
/// two blocks per register (`x`: the token's `pairs` pairs; its `d·Σq` at `s`, `s_stride`
/// apart per block).
///
/// # Safety
/// `w` holds `R` rows of `row_bytes` (= the bytes of `2·pairs − odd` blocks); `x` holds
/// `pairs` pairs; `s` holds `2·pairs` blocks; `out` has room for `(R − 1)·stride + 1` values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_one<const TY: u8, const R: usize>(
    w: *const u8,
    row_bytes: usize,
    x: *const PairBlock,
    pairs: usize,
    odd: bool,
    s: *const f32,
    s_stride: usize,
    out: *mut f32,
    stride: usize,
) {
    let (bytes, signed) = layout(TY);
    let idx_d = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    let mut acc = [_mm256_setzero_ps(); R];
    // The Q4_1 min term (lane 0), summed apart as the one-row kernels do.
    let mut mins = [_mm_setzero_ps(); R];
    for p in 0..pairs {
        let single = odd && p + 1 == pairs;
        // SAFETY: pair `p` and blocks 2p, 2p + 1 are within `x` and `s`.
        let (xb, sa, sb) =
            unsafe { (&*x.add(p), _mm_load_ss(s.add(2 * p * s_stride)), _mm_load_ss(s.add((2 * p + 1) * s_stride))) };
        // SAFETY: `PairBlock` is 64-byte aligned.
        let (xv, xd) = unsafe { (_mm512_load_si512(xb.qs.as_ptr() as *const _), _mm512_load_ps(xb.d.as_ptr())) };
        let init = if signed { offset_sums::<TY>(xv) } else { _mm512_setzero_si512() };
        for i in 0..R {
            // Decode streams every weight once from L3 or memory: ask for the same place two
            // tiles ahead now. A prefetch never faults, so the address may run past `w`.
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((i + 2 * R) * row_bytes + p * 2 * bytes) as *const i8);
            // SAFETY: row `i`, pair `p` is within `w` (caller's contract).
            let (wv, ws) = unsafe { unpack::<TY>(w.add(i * row_bytes + p * 2 * bytes), single) };
            let wd = _mm512_permutexvar_ps(idx_d, _mm512_castps128_ps512(ws));
            let dp = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, wv, xv));
            let sc = _mm512_mul_ps(wd, xd);
            acc[i] = _mm256_fmadd_ps(_mm512_castps512_ps256(sc), _mm512_castps512_ps256(dp), acc[i]);
            acc[i] = _mm256_fmadd_ps(high(sc), high(dp), acc[i]);
            if TY == Q4_1 {
                // `ws` is [d_a, m_a, d_b, m_b].
                let (ma, mb) = (_mm_permute_ps::<0b01_01_01_01>(ws), _mm_permute_ps::<0b11_11_11_11>(ws));
                mins[i] = _mm_add_ps(mins[i], _mm_mul_ps(ma, sa));
                mins[i] = _mm_add_ps(mins[i], _mm_mul_ps(mb, sb));
            }
        }
    }
    for i in 0..R {
        // SAFETY: within `out` (caller's contract).
        unsafe { *out.add(i * stride) = super::avx2::hsum(acc[i]) + _mm_cvtss_f32(mins[i]) };
    }
}

/// Signed weights are read as unsigned (+8 for Q4_0, +128 for Q8_0): a dot product starts at
/// −offset × (the sum of each lane's 4 activations), exact in i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn offset_sums<const TY: u8>(xv: __m512i) -> __m512i {
    let offset = _mm512_set1_epi8(if TY == Q4_0 { 8 } else { -128 });
    _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, xv))
}

/// `2·P` tokens (`P` token pairs from `x`, `blocks` pairs apart; their `d·Σq` at `s`,
/// `s_stride` apart per block) against `R` rows from `w` (`row_bytes` apart):
/// `out[i * stride + j] = row_i · token_j` for the first `n` tokens.
///
/// # Safety
/// `w` holds `R` rows of `blocks` blocks (`row_bytes` each); `x` holds `P × blocks` pairs;
/// `s` holds `blocks` blocks of 8 readable values; `out` has room for `(R − 1)·stride + n`
/// values; `n ≤ 2·P ≤ 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_many<const TY: u8, const R: usize, const P: usize>(
    w: *const u8,
    row_bytes: usize,
    blocks: usize,
    x: *const PairBlock,
    s: *const f32,
    s_stride: usize,
    out: *mut f32,
    stride: usize,
    n: usize,
) {
    let (bytes, signed) = layout(TY);
    // Per (row, token pair): two tokens' 8-lane accumulators side by side.
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    // The Q4_1 min term, one lane per token, summed apart as the one-row kernels do.
    let mut mins = [_mm256_setzero_ps(); R];
    for b in 0..blocks {
        // SAFETY: block `b` of every token pair is within `x`; `PairBlock` is 64-byte aligned.
        let xb: [&PairBlock; P] = std::array::from_fn(|q| unsafe { &*x.add(q * blocks + b) });
        let xv: [__m512i; P] = std::array::from_fn(|q| unsafe { _mm512_load_si512(xb[q].qs.as_ptr() as *const _) });
        let init: [__m512i; P] =
            std::array::from_fn(|q| if signed { offset_sums::<TY>(xv[q]) } else { _mm512_setzero_si512() });
        // SAFETY: 8 values of block `b` are readable at `s` (caller's contract).
        let sv = if TY == Q4_1 { unsafe { _mm256_loadu_ps(s.add(b * s_stride)) } } else { _mm256_setzero_ps() };
        for i in 0..R {
            // As in `tile_one` (a prefetch never faults).
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((i + 2 * R) * row_bytes + b * bytes) as *const i8);
            // SAFETY: row `i`, block `b` is within `w` (caller's contract).
            let (wv, ws) = unsafe { unpack1::<TY>(w.add(i * row_bytes + b * bytes)) };
            let wd = _mm512_broadcastss_ps(ws);
            for q in 0..P {
                let dp = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init[q], wv, xv[q]));
                // SAFETY: as above.
                let sc = _mm512_mul_ps(wd, unsafe { _mm512_load_ps(xb[q].d.as_ptr()) });
                acc[i][q] = _mm512_fmadd_ps(sc, dp, acc[i][q]);
            }
            if TY == Q4_1 {
                let m = _mm256_broadcastss_ps(_mm_permute_ps::<0b01_01_01_01>(ws));
                mins[i] = _mm256_add_ps(mins[i], _mm256_mul_ps(m, sv));
            }
        }
    }
    for i in 0..R {
        let mut m = [0f32; 8];
        // SAFETY: `m` has room for 8 floats.
        unsafe { _mm256_storeu_ps(m.as_mut_ptr(), mins[i]) };
        for j in 0..n {
            let a = acc[i][j / 2];
            let half = if j % 2 == 0 { _mm512_castps512_ps256(a) } else { high(a) };
            // SAFETY: within `out` (caller's contract).
            unsafe { *out.add(i * stride + j) = super::avx2::hsum(half) + m[j] };
        }
    }
}

/// `out[r * t + j] = row_r · token_j` for the `rows` rows of `w` and the `t` tokens of `x`
/// (`blocks` blocks per row), in tiles of 4 rows (then single rows) × 8 tokens (then 4, then
/// 2 — an odd last token shares its pair with zeros) or × the one token.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are available; `w` is exactly `rows` rows of
/// `blocks` blocks of type `TY`; `x` [`fits`](Panel::fits) `t` tokens of `blocks`; `out` is
/// `rows × t`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn gemm<const TY: u8>(w: &[u8], rows: usize, blocks: usize, x: &Panel, out: &mut [f32]) {
    let (bytes, _) = layout(TY);
    let row_bytes = blocks * bytes;
    let t = x.t;
    debug_assert_eq!(w.len(), rows * row_bytes);
    debug_assert!(x.fits(out.len() / rows.max(1), blocks));
    let (wp, xp, sp, op, ss) = (w.as_ptr(), x.pairs.as_ptr(), x.s.as_ptr(), out.as_mut_ptr(), x.stride);
    if t == 1 {
        let (pairs, odd) = (blocks.div_ceil(2), blocks % 2 == 1);
        let mut i = 0;
        while i < rows {
            // SAFETY: rows `i..i + 4` (or `i`) are within `w` and `out`; the panel is one token.
            unsafe {
                let (wi, o) = (wp.add(i * row_bytes), op.add(i));
                if rows - i >= 4 {
                    tile_one::<TY, 4>(wi, row_bytes, xp, pairs, odd, sp, ss, o, 1);
                    i += 4;
                } else {
                    tile_one::<TY, 1>(wi, row_bytes, xp, pairs, odd, sp, ss, o, 1);
                    i += 1;
                }
            }
        }
        return;
    }
    // Tokens outer, rows inner: a group of tokens stays in L1 while the rows stream past it.
    let mut j = 0;
    while j < t {
        let p = match t - j {
            8.. => 4,
            4.. => 2,
            _ => 1,
        };
        let n = (2 * p).min(t - j);
        let mut i = 0;
        while i < rows {
            let r = if rows - i >= 4 { 4 } else { 1 };
            // SAFETY: rows `i..i + r` and tokens `j..j + n` (pairs `j/2..j/2 + p`, padded) are
            // within the extents above; `s` has 8 readable values from any token up to `t`.
            unsafe {
                let (wi, xj, sj, o) = (wp.add(i * row_bytes), xp.add(j / 2 * blocks), sp.add(j), op.add(i * t + j));
                match (r, p) {
                    (4, 4) => tile_many::<TY, 4, 4>(wi, row_bytes, blocks, xj, sj, ss, o, t, n),
                    (4, 2) => tile_many::<TY, 4, 2>(wi, row_bytes, blocks, xj, sj, ss, o, t, n),
                    (4, _) => tile_many::<TY, 4, 1>(wi, row_bytes, blocks, xj, sj, ss, o, t, n),
                    (_, 4) => tile_many::<TY, 1, 4>(wi, row_bytes, blocks, xj, sj, ss, o, t, n),
                    (_, 2) => tile_many::<TY, 1, 2>(wi, row_bytes, blocks, xj, sj, ss, o, t, n),
                    _ => tile_many::<TY, 1, 1>(wi, row_bytes, blocks, xj, sj, ss, o, t, n),
                }
            }
            i += r;
        }
        j += n;
    }
}
