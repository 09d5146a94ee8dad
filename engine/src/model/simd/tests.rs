//! The SIMD kernels against the portable reference ([`super::quant`]), on whatever this CPU
//! detects; the AVX-512 VNNI matrix kernel also through its portable model ([`super::vnni_model`]).

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
    let mut rnd = |n: usize| -> Vec<f32> { (0..n).map(|_| (lcg(&mut seed) % 2000) as f32 / 1000.0 - 1.0).collect() };
    for kernel in [Kernel::portable(), Kernel::detect()] {
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
    if k == Kernel::portable() {
        eprintln!("skipped: SIMD vs portable (no AVX2 on this CPU: the portable kernel is the only one)");
    }
    if !k.vnni_ok() {
        eprintln!(
            "skipped: the AVX-512 VNNI tiles vs the AVX2 rows (this CPU has no AVX-512 F/BW/VL/VNNI; \
             `the_vnni_kernel_model_matches_the_reference_and_the_kernels` checks their arithmetic)"
        );
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
            let mut kernels = vec![Kernel::portable()];
            kernels.extend(Kernel::avx2());
            if k.vnni_ok() {
                kernels.push(k);
            }
            for &kernel in &kernels {
                let mut out = vec![0f32; t];
                dot_row_tokens(kernel, ty, &row, &xq, blocks, &mut out).unwrap();
                for (tt, x) in xs.iter().enumerate() {
                    let want = quant::dot_row(ty, &row, x, &xq[tt * blocks..(tt + 1) * blocks]).unwrap();
                    assert!((out[tt] - want).abs() <= 1e-4 * want.abs().max(1.0), "{ty} t={t}: {} vs {want}", out[tt]);
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
                    assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{ty} {rows}×{t} n={n}: {got} vs {want}");
                }
            }
            // The tiles reproduce the one-row kernel bit for bit (the same block order).
            if let (true, Some(avx2)) = (k.vnni_ok(), Kernel::avx2()) {
                for r in 0..rows {
                    let mut one = vec![0f32; t];
                    dot_row_tokens(avx2, ty, &w[r * rb..(r + 1) * rb], acts.blocks(), blocks, &mut one).unwrap();
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
        for kernel in [Kernel::portable(), k] {
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

/// The AVX-512 VNNI matrix kernel's portable model ([`super::vnni_model`], whose docs say what
/// each CPU checks): against the portable reference on every CPU, against the real AVX2
/// one-row kernel bit for bit where AVX2 runs, and the real VNNI kernel against the model bit
/// for bit where AVX-512 VNNI runs. Shapes cover 4-row and single-row tiles, the one-token
/// path with odd and even block counts, and token tiles of 8, 4 and 2 with odd remainders.
#[test]
fn the_vnni_kernel_model_matches_the_reference_and_the_kernels() {
    let (avx2, detected) = (Kernel::avx2(), Kernel::detect());
    if avx2.is_none() {
        eprintln!("skipped: the VNNI model vs the AVX2 one-row kernel, bit for bit (this CPU has no AVX2+FMA+F16C)");
    }
    if !detected.vnni_ok() {
        eprintln!(
            "skipped: the real AVX-512 VNNI kernel vs its model, bit for bit (this CPU has no AVX-512 \
             F/BW/VL/VNNI; the model's arithmetic is still checked against the reference{})",
            if avx2.is_some() { " and, bit for bit, against the AVX2 kernel" } else { "" }
        );
    }
    let mut s = 1234u64;
    let shapes = [
        (1usize, 1usize, 32usize),
        (7, 1, 96),
        (5, 1, 576),
        (4, 1, 64),
        (5, 6, 576),
        (9, 4, 96),
        (4, 9, 1536),
        (6, 14, 576),
        (4, 17, 96),
        (1, 2, 64),
        (2, 3, 32),
        (4, 8, 64),
        (5, 15, 160),
    ];
    for (rows, t, n) in shapes {
        let blocks = n / QK;
        let x: Vec<f32> = (0..t * n).map(|_| (lcg(&mut s) % 2000) as f32 / 500.0 - 2.0).collect();
        let mut xq = Vec::new();
        quant::quantize_q8(&x, &mut xq);
        let mut panel = panel::Panel::default();
        panel.build(&xq, blocks);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let rb = ty.bytes_for(n);
            let w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, n, &mut s)).collect();
            let mut model = vec![f32::NAN; rows * t];
            vnni_model::gemm(ty, &w, rows, blocks, &panel, &mut model);
            for r in 0..rows {
                let row = &w[r * rb..(r + 1) * rb];
                for tt in 0..t {
                    let want =
                        quant::dot_row(ty, row, &x[tt * n..(tt + 1) * n], &xq[tt * blocks..(tt + 1) * blocks]).unwrap();
                    let got = model[r * t + tt];
                    assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{ty} {rows}×{t} n={n}: {got} vs {want}");
                }
                if let Some(k) = avx2 {
                    let mut one = vec![0f32; t];
                    dot_row_tokens(k, ty, row, &xq, blocks, &mut one).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&one),
                        bits(&model[r * t..(r + 1) * t]),
                        "{ty} {rows}×{t} n={n}: AVX2 row vs model"
                    );
                }
            }
            if detected.vnni_ok() {
                let mut acts = QuantizedActs::default();
                acts.quantize(detected, &x, n);
                let mut real = vec![0f32; rows * t];
                dot_rows_tokens(detected, ty, &w, rows, &acts, &mut real).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&real), bits(&model), "{ty} {rows}×{t} n={n}: VNNI kernel vs model");
            }
        }
    }
}
