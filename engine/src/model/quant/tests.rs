//! Reference kernel tests: hand-built blocks with known weights.

use super::*;

fn h(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_bits().to_le_bytes()
}

/// A Q4_1 block with d = 0.5, m = −1 and nibbles (j, 15 − j).
fn q4_1_block() -> (Vec<u8>, Vec<f32>) {
    let mut b = [h(0.5), h(-1.0)].concat();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut w: Vec<f32> = (0..16).map(|j| j as f32 * 0.5 - 1.0).collect();
    w.extend((0..16).map(|j| (15 - j) as f32 * 0.5 - 1.0));
    (b, w)
}

fn q4_0_block() -> (Vec<u8>, Vec<f32>) {
    let mut b = h(0.25).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut w: Vec<f32> = (0..16).map(|j| (j as f32 - 8.0) * 0.25).collect();
    w.extend((0..16).map(|j| ((15 - j) as f32 - 8.0) * 0.25));
    (b, w)
}

fn q8_0_block() -> (Vec<u8>, Vec<f32>) {
    let mut b = h(0.125).to_vec();
    b.extend((0..32i32).map(|j| (j * 7 - 100) as i8 as u8));
    let w = (0..32).map(|j| (j * 7 - 100) as f32 * 0.125).collect();
    (b, w)
}

fn acts(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 37 % 19) as f32 - 9.0) * 0.173).collect()
}

#[test]
fn dequantizes_known_blocks() {
    for (ty, (bytes, want)) in
        [(GgmlType::Q4_1, q4_1_block()), (GgmlType::Q4_0, q4_0_block()), (GgmlType::Q8_0, q8_0_block())]
    {
        let mut out = vec![0f32; 32];
        dequantize_row(ty, &bytes, &mut out).unwrap();
        assert_eq!(out, want, "{ty}");
    }
    let f: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = [0f32; 2];
    dequantize_row(GgmlType::F32, &f, &mut out).unwrap();
    assert_eq!(out, [1.5, -2.0]);
    dequantize_row(GgmlType::F16, &[h(1.5), h(-2.0)].concat(), &mut out).unwrap();
    assert_eq!(out, [1.5, -2.0]);
    let bf: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
    dequantize_row(GgmlType::BF16, &bf, &mut out).unwrap();
    assert_eq!(out, [1.5, -2.0]);
}

#[test]
fn quantize_q8_matches_llama_cpp_rounding() {
    let mut x = vec![0f32; 32];
    x[0] = 127.0;
    x[1] = 0.5; // half away from zero: 1
    x[2] = -0.5; // −1
    x[3] = 63.49;
    let mut out = Vec::new();
    quantize_q8(&x, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].d, 1.0);
    assert_eq!(&out[0].qs[..4], &[127, 1, -1, 63]);
    assert_eq!(out[0].s, 190.0);
    quantize_q8(&[0f32; 64], &mut out);
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|b| b.d == 0.0 && b.s == 0.0 && b.qs == [0; 32]));
}

#[test]
fn quantized_dot_matches_the_dequantized_dot() {
    let x = acts(64);
    let mut xq = Vec::new();
    quantize_q8(&x, &mut xq);
    for (ty, block) in [(GgmlType::Q4_1, q4_1_block()), (GgmlType::Q4_0, q4_0_block()), (GgmlType::Q8_0, q8_0_block())]
    {
        let (bytes, w) = block;
        let row = [bytes.clone(), bytes].concat();
        let w = [w.clone(), w].concat();
        let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        let norm: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
        let got = dot_row(ty, &row, &x, &xq).unwrap();
        // Activations carry ≤ 1/254 relative error per element.
        assert!((got - exact).abs() <= norm / 100.0, "{ty}: {got} vs {exact}");
    }
    let f: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let self_dot: f32 = x.iter().map(|v| v * v).sum();
    assert_eq!(dot_row(GgmlType::F32, &f, &x, &xq).unwrap(), self_dot);
}

#[test]
fn shape_and_type_errors() {
    let x = acts(32);
    let mut xq = Vec::new();
    quantize_q8(&x, &mut xq);
    let (b, _) = q4_1_block();
    assert!(matches!(dot_row(GgmlType::Q4_1, &b[..19], &x, &xq), Err(QuantError::Shape { .. })));
    assert!(matches!(dot_row(GgmlType::Q4_1, &[b.clone(), b].concat(), &x, &xq), Err(QuantError::Shape { .. })));
    assert!(matches!(dot_row(GgmlType::Q6K, &[0; 210], &acts(256), &xq), Err(QuantError::Unsupported(GgmlType::Q6K))));
    let mut out = [0f32; 256];
    assert!(matches!(dequantize_row(GgmlType::Q4K, &[0; 144], &mut out), Err(QuantError::Unsupported(_))));
}
