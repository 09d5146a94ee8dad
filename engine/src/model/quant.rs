//! Weight formats and the portable reference kernels over them.
//!
//! Quantized weights are multiplied the way llama.cpp multiplies them, so our logits track
//! the anchor's: activations are first quantized to 8-bit blocks of 32 ([`Q8Block`], ggml's
//! `Q8_1` layout: scale `d` and `s = d·Σq`, both rounded through f16), and each weight block
//! meets its activation block in integer arithmetic:
//!
//! ```text
//! Q4_0: w = (q − 8)·d            Σ = d_w·d_a·Σ((q_w − 8)·q_a)
//! Q4_1: w = q·d + m              Σ = d_w·d_a·Σ(q_w·q_a) + m_w·s_a
//! Q8_0: w = q·d                  Σ = d_w·d_a·Σ(q_w·q_a)
//! ```
//!
//! Float weights (F32, F16, BF16) meet the activations in f32. Every function here is the
//! portable reference: SIMD kernels must agree with it within tolerance.

use super::gguf::GgmlType;

/// Weights (and activations) per quantization block.
pub const QK: usize = 32;

/// Why a row cannot be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The tensor type has no kernel yet.
    #[error("no kernel for {0} weights")]
    Unsupported(GgmlType),
    /// Lengths disagree.
    #[error("row of {row} weights ({bytes} bytes of {ty}) does not match {n} activations")]
    Shape {
        /// Weight type.
        ty: GgmlType,
        /// Weights in the row.
        row: usize,
        /// Bytes given.
        bytes: usize,
        /// Activations given.
        n: usize,
    },
}

/// Half-precision bits to f32.
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// f32 rounded to the nearest half (round-to-nearest-even), back as f32.
#[inline]
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// bfloat16 bits to f32.
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[inline]
fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// A block of 32 activations quantized to i8 (ggml's `Q8_1`): `x ≈ d·q`, `s = d·Σq`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Q8Block {
    /// Scale (rounded through f16, as llama.cpp stores it).
    pub d: f32,
    /// `d·Σq` (rounded through f16).
    pub s: f32,
    /// Quantized values.
    pub qs: [i8; QK],
}

/// Quantize `x` (a multiple of 32 long) to 8-bit blocks, exactly as llama.cpp's reference
/// `quantize_row_q8_1` does: `d = max|x| / 127`, `q = round(x / d)` (half away from zero).
pub fn quantize_q8(x: &[f32], out: &mut Vec<Q8Block>) {
    debug_assert_eq!(x.len() % QK, 0);
    out.clear();
    out.extend(x.chunks_exact(QK).map(|chunk| {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; QK];
        let mut sum = 0i32;
        for (q, &v) in qs.iter_mut().zip(chunk) {
            *q = (v * id).round() as i8;
            sum += i32::from(*q);
        }
        Q8Block { d: round_f16(d), s: round_f16(sum as f32 * d), qs }
    }));
}

/// `row` holds exactly `n` weights of type `ty`.
pub(crate) fn check_shape(ty: GgmlType, row: &[u8], n: usize) -> Result<(), QuantError> {
    if !n.is_multiple_of(ty.block_len()) || ty.bytes_for(n) != row.len() {
        return Err(QuantError::Shape { ty, row: row.len() / ty.block_bytes() * ty.block_len(), bytes: row.len(), n });
    }
    Ok(())
}

/// Dot product of one weight row (raw bytes of type `ty`) with activations given both as
/// f32 (`x`, for float weights) and as [`Q8Block`]s (`xq`, for quantized weights).
pub fn dot_row(ty: GgmlType, row: &[u8], x: &[f32], xq: &[Q8Block]) -> Result<f32, QuantError> {
    check_shape(ty, row, x.len())?;
    Ok(match ty {
        GgmlType::F32 => {
            row.chunks_exact(4).zip(x).map(|(w, a)| f32::from_le_bytes([w[0], w[1], w[2], w[3]]) * a).sum()
        }
        GgmlType::F16 => row.chunks_exact(2).zip(x).map(|(w, a)| f16_to_f32(le16(w, 0)) * a).sum(),
        GgmlType::BF16 => row.chunks_exact(2).zip(x).map(|(w, a)| bf16_to_f32(le16(w, 0)) * a).sum(),
        GgmlType::Q4_0 => row
            .chunks_exact(18)
            .zip(xq)
            .map(|(b, a)| {
                let mut acc = 0i32;
                for j in 0..16 {
                    let q = b[2 + j];
                    acc += (i32::from(q & 0x0f) - 8) * i32::from(a.qs[j]);
                    acc += (i32::from(q >> 4) - 8) * i32::from(a.qs[j + 16]);
                }
                f16_to_f32(le16(b, 0)) * a.d * acc as f32
            })
            .sum(),
        GgmlType::Q4_1 => row
            .chunks_exact(20)
            .zip(xq)
            .map(|(b, a)| {
                let mut acc = 0i32;
                for j in 0..16 {
                    let q = b[4 + j];
                    acc += i32::from(q & 0x0f) * i32::from(a.qs[j]);
                    acc += i32::from(q >> 4) * i32::from(a.qs[j + 16]);
                }
                f16_to_f32(le16(b, 0)) * a.d * acc as f32 + f16_to_f32(le16(b, 2)) * a.s
            })
            .sum(),
        GgmlType::Q8_0 => row
            .chunks_exact(34)
            .zip(xq)
            .map(|(b, a)| {
                let acc: i32 = b[2..].iter().zip(&a.qs).map(|(&w, &q)| i32::from(w as i8) * i32::from(q)).sum();
                f16_to_f32(le16(b, 0)) * a.d * acc as f32
            })
            .sum(),
        other => return Err(QuantError::Unsupported(other)),
    })
}

/// Expand one row of type `ty` to f32 (`out.len()` weights).
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check_shape(ty, row, out.len())?;
    match ty {
        GgmlType::F32 => {
            for (o, w) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, w) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16_to_f32(le16(w, 0));
            }
        }
        GgmlType::BF16 => {
            for (o, w) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16_to_f32(le16(w, 0));
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(18)) {
                let d = f16_to_f32(le16(b, 0));
                for j in 0..16 {
                    o[j] = (f32::from(b[2 + j] & 0x0f) - 8.0) * d;
                    o[j + 16] = (f32::from(b[2 + j] >> 4) - 8.0) * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(20)) {
                let (d, m) = (f16_to_f32(le16(b, 0)), f16_to_f32(le16(b, 2)));
                for j in 0..16 {
                    o[j] = f32::from(b[4 + j] & 0x0f) * d + m;
                    o[j + 16] = f32::from(b[4 + j] >> 4) * d + m;
                }
            }
        }
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            let (bytes, head) = if ty == GgmlType::Q8_0 { (34, 2) } else { (36, 4) };
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(bytes)) {
                let d = f16_to_f32(le16(b, 0));
                for (o, &q) in o.iter_mut().zip(&b[head..]) {
                    *o = f32::from(q as i8) * d;
                }
            }
        }
        other => return Err(QuantError::Unsupported(other)),
    }
    Ok(())
}

#[cfg(test)]
mod tests;
