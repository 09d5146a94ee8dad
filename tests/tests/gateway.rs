//! The gateway against real `switchyard-engine --backend sim` processes on loopback.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use switchyard_testkit::*;

const MODEL: &str = "meta-llama/Meta-Llama-3-8B-Instruct";

/// A gateway over `engines` with `policy`, once it has scraped them all.
async fn start_gateway(engines: &[&EngineProc], policy: &str) -> GatewayProc {
    let g = GatewayProc::start(&config(engines, policy));
    wait_scraped(&g, engines.len()).await;
    g
}

/// `n` short completions through the gateway, one after another; each must succeed.
async fn send_short_requests(g: &GatewayProc, n: u64) {
    for i in 0..n {
        let r =
            post(g.addr, "/v1/completions", &json!({"model": MODEL, "prompt": "hi", "max_tokens": 3, "seed": i})).await;
        assert_eq!(r.status, 200);
        r.text().await;
    }
}

fn config(engines: &[&EngineProc], policy: &str) -> GatewayConfigBuilder {
    GatewayConfigBuilder::new().backends(engines.iter().map(|e| e.url())).policy(policy)
}

fn routed(b: &serde_json::Value, url: &str) -> u64 {
    b["backends"].as_array().unwrap().iter().find(|x| x["url"] == url).unwrap()["routed"].as_u64().unwrap()
}

fn content_times(events: &[(Instant, String)]) -> Vec<Instant> {
    events
        .iter()
        .filter(|(_, e)| {
            let v: serde_json::Value = serde_json::from_str(e).unwrap_or_default();
            v["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty())
        })
        .map(|(t, _)| *t)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_through_the_gateway_adds_only_milliseconds_per_chunk() {
    // 70B on 4 simulated H100s: a decode step of ~20 ms, so a bound of half a step leaves a
    // loaded machine room and still catches a gateway that holds chunks back.
    let engine = EngineProc::start(&["--sim-profile", "h100x4-llama3-70b", "--served-model-name", MODEL]);
    let g = start_gateway(&[&engine], "least_load").await;
    let body = |seed: u64, n: u32| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
               "max_tokens": n, "ignore_eos": true, "stream": true, "seed": seed})
    };
    // A direct stream and a gateway stream in the same engine batch: every engine step
    // emits a chunk on both at the same instant. The gateway's added latency per chunk is
    // how long after the matching direct chunk it arrives.
    let (direct, via) =
        tokio::join!(async { post(engine.addr, "/v1/chat/completions", &body(1, 60)).await.events().await }, async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            post(g.addr, "/v1/chat/completions", &body(2, 40)).await.events().await
        },);
    assert_eq!(via.last().unwrap().1, "[DONE]");
    let (d, v) = (content_times(&direct), content_times(&via));
    assert_eq!(v.len(), 40, "one chunk per token through the gateway");
    let mut added: Vec<f64> = v
        .iter()
        .map(|t| {
            let emitted = d.iter().filter(|x| *x <= t).max().expect("a direct chunk from the same step");
            (*t - *emitted).as_secs_f64() * 1e3
        })
        .collect();
    added.sort_by(f64::total_cmp);
    let median = added[added.len() / 2];
    eprintln!("median added latency {median:.2} ms per chunk");
    assert!(median < 10.0, "median added latency {median:.2} ms per chunk: {added:?}");
    let spread = (v[39] - v[0]).as_secs_f64();
    assert!(spread > 0.2, "chunks arrive over the whole generation, not at the end: {spread:.3}s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_load_avoids_a_saturated_engine_and_round_robin_does_not() {
    let engines: Vec<EngineProc> = (0..3).map(|_| EngineProc::start(&["--sim-profile", "h100-llama3-8b"])).collect();
    let g = start_gateway(&engines.iter().collect::<Vec<_>>(), "least_load").await;
    let (a, b, c) = (engines[0].url(), engines[1].url(), engines[2].url());

    // Saturate A with direct traffic: 48 long streams it keeps running.
    let mut hogs = Vec::new();
    for i in 0..48 {
        let body = json!({"model": MODEL, "prompt": prompt_of(200, "h"), "max_tokens": 4000, "ignore_eos": true,
                          "stream": true, "seed": i});
        let mut r = post(engines[0].addr, "/v1/completions", &body).await;
        r.next_event().await.expect("hog started");
        hogs.push(r);
    }
    // Wait until the gateway has scraped A's load.
    eventually("A's load shows in the gateway's view", async || {
        backends(&g).await["backends"][0]["signal"]["running"].as_f64().unwrap_or(0.0) >= 48.0
    })
    .await;
    let before = backends(&g).await;
    send_short_requests(&g, 30).await;
    let after = backends(&g).await;
    let to_a = routed(&after, &a) - routed(&before, &a);
    let to_bc = routed(&after, &b) + routed(&after, &c) - routed(&before, &b) - routed(&before, &c);
    assert_eq!(to_a + to_bc, 30);
    assert!(to_bc >= 27, "least_load sent {to_a} of 30 to the saturated engine");

    // Same cluster, round_robin: an even spread, load or not.
    g.rewrite(&config(&engines.iter().collect::<Vec<_>>(), "round_robin"));
    eventually("policy reloaded", async || backends(&g).await["policy"] == "round_robin").await;
    let before = backends(&g).await;
    send_short_requests(&g, 30).await;
    let after = backends(&g).await;
    for url in [&a, &b, &c] {
        assert_eq!(routed(&after, url) - routed(&before, url), 10, "round_robin spread for {url}");
    }
    drop(hogs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mebibyte_prompt_reaches_the_engine_intact() {
    let engine = EngineProc::start(&["--sim-profile", "instant", "--max-model-len", "400000"]);
    let g = start_gateway(&[&engine], "least_load").await;
    let prompt = prompt_of(1024 * 1024 / 5, "q"); // 1 MiB: 5 bytes per token
    assert!(prompt.len() >= 1024 * 1024 - 5);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    let direct = post(engine.addr, "/v1/completions", &body).await.json().await;
    let via = post(g.addr, "/v1/completions", &body).await.json().await;
    assert_eq!(direct["usage"]["prompt_tokens"], 1024 * 1024 / 5, "{direct}");
    assert_eq!(via["usage"]["prompt_tokens"], direct["usage"]["prompt_tokens"], "{via}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_fails_no_request_started_after_the_kill() {
    let mut engines: Vec<EngineProc> =
        (0..3).map(|_| EngineProc::start(&["--sim-profile", "h100-llama3-8b"])).collect();
    let g = Arc::new(start_gateway(&engines.iter().collect::<Vec<_>>(), "least_load").await);
    let victim = engines[1].url();
    let kill_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let failures_after = Arc::new(AtomicUsize::new(0));
    let done_after = Arc::new(AtomicUsize::new(0));
    // Traffic for 3 s, and on until 60 requests started after the kill, however slow the machine.
    let begun = Instant::now();
    let mut clients = Vec::new();
    for w in 0..8 {
        let (g, kill_at, failures_after, done_after) =
            (g.clone(), kill_at.clone(), failures_after.clone(), done_after.clone());
        clients.push(tokio::spawn(async move {
            let mut i = 0;
            while (begun.elapsed() < Duration::from_secs(3) || done_after.load(Ordering::Relaxed) < 60)
                && begun.elapsed() < PATIENCE
            {
                let started = Instant::now();
                let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 8, "ignore_eos": true,
                                  "stream": true, "seed": w * 1000 + i});
                let r = post(g.addr, "/v1/completions", &body).await;
                let status = r.status;
                let events = r.events().await;
                let ok = status == 200
                    && events.last().is_some_and(|e| e.1 == "[DONE]")
                    && !events.iter().any(|e| e.1.contains("\"error\""));
                let killed = *kill_at.lock().unwrap();
                if killed.is_some_and(|k| started > k) {
                    done_after.fetch_add(1, Ordering::Relaxed);
                    if !ok {
                        failures_after.fetch_add(1, Ordering::Relaxed);
                        eprintln!("request after the kill failed: {status} {events:?}");
                    }
                }
                i += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    engines[1].kill();
    *kill_at.lock().unwrap() = Some(Instant::now());
    for c in clients {
        c.await.unwrap();
    }
    assert!(done_after.load(Ordering::Relaxed) > 50, "enough traffic after the kill");
    assert_eq!(failures_after.load(Ordering::Relaxed), 0, "{}", g.log());
    let b = backends(&g).await;
    let killed = b["backends"].as_array().unwrap().iter().find(|x| x["url"] == victim.as_str()).unwrap().clone();
    assert_ne!(killed["state"], "up", "{killed}");
    assert!(killed["scrape_error"].is_string() || killed["last_ejection_reason"].is_string(), "{killed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_through_the_gateway_frees_the_engine_request() {
    let engine = EngineProc::start(&["--sim-profile", "a100-llama3-8b", "--max-num-batched-tokens", "512"]);
    let g = start_gateway(&[&engine], "least_load").await;
    // After the first token.
    let mut r = post(
        g.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": 3000, "ignore_eos": true, "stream": true}),
    )
    .await;
    r.next_event().await.expect("first chunk");
    assert_eq!(metric(&scrape(engine.addr).await, "vllm:num_requests_running"), 1.0);
    r.disconnect();
    // Freed long before the 3,000 tokens (~25 s) would have been generated.
    wait_for_metrics(engine.addr, Duration::from_secs(5), "freed after a disconnect after the first chunk", |s| {
        metric(s, "vllm:num_requests_running") == 0.0 && metric(s, "vllm:kv_cache_usage_perc") == 0.0
    })
    .await;
    // During the prefill of a long prompt (~1 s of prefill on the A100 profile).
    let r = post(
        g.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt_of(8000, "p"), "max_tokens": 5, "stream": true}),
    )
    .await;
    wait_for_metrics(engine.addr, PATIENCE, "the long prompt is prefilling", |s| {
        metric(s, "vllm:num_requests_running") == 1.0
    })
    .await;
    let generated = metric(&scrape(engine.addr).await, "vllm:generation_tokens_total");
    r.disconnect();
    wait_for_metrics(engine.addr, Duration::from_secs(5), "freed after a disconnect during prefill", |s| {
        metric(s, "vllm:num_requests_running") == 0.0 && metric(s, "vllm:kv_cache_usage_perc") == 0.0
    })
    .await;
    assert_eq!(
        metric(&scrape(engine.addr).await, "vllm:generation_tokens_total"),
        generated,
        "no token after the abort"
    );
}

/// Regression: before any engine was scraped (starting up, or none reachable since), a
/// request for a model was answered 404 `model_not_found` — no engine had said which models
/// it serves yet, so none could be known. It is a 503 with `Retry-After` now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_any_engine_told_its_models_a_request_is_503_not_404() {
    let nobody = format!("http://127.0.0.1:{}", free_port());
    let g = GatewayProc::start(&GatewayConfigBuilder::new().backends([nobody.as_str()]));
    let r =
        send(g.addr, "POST", "/v1/completions", json!({"model": MODEL, "prompt": "a"}).to_string().into_bytes()).await;
    let status = r.status;
    let v = r.json().await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["type"], "service_unavailable", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_never_a_5xx() {
    let engine = EngineProc::start(&["--sim-profile", "instant"]);
    let g = GatewayProc::start(&config(&[&engine], "least_load").section("limits", "{ max_body_bytes: 4096 }"));
    wait_scraped(&g, 1).await;
    let big = json!({"model": MODEL, "prompt": "x".repeat(5000)}).to_string();
    let cases: Vec<(&str, &str, Vec<u8>, u16)> = vec![
        ("body over the limit", "/v1/completions", big.into_bytes(), 413),
        ("malformed JSON", "/v1/completions", b"{\"model\": ".to_vec(), 400),
        ("not an object", "/v1/chat/completions", b"[]".to_vec(), 400),
        ("model not a string", "/v1/completions", b"{\"model\": 7, \"prompt\": \"a\"}".to_vec(), 400),
        ("unknown model", "/v1/completions", b"{\"model\": \"gpt-9\", \"prompt\": \"a\"}".to_vec(), 404),
        ("invalid UTF-8", "/v1/completions", b"{\"model\": \"\xff\"}".to_vec(), 400),
        (
            "engine-side validation",
            "/v1/completions",
            format!("{{\"model\": \"{MODEL}\", \"prompt\": \"\"}}").into_bytes(),
            400,
        ),
        ("unknown route", "/v2/everything", b"{}".to_vec(), 404),
    ];
    for (what, path, body, status) in cases {
        let r = send(g.addr, "POST", path, body).await;
        let got = r.status;
        let v = r.json().await;
        assert_eq!(got, status, "{what}: {v}");
        assert!(v["error"]["message"].is_string() && v["error"]["type"].is_string(), "{what}: not OpenAI-shaped: {v}");
    }
    // Huge numbers, wrong types and a 10,000-message chat: a 4xx from the gateway or the
    // engine, never a 5xx.
    let many: Vec<_> =
        (0..10_000).map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "hi"})).collect();
    let odd = vec![
        json!({"model": MODEL, "prompt": "a", "max_tokens": 1e300}),
        json!({"model": MODEL, "prompt": "a", "max_tokens": -5}),
        json!({"model": MODEL, "prompt": "a", "max_tokens": "ten"}),
        json!({"model": MODEL, "prompt": "a", "temperature": 1e308, "max_tokens": 2}),
        json!({"model": MODEL, "prompt": "a", "n": 18446744073709551615u64}),
        json!({"model": MODEL, "messages": "not a list"}),
        json!({"model": MODEL, "messages": many, "max_tokens": 2}),
    ];
    for body in odd {
        let r = post(g.addr, "/v1/chat/completions", &body).await;
        assert!((200..500).contains(&r.status), "{} for {:.200}", r.status, body.to_string());
        r.text().await;
    }
    let huge_literal = format!("{{\"model\": \"{MODEL}\", \"prompt\": \"a\", \"max_tokens\": 1{}}}", "0".repeat(400));
    let r = send(g.addr, "POST", "/v1/completions", huge_literal).await;
    assert!((400..500).contains(&r.status), "{}", r.status);
    r.text().await;
    // A seeded corpus of mutated bodies: never a 5xx, never a dead gateway.
    let valid = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let mut x: u64 = 0x9E3779B97F4A7C15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..300 {
        let mut b = valid.clone().into_bytes();
        for _ in 0..(next() % 4 + 1) {
            let i = (next() % b.len() as u64) as usize;
            match next() % 3 {
                0 => b[i] = (next() % 256) as u8,
                1 => {
                    b.remove(i);
                }
                _ => b.insert(i, b"{}[]\",:0\\"[(next() % 9) as usize]),
            }
        }
        let r = send(g.addr, "POST", "/v1/chat/completions", b.clone()).await;
        assert!(r.status < 500, "{} for {:?}", r.status, String::from_utf8_lossy(&b));
        r.text().await;
    }
    let ok = post(g.addr, "/v1/completions", &json!({"model": MODEL, "prompt": "a", "max_tokens": 2})).await;
    assert_eq!(ok.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_rewrite_under_load_adds_a_backend_without_failures() {
    let e1 = EngineProc::start(&["--sim-profile", "h100-llama3-8b"]);
    let e2 = EngineProc::start(&["--sim-profile", "h100-llama3-8b"]);
    let e3 = EngineProc::start(&["--sim-profile", "h100-llama3-8b"]);
    let g = Arc::new(start_gateway(&[&e1, &e2], "least_load").await);
    let failures = Arc::new(AtomicUsize::new(0));
    let total = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for w in 0..6 {
        let (g, failures, total, stop) = (g.clone(), failures.clone(), total.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let body =
                    json!({"model": MODEL, "prompt": "hi", "max_tokens": 6, "ignore_eos": true, "seed": w * 1000 + i});
                let r = post(g.addr, "/v1/completions", &body).await;
                if r.status != 200 {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                r.text().await;
                total.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    g.rewrite(&config(&[&e1, &e2, &e3], "least_load"));
    let took = eventually("the new backend takes traffic", async || {
        let b = backends(&g).await;
        b["backends"].as_array().unwrap().len() == 3 && routed(&b, &e3.url()) > 0
    })
    .await;
    eprintln!("new backend took traffic {took:?} after the rewrite");
    // An invalid file keeps the config in force and is counted.
    g.rewrite_config("listen: [not, an, address]\n");
    eventually("the invalid file is rejected", async || reloads(&scrape(g.admin).await, "error") == 1.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert!(total.load(Ordering::Relaxed) > 30);
    assert_eq!(failures.load(Ordering::Relaxed), 0, "{}", g.log());
    let m = scrape(g.admin).await;
    assert_eq!(reloads(&m, "ok"), 1.0);
    assert_eq!(reloads(&m, "error"), 1.0);
    assert_eq!(backends(&g).await["backends"].as_array().unwrap().len(), 3, "the invalid file changed nothing");
    assert!(g.log().contains("config reload rejected"));
}

/// `switchyard_config_reloads_total{result}`.
fn reloads(m: &Scrape, result: &str) -> f64 {
    m.iter()
        .filter(|s| {
            s.name == "switchyard_config_reloads_total" && s.labels.get("result").map(String::as_str) == Some(result)
        })
        .map(|s| match s.value {
            SeriesValue::Scalar(v) => v,
            _ => 0.0,
        })
        .sum::<f64>()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_models_and_metrics_endpoints() {
    let engine = EngineProc::start(&["--sim-profile", "instant"]);
    let g = start_gateway(&[&engine], "least_load").await;
    assert_eq!(send(g.addr, "GET", "/-/healthz", bytes::Bytes::new()).await.status, 200);
    assert_eq!(send(g.addr, "GET", "/-/ready", bytes::Bytes::new()).await.status, 200);
    let models = send(g.addr, "GET", "/v1/models", bytes::Bytes::new()).await.json().await;
    assert_eq!(models["data"][0]["id"], MODEL);
    let r = post(
        g.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "stream": true}),
    )
    .await;
    r.events().await;
    let m = scrape(g.admin).await;
    for name in [
        "switchyard_requests_total",
        "switchyard_request_duration_seconds",
        "switchyard_ttft_seconds",
        "switchyard_backend_inflight",
        "switchyard_backend_waiting",
        "switchyard_backend_kv_usage",
        "switchyard_routing_decisions_total",
        "switchyard_retries_total",
        "switchyard_config_reloads_total",
    ] {
        assert!(m.iter().any(|s| s.name == name), "missing {name}");
    }
    // The access log is buffered and written out every second.
    eventually("an access log line for the chat", async || {
        g.log().lines().any(|l| l.contains("\"path\":\"/v1/chat/completions\"") && l.contains("\"ttft_ms\""))
    })
    .await;
    // The gateway's own answers are logged with the status they had.
    let logged = |path: &str, status: u16| {
        let (path, status) = (format!("\"path\":\"{path}\""), format!("\"status\":{status},"));
        g.log().lines().any(|l| l.contains(&path) && l.contains(&status))
    };
    for path in ["/-/healthz", "/-/ready", "/v1/models"] {
        assert!(logged(path, 200), "{path} logged with status 200:\n{}", g.log());
    }
    drop(engine);
    // With the only engine gone, readiness fails once the scraper notices.
    eventually("readiness fails", async || send(g.addr, "GET", "/-/ready", bytes::Bytes::new()).await.status == 503)
        .await;
    eventually("the refused readiness probe in the access log", async || logged("/-/ready", 503)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_cleartext_clients_stream_through_the_gateway() {
    use http_body_util::{BodyExt, Full};
    let engine = EngineProc::start(&["--sim-profile", "h100-llama3-8b"]);
    let g = start_gateway(&[&engine], "least_load").await;
    let (mut sender, _conn) = h2c_connect(g.addr).await;
    // Two concurrent streams on one connection.
    let mut streams = Vec::new();
    for seed in 0..2 {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                          "ignore_eos": true, "stream": true, "seed": seed});
        let req = hyper::Request::post(format!("http://{}/v1/chat/completions", g.addr))
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(body.to_string())))
            .unwrap();
        streams.push(sender.send_request(req));
    }
    for s in streams {
        let resp = s.await.expect("h2 response");
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.version(), hyper::Version::HTTP_2);
        let mut body = resp.into_body();
        let (mut frames, mut text) = (0, String::new());
        while let Some(f) = body.frame().await {
            if let Ok(d) = f.unwrap().into_data() {
                frames += 1;
                text.push_str(std::str::from_utf8(&d).unwrap());
            }
        }
        assert!(frames > 5, "streamed in pieces, got {frames} frames");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert_eq!(text.matches("\"content\":\" ").count(), 10);
    }
}
