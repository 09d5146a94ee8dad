//! Roofline time model of one engine step.
//!
//! A step computes `T` new tokens across its sequences (decodes and prefill chunks). Per GPU
//! (everything divided by the tensor-parallel degree `tp`):
//!
//! - **FLOPs** = 2 · (P − 2·V·H) · T (linear layers) + 2 · V · H · S (LM head, only for the
//!   `S` sampled positions) + 4 · L · heads · d · Σᵢ nᵢ·(startᵢ + (nᵢ+1)/2) (causal attention:
//!   each new token attends to its context).
//! - **Bytes** = weights (P − V·H) · dtype (read once per step, the embedding table is only
//!   gathered) + KV bytes/token · (Σᵢ context read + T written).
//! - **Time** = max(FLOPs ÷ (peak · compute_eff), bytes ÷ (bandwidth · bandwidth_eff))
//!   + step overhead + per-sequence overhead · sequences + (tp > 1: 2·L all-reduces of T·H activations, each latency + ring time).
//!
//! Attention cost therefore grows with context length, decode steps are bandwidth-bound
//! and prefill steps compute-bound, as on real hardware.

use std::time::Duration;

use super::profiles::SimProfile;
use crate::scheduler::SeqView;

/// What the time model needs of a step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// New tokens computed.
    pub num_tokens: f64,
    /// Sequences that sample a token.
    pub num_sampled: f64,
    /// Sequences in the step.
    pub num_seqs: f64,
    /// Σ nᵢ·(startᵢ + (nᵢ+1)/2): query–key pairs of causal attention.
    pub attn_pairs: f64,
    /// Σ (startᵢ + nᵢ): KV entries read.
    pub kv_tokens_read: f64,
}

impl StepShape {
    /// The shape of a scheduled batch.
    pub fn of(batch: &[SeqView<'_>]) -> Self {
        let mut s = StepShape::default();
        for v in batch {
            s.push(v.sched.start, v.sched.len, v.sched.sample);
        }
        s
    }

    /// Add one sequence computing `len` tokens after `start` cached ones.
    pub fn push(&mut self, start: usize, len: usize, sample: bool) {
        let (start, len) = (start as f64, len as f64);
        self.num_tokens += len;
        self.num_seqs += 1.0;
        self.num_sampled += f64::from(u8::from(sample));
        self.attn_pairs += len * (start + (len + 1.0) / 2.0);
        self.kv_tokens_read += start + len;
    }
}

/// Modelled duration of a step of `shape` under profile `p` with `p.tp` GPUs.
pub fn step_time(p: &SimProfile, shape: &StepShape) -> Duration {
    if p.instant || shape.num_tokens == 0.0 {
        return Duration::ZERO;
    }
    let m = &p.model;
    let tp = p.tp as f64;
    let vh = (m.vocab * m.hidden) as f64;
    let flops = (2.0 * (m.params - 2.0 * vh) * shape.num_tokens
        + 2.0 * vh * shape.num_sampled
        + 4.0 * (m.layers * m.heads * m.head_dim) as f64 * shape.attn_pairs)
        / tp;
    let bytes = ((m.params - vh) * m.dtype_bytes as f64
        + m.kv_bytes_per_token() * (shape.kv_tokens_read + shape.num_tokens))
        / tp;
    let compute = flops / (p.gpu.bf16_flops * p.compute_efficiency);
    let memory = bytes / (p.gpu.hbm_bandwidth * p.bandwidth_efficiency);
    let mut t = compute.max(memory) + p.step_overhead_s + p.per_seq_overhead_s * shape.num_seqs;
    if p.tp > 1 {
        let payload = shape.num_tokens * (m.hidden * m.dtype_bytes) as f64;
        let ring = 2.0 * (tp - 1.0) / tp * payload / p.gpu.link_bandwidth;
        t += 2.0 * m.layers as f64 * (p.allreduce_latency_s + ring);
    }
    Duration::from_secs_f64(t)
}

/// Activation and workspace memory vLLM keeps out of the KV cache, per GPU.
pub const ACTIVATION_RESERVE_BYTES: f64 = 2.0 * 1024.0 * 1024.0 * 1024.0;

/// KV blocks that fit: per GPU, memory × utilization − weights ÷ tp − activations, divided
/// by the GPU's share of one block. `None` when the weights do not fit.
pub fn kv_cache_blocks(p: &SimProfile, block_size: usize, gpu_memory_utilization: f64) -> Option<usize> {
    let tp = p.tp as f64;
    let weights = p.model.params * p.model.dtype_bytes as f64 / tp;
    let free = p.gpu.memory_bytes * gpu_memory_utilization - weights - ACTIVATION_RESERVE_BYTES;
    let block_bytes = p.model.kv_bytes_per_token() / tp * block_size as f64;
    (free > block_bytes).then(|| (free / block_bytes) as usize)
}

#[cfg(test)]
mod tests {
    use super::super::profiles::profile;
    use super::*;

    fn decode_batch(batch: usize, ctx: usize) -> StepShape {
        let mut s = StepShape::default();
        for _ in 0..batch {
            s.push(ctx, 1, true);
        }
        s
    }

    #[test]
    fn decode_is_bandwidth_bound_and_grows_with_context() {
        let p = profile("h100-llama3-8b").unwrap();
        let short = step_time(&p, &decode_batch(1, 100)).as_secs_f64();
        assert!((short - 7.05e-3).abs() / 7.05e-3 < 0.1, "batch-1 decode {short}");
        let long = step_time(&p, &decode_batch(64, 8000)).as_secs_f64();
        assert!(long > short * 1.5, "64 × 8k context reads 67 GB of KV: {long}");
    }

    #[test]
    fn tensor_parallel_profiles_fit_and_pay_for_all_reduce() {
        let p = profile("h100x4-llama3-70b").unwrap();
        assert!(kv_cache_blocks(&p, 16, 0.9).unwrap() > 10_000);
        let mut single = p;
        single.tp = 1;
        assert_eq!(kv_cache_blocks(&single, 16, 0.9), None, "70B bf16 does not fit one H100");
    }

    #[test]
    fn instant_profile_takes_no_time() {
        assert_eq!(step_time(&profile("instant").unwrap(), &decode_batch(8, 10)), Duration::ZERO);
    }
}
