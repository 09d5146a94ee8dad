//! Normalizes any LLM engine's Prometheus `/metrics` text into one load signal.
//!
//! The gateway scrapes every engine pod about every 100 ms and routes on how
//! loaded each one is. Engines disagree on names (vLLM, SGLang, TGI and
//! llama.cpp each have their own), so this crate is the single place that
//! knows them. Its parsers are pure: no I/O, no clock (the caller passes the
//! scrape time), no globals, no logging; the same bytes always give the same
//! result.
//!
//! # Algorithm
//!
//! [`parse_load_signal`] makes one pass over the body:
//!
//! 1. **Parse.** Each line goes through the Prometheus text-format 0.0.4
//!    parser in [`text`]; comments and blank lines are skipped, and the first
//!    malformed line fails the whole scrape with [`ShimError::Syntax`] (a
//!    truncated or garbled body must not be mistaken for an idle engine).
//!    Samples are borrowed from the body, so the pass allocates almost nothing.
//! 2. **Classify and fold.** Each sample whose name is a known engine metric
//!    is folded into its family's slot, across label sets (`model_name`,
//!    vLLM data-parallel `engine="0"`, `engine="1"`, ...):
//!    * queue lengths and counters are **summed**, over finite, non-negative
//!      samples;
//!    * KV-cache usage is the **maximum**, each sample clamped into 0..=1
//!      (the fullest replica is the one that preempts first);
//!    * a hit-rate gauge is the **mean**, each sample clamped into 0..=1;
//!    * a NaN sample is treated as absent.
//!
//!    `process_start_time_seconds` (latest one) and `max_model_len` (largest
//!    one) are picked up whatever the family.
//! 3. **Detect.** The family with the most distinct known names present wins
//!    (ties: vLLM, SGLang, TGI, llama.cpp). If no known name is present, the
//!    family with the most samples under its prefix (`vllm:`, `sglang:`,
//!    `tgi_`, `llamacpp:`) wins, so an engine that has not yet served a
//!    request still reads as idle rather than unknown. Otherwise the result is
//!    [`ShimError::NoKnownMetrics`].
//! 4. **Finish.** Missing queue gauges read as 0; missing optional fields are
//!    `None`. Where a family has two spellings of a metric, the preferred one
//!    is used whenever it has a usable sample, the other only as a fallback
//!    (they are never added together).
//!
//! # Names
//!
//! | field | vLLM (V1; V0/old fallback) | SGLang | TGI | llama.cpp |
//! |---|---|---|---|---|
//! | `waiting` | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` | `tgi_queue_size` | `llamacpp:requests_deferred` |
//! | `running` | `vllm:num_requests_running` | `sglang:num_running_reqs` | `tgi_batch_current_size` | `llamacpp:requests_processing` |
//! | `kv_usage` | `vllm:kv_cache_usage_perc`; `vllm:gpu_cache_usage_perc` | `sglang:token_usage` | — | `llamacpp:kv_cache_usage_ratio` |
//! | `prefix_hit_rate` | `vllm:gpu_prefix_cache_hit_rate`; else hits / queries | `sglang:cache_hit_rate` | — | — |
//! | `prefix_cache_queries_total` | `vllm:prefix_cache_queries_total`; `vllm:prefix_cache_queries` | — | — | — |
//! | `prefix_cache_hits_total` | `vllm:prefix_cache_hits_total`; `vllm:prefix_cache_hits` | — | — | — |
//! | `generation_tokens_total` | `vllm:generation_tokens_total`; `vllm:generation_tokens` | `sglang:generation_tokens_total` | `tgi_request_generated_tokens_sum` | `llamacpp:tokens_predicted_total`; `llamacpp:n_decode_total` |
//!
//! `max_model_len` comes from a `vllm:max_model_len` sample or from a
//! `max_model_len` label on `vllm:cache_config_info` or
//! `vllm:model_config_info`.
//!
//! # Features
//!
//! - `process`: the `process` module, what every Switchyard binary shares
//!   (Unix time, waiting for SIGTERM, the drain loop); adds tokio.
//! - `sidecar` (default, implies `process`): the `sidecar` module, the engine
//!   pod's sidecar that the `switchyard-shim` binary runs (an axum server, a
//!   hyper client, a Prometheus registry).
//!
//! Without `sidecar`, as the gateway (`process`) and the load generator
//! (neither) link it, the crate has no HTTP dependency: the parsers,
//! [`expose`] and [`openai_error`] need only `serde_json` and `thiserror`.

pub mod error;
pub mod expose;
pub mod lora;
mod normalize;
pub mod openai_error;
#[cfg(feature = "process")]
pub mod process;
#[cfg(feature = "sidecar")]
pub mod sidecar;
pub mod text;

#[cfg(test)]
mod tests;

use std::fmt;

pub use error::ShimError;
pub use lora::{parse_lora_info, LoraInfo};

/// Which engine family produced the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// vLLM (V1 and V0), and Switchyard's own engine, which uses vLLM's names.
    Vllm,
    /// SGLang.
    Sglang,
    /// Hugging Face Text Generation Inference.
    Tgi,
    /// llama.cpp's `llama-server --metrics`.
    LlamaCpp,
}

impl Dialect {
    /// Stable lower-case name, for labels and logs: `vllm`, `sglang`, `tgi`, `llamacpp`.
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Vllm => "vllm",
            Dialect::Sglang => "sglang",
            Dialect::Tgi => "tgi",
            Dialect::LlamaCpp => "llamacpp",
        }
    }
}

impl fmt::Display for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One engine's load, normalized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSignal {
    /// The family detected from the metric names.
    pub dialect: Dialect,
    /// Requests queued, not yet running (sum over label sets; 0 when not reported).
    pub waiting: f64,
    /// Requests in the running batch (sum over label sets; 0 when not reported).
    pub running: f64,
    /// KV-cache usage in 0..=1 (max over label sets); `None` when the engine does not report it.
    pub kv_usage: Option<f64>,
    /// Prefix-cache hit rate in 0..=1: the engine's own rate gauge, else
    /// cumulative hits / queries; `None` if unknown or queries are 0.
    pub prefix_hit_rate: Option<f64>,
    /// Cumulative prefix-cache queries (tokens looked up), when reported.
    pub prefix_cache_queries_total: Option<f64>,
    /// Cumulative prefix-cache hits (tokens found), when reported.
    pub prefix_cache_hits_total: Option<f64>,
    /// Cumulative generated tokens; a drop between scrapes means a restart.
    pub generation_tokens_total: Option<f64>,
    /// The standard `process_start_time_seconds`, if present.
    pub process_start_time_seconds: Option<f64>,
    /// The longest context the engine accepts, when it exposes it.
    pub max_model_len: Option<u64>,
    /// When the body was scraped, as passed in by the caller.
    pub scraped_at_unix_ms: u64,
}

/// Parse a whole `/metrics` body and normalize it. The dialect is detected
/// from the metric names; see the [crate documentation](crate) for the rules.
///
/// # Errors
///
/// [`ShimError::Syntax`] for the first line that is not valid Prometheus text
/// format, [`ShimError::NoKnownMetrics`] when no engine family is recognized.
///
/// # Example
///
/// ```
/// use switchyard_shim::{parse_load_signal, Dialect};
///
/// let body = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
/// ## TYPE vllm:num_requests_running gauge
/// vllm:num_requests_running{engine="0",model_name="llama"} 7.0
/// vllm:num_requests_running{engine="1",model_name="llama"} 5.0
/// ## HELP vllm:num_requests_waiting Number of requests waiting to be processed.
/// ## TYPE vllm:num_requests_waiting gauge
/// vllm:num_requests_waiting{engine="0",model_name="llama"} 2.0
/// vllm:num_requests_waiting{engine="1",model_name="llama"} 0.0
/// ## HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
/// ## TYPE vllm:kv_cache_usage_perc gauge
/// vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
/// vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.25
/// ## TYPE vllm:prefix_cache_queries_total counter
/// vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 800.0
/// ## TYPE vllm:prefix_cache_hits_total counter
/// vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 200.0
/// "#;
///
/// let load = parse_load_signal(body, 1_700_000_000_000)?;
/// assert_eq!(load.dialect, Dialect::Vllm);
/// assert_eq!((load.waiting, load.running), (2.0, 12.0));
/// assert_eq!(load.kv_usage, Some(0.5));
/// assert_eq!(load.prefix_hit_rate, Some(0.25));
/// assert_eq!(load.generation_tokens_total, None);
/// assert_eq!(load.scraped_at_unix_ms, 1_700_000_000_000);
/// # Ok::<(), switchyard_shim::ShimError>(())
/// ```
pub fn parse_load_signal(text: &str, scraped_at_unix_ms: u64) -> Result<LoadSignal, ShimError> {
    normalize::load_signal(text, scraped_at_unix_ms)
}
