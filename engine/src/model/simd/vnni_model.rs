//! A portable, lane-exact model of the AVX-512 VNNI matrix kernel (`vnni512::gemm`), so that
//! its arithmetic is tested on CPUs without AVX-512 (test builds only).
//!
//! The model walks the kernel's tiles — 4 weight rows, then single rows; against the one
//! token (two blocks per register), or against 8, 4, then 2 tokens (one block of two tokens
//! per register, an odd last token paired with zeros) — reads the same [`Panel`], and computes
//! each 512-bit register as 16 lanes with the kernel's operations in the kernel's order:
//!
//! - weights unpacked to unsigned bytes in the block's order (Q4: the 16 low nibbles, then
//!   the 16 high ones; Q8_0: each byte + 128), a missing second block as the kernel's zeros;
//! - `vpdpbusd`: each i32 lane adds the 4 products of its 4 bytes (u8 × i8), wrapping; signed
//!   types start from `−offset × Σ activations` per lane (`offset_sums`), as the kernel does;
//! - each token's 8 float lanes take, per block in order, `fma(d_w · d_x, lane as f32, acc)`;
//!   the Q4_1 `m · s` term is summed apart (multiply, then add); the result is the kernel's
//!   horizontal sum (`(l0+l4 + l2+l6) + (l1+l5 + l3+l7)`) plus that term.
//!
//! ## What a CPU without AVX-512 checks, and what it does not
//! Checked on every CPU (`simd/tests.rs`): this model against the portable reference
//! (`quant::dot_row`, 1e-4 relative) for Q4_0, Q4_1 and Q8_0, odd and even block counts and
//! every tile remainder; the panel layout the kernel reads ([`Panel::build`] is plain Rust).
//! Checked on a CPU with AVX2 (this repository's CI machine): the model against the real AVX2
//! one-row kernel, bit for bit — the claim in `vnni512`'s docs that its tiles reproduce the
//! one-row kernels' bits, as far as the arithmetic goes.
//! Checked only on a CPU with AVX-512 F/BW/VL/VNNI: the real `vnni512::gemm` against this
//! model, bit for bit — that is, that the intrinsics do what the model says (nibble unpacking,
//! the lane shuffles `shuffle_i64x2`, `mask_blend_epi64` and `permutexvar`, `vpdpbusd`'s
//! semantics, the pointer arithmetic and prefetch distances, the `#[target_feature]` code).
//! Elsewhere that test prints that it was skipped and why. Not modelled: the AVX-512
//! attention (`attn512`), which only an AVX-512 CPU exercises (against the portable one).

use super::super::gguf::GgmlType;
use super::super::quant::f16_to_f32;
use super::panel::Panel;

/// One 512-bit register of i32 lanes.
type I32x16 = [i32; 16];

/// `vpdpbusd`: lane `k` of `src` plus the 4 products `a[4k + i] · b[4k + i]` (u8 × i8), wrapping.
fn dpbusd(src: I32x16, a: &[u8; 64], b: &[i8; 64]) -> I32x16 {
    std::array::from_fn(|k| {
        let sum: i32 = (0..4).map(|i| i32::from(a[4 * k + i]) * i32::from(b[4 * k + i])).sum();
        src[k].wrapping_add(sum)
    })
}

/// Bytes of a block of `ty`, where its quants start, and what the kernel adds to a signed
/// weight to make it unsigned (0: unsigned already).
fn layout(ty: GgmlType) -> (usize, usize, u8) {
    match ty {
        GgmlType::Q4_1 => (20, 4, 0),
        GgmlType::Q4_0 => (18, 2, 8),
        _ => (34, 2, 128),
    }
}

/// The kernel's `offset_sums`: `0 − dpbusd(0, offset, x)`, zeros for unsigned types.
fn offset_sums(offset: u8, x: &[i8; 64]) -> I32x16 {
    if offset == 0 {
        return [0; 16];
    }
    dpbusd([0; 16], &[offset; 64], x).map(|v| 0i32.wrapping_sub(v))
}

/// One block as the kernel unpacks it: 32 unsigned weight bytes, scale `d` and min `m` (0 for
/// types without one). `None`: the absent block after an odd row's last (zero bytes, which
/// Q8_0's `xor 0x80` turns into 128s; scale and min 0).
fn unpack(ty: GgmlType, block: Option<&[u8]>) -> ([u8; 32], f32, f32) {
    let (_, off, _) = layout(ty);
    let Some(b) = block else {
        return ([if ty == GgmlType::Q8_0 { 128 } else { 0 }; 32], 0.0, 0.0);
    };
    let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    let m = if ty == GgmlType::Q4_1 { f16_to_f32(u16::from_le_bytes([b[2], b[3]])) } else { 0.0 };
    let w = std::array::from_fn(|i| match ty {
        GgmlType::Q8_0 => b[off + i] ^ 0x80,
        _ if i < 16 => b[off + i] & 0x0f,
        _ => b[off + i - 16] >> 4,
    });
    (w, d, m)
}

/// The kernel's horizontal sum of 8 lanes: halves added, then pairs, then the last two.
fn hsum(v: &[f32]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// `out[r * t + j] = row_r · token_j`, computed as `vnni512::gemm::<ty>` computes it (see
/// the module docs): `w` is `rows` rows of `blocks` blocks of `ty` (Q4_0, Q4_1 or Q8_0), `x`
/// the panel of `t` tokens, `out` is `rows × t`.
pub(super) fn gemm(ty: GgmlType, w: &[u8], rows: usize, blocks: usize, x: &Panel, out: &mut [f32]) {
    let row_bytes = blocks * layout(ty).0;
    let t = x.t;
    assert!(w.len() == rows * row_bytes && out.len() == rows * t && x.fits(t, blocks));
    let row = |i: usize| &w[i * row_bytes..(i + 1) * row_bytes];
    // The same tiles in the same order as the kernel (results do not depend on them; the
    // walk checks that every output is written once, by the tile the kernel would use).
    let row_tiles = || {
        let mut tiles = Vec::new();
        let mut i = 0;
        while i < rows {
            let r = if rows - i >= 4 { 4 } else { 1 };
            tiles.push(i..i + r);
            i += r;
        }
        tiles
    };
    if t == 1 {
        for tile in row_tiles() {
            for i in tile {
                out[i] = tile_one(ty, row(i), x);
            }
        }
        return;
    }
    let mut j = 0;
    while j < t {
        let p = match t - j {
            8.. => 4,
            4.. => 2,
            _ => 1,
        };
        let n = (2 * p).min(t - j);
        for tile in row_tiles() {
            for i in tile {
                tile_many(ty, row(i), x, j, p, &mut out[i * t + j..i * t + j + n]);
            }
        }
        j += n;
    }
}

/// One row against the one token of `x`, two blocks per register (`tile_one`).
fn tile_one(ty: GgmlType, row: &[u8], x: &Panel) -> f32 {
    let (bytes, _, offset) = layout(ty);
    let blocks = row.len() / bytes;
    let (pairs, odd) = (blocks.div_ceil(2), blocks % 2 == 1);
    let mut acc = [0f32; 8];
    let mut mins = 0f32;
    for p in 0..pairs {
        let single = odd && p + 1 == pairs;
        let xb = &x.pairs[p];
        let (sa, sb) = (x.s[2 * p * x.stride], x.s[(2 * p + 1) * x.stride]);
        let (wa, da, ma) = unpack(ty, Some(&row[2 * p * bytes..(2 * p + 1) * bytes]));
        let (wb, db, mb) = unpack(ty, (!single).then(|| &row[(2 * p + 1) * bytes..(2 * p + 2) * bytes]));
        let wv: [u8; 64] = std::array::from_fn(|i| if i < 32 { wa[i] } else { wb[i - 32] });
        let dp = dpbusd(offset_sums(offset, &xb.qs), &wv, &xb.qs).map(|v| v as f32);
        let sc: [f32; 16] = std::array::from_fn(|k| if k < 8 { da } else { db } * xb.d[k]);
        // Block a's lanes, then block b's, into the same 8 accumulators.
        for k in 0..16 {
            acc[k % 8] = sc[k].mul_add(dp[k], acc[k % 8]);
        }
        if ty == GgmlType::Q4_1 {
            mins += ma * sa;
            mins += mb * sb;
        }
    }
    hsum(&acc) + mins
}

/// One row against tokens `j..j + out.len()` of `x`, as `p` token pairs of one block each per
/// register (`tile_many`; the padding token of an odd pair is computed and dropped).
fn tile_many(ty: GgmlType, row: &[u8], x: &Panel, j: usize, p: usize, out: &mut [f32]) {
    let (bytes, _, offset) = layout(ty);
    let blocks = x.blocks;
    let mut acc = vec![[0f32; 16]; p];
    let mut mins = [0f32; 8];
    for b in 0..blocks {
        let (w, d, m) = unpack(ty, Some(&row[b * bytes..(b + 1) * bytes]));
        let wv: [u8; 64] = std::array::from_fn(|i| w[i % 32]);
        for (q, acc) in acc.iter_mut().enumerate() {
            let xb = &x.pairs[(j / 2 + q) * blocks + b];
            let dp = dpbusd(offset_sums(offset, &xb.qs), &wv, &xb.qs).map(|v| v as f32);
            for k in 0..16 {
                acc[k] = (d * xb.d[k]).mul_add(dp[k], acc[k]);
            }
        }
        if ty == GgmlType::Q4_1 {
            let sv = &x.s[j + b * x.stride..j + b * x.stride + 8];
            for (mk, s) in mins.iter_mut().zip(sv) {
                *mk += m * s;
            }
        }
    }
    for (jj, o) in out.iter_mut().enumerate() {
        let lanes = &acc[jj / 2][(jj % 2) * 8..(jj % 2) * 8 + 8];
        *o = hsum(lanes) + mins[jj];
    }
}
