//! Tensor parallelism on this machine: the cpu backend's model steps with one rank vs the
//! largest tensor-parallel size that fits the model (3 for SmolLM2-135M), same threads,
//! alternating, in one run. Prints tokens/s for each, the ratio, and the share of a TP step
//! that rank 0 spends in collectives (all-reduces and the logits gather, waiting included).
//!
//! On two cores, three ranks cannot be faster than one rank using both cores: the point is
//! that TP is correct (bit-identical, see `tests/tensor_parallel.rs`) and what it costs.
//!
//! `cargo bench -p switchyard-engine --bench tensor_parallel` (`SWITCHYARD_BENCH_THREADS`,
//! default 2; `SWITCHYARD_BENCH_REPS`, default 5).

use std::time::Instant;

use switchyard_engine::backend::cpu::load;
use switchyard_engine::backend::tp_group::TpGroup;
use switchyard_engine::model::default_model_path;
use switchyard_engine::model::llama::SeqInput;
use switchyard_engine::model::tp::TpPlan;

const BLOCK: usize = 16;

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let model = match load(&default_model_path()) {
        Ok(m) => m.model,
        Err(e) => {
            eprintln!("tensor_parallel: {e} (run scripts/setup.sh to fetch the model)");
            std::process::exit(1);
        }
    };
    let threads = env_usize("SWITCHYARD_BENCH_THREADS", 2);
    let reps = env_usize("SWITCHYARD_BENCH_REPS", 5);
    let n = *TpPlan::valid_sizes(model.tp_dims()).last().expect("1 always fits");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    let seqs = 17;
    let per_seq = 1024 / BLOCK;
    let mut kv = model.kv_store(seqs * per_seq, BLOCK);
    let mut group = TpGroup::spawn(&model, n, threads, seqs * per_seq, BLOCK).expect("group");
    let tables: Vec<Vec<u32>> = (0..seqs).map(|s| (0..per_seq).map(|b| (s * per_seq + b) as u32).collect()).collect();
    let vocab = model.cfg.vocab as u32;
    let tokens =
        |seed: u32, k: usize| -> Vec<u32> { (0..k as u32).map(|i| (i * 7919 + seed * 104729) % vocab).collect() };
    let prompt = tokens(0, 512);
    let next = [prompt[511]];
    let ctx: Vec<Vec<u32>> = (1..seqs).map(|s| tokens(s as u32, 129)).collect();

    type Case<'a> = (&'static str, f64, Vec<SeqInput<'a>>);
    let cases: Vec<Case<'_>> = vec![
        (
            "prefill 512 tokens",
            512.0,
            vec![SeqInput { tokens: &prompt, start: 0, block_table: &tables[0], logits: true, pool: false }],
        ),
        (
            "decode 1 sequence",
            1.0,
            vec![SeqInput { tokens: &next, start: 512, block_table: &tables[0], logits: true, pool: false }],
        ),
        (
            "decode 16 sequences",
            16.0,
            ctx.iter()
                .enumerate()
                .map(|(s, c)| SeqInput {
                    tokens: &c[128..],
                    start: 128,
                    block_table: &tables[s + 1],
                    logits: true,
                    pool: false,
                })
                .collect(),
        ),
    ];
    println!("tensor parallelism, SmolLM2-135M-Instruct Q4_1, {threads} threads: TP 1 vs TP {n} (median of {reps})\n");
    println!("| step | TP 1 tokens/s | TP {n} tokens/s | ratio | collectives share of a TP {n} step |");
    println!("|---|---:|---:|---:|---:|");
    // The prefill case also fills the cache the decode cases read.
    for (name, toks, inputs) in &cases {
        let (mut one, mut tp, mut share) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            let t = Instant::now();
            pool.install(|| model.forward(&mut kv, inputs)).expect("forward");
            one.push(toks / t.elapsed().as_secs_f64());
            let (c0, t) = (group.comm_seconds(), Instant::now());
            group.forward(inputs).expect("tp forward");
            let dt = t.elapsed().as_secs_f64();
            tp.push(toks / dt);
            share.push((group.comm_seconds() - c0) / dt);
        }
        let (a, b) = (median(one), median(tp));
        println!("| {name} | {a:.1} | {b:.1} | {:.2}× | {:.0}% |", b / a, 100.0 * median(share));
    }
    println!(
        "\nTP {n} runs {n} rank threads on {threads} cores ({} thread(s) each): a rank waiting in a collective \
         for a rank that has no core is most of that share.",
        (threads / n).max(1)
    );
}
