//! `switchyard-shim` in front of a real engine process: readiness follows the engine and
//! its model list, `/metrics` and `/load` carry the normalized load, the API is proxied
//! without buffering while in-flight requests are counted, a dialect mismatch is reported,
//! and SIGTERM drains: not ready at once, the open stream finishes, exit 0. Only inference
//! routes reach the engine unless the caller holds the admin token. The bundled engine drains
//! on SIGTERM too, and a pod stopped with the chart's preStop timing finishes its stream.

use std::time::{Duration, Instant};

use serde_json::json;
use switchyard_testkit::*;

async fn status(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let r = send(addr, "GET", path, "").await;
    let s = r.status;
    (s, r.text().await)
}

/// Poll `path` until its body contains `needle`.
async fn wait_body(addr: std::net::SocketAddr, path: &str, needle: &str) -> String {
    let start = Instant::now();
    loop {
        let (_, body) = status(addr, path).await;
        if body.contains(needle) {
            return body;
        }
        assert!(start.elapsed() < PATIENCE, "{path} never said {needle:?}: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_status(addr: std::net::SocketAddr, path: &str, want: u16) -> String {
    let start = Instant::now();
    loop {
        let (s, body) = status(addr, path).await;
        if s == want {
            return body;
        }
        assert!(start.elapsed() < PATIENCE, "{path} stayed {s}: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_proxies_counts_normalizes_and_drains() {
    let engine = EngineProc::start(&["--backend", "sim", "--sim-profile", "h100-llama3-8b"]);
    let mut shim = ShimProc::start(&engine.url(), &["--scrape-interval-ms", "50", "--drain-timeout", "20s"]);
    wait_status(shim.addr, "/-/healthz", 200).await;

    let (s, metrics) = status(shim.addr, "/metrics").await;
    assert_eq!(s, 200);
    let waiting: Vec<&str> = metrics.lines().filter(|l| l.starts_with("vllm:num_requests_waiting")).collect();
    assert_eq!(waiting, vec!["vllm:num_requests_waiting{engine_dialect=\"vllm\"} 0"], "normalized once");
    assert!(metrics.contains("vllm:num_requests_running{engine_dialect=\"vllm\"}"));
    assert!(metrics.contains("vllm:prompt_tokens_total"), "the engine's own series pass through");
    assert!(metrics.contains("switchyard_shim_in_flight_requests 0"));
    assert!(parse_metrics(&metrics).len() > 5, "the whole body parses as Prometheus text");

    // A streamed completion through the shim: chunks arrive as the engine makes them.
    let body = json!({"prompt": "hello there", "max_tokens": 60, "ignore_eos": true, "stream": true});
    let mut r = post(shim.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200);
    let first = r.next_event().await.expect("a first chunk");
    assert!(first.contains("text_completion"));
    let load: serde_json::Value = serde_json::from_str(&status(shim.addr, "/load").await.1).unwrap();
    assert_eq!(load["in_flight"], 1, "{load}");
    assert_eq!(load["dialect"], "vllm");
    assert_eq!(load["ready"], true);
    let started = Instant::now();
    let rest = r.events().await;
    assert!(rest.len() >= 50, "{} more events", rest.len());
    // 60 tokens at ~7 ms each: the rest of the stream spans well over 100 ms, so the first
    // chunk was not held back until the end.
    assert!(rest[rest.len() - 1].0 - started > Duration::from_millis(100));
    let load: serde_json::Value = serde_json::from_str(&status(shim.addr, "/load").await.1).unwrap();
    assert_eq!(load["in_flight"], 0);
    let (_, metrics) = status(shim.addr, "/metrics").await;
    assert!(metrics.contains("switchyard_shim_ttft_seconds_count 1"), "one TTFT observed");

    // SIGTERM with a stream open: not ready at once, the stream still completes, exit 0.
    let body = json!({"prompt": "drain me", "max_tokens": 80, "ignore_eos": true, "stream": true});
    let mut r = post(shim.addr, "/v1/completions", &body).await;
    r.next_event().await.expect("first chunk");
    shim.terminate();
    let why = wait_status(shim.addr, "/-/healthz", 503).await;
    assert!(why.contains("draining"), "{why}");
    let rest = r.events().await;
    assert!(rest.iter().any(|(_, e)| e == "[DONE]"), "the open stream finished");
    let st = tokio::task::spawn_blocking(move || shim.wait_exit(Duration::from_secs(10))).await.unwrap();
    assert_eq!(st.map(|s| s.code()), Some(Some(0)), "exit 0 after the drain");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_needs_a_healthy_engine_the_right_dialect_and_the_model() {
    let mut engine = EngineProc::start(&["--backend", "sim", "--sim-profile", "instant"]);
    let wrong = ShimProc::start(&engine.url(), &["--scrape-interval-ms", "50", "--dialect", "sglang"]);
    wait_body(wrong.addr, "/-/healthz", "the engine's metrics are vllm, --dialect says sglang").await;
    assert_eq!(status(wrong.addr, "/-/healthz").await.0, 503);

    let other_model = ShimProc::start(&engine.url(), &["--scrape-interval-ms", "50", "--served-model-name", "nope"]);
    let shim = ShimProc::start(&engine.url(), &["--scrape-interval-ms", "50", "--dialect", "switchyard"]);
    wait_status(shim.addr, "/-/healthz", 200).await;
    wait_body(other_model.addr, "/-/healthz", "does not list model `nope`").await;
    assert_eq!(status(other_model.addr, "/-/healthz").await.0, 503);

    // The engine dies: not ready, /load says why, the API answers 502 in the OpenAI shape.
    engine.kill();
    let why = wait_status(shim.addr, "/-/healthz", 503).await;
    assert!(why.contains("not ready"), "{why}");
    let load: serde_json::Value = serde_json::from_str(&status(shim.addr, "/load").await.1).unwrap();
    assert!(load["error"].is_string() && load["waiting"].is_null(), "{load}");
    let r = post(shim.addr, "/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!(r.status, 502);
    assert!(r.json().await["error"]["message"].as_str().unwrap().contains("engine unreachable"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_reading_sidecars_stops_routing_to_a_draining_pod() {
    let (e1, e2) = (EngineProc::start(&["--backend", "sim"]), EngineProc::start(&["--backend", "sim"]));
    let s1 = ShimProc::start(&e1.url(), &["--scrape-interval-ms", "20", "--drain-timeout", "30"]);
    let s2 = ShimProc::start(&e2.url(), &["--scrape-interval-ms", "20"]);
    let urls = [format!("http://{}", s1.addr), format!("http://{}", s2.addr)];
    let g = GatewayProc::start(&GatewayConfigBuilder::new().backends(&urls).policy("least_load").scrape_source("load"));
    wait_scraped(&g, 2).await;
    for i in 0..6 {
        let r = post(g.addr, "/v1/completions", &json!({"prompt": format!("hi {i}"), "max_tokens": 4})).await;
        assert_eq!(r.status, 200);
    }
    // A long stream straight to the first pod, then SIGTERM: the sidecar says `draining` on
    // /load at once, and the gateway takes that pod out while its stream runs on.
    let body = json!({"prompt": "long", "max_tokens": 400, "ignore_eos": true, "stream": true});
    let mut open = post(s1.addr, "/v1/completions", &body).await;
    open.next_event().await.expect("first chunk");
    s1.terminate();
    let start = Instant::now();
    let pod =
        |b: &serde_json::Value| b["backends"].as_array().unwrap().iter().find(|x| x["url"] == urls[0]).unwrap().clone();
    loop {
        let b = pod(&backends(&g).await);
        if b["state"] == "down" {
            assert!(b["scrape_error"].as_str().unwrap_or("").contains("draining"), "{b}");
            break;
        }
        assert!(start.elapsed() < PATIENCE, "the draining pod stayed {b}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = pod(&backends(&g).await)["routed"].as_u64().unwrap();
    for i in 0..6 {
        let r = post(g.addr, "/v1/completions", &json!({"prompt": format!("after {i}"), "max_tokens": 4})).await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(pod(&backends(&g).await)["routed"].as_u64().unwrap(), before, "no new request reached the draining pod");
    let rest = open.events().await;
    assert!(rest.iter().any(|(_, e)| e == "[DONE]"), "the draining pod finished its stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_forwards_inference_routes_only_and_admin_routes_with_the_token() {
    let engine = FaultEngine::start(Fault::Healthy).await;
    let shim = ShimProc::start(
        &engine.url(),
        &["--scrape-interval-ms", "50", "--admin-token", "s3cret", "--allow-path", "/reset_prefix_cache"],
    );
    wait_status(shim.addr, "/-/healthz", 200).await;
    let reached = |what: &str| engine.seen.lines.lock().unwrap().iter().any(|l| l.contains(what));

    // vLLM's admin routes, and tricks a normalizing router could read as one, are refused
    // with 403 in the OpenAI shape and never reach the engine.
    for path in [
        "/collective_rpc",
        "/sleep",
        "/v1/load_lora_adapter",
        "/v1/models/../collective_rpc",
        "/v1/models/%2e%2e/collective_rpc",
        "/v1/chat/completions/..%2F..%2Fsleep",
    ] {
        let r = send(shim.addr, "POST", path, "{}").await;
        assert_eq!(r.status, 403, "{path}");
        let err = r.json().await;
        assert_eq!(err["error"]["type"], "permission_error", "{path}: {err}");
        let r = send_with(shim.addr, "POST", path, &[("x-switchyard-admin-token", "wrong")], "{}").await;
        assert_eq!(r.status, 403, "{path} with a wrong token");
    }
    assert!(!reached("collective_rpc") && !reached("sleep") && !reached("lora"), "{:?}", engine.seen.lines);
    let (_, metrics) = status(shim.addr, "/metrics").await;
    assert_eq!(metric(&parse_metrics(&metrics), "switchyard_shim_refused_requests_total"), 12.0);

    // Inference routes pass; so does what --allow-path adds.
    let r = post(shim.addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 2})).await;
    assert_eq!(r.status, 200);
    assert_eq!(send(shim.addr, "POST", "/reset_prefix_cache", "").await.status, 200, "the engine answered");
    assert!(reached("POST /v1/completions ") && reached("POST /reset_prefix_cache "));

    // The admin token opens the rest, and is not passed on.
    let r = send_with(shim.addr, "POST", "/collective_rpc", &[("x-switchyard-admin-token", "s3cret")], "{}").await;
    assert_eq!(r.status, 200, "the fault engine answers every POST");
    assert!(reached("POST /collective_rpc "));
    let last = engine.seen.requests.lock().unwrap().last().cloned().unwrap();
    assert!(!String::from_utf8_lossy(&last).to_ascii_lowercase().contains("x-switchyard-admin-token"));
}

/// The bundled engine on SIGTERM (#25): it accepts no new connection, finishes the stream in
/// flight and exits 0; past `--shutdown-timeout` it exits anyway, cutting what is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_finishes_its_streams_on_sigterm_within_its_shutdown_timeout() {
    let mut engine = EngineProc::start(&["--backend", "sim", "--sim-profile", "h100-llama3-8b"]);
    // ~7 ms a token: the stream runs on for about 2 s after the signal.
    let body = json!({"prompt": "finish me", "max_tokens": 300, "ignore_eos": true, "stream": true});
    let mut r = post(engine.addr, "/v1/completions", &body).await;
    r.next_event().await.expect("first chunk");
    engine.terminate();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(tokio::net::TcpStream::connect(engine.addr).await.is_err(), "no new connection after SIGTERM");
    let rest = r.events().await;
    assert!(rest.iter().any(|(_, e)| e == "[DONE]"), "the open stream finished ({} events)", rest.len());
    let st = tokio::task::spawn_blocking(move || engine.wait_exit(PATIENCE)).await.unwrap();
    assert_eq!(st.map(|s| s.code()), Some(Some(0)), "exit 0 once it finished");

    // A stream far longer than the shutdown timeout is cut when the timeout passes.
    let mut engine =
        EngineProc::start(&["--backend", "sim", "--sim-profile", "h100-llama3-8b", "--shutdown-timeout", "1"]);
    let body = json!({"prompt": "too long", "max_tokens": 4000, "ignore_eos": true, "stream": true});
    let mut r = post(engine.addr, "/v1/completions", &body).await;
    r.next_event().await.expect("first chunk");
    let signalled = Instant::now();
    engine.terminate();
    let st = tokio::task::spawn_blocking(move || engine.wait_exit(PATIENCE)).await.unwrap();
    let took = signalled.elapsed();
    assert!(st.is_some(), "the engine did not exit within {PATIENCE:?}");
    // 4,000 tokens would take ~28 s; the timeout is 1 s.
    assert!(took < Duration::from_secs(15), "exited {took:?} after SIGTERM");
    let mut done = false;
    while let Ok(Some(e)) = r.try_next_event().await {
        done |= e == "[DONE]";
    }
    assert!(!done, "a stream past the shutdown timeout was cut");
}

/// A pod told to stop while a stream is mid-generation (#25), with the chart's timing: the
/// kubelet runs each container's preStop, then sends it SIGTERM. The sidecar's preStop waits
/// for the endpoints to update, then it drains for `drainTimeoutSeconds`; the engine's preStop
/// is `drainTimeoutSeconds + 5`, so the engine — vLLM before 0.18 aborts what is in flight on
/// SIGTERM — is still serving while the sidecar drains. Scaled down: sidecar preStop 0.3 s,
/// drain 6 s, engine preStop 6.3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminating_pod_finishes_the_stream_in_flight() {
    let (pre_stop, drain) = (Duration::from_millis(300), Duration::from_secs(6));
    let mut engine = EngineProc::start(&["--backend", "sim", "--sim-profile", "h100-llama3-8b"]);
    let mut shim = ShimProc::start(&engine.url(), &["--scrape-interval-ms", "50", "--drain-timeout", "6s"]);
    wait_status(shim.addr, "/-/healthz", 200).await;
    let body = json!({"prompt": "mid-generation", "max_tokens": 300, "ignore_eos": true, "stream": true});
    let mut r = post(shim.addr, "/v1/completions", &body).await;
    r.next_event().await.expect("first chunk");

    let stopped = Instant::now();
    let kubelet = tokio::spawn(async move {
        // Both preStops start together; each container gets SIGTERM when its own ends.
        tokio::time::sleep(pre_stop).await;
        shim.terminate();
        tokio::time::sleep(drain).await;
        engine.terminate();
        let engine_exit = tokio::task::spawn_blocking(move || engine.wait_exit(PATIENCE)).await.unwrap();
        let shim_exit = tokio::task::spawn_blocking(move || shim.wait_exit(PATIENCE)).await.unwrap();
        (shim_exit, engine_exit)
    });
    let rest = r.events().await;
    assert!(rest.iter().any(|(_, e)| e == "[DONE]"), "the stream finished through the terminating pod");
    let finished = stopped.elapsed();
    let (shim_exit, engine_exit) = kubelet.await.unwrap();
    assert_eq!(shim_exit.map(|s| s.code()), Some(Some(0)), "the sidecar drained and exited 0");
    assert_eq!(engine_exit.map(|s| s.code()), Some(Some(0)), "the engine exited 0");
    eprintln!("stream finished {finished:?} after the pod was told to stop");
}
