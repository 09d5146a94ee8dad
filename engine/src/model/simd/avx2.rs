//! The AVX2 + FMA + F16C kernels (x86-64): one weight row against one or a batch of token
//! rows, f32 dot products and axpy for attention, and Q8 quantization of activations.
//!
//! Integer blocks follow llama.cpp's scheme: 32 weights meet 32 i8 activations in
//! `maddubs` (u8 × i8 → i16 pairs) and `madd` (i16 pairs → i32), so each of the 8 i32 lanes
//! holds the products of 4 consecutive values; then one float FMA per block applies both
//! scales. Signed weights (Q4_0 after −8, Q8_0) use the sign trick `|w| × (a · sign(w))`,
//! since `maddubs` needs an unsigned operand. The dispatchers in [`super`] call these only
//! with a [`super::Kernel`] that detection produced.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::super::quant::{f16_to_f32, Q8Block};

/// A batched integer kernel — one weight row against `out.len()` token rows of Q8 activations —
/// for a set of target features: tiles of 4 tokens (then single tokens), each weight block
/// unpacked once per tile (`unpack` → scale `d`, min `m`, 32 weight bytes) and met by every
/// token of the tile with `sum` (32 products → 8 f32 lanes). Each token's blocks accumulate
/// in one chain in block order, whatever the tile: a token's result never depends on its batch.
macro_rules! batched_kernel {
    ($name:ident, $tile:ident, $features:literal, $bytes:expr, $sum:ident, |$b:ident| $unpack:expr) => {
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $tile<const N: usize>(row: &[u8], xq: &[Q8Block], blocks: usize, start: usize, out: &mut [f32]) {
            let mut acc = [_mm256_setzero_ps(); N];
            let mut mins = [0f32; N];
            for (bi, $b) in row.chunks_exact($bytes).enumerate() {
                // SAFETY: `$b` is one whole block of `$bytes` bytes.
                let (d, m, w) = unsafe { $unpack };
                for j in 0..N {
                    let a = &xq[(start + j) * blocks + bi];
                    // SAFETY: `a.qs` is 32 bytes.
                    let x = unsafe { load_q8(a) };
                    acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), $sum(w, x), acc[j]);
                    mins[j] += m * a.s;
                }
            }
            for j in 0..N {
                out[start + j] = hsum(acc[j]) + mins[j];
            }
        }

        /// `out[t] = row · xq[t]` for every token row `t` of `xq` (`blocks` blocks each).
        #[target_feature(enable = $features)]
        pub unsafe fn $name(row: &[u8], xq: &[Q8Block], blocks: usize, out: &mut [f32]) {
            let t = out.len();
            let mut start = 0;
            // SAFETY (both calls): the caller checked the extents of `row` and `xq`.
            while start + 4 <= t {
                unsafe { $tile::<4>(row, xq, blocks, start, out) };
                start += 4;
            }
            while start < t {
                unsafe { $tile::<1>(row, xq, blocks, start, out) };
                start += 1;
            }
        }
    };
}

/// The f16 at `b[0..2]` (and `b[2..4]`) as f32, converted by F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn halves(b: &[u8]) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([b[0], b[1], b[2], b[3]])));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn half(b: &[u8]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes([b[0], b[1]])))))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// 32 nibbles of `qs[16]` as bytes: low nibbles in lanes 0..16, high in 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles(qs: *const u8) -> __m256i {
    // SAFETY (caller): `qs` points at 16 readable bytes.
    let raw = unsafe { _mm_loadu_si128(qs as *const __m128i) };
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(raw, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    _mm256_set_m128i(hi, lo)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn i32_sum_u8_i8(w: __m256i, a: __m256i) -> __m256 {
    let pairs = _mm256_maddubs_epi16(w, a);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn i32_sum_i8_i8(w: __m256i, a: __m256i) -> __m256 {
    i32_sum_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load_q8(a: &Q8Block) -> __m256i {
    // SAFETY: `qs` is 32 bytes.
    unsafe { _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i) }
}

/// Q4_1 row (20-byte blocks) · Q8 activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_1(row: &[u8], xq: &[Q8Block]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0f32;
    for (b, a) in row.chunks_exact(20).zip(xq) {
        let (d, m) = halves(b);
        // SAFETY: a 20-byte block holds 16 quant bytes at offset 4; `a.qs` is 32 bytes.
        let (w, x) = unsafe { (nibbles(b.as_ptr().add(4)), load_q8(a)) };
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), i32_sum_u8_i8(w, x), acc);
        mins += m * a.s;
    }
    hsum(acc) + mins
}

/// Q4_0 row (18-byte blocks) · Q8 activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_0(row: &[u8], xq: &[Q8Block]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, a) in row.chunks_exact(18).zip(xq) {
        let d = half(b);
        // SAFETY: an 18-byte block holds 16 quant bytes at offset 2; `a.qs` is 32 bytes.
        let (w, x) = unsafe { (nibbles(b.as_ptr().add(2)), load_q8(a)) };
        let w = _mm256_sub_epi8(w, _mm256_set1_epi8(8));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), i32_sum_i8_i8(w, x), acc);
    }
    hsum(acc)
}

/// Q8_0 row (34-byte blocks) · Q8 activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q8_0(row: &[u8], xq: &[Q8Block]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, a) in row.chunks_exact(34).zip(xq) {
        let d = half(b);
        // SAFETY: a 34-byte block holds 32 quant bytes at offset 2; `a.qs` is 32 bytes.
        let (w, x) = unsafe { (_mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i), load_q8(a)) };
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), i32_sum_i8_i8(w, x), acc);
    }
    hsum(acc)
}

batched_kernel!(q4_1_tokens, q4_1_tile, "avx2,fma,f16c", 20, i32_sum_u8_i8, |b| {
    let (d, m) = halves(b);
    (d, m, nibbles(b.as_ptr().add(4)))
});
batched_kernel!(q4_0_tokens, q4_0_tile, "avx2,fma,f16c", 18, i32_sum_i8_i8, |b| {
    (half(b), 0.0f32, _mm256_sub_epi8(nibbles(b.as_ptr().add(2)), _mm256_set1_epi8(8)))
});
batched_kernel!(q8_0_tokens, q8_0_tile, "avx2,fma,f16c", 34, i32_sum_i8_i8, |b| {
    (half(b), 0.0f32, _mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i))
});

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = a.len() = b.len().
        let (x, y) = unsafe { (_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i))) };
        acc = _mm256_fmadd_ps(x, y, acc);
        i += 8;
    }
    let mut s = hsum(acc);
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let wv = _mm256_set1_ps(w);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = x.len() = y.len().
        unsafe {
            let v = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(y.as_ptr().add(i)));
            _mm256_storeu_ps(y.as_mut_ptr().add(i), v);
        }
        i += 8;
    }
    while i < n {
        y[i] += w * x[i];
        i += 1;
    }
}

/// [`quant::quantize_q8`](super::super::quant::quantize_q8) 8 lanes at a time, with the
/// same operations per value (so the same bits): `amax / 127`, `x · (1/d)` rounded half
/// away from zero (truncate, then step away when the dropped fraction is ≥ ½).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    let sign = _mm256_set1_ps(-0.0);
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    for (chunk, o) in x.chunks_exact(super::QK).zip(out.iter_mut()) {
        // SAFETY: `chunk` is 32 floats: four loads of 8.
        let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(chunk.as_ptr().add(8 * i)) });
        let abs = |a: __m256| _mm256_andnot_ps(sign, a);
        let m = _mm256_max_ps(_mm256_max_ps(abs(v[0]), abs(v[1])), _mm256_max_ps(abs(v[2]), abs(v[3])));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let p = _mm256_mul_ps(v[i], id);
            let t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let away = _mm256_cmp_ps(abs(_mm256_sub_ps(p, t)), half, _CMP_GE_OQ);
            let step = _mm256_and_ps(away, _mm256_or_ps(_mm256_and_ps(p, sign), one));
            _mm256_cvttps_epi32(_mm256_add_ps(t, step))
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let sum = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        let sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b01_00_11_10));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b00_00_00_01)));
        // i32 → i8 in order: the packs work per 128-bit lane, the permute restores order.
        let p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `o.qs` is 32 bytes.
        unsafe { _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, p) };
        o.d = super::super::quant::round_f16(d);
        o.s = super::super::quant::round_f16(sum as f32 * d);
    }
}

/// [`super::attend`] with the AVX2 `dot_f32` and `axpy` inlined.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend(shape: super::AttnShape, q: &[f32], out: &mut [f32], kv: super::KvRows<'_>, scores: &mut [f32]) {
    // SAFETY (both closures): AVX2/FMA are enabled here; the slices are of equal length.
    super::attend_with(shape, q, out, kv, scores, |a, b| unsafe { dot_f32(a, b) }, |w, x, y| unsafe { axpy(w, x, y) })
}

/// Float rows: 8 weights at a time, converted by `load`, tail in scalar.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_dot(
    row: &[u8],
    x: &[f32],
    width: usize,
    load: impl Fn(*const u8) -> __m256,
    scalar: impl Fn(&[u8]) -> f32,
) -> f32 {
    let n = x.len();
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `row` holds `n * width` bytes and `x` holds `n` floats; i + 8 <= n.
        let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) };
        let wv = load(unsafe { row.as_ptr().add(i * width) });
        acc = _mm256_fmadd_ps(wv, xv, acc);
        i += 8;
    }
    let mut s = hsum(acc);
    while i < n {
        s += scalar(&row[i * width..(i + 1) * width]) * x[i];
        i += 1;
    }
    s
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f32(row: &[u8], x: &[f32]) -> f32 {
    // SAFETY: `float_dot` passes pointers with 32 readable bytes (8 floats) left in `row`.
    let load = |p: *const u8| unsafe { _mm256_loadu_ps(p as *const f32) };
    let scalar = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    // SAFETY: lengths as `float_dot` requires (checked by the dispatcher).
    unsafe { float_dot(row, x, 4, load, scalar) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f16(row: &[u8], x: &[f32]) -> f32 {
    // SAFETY: `float_dot` passes pointers with 16 readable bytes (8 halves) left in `row`.
    let load = |p: *const u8| _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) });
    let scalar = |b: &[u8]| f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    // SAFETY: lengths as `float_dot` requires (checked by the dispatcher).
    unsafe { float_dot(row, x, 2, load, scalar) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn bf16(row: &[u8], x: &[f32]) -> f32 {
    // SAFETY: `float_dot` passes pointers with 16 readable bytes (8 bfloat16) left in `row`.
    let load = |p: *const u8| {
        let h = unsafe { _mm_loadu_si128(p as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    };
    let scalar = |b: &[u8]| super::super::quant::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    // SAFETY: lengths as `float_dot` requires (checked by the dispatcher).
    unsafe { float_dot(row, x, 2, load, scalar) }
}
