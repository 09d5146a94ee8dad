//! Where the `cpu` backend's time goes, without HTTP or the scheduler: one model step on
//! the default model (SmolLM2-135M Q4_1), the three shapes the llama.cpp comparison
//! (`loadtest/bench/cpu_vs_llama_cpp.py`) exercises.
//!
//! 1. prefill: one 512-token prompt in one step (prompt processing, tokens/s);
//! 2. decode: one sequence, one token at position 512 (single-stream decode, tokens/s);
//! 3. batch-16 decode: 16 sequences one token each at position 128 (aggregate, tokens/s);
//! 4. gemm: the quantized matrix kernel alone, one thread, layer 0's gate projection against
//!    1, 16 and 512 token rows (billions of multiply-adds per second).
//!
//! Each figure is the median of `SWITCHYARD_BENCH_REPS` (default 5) runs on a rayon pool of
//! `SWITCHYARD_BENCH_THREADS` (default 2) threads.
//!
//! `cargo bench -p switchyard-engine --bench cpu_forward [-- prefill|decode|batch|gemm]` (one
//! case only, e.g. under `perf record`).

use std::time::Instant;

use switchyard_engine::backend::cpu::load;
use switchyard_engine::model::default_model_path;
use switchyard_engine::model::llama::{KvStore, SeqInput};
use switchyard_engine::model::simd::{dot_rows_tokens, Kernel, QuantizedActs};

const BLOCK: usize = 16;

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).map_or_else(|| "       -".to_string(), |m| format!("{m:8.1}"))
}

fn main() {
    let path = default_model_path();
    let loaded = match load(&path) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("cpu_forward: {e} (run scripts/setup.sh to fetch the model)");
            std::process::exit(1);
        }
    };
    let model = loaded.model;
    let reps = env_usize("SWITCHYARD_BENCH_REPS", 5);
    let threads = env_usize("SWITCHYARD_BENCH_THREADS", 2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    let vocab = model.cfg.vocab as u32;
    // Deterministic, varied token ids (not one repeated token: attention would be degenerate).
    let tokens =
        |seed: u32, n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i * 7919 + seed * 104729) % vocab).collect() };
    let seqs = 17;
    let blocks_per_seq = 1024 / BLOCK;
    let mut kv = KvStore::new(&model.cfg, seqs * blocks_per_seq, BLOCK);
    let tables: Vec<Vec<u32>> =
        (0..seqs).map(|s| (0..blocks_per_seq).map(|b| (s * blocks_per_seq + b) as u32).collect()).collect();

    // Timing does not depend on the cached values: decode steps attend over whatever the
    // cache holds at their positions (zeros when the prefill case did not run).
    let prompt = tokens(0, 512);
    let step = |kv: &mut KvStore, inputs: &[SeqInput<'_>]| -> f64 {
        let t = Instant::now();
        pool.install(|| model.forward(kv, inputs)).expect("forward");
        t.elapsed().as_secs_f64()
    };
    let only = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    let run = |case: &str| only.as_deref().is_none_or(|o| o == case);
    let prefill: Vec<f64> = (0..if run("prefill") { reps } else { 0 })
        .map(|_| {
            let s = step(
                &mut kv,
                &[SeqInput { tokens: &prompt, start: 0, block_table: &tables[0], logits: true, pool: false }],
            );
            512.0 / s
        })
        .collect();
    let next = [prompt[511]];
    let decode: Vec<f64> = (0..if run("decode") { reps.max(10) } else { 0 })
        .map(|_| {
            1.0 / step(
                &mut kv,
                &[SeqInput { tokens: &next, start: 512, block_table: &tables[0], logits: true, pool: false }],
            )
        })
        .collect();
    let ctx: Vec<Vec<u32>> = (1..seqs).map(|s| tokens(s as u32, 129)).collect();
    let batch: Vec<f64> = (0..if run("batch") { reps.max(10) } else { 0 })
        .map(|_| {
            let inputs: Vec<SeqInput<'_>> = ctx
                .iter()
                .enumerate()
                .map(|(s, c)| SeqInput {
                    tokens: &c[128..],
                    start: 128,
                    block_table: &tables[s + 1],
                    logits: true,
                    pool: false,
                })
                .collect();
            16.0 / step(&mut kv, &inputs)
        })
        .collect();
    let kernel = Kernel::detect();
    let mut gemm = Vec::new();
    if run("gemm") {
        let w = &model.layers[0].w_gate;
        for t in [1usize, 16, 512] {
            let x: Vec<f32> = (0..t * w.cols).map(|i| ((i * 7919) % 2000) as f32 / 1000.0 - 1.0).collect();
            let mut acts = QuantizedActs::default();
            acts.quantize(kernel, &x, w.cols);
            let mut out = vec![0f32; w.rows * t];
            let bytes = w.rows_bytes(0, w.rows);
            let reps = (20_000 / t).max(4);
            let mut best = f64::MAX;
            for _ in 0..5 {
                let start = Instant::now();
                for _ in 0..reps {
                    dot_rows_tokens(kernel, w.ty, bytes, w.rows, &acts, &mut out).expect("gemm");
                }
                best = best.min(start.elapsed().as_secs_f64() / reps as f64);
            }
            gemm.push((t, (w.rows * w.cols * t) as f64 / best / 1e9));
        }
    }
    println!("cpu_forward ({threads} threads, kernel {kernel:?}):");
    println!("  prefill 512 tokens     {} tokens/s", median(prefill));
    println!("  decode 1 sequence      {} tokens/s", median(decode));
    println!("  decode 16 sequences    {} tokens/s", median(batch));
    for (t, g) in gemm {
        println!("  gemm 1536×576 × {t:3} tokens, 1 thread {g:8.1} GMAC/s");
    }
}
