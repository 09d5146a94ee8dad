//! A fake Kubernetes API server for EndpointSlices, Pods and InferencePools, spoken over
//! real HTTP so the gateway's `kube` client runs unmodified: list (with `resourceVersion`),
//! watch streams (JSON lines, bookmarks), and `410 Gone` on a watch from an expired version,
//! which forces a relist. It does not filter by label or field selector (it records them):
//! the gateway must check what it is given.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::response::Response;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// The kinds served, with their API version and collection path (namespace `{ns}`).
const KINDS: [(&str, &str, &str); 3] = [
    ("EndpointSlice", "discovery.k8s.io/v1", "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"),
    ("Pod", "v1", "/api/v1/namespaces/{ns}/pods"),
    (
        "InferencePool",
        "inference.networking.k8s.io/v1",
        "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    ),
];

#[derive(Default)]
struct Inner {
    rv: u64,
    /// Objects by kind, then name.
    objects: BTreeMap<&'static str, BTreeMap<String, Value>>,
    watchers: Vec<(&'static str, mpsc::UnboundedSender<Bytes>)>,
    lists: usize,
    watches: usize,
    /// Watches from a version at or below this get 410 Gone.
    expired_below: u64,
    /// The `labelSelector` of every list and watch, in order.
    selectors: Vec<String>,
    /// The `fieldSelector` of every list and watch, in order.
    field_selectors: Vec<String>,
}

/// The fake server; dropping it stops nothing (the runtime does).
#[derive(Clone)]
pub struct FakeKube {
    inner: Arc<Mutex<Inner>>,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

fn line(v: &Value) -> Bytes {
    Bytes::from(format!("{v}\n"))
}

impl Inner {
    /// Send a watch event to the watchers of `kind` that are still there.
    fn notify(&mut self, kind: &str, event: &Value) {
        let bytes = line(event);
        self.watchers.retain(|(k, w)| *k != kind || w.send(bytes.clone()).is_ok());
    }
}

/// The served kind named `kind`.
fn served(kind: &str) -> &'static str {
    KINDS.iter().find(|k| k.0 == kind).unwrap_or_else(|| panic!("the fake API server has no {kind}")).0
}

fn kind_of(obj: &Value) -> &'static str {
    served(obj["kind"].as_str().expect("an object with a kind"))
}

async fn handle(
    (kind, api_version): (&'static str, &'static str),
    k: FakeKube,
    q: BTreeMap<String, String>,
) -> Response {
    let mut g = k.inner.lock().unwrap();
    g.selectors.push(q.get("labelSelector").cloned().unwrap_or_default());
    g.field_selectors.push(q.get("fieldSelector").cloned().unwrap_or_default());
    if q.get("watch").map(String::as_str) != Some("true") {
        g.lists += 1;
        let items: Vec<Value> = g.objects.get(kind).map(|o| o.values().cloned().collect()).unwrap_or_default();
        let body = json!({"apiVersion": api_version, "kind": format!("{kind}List"),
                          "metadata": {"resourceVersion": g.rv.to_string()}, "items": items});
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
    }
    g.watches += 1;
    let from: u64 = q.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    if from < g.expired_below {
        let status = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": format!("too old resource version: {from}"), "reason": "Expired", "code": 410}});
        let _ = tx.send(line(&status));
        drop(tx);
    } else {
        // Every watch starts with a bookmark at the current version.
        let _ = tx.send(line(&json!({"type": "BOOKMARK", "object": {"kind": kind,
            "apiVersion": api_version, "metadata": {"resourceVersion": g.rv.to_string()}}})));
        g.watchers.push((kind, tx));
    }
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    Response::builder().header("content-type", "application/json").body(Body::from_stream(stream)).unwrap()
}

impl FakeKube {
    /// Serve on a free loopback port (inside the current tokio runtime).
    pub async fn start() -> FakeKube {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let k = FakeKube {
            inner: Arc::new(Mutex::new(Inner { rv: 10, ..Inner::default() })),
            url: format!("http://{addr}"),
        };
        let mut app = axum::Router::new();
        for (kind, api_version, path) in KINDS {
            app = app.route(
                path,
                axum::routing::get(move |State(k): State<FakeKube>, Query(q): Query<BTreeMap<String, String>>| {
                    handle((kind, api_version), k, q)
                }),
            );
        }
        let app = app.with_state(k.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        k
    }

    /// An EndpointSlice `name` with port `shim` = `port` and `(address, ready, terminating)`.
    pub fn slice(name: &str, port: u16, endpoints: &[(&str, bool, bool)]) -> Value {
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": name, "namespace": "serving", "labels": {"kubernetes.io/service-name": "engines",
                   "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
               "addressType": "IPv4", "ports": [{"name": "shim", "port": port, "protocol": "TCP"}],
               "endpoints": endpoints.iter().map(|(a, r, t)| json!({"addresses": [a],
                   "conditions": {"ready": r, "serving": *r || *t, "terminating": t}})).collect::<Vec<_>>()})
    }

    /// Create or replace an object (of any kind served); its kind's watchers get ADDED or
    /// MODIFIED.
    pub fn apply(&self, mut obj: Value) {
        let mut g = self.inner.lock().unwrap();
        g.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        let (kind, name) = (kind_of(&obj), obj["metadata"]["name"].as_str().unwrap().to_string());
        let objects = g.objects.entry(kind).or_default();
        let event = if objects.contains_key(&name) { "MODIFIED" } else { "ADDED" };
        objects.insert(name, obj.clone());
        g.notify(kind, &json!({"type": event, "object": obj}));
    }

    /// Delete the object of `kind` named `name`; its kind's watchers get DELETED.
    pub fn delete(&self, kind: &str, name: &str) {
        let mut g = self.inner.lock().unwrap();
        g.rv += 1;
        let kind = served(kind);
        let mut obj = g.objects.entry(kind).or_default().remove(name).expect("deleting an object that exists");
        obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        g.notify(kind, &json!({"type": "DELETED", "object": obj}));
    }

    /// Change the stored slices without telling any watcher, then end every watch stream and
    /// expire every version seen so far: the client must list again to learn the change.
    pub fn expire_and_replace(&self, slices: Vec<Value>) {
        let mut g = self.inner.lock().unwrap();
        g.rv += 1;
        let slices = slices.into_iter().map(|s| (s["metadata"]["name"].as_str().unwrap().to_string(), s)).collect();
        g.objects.insert("EndpointSlice", slices);
        g.expired_below = g.rv;
        g.watchers.clear();
    }

    /// A Pod `name` in `serving` with `labels`, `ip`, `Ready` as given, and a deletion
    /// timestamp when `terminating`.
    pub fn pod(name: &str, labels: Value, ip: &str, ready: bool, terminating: bool) -> Value {
        let mut pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "serving", "labels": labels},
            "spec": {"containers": [{"name": "engine", "image": "switchyard-engine"}]},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}});
        if terminating {
            pod["metadata"]["deletionTimestamp"] = json!("2026-12-05T00:00:00Z");
        }
        pod
    }

    /// An InferencePool `name` in `serving` selecting `match_labels`, at `ports`.
    pub fn inference_pool(name: &str, match_labels: Value, ports: &[u16]) -> Value {
        json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": "serving"},
            "spec": {"selector": {"matchLabels": match_labels},
                "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
                "endpointPickerRef": {"kind": "Service", "name": "switchyard-epp", "port": {"number": 9002},
                    "failureMode": "FailClose"}}})
    }

    /// The `fieldSelector` of every list and watch so far.
    pub fn field_selectors(&self) -> Vec<String> {
        self.inner.lock().unwrap().field_selectors.clone()
    }

    /// The `labelSelector` of every list and watch so far (this fake does not filter by it).
    pub fn selectors(&self) -> Vec<String> {
        self.inner.lock().unwrap().selectors.clone()
    }

    /// A slice like [`FakeKube::slice`] that Kubernetes' EndpointSlice controller did not
    /// make: no `endpointslice.kubernetes.io/managed-by` label.
    pub fn forged_slice(name: &str, port: u16, endpoints: &[(&str, bool, bool)]) -> Value {
        let mut s = FakeKube::slice(name, port, endpoints);
        s["metadata"]["labels"].as_object_mut().unwrap().remove("endpointslice.kubernetes.io/managed-by");
        s
    }

    /// `(lists, watches)` served so far.
    pub fn calls(&self) -> (usize, usize) {
        let g = self.inner.lock().unwrap();
        (g.lists, g.watches)
    }
}
