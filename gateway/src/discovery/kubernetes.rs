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
//!   requests already streaming from it finish on their own connections.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use super::Publisher;
use crate::config::KubernetesDiscovery;

/// Backend URLs of the endpoints that may take new requests, sorted and without repeats.
/// `port_name` picks the slice port (empty: the slice's only port); slices without it are
/// skipped.
pub fn ready_urls<'a>(slices: impl IntoIterator<Item = &'a EndpointSlice>, port_name: &str) -> Vec<String> {
    let mut urls = Vec::new();
    for slice in slices {
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

    async fn client(&self) -> Result<kube::Client, String> {
        let config = match &self.cfg.api_server {
            Some(url) => kube::Config::new(url.parse().map_err(|e| format!("api_server {url}: {e}"))?),
            None => kube::Config::infer().await.map_err(|e| format!("no Kubernetes configuration: {e}"))?,
        };
        kube::Client::try_from(config).map_err(|e| format!("Kubernetes client: {e}"))
    }

    async fn publish(&self, slices: &BTreeMap<String, EndpointSlice>) {
        let urls = ready_urls(slices.values(), &self.cfg.port_name);
        self.publisher.publish(urls, "kubernetes").await;
    }
}

#[async_trait]
impl BackgroundService for K8sDiscovery {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let client = loop {
            match self.client().await {
                Ok(c) => break c,
                Err(e) => {
                    tracing::error!(error = %e, "kubernetes discovery cannot start; retrying in 5 s");
                    tokio::select! {
                        _ = shutdown.changed() => return,
                        _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                    }
                }
            }
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

    fn slice(name: &str, v6: bool, port: (&str, i32), eps: &[(&str, Option<bool>, Option<bool>)]) -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
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
            ready_urls([&a, &b, &c], "shim"),
            vec!["http://10.0.0.1:8001", "http://10.0.0.4:8001", "http://[fd00::5]:8001"]
        );
        // Without a port name, a slice needs exactly one port.
        assert!(ready_urls([&a], "").is_empty());
        assert!(ready_urls(std::iter::empty(), "shim").is_empty());
    }
}
