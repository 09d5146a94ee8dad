//! The `cpu` backend: a real Llama model computed on the host CPU.
//!
//! Each step hands every scheduled sequence (prefill chunks and decodes) to
//! [`Llama::forward`] as one batch on the backend's own rayon pool, then samples one token
//! for each sequence whose step reached the end of its known tokens. K/V live in a
//! [`KvStore`] indexed by the block pool's block ids, so the scheduler's prefix cache and
//! preemption apply to real tensors unchanged.
//!
//! Sampling ([`sample`]) is pure: greedy at temperature 0, otherwise temperature → top-k →
//! top-p over a softmax, drawn from an RNG seeded by the request's seed and the index of the
//! token being generated — the same request with the same seed gives the same text whatever
//! else shares its batches.

use std::path::Path;

use rand::{Rng, SeedableRng};

use super::tp_group::{GroupError, TpGroup};
use super::{Backend, BackendFailure, StepOutput};
use crate::model::gguf::GgufFile;
use crate::model::llama::{KvStore, Llama, ModelError, SeqInput};
use crate::model::model_tokenizer::{ModelTokenizer, TokenizerError};
use crate::scheduler::{Sampled, SamplingParams, SeqView, TokenLogprobs};
use crate::tokenizer::TokenId;

/// Why the model cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The weights.
    #[error("{path}: {source}")]
    Model {
        /// The file.
        path: String,
        /// What is wrong.
        source: ModelError,
    },
    /// The tokenizer.
    #[error("{path}: {source}")]
    Tokenizer {
        /// The file.
        path: String,
        /// What is wrong.
        source: TokenizerError,
    },
    /// An HF checkpoint directory.
    #[error("{path}: {source}")]
    Hf {
        /// The directory.
        path: String,
        /// What is wrong.
        source: crate::model::hf::HfError,
    },
    /// The thread pool.
    #[error("thread pool: {0}")]
    Threads(String),
    /// Tensor parallelism.
    #[error(transparent)]
    Tp(#[from] GroupError),
}

/// A model file loaded: weights and tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    /// Weights.
    pub model: Llama,
    /// Tokenizer and chat template.
    pub tokenizer: ModelTokenizer,
}

/// Load a model: a GGUF file, or an HF checkpoint directory.
pub fn load(path: &Path) -> Result<LoadedModel, LoadError> {
    let p = path.display().to_string();
    if path.is_dir() {
        let (model, tokenizer) = crate::model::hf::load(path).map_err(|source| LoadError::Hf { path: p, source })?;
        return Ok(LoadedModel { model, tokenizer });
    }
    let file = GgufFile::open(path).map_err(|e| LoadError::Model { path: p.clone(), source: e.into() })?;
    let model = Llama::from_gguf(&file).map_err(|source| LoadError::Model { path: p.clone(), source })?;
    let tokenizer =
        ModelTokenizer::from_gguf(&file.header).map_err(|source| LoadError::Tokenizer { path: p, source })?;
    Ok(LoadedModel { model, tokenizer })
}

/// The cpu executor.
pub struct CpuBackend {
    exec: Executor,
    eos: TokenId,
}

/// Where the logits are computed.
enum Executor {
    /// The whole model on one rayon pool.
    Single { model: Box<Llama>, kv: KvStore, pool: rayon::ThreadPool },
    /// A tensor-parallel group of rank threads.
    Group(TpGroup),
}

impl CpuBackend {
    /// A backend over `model` with K/V room for `num_blocks` blocks of `block_size` tokens,
    /// computing on `threads` threads, with `tp` tensor-parallel ranks (1: none).
    pub fn new(
        model: Llama,
        eos: TokenId,
        num_blocks: usize,
        block_size: usize,
        threads: usize,
        tp: usize,
    ) -> Result<Self, LoadError> {
        if tp > 1 {
            let group = TpGroup::spawn(&model, tp, threads, num_blocks, block_size)?;
            return Ok(Self { exec: Executor::Group(group), eos });
        }
        Self::single(model, eos, num_blocks, block_size, threads)
    }

    /// [`Self::new`] with `tp` > 1 ranks of which `fail_rank` panics at its first step
    /// (reliability tests; feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    pub fn with_failing_rank(
        model: Llama,
        eos: TokenId,
        num_blocks: usize,
        block_size: usize,
        threads: usize,
        tp: usize,
        fail_rank: usize,
    ) -> Result<Self, LoadError> {
        let group = TpGroup::spawn_with_failing_rank(&model, tp, threads, num_blocks, block_size, fail_rank)?;
        Ok(Self { exec: Executor::Group(group), eos })
    }

    fn single(
        model: Llama,
        eos: TokenId,
        num_blocks: usize,
        block_size: usize,
        threads: usize,
    ) -> Result<Self, LoadError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cpu-backend-{i}"))
            .build()
            .map_err(|e| LoadError::Threads(e.to_string()))?;
        let kv = KvStore::new(&model.cfg, num_blocks, block_size);
        Ok(Self { exec: Executor::Single { model: Box::new(model), kv, pool }, eos })
    }
}

impl Backend for CpuBackend {
    fn execute(&mut self, batch: &[SeqView<'_>]) -> Result<StepOutput, BackendFailure> {
        let inputs: Vec<SeqInput<'_>> = batch
            .iter()
            .map(|s| SeqInput {
                tokens: &s.tokens[s.sched.start..s.sched.start + s.sched.len],
                start: s.sched.start,
                block_table: s.block_table,
                logits: s.sched.sample,
            })
            .collect();
        let result = match &mut self.exec {
            Executor::Single { model, kv, pool } => pool.install(|| model.forward(kv, &inputs)),
            // A failed rank takes the group down: fatal for the engine.
            Executor::Group(group) => Ok(group.forward(&inputs).map_err(|e| BackendFailure(e.to_string()))?),
        };
        let sampling = batch.iter().filter(|s| s.sched.sample);
        let sampled = match result {
            Ok(logits) => sampling
                .zip(logits)
                .map(|(s, mut l)| {
                    // Log probabilities come from the raw distribution, so keep it when asked.
                    let raw = s.params.logprobs.map(|n| (l.clone(), n));
                    if let (false, Some(e)) = (s.eos_allowed, l.get_mut(self.eos as usize)) {
                        *e = f32::NEG_INFINITY;
                    }
                    let output = &s.tokens[s.tokens.len().saturating_sub(s.num_output_tokens)..];
                    penalize(&mut l, s.params, s.tokens, output);
                    let token = sample(&mut l, s.params, s.num_output_tokens);
                    let logprobs = raw.map(|(raw, n)| logprobs(&raw, token, n));
                    Sampled { id: s.sched.id, token, logprobs }
                })
                .collect(),
            // The server validates token ids and the scheduler sizes block tables, so this is
            // a bug; end the affected requests rather than the engine.
            Err(e) => {
                tracing::error!(error = %e, "cpu backend step failed; ending its requests");
                sampling.map(|s| Sampled { id: s.sched.id, token: self.eos, logprobs: None }).collect()
            }
        };
        Ok(StepOutput { sampled, model_time: None })
    }
}

/// Apply vLLM's penalties to `logits`: repetition over every token seen (`seen`: prompt +
/// output), presence and frequency over the generated `output`.
pub fn penalize(logits: &mut [f32], p: &SamplingParams, seen: &[TokenId], output: &[TokenId]) {
    if p.repetition_penalty != 1.0 {
        let mut done = std::collections::HashSet::new();
        for &t in seen {
            if let Some(l) = logits.get_mut(t as usize) {
                if done.insert(t) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts = std::collections::HashMap::new();
        for &t in output {
            *counts.entry(t).or_insert(0u32) += 1;
        }
        for (t, n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * n as f32;
            }
        }
    }
}

/// Pick the next token from `logits` (modified in place) under `p`; `index` is how many
/// tokens the request has generated so far (it seeds the draw).
pub fn sample(logits: &mut [f32], p: &SamplingParams, index: usize) -> TokenId {
    if p.temperature <= 0.0 || p.top_k == 1 {
        return argmax(logits);
    }
    let inv_t = 1.0 / p.temperature;
    let mut cand: Vec<(TokenId, f32)> =
        logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (i as TokenId, l * inv_t)).collect();
    if cand.is_empty() {
        return argmax(logits);
    }
    // Highest first, ties by lower id — only as far as the filters need: top-k selects its k
    // first; top-p and min-p need the order; plain sampling needs none (id order).
    let by_logit = |a: &(TokenId, f32), b: &(TokenId, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.top_k > 0 && (p.top_k as usize) < cand.len() {
        cand.select_nth_unstable_by(p.top_k as usize - 1, by_logit);
        cand.truncate(p.top_k as usize);
    }
    if p.top_p < 1.0 || p.min_p > 0.0 || p.top_k > 0 {
        cand.sort_unstable_by(by_logit);
    }
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0.0f64;
    for c in cand.iter_mut() {
        c.1 = (c.1 - max).exp();
        total += f64::from(c.1);
    }
    if p.min_p > 0.0 {
        // Probabilities relative to the most likely token are exp(l - max) = c.1 here.
        let keep = cand.iter().position(|c| c.1 < p.min_p).unwrap_or(cand.len()).max(1);
        cand.truncate(keep);
        total = cand.iter().map(|c| f64::from(c.1)).sum();
    }
    if p.top_p < 1.0 {
        let mut acc = 0.0f64;
        let keep = cand
            .iter()
            .position(|c| {
                acc += f64::from(c.1) / total;
                acc >= f64::from(p.top_p)
            })
            .map_or(cand.len(), |i| i + 1);
        cand.truncate(keep);
        total = cand.iter().map(|c| f64::from(c.1)).sum();
    }
    let seed = p.seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut u = rng.random::<f64>() * total;
    for c in &cand {
        u -= f64::from(c.1);
        if u <= 0.0 {
            return c.0;
        }
    }
    cand[cand.len() - 1].0
}

/// `token`'s log probability under `logits` and the `n` most likely tokens' (most likely
/// first, lower id first among ties), from a log-softmax computed in f64.
pub fn logprobs(logits: &[f32], token: TokenId, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_z = f64::from(max) + sum.ln();
    let lp = |l: f32| (f64::from(l) - log_z) as f32;
    let mut top: Vec<(TokenId, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as TokenId, l)).collect();
    let by_logit = |a: &(TokenId, f32), b: &(TokenId, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let n = n.min(top.len());
    if n > 0 && n < top.len() {
        top.select_nth_unstable_by(n - 1, by_logit);
    }
    top.truncate(n);
    top.sort_unstable_by(by_logit);
    let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| lp(l));
    TokenLogprobs { token, logprob, top: top.into_iter().map(|(t, l)| (t, lp(l))).collect() }
}

/// Index of the largest logit (lowest index among ties).
pub fn argmax(logits: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as TokenId
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: i32, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, seed, ..SamplingParams::default() }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut l = vec![0.1, 3.0, -1.0, 3.0];
        assert_eq!(sample(&mut l, &params(0.0, 0, 1.0, 0), 0), 1);
        let mut l = vec![0.1, 3.0, -1.0, 3.0];
        assert_eq!(sample(&mut l, &params(0.7, 1, 1.0, 0), 0), 1, "top_k 1 is greedy");
    }

    #[test]
    fn the_same_seed_and_index_give_the_same_token() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let draw = |seed, index| sample(&mut logits.clone(), &params(1.0, 0, 1.0, seed), index);
        for index in 0..20 {
            assert_eq!(draw(42, index), draw(42, index));
        }
        let a: Vec<_> = (0..20).map(|i| draw(42, i)).collect();
        let b: Vec<_> = (0..20).map(|i| draw(43, i)).collect();
        assert_ne!(a, b, "different seeds differ somewhere in 20 draws");
    }

    #[test]
    fn penalties_follow_vllm() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::default()
        };
        let mut l = vec![4.0, -4.0, 1.0, 1.0];
        // Token 0 in the prompt only, token 1 generated twice, token 2 once.
        penalize(&mut l, &p, &[0, 3, 1, 2, 1], &[1, 2, 1]);
        assert_eq!(l, vec![2.0, -8.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, 0.5]);
        // Greedy sees the penalties too.
        let mut l = vec![3.0, 2.9];
        penalize(&mut l, &SamplingParams { presence_penalty: 1.0, ..SamplingParams::default() }, &[0], &[0]);
        assert_eq!(sample(&mut l, &params(0.0, 0, 1.0, 0), 1), 1);
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_tokens_first() {
        let logits = vec![1.0f32, 3.0, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let want = |l: f32| (f64::from(l) - z.ln()) as f32;
        let lp = logprobs(&logits, 2, 3);
        assert_eq!(lp.token, 2);
        assert!((lp.logprob - want(2.0)).abs() < 1e-6);
        let ids: Vec<_> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2], "most likely first, lower id first among ties");
        for (t, l) in &lp.top {
            assert!((l - want(logits[*t as usize])).abs() < 1e-6);
        }
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(logprobs(&logits, 0, 99).top.len(), logits.len());
        // Large logits do not overflow.
        let lp = logprobs(&[1000.0, 1000.0], 0, 1);
        assert!((lp.logprob - (-std::f32::consts::LN_2)).abs() < 1e-6);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = vec![2.0, 1.9, -3.0, -4.0];
        let mut p = params(1.0, 0, 1.0, 0);
        p.min_p = 0.5;
        for seed in 0..200 {
            p.seed = seed;
            assert!(sample(&mut logits.clone(), &p, 0) <= 1);
        }
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let logits = vec![5.0, 4.9, 0.0, -1.0, -2.0];
        for seed in 0..200 {
            let t = sample(&mut logits.clone(), &params(1.0, 2, 1.0, seed), 0);
            assert!(t <= 1, "top_k 2 keeps ids 0 and 1, drew {t}");
            let t = sample(&mut logits.clone(), &params(1.0, 0, 0.5, seed), 0);
            assert_eq!(t, 0, "top_p 0.5 keeps only the most likely token");
        }
        // Disallowed tokens (−∞) are never drawn.
        let mut l = vec![f32::NEG_INFINITY, 0.0, 0.0];
        for seed in 0..50 {
            assert_ne!(sample(&mut l, &params(1.5, 0, 1.0, seed), 3), 0);
        }
    }
}
