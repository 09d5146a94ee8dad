//! Kubernetes discovery: the engines are the ready endpoints of a Service's EndpointSlices.
//!
//! A background service watches EndpointSlices (by `kubernetes.io/service-name`, or any
//! label selector) with `kube`'s watcher, which lists, then watches from the list's
//! `resourceVersion` with bookmarks, and lists again when the server answers 410 Gone.
//! After every change the set of backend URLs is recomputed by [`ready_urls`] (pure) and
//! published through a [`Publisher`]:
//!
//! - an endpoint takes new requests only while `conditions.ready` is true (unset counts as
//!   true, as the API defines it) and it is not `terminating`;
//! - a terminating endpoint leaves the set at once, so it gets no new request, while the
//!   requests already streaming from it finish on their own connections;
//! - only slices managed by `discovery.kubernetes.managed_by` (Kubernetes' EndpointSlice
//!   controller by default) count: the selector asks the API server for them, and
//!   [`ready_urls`] checks the label again.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use super::Publisher;
use crate::config::{KubernetesDiscovery, MANAGED_BY_LABEL};

/// Backend URLs of the endpoints that may take new requests, sorted and without repeats.
/// `port_name` picks the slice port (empty: the slice's only port); slices without it are
/// skipped, as are slices not labelled managed by `managed_by` (empty: any).
pub fn ready_urls<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    port_name: &str,
    managed_by: &str,
) -> Vec<String> {
    let mut urls = Vec::new();
    for slice in slices {
        let manager = slice.metadata.labels.as_ref().and_then(|l| l.get(MANAGED_BY_LABEL));
        if !managed_by.is_empty() && manager.map(String::as_str) != Some(managed_by) {
            continue;
        }
        let ports = slice.ports.as_deref().unwrap_or_default();
        let port = if port_name.is_empty() {
            (ports.len() == 1).then(|| ports[0].port).flatten()
        } else {
            ports.iter().find(|p| p.name.as_deref() == Some(port_name)).and_then(|p| p.port)
        };
        let Some(port) = port else { continue };
        let v6 = slice.address_type == "IPv6";
        for ep in &slice.endpoints {
            let c = ep.conditions.as_ref();
            let ready = c.and_then(|c| c.ready).unwrap_or(true);
            let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
            if !ready || terminating {
                continue;
            }
            for a in &ep.addresses {
                urls.push(if v6 { format!("http://[{a}]:{port}") } else { format!("http://{a}:{port}") });
            }
        }
    }
    urls.sort();
    urls.dedup();
    urls
}

/// A client for `api_server` (default: the in-cluster service account, else the kubeconfig),
/// tried every 5 s until one can be made; `None` when the gateway shuts down first.
pub(super) async fn kube_client(
    api_server: Option<&str>,
    source: &str,
    shutdown: &mut ShutdownWatch,
) -> Option<kube::Client> {
    let make = async || {
        let config = match api_server {
            Some(url) => kube::Config::new(url.parse().map_err(|e| format!("api_server {url}: {e}"))?),
            None => kube::Config::infer().await.map_err(|e| format!("no Kubernetes configuration: {e}"))?,
        };
        kube::Client::try_from(config).map_err(|e| format!("Kubernetes client: {e}"))
    };
    loop {
        match make().await {
            Ok(c) => return Some(c),
            Err(e) => {
                tracing::error!(error = %e, source, "discovery cannot start; retrying in 5 s");
                tokio::select! {
                    _ = shutdown.changed() => return None,
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
            }
        }
    }
}

/// The EndpointSlice watcher service.
pub struct K8sDiscovery {
    publisher: Publisher,
    cfg: KubernetesDiscovery,
}

impl K8sDiscovery {
    /// Watch what `cfg` names, publishing through `publisher`.
    pub fn new(publisher: Publisher, cfg: KubernetesDiscovery) -> Self {
        K8sDiscovery { publisher, cfg }
    }

    async fn publish(&self, slices: &BTreeMap<String, EndpointSlice>) {
        let urls = ready_urls(slices.values(), &self.cfg.port_name, &self.cfg.managed_by);
        self.publisher.publish(urls, "kubernetes").await;
    }
}

#[async_trait]
impl BackgroundService for K8sDiscovery {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(client) = kube_client(self.cfg.api_server.as_deref(), "kubernetes", &mut shutdown).await else {
            return;
        };
        let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client, &self.cfg.namespace);
        let wc = watcher::Config::default().labels(&self.cfg.selector());
        let mut events = watcher::watcher(api, wc).boxed();
        let name = |s: &EndpointSlice| s.metadata.name.clone().unwrap_or_default();
        let mut slices: BTreeMap<String, EndpointSlice> = BTreeMap::new();
        // A relist is buffered and swapped in whole, so a half-listed set is never routed to.
        let mut relist: Option<BTreeMap<String, EndpointSlice>> = None;
        loop {
            let event = tokio::select! {
                _ = shutdown.changed() => return,
                e = events.next() => e,
            };
            match event {
                None => return,
                Some(Ok(Event::Init)) => relist = Some(BTreeMap::new()),
                Some(Ok(Event::InitApply(s))) => {
                    relist.get_or_insert_with(BTreeMap::new).insert(name(&s), s);
                }
                Some(Ok(Event::InitDone)) => {
                    slices = relist.take().unwrap_or_default();
                    self.publish(&slices).await;
                }
                Some(Ok(Event::Apply(s))) => {
                    slices.insert(name(&s), s);
                    self.publish(&slices).await;
                }
                Some(Ok(Event::Delete(s))) => {
                    slices.remove(&name(&s));
                    self.publish(&slices).await;
                }
                Some(Err(e)) => {
                    // The watcher retries by itself (410 Gone means a fresh list); keep the
                    // last known endpoints meanwhile and do not spin.
                    tracing::warn!(error = %e, "kubernetes discovery: watch error");
                    tokio::select! {
                        _ = shutdown.changed() => return,
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTROLLER: &str = crate::config::DEFAULT_MANAGED_BY;

    fn slice(name: &str, v6: bool, port: (&str, i32), eps: &[(&str, Option<bool>, Option<bool>)]) -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {MANAGED_BY_LABEL: CONTROLLER}},
            "addressType": if v6 { "IPv6" } else { "IPv4" },
            "ports": [{"name": port.0, "port": port.1}, {"name": "metrics", "port": 9999}],
            "endpoints": eps.iter().map(|(a, ready, term)| serde_json::json!({
                "addresses": [a],
                "conditions": {"ready": ready, "terminating": term},
            })).collect::<Vec<_>>(),
        }))
        .unwrap()
    }

    #[test]
    fn only_ready_endpoints_that_are_not_terminating_take_requests() {
        let a = slice(
            "a",
            false,
            ("shim", 8001),
            &[
                ("10.0.0.1", Some(true), None),
                ("10.0.0.2", Some(false), None),
                ("10.0.0.3", Some(false), Some(true)),
                ("10.0.0.4", None, None),
            ],
        );
        let b = slice("b", true, ("shim", 8001), &[("fd00::5", Some(true), Some(false))]);
        let c = slice("c", false, ("other", 1), &[("10.0.0.9", Some(true), None)]);
        assert_eq!(
            ready_urls([&a, &b, &c], "shim", CONTROLLER),
            vec!["http://10.0.0.1:8001", "http://10.0.0.4:8001", "http://[fd00::5]:8001"]
        );
        // Without a port name, a slice needs exactly one port.
        assert!(ready_urls([&a], "", CONTROLLER).is_empty());
        assert!(ready_urls(std::iter::empty(), "shim", CONTROLLER).is_empty());
    }

    #[test]
    fn only_slices_of_the_configured_manager_count() {
        let real = slice("real", false, ("shim", 8001), &[("10.0.0.1", Some(true), None)]);
        let mut forged = slice("forged", false, ("shim", 8001), &[("203.0.113.9", Some(true), None)]);
        forged.metadata.labels = None;
        let mut other = slice("other", false, ("shim", 8001), &[("10.0.0.2", Some(true), None)]);
        other.metadata.labels.as_mut().unwrap().insert(MANAGED_BY_LABEL.into(), "someone-else".into());
        assert_eq!(ready_urls([&real, &forged, &other], "shim", CONTROLLER), vec!["http://10.0.0.1:8001"]);
        assert_eq!(ready_urls([&real, &forged, &other], "shim", "").len(), 3, "empty: any manager");
    }

    #[test]
    fn the_selector_asks_for_the_managers_slices() {
        let cfg: KubernetesDiscovery =
            serde_yaml::from_str("{ namespace: serving, service: engines, port_name: shim }").unwrap();
        assert_eq!(
            cfg.selector(),
            "kubernetes.io/service-name=engines,endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io"
        );
        let any: KubernetesDiscovery =
            serde_yaml::from_str("{ namespace: serving, label_selector: app=x, managed_by: '' }").unwrap();
        assert_eq!(any.selector(), "app=x");
    }
}
