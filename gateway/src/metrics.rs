//! The gateway's own Prometheus metrics, all prefixed `switchyard_`.
//!
//! The registry is created in `main` and passed in. Per-backend gauges (in-flight, waiting,
//! KV usage, up) are filled from the cluster snapshot when `/metrics` is scraped, so the
//! request path only touches counters and histograms.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::cluster::{Backend, BackendSeries, BackendState, ClusterView};

/// Latency buckets (seconds) for TTFT and request duration.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0,
];

/// Handles to every gateway series.
#[derive(Clone)]
pub struct GatewayMetrics {
    registry: Registry,
    /// Requests by backend (`none` when not routed) and status code.
    pub requests: IntCounterVec,
    /// Whole request duration.
    pub duration: Histogram,
    /// Arrival to first upstream body chunk, by backend.
    pub ttft: HistogramVec,
    /// Routing decisions by policy and reason.
    pub decisions: IntCounterVec,
    /// Retries.
    pub retries: IntCounter,
    /// Upstream failures by kind.
    pub upstream_errors: IntCounterVec,
    /// Config reloads by result.
    pub config_reloads: IntCounterVec,
    /// Share of the prompt the chosen backend had cached (prefix-aware policies).
    pub prefix_match_ratio: Histogram,
    /// Memory charged by the prefix index.
    pub prefix_index_bytes: IntGauge,
    /// Requests waiting in the admission queue (KEDA scales engines from zero on it).
    pub queue_depth: IntGauge,
    /// Time requests spent in the admission queue.
    pub queue_wait: Histogram,
    /// Requests the gateway refused itself (auth, rate limits, header limits), by reason
    /// and tenant.
    pub rejected: IntCounterVec,
    /// TLS certificate rotations by result.
    pub certificate_reloads: IntCounterVec,
    /// Connections closed for not sending a request header within the deadline.
    pub header_timeouts: IntCounter,
    /// Client connections open on the API listener.
    pub client_connections: IntGauge,
    /// Client connections open on each core (`work_stealing: false`).
    pub core_connections: IntGaugeVec,
    /// Connections closed at accept because `limits.max_connections` were open.
    pub connections_refused: IntCounter,
    /// Connections closed after `limits.idle_connection_timeout_ms` with no request.
    pub idle_connections_closed: IntCounter,
    /// ext_proc streams ended for a message the Endpoint Picker protocol does not allow.
    pub epp_protocol_errors: IntCounter,
    /// ext_proc streams open now.
    pub epp_streams: IntGauge,
    /// Requests for a model alias, by alias and the target chosen.
    pub alias_requests: IntCounterVec,
    /// Request body bytes buffered now, process-wide (`limits.max_buffered_body_bytes`).
    pub buffered_body_bytes: IntGauge,
    /// KV-event batches applied, by backend.
    pub kv_event_batches: IntCounterVec,
    /// KV-event sequence gaps, by backend and outcome (`replayed`, `forgotten`).
    pub kv_event_gaps: IntCounterVec,
    /// Prompts handed to the tokenizing pool, by outcome (`precise`, `too_large`, `busy`,
    /// `timeout`).
    pub prompt_tokenizations: IntCounterVec,
    /// Bytes the precise KV index charges.
    pub kv_index_bytes: IntGauge,
    /// Limit decisions taken without Redis (`auth.shared_limits`), by decision.
    pub shared_limits_unavailable: IntCounterVec,
    inflight: IntGaugeVec,
    waiting: GaugeVec,
    kv_usage: GaugeVec,
    up: IntGaugeVec,
}

impl GatewayMetrics {
    /// `backend`'s per-request series (resolved on its first request).
    pub fn of<'a>(&self, backend: &'a Backend) -> &'a BackendSeries {
        backend.series.get_or_init(|| BackendSeries {
            ttft: self.ttft.with_label_values(&[backend.url.as_str()]),
            ok: self.requests.with_label_values(&[backend.url.as_str(), "200"]),
        })
    }

    /// Count a request routed through an alias (`alias`, `target`).
    pub fn count_alias(&self, alias: Option<&str>, target: &str) {
        if let Some(alias) = alias {
            self.alias_requests.with_label_values(&[alias, target]).inc();
        }
    }

    /// Create and register every series in `registry`.
    pub fn new(registry: Registry) -> prometheus::Result<Self> {
        let r = &registry;
        let ratio_buckets = vec![0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0];
        let wait_buckets = vec![0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
        let m = GatewayMetrics {
            requests: counter_vec(r, "switchyard_requests_total", "Requests by backend and status.", &["backend", "code"])?,
            duration: histogram(r, "switchyard_request_duration_seconds", "Request duration at the gateway.", LATENCY_BUCKETS.to_vec())?,
            ttft: register(r, HistogramVec::new(
                HistogramOpts::new("switchyard_ttft_seconds", "Arrival to first response chunk from the engine.")
                    .buckets(LATENCY_BUCKETS.to_vec()),
                &["backend"],
            )?)?,
            decisions: counter_vec(r, "switchyard_routing_decisions_total", "Routing decisions by policy and reason.", &["policy", "reason"])?,
            retries: register(r, IntCounter::new("switchyard_retries_total", "Attempts retried on another backend.")?)?,
            upstream_errors: counter_vec(r, "switchyard_upstream_errors_total", "Upstream failures by kind.", &["kind"])?,
            config_reloads: counter_vec(r, "switchyard_config_reloads_total", "Config reloads by result.", &["result"])?,
            prefix_match_ratio: histogram(r, "switchyard_prefix_match_ratio",
                "Share of the prompt's blocks the chosen backend probably had cached.", ratio_buckets)?,
            prefix_index_bytes: gauge(r, "switchyard_prefix_index_bytes", "Memory charged by the gateway's prefix index.")?,
            queue_depth: gauge(r, "switchyard_queue_depth", "Requests held in the admission queue while no engine can take them.")?,
            queue_wait: histogram(r, "switchyard_queue_wait_seconds", "Time spent in the admission queue.", wait_buckets)?,
            rejected: counter_vec(r, "switchyard_rejected_total", "Requests refused by the gateway, by reason and tenant.",
                &["reason", "tenant"])?,
            certificate_reloads: counter_vec(r, "switchyard_certificate_reloads_total", "TLS certificate rotations by result.",
                &["result"])?,
            header_timeouts: register(r, IntCounter::new("switchyard_header_timeouts_total",
                "Connections closed because a request header did not arrive within limits.header_read_timeout_ms.")?)?,
            client_connections: gauge(r, "switchyard_client_connections",
                "Client connections open on the API listener (limits.max_connections caps it).")?,
            core_connections: register(r, IntGaugeVec::new(Opts::new("switchyard_core_client_connections",
                "Client connections served by each core (work_stealing: false; a new one goes to the core with fewest)."),
                &["core"])?)?,
            connections_refused: register(r, IntCounter::new("switchyard_connections_refused_total",
                "Client connections closed at accept because limits.max_connections were open.")?)?,
            idle_connections_closed: register(r, IntCounter::new("switchyard_idle_connections_closed_total",
                "HTTP/1 keep-alive connections closed after limits.idle_connection_timeout_ms without a request.")?)?,
            epp_protocol_errors: register(r, IntCounter::new("switchyard_epp_protocol_errors_total",
                "ext_proc streams the Endpoint Picker ended for a message out of protocol order")?)?,
            epp_streams: gauge(r, "switchyard_epp_streams", "ext_proc streams the Endpoint Picker has open.")?,
            alias_requests: counter_vec(r, "switchyard_alias_requests_total", "Requests for a model alias, by the target chosen.",
                &["alias", "target"])?,
            kv_event_batches: counter_vec(r, "switchyard_kv_events_batches_total", "Engine KV-event batches applied to the index.",
                &["backend"])?,
            kv_event_gaps: counter_vec(r, "switchyard_kv_events_gaps_total",
                "Sequence gaps in an engine's KV events: closed by a replay, or the engine's entries forgotten.",
                &["backend", "outcome"])?,
            prompt_tokenizations: counter_vec(r, "switchyard_prompt_tokenizations_total",
                "Prompts for the precise index: tokenized (precise), or routed by the approximate index because the body was over kv_events.tokenize_max_bytes (too_large), the tokenizing queue was full (busy) or kv_events.tokenize_timeout_ms passed (timeout).",
                &["outcome"])?,
            kv_index_bytes: gauge(r, "switchyard_kv_index_bytes",
                "Memory charged by the precise KV index (kv_events.max_bytes bounds it).")?,
            shared_limits_unavailable: counter_vec(r, "switchyard_shared_limits_unavailable_total",
                "Tenant limit decisions taken without Redis (auth.shared_limits): local (limit / replicas), open, closed; settle_lost: a token settlement that did not reach Redis.",
                &["decision"])?,
            buffered_body_bytes: gauge(r, "switchyard_buffered_body_bytes",
                "Request body bytes held by the gateway now (limits.max_buffered_body_bytes caps it).")?,
            inflight: register(r, IntGaugeVec::new(Opts::new("switchyard_backend_inflight", "Requests in flight per backend."),
                &["backend"])?)?,
            waiting: register(r, GaugeVec::new(Opts::new("switchyard_backend_waiting", "Scraped waiting requests per backend."),
                &["backend"])?)?,
            kv_usage: register(r, GaugeVec::new(Opts::new("switchyard_backend_kv_usage", "Scraped KV cache usage per backend."),
                &["backend"])?)?,
            up: register(r, IntGaugeVec::new(Opts::new("switchyard_backend_up", "1 when the backend is routable."), &["backend"])?)?,
            registry,
        };
        for r in ["ok", "error"] {
            m.config_reloads.with_label_values(&[r]);
        }
        Ok(m)
    }

    /// Prometheus text of every series, with per-backend gauges taken from `view` now.
    pub fn render(&self, view: &ClusterView, now: std::time::Instant, down_after: u32) -> Vec<u8> {
        self.inflight.reset();
        self.waiting.reset();
        self.kv_usage.reset();
        self.up.reset();
        for b in &view.backends {
            let l = [b.url.as_str()];
            self.inflight.with_label_values(&l).set(b.inflight.load(std::sync::atomic::Ordering::Relaxed) as i64);
            self.up.with_label_values(&l).set(i64::from(b.state(now, down_after) == BackendState::Up));
            if let Some((s, _)) = &b.scraped.load().signal {
                self.waiting.with_label_values(&l).set(s.waiting);
                self.kv_usage.with_label_values(&l).set(s.kv_usage.unwrap_or(0.0));
            }
        }
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf).expect("text encoding cannot fail");
        buf
    }
}

/// `collector`, registered in `registry`.
fn register<C: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    collector: C,
) -> prometheus::Result<C> {
    registry.register(Box::new(collector.clone()))?;
    Ok(collector)
}

/// A registered counter with `labels`.
fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntCounterVec> {
    register(registry, IntCounterVec::new(Opts::new(name, help), labels)?)
}

/// A registered gauge.
fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    register(registry, IntGauge::new(name, help)?)
}

/// A registered histogram with `buckets`.
fn histogram(registry: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> prometheus::Result<Histogram> {
    register(registry, Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))?)
}
