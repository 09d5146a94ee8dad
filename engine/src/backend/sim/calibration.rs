//! Calibration of the `sim` profiles against published vLLM measurements.
//!
//! Each [`Scenario`] replays a published benchmark's shape (batch size, input and output
//! lengths) through the real scheduler and block pool with the sim backend, in *virtual
//! time* (no sleeping: each step advances a clock by its modelled duration), and reports
//! the same figure the publication reports. `engine/README.md` holds the resulting table;
//! the unit test below keeps every scenario within ±25% of its published value, and
//! `cargo bench -p switchyard-engine --bench sim_calibration` prints it.

use std::collections::HashMap;

use super::{kv_cache_blocks, profile, SimBackend, SimProfile};
use crate::engine_core::EngineCore;
use crate::kv::BlockPool;
use crate::scheduler::{Request, SamplingParams, Scheduler, SchedulerConfig};
use crate::tokenizer::SimTokenizer;

/// What a scenario measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure {
    /// Mean inter-token latency of the requests (ms).
    MeanItlMs,
    /// Mean time to first token (ms).
    MeanTtftMs,
    /// Mean end-to-end latency (ms).
    MeanE2eMs,
    /// Completed requests per second over the whole run.
    RequestsPerS,
}

/// A published measurement and the workload that reproduces its shape.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    /// Sim profile.
    pub profile: &'static str,
    /// Tensor-parallel override, when the publication ran another TP than the profile.
    pub tp: Option<usize>,
    /// Short description of the workload.
    pub workload: &'static str,
    /// Requests, all arriving at t = 0.
    pub requests: usize,
    /// Prompt tokens per request.
    pub input_len: usize,
    /// Output tokens per request.
    pub output_len: usize,
    /// Figure compared.
    pub figure: Figure,
    /// Published value.
    pub published: f64,
    /// Where it was published.
    pub source: &'static str,
}

/// The published figures we calibrate against (see `shared/design/SIM-CALIBRATION.md`).
pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        profile: "h100-llama3-8b",
        tp: None,
        workload: "1 stream, 741 output tokens",
        requests: 1,
        input_len: 128,
        output_len: 741,
        figure: Figure::MeanItlMs,
        published: 7.05,
        source: "LambdaLabsML/vllm-benchmark 1xH100 (vLLM 0.6.0)",
    },
    Scenario {
        profile: "h100-llama3-8b",
        tp: None,
        workload: "10 prompts, 1,369 tokens prefilled together",
        requests: 10,
        input_len: 137,
        output_len: 1,
        figure: Figure::MeanTtftMs,
        published: 62.0,
        source: "LambdaLabsML/vllm-benchmark 1xH100 (vLLM 0.6.0)",
    },
    Scenario {
        profile: "h100-llama3-8b",
        tp: None,
        workload: "batch 8, 32 in / 128 out",
        requests: 8,
        input_len: 32,
        output_len: 128,
        figure: Figure::MeanE2eMs,
        published: 997.5,
        source: "vLLM perf CI, buildkite build 9555",
    },
    Scenario {
        profile: "h100-llama3-8b",
        tp: None,
        workload: "2,000 requests, 462 in / 16 out, unlimited rate",
        requests: 2000,
        input_len: 462,
        output_len: 16,
        figure: Figure::RequestsPerS,
        published: 59.0,
        source: "vLLM v0.6.0 perf blog (prefill-heavy)",
    },
    Scenario {
        profile: "h100-llama3-8b",
        tp: None,
        workload: "2,000 requests, 202 in / 179 out, unlimited rate",
        requests: 2000,
        input_len: 202,
        output_len: 179,
        figure: Figure::RequestsPerS,
        published: 37.0,
        source: "vLLM v0.6.0 perf blog (ShareGPT-like)",
    },
    Scenario {
        profile: "h100x4-llama3-70b",
        tp: None,
        workload: "batch 8, 32 in / 128 out",
        requests: 8,
        input_len: 32,
        output_len: 128,
        figure: Figure::MeanE2eMs,
        published: 2444.0,
        source: "vLLM perf CI, buildkite build 9555",
    },
    Scenario {
        profile: "h100x4-llama3-70b",
        tp: None,
        workload: "1 stream, 128 output tokens",
        requests: 1,
        input_len: 200,
        output_len: 128,
        figure: Figure::MeanItlMs,
        published: 19.4,
        source: "vLLM perf CI, build 9555 (mean ITL at QPS 1)",
    },
    Scenario {
        profile: "h200-llama3-70b",
        tp: Some(4),
        workload: "4xH200 TP4, batch 8, 32 in / 128 out",
        requests: 8,
        input_len: 32,
        output_len: 128,
        figure: Figure::MeanE2eMs,
        published: 2075.0,
        source: "vLLM perf CI, buildkite build 9513",
    },
    Scenario {
        profile: "h200-llama3-70b",
        tp: Some(4),
        workload: "4xH200 TP4, 1 stream",
        requests: 1,
        input_len: 200,
        output_len: 128,
        figure: Figure::MeanItlMs,
        published: 16.55,
        source: "vLLM perf CI, build 9513 (mean ITL)",
    },
    Scenario {
        profile: "h100x4-llama3-70b",
        tp: None,
        workload: "2,000 requests, 202 in / 179 out, unlimited rate",
        requests: 2000,
        input_len: 202,
        output_len: 179,
        figure: Figure::RequestsPerS,
        published: 17.3,
        source: "vLLM v0.6.0 perf blog (ShareGPT-like, TP4)",
    },
];

/// Timings of one request in a virtual run, seconds from t = 0.
#[derive(Debug, Clone, Default)]
pub struct VirtualTimings {
    /// Time of each generated token.
    pub token_times: Vec<f64>,
}

/// Run `requests` identical-shape requests arriving at t = 0 through the real scheduler
/// with vLLM's default limits, stepping a virtual clock. Returns per-request timings and
/// the total virtual time.
pub fn run_virtual(p: &SimProfile, requests: usize, input_len: usize, output_len: usize) -> (Vec<VirtualTimings>, f64) {
    let block_size = 16;
    let blocks = kv_cache_blocks(p, block_size, 0.9).expect("model fits");
    let cfg = SchedulerConfig { max_num_batched_tokens: 8192, max_num_seqs: 256, max_model_len: 1 << 20 };
    let scheduler = Scheduler::new(cfg, BlockPool::new(blocks, block_size, true), SimTokenizer::EOS);
    let mut core = EngineCore::new(scheduler, Box::new(SimBackend::new(*p)));
    for id in 0..requests as u64 {
        // distinct prompts: no accidental prefix sharing
        let prompt = (0..input_len as u32).map(|t| 100_000 + (id as u32) * 10_000 + t).collect();
        let params = SamplingParams { max_tokens: output_len, ignore_eos: true, seed: id, ..Default::default() };
        core.scheduler.add(Request::new(id, prompt, params));
    }
    let mut timings: HashMap<u64, VirtualTimings> = HashMap::new();
    let mut now = 0.0;
    while let Some(step) = core.step().expect("the sim backend never fails") {
        now += step.model_time.unwrap_or_default().as_secs_f64();
        for out in step.outputs {
            timings.entry(out.id).or_default().token_times.push(now);
        }
    }
    let mut out: Vec<_> = timings.into_iter().collect();
    out.sort_by_key(|(id, _)| *id);
    (out.into_iter().map(|(_, t)| t).collect(), now)
}

/// The modelled value of a scenario's figure.
pub fn model_value(s: &Scenario) -> f64 {
    let mut p = profile(s.profile).expect("known profile");
    if let Some(tp) = s.tp {
        p.tp = tp;
    }
    let (runs, total) = run_virtual(&p, s.requests, s.input_len, s.output_len);
    let mean = |f: &dyn Fn(&VirtualTimings) -> f64| runs.iter().map(f).sum::<f64>() / runs.len() as f64;
    match s.figure {
        Figure::MeanItlMs => {
            mean(&|t| {
                let n = t.token_times.len();
                (t.token_times[n - 1] - t.token_times[0]) / (n - 1) as f64
            }) * 1e3
        }
        Figure::MeanTtftMs => mean(&|t| t.token_times[0]) * 1e3,
        Figure::MeanE2eMs => mean(&|t| *t.token_times.last().unwrap()) * 1e3,
        Figure::RequestsPerS => runs.len() as f64 / total,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_is_within_25_percent_of_its_published_value() {
        let mut report = String::new();
        let mut worst: f64 = 1.0;
        for s in SCENARIOS {
            let m = model_value(s);
            let ratio = m / s.published;
            report.push_str(&format!(
                "{:<20} {:<50} model {m:>9.2} published {:>9.2} ratio {ratio:.2}\n",
                s.profile, s.workload, s.published
            ));
            worst = if (ratio - 1.0).abs() > (worst - 1.0).abs() { ratio } else { worst };
        }
        eprintln!("{report}");
        assert!((0.75..=1.25).contains(&worst), "worst ratio {worst:.2}\n{report}");
    }
}
