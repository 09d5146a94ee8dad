//! The gateway's Kubernetes discovery against a fake API server (real HTTP, the real `kube`
//! client): the first list routes to ready endpoints only; watch events add an endpoint that
//! becomes ready and take out one that starts terminating — while a stream it already serves
//! finishes; bookmarks are harmless; a watch that gets 410 Gone leads to a fresh list. An
//! InferencePool's selector and target ports over Pods drive the set the same way.

use std::time::{Duration, Instant};

use serde_json::json;
use switchyard_testkit::fake_kube::FakeKube;
use switchyard_testkit::*;

fn urls(b: &serde_json::Value) -> Vec<String> {
    let mut v: Vec<String> =
        b["backends"].as_array().unwrap().iter().map(|x| x["url"].as_str().unwrap().to_string()).collect();
    v.sort();
    v
}

async fn wait_backends(g: &GatewayProc, want: &[String]) {
    let start = Instant::now();
    let mut want = want.to_vec();
    want.sort();
    loop {
        let b = backends(g).await;
        if urls(&b) == want {
            return;
        }
        assert!(start.elapsed() < PATIENCE, "backends {:?}, want {want:?}\n{}", urls(&b), g.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpointslices_drive_the_backend_set() {
    let kube = FakeKube::start().await;
    let (e1, e2) = (EngineProc::start(&["--backend", "sim"]), EngineProc::start(&["--backend", "sim"]));
    let (p1, p2) = (e1.addr.port(), e2.addr.port());
    let (u1, u2) = (format!("http://127.0.0.1:{p1}"), format!("http://127.0.0.1:{p2}"));
    // Engine 1 ready, engine 2 not yet.
    kube.apply(FakeKube::slice("engines-a", p1, &[("127.0.0.1", true, false)]));
    kube.apply(FakeKube::slice("engines-b", p2, &[("127.0.0.1", false, false)]));
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new().kubernetes("serving", "engines", "shim", &kube.url).policy("least_load"),
    );
    wait_backends(&g, std::slice::from_ref(&u1)).await;
    wait_scraped(&g, 1).await;
    // A long stream, on engine 1 (the only one).
    let body = json!({"prompt": "long", "max_tokens": 300, "ignore_eos": true, "stream": true});
    let mut open = post(g.addr, "/v1/completions", &body).await;
    assert_eq!(open.status, 200);
    open.next_event().await.expect("first chunk");

    // Engine 2 becomes ready: both take requests.
    kube.apply(FakeKube::slice("engines-b", p2, &[("127.0.0.1", true, false)]));
    wait_backends(&g, &[u1.clone(), u2.clone()]).await;
    wait_scraped(&g, 2).await;

    // Engine 1 starts terminating: no new requests, its open stream finishes.
    kube.apply(FakeKube::slice("engines-a", p1, &[("127.0.0.1", false, true)]));
    wait_backends(&g, std::slice::from_ref(&u2)).await;
    for i in 0..4 {
        let r = post(g.addr, "/v1/completions", &json!({"prompt": format!("q{i}"), "max_tokens": 2})).await;
        assert_eq!(r.status, 200);
    }
    let b = backends(&g).await;
    assert_eq!(b["backends"][0]["routed"], 4, "all new requests went to engine 2: {b}");
    let rest = open.events().await;
    assert!(rest.iter().any(|(_, e)| e == "[DONE]"), "the terminating engine finished its stream");

    // The server expires every version and changes state behind the watch: engine 1 is back,
    // engine 2 gone. Only a relist can show that.
    let (lists_before, _) = kube.calls();
    kube.expire_and_replace(vec![FakeKube::slice("engines-a", p1, &[("127.0.0.1", true, false)])]);
    wait_backends(&g, std::slice::from_ref(&u1)).await;
    let (lists, watches) = kube.calls();
    assert!(lists > lists_before, "410 Gone led to a fresh list ({lists_before} → {lists})");
    assert!(watches >= 3, "watched again after each stream ended ({watches})");
    wait_scraped(&g, 1).await;
    let r = post(g.addr, "/v1/completions", &json!({"prompt": "after", "max_tokens": 2})).await;
    assert_eq!(r.status, 200);

    // A slice with the Service's name that the EndpointSlice controller did not make is not
    // routed to (#24): the gateway asks for the controller's slices and checks the label.
    let sink = free_port();
    kube.apply(FakeKube::forged_slice("engines-forged", sink, &[("127.0.0.1", true, false)]));
    // A real change after it: once it shows, the forged one was seen (and left out).
    kube.apply(FakeKube::slice("engines-b", p2, &[("127.0.0.1", true, false)]));
    wait_backends(&g, &[u1.clone(), u2.clone()]).await;
    let managed = "endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io";
    assert!(
        kube.selectors().iter().all(|s| s == &format!("kubernetes.io/service-name=engines,{managed}")),
        "{:?}",
        kube.selectors()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inference_pool_drives_the_backend_set() {
    let kube = FakeKube::start().await;
    let (e1, e2) = (EngineProc::start(&["--backend", "sim"]), EngineProc::start(&["--backend", "sim"]));
    let (p1, p2) = (e1.addr.port(), e2.addr.port());
    let at = |ip: &str, ports: &[u16]| ports.iter().map(|p| format!("http://{ip}:{p}")).collect::<Vec<_>>();
    let engine = json!({"app": "engine"});
    // Pod a serves; b is not ready yet; c is not the pool's (other labels).
    kube.apply(FakeKube::pod("a", engine.clone(), "127.0.0.1", true, false));
    kube.apply(FakeKube::pod("b", engine.clone(), "127.0.0.2", false, false));
    kube.apply(FakeKube::pod("c", json!({"app": "other"}), "127.0.0.3", true, false));
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new().inference_pool("serving", "engines", &kube.url).policy("least_load"),
    );
    // No pool yet: no backends.
    eventually("the pool is watched", async || kube.field_selectors().contains(&"metadata.name=engines".into())).await;
    assert!(urls(&backends(&g).await).is_empty());

    // The pool appears with two target ports: pod a at both, each port one engine.
    kube.apply(FakeKube::inference_pool("engines", engine.clone(), &[p1, p2]));
    wait_backends(&g, &at("127.0.0.1", &[p1, p2])).await;
    wait_scraped(&g, 2).await;
    for i in 0..4 {
        let r = post(g.addr, "/v1/completions", &json!({"prompt": format!("q{i}"), "max_tokens": 2})).await;
        assert_eq!(r.status, 200);
    }
    // Another pool in the namespace changes nothing.
    kube.apply(FakeKube::inference_pool("elsewhere", json!({"app": "other"}), &[p1]));
    // Pod b becomes ready; then pod a starts terminating.
    kube.apply(FakeKube::pod("b", engine.clone(), "127.0.0.2", true, false));
    wait_backends(&g, &[at("127.0.0.1", &[p1, p2]), at("127.0.0.2", &[p1, p2])].concat()).await;
    kube.apply(FakeKube::pod("a", engine.clone(), "127.0.0.1", true, true));
    wait_backends(&g, &at("127.0.0.2", &[p1, p2])).await;
    // The pool changes: one port, then another selector (a new Pod watch).
    kube.apply(FakeKube::inference_pool("engines", engine.clone(), &[p2]));
    wait_backends(&g, &at("127.0.0.2", &[p2])).await;
    kube.apply(FakeKube::inference_pool("engines", json!({"app": "other"}), &[p2]));
    wait_backends(&g, &at("127.0.0.3", &[p2])).await;
    let selectors: Vec<String> = kube.selectors().into_iter().filter(|s| s.starts_with("app=")).collect();
    assert!(selectors.contains(&"app=engine".into()) && selectors.contains(&"app=other".into()), "{selectors:?}");
    // The pool is deleted: no backends; created again: back.
    kube.delete("InferencePool", "engines");
    wait_backends(&g, &[]).await;
    kube.apply(FakeKube::inference_pool("engines", engine, &[p1]));
    wait_backends(&g, &at("127.0.0.2", &[p1])).await;
    assert!(g.log().lines().all(|l| !l.contains("panicked")), "{}", g.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_name_resolves_to_the_engines() {
    let e = EngineProc::start(&["--backend", "sim", "--sim-profile", "instant"]);
    let port = e.addr.port();
    let g = GatewayProc::start(&GatewayConfigBuilder::new().dns("localhost", port, 200));
    // `localhost` resolves to 127.0.0.1 (and ::1 where the hosts file says so).
    let start = Instant::now();
    loop {
        let b = backends(&g).await;
        if urls(&b).contains(&format!("http://127.0.0.1:{port}")) {
            break;
        }
        assert!(start.elapsed() < PATIENCE, "no backend from DNS: {b}\n{}", g.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_scraped(&g, 1).await;
    let r = post(g.addr, "/v1/completions", &json!({"prompt": "dns", "max_tokens": 2})).await;
    assert_eq!(r.status, 200);
}
