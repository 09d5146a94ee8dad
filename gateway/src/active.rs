//! [`Active`]: the config in force, the policy built from it, the backend set and the API
//! keys — one immutable snapshot, swapped whole on a reload ([`crate::state`]). A request
//! loads it once and works on it to its end.

use std::sync::Arc;

use crate::auth::Authenticator;
use crate::cluster::ClusterView;
use crate::config::GatewayConfig;
#[cfg(any(test, feature = "fuzzing"))]
use crate::discovery::{backend_specs_with, static_list::literal_resolve};
use crate::policy::Policy;

/// The config in force, the policy built from it and the backend set: one snapshot, so a
/// request never sees a new policy with old backends or the reverse.
pub struct Active {
    /// Configuration.
    pub config: GatewayConfig,
    /// Policy.
    pub policy: Box<dyn Policy>,
    /// Backend membership.
    pub cluster: Arc<ClusterView>,
    /// API keys and their limiter state.
    pub auth: Arc<Authenticator>,
}

impl Active {
    /// `config` in force with its own policy over `cluster`.
    pub fn new(config: GatewayConfig, cluster: Arc<ClusterView>, auth: Arc<Authenticator>) -> Self {
        let policy = config.policy.build();
        Active { config, policy, cluster, auth }
    }

    /// A snapshot of `config` alone, without DNS: backends given by IP address resolve,
    /// named ones stay down. For the fuzz target and tests.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn for_config(config: GatewayConfig) -> Self {
        let specs = backend_specs_with(&config, &[], &literal_resolve);
        let cluster = Arc::new(ClusterView::rebuild(&ClusterView::default(), &specs));
        let auth = build_auth(&config, None);
        Active::new(config, cluster, auth)
    }
}

/// The key table of `config`, keeping `previous`'s limiter state for unchanged keys. Fails
/// closed: a key source that became unreadable since validation leaves no valid key.
pub(crate) fn build_auth(config: &GatewayConfig, previous: Option<&Authenticator>) -> Arc<Authenticator> {
    let keys = config.auth.all_keys().unwrap_or_else(|errs| {
        for e in errs {
            tracing::error!(error = %e, "API keys unavailable; requests will be refused");
        }
        Vec::new()
    });
    Arc::new(Authenticator::build(config.auth.enabled(), keys, previous))
}
