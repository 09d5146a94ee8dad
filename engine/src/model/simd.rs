//! x86-64 AVX2 + FMA dot-product kernels, chosen at run time, with the portable kernels of
//! [`super::quant`] as the fallback and the reference they are tested against.
//!
//! Integer blocks follow llama.cpp's scheme: 32 weights meet 32 i8 activations in
//! `maddubs` (u8 × i8 → i16 pairs) and `madd` (i16 pairs → i32), then one float FMA per
//! block applies both scales. Signed weights (Q4_0 after −8, Q8_0) use the sign trick:
//! `|w| × (a · sign(w))`, since `maddubs` needs an unsigned operand.
#![allow(unsafe_code)]

use super::gguf::GgmlType;
use rayon::prelude::*;

use super::quant::{self, Q8Block, QuantError, QK};

#[cfg(target_arch = "x86_64")]
mod attn512;
#[cfg(target_arch = "x86_64")]
mod vnni512;

/// Which kernels this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust (any CPU).
    Portable,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 + FMA + F16C, and AVX-512 F/BW/VL/VNNI for the matrix kernels ([`dot_rows_tokens`]):
    /// tiles of rows × tokens, two blocks per `vpdpbusd`.
    Vnni,
}

impl Kernel {
    /// The best kernel the running CPU supports.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
                {
                    return Kernel::Vnni;
                }
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }
}

/// [`quant::dot_row`] with the kernel `k`.
#[inline]
pub fn dot_row(k: Kernel, ty: GgmlType, row: &[u8], x: &[f32], xq: &[Q8Block]) -> Result<f32, QuantError> {
    #[cfg(target_arch = "x86_64")]
    if matches!(k, Kernel::Avx2 | Kernel::Vnni) {
        quant::check_shape(ty, row, x.len())?;
        if ty.block_len() == QK && xq.len() * QK != x.len() {
            return Err(QuantError::Shape { ty, row: x.len(), bytes: row.len(), n: xq.len() * QK });
        }
        // SAFETY: `Kernel::Avx2` and `Kernel::Vnni` are only produced by `detect` after
        // checking AVX2, FMA and F16C at run time; the lengths of `row`, `x` and `xq` were checked just above and
        // every kernel reads exactly those extents.
        return unsafe {
            match ty {
                GgmlType::Q4_1 => Ok(avx2::q4_1(row, xq)),
                GgmlType::Q4_0 => Ok(avx2::q4_0(row, xq)),
                GgmlType::Q8_0 => Ok(avx2::q8_0(row, xq)),
                GgmlType::F32 => Ok(avx2::f32(row, x)),
                GgmlType::F16 => Ok(avx2::f16(row, x)),
                GgmlType::BF16 => Ok(avx2::bf16(row, x)),
                _ => quant::dot_row(ty, row, x, xq),
            }
        };
    }
    let _ = k;
    quant::dot_row(ty, row, x, xq)
}

/// [`quant::quantize_q8`] with the kernel `k` (bit-identical): `x` is `out.len()` blocks.
pub fn quantize_q8(k: Kernel, x: &[f32], out: &mut [Q8Block]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if matches!(k, Kernel::Avx2 | Kernel::Vnni) && x.len() == out.len() * QK {
        // SAFETY: AVX2/FMA/F16C detected at run time; `x` is exactly `out.len()` blocks.
        unsafe { avx2::quantize_q8(x, out) };
        return;
    }
    let _ = k;
    let mut v = Vec::with_capacity(out.len());
    quant::quantize_q8(x, &mut v);
    out.iter_mut().zip(v).for_each(|(o, b)| *o = b);
}

/// `a · b` over f32 slices of equal length (attention scores).
#[inline]
pub fn dot_f32(k: Kernel, a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    if matches!(k, Kernel::Avx2 | Kernel::Vnni) {
        // SAFETY: AVX2/FMA detected at run time; both slices are read within `n`.
        return unsafe { avx2::dot_f32(&a[..n], &b[..n]) };
    }
    let _ = k;
    // Eight independent partial sums: the same association as the SIMD kernel.
    let mut acc = [0f32; 8];
    let (ac, bc) = (a[..n].chunks_exact(8), b[..n].chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The shape of one attention call: `n_heads` query heads of `head_dim`, sharing
/// `n_kv_heads` K/V heads (grouped-query attention).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// K/V heads.
    pub n_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
}

/// The cached K/V rows one query attends to: position `i`'s rows start at `k[slots[i]..]`
/// and `v[slots[i]..]`.
#[derive(Debug, Clone, Copy)]
pub struct KvRows<'a> {
    /// One layer's K cache.
    pub k: &'a [f32],
    /// One layer's V cache.
    pub v: &'a [f32],
    /// Offsets of the attended positions, in order.
    pub slots: &'a [usize],
}

/// Attention of one query row `q` (`n_heads × head_dim`) over `kv`: `out` = per head,
/// softmax(q·k / √d) · v. `scores` is scratch.
pub fn attend(k: Kernel, shape: AttnShape, q: &[f32], out: &mut [f32], kv: KvRows<'_>, scores: &mut Vec<f32>) {
    scores.resize(kv.slots.len(), 0.0);
    #[cfg(target_arch = "x86_64")]
    if matches!(k, Kernel::Avx2 | Kernel::Vnni) {
        // SAFETY: AVX2/FMA detected at run time; every slice access inside is bounds-checked.
        unsafe { avx2::attend(shape, q, out, kv, scores) };
        return;
    }
    attend_with(shape, q, out, kv, scores, |a, b| dot_f32(k, a, b), |w, x, y| axpy(k, w, x, y));
}

/// Attention of consecutive query rows of one sequence (`q`, `out`: `lens.len()` rows of
/// `n_heads × head_dim`): row `i` attends to the first `lens[i]` slots of `kv` (non-decreasing,
/// the last row's being all of them). With [`Kernel::Vnni`] and a head size of 64 or 128,
/// tiles of rows share every K/V load ([`attn512`]); otherwise one row at a time. Either way
/// a row's result does not depend on the rows it is computed with.
pub fn attend_rows(
    k: Kernel,
    shape: AttnShape,
    q: &[f32],
    out: &mut [f32],
    kv: KvRows<'_>,
    lens: &[usize],
    scores: &mut Vec<f32>,
) {
    let dim = shape.n_heads * shape.head_dim;
    debug_assert!(q.len() == lens.len() * dim && out.len() == q.len());
    debug_assert!(lens.windows(2).all(|w| w[0] <= w[1]) && lens.last() == Some(&kv.slots.len()));
    #[cfg(target_arch = "x86_64")]
    if k == Kernel::Vnni && matches!(shape.head_dim, 64 | 128) && lens.last() == Some(&kv.slots.len()) {
        let tile = if shape.head_dim == 64 { 4 } else { 2 };
        scores.resize(tile * kv.slots.len(), 0.0);
        let mut i = 0;
        while i < lens.len() {
            let n = tile.min(lens.len() - i);
            let (l, rows) = (&lens[i..i + n], i * dim..(i + n) * dim);
            let kv = KvRows { slots: &kv.slots[..l[n - 1]], ..kv };
            let (q, out) = (&q[rows.clone()], &mut out[rows]);
            // SAFETY: `Kernel::Vnni` is only produced by `detect` after checking AVX-512
            // F/BW/VL/VNNI, AVX2, FMA and F16C; head_dim is 16·D; `l` is non-decreasing and ends
            // at `kv.slots.len()`; K/V rows are sliced (bounds-checked) inside.
            unsafe {
                match (shape.head_dim, n) {
                    (64, 4) => attn512::attend::<4, 4>(shape, q, out, kv, l, scores),
                    (64, 3) => attn512::attend::<3, 4>(shape, q, out, kv, l, scores),
                    (64, 2) => attn512::attend::<2, 4>(shape, q, out, kv, l, scores),
                    (64, _) => attn512::attend::<1, 4>(shape, q, out, kv, l, scores),
                    (_, 2) => attn512::attend::<2, 8>(shape, q, out, kv, l, scores),
                    _ => attn512::attend::<1, 8>(shape, q, out, kv, l, scores),
                }
            }
            i += n;
        }
        return;
    }
    for ((qr, or), &l) in q.chunks_exact(dim).zip(out.chunks_exact_mut(dim)).zip(lens) {
        attend(k, shape, qr, or, KvRows { slots: &kv.slots[..l], ..kv }, scores);
    }
}

/// The attention algorithm over given `dot` and `axpy` (inlined into each kernel's copy).
#[inline(always)]
fn attend_with(
    shape: AttnShape,
    q: &[f32],
    out: &mut [f32],
    kv: KvRows<'_>,
    scores: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
    axpy: impl Fn(f32, &[f32], &mut [f32]),
) {
    let hd = shape.head_dim;
    let group = shape.n_heads / shape.n_kv_heads.max(1);
    let scale = 1.0 / (hd as f32).sqrt();
    let KvRows { k: kc, v: vc, slots } = kv;
    for h in 0..shape.n_heads {
        let kvh = h / group.max(1);
        let qh = &q[h * hd..(h + 1) * hd];
        let mut max = f32::NEG_INFINITY;
        for (s, &at) in scores.iter_mut().zip(slots) {
            *s = dot(qh, &kc[at + kvh * hd..at + (kvh + 1) * hd]) * scale;
            max = max.max(*s);
        }
        let mut sum = 0.0;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let oh = &mut out[h * hd..(h + 1) * hd];
        oh.fill(0.0);
        let inv = 1.0 / sum;
        for (s, &at) in scores.iter().zip(slots) {
            axpy(s * inv, &vc[at + kvh * hd..at + (kvh + 1) * hd], oh);
        }
    }
}

/// `y += w · x` over f32 slices of equal length (attention's weighted sum of values).
#[inline]
pub fn axpy(k: Kernel, w: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    #[cfg(target_arch = "x86_64")]
    if matches!(k, Kernel::Avx2 | Kernel::Vnni) {
        // SAFETY: AVX2/FMA detected at run time; both slices are accessed within `n`.
        unsafe { avx2::axpy(w, &x[..n], &mut y[..n]) };
        return;
    }
    let _ = k;
    y[..n].iter_mut().zip(&x[..n]).for_each(|(y, x)| *y += w * x);
}

/// The activations of one matrix product (`T` token rows), quantized once for whichever
/// kernel runs: 8-bit blocks, and for [`Kernel::Vnni`] the same blocks laid out in pairs.
#[derive(Default)]
pub struct QuantizedActs {
    blocks: usize,
    xq: Vec<Q8Block>,
    #[cfg(target_arch = "x86_64")]
    panel: vnni512::Panel,
}

impl QuantizedActs {
    /// Quantize `x` (token rows of `cols` values, `cols` a multiple of 32) for kernel `k`,
    /// token rows in parallel on the current rayon pool.
    pub fn quantize(&mut self, k: Kernel, x: &[f32], cols: usize) {
        debug_assert!(cols.is_multiple_of(QK) && x.len().is_multiple_of(cols.max(1)));
        self.blocks = cols / QK;
        let t = x.len() / cols.max(1);
        self.xq.resize(t * self.blocks, Q8Block { d: 0.0, s: 0.0, qs: [0; QK] });
        self.xq.par_chunks_mut(self.blocks.max(1)).zip(x.par_chunks(cols.max(1))).for_each(|(o, xr)| {
            quantize_q8(k, xr, o);
        });
        #[cfg(target_arch = "x86_64")]
        if k == Kernel::Vnni {
            self.panel.build(&self.xq, self.blocks);
        }
        let _ = k;
    }

    /// Number of token rows.
    pub fn tokens(&self) -> usize {
        self.xq.len().checked_div(self.blocks).unwrap_or(0)
    }

    /// The 8-bit blocks, token-major.
    pub fn blocks(&self) -> &[Q8Block] {
        &self.xq
    }
}

/// `out[r · T + t] = row_r · x_t` for the `rows` consecutive rows of `w` (quantized type `ty`)
/// and every token row of `acts`. With [`Kernel::Vnni`], tiles of rows × tokens; otherwise
/// one row at a time ([`dot_row_tokens`]). Either way a token's result does not depend on
/// the other tokens of the batch.
pub fn dot_rows_tokens(
    k: Kernel,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    acts: &QuantizedActs,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let (blocks, t) = (acts.blocks, acts.tokens());
    let n = blocks * QK;
    let row_bytes = ty.bytes_for(n);
    if w.len() != rows * row_bytes || out.len() != rows * t {
        return Err(QuantError::Shape { ty, row: n, bytes: w.len() / rows.max(1), n });
    }
    #[cfg(target_arch = "x86_64")]
    if k == Kernel::Vnni && acts.panel.fits(t, blocks) {
        // SAFETY: `Kernel::Vnni` comes only from `detect`, after checking AVX-512
        // F/BW/VL/VNNI, AVX2, FMA and F16C; `w` is `rows` whole rows of `blocks` blocks, the
        // panel fits `t` tokens of `blocks` and `out` is `rows × t` (all checked above).
        unsafe {
            match vnni512::type_id(ty) {
                Some(vnni512::Q4_1) => vnni512::gemm::<{ vnni512::Q4_1 }>(w, rows, blocks, &acts.panel, out),
                Some(vnni512::Q4_0) => vnni512::gemm::<{ vnni512::Q4_0 }>(w, rows, blocks, &acts.panel, out),
                Some(_) => vnni512::gemm::<{ vnni512::Q8_0 }>(w, rows, blocks, &acts.panel, out),
                None => return Err(QuantError::Shape { ty, row: n, bytes: row_bytes, n }),
            }
        }
        return Ok(());
    }
    for (row, o) in w.chunks_exact(row_bytes.max(1)).zip(out.chunks_exact_mut(t.max(1))) {
        dot_row_tokens(k, ty, row, &acts.xq, blocks, o)?;
    }
    Ok(())
}

/// `out[t] = row · xq[t]` for `out.len()` token rows of quantized activations (`blocks`
/// blocks each) — one weight row against a batch, unpacking each weight block once.
/// Quantized weight types only (Q4_0, Q4_1, Q8_0).
pub fn dot_row_tokens(
    k: Kernel,
    ty: GgmlType,
    row: &[u8],
    xq: &[Q8Block],
    blocks: usize,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let n = blocks * QK;
    quant::check_shape(ty, row, n)?;
    if xq.len() != out.len() * blocks || !matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
        return Err(QuantError::Shape { ty, row: n, bytes: row.len(), n: xq.len() * QK });
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(k, Kernel::Avx2 | Kernel::Vnni) {
        // SAFETY: AVX2/FMA/F16C were detected at run time (`Kernel::Avx2`, `Kernel::Vnni`); `row` holds
        // `blocks` whole blocks and `xq` holds `blocks` blocks per output (checked above).
        unsafe {
            match ty {
                GgmlType::Q4_1 => avx2::q4_1_tokens(row, xq, blocks, out),
                GgmlType::Q4_0 => avx2::q4_0_tokens(row, xq, blocks, out),
                _ => avx2::q8_0_tokens(row, xq, blocks, out),
            }
        }
        return Ok(());
    }
    let _ = k;
    let x = vec![0f32; n];
    for (o, a) in out.iter_mut().zip(xq.chunks_exact(blocks.max(1))) {
        *o = quant::dot_row(ty, row, &x, a)?;
    }
    Ok(())
}

/// A batched integer kernel — one weight row against `out.len()` token rows of Q8 activations —
/// for a set of target features: tiles of 4 tokens (then single tokens), each weight block
/// unpacked once per tile (`unpack` → scale `d`, min `m`, 32 weight bytes) and met by every
/// token of the tile with `sum` (32 products → 8 f32 lanes). Each token's blocks accumulate
/// in one chain in block order, whatever the tile: a token's result never depends on its batch.
#[cfg(target_arch = "x86_64")]
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::quant::{f16_to_f32, Q8Block};

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
    pub unsafe fn attend(
        shape: super::AttnShape,
        q: &[f32],
        out: &mut [f32],
        kv: super::KvRows<'_>,
        scores: &mut [f32],
    ) {
        // SAFETY (both closures): AVX2/FMA are enabled here; the slices are of equal length.
        super::attend_with(
            shape,
            q,
            out,
            kv,
            scores,
            |a, b| unsafe { dot_f32(a, b) },
            |w, x, y| unsafe { axpy(w, x, y) },
        )
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(s: &mut u64) -> u64 {
        *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *s >> 33
    }

    /// Random bytes of `n` weights of `ty`, with sane (finite) scales.
    fn random_row(ty: GgmlType, n: usize, s: &mut u64) -> Vec<u8> {
        let h = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
        let mut out = Vec::new();
        match ty {
            GgmlType::F32 => (0..n).for_each(|_| out.extend(((lcg(s) % 2000) as f32 / 1000.0 - 1.0).to_le_bytes())),
            GgmlType::F16 => (0..n).for_each(|_| out.extend(h((lcg(s) % 2000) as f32 / 1000.0 - 1.0))),
            GgmlType::BF16 => (0..n).for_each(|_| {
                let v = (lcg(s) % 2000) as f32 / 1000.0 - 1.0;
                out.extend(((v.to_bits() >> 16) as u16).to_le_bytes())
            }),
            _ => {
                for _ in 0..n / QK {
                    let start = out.len();
                    out.extend(h((lcg(s) % 100) as f32 / 1000.0 + 0.001));
                    if ty == GgmlType::Q4_1 {
                        out.extend(h(-((lcg(s) % 100) as f32) / 100.0));
                    }
                    while out.len() - start < ty.block_bytes() {
                        out.push(lcg(s) as u8);
                    }
                }
            }
        }
        out
    }

    /// The forward pass splits a decode row's attention by K/V head: each head group alone
    /// (its K/V rows `h · hd` into every slot) must give the same bits as the whole row.
    #[test]
    fn attention_split_by_kv_head_is_bit_identical() {
        let mut seed = 7u64;
        let mut rnd =
            |n: usize| -> Vec<f32> { (0..n).map(|_| (lcg(&mut seed) % 2000) as f32 / 1000.0 - 1.0).collect() };
        for kernel in [Kernel::Portable, Kernel::detect()] {
            for head_dim in [32, 64, 128] {
                let shape = AttnShape { n_heads: 9, n_kv_heads: 3, head_dim };
                let (dim, kvd, group) = (9 * head_dim, 3 * head_dim, 3);
                let positions = 37;
                let (k, v) = (rnd(positions * 2 * kvd), rnd(positions * 2 * kvd));
                // Scattered slots (every other row of the cache, backwards).
                let slots: Vec<usize> = (0..positions).map(|p| (2 * (positions - 1 - p) + 1) * kvd).collect();
                let q = rnd(dim);
                let mut scores = Vec::new();
                let mut whole = vec![0f32; dim];
                let lens = [positions];
                attend_rows(kernel, shape, &q, &mut whole, KvRows { k: &k, v: &v, slots: &slots }, &lens, &mut scores);
                let one = AttnShape { n_heads: group, n_kv_heads: 1, head_dim };
                for h in 0..3 {
                    let span = h * group * head_dim..(h + 1) * group * head_dim;
                    let mut part = vec![0f32; group * head_dim];
                    let kv = KvRows { k: &k[h * head_dim..], v: &v[h * head_dim..], slots: &slots };
                    attend_rows(kernel, one, &q[span.clone()], &mut part, kv, &lens, &mut scores);
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&part), bits(&whole[span]), "{kernel:?}, head_dim {head_dim}, K/V head {h}");
                }
            }
        }
    }

    #[test]
    fn simd_and_portable_kernels_agree_on_every_type() {
        let k = Kernel::detect();
        if k == Kernel::Portable {
            eprintln!("no AVX2 on this CPU: the portable kernel is the only one (nothing to compare)");
        }
        let mut s = 99u64;
        for n in [32usize, 64, 576, 1536] {
            let x: Vec<f32> = (0..n).map(|_| (lcg(&mut s) % 2000) as f32 / 500.0 - 2.0).collect();
            let mut xq = Vec::new();
            quant::quantize_q8(&x, &mut xq);
            for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
                let row = random_row(ty, n, &mut s);
                let want = quant::dot_row(ty, &row, &x, &xq).unwrap();
                let got = dot_row(k, ty, &row, &x, &xq).unwrap();
                let scale = want.abs().max(1.0);
                assert!((got - want).abs() <= 1e-4 * scale, "{ty} n={n}: {got} vs {want}");
            }
        }
        // One row against a batch of token rows (tiles of 4 and a remainder).
        for t in [1usize, 3, 4, 9] {
            let n = 576;
            let blocks = n / QK;
            let xs: Vec<Vec<f32>> =
                (0..t).map(|_| (0..n).map(|_| (lcg(&mut s) % 2000) as f32 / 500.0 - 2.0).collect()).collect();
            let mut xq = Vec::new();
            for x in &xs {
                let mut q = Vec::new();
                quant::quantize_q8(x, &mut q);
                xq.extend(q);
            }
            for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
                let row = random_row(ty, n, &mut s);
                let kernels: &[Kernel] = match k {
                    Kernel::Vnni => &[Kernel::Portable, Kernel::Avx2, Kernel::Vnni],
                    Kernel::Avx2 => &[Kernel::Portable, Kernel::Avx2],
                    Kernel::Portable => &[Kernel::Portable],
                };
                for &kernel in kernels {
                    let mut out = vec![0f32; t];
                    dot_row_tokens(kernel, ty, &row, &xq, blocks, &mut out).unwrap();
                    for (tt, x) in xs.iter().enumerate() {
                        let want = quant::dot_row(ty, &row, x, &xq[tt * blocks..(tt + 1) * blocks]).unwrap();
                        assert!(
                            (out[tt] - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{ty} t={t}: {} vs {want}",
                            out[tt]
                        );
                    }
                }
            }
        }
        // Tiles of rows × tokens (4 × 4 and every remainder), odd and even block counts.
        for (rows, t, n) in [
            (1usize, 1usize, 32usize),
            (5, 6, 576),
            (9, 4, 96),
            (4, 9, 1536),
            (3, 1, 64),
            (6, 14, 576),
            (4, 17, 96),
            (1, 2, 64),
        ] {
            let blocks = n / QK;
            let x: Vec<f32> = (0..t * n).map(|_| (lcg(&mut s) % 2000) as f32 / 500.0 - 2.0).collect();
            let mut acts = QuantizedActs::default();
            acts.quantize(k, &x, n);
            for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
                let w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, n, &mut s)).collect();
                let mut out = vec![0f32; rows * t];
                dot_rows_tokens(k, ty, &w, rows, &acts, &mut out).unwrap();
                let rb = ty.bytes_for(n);
                for r in 0..rows {
                    for tt in 0..t {
                        let xq = &acts.blocks()[tt * blocks..(tt + 1) * blocks];
                        let want = quant::dot_row(ty, &w[r * rb..(r + 1) * rb], &x[tt * n..(tt + 1) * n], xq).unwrap();
                        let got = out[r * t + tt];
                        assert!(
                            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{ty} {rows}×{t} n={n}: {got} vs {want}"
                        );
                    }
                }
                // The tiles reproduce the one-row kernel bit for bit (the same block order).
                if k == Kernel::Vnni {
                    for r in 0..rows {
                        let mut one = vec![0f32; t];
                        dot_row_tokens(Kernel::Avx2, ty, &w[r * rb..(r + 1) * rb], acts.blocks(), blocks, &mut one)
                            .unwrap();
                        for tt in 0..t {
                            assert_eq!(one[tt].to_bits(), out[r * t + tt].to_bits(), "{ty} {rows}×{t}: tile vs row");
                        }
                    }
                }
                // A token's result does not depend on its batch.
                let mut alone = QuantizedActs::default();
                alone.quantize(k, &x[(t - 1) * n..], n);
                let mut one = vec![0f32; rows];
                dot_rows_tokens(k, ty, &w, rows, &alone, &mut one).unwrap();
                for r in 0..rows {
                    assert_eq!(one[r].to_bits(), out[r * t + t - 1].to_bits(), "{ty}: batched differs from alone");
                }
            }
        }
        // Quantization: the SIMD path gives the reference's bits (ties included).
        let mut x: Vec<f32> = (0..4096).map(|_| (lcg(&mut s) % 20001) as f32 / 100.0 - 100.0).collect();
        x[0] = 127.0;
        x[1] = 0.5;
        x[2] = -0.5;
        x[3] = 2.5;
        x[4] = -1.5;
        x[32..64].fill(0.0);
        let mut want = Vec::new();
        quant::quantize_q8(&x, &mut want);
        let mut got = vec![Q8Block { d: 0.0, s: 0.0, qs: [0; QK] }; x.len() / QK];
        quantize_q8(k, &x, &mut got);
        assert_eq!(got, want);
        // Attention helpers.
        for n in [5usize, 64, 67] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            for kernel in [Kernel::Portable, k] {
                assert!((dot_f32(kernel, &a, &b) - want).abs() < 1e-4);
                let mut y = b.clone();
                axpy(kernel, 0.5, &a, &mut y);
                assert!(y.iter().zip(a.iter().zip(&b)).all(|(y, (a, b))| (y - (b + 0.5 * a)).abs() < 1e-6));
            }
        }
        // Odd float lengths exercise the scalar tail.
        let x: Vec<f32> = (0..13).map(|i| i as f32 * 0.1).collect();
        let row = random_row(GgmlType::F32, 13, &mut s);
        let want = quant::dot_row(GgmlType::F32, &row, &x, &[]).unwrap();
        assert!((dot_row(k, GgmlType::F32, &row, &x, &[]).unwrap() - want).abs() < 1e-4);
        // Shape errors surface from either kernel.
        assert!(dot_row(k, GgmlType::Q4_1, &row, &x, &[]).is_err());
    }
}
