//! The cluster: every backend, its scraped signal, the gateway's own counters and health.
//!
//! Membership is an immutable [`ClusterView`] (a list of `Arc<Backend>`) published through
//! `ArcSwap`: discovery and config reloads build a new view and swap it in; a request loads
//! the current view once and never blocks. A backend that stays across a reload keeps its
//! `Arc`, so its counters and health survive.
//!
//! Per backend, what changes often lives in cheap shared cells: the scraper swaps in a new
//! [`Scraped`] (`ArcSwap`), the request path bumps atomic counters, and the passive health
//! state ([`Health`]) sits behind a small mutex touched once per request outcome.
//!
//! ## Health
//! - **Down**: `scrape.down_after_failures` consecutive failed scrapes (the scraper is the
//!   active probe; it keeps probing a down backend and brings it back on the first success).
//! - **Ejected**: `health.consecutive_failures` consecutive 5xx answers or connection
//!   errors eject a backend for `health.ejection_ms`, unless that would eject more than
//!   `health.max_ejection_percent` of the backends (one may always be ejected).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use pingora::upstreams::peer::{HttpPeer, Peer};
use switchyard_shim::LoadSignal;

use crate::config::HealthConfig;
use crate::ewma::Ewma;
use crate::policy::{Candidate, SignalView};

/// One backend's series that every request touches, looked up once instead of by label
/// values per request (a hash and a lock each time); made by
/// [`GatewayMetrics::of`](crate::metrics::GatewayMetrics::of).
#[derive(Debug)]
pub struct BackendSeries {
    /// `switchyard_ttft_seconds{backend}`.
    pub ttft: prometheus::Histogram,
    /// `switchyard_requests_total{backend, code="200"}`.
    pub ok: prometheus::IntCounter,
}

/// What the scraper last learned about a backend.
#[derive(Debug, Clone, Default)]
pub struct Scraped {
    /// Last good signal and when it was taken.
    pub signal: Option<(LoadSignal, Instant)>,
    /// Models from `/v1/models` (or the configured override).
    pub models: Vec<String>,
    /// `/v1/models`' objects as the engine reported them (`owned_by`, `created`,
    /// `max_model_len`, an adapter's `root` and `parent`, …); empty for configured models.
    pub cards: Arc<Vec<serde_json::Value>>,
    /// The LoRA adapters it has loaded (vLLM's `vllm:lora_requests_info`), when reported.
    pub lora: Option<Arc<switchyard_shim::LoraInfo>>,
    /// Consecutive failed scrapes.
    pub consecutive_failures: u32,
    /// Last scrape error.
    pub last_error: Option<String>,
}

impl Scraped {
    /// Whether the backend serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == model)
    }

    /// The signal, if taken within `stale_after` of `now`.
    pub fn fresh_signal(&self, now: Instant, stale_after: Duration) -> Option<SignalView> {
        let (s, at) = self.signal.as_ref()?;
        (now.saturating_duration_since(*at) <= stale_after).then(|| SignalView {
            waiting: s.waiting,
            running: s.running,
            kv_usage: s.kv_usage.unwrap_or(0.0),
        })
    }
}

/// Passive health state.
#[derive(Debug, Clone, Default)]
pub struct Health {
    /// Consecutive failed requests.
    pub consecutive_failures: u32,
    /// Ejected until this instant.
    pub ejected_until: Option<Instant>,
    /// Why it was last ejected.
    pub last_ejection_reason: Option<String>,
    /// Times ejected.
    pub ejections: u64,
}

/// What discovery says about one backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSpec {
    /// `http://host:port`.
    pub url: String,
    /// `host:port`.
    pub authority: String,
    /// Resolved address (`None` when the name did not resolve: the backend stays down).
    pub addr: Option<SocketAddr>,
    /// Configured model list.
    pub models: Option<Vec<String>>,
}

/// Requests with less prefill work than this teach nothing about the prefill rate.
pub const MIN_SAMPLE_TOKENS: u64 = 256;

/// How fast a learned prefill rate forgets: after this long without samples the old rate
/// weighs 1/e against a new sample ([`Ewma`]).
pub const PREFILL_RATE_DECAY: Duration = Duration::from_secs(2);

/// The stable key of a backend URL.
pub fn backend_key(url: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(url.as_bytes())
}

/// One engine endpoint.
#[derive(Debug)]
pub struct Backend {
    /// `http://host:port` as configured.
    pub url: String,
    /// `host:port`.
    pub authority: String,
    /// Resolved address.
    pub addr: Option<SocketAddr>,
    /// Where and how connections are opened (address, TLS, server name); `None` while the
    /// address does not resolve. Timeouts are set per connection.
    pub peer: Option<HttpPeer>,
    /// The peer's reuse hash, computed once: idle connections are pooled under it
    /// ([`crate::pool`]), so a name that now resolves elsewhere gets no old connections.
    pub pool_key: u64,
    /// Models from the config, overriding `/v1/models`.
    pub configured_models: Option<Vec<String>>,
    /// Scraper output.
    pub scraped: ArcSwap<Scraped>,
    /// Requests in flight from this gateway.
    pub inflight: AtomicU64,
    /// Requests routed here in all.
    pub routed: AtomicU64,
    /// Passive health.
    pub health: Mutex<Health>,
    /// Times the scraper saw this backend's counters go backwards (a restart).
    pub restarts: AtomicU32,
    /// Stable identity across reloads: a hash of the URL (prefix index and session hashing).
    pub key: u64,
    /// Estimated prompt tokens dispatched here that have not produced a first byte yet.
    pub pending_prefill_tokens: AtomicU64,
    /// Learned prefill rate in tokens/s as `f64` bits (0.0: not learned yet), published
    /// for lock-free reads on the request path.
    prefill_rate_bits: AtomicU64,
    /// The average behind it.
    prefill_rate: Mutex<Option<Ewma>>,
    /// This backend's per-request series, resolved once ([`crate::metrics::GatewayMetrics::of`]).
    pub series: OnceLock<BackendSeries>,
}

impl Backend {
    /// Whether the engine is reached over TLS (`https://`).
    pub fn tls(&self) -> bool {
        self.url.starts_with("https://")
    }

    /// The host name (or IP) of the authority: the TLS server name.
    pub fn host(&self) -> &str {
        let host = self.authority.rsplit_once(':').map_or(self.authority.as_str(), |(h, _)| h);
        host.trim_start_matches('[').trim_end_matches(']')
    }

    /// A new backend with nothing known yet.
    pub fn new(spec: &BackendSpec) -> Self {
        let configured_models = spec.models.clone();
        let models = configured_models.clone().unwrap_or_default();
        let mut backend = Backend {
            url: spec.url.trim_end_matches('/').to_string(),
            authority: spec.authority.clone(),
            addr: spec.addr,
            peer: None,
            pool_key: 0,
            configured_models,
            scraped: ArcSwap::from_pointee(Scraped { models, ..Default::default() }),
            inflight: AtomicU64::new(0),
            routed: AtomicU64::new(0),
            health: Mutex::new(Health::default()),
            restarts: AtomicU32::new(0),
            key: backend_key(spec.url.trim_end_matches('/')),
            pending_prefill_tokens: AtomicU64::new(0),
            prefill_rate_bits: AtomicU64::new(0),
            prefill_rate: Mutex::new(None),
            series: OnceLock::new(),
        };
        backend.peer = spec.addr.map(|addr| HttpPeer::new(addr, backend.tls(), backend.host().to_string()));
        backend.pool_key = backend.peer.as_ref().map_or(0, Peer::reuse_hash);
        backend
    }

    /// Learned prefill rate in tokens/s (0.0 until a sample was taken).
    pub fn prefill_tokens_per_s(&self) -> f64 {
        f64::from_bits(self.prefill_rate_bits.load(Ordering::Relaxed))
    }

    /// Learn from one request: `tokens` of prefill work (its queue ahead plus its uncached
    /// prompt, as estimated at dispatch) took `ttft_s` to the first byte, which arrived at
    /// `now`. A time-decayed average ([`PREFILL_RATE_DECAY`]); samples under
    /// [`MIN_SAMPLE_TOKENS`] are skipped (fixed overheads dominate them).
    pub fn observe_prefill(&self, tokens: u64, ttft_s: f64, now: Instant) {
        if tokens < MIN_SAMPLE_TOKENS || ttft_s.is_nan() || ttft_s <= 0.0 {
            return;
        }
        let sample = tokens as f64 / ttft_s;
        let mut rate = self.prefill_rate.lock();
        let rate = match rate.as_mut() {
            Some(ewma) => {
                ewma.observe(sample, now);
                *ewma
            }
            None => *rate.insert(Ewma::new(sample, PREFILL_RATE_DECAY, now)),
        };
        self.prefill_rate_bits.store(rate.value().to_bits(), Ordering::Relaxed);
    }

    /// Routing state now.
    pub fn state(&self, now: Instant, down_after_failures: u32) -> BackendState {
        self.state_with(&self.scraped.load(), now, down_after_failures)
    }

    /// [`Self::state`] with the scraped snapshot already loaded.
    fn state_with(&self, scraped: &Scraped, now: Instant, down_after_failures: u32) -> BackendState {
        if let Some(until) = self.health.lock().ejected_until {
            if until > now {
                return BackendState::Ejected;
            }
        }
        if self.addr.is_none() || scraped.consecutive_failures >= down_after_failures {
            return BackendState::Down;
        }
        BackendState::Up
    }

    /// Count a successful exchange (resets the failure streak).
    pub fn record_success(&self) {
        self.health.lock().consecutive_failures = 0;
    }
}

/// A backend's routing state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendState {
    /// Routable.
    Up,
    /// Scrapes failing.
    Down,
    /// Ejected after request failures.
    Ejected,
}

impl BackendState {
    /// Label.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendState::Up => "up",
            BackendState::Down => "down",
            BackendState::Ejected => "ejected",
        }
    }
}

/// An immutable membership snapshot.
#[derive(Debug, Default)]
pub struct ClusterView {
    /// Backends, in configuration order.
    pub backends: Vec<Arc<Backend>>,
}

impl ClusterView {
    /// Build a view for `wanted`, reusing backends of `previous` with the same URL, address
    /// and model override.
    pub fn rebuild(previous: &ClusterView, wanted: &[BackendSpec]) -> ClusterView {
        let backends = wanted
            .iter()
            .map(|spec| {
                let url = spec.url.trim_end_matches('/');
                previous
                    .backends
                    .iter()
                    .find(|b| b.url == url && b.addr == spec.addr && b.configured_models == spec.models)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(Backend::new(spec)))
            })
            .collect();
        ClusterView { backends }
    }

    /// Routable candidates for `model`, skipping `exclude`d positions. Also says whether any
    /// backend (routable or not) serves the model.
    pub fn candidates(
        &self,
        model: &str,
        exclude: &[usize],
        now: Instant,
        down_after_failures: u32,
        stale_after: Duration,
    ) -> (Vec<Candidate>, bool) {
        let mut known = false;
        let mut adapters_reported = false;
        let mut out = Vec::with_capacity(self.backends.len());
        for (index, b) in self.backends.iter().enumerate() {
            // One snapshot per backend for all that is read of it here.
            let scraped = b.scraped.load();
            if !scraped.serves(model) {
                continue;
            }
            known = true;
            if exclude.contains(&index) || b.state_with(&scraped, now, down_after_failures) != BackendState::Up {
                continue;
            }
            adapters_reported |= scraped.lora.is_some();
            out.push(Candidate {
                index,
                key: b.key,
                inflight: b.inflight.load(Ordering::Relaxed),
                signal: scraped.fresh_signal(now, stale_after),
                pending_prefill_tokens: b.pending_prefill_tokens.load(Ordering::Relaxed),
                prefill_tokens_per_s: b.prefill_tokens_per_s(),
                matched_tokens: 0,
            });
        }
        // Most engines report no adapters: nothing to prefer then.
        if adapters_reported {
            self.prefer_adapter_holders(&mut out, model);
        }
        (out, known)
    }

    /// LoRA affinity: for an adapter, only the candidates that have it loaded (running or
    /// waiting, by vLLM's `vllm:lora_requests_info`) when any has; else, when the model is
    /// an adapter (a `parent` in its `/v1/models` object), those with a free adapter slot
    /// when any has. The policy then decides among them by load. Engines that report no
    /// adapters change nothing.
    fn prefer_adapter_holders(&self, out: &mut Vec<Candidate>, model: &str) {
        let lora: Vec<Option<Arc<switchyard_shim::LoraInfo>>> =
            out.iter().map(|c| self.backends[c.index].scraped.load().lora.clone()).collect();
        let keep = |want: &dyn Fn(&switchyard_shim::LoraInfo) -> bool, out: &mut Vec<Candidate>| {
            let chosen: Vec<bool> = lora.iter().map(|l| l.as_deref().is_some_and(want)).collect();
            if chosen.iter().any(|&c| c) {
                let mut i = 0;
                out.retain(|_| {
                    i += 1;
                    chosen[i - 1]
                });
                return true;
            }
            false
        };
        if keep(&|l| l.holds(model), out) {
            return;
        }
        let adapter = self.backends.iter().any(|b| {
            b.scraped
                .load()
                .cards
                .iter()
                .any(|c| c["id"] == model && c["parent"].as_str().is_some_and(|p| !p.is_empty()))
        });
        if adapter {
            keep(&|l| l.has_free_slot(), out);
        }
    }

    /// Every model served by an up backend, sorted and deduplicated.
    pub fn models(&self) -> Vec<String> {
        let mut all: Vec<String> = self.backends.iter().flat_map(|b| b.scraped.load().models.clone()).collect();
        all.sort();
        all.dedup();
        all
    }

    /// The model objects of `GET /v1/models`: one per model any backend serves (the first
    /// backend's object where several report one), sorted by id; a configured model that no
    /// engine described gets a minimal object.
    pub fn model_cards(&self) -> Vec<serde_json::Value> {
        let mut cards: std::collections::BTreeMap<String, serde_json::Value> = std::collections::BTreeMap::new();
        for b in &self.backends {
            let scraped = b.scraped.load();
            for card in scraped.cards.iter() {
                if let Some(id) = card["id"].as_str().filter(|id| scraped.models.iter().any(|m| m == id)) {
                    cards.entry(id.to_string()).or_insert_with(|| card.clone());
                }
            }
            for id in &scraped.models {
                cards.entry(id.clone()).or_insert_with(
                    || serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "switchyard"}),
                );
            }
        }
        cards.into_values().collect()
    }

    /// Record a failed request to backend `index`; ejects it when the streak reaches the
    /// threshold and the ejection cap allows. Returns true when it was ejected now.
    pub fn record_failure(&self, index: usize, reason: &str, now: Instant, cfg: &HealthConfig) -> bool {
        let ejected_now =
            self.backends.iter().filter(|b| b.health.lock().ejected_until.is_some_and(|u| u > now)).count();
        let cap = ((self.backends.len() * cfg.max_ejection_percent as usize) / 100).max(1);
        let mut h = self.backends[index].health.lock();
        h.consecutive_failures += 1;
        let already = h.ejected_until.is_some_and(|u| u > now);
        if h.consecutive_failures >= cfg.consecutive_failures && !already && ejected_now < cap {
            h.ejected_until = Some(now + Duration::from_millis(cfg.ejection_ms));
            h.last_ejection_reason = Some(format!("{} consecutive failures, last: {reason}", h.consecutive_failures));
            h.ejections += 1;
            h.consecutive_failures = 0;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(i: usize) -> BackendSpec {
        BackendSpec {
            url: format!("http://10.0.0.{i}:8000"),
            authority: format!("10.0.0.{i}:8000"),
            addr: Some(format!("10.0.0.{i}:8000").parse().unwrap()),
            models: Some(vec!["m".into()]),
        }
    }

    fn view(n: usize) -> ClusterView {
        let wanted: Vec<_> = (0..n).map(spec).collect();
        ClusterView::rebuild(&ClusterView::default(), &wanted)
    }

    #[test]
    fn consecutive_failures_eject_within_the_cap() {
        let v = view(4);
        let cfg = HealthConfig {
            consecutive_failures: 3,
            ejection_ms: 1000,
            max_ejection_percent: 25,
            ..HealthConfig::default()
        };
        let now = Instant::now();
        assert!(!v.record_failure(0, "500", now, &cfg));
        assert!(!v.record_failure(0, "500", now, &cfg));
        assert!(v.record_failure(0, "500", now, &cfg));
        assert_eq!(v.backends[0].state(now, 3), BackendState::Ejected);
        // 25% of 4 = 1 ejected at most: backend 1 stays in.
        for _ in 0..5 {
            assert!(!v.record_failure(1, "500", now, &cfg));
        }
        assert_eq!(v.backends[1].state(now, 3), BackendState::Up);
        // After the ejection time, it is back.
        assert_eq!(v.backends[0].state(now + Duration::from_millis(1001), 3), BackendState::Up);
    }

    #[test]
    fn a_success_resets_the_streak() {
        let v = view(2);
        let cfg = HealthConfig {
            consecutive_failures: 2,
            ejection_ms: 1000,
            max_ejection_percent: 50,
            ..HealthConfig::default()
        };
        let now = Instant::now();
        v.record_failure(0, "connect", now, &cfg);
        v.backends[0].record_success();
        assert!(!v.record_failure(0, "connect", now, &cfg));
    }

    #[test]
    fn rebuild_keeps_surviving_backends_and_their_counters() {
        let v = view(2);
        v.backends[1].routed.store(42, Ordering::Relaxed);
        let wanted = vec![spec(1), spec(9)];
        let v2 = ClusterView::rebuild(&v, &wanted);
        assert!(Arc::ptr_eq(&v.backends[1], &v2.backends[0]));
        assert_eq!(v2.backends[0].routed.load(Ordering::Relaxed), 42);
        assert_eq!(v2.backends[1].routed.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn candidates_skip_other_models_excluded_and_unhealthy() {
        let v = view(3);
        let now = Instant::now();
        let (c, known) = v.candidates("m", &[1], now, 3, Duration::from_secs(2));
        assert!(known);
        assert_eq!(c.iter().map(|x| x.index).collect::<Vec<_>>(), vec![0, 2]);
        assert!(c.iter().all(|x| x.signal.is_none()), "nothing scraped yet");
        let (c, known) = v.candidates("other", &[], now, 3, Duration::from_secs(2));
        assert!(c.is_empty() && !known);
    }
}
