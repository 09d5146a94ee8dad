//! The gateway's long-lived state and how a configuration is applied to it.
//!
//! [`GatewayState`] is built once in `main` and shared by the proxy, the admin listener and
//! the background services. What a config reload changes — the config itself, the policy
//! and the backend set — is swapped atomically (`ArcSwap`); requests in flight keep the
//! snapshot they started with.

use std::net::ToSocketAddrs;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use arc_swap::ArcSwap;
use pingora::connectors::http::Connector;

use crate::access_log::AccessLog;
use crate::cluster::{BackendSpec, ClusterView};
use crate::config::{parse_backend_url, GatewayConfig};
use crate::metrics::GatewayMetrics;
use crate::policy::Policy;
use crate::prefix::PrefixTracker;

/// The config in force, the policy built from it and the backend set: one snapshot, so a
/// request never sees a new policy with old backends or the reverse.
pub struct Active {
    /// Configuration.
    pub config: GatewayConfig,
    /// Policy.
    pub policy: Box<dyn Policy>,
    /// Backend membership.
    pub cluster: Arc<ClusterView>,
}

/// Shared state.
pub struct GatewayState {
    /// Config + policy + backends.
    pub active: ArcSwap<Active>,
    /// Pooled upstream connections (pingora).
    pub connector: Connector,
    /// Metrics.
    pub metrics: GatewayMetrics,
    /// Set on shutdown: readiness fails so load balancers stop sending.
    pub draining: AtomicBool,
    /// Access log (JSON lines on stdout, buffered).
    pub access_log: AccessLog,
    /// What the gateway sent where: the prefix index of `prefix_affinity` and `cost`.
    pub prefix: PrefixTracker,
}

/// Resolve the static backends of `cfg` (DNS happens here, once per apply, never per request).
pub fn backend_specs(cfg: &GatewayConfig) -> Vec<BackendSpec> {
    cfg.discovery
        .static_backends
        .iter()
        .map(|b| {
            let authority = parse_backend_url(&b.url).expect("validated").authority;
            let addr = authority.to_socket_addrs().ok().and_then(|mut a| a.next());
            if addr.is_none() {
                tracing::warn!(url = %b.url, "backend address does not resolve; it stays down");
            }
            BackendSpec { url: b.url.clone(), authority, addr, models: b.models.clone() }
        })
        .collect()
}

impl GatewayState {
    /// State for a validated config.
    pub fn new(config: GatewayConfig, metrics: GatewayMetrics) -> Arc<Self> {
        let cluster = Arc::new(ClusterView::rebuild(&ClusterView::default(), &backend_specs(&config)));
        let policy = config.policy.build();
        let prefix = PrefixTracker::new(&config.prefix_index);
        Arc::new(GatewayState {
            prefix,
            active: ArcSwap::from_pointee(Active { config, policy, cluster }),
            connector: Connector::new(None),
            metrics,
            draining: AtomicBool::new(false),
            access_log: AccessLog::stdout(),
        })
    }

    /// Swap in a new validated config: policy and backends change atomically; backends that
    /// stay keep their counters. Listener addresses need a restart and are left as they are.
    pub fn apply(&self, config: GatewayConfig) {
        let old = self.active.load();
        if old.config.listen != config.listen || old.config.admin_listen != config.admin_listen {
            tracing::warn!("listen/admin_listen changes take effect after a restart");
        }
        let cluster = Arc::new(ClusterView::rebuild(&old.cluster, &backend_specs(&config)));
        self.prefix.reconfigure(&config.prefix_index);
        for gone in old.cluster.backends.iter().filter(|b| !cluster.backends.iter().any(|n| n.key == b.key)) {
            self.prefix.remove(gone.key);
        }
        let policy = config.policy.build();
        self.active.store(Arc::new(Active { config, policy, cluster }));
    }
}
