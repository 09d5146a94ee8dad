//! Paged attention against a straightforward contiguous implementation, on a small random
//! model with f32 weights (exact arithmetic on both sides, so any indexing slip shows).

use std::sync::Arc;

use super::*;
use crate::model::gguf::GgmlType;

const V: usize = 50;

fn rng(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
}

fn f32_matrix(rows: usize, cols: usize, seed: &mut u64) -> Matrix {
    let bytes: Vec<u8> = (0..rows * cols).flat_map(|_| rng(seed).to_le_bytes()).collect();
    Matrix::new(Arc::new(bytes), 0, GgmlType::F32, rows, cols).unwrap()
}

fn model(rope: RopeStyle) -> Llama {
    shaped(rope, 4, 2, 32)
}

/// A random model with `heads` query heads and `kv_heads` K/V heads over `dim`.
fn shaped(rope: RopeStyle, heads: usize, kv_heads: usize, dim: usize) -> Llama {
    let cfg = LlamaConfig {
        n_layers: 2,
        dim,
        ffn_dim: 64,
        n_heads: heads,
        n_kv_heads: kv_heads,
        vocab: V,
        max_ctx: 128,
        rope_theta: 10000.0,
        eps: 1e-5,
        rope,
    };
    let mut s = 7u64;
    let (d, kv, f) = (cfg.dim, cfg.kv_dim(), cfg.ffn_dim);
    let layers = (0..cfg.n_layers)
        .map(|_| LayerWeights {
            attn_norm: (0..d).map(|_| 1.0 + rng(&mut s)).collect(),
            wq: f32_matrix(d, d, &mut s),
            wk: f32_matrix(kv, d, &mut s),
            wv: f32_matrix(kv, d, &mut s),
            wo: f32_matrix(d, d, &mut s),
            ffn_norm: (0..d).map(|_| 1.0 + rng(&mut s)).collect(),
            w_gate: f32_matrix(f, d, &mut s),
            w_up: f32_matrix(f, d, &mut s),
            w_down: f32_matrix(d, f, &mut s),
        })
        .collect();
    let embed = f32_matrix(V, d, &mut s);
    let norm = (0..d).map(|_| 1.0 + rng(&mut s)).collect();
    Llama::assemble(cfg, embed.clone(), layers, norm, embed)
}

fn mat_vec(w: &Matrix, x: &[f32]) -> Vec<f32> {
    let mut row = vec![0f32; w.cols];
    (0..w.rows)
        .map(|r| {
            w.row_f32(r, &mut row).unwrap();
            row.iter().zip(x).map(|(a, b)| a * b).sum()
        })
        .collect()
}

/// Textbook causal attention over a whole sequence, contiguous K/V, token by token.
fn reference_logits(m: &Llama, tokens: &[TokenId]) -> Vec<f32> {
    let c = &m.cfg;
    let (d, hd) = (c.dim, c.head_dim());
    let mut xs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| {
            let mut r = vec![0f32; d];
            m.embed.row_f32(t as usize, &mut r).unwrap();
            r
        })
        .collect();
    for l in &m.layers {
        let normed: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| {
                let mut n = vec![0f32; d];
                rmsnorm(x, &l.attn_norm, c.eps, &mut n);
                n
            })
            .collect();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut qs = Vec::new();
        for (p, n) in normed.iter().enumerate() {
            let mut q = mat_vec(&l.wq, n);
            let mut k = mat_vec(&l.wk, n);
            m.rope(&mut q, p);
            m.rope(&mut k, p);
            qs.push(q);
            ks.push(k);
            vs.push(mat_vec(&l.wv, n));
        }
        for (p, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0f32; d];
            for h in 0..c.n_heads {
                let kvh = h / (c.n_heads / c.n_kv_heads);
                let q = &qs[p][h * hd..(h + 1) * hd];
                let scores: Vec<f32> = (0..=p)
                    .map(|j| {
                        q.iter().zip(&ks[j][kvh * hd..(kvh + 1) * hd]).map(|(a, b)| a * b).sum::<f32>()
                            / (hd as f32).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f32 = e.iter().sum();
                for j in 0..=p {
                    for i in 0..hd {
                        att[h * hd + i] += e[j] / z * vs[j][kvh * hd + i];
                    }
                }
            }
            let o = mat_vec(&l.wo, &att);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let mut n = vec![0f32; d];
            rmsnorm(x, &l.ffn_norm, c.eps, &mut n);
            let g = mat_vec(&l.w_gate, &n);
            let u = mat_vec(&l.w_up, &n);
            let hmid: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let down = mat_vec(&l.w_down, &hmid);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
    }
    let mut n = vec![0f32; d];
    rmsnorm(xs.last().unwrap(), &m.norm, c.eps, &mut n);
    mat_vec(&m.lm_head, &n)
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "logit {i}: {x} vs {y}");
    }
}

fn tokens(n: usize, salt: u32) -> Vec<TokenId> {
    (0..n as u32).map(|i| (i * 17 + salt * 5 + 3) % V as u32).collect()
}

#[test]
fn one_prefill_through_a_contiguous_table_equals_the_reference() {
    for rope in [RopeStyle::Interleaved, RopeStyle::NeoX] {
        let m = model(rope);
        let toks = tokens(13, 0);
        let mut kv = KvStore::new(&m.cfg, 8, 4);
        let table = [0, 1, 2, 3];
        let out = m
            .forward(&mut kv, &[SeqInput { tokens: &toks, start: 0, block_table: &table, logits: true, pool: false }])
            .unwrap();
        close(&out[0], &reference_logits(&m, &toks));
    }
}

#[test]
fn scattered_blocks_chunked_prefill_and_decodes_equal_the_reference() {
    let m = model(RopeStyle::Interleaved);
    let toks = tokens(19, 1);
    let mut kv = KvStore::new(&m.cfg, 16, 4);
    let table = [11, 3, 14, 0, 7];
    // Chunks of 7 and 6, then one token at a time.
    let mut start = 0;
    let mut last = Vec::new();
    for len in [7, 6, 1, 1, 1, 1, 1, 1] {
        let s = SeqInput { tokens: &toks[start..start + len], start, block_table: &table, logits: true, pool: false };
        last = m.forward(&mut kv, &[s]).unwrap().remove(0);
        close(&last, &reference_logits(&m, &toks[..start + len]));
        start += len;
    }
    assert_eq!(start, toks.len());
    assert!(!last.is_empty());
}

#[test]
fn a_batch_of_sequences_sharing_a_prefix_block_equals_each_alone() {
    let m = model(RopeStyle::Interleaved);
    let mut kv = KvStore::new(&m.cfg, 16, 4);
    let a = tokens(10, 2);
    // b shares a's first 4 tokens (one full block) and diverges after.
    let mut b = a[..4].to_vec();
    b.extend(tokens(7, 3));
    let (ta, tb) = ([9, 2, 5], [9, 12, 4]);
    // Step 1: a's prefill alone. Step 2: a decodes while b prefills its uncached tail,
    // reading block 9 that a wrote.
    m.forward(&mut kv, &[SeqInput { tokens: &a[..9], start: 0, block_table: &ta, logits: false, pool: false }])
        .unwrap();
    let out = m
        .forward(
            &mut kv,
            &[
                SeqInput { tokens: &a[9..10], start: 9, block_table: &ta, logits: true, pool: false },
                SeqInput { tokens: &b[4..], start: 4, block_table: &tb, logits: true, pool: false },
            ],
        )
        .unwrap();
    assert_eq!(out.len(), 2);
    close(&out[0], &reference_logits(&m, &a));
    close(&out[1], &reference_logits(&m, &b));
}

#[test]
fn bad_inputs_are_errors() {
    let m = model(RopeStyle::Interleaved);
    let mut kv = KvStore::new(&m.cfg, 4, 4);
    let toks = tokens(9, 0);
    let short = [0, 1];
    assert!(m
        .forward(&mut kv, &[SeqInput { tokens: &toks, start: 0, block_table: &short, logits: true, pool: false }])
        .is_err());
    let bad = [V as TokenId];
    assert!(m
        .forward(&mut kv, &[SeqInput { tokens: &bad, start: 0, block_table: &short, logits: true, pool: false }])
        .is_err());
}

/// Runs the same steps through one model and through a tensor-parallel group: batched
/// prefill chunks, a prefix-cache hit (b reuses a's first block), decodes.
fn tp_steps(forward: &mut dyn FnMut(&[SeqInput<'_>]) -> Vec<Vec<f32>>) -> Vec<Vec<f32>> {
    let a = tokens(12, 4);
    let mut b = a[..4].to_vec();
    b.extend(tokens(10, 5));
    let c = tokens(9, 6);
    let (ta, tb, tc) = ([9, 2, 5, 13], [9, 12, 4, 1], [7, 0, 11]);
    let mut out = Vec::new();
    out.extend(forward(&[
        SeqInput { tokens: &a[..7], start: 0, block_table: &ta, logits: false, pool: false },
        SeqInput { tokens: &c[..5], start: 0, block_table: &tc, logits: true, pool: false },
    ]));
    out.extend(forward(&[
        SeqInput { tokens: &a[7..9], start: 7, block_table: &ta, logits: true, pool: false },
        SeqInput { tokens: &b[4..10], start: 4, block_table: &tb, logits: true, pool: false },
        SeqInput { tokens: &c[5..6], start: 5, block_table: &tc, logits: true, pool: false },
    ]));
    for i in 0..3 {
        out.extend(forward(&[
            SeqInput { tokens: &a[9 + i..10 + i], start: 9 + i, block_table: &ta, logits: true, pool: false },
            SeqInput { tokens: &b[10 + i..11 + i], start: 10 + i, block_table: &tb, logits: true, pool: false },
            SeqInput { tokens: &c[6 + i..7 + i], start: 6 + i, block_table: &tc, logits: true, pool: false },
        ]));
    }
    out
}

#[test]
fn tensor_parallel_ranks_give_the_logits_and_greedy_tokens_of_one() {
    use crate::backend::tp_group::TpGroup;
    // 8 heads, 4 K/V heads: N = 2 and 4 split both; N = 8 replicates each K/V head twice.
    for rope in [RopeStyle::Interleaved, RopeStyle::NeoX] {
        let m = shaped(rope, 8, 4, 64);
        let mut kv = m.kv_store(16, 4);
        let want = tp_steps(&mut |seqs| m.forward(&mut kv, seqs).unwrap());
        assert_eq!(want.len(), 1 + 3 + 3 * 3);
        for n in [2, 4, 8] {
            let mut group = TpGroup::spawn(&m, n, 2, 16, 4).unwrap();
            let got = tp_steps(&mut |seqs| group.forward(seqs).unwrap());
            assert_eq!(got.len(), want.len());
            // Bit-identical: the row-parallel segments are summed in the same order at any N
            // (the bar is 1e-4 relative).
            let bits = |v: &[Vec<f32>]| {
                v.iter().map(|r| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>()
            };
            assert_eq!(bits(&got), bits(&want), "N = {n}, {rope:?}");
            for w in &want {
                assert!(w.iter().any(|x| *x != 0.0));
            }
        }
    }
}

#[test]
fn a_failed_rank_fails_the_group_without_hanging() {
    use crate::backend::tp_group::{GroupError, TpGroup};
    let m = shaped(RopeStyle::Interleaved, 8, 4, 64);
    let mut group = TpGroup::spawn_with_failing_rank(&m, 4, 2, 16, 4, 2).unwrap();
    let toks = tokens(5, 1);
    let seqs = [SeqInput { tokens: &toks, start: 0, block_table: &[0, 1], logits: true, pool: false }];
    for _ in 0..2 {
        match group.forward(&seqs) {
            Err(GroupError::RankFailed { rank: 2, reason }) => assert!(reason.contains("on purpose"), "{reason}"),
            other => panic!("expected rank 2 to fail, got {other:?}"),
        }
    }
    // Sizes that do not fit are refused up front, naming the numbers.
    let e = TpGroup::spawn(&m, 3, 2, 16, 4).unwrap_err().to_string();
    assert!(e.contains("8 attention heads do not divide by 3") && e.contains("1, 2, 4, 8"), "{e}");
}

#[test]
fn row_parallel_segments_sum_the_same_in_one_pass_or_one_at_a_time() {
    let mut seed = 11u64;
    let parts: Vec<Matrix> = (0..4).map(|_| f32_matrix(6, 8, &mut seed)).collect();
    let t = 5;
    let x: Vec<f32> = (0..t * 32).map(|_| rng(&mut seed)).collect();
    let run = |max_partials: usize| {
        let mut scratch = Scratch { max_partials, ..Scratch::default() };
        let mut out = vec![0f32; t * 6];
        row_parallel(&parts, &x, t, &mut out, &mut scratch, None).unwrap();
        out
    };
    let (all, single, pairs) = (run(1 << 20), run(1), run(2 * t * 6));
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&all), bits(&single));
    assert_eq!(bits(&all), bits(&pairs));
    // And it is the product with the whole matrix, up to rounding.
    for r in 0..t {
        for o in 0..6 {
            let want: f32 = (0..4)
                .map(|j| {
                    let mut row = vec![0f32; 8];
                    parts[j].row_f32(o, &mut row).unwrap();
                    (0..8).map(|c| row[c] * x[r * 32 + j * 8 + c]).sum::<f32>()
                })
                .sum();
            assert!((all[r * 6 + o] - want).abs() < 1e-5, "{} vs {want}", all[r * 6 + o]);
        }
    }
}
