//! Dot-product kernels chosen at run time: x86-64 AVX2 + FMA (`avx2`) and AVX-512 VNNI
//! (`vnni512`, `attn512`), with the portable kernels of [`super::quant`] as the fallback and
//! the reference they are tested against.
//!
//! A [`Kernel`] value is the proof that the running CPU has the instructions a kernel uses:
//! only [`Kernel::detect`] makes a SIMD one ([`Kernel::portable`] is the one any caller may
//! make), so the safe dispatchers below can call `unsafe` `#[target_feature]` code without
//! checking again. Tests live in `simd/tests.rs`; the AVX-512 matrix kernel has a portable,
//! lane-exact model (`simd/vnni_model.rs`) that those tests check on every CPU.
#![allow(unsafe_code)]

use super::gguf::GgmlType;
use rayon::prelude::*;

use super::quant::{self, Q8Block, QuantError, QK};

#[cfg(target_arch = "x86_64")]
mod attn512;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(any(target_arch = "x86_64", test))]
mod panel;
#[cfg(target_arch = "x86_64")]
mod vnni512;
#[cfg(test)]
mod vnni_model;

/// Which kernels this CPU runs: plain Rust, AVX2 (+ FMA + F16C), or AVX2 and AVX-512
/// F/BW/VL/VNNI for the matrix kernels ([`dot_rows_tokens`]: tiles of rows × tokens, two
/// blocks per `vpdpbusd`) and attention ([`attend_rows`]).
///
/// Cannot be forged: the instruction set is a private field, and only [`Kernel::detect`]
/// (after asking the CPU) produces anything but [`Kernel::portable`]. Handing a SIMD kernel
/// to a safe function on a CPU without those instructions — undefined behaviour — is
/// therefore impossible outside this module.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Kernel(Isa);

/// The instruction sets, in increasing order (each includes the ones before).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Isa {
    Portable,
    Avx2,
    Vnni,
}

/// `Portable`, `Avx2` or `Vnni` (the names benchmarks print).
impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl Kernel {
    /// Plain Rust: runs on any CPU.
    pub const fn portable() -> Self {
        Kernel(Isa::Portable)
    }

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
                    return Kernel(Isa::Vnni);
                }
                return Kernel(Isa::Avx2);
            }
        }
        Kernel::portable()
    }

    /// The AVX2 kernel, if this CPU has AVX2, FMA and F16C (tests that compare kernels on a
    /// CPU that detects a better one).
    #[cfg(test)]
    pub(crate) fn avx2() -> Option<Self> {
        (Kernel::detect().0 >= Isa::Avx2).then_some(Kernel(Isa::Avx2))
    }

    /// Whether the AVX2 (+ FMA + F16C) kernels may run: [`Kernel::detect`] saw them.
    #[inline]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn avx2_ok(self) -> bool {
        self.0 >= Isa::Avx2
    }

    /// Whether the AVX-512 F/BW/VL/VNNI kernels may run: [`Kernel::detect`] saw them.
    #[inline]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn vnni_ok(self) -> bool {
        self.0 >= Isa::Vnni
    }
}

/// [`quant::dot_row`] with the kernel `k`.
#[inline]
pub fn dot_row(k: Kernel, ty: GgmlType, row: &[u8], x: &[f32], xq: &[Q8Block]) -> Result<f32, QuantError> {
    #[cfg(target_arch = "x86_64")]
    if k.avx2_ok() {
        quant::check_shape(ty, row, x.len())?;
        if ty.block_len() == QK && xq.len() * QK != x.len() {
            return Err(QuantError::Shape { ty, row: x.len(), bytes: row.len(), n: xq.len() * QK });
        }
        // SAFETY: a kernel with `avx2_ok` is only produced by `Kernel::detect`, after checking
        // AVX2, FMA and F16C at run time; the lengths of `row`, `x` and `xq` were checked just
        // above and every kernel reads exactly those extents.
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
    if k.avx2_ok() && x.len() == out.len() * QK {
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
    if k.avx2_ok() {
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
    if k.avx2_ok() {
        // SAFETY: AVX2/FMA detected at run time; every slice access inside is bounds-checked.
        unsafe { avx2::attend(shape, q, out, kv, scores) };
        return;
    }
    attend_with(shape, q, out, kv, scores, |a, b| dot_f32(k, a, b), |w, x, y| axpy(k, w, x, y));
}

/// Attention of consecutive query rows of one sequence (`q`, `out`: `lens.len()` rows of
/// `n_heads × head_dim`): row `i` attends to the first `lens[i]` slots of `kv` (non-decreasing,
/// the last row's being all of them). With the AVX-512 kernel and a head size of 64 or 128,
/// tiles of rows share every K/V load (`attn512`); otherwise one row at a time. Either way
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
    if k.vnni_ok() && matches!(shape.head_dim, 64 | 128) && lens.last() == Some(&kv.slots.len()) {
        let tile = if shape.head_dim == 64 { 4 } else { 2 };
        scores.resize(tile * kv.slots.len(), 0.0);
        let mut i = 0;
        while i < lens.len() {
            let n = tile.min(lens.len() - i);
            let (l, rows) = (&lens[i..i + n], i * dim..(i + n) * dim);
            let kv = KvRows { slots: &kv.slots[..l[n - 1]], ..kv };
            let (q, out) = (&q[rows.clone()], &mut out[rows]);
            // SAFETY: a kernel with `vnni_ok` is only produced by `detect` after checking AVX-512
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
    if k.avx2_ok() {
        // SAFETY: AVX2/FMA detected at run time; both slices are accessed within `n`.
        unsafe { avx2::axpy(w, &x[..n], &mut y[..n]) };
        return;
    }
    let _ = k;
    y[..n].iter_mut().zip(&x[..n]).for_each(|(y, x)| *y += w * x);
}

/// The activations of one matrix product (`T` token rows), quantized once for whichever
/// kernel runs: 8-bit blocks, and for the AVX-512 kernel the same blocks laid out in pairs.
#[derive(Default)]
pub struct QuantizedActs {
    blocks: usize,
    xq: Vec<Q8Block>,
    #[cfg(target_arch = "x86_64")]
    panel: panel::Panel,
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
        if k.vnni_ok() {
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
/// and every token row of `acts`. With the AVX-512 kernel, tiles of rows × tokens; otherwise
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
    if k.vnni_ok() && acts.panel.fits(t, blocks) {
        // SAFETY: a kernel with `vnni_ok` comes only from `detect`, after checking AVX-512
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
    if k.avx2_ok() {
        // SAFETY: AVX2/FMA/F16C were detected at run time (`avx2_ok`); `row` holds
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

#[cfg(test)]
mod tests;
