//! A fake Kubernetes API server for EndpointSlices, spoken over real HTTP so the gateway's
//! `kube` client runs unmodified: list (with `resourceVersion`), watch streams (JSON lines,
//! bookmarks), and `410 Gone` on a watch from an expired version, which forces a relist.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::response::Response;
use serde_json::{json, Value};
use tokio::sync::mpsc;

#[derive(Default)]
struct Inner {
    rv: u64,
    slices: BTreeMap<String, Value>,
    watchers: Vec<mpsc::UnboundedSender<Bytes>>,
    lists: usize,
    watches: usize,
    /// Watches from a version at or below this get 410 Gone.
    expired_below: u64,
    /// The `labelSelector` of every list and watch, in order.
    selectors: Vec<String>,
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

async fn handle(State(k): State<FakeKube>, Query(q): Query<BTreeMap<String, String>>) -> Response {
    let mut g = k.inner.lock().unwrap();
    g.selectors.push(q.get("labelSelector").cloned().unwrap_or_default());
    if q.get("watch").map(String::as_str) != Some("true") {
        g.lists += 1;
        let items: Vec<Value> = g.slices.values().cloned().collect();
        let body = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
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
        let _ = tx.send(line(&json!({"type": "BOOKMARK", "object": {"kind": "EndpointSlice",
            "apiVersion": "discovery.k8s.io/v1", "metadata": {"resourceVersion": g.rv.to_string()}}})));
        g.watchers.push(tx);
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
        let app = axum::Router::new()
            .route("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", axum::routing::get(handle))
            .with_state(k.clone());
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

    /// Create or replace a slice; watchers get ADDED or MODIFIED.
    pub fn apply(&self, mut slice: Value) {
        let mut g = self.inner.lock().unwrap();
        g.rv += 1;
        slice["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        let name = slice["metadata"]["name"].as_str().unwrap().to_string();
        let kind = if g.slices.contains_key(&name) { "MODIFIED" } else { "ADDED" };
        g.slices.insert(name, slice.clone());
        let ev = line(&json!({"type": kind, "object": slice}));
        g.watchers.retain(|w| w.send(ev.clone()).is_ok());
    }

    /// Change the stored slices without telling any watcher, then end every watch stream and
    /// expire every version seen so far: the client must list again to learn the change.
    pub fn expire_and_replace(&self, slices: Vec<Value>) {
        let mut g = self.inner.lock().unwrap();
        g.rv += 1;
        g.slices = slices.into_iter().map(|s| (s["metadata"]["name"].as_str().unwrap().to_string(), s)).collect();
        g.expired_below = g.rv;
        g.watchers.clear();
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
