//! vLLM-named Prometheus metrics of the engine.
//!
//! Names, labels and histogram buckets follow vLLM V1, so dashboards, KEDA triggers and
//! the gateway's scraper work the same against vLLM and against us. The registry is
//! passed in (no global registry); every series carries the `model_name` label.

use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::scheduler::{FinishReason, SchedulerStats};

/// vLLM V1 buckets of `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
/// vLLM V1 buckets of `vllm:inter_token_latency_seconds`.
pub const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
/// vLLM V1 buckets of `vllm:e2e_request_latency_seconds`.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];

/// Handles to every engine series.
#[derive(Clone)]
pub struct EngineMetrics {
    running: IntGauge,
    waiting: IntGauge,
    gpu_cache_usage: Gauge,
    kv_cache_usage: Gauge,
    kv_cache_waste: Gauge,
    prefix_queries: IntCounter,
    prefix_hits: IntCounter,
    preemptions: IntCounter,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    success: IntCounterVec,
    /// Time to first token.
    pub ttft: Histogram,
    /// Gap between consecutive tokens.
    pub itl: Histogram,
    /// Arrival to last token.
    pub e2e: Histogram,
    /// KV event batches dropped because the publisher's queue was full.
    pub kv_events_dropped: IntCounter,
    last: SchedulerStats,
}

fn opts(name: &str, help: &str, model: &str) -> Opts {
    Opts::new(name, help).const_label("model_name", model)
}

fn hist(name: &str, help: &str, model: &str, buckets: &[f64]) -> HistogramOpts {
    HistogramOpts::new(name, help).const_label("model_name", model).buckets(buckets.to_vec())
}

impl EngineMetrics {
    /// Create and register every series.
    pub fn new(registry: &Registry, model: &str, block_size: usize, num_blocks: usize) -> prometheus::Result<Self> {
        let m = EngineMetrics {
            running: IntGauge::with_opts(opts("vllm:num_requests_running", "Requests in the running batch.", model))?,
            waiting: IntGauge::with_opts(opts(
                "vllm:num_requests_waiting",
                "Requests waiting to be scheduled.",
                model,
            ))?,
            gpu_cache_usage: Gauge::with_opts(opts(
                "vllm:gpu_cache_usage_perc",
                "KV cache usage, 0..1 (V0 name).",
                model,
            ))?,
            kv_cache_usage: Gauge::with_opts(opts("vllm:kv_cache_usage_perc", "KV cache usage, 0..1.", model))?,
            kv_cache_waste: Gauge::with_opts(opts(
                "switchyard:kv_cache_waste_perc",
                "Allocated KV token slots of running requests holding no token, over slots in use, 0..1.",
                model,
            ))?,
            prefix_queries: IntCounter::with_opts(opts(
                "vllm:prefix_cache_queries_total",
                "Tokens looked up in the prefix cache.",
                model,
            ))?,
            prefix_hits: IntCounter::with_opts(opts(
                "vllm:prefix_cache_hits_total",
                "Tokens found in the prefix cache.",
                model,
            ))?,
            preemptions: IntCounter::with_opts(opts("vllm:num_preemptions_total", "Preemptions.", model))?,
            prompt_tokens: IntCounter::with_opts(opts("vllm:prompt_tokens_total", "Prefilled prompt tokens.", model))?,
            generation_tokens: IntCounter::with_opts(opts("vllm:generation_tokens_total", "Generated tokens.", model))?,
            success: IntCounterVec::new(
                opts("vllm:request_success_total", "Finished requests.", model),
                &["finished_reason"],
            )?,
            ttft: Histogram::with_opts(hist(
                "vllm:time_to_first_token_seconds",
                "Time to first token.",
                model,
                TTFT_BUCKETS,
            ))?,
            itl: Histogram::with_opts(hist(
                "vllm:inter_token_latency_seconds",
                "Inter-token latency.",
                model,
                ITL_BUCKETS,
            ))?,
            e2e: Histogram::with_opts(hist(
                "vllm:e2e_request_latency_seconds",
                "End-to-end request latency.",
                model,
                E2E_BUCKETS,
            ))?,
            kv_events_dropped: IntCounter::with_opts(opts(
                "switchyard:kv_events_dropped_total",
                "KV event batches dropped because the publisher's queue was full (--kv-events-config).",
                model,
            ))?,
            last: SchedulerStats::default(),
        };
        let info = IntGauge::with_opts(
            opts("vllm:cache_config_info", "KV cache configuration.", model)
                .const_label("block_size", block_size.to_string())
                .const_label("num_gpu_blocks", num_blocks.to_string()),
        )?;
        info.set(1);
        registry.register(Box::new(info))?;
        registry.register(Box::new(m.running.clone()))?;
        registry.register(Box::new(m.waiting.clone()))?;
        registry.register(Box::new(m.gpu_cache_usage.clone()))?;
        registry.register(Box::new(m.kv_cache_usage.clone()))?;
        registry.register(Box::new(m.kv_cache_waste.clone()))?;
        registry.register(Box::new(m.prefix_queries.clone()))?;
        registry.register(Box::new(m.prefix_hits.clone()))?;
        registry.register(Box::new(m.preemptions.clone()))?;
        registry.register(Box::new(m.prompt_tokens.clone()))?;
        registry.register(Box::new(m.generation_tokens.clone()))?;
        registry.register(Box::new(m.success.clone()))?;
        registry.register(Box::new(m.ttft.clone()))?;
        registry.register(Box::new(m.itl.clone()))?;
        registry.register(Box::new(m.e2e.clone()))?;
        registry.register(Box::new(m.kv_events_dropped.clone()))?;
        for reason in [FinishReason::Stop, FinishReason::Length, FinishReason::Abort] {
            m.success.with_label_values(&[reason.as_str()]);
        }
        Ok(m)
    }

    /// Publish the scheduler's gauges and the growth of its counters.
    pub fn observe_scheduler(
        &mut self,
        running: usize,
        waiting: usize,
        kv_usage: f64,
        kv_waste: f64,
        stats: SchedulerStats,
    ) {
        self.kv_cache_waste.set(kv_waste);
        self.running.set(running as i64);
        self.waiting.set(waiting as i64);
        self.gpu_cache_usage.set(kv_usage);
        self.kv_cache_usage.set(kv_usage);
        let last = std::mem::replace(&mut self.last, stats);
        self.prefix_queries.inc_by(stats.prefix_queries - last.prefix_queries);
        self.prefix_hits.inc_by(stats.prefix_hits - last.prefix_hits);
        self.preemptions.inc_by(stats.preemptions - last.preemptions);
        self.prompt_tokens.inc_by(stats.prompt_tokens - last.prompt_tokens);
        self.generation_tokens.inc_by(stats.generation_tokens - last.generation_tokens);
    }

    /// Count a finished request.
    pub fn finished(&self, reason: FinishReason) {
        self.success.with_label_values(&[reason.as_str()]).inc();
    }
}
