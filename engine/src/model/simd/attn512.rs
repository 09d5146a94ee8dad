//! AVX-512 attention for up to 4 query rows of one sequence at a time.
//!
//! Consecutive rows of a prefill chunk attend to the same cached positions (each one more
//! than the last), so a tile of rows shares every K and V load. Each row's output stays in
//! registers for the whole pass over the values, and the softmax runs 16 scores at a time
//! with a polynomial `exp`.
//!
//! Every row sees the same sequence of operations whether it is alone or in a tile (the
//! tile only shares loads): a row's result never depends on its batch.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::{AttnShape, KvRows};

/// `e^x` for 16 lanes: `x = n·ln2 + r`, `|r| ≤ ln2/2`, degree-7 Taylor polynomial for `e^r`
/// (relative error below 1e-8 before rounding), scaled by `2^n`. Inputs below −104 give 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn exp(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(-104.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    // ln 2 split in two so that `n · LN2_HI` is exact.
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 5040.0);
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// The lanes of positions `i..i + 16` that are below `len`.
#[inline]
fn mask(i: usize, len: usize) -> __mmask16 {
    let left = len - i;
    if left >= 16 {
        0xffff
    } else {
        (1u16 << left) - 1
    }
}

/// Attention of `R` consecutive query rows of one sequence (`q`: `R × n_heads × head_dim`)
/// over `kv`, whose `slots` are the last row's; row `i` attends to the first `lens[i]`
/// slots. `scores` is scratch of at least `R × slots.len()`.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are available; `head_dim == 16 · D`;
/// `lens` is non-decreasing with `lens[R − 1] == kv.slots.len()`; every slot's K/V rows are
/// within `kv.k`/`kv.v` (checked by slicing).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn attend<const R: usize, const D: usize>(
    shape: AttnShape,
    q: &[f32],
    out: &mut [f32],
    kv: KvRows<'_>,
    lens: &[usize],
    scores: &mut [f32],
) {
    let hd = shape.head_dim;
    let dim = shape.n_heads * hd;
    let group = (shape.n_heads / shape.n_kv_heads.max(1)).max(1);
    let len = kv.slots.len();
    let common = lens[0];
    let scale = 1.0 / (hd as f32).sqrt();
    let load = |s: &[f32], c: usize| -> __m512 {
        // SAFETY: callers pass slices of `hd = 16·D` floats and `c < D`.
        unsafe { _mm512_loadu_ps(s.as_ptr().add(16 * c)) }
    };
    for h in 0..shape.n_heads {
        let off = (h / group) * hd;
        let qh: [[__m512; D]; R] = std::array::from_fn(|i| std::array::from_fn(|c| load(&q[i * dim + h * hd..], c)));
        // Scores: per (row, slot), ggml's f32 dot order, reduced, scaled.
        for (s, &at) in kv.slots.iter().enumerate() {
            let k = &kv.k[at + off..at + off + hd];
            let kr: [__m512; D] = std::array::from_fn(|c| load(k, c));
            for i in 0..R {
                if s < lens[i] {
                    // ggml's f32 dot: four accumulators over chunks, folded pairwise.
                    let mut acc = [_mm512_setzero_ps(); 4];
                    for c in 0..D {
                        acc[c % 4] = _mm512_fmadd_ps(qh[i][c], kr[c], acc[c % 4]);
                    }
                    let folded = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
                    scores[i * len + s] = _mm512_reduce_add_ps(folded) * scale;
                }
            }
        }
        // Softmax, 16 at a time.
        for i in 0..R {
            let row = &mut scores[i * len..i * len + lens[i]];
            let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
            for j in (0..row.len()).step_by(16) {
                // SAFETY: the mask keeps the load within `row`.
                let v = unsafe { _mm512_mask_loadu_ps(mx, mask(j, row.len()), row.as_ptr().add(j)) };
                mx = _mm512_max_ps(mx, v);
            }
            let mx = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            let mut sum = _mm512_setzero_ps();
            for j in (0..row.len()).step_by(16) {
                let m = mask(j, row.len());
                // SAFETY: the mask keeps the load and the store within `row`.
                unsafe {
                    let e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row.as_ptr().add(j)), mx));
                    let e = _mm512_maskz_mov_ps(m, e);
                    sum = _mm512_add_ps(sum, e);
                    _mm512_mask_storeu_ps(row.as_mut_ptr().add(j), m, e);
                }
            }
            // Normalized before weighting the values, as llama.cpp's softmax does.
            let inv = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(sum));
            for j in (0..row.len()).step_by(16) {
                let m = mask(j, row.len());
                // SAFETY: the mask keeps the load and the store within `row`.
                unsafe {
                    let p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row.as_ptr().add(j)), inv);
                    _mm512_mask_storeu_ps(row.as_mut_ptr().add(j), m, p);
                }
            }
        }
        // Weighted values: rows share each V load while every row still has the slot.
        let mut acc = [[_mm512_setzero_ps(); D]; R];
        let step = |s: usize, at: usize, rows: std::ops::Range<usize>, acc: &mut [[__m512; D]; R]| {
            let v = &kv.v[at + off..at + off + hd];
            let vr: [__m512; D] = std::array::from_fn(|c| load(v, c));
            for i in rows {
                let p = _mm512_set1_ps(scores[i * len + s]);
                for c in 0..D {
                    acc[i][c] = _mm512_fmadd_ps(p, vr[c], acc[i][c]);
                }
            }
        };
        for (s, &at) in kv.slots[..common].iter().enumerate() {
            step(s, at, 0..R, &mut acc);
        }
        for (i, &l) in lens.iter().enumerate() {
            for (s, &at) in kv.slots[..l].iter().enumerate().skip(common) {
                step(s, at, i..i + 1, &mut acc);
            }
        }
        for (i, acc_i) in acc.iter().enumerate() {
            for (c, a) in acc_i.iter().enumerate() {
                // SAFETY: row `i`, head `h`, chunk `c` is within `out` (`R × dim`).
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i * dim + h * hd + 16 * c), *a) };
            }
        }
    }
}
