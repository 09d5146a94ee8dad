//! InferencePool discovery: the engines are the Pods a Gateway API Inference Extension
//! `InferencePool` (`inference.networking.k8s.io/v1`) selects, at each of its target ports.
//!
//! A background service watches the one pool by name and, with a second watcher, the Pods
//! of its namespace that carry the pool's `selector.matchLabels` (`kube`'s watcher for both,
//! as for EndpointSlices: list, watch from the list's version, list again on 410 Gone).
//! After every change [`pool_urls`] (pure) recomputes the set and a [`Publisher`] applies it:
//!
//! - a Pod takes new requests while its `Ready` condition is `True`, it has a pod IP and it
//!   is not terminating (`metadata.deletionTimestamp` unset); its labels are checked against
//!   the selector again, so the answer never depends on the API server filtering;
//! - every target port (up to 8) of every such Pod is one endpoint, `http://podIP:port`;
//! - a changed selector starts a new Pod watch; the old endpoints stay until its first list
//!   is complete, so a selector edit never empties the set in between;
//! - a deleted pool empties the set (requests then queue or get 503, as with no engines);
//!   a pool the gateway cannot read (bad spec) is logged and the last good set is kept.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::{self, Event};
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde::Deserialize;

use super::kubernetes::kube_client;
use super::Publisher;
use crate::config::InferencePoolDiscovery;

/// The API group, version and kind watched.
pub const GROUP: &str = "inference.networking.k8s.io";
/// See [`GROUP`].
pub const VERSION: &str = "v1";
/// See [`GROUP`].
pub const KIND: &str = "InferencePool";
/// The most target ports a pool may list.
pub const MAX_TARGET_PORTS: usize = 8;

/// What the gateway reads of a pool's `spec`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// `selector.matchLabels`: a Pod is a member when it carries all of them.
    pub match_labels: BTreeMap<String, String>,
    /// `targetPorts[*].number`.
    pub ports: Vec<u16>,
    /// `appProtocol` (absent: `http`): how the data plane speaks to the Pods. Scraping is
    /// HTTP/1.1 either way; the gateway's own proxy (edge mode) speaks HTTP/1.1.
    pub app_protocol: AppProtocol,
}

/// A pool's `appProtocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppProtocol {
    /// HTTP/1.1 (the default).
    Http,
    /// HTTP/2 over cleartext (`kubernetes.io/h2c`, or `h2c`).
    H2c,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSpec {
    selector: Option<RawSelector>,
    #[serde(default)]
    target_ports: Vec<RawPort>,
    app_protocol: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSelector {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct RawPort {
    number: i64,
}

/// Read a pool object's spec; `Err` names what is wrong with it.
pub fn pool_spec(pool: &DynamicObject) -> Result<PoolSpec, String> {
    let spec = pool.data.get("spec").ok_or("the pool has no spec")?;
    let raw: RawSpec = serde_json::from_value(spec.clone()).map_err(|e| format!("spec: {e}"))?;
    let match_labels = raw.selector.map(|s| s.match_labels).unwrap_or_default();
    if match_labels.is_empty() {
        // An empty selector would select every Pod of the namespace.
        return Err("spec.selector.matchLabels is empty".into());
    }
    if raw.target_ports.is_empty() || raw.target_ports.len() > MAX_TARGET_PORTS {
        return Err(format!(
            "spec.targetPorts must list 1 to {MAX_TARGET_PORTS} ports, not {}",
            raw.target_ports.len()
        ));
    }
    let mut ports = Vec::with_capacity(raw.target_ports.len());
    for (i, p) in raw.target_ports.iter().enumerate() {
        match u16::try_from(p.number) {
            Ok(n) if n > 0 => ports.push(n),
            _ => return Err(format!("spec.targetPorts[{i}].number {} is not a port (1-65535)", p.number)),
        }
    }
    ports.sort_unstable();
    ports.dedup();
    let app_protocol = match raw.app_protocol.as_deref() {
        None | Some("http") => AppProtocol::Http,
        Some("kubernetes.io/h2c") | Some("h2c") => AppProtocol::H2c,
        Some(other) => return Err(format!("spec.appProtocol {other:?} is not http or kubernetes.io/h2c")),
    };
    Ok(PoolSpec { match_labels, ports, app_protocol })
}

/// The selector as a Kubernetes label selector string (`k=v,k2=v2`), for the Pod watch.
pub fn label_selector(spec: &PoolSpec) -> String {
    spec.match_labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// Whether a Pod may take new requests: selected, `Ready`, with an IP, not terminating.
fn serving_ip<'a>(spec: &PoolSpec, pod: &'a Pod) -> Option<&'a str> {
    let labels = pod.metadata.labels.as_ref();
    let selected = spec.match_labels.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v));
    if !selected || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready =
        status.conditions.as_deref().unwrap_or_default().iter().any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref().filter(|ip| !ip.is_empty())
}

/// Backend URLs of the pool's serving endpoints, sorted and without repeats.
pub fn pool_urls<'a>(spec: &PoolSpec, pods: impl IntoIterator<Item = &'a Pod>) -> Vec<String> {
    let mut urls = Vec::new();
    for pod in pods {
        let Some(ip) = serving_ip(spec, pod) else { continue };
        for port in &spec.ports {
            urls.push(if ip.contains(':') { format!("http://[{ip}]:{port}") } else { format!("http://{ip}:{port}") });
        }
    }
    urls.sort();
    urls.dedup();
    urls
}

/// The pool and Pod watcher service.
pub struct PoolDiscovery {
    publisher: Publisher,
    cfg: InferencePoolDiscovery,
}

/// What the service knows now.
#[derive(Default)]
struct Seen {
    /// The pool's spec; `None` before the first list or after the pool is deleted.
    spec: Option<PoolSpec>,
    pods: BTreeMap<String, Pod>,
    /// A relist (of either watch) being collected, swapped in whole at its end.
    pods_relist: Option<BTreeMap<String, Pod>>,
    /// The Pods of the current selector have been listed once.
    pods_listed: bool,
}

type PodEvents = BoxStream<'static, Result<Event<Pod>, watcher::Error>>;

impl PoolDiscovery {
    /// Watch the pool `cfg` names, publishing through `publisher`.
    pub fn new(publisher: Publisher, cfg: InferencePoolDiscovery) -> Self {
        PoolDiscovery { publisher, cfg }
    }

    async fn publish(&self, seen: &Seen) {
        let urls = match &seen.spec {
            Some(spec) => pool_urls(spec, seen.pods.values()),
            None => Vec::new(),
        };
        self.publisher.publish(urls, "inference_pool").await;
    }

    /// A new or changed pool spec (or its deletion, `None`); returns a new Pod watch when
    /// the selector changed.
    fn set_spec(&self, client: &kube::Client, seen: &mut Seen, spec: Option<PoolSpec>) -> Option<Option<PodEvents>> {
        let selector_changed = seen.spec.as_ref().map(|s| &s.match_labels) != spec.as_ref().map(|s| &s.match_labels);
        if let Some(s) = &spec {
            if s.app_protocol == AppProtocol::H2c {
                tracing::info!(pool = %self.cfg.name, "inference pool speaks h2c: the data plane's business; scrapes use HTTP/1.1");
            }
        }
        seen.spec = spec;
        if !selector_changed {
            return None;
        }
        seen.pods_listed = false;
        seen.pods_relist = None;
        Some(seen.spec.as_ref().map(|s| {
            let api: kube::Api<Pod> = kube::Api::namespaced(client.clone(), &self.cfg.namespace);
            watcher::watcher(api, watcher::Config::default().labels(&label_selector(s))).boxed()
        }))
    }
}

/// The next Pod event, or never when there is no Pod watch.
async fn next_pod_event(pods: &mut Option<PodEvents>) -> Option<Result<Event<Pod>, watcher::Error>> {
    match pods {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

#[async_trait]
impl BackgroundService for PoolDiscovery {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(client) = kube_client(self.cfg.api_server.as_deref(), "inference_pool", &mut shutdown).await else {
            return;
        };
        let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(GROUP, VERSION, KIND));
        let pools: kube::Api<DynamicObject> =
            kube::Api::namespaced_with(client.clone(), &self.cfg.namespace, &resource);
        let by_name = watcher::Config::default().fields(&format!("metadata.name={}", self.cfg.name));
        let mut pool_events = watcher::watcher(pools, by_name).boxed();
        let mut pod_events: Option<PodEvents> = None;
        let mut seen = Seen::default();
        // The pool as of the current (re)list: `Some(None)` while listing, found nothing yet.
        let mut pool_relist: Option<Option<DynamicObject>> = None;
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                event = pool_events.next() => {
                    let Some(event) = event else { return };
                    let Some(pool) = self.pool_event(event, &mut pool_relist).await else { continue };
                    let spec = match pool.as_ref().map(pool_spec) {
                        None => None,
                        Some(Ok(spec)) => Some(spec),
                        Some(Err(e)) => {
                            tracing::error!(pool = %self.cfg.name, error = %e, "inference pool rejected; keeping the last endpoints");
                            continue;
                        }
                    };
                    if let Some(new_watch) = self.set_spec(&client, &mut seen, spec) {
                        pod_events = new_watch;
                        if pod_events.is_some() {
                            // Publish once the new selector's Pods are listed.
                            continue;
                        }
                        seen.pods.clear();
                    }
                    self.publish(&seen).await;
                }
                event = next_pod_event(&mut pod_events) => match event {
                    None => pod_events = None,
                    Some(event) => self.pod_event(event, &mut seen).await,
                }
            }
        }
    }
}

impl PoolDiscovery {
    /// What a pool watch event says: the pool as it now is (`Some(None)`: deleted, or not
    /// found by a relist), or `None` when there is nothing to act on yet (a relist under way,
    /// another pool, an error). `relist`: the pool as of the current relist.
    async fn pool_event(
        &self,
        event: Result<Event<DynamicObject>, watcher::Error>,
        relist: &mut Option<Option<DynamicObject>>,
    ) -> Option<Option<DynamicObject>> {
        // Only the named pool counts, whatever else the server sends.
        let ours = |p: &DynamicObject| p.metadata.name.as_deref() == Some(self.cfg.name.as_str());
        match event {
            Ok(Event::Init) => {
                *relist = Some(None);
                None
            }
            Ok(Event::InitApply(p)) => {
                if ours(&p) {
                    *relist = Some(Some(p));
                }
                None
            }
            Ok(Event::InitDone) => Some(relist.take().flatten()),
            Ok(Event::Apply(p)) if ours(&p) => Some(Some(p)),
            Ok(Event::Delete(p)) if ours(&p) => Some(None),
            Ok(Event::Apply(_) | Event::Delete(_)) => None,
            Err(e) => {
                tracing::warn!(error = %e, "inference pool discovery: pool watch error");
                tokio::time::sleep(Duration::from_millis(500)).await;
                None
            }
        }
    }

    /// A Pod watch event: the Pods seen updated, and published once they are listed.
    async fn pod_event(&self, event: Result<Event<Pod>, watcher::Error>, seen: &mut Seen) {
        let pod_name = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
        match event {
            Ok(Event::Init) => seen.pods_relist = Some(BTreeMap::new()),
            Ok(Event::InitApply(p)) => {
                seen.pods_relist.get_or_insert_with(BTreeMap::new).insert(pod_name(&p), p);
            }
            Ok(Event::InitDone) => {
                seen.pods = seen.pods_relist.take().unwrap_or_default();
                seen.pods_listed = true;
                self.publish(seen).await;
            }
            Ok(Event::Apply(p)) => {
                seen.pods.insert(pod_name(&p), p);
                if seen.pods_listed {
                    self.publish(seen).await;
                }
            }
            Ok(Event::Delete(p)) => {
                seen.pods.remove(&pod_name(&p));
                if seen.pods_listed {
                    self.publish(seen).await;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "inference pool discovery: pod watch error");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool(spec: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "serving"}, "spec": spec}))
        .unwrap()
    }

    fn pod(name: &str, app: &str, ip: &str, ready: bool, terminating: bool) -> Pod {
        let mut p = json!({"metadata": {"name": name, "labels": {"app": app, "tier": "engine"}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}});
        if terminating {
            p["metadata"]["deletionTimestamp"] = json!("2026-12-05T00:00:00Z");
        }
        serde_json::from_value(p).unwrap()
    }

    fn spec() -> PoolSpec {
        pool_spec(&pool(
            json!({"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}, {"number": 8001}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}),
        ))
        .unwrap()
    }

    #[test]
    fn serving_pods_of_the_selector_at_every_target_port() {
        let pods = [
            pod("a", "vllm", "10.0.0.1", true, false),
            pod("b", "vllm", "10.0.0.2", false, false),
            pod("c", "vllm", "10.0.0.3", true, true),
            pod("d", "other", "10.0.0.4", true, false),
            pod("e", "vllm", "", true, false),
            pod("f", "vllm", "fd00::5", true, false),
        ];
        assert_eq!(
            pool_urls(&spec(), &pods),
            ["http://10.0.0.1:8000", "http://10.0.0.1:8001", "http://[fd00::5]:8000", "http://[fd00::5]:8001"]
        );
        assert_eq!(label_selector(&spec()), "app=vllm");
    }

    #[test]
    fn a_pool_spec_is_read_or_refused_with_its_field() {
        let s = spec();
        assert_eq!((s.ports.clone(), s.app_protocol), (vec![8000, 8001], AppProtocol::Http));
        let h2c = json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}], "appProtocol": "kubernetes.io/h2c"});
        assert_eq!(pool_spec(&pool(h2c)).unwrap().app_protocol, AppProtocol::H2c);
        let nine: Vec<_> = (1..=9).map(|n| json!({"number": n})).collect();
        for (spec, says) in [
            (json!({"targetPorts": [{"number": 1}]}), "matchLabels"),
            (json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}), "matchLabels"),
            (json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []}), "targetPorts"),
            (json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": nine}), "targetPorts"),
            (json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]}), "targetPorts[0]"),
            (
                json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}], "appProtocol": "grpc"}),
                "appProtocol",
            ),
            (json!({"selector": "x"}), "spec"),
        ] {
            let err = pool_spec(&pool(spec.clone())).unwrap_err();
            assert!(err.contains(says), "{spec}: {err}");
        }
    }
}
