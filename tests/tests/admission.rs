//! The admission queue: with no engine up, a request waits (counted in
//! `switchyard_queue_depth`) and goes through once an engine comes up; past `max_wait_ms` it
//! gets 503 with `Retry-After`; past `max_queue` it gets 503 at once. With
//! `readiness.require_backend: false` (scale from zero) the gateway is ready with no engine,
//! so its Service keeps sending it the requests that wake the engines.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use switchyard_testkit::*;

/// A gateway in front of one engine that is not running (scaled to zero), once its scrapes
/// have marked it down; ready without an engine, as the chart runs it under KEDA.
async fn gateway(port: u16, max_queue: usize, max_wait_ms: u64) -> GatewayProc {
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backend_serving(&format!("http://127.0.0.1:{port}"), &["m"])
            .scrape_timeout_ms(300)
            .section("admission", &format!("{{ max_queue: {max_queue}, max_wait_ms: {max_wait_ms} }}"))
            .section("readiness", "{ require_backend: false }"),
    );
    eventually("the absent engine is marked down", async || backends(&g).await["backends"][0]["state"] == "down").await;
    g
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_an_engine_to_come_up() {
    let port = free_port();
    let g = gateway(port, 10, 20_000).await;
    // Ready with no engine: the Service keeps this gateway, so the request below reaches it.
    let ready = send(g.addr, "GET", "/-/ready", "").await;
    assert_eq!(ready.status, 200, "a scale-from-zero gateway is ready without engines");
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 3});
    let addr = g.addr;
    let waiting = tokio::spawn(async move {
        let t = Instant::now();
        let r = post(addr, "/v1/completions", &body).await;
        (r.status, t.elapsed())
    });
    // Held: the queue gauge shows it.
    eventually("the request is queued", async || metric(&scrape(g.admin).await, "switchyard_queue_depth") == 1.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The engine starts (scaling up); the held request goes through.
    let mut engine = Command::new(workspace_bin("switchyard-engine"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--backend", "sim", "--sim-profile", "instant"])
        .args(["--served-model-name", "m"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (status, waited) = waiting.await.unwrap();
    let _ = engine.kill();
    let _ = engine.wait();
    assert_eq!(status, 200);
    assert!(waited >= Duration::from_millis(300), "it waited for the engine ({waited:?})");
    let m = scrape(g.admin).await;
    assert_eq!(metric(&m, "switchyard_queue_depth"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_deadline_or_the_bound_it_is_503_with_retry_after() {
    // A 3 s wait, so that "at once" (under 1.5 s) and "after the wait" stay apart on a loaded
    // machine.
    let port = free_port();
    let g = gateway(port, 1, 3000).await;
    let body = json!({"model": "m", "prompt": "x", "max_tokens": 1});
    let addr = g.addr;
    let b = body.clone();
    let first = tokio::spawn(async move {
        let t = Instant::now();
        let r = post(addr, "/v1/completions", &b).await;
        (r.status, r.headers.get("retry-after").cloned(), t.elapsed(), r.json().await)
    });
    eventually("the first request is queued", async || metric(&scrape(g.admin).await, "switchyard_queue_depth") == 1.0)
        .await;
    // The queue holds one: a second request is refused at once.
    let t = Instant::now();
    let r = post(g.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 503);
    assert!(t.elapsed() < Duration::from_millis(1500), "refused at once, not after the wait ({:?})", t.elapsed());
    let (status, retry_after, waited, v) = first.await.unwrap();
    assert_eq!(status, 503, "{v}");
    assert!(retry_after.is_some(), "Retry-After on a 503");
    assert!(waited >= Duration::from_millis(2950), "it waited max_wait_ms first ({waited:?})");
    assert!(v["error"]["message"].as_str().unwrap().contains("no backend available"), "{v}");
    assert_eq!(metric(&scrape(g.admin).await, "switchyard_queue_depth"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_wait_while_every_engine_is_saturated() {
    // One engine that runs one request at a time: concurrent requests queue inside it.
    let e = EngineProc::start(&["--backend", "sim", "--max-num-seqs", "1", "--served-model-name", "m"]);
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backends([e.url()])
            .scrape_interval_ms(20)
            .scrape_timeout_ms(300)
            .section("admission", "{ max_queue: 10, max_wait_ms: 20000, saturated_waiting: 2 }"),
    );
    wait_scraped(&g, 1).await;
    // Four long requests (~1.4 s each): one runs, the others wait in the engine (waiting = 3 ≥ 2).
    let long = json!({"model": "m", "prompt": "long", "max_tokens": 200, "ignore_eos": true});
    let mut held = Vec::new();
    for _ in 0..4 {
        let (addr, b) = (g.addr, long.clone());
        held.push(tokio::spawn(async move { post(addr, "/v1/completions", &b).await.status }));
    }
    eventually("the engine queues", async || {
        backends(&g).await["backends"][0]["signal"]["waiting"].as_f64().unwrap_or(0.0) >= 2.0
    })
    .await;
    // The next request is held at the gateway until the engine's queue drains below 2.
    let (addr, b) = (g.addr, json!({"model": "m", "prompt": "short", "max_tokens": 2}));
    let queued = tokio::spawn(async move { post(addr, "/v1/completions", &b).await.status });
    let mut seen_queued = false;
    let start = Instant::now();
    while !queued.is_finished() && start.elapsed() < PATIENCE {
        seen_queued |= metric(&scrape(g.admin).await, "switchyard_queue_depth") >= 1.0;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(seen_queued, "the request waited in the gateway's admission queue");
    assert_eq!(queued.await.unwrap(), 200);
    for h in held {
        assert_eq!(h.await.unwrap(), 200);
    }
    assert_eq!(metric(&scrape(g.admin).await, "switchyard_queue_depth"), 0.0);
}

/// A client that leaves while its request waits gives its place up at once: abandoned
/// requests neither hold the queue nor inflate `switchyard_queue_depth`, which autoscaling
/// reads (#24). The wait allowed (60 s) is far past the test's patience, so the gauge can only
/// fall because the request left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_the_queue_gives_its_place_up_at_once() {
    let port = free_port();
    let g = gateway(port, 10, 60_000).await;
    let addr = g.addr;
    let waiting = tokio::spawn(async move {
        post(addr, "/v1/completions", &json!({"model": "m", "prompt": "hello", "max_tokens": 3})).await
    });
    eventually("the request is queued", async || metric(&scrape(g.admin).await, "switchyard_queue_depth") == 1.0).await;
    // The client goes away (its connection is dropped with the task).
    waiting.abort();
    let _ = waiting.await;
    eventually("the abandoned request leaves the queue", async || {
        metric(&scrape(g.admin).await, "switchyard_queue_depth") == 0.0
    })
    .await;
}
