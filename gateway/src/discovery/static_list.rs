//! The `static` source: the config's `discovery.static` backends, plus the URLs the dynamic
//! sources published, turned into [`BackendSpec`]s with their names resolved.
//!
//! DNS happens when a config is applied and every `discovery.resolve_interval_ms` (a name
//! that did not resolve yet — a pod not created — or that now points elsewhere is picked
//! up without a reload), never per request.

use std::net::{SocketAddr, ToSocketAddrs};

use crate::cluster::BackendSpec;
use crate::config::{parse_backend_url, GatewayConfig};

/// Resolve a `host:port` with the system resolver (blocking).
pub fn system_resolve(authority: &str) -> Option<SocketAddr> {
    authority.to_socket_addrs().ok().and_then(|mut a| a.next())
}

/// An `IP:port` authority as an address, without any lookup (names stay unresolved).
#[cfg(any(test, feature = "fuzzing"))]
pub fn literal_resolve(authority: &str) -> Option<SocketAddr> {
    authority.parse().ok()
}

/// The static backends of `cfg` then the `discovered` ones, names resolved by `resolve`.
pub fn backend_specs_with(
    cfg: &GatewayConfig,
    discovered: &[String],
    resolve: &dyn Fn(&str) -> Option<SocketAddr>,
) -> Vec<BackendSpec> {
    let listed = cfg.discovery.static_backends.iter().map(|b| (b.url.clone(), b.models.clone()));
    let found = discovered
        .iter()
        .filter(|u| !cfg.discovery.static_backends.iter().any(|b| &b.url == *u))
        .map(|u| (u.clone(), None));
    listed
        .chain(found)
        .filter_map(|(url, models)| {
            let authority = parse_backend_url(&url).ok()?.authority;
            let addr = resolve(&authority);
            Some(BackendSpec { url, authority, addr, models })
        })
        .collect()
}

/// [`backend_specs_with`] the system resolver, warning about names that do not resolve.
pub fn backend_specs(cfg: &GatewayConfig, discovered: &[String]) -> Vec<BackendSpec> {
    let specs = backend_specs_with(cfg, discovered, &system_resolve);
    for s in specs.iter().filter(|s| s.addr.is_none()) {
        tracing::warn!(url = %s.url, "backend address does not resolve; it stays down until it does");
    }
    specs
}
