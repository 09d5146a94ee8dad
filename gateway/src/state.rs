//! The gateway's long-lived state and how a configuration is applied to it.
//!
//! [`GatewayState`] is built once in `main` and shared by the proxy, the admin listener and
//! the background services. What a config reload changes — the config itself, the policy
//! and the backend set, one [`Active`] snapshot — is swapped atomically (`ArcSwap`);
//! requests in flight keep the snapshot they started with.

use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use pingora::connectors::TransportConnector;

use crate::access_log::AccessLog;
use crate::active::{build_auth, Active};
use crate::admission::AdmissionQueue;
use crate::auth::Authenticator;
use crate::body_budget::BodyBudget;
use crate::cluster::{BackendSpec, ClusterView};
use crate::config::GatewayConfig;
use crate::discovery::{backend_specs, backend_specs_with, system_resolve};
use crate::drain::Lifecycle;
use crate::error::ConfigError;
use crate::kv_events::prompt::{PoolLimits, PromptTokenizer};
use crate::kv_events::subscriber::KvEvents;
use crate::metrics::GatewayMetrics;
use crate::prefix::PrefixTracker;
use crate::retry::RetryBudget;

/// Idle connections kept per backend (NGINX's `keepalive`).
pub const UPSTREAM_MAX_IDLE: usize = 256;
/// How long an idle engine connection is kept.
pub const UPSTREAM_IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// Shared state.
pub struct GatewayState {
    /// Config + policy + backends (shared with the scraper, which needs nothing else).
    pub active: Arc<ArcSwap<Active>>,
    /// Opens upstream connections (pingora; TCP, TLS).
    pub connector: TransportConnector,
    /// Idle upstream connections for reuse, one pool per core (the calling thread's:
    /// `pools.of(cores::current())`).
    pub pools: crate::pool::Pools<crate::upstream::EngineConnection>,
    /// Metrics.
    pub metrics: GatewayMetrics,
    /// Draining or not, and the connections being served (drain waits for zero).
    pub lifecycle: Arc<Lifecycle>,
    /// Access log (JSON lines on stdout, buffered).
    pub access_log: AccessLog,
    /// What the gateway sent where: the prefix index of `prefix_affinity` and `cost`.
    pub prefix: PrefixTracker,
    /// Backend URLs found by discovery (beside the config's static ones).
    pub discovered: ArcSwap<Vec<String>>,
    /// Requests waiting for an engine.
    pub queue: Arc<AdmissionQueue>,
    /// Request body bytes held, against `limits.max_buffered_body_bytes`.
    pub bodies: Arc<BodyBudget>,
    /// Retries spent against requests made.
    pub retry_budget: Mutex<RetryBudget>,
    /// The engines' KV events and the precise index they build (`kv_events` configured).
    pub kv_events: Option<Arc<KvEvents>>,
    /// Tokenizes prompts into the index's block keys (`kv_events.tokenizer` configured).
    pub prompt_tokenizer: Option<PromptTokenizer>,
    /// Tenant limits kept in Redis for every replica (`auth.shared_limits`, read at start).
    pub shared_limits: Option<Arc<crate::shared_limits::SharedLimits>>,
}

impl GatewayState {
    /// State for a validated config; `tokenizer`: `kv_events.tokenizer`, loaded.
    pub fn new(
        config: GatewayConfig,
        metrics: GatewayMetrics,
        tokenizer: Option<Arc<switchyard_tokenizer::ModelTokenizer>>,
    ) -> Arc<Self> {
        let cluster = Arc::new(ClusterView::rebuild(&ClusterView::default(), &backend_specs(&config, &[])));
        let prefix = PrefixTracker::new(&config.prefix_index);
        let auth = build_auth(&config, None);
        // The connector only opens connections; its own keep-alive pool stays empty (idle
        // connections go to `pool`), so its size does not matter.
        let mut connector_options = pingora::connectors::ConnectorOptions::new(128);
        connector_options.ca_file = config.upstream_tls.ca_file.clone();
        let kv_events = config.kv_events.as_ref().map(|k| KvEvents::new(k.block_size, k.max_bytes));
        let prompt_tokenizer = config.kv_events.as_ref().zip(tokenizer).map(|(k, tokenizer)| {
            let limits = PoolLimits {
                threads: k.tokenizer_threads.unwrap_or(config.worker_threads()),
                max_bytes: k.tokenize_max_bytes,
                timeout: std::time::Duration::from_millis(k.tokenize_timeout_ms),
            };
            let counter = &metrics.prompt_tokenizations;
            PromptTokenizer::new(tokenizer, k.tokenizer_cache_bytes, k.block_size, limits, counter)
        });
        let shared_limits =
            config.auth.shared_limits.clone().map(|c| crate::shared_limits::SharedLimits::new(c, metrics.clone()));
        let r = &config.retries;
        let retry_budget = RetryBudget::new(r.budget_percent, r.min_retries_per_second, std::time::Instant::now());
        let cores = config.core_threads();
        Arc::new(GatewayState {
            prefix,
            active: Arc::new(ArcSwap::from_pointee(Active::new(config, cluster, auth))),
            connector: TransportConnector::new(Some(connector_options)),
            pools: crate::pool::Pools::new(cores, UPSTREAM_MAX_IDLE, UPSTREAM_IDLE),
            bodies: BodyBudget::new(metrics.buffered_body_bytes.clone()),
            metrics,
            lifecycle: Arc::default(),
            access_log: AccessLog::stdout(),
            discovered: ArcSwap::from_pointee(Vec::new()),
            queue: AdmissionQueue::new(),
            retry_budget: Mutex::new(retry_budget),
            kv_events,
            prompt_tokenizer,
            shared_limits,
        })
    }

    /// Replace the backends found by discovery (Kubernetes EndpointSlices, DNS) and rebuild
    /// the cluster view; backends that stay keep their state, and requests already streaming
    /// from one that left finish on their own connections. Blocking: the static names are
    /// resolved again too.
    pub fn set_discovered(&self, urls: Vec<String>) {
        self.discovered.store(Arc::new(urls));
        self.re_resolve(&system_resolve);
    }

    /// The cluster view for `specs`, carrying over the state of the backends of `old` that
    /// stay; the prefix index forgets the ones that left.
    fn rebuild_cluster(&self, old: &ClusterView, specs: &[BackendSpec]) -> Arc<ClusterView> {
        let cluster = Arc::new(ClusterView::rebuild(old, specs));
        for gone in old.backends.iter().filter(|b| !cluster.backends.iter().any(|n| n.key == b.key)) {
            self.prefix.remove(gone.key);
        }
        cluster
    }

    /// Resolve the active config's backend names again; when an address changed (a name
    /// that now resolves, a pod with a new IP), rebuild the cluster view with the same
    /// config — backends whose address did not change keep their state. True when rebuilt.
    pub fn re_resolve(&self, resolve: &dyn Fn(&str) -> Option<SocketAddr>) -> bool {
        let old = self.active.load_full();
        let discovered = self.discovered.load_full();
        let specs = backend_specs_with(&old.config, &discovered, resolve);
        let same = specs.len() == old.cluster.backends.len()
            && specs.iter().zip(old.cluster.backends.iter()).all(|(s, b)| s.url == b.url && s.addr == b.addr);
        if same {
            return false;
        }
        for s in &specs {
            if let Some(b) = old.cluster.backends.iter().find(|b| b.url == s.url && b.addr != s.addr) {
                tracing::info!(url = %s.url, from = ?b.addr, to = ?s.addr, "backend address changed");
            }
        }
        let cluster = self.rebuild_cluster(&old.cluster, &specs);
        // Only if no reload swapped the config meanwhile (that one resolved for itself).
        let next = Arc::new(Active::new(old.config.clone(), cluster, old.auth.clone()));
        let prev = self.active.compare_and_swap(&old, next);
        Arc::ptr_eq(&prev, &old)
    }

    /// Read the API key sources again (`auth.keys_file`, e.g. a rotated Secret): a key
    /// removed there is refused from now on, keys that stay keep their limiter state. A
    /// source that cannot be read or holds a bad entry leaves the keys in force (the error
    /// is returned). Returns the number of keys now in force.
    pub fn reload_keys(&self) -> Result<usize, ConfigError> {
        let old = self.active.load_full();
        let keys = old.config.auth.read_checked_keys()?;
        let n = keys.len();
        let auth = Arc::new(Authenticator::build(old.config.auth.enabled(), keys, Some(&old.auth)));
        let next = Arc::new(Active::new(old.config.clone(), old.cluster.clone(), auth));
        // A config reload that swapped in meanwhile read the key sources itself.
        self.active.compare_and_swap(&old, next);
        Ok(n)
    }

    /// Swap in a new validated config: policy and backends change atomically; backends that
    /// stay keep their counters. Listener addresses need a restart and are left as they are.
    pub fn apply(&self, config: GatewayConfig) {
        let old = self.active.load();
        if old.config.listen != config.listen || old.config.admin_listen != config.admin_listen {
            tracing::warn!("listen/admin_listen changes take effect after a restart");
        }
        self.prefix.reconfigure(&config.prefix_index);
        let cluster = self.rebuild_cluster(&old.cluster, &backend_specs(&config, &self.discovered.load()));
        let auth = build_auth(&config, Some(&old.auth));
        if old.config.auth.shared_limits != config.auth.shared_limits {
            tracing::warn!("auth.shared_limits changes take effect after a restart");
        }
        let r = &config.retries;
        self.retry_budget.lock().set_limits(r.budget_percent, r.min_retries_per_second);
        self.active.store(Arc::new(Active::new(config, cluster, auth)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> Arc<GatewayState> {
        let yaml = "listen: 127.0.0.1:18080\nadmin_listen: 127.0.0.1:19090\ndiscovery:\n  static:\n    - url: http://engine-0.engines:8001\n    - url: http://127.0.0.1:9\n";
        let cfg = GatewayConfig::parse(yaml).unwrap();
        GatewayState::new(cfg, GatewayMetrics::new(prometheus::Registry::new()).unwrap(), None)
    }

    #[test]
    fn a_name_that_resolves_later_or_moves_is_picked_up_without_a_reload() {
        let st = state();
        let addr_of = |st: &GatewayState, i: usize| st.active.load().cluster.backends[i].addr;
        // engine-0.engines does not resolve here (the pod does not exist yet).
        assert_eq!(addr_of(&st, 0), None);
        let loopback: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let fixed = |a: &str| if a == "127.0.0.1:9" { Some(loopback) } else { None };
        assert!(!st.re_resolve(&fixed), "nothing changed");
        let key_of_second = st.active.load().cluster.backends[1].key;
        // The pod appears…
        let up: SocketAddr = "10.0.0.7:8001".parse().unwrap();
        let created = |a: &str| if a == "engine-0.engines:8001" { Some(up) } else { fixed(a) };
        assert!(st.re_resolve(&created));
        assert_eq!(addr_of(&st, 0), Some(up));
        assert_eq!(st.active.load().cluster.backends[1].key, key_of_second, "the unchanged backend keeps its state");
        assert!(!st.re_resolve(&created), "stable");
        // …and restarts with a new IP.
        let moved: SocketAddr = "10.0.0.9:8001".parse().unwrap();
        assert!(st.re_resolve(&|a: &str| if a == "engine-0.engines:8001" { Some(moved) } else { fixed(a) }));
        assert_eq!(addr_of(&st, 0), Some(moved));
    }
}
