//! Engine configuration: vLLM-named command-line flags, resolved and validated.
//!
//! [`EngineArgs`] is what the user typed; [`EngineConfig::from_args`] resolves defaults that
//! depend on the backend (served model name, context length, KV capacity) and rejects
//! impossible settings with an error naming the flag, the value and the reason.

use std::net::SocketAddr;

use clap::{Parser, ValueEnum};

use crate::backend::sim::{self, SimProfile};
use crate::error::ConfigError;
use crate::scheduler::SchedulerConfig;

/// Which executor runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// Calibrated GPU timing model (no weights, deterministic words).
    Sim,
    /// A real model (GGUF llama) computed on the CPU.
    Cpu,
}

/// Command-line flags. Names follow vLLM's `vllm serve` where vLLM has the flag.
#[derive(Debug, Clone, Parser)]
#[command(name = "switchyard-engine", version, about = "Switchyard's bundled LLM engine (OpenAI-compatible)")]
pub struct EngineArgs {
    /// Address to bind.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    /// Port to bind (0 picks a free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Executor.
    #[arg(long, value_enum, default_value = "sim")]
    pub backend: BackendKind,
    /// Model path (cpu backend) or model name (sim: the default served name).
    #[arg(long)]
    pub model: Option<String>,
    /// Name clients use in `model`; defaults to --model, or the sim profile's model.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// GPU + model the sim backend models (see `engine/README.md`).
    #[arg(long, default_value = "h100-llama3-8b")]
    pub sim_profile: String,
    /// sim: tokenize and render chats with this model's tokenizer (a `.gguf` file, a
    /// `tokenizer.json`, or a Hugging Face directory) instead of the simulator's own, so a
    /// simulated engine caches and publishes the token ids a real one would.
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// Tensor-parallel degree: ranks that each hold 1/N of every layer and meet in two
    /// all-reduces per layer (sim: the profile's GPU count; cpu: rank threads sharing
    /// --threads).
    #[arg(long)]
    pub tensor_parallel_size: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Token budget of one scheduler step.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Maximum concurrently running requests.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Maximum prompt + output tokens (default: the model's context length).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Number of KV blocks, instead of what memory allows.
    #[arg(long)]
    pub num_gpu_blocks_override: Option<usize>,
    /// Share of GPU memory for weights + KV cache (sim).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Disable automatic prefix caching.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Seed of requests that do not give one: 0, a random seed per request (vLLM's
    /// behaviour); otherwise this mixed with the request's number, for reproducible runs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// cpu: KV cache size in GiB (vLLM's `VLLM_CPU_KVCACHE_SPACE`).
    #[arg(long, default_value_t = 1.0)]
    pub kv_cache_space: f64,
    /// cpu: compute threads (default: one per CPU).
    #[arg(long)]
    pub threads: Option<usize>,
    /// On SIGTERM, stop accepting connections and let the requests in flight finish for at
    /// most this many seconds (vLLM's flag of the same name); what is still open then is cut.
    #[arg(long, default_value_t = 120)]
    pub shutdown_timeout: u64,
    /// Publish KV-cache events as vLLM does: JSON with vLLM's keys, e.g.
    /// `{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}`.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// Longest prompt text, in bytes, the engine tokenizes; a longer one is refused with 400
    /// before any work is spent on it (default: --max-model-len x 32 bytes, far more than any
    /// text that fits the context: English runs at about 4 bytes a token).
    #[arg(long)]
    pub max_prompt_bytes: Option<usize>,
    /// Threads that parse, render and tokenize requests and compile their grammars, apart
    /// from the threads that serve connections (default: twice the CPUs); bodies over 16 KiB
    /// get a quarter as many (at least 1).
    #[arg(long)]
    pub prepare_threads: Option<usize>,
}

impl EngineArgs {
    /// Defaults, as if no flag was given (handy in tests).
    pub fn defaults() -> Self {
        EngineArgs::parse_from(["switchyard-engine"])
    }
}

/// Resolved, validated configuration.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// Backend.
    pub backend: BackendKind,
    /// Served model name.
    pub served_model_name: String,
    /// Sim profile (with TP applied).
    pub sim_profile: SimProfile,
    /// Tokens per block.
    pub block_size: usize,
    /// KV blocks.
    pub num_blocks: usize,
    /// Scheduler limits.
    pub scheduler: SchedulerConfig,
    /// Prefix caching on?
    pub enable_prefix_caching: bool,
    /// Default request seed.
    pub seed: u64,
    /// cpu: the model file (`--model`, default: the fetched SmolLM2-135M-Instruct).
    pub model_path: std::path::PathBuf,
    /// sim: a real model's tokenizer to use instead of the simulator's (`--tokenizer`).
    pub tokenizer_path: Option<std::path::PathBuf>,
    /// cpu: KV cache bytes.
    pub kv_cache_bytes: usize,
    /// cpu: compute threads.
    pub threads: usize,
    /// Tensor-parallel ranks (the sim profile's `tp` for the sim backend).
    pub tensor_parallel_size: usize,
    /// How long requests in flight may run on after SIGTERM.
    pub shutdown_timeout: std::time::Duration,
    /// KV events to publish (`None`: off).
    pub kv_events: Option<crate::kv_events::KvEventsConfig>,
    /// `--max-prompt-bytes` as given (see [`Self::prompt_byte_limit`]).
    pub max_prompt_bytes: Option<usize>,
    /// Threads that prepare requests ([`crate::server::prepare`]).
    pub prepare_threads: usize,
}

/// Bytes a token of prompt is allowed on average before `--max-prompt-bytes`' default
/// refuses it: eight times English's ~4, so only text that could never fit is refused.
pub const PROMPT_BYTES_PER_TOKEN: usize = 32;

fn invalid(field: &'static str, value: impl ToString, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, value: value.to_string(), reason: reason.into() }
}

impl EngineConfig {
    /// Resolve and validate flags.
    pub fn from_args(a: &EngineArgs) -> Result<Self, ConfigError> {
        let ip: std::net::IpAddr = a.host.parse().map_err(|_| invalid("--host", &a.host, "must be an IP address"))?;
        let mut profile = sim::profile(&a.sim_profile).ok_or_else(|| {
            invalid(
                "--sim-profile",
                &a.sim_profile,
                format!("unknown profile; one of {}", sim::PROFILE_NAMES.join(", ")),
            )
        })?;
        if let Some(tp) = a.tensor_parallel_size {
            if !(1..=64).contains(&tp) {
                return Err(invalid("--tensor-parallel-size", tp, "must be between 1 and 64"));
            }
            profile.tp = tp;
        } else if a.backend == BackendKind::Cpu {
            profile.tp = 1;
        }
        if !a.block_size.is_power_of_two() || a.block_size > 256 {
            return Err(invalid("--block-size", a.block_size, "must be a power of two between 1 and 256"));
        }
        if a.max_num_seqs == 0 {
            return Err(invalid("--max-num-seqs", 0, "must be at least 1"));
        }
        if a.max_num_batched_tokens < a.max_num_seqs {
            return Err(invalid(
                "--max-num-batched-tokens",
                a.max_num_batched_tokens,
                format!("must be >= --max-num-seqs ({})", a.max_num_seqs),
            ));
        }
        // cpu: 0 means "the model's context length", resolved when the file is loaded.
        let max_model_len = match a.backend {
            BackendKind::Sim => a.max_model_len.unwrap_or(profile.model.max_context),
            BackendKind::Cpu => a.max_model_len.unwrap_or(0),
        };
        if max_model_len < 2 && !(a.backend == BackendKind::Cpu && a.max_model_len.is_none()) {
            return Err(invalid("--max-model-len", max_model_len, "must be at least 2"));
        }
        if !(a.gpu_memory_utilization > 0.0 && a.gpu_memory_utilization <= 1.0) {
            return Err(invalid("--gpu-memory-utilization", a.gpu_memory_utilization, "must be in (0, 1]"));
        }
        if !(a.kv_cache_space > 0.0 && a.kv_cache_space <= 1024.0) {
            return Err(invalid("--kv-cache-space", a.kv_cache_space, "must be in (0, 1024] GiB"));
        }
        let threads = match a.threads {
            Some(0) => return Err(invalid("--threads", 0, "must be at least 1")),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let prepare_threads = match a.prepare_threads {
            Some(0) => return Err(invalid("--prepare-threads", 0, "must be at least 1")),
            Some(n) => n,
            None => 2 * std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        if a.max_prompt_bytes == Some(0) {
            return Err(invalid("--max-prompt-bytes", 0, "must be at least 1"));
        }
        let num_blocks = match a.num_gpu_blocks_override {
            Some(0) => return Err(invalid("--num-gpu-blocks-override", 0, "must be at least 1")),
            Some(n) => n,
            // cpu: sized from --kv-cache-space once the model's shape is known.
            None if a.backend == BackendKind::Cpu => 0,
            None => sim::kv_cache_blocks(&profile, a.block_size, a.gpu_memory_utilization).ok_or_else(|| {
                invalid(
                    "--tensor-parallel-size",
                    profile.tp,
                    format!("{} does not fit on {} x {}", profile.model.name, profile.tp, profile.gpu.name),
                )
            })?,
        };
        let default_name = match a.backend {
            BackendKind::Sim => profile.model.name.to_string(),
            BackendKind::Cpu => crate::model::DEFAULT_MODEL_NAME.to_string(),
        };
        let served_model_name = a.served_model_name.clone().or_else(|| a.model.clone()).unwrap_or(default_name);
        let model_path = match (a.backend, &a.model) {
            (BackendKind::Cpu, Some(m)) => std::path::PathBuf::from(m),
            _ => crate::model::default_model_path(),
        };
        let tensor_parallel_size = profile.tp;
        if let (BackendKind::Cpu, Some(t)) = (a.backend, &a.tokenizer) {
            return Err(invalid("--tokenizer", t.display(), "is for the sim backend (cpu uses its model's own)"));
        }
        Ok(EngineConfig {
            listen: SocketAddr::new(ip, a.port),
            backend: a.backend,
            served_model_name,
            sim_profile: profile,
            block_size: a.block_size,
            num_blocks,
            scheduler: SchedulerConfig {
                max_num_batched_tokens: a.max_num_batched_tokens,
                max_num_seqs: a.max_num_seqs,
                max_model_len,
            },
            enable_prefix_caching: !a.no_enable_prefix_caching,
            seed: a.seed,
            model_path,
            tokenizer_path: a.tokenizer.clone(),
            kv_cache_bytes: (a.kv_cache_space * (1u64 << 30) as f64) as usize,
            threads,
            tensor_parallel_size,
            shutdown_timeout: std::time::Duration::from_secs(a.shutdown_timeout),
            kv_events: match &a.kv_events_config {
                Some(json) => crate::kv_events::KvEventsConfig::parse(json)?,
                None => None,
            },
            max_prompt_bytes: a.max_prompt_bytes,
            prepare_threads,
        })
    }

    /// The longest prompt text tokenized: `--max-prompt-bytes`, or the context length at
    /// [`PROMPT_BYTES_PER_TOKEN`] (known once the model is loaded, for the cpu backend).
    pub fn prompt_byte_limit(&self) -> usize {
        self.max_prompt_bytes.unwrap_or(self.scheduler.max_model_len.saturating_mul(PROMPT_BYTES_PER_TOKEN))
    }

    /// Tokens the KV cache holds in all.
    pub fn kv_capacity_tokens(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str]) -> Result<EngineConfig, String> {
        let mut argv = vec!["switchyard-engine"];
        argv.extend_from_slice(flags);
        let args = EngineArgs::try_parse_from(argv).map_err(|e| e.to_string())?;
        EngineConfig::from_args(&args).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_follow_vllm() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.listen.port(), 8000);
        assert_eq!(c.block_size, 16);
        assert_eq!(c.scheduler.max_num_seqs, 256);
        assert_eq!(c.scheduler.max_model_len, 8192);
        assert_eq!(c.served_model_name, "meta-llama/Meta-Llama-3-8B-Instruct");
        assert!(c.enable_prefix_caching);
        assert_eq!(c.prompt_byte_limit(), 8192 * PROMPT_BYTES_PER_TOKEN);
        assert_eq!(parse(&["--max-prompt-bytes", "100"]).unwrap().prompt_byte_limit(), 100);
        assert!(c.num_blocks > 20_000, "an H100 holds ~400k Llama-3-8B tokens: {}", c.num_blocks);
    }

    #[test]
    fn tensor_parallel_size_means_ranks_for_both_backends() {
        assert_eq!(parse(&[]).unwrap().tensor_parallel_size, 1);
        assert_eq!(parse(&["--sim-profile", "h100x4-llama3-70b"]).unwrap().tensor_parallel_size, 4);
        assert_eq!(parse(&["--backend", "cpu"]).unwrap().tensor_parallel_size, 1);
        assert_eq!(parse(&["--backend", "cpu", "--tensor-parallel-size", "3"]).unwrap().tensor_parallel_size, 3);
    }

    #[test]
    fn errors_name_the_flag_and_value() {
        let cases: &[(&[&str], &str)] = &[
            (&["--sim-profile", "tpu-v9"], "--sim-profile: unknown profile"),
            (&["--block-size", "12"], "--block-size"),
            (&["--max-num-seqs", "0"], "--max-num-seqs"),
            (&["--max-num-batched-tokens", "8", "--max-num-seqs", "16"], "--max-num-batched-tokens"),
            (&["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override"),
            (&["--sim-profile", "h100x4-llama3-70b", "--tensor-parallel-size", "1"], "does not fit"),
            (&["--host", "localhost:80"], "--host"),
            (&["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
            (&["--max-prompt-bytes", "0"], "--max-prompt-bytes"),
            (&["--prepare-threads", "0"], "--prepare-threads"),
        ];
        for (flags, want) in cases {
            let err = parse(flags).unwrap_err();
            assert!(err.contains(want), "{flags:?}: {err}");
        }
    }
}
