//! Named GPU + model profiles for the `sim` backend.
//!
//! Hardware figures are the vendors' published peaks (see `shared/design/SIM-CALIBRATION.md`
//! and `engine/README.md`); model shapes are the models' `config.json`. Efficiency terms are
//! calibrated against published vLLM measurements:
//!
//! - `compute_efficiency` 0.40: prefill reaches ~40–45% of dense bf16 peak in vLLM.
//! - `bandwidth_efficiency` 0.90: weight streaming in decode gets ~90% of HBM bandwidth.
//! - `step_overhead_s` 2.4 ms: scheduling, sampling, kernel launches per step
//!   (batch-1 decode of Llama-3-8B on H100 is 7.05 ms vs 4.5 ms of pure weight reads).
//! - `per_seq_overhead_s` 45 µs: host work that grows with the batch (vLLM 0.6's own
//!   analysis found the CPU side — scheduling, sampling, detokenizing — a bottleneck at
//!   large batches); without it, saturated ShareGPT-like throughput is 1.7× the published one.
//! - `allreduce_latency_s` 32 µs: fixed cost of each of the 2 all-reduces per layer
//!   under tensor parallelism (closes the 70B-TP4 gap of ~6 ms per step).

/// A GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSpec {
    /// Marketing name.
    pub name: &'static str,
    /// Dense bf16 FLOP/s.
    pub bf16_flops: f64,
    /// Memory in bytes.
    pub memory_bytes: f64,
    /// HBM bandwidth in bytes/s.
    pub hbm_bandwidth: f64,
    /// GPU-to-GPU bandwidth per direction (NVLink), bytes/s.
    pub link_bandwidth: f64,
}

/// A decoder-only transformer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelSpec {
    /// Hugging Face id, the default served model name.
    pub name: &'static str,
    /// Total parameters.
    pub params: f64,
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// KV heads (GQA).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Vocabulary size (embedding and LM head are `vocab × hidden` each, untied).
    pub vocab: usize,
    /// Bytes per weight and per KV element.
    pub dtype_bytes: usize,
    /// Context length.
    pub max_context: usize,
}

impl ModelSpec {
    /// KV cache bytes per token over all layers and GPUs.
    pub fn kv_bytes_per_token(&self) -> f64 {
        (self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes) as f64
    }
}

/// A GPU, a model and how they are run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimProfile {
    /// Profile name (`--sim-profile`).
    pub name: &'static str,
    /// GPU.
    pub gpu: GpuSpec,
    /// Model.
    pub model: ModelSpec,
    /// Tensor-parallel degree (overridable with `--tensor-parallel-size`).
    pub tp: usize,
    /// Share of peak FLOP/s reached by the linear layers and attention.
    pub compute_efficiency: f64,
    /// Share of HBM bandwidth reached.
    pub bandwidth_efficiency: f64,
    /// Fixed time per step, seconds.
    pub step_overhead_s: f64,
    /// Host time per scheduled sequence per step (scheduling, sampling, detokenizing), seconds.
    pub per_seq_overhead_s: f64,
    /// Fixed time per all-reduce, seconds.
    pub allreduce_latency_s: f64,
    /// Zero-time steps (the `instant` profile, for overhead tests).
    pub instant: bool,
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// NVIDIA H100 SXM 80 GB.
pub const H100: GpuSpec = GpuSpec {
    name: "H100-SXM-80GB",
    bf16_flops: 989.4e12,
    memory_bytes: 80.0 * GIB,
    hbm_bandwidth: 3.35e12,
    link_bandwidth: 450e9,
};
/// NVIDIA H200 141 GB.
pub const H200: GpuSpec = GpuSpec {
    name: "H200-141GB",
    bf16_flops: 989.4e12,
    memory_bytes: 141e9,
    hbm_bandwidth: 4.8e12,
    link_bandwidth: 450e9,
};
/// NVIDIA A100 SXM 80 GB.
pub const A100: GpuSpec = GpuSpec {
    name: "A100-SXM-80GB",
    bf16_flops: 312e12,
    memory_bytes: 80.0 * GIB,
    hbm_bandwidth: 2.039e12,
    link_bandwidth: 300e9,
};

/// Llama-3-8B-Instruct, bf16.
pub const LLAMA3_8B: ModelSpec = ModelSpec {
    name: "meta-llama/Meta-Llama-3-8B-Instruct",
    params: 8.03e9,
    layers: 32,
    hidden: 4096,
    heads: 32,
    kv_heads: 8,
    head_dim: 128,
    vocab: 128_256,
    dtype_bytes: 2,
    max_context: 8192,
};
/// Llama-3-70B-Instruct, bf16.
pub const LLAMA3_70B: ModelSpec = ModelSpec {
    name: "meta-llama/Meta-Llama-3-70B-Instruct",
    params: 70.6e9,
    layers: 80,
    hidden: 8192,
    heads: 64,
    kv_heads: 8,
    head_dim: 128,
    vocab: 128_256,
    dtype_bytes: 2,
    max_context: 8192,
};

const fn calibrated(name: &'static str, gpu: GpuSpec, model: ModelSpec, tp: usize) -> SimProfile {
    SimProfile {
        name,
        gpu,
        model,
        tp,
        compute_efficiency: 0.40,
        bandwidth_efficiency: 0.90,
        step_overhead_s: 2.4e-3,
        per_seq_overhead_s: 45e-6,
        allreduce_latency_s: 32e-6,
        instant: false,
    }
}

/// Every profile.
pub const PROFILES: &[SimProfile] = &[
    calibrated("h100-llama3-8b", H100, LLAMA3_8B, 1),
    calibrated("h100x4-llama3-70b", H100, LLAMA3_70B, 4),
    calibrated("a100-llama3-8b", A100, LLAMA3_8B, 1),
    calibrated("h200-llama3-70b", H200, LLAMA3_70B, 2),
    SimProfile { instant: true, ..calibrated("instant", H100, LLAMA3_8B, 1) },
];

/// Profile names, for help and error messages.
pub const PROFILE_NAMES: &[&str] =
    &["h100-llama3-8b", "h100x4-llama3-70b", "a100-llama3-8b", "h200-llama3-70b", "instant"];

/// Look a profile up by name.
pub fn profile(name: &str) -> Option<SimProfile> {
    PROFILES.iter().find(|p| p.name == name).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_list_matches_profiles() {
        let names: Vec<_> = PROFILES.iter().map(|p| p.name).collect();
        assert_eq!(names, PROFILE_NAMES);
        assert!(profile("h100-llama3-8b").is_some());
        assert!(profile("tpu").is_none());
    }

    #[test]
    fn kv_bytes_match_published_figures() {
        assert_eq!(LLAMA3_8B.kv_bytes_per_token(), 131_072.0);
        assert_eq!(LLAMA3_70B.kv_bytes_per_token(), 327_680.0);
    }
}
