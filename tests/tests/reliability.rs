//! RELIABILITY.md cases 1, 2, 4 and 11–14: engines that die, refuse, fail, stall; clients
//! that leave or reset streams. Real gateway processes; `sim` engines or the scripted
//! fault engine ([`switchyard_testkit::fault`]).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use switchyard_testkit::*;

const MODEL: &str = "meta-llama/Meta-Llama-3-8B-Instruct";

/// A gateway config over `backends` with `least_load`.
fn config(backends: &[String]) -> GatewayConfigBuilder {
    GatewayConfigBuilder::new().backends(backends).policy("least_load")
}

/// `n` requests, `concurrency` at a time: their statuses.
async fn load(addr: SocketAddr, n: usize, concurrency: usize, body: serde_json::Value) -> Vec<(u16, Duration)> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (next, body) = (next.clone(), body.clone());
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while next.fetch_add(1, Ordering::SeqCst) < n {
                let t = Instant::now();
                let r = post(addr, "/v1/completions", &body).await;
                let status = r.status;
                if status == 503 {
                    assert!(r.headers.contains_key("retry-after"), "503 without Retry-After");
                }
                r.text().await;
                out.push((status, t.elapsed()));
            }
            out
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    all
}

fn ok(body: &str) -> serde_json::Value {
    json!({"model": "m", "prompt": body, "max_tokens": 2})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_refusing_connections_costs_no_client_an_error() {
    let a = FaultEngine::start(Fault::Healthy).await;
    let b = FaultEngine::start(Fault::Healthy).await;
    // A port nobody listens on, declared to serve the model so it is tried at once.
    let refused = format!("http://127.0.0.1:{}", free_port());
    // Scrapes slow enough that the refusing engine is still routable for a while.
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backend_serving(&a.url(), &["m"])
            .backend_serving(&b.url(), &["m"])
            .backend_serving(&refused, &["m"])
            .scrape_interval_ms(2000)
            .stale_after_ms(10000)
            .down_after_failures(100),
    );
    let results = load(g.addr, 200, 8, ok("x")).await;
    let failed: Vec<_> = results.iter().filter(|r| r.0 != 200).collect();
    assert!(failed.is_empty(), "{} failures: {failed:?}", failed.len());
    assert_eq!(a.posts() + b.posts(), 200, "each request reached an engine exactly once");
    let m = scrape(g.admin).await;
    assert!(metric(&m, "switchyard_retries_total") >= 1.0, "the refusing engine was tried and retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_dropping_requests_before_answering_costs_no_client_an_error() {
    // Reads each request, then closes the connection: an engine that crashed mid-admission.
    let dying = FaultEngine::start(Fault::Reset).await;
    let healthy = FaultEngine::start(Fault::Healthy).await;
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backends([dying.url(), healthy.url()])
            .policy("round_robin")
            .section("health", "{ consecutive_failures: 1000 }"),
    );
    wait_scraped(&g, 2).await;
    let results = load(g.addr, 60, 4, ok("x")).await;
    assert!(results.iter().all(|r| r.0 == 200), "{results:?}");
    assert!(dying.posts() >= 20, "the dying engine was tried ({} times)", dying.posts());
    assert_eq!(healthy.posts(), 60, "every request was served once, elsewhere");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_engine_says_503_retries_stay_within_the_budget() {
    let engines: Vec<FaultEngine> =
        futures_util::future::join_all((0..3).map(|_| FaultEngine::start(Fault::Status(503)))).await;
    let urls: Vec<String> = engines.iter().map(FaultEngine::url).collect();
    let g = GatewayProc::start(
        &config(&urls)
            .section("retries", "{ max_attempts: 3, budget_percent: 20, min_retries_per_second: 1 }")
            .section("health", "{ consecutive_failures: 1000 }"),
    );
    wait_scraped(&g, 3).await;
    let n = 100;
    let results = load(g.addr, n, 4, ok("x")).await;
    assert!(results.iter().all(|r| r.0 == 503), "clients get the engines' 503");
    // Passed on at once, never held back (no backoff, no waiting for a budget to refill).
    let slowest = results.iter().map(|r| r.1).max().unwrap();
    assert!(slowest < Duration::from_secs(3), "503s come back quickly: slowest {slowest:?}");
    let posts: usize = engines.iter().map(FaultEngine::posts).sum();
    // 20 % of 100 requests plus 1/s over the 10 s window.
    let budget = n + n / 5 + 10;
    assert!(posts > n, "some retries were made");
    assert!(posts <= budget, "{posts} engine requests for {n} client requests: over the retry budget of {budget}");
    let m = scrape(g.admin).await;
    assert_eq!(metric(&m, "switchyard_retries_total") as usize, posts - n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_failing_everything_is_ejected_and_readmitted() {
    let good: Vec<FaultEngine> =
        futures_util::future::join_all((0..2).map(|_| FaultEngine::start(Fault::Healthy))).await;
    let bad = FaultEngine::start(Fault::Status(500)).await;
    let mut urls: Vec<String> = good.iter().map(FaultEngine::url).collect();
    urls.push(bad.url());
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backends(&urls)
            .policy("round_robin")
            .section("retries", "{ retry_on_status: [500, 502, 503] }")
            .section("health", "{ consecutive_failures: 3, ejection_ms: 400, max_ejection_percent: 34 }"),
    );
    wait_scraped(&g, 3).await;
    let started = Instant::now();
    let mut results = Vec::new();
    while started.elapsed() < Duration::from_secs(2) {
        results.extend(load(g.addr, 50, 2, ok("x")).await);
    }
    let success = results.iter().filter(|r| r.0 == 200).count() as f64 / results.len() as f64;
    assert!(success >= 0.999, "success {success} over {} requests", results.len());
    let b = backends(&g).await;
    let entry = b["backends"].as_array().unwrap().iter().find(|x| x["url"] == bad.url().as_str()).unwrap().clone();
    let ejections = entry["ejections"].as_u64().unwrap();
    assert!(ejections >= 2, "ejected, re-admitted after the ejection time, ejected again: {entry}");
    // Far less than its third of the traffic: it spends most of the time ejected.
    assert!(bad.posts() * 6 < results.len(), "{} of {} requests hit the failing engine", bad.posts(), results.len());
    // Never more than the max-ejection share: the good engines were never ejected.
    for e in b["backends"].as_array().unwrap().iter().filter(|x| x["url"] != bad.url().as_str()) {
        assert_eq!(e["ejections"], 0, "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_engines_hit_the_timeouts_and_their_connections_are_dropped() {
    let engine = FaultEngine::start(Fault::StallBeforeHeader).await;
    let g = GatewayProc::start(
        &config(&[engine.url()])
            .section("timeouts", "{ first_byte_ms: 500, idle_ms: 500 }")
            .section("health", "{ consecutive_failures: 100 }"),
    );
    wait_scraped(&g, 1).await;
    // Accepts, never answers: 504 after the first-byte timeout.
    let t = Instant::now();
    let r = post(g.addr, "/v1/completions", &ok("stall")).await;
    assert_eq!(r.status, 504);
    assert!(t.elapsed() < Duration::from_secs(10), "504 after the 500 ms first-byte timeout, took {:?}", t.elapsed());
    assert_eq!(r.json().await["error"]["type"], "service_unavailable");
    // Stops mid-stream: the stream ends with an SSE error event after the idle timeout.
    engine.set(Fault::StallMidStream(2));
    let r = post(g.addr, "/v1/completions", &json!({"model": "m", "prompt": "s", "stream": true})).await;
    assert_eq!(r.status, 200);
    let events = r.events().await;
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(events[2].1.contains("\"error\"") && events[2].1.contains("idle_timeout"), "{events:?}");
    // Both stalled connections were closed by the gateway, never put back in its pool.
    eventually("both stalled connections closed", async || engine.seen.stalls_closed.load(Ordering::SeqCst) >= 2).await;
    engine.set(Fault::Healthy);
    let before = engine.seen.connections.load(Ordering::SeqCst);
    let r = post(g.addr, "/v1/completions", &ok("fine")).await;
    assert_eq!(r.status, 200);
    r.text().await;
    assert!(engine.seen.connections.load(Ordering::SeqCst) > before, "served on a new connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_of_three_engines_under_200_streams_fails_no_unstarted_request() {
    let mut engines: Vec<EngineProc> =
        (0..3).map(|_| EngineProc::start(&["--sim-profile", "h100-llama3-8b"])).collect();
    let urls: Vec<String> = engines.iter().map(EngineProc::url).collect();
    let g = GatewayProc::start(&config(&urls));
    wait_scraped(&g, 3).await;
    let mut streams = Vec::new();
    for i in 0..200 {
        let addr = g.addr;
        streams.push(tokio::spawn(async move {
            let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 150, "ignore_eos": true,
                              "stream": true, "seed": i});
            let r = post(addr, "/v1/completions", &body).await;
            (r.status, r.events().await)
        }));
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    engines[1].kill();
    let (mut complete, mut cut_with_error) = (0, 0);
    for s in streams {
        let (status, events) = s.await.unwrap();
        assert_eq!(status, 200, "a request failed before its first byte");
        let last = &events.last().expect("no event at all").1;
        if last == "[DONE]" {
            complete += 1;
        } else {
            assert!(last.contains("\"error\""), "a silent truncation: last event {last}");
            cut_with_error += 1;
        }
    }
    eprintln!("{complete} complete, {cut_with_error} ended with an error event");
    assert!(cut_with_error > 0 && cut_with_error < 100, "the killed engine carried about a third");
    // New requests afterwards all succeed.
    let after = load(g.addr, 30, 6, json!({"model": MODEL, "prompt": "x", "max_tokens": 2})).await;
    assert!(after.iter().all(|r| r.0 == 200), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_clients_leaving_after_five_tokens_free_the_engine() {
    let engine = EngineProc::start(&["--sim-profile", "h100-llama3-8b"]);
    let g = GatewayProc::start(&config(&[engine.url()]));
    wait_scraped(&g, 1).await;
    let mut clients = Vec::new();
    for i in 0..100 {
        let addr = g.addr;
        clients.push(tokio::spawn(async move {
            let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2000, "ignore_eos": true,
                              "stream": true, "seed": i});
            let mut r = post(addr, "/v1/completions", &body).await;
            for _ in 0..5 {
                r.next_event().await.expect("a token");
            }
            r.disconnect();
            Instant::now()
        }));
    }
    let mut last_leave = Instant::now();
    for c in clients {
        last_leave = last_leave.max(c.await.unwrap());
    }
    // Freed long before their 2,000 tokens would have been generated (~30 s).
    wait_for_metrics(engine.addr, Duration::from_secs(10), "every aborted request freed", |s| {
        metric(s, "vllm:num_requests_running") == 0.0 && metric(s, "vllm:kv_cache_usage_perc") == 0.0
    })
    .await;
    eprintln!("engine back to baseline {:?} after the last client left", last_leave.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_stream_resets_leave_the_other_streams_alone() {
    use http_body_util::{BodyExt, Full};
    let engine = FaultEngine::start(Fault::Slow { events: 20, gap_ms: 20 }).await;
    let g = GatewayProc::start(&config(&[engine.url()]));
    wait_scraped(&g, 1).await;
    let (sender, _conn) = h2c_connect(g.addr).await;
    let request = |addr: SocketAddr| {
        let body = json!({"model": "m", "prompt": "p", "stream": true}).to_string();
        hyper::Request::post(format!("http://{addr}/v1/completions"))
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(body)))
            .unwrap()
    };
    // Read a whole stream: (events, seconds it took).
    let full = |mut sender: hyper::client::conn::http2::SendRequest<Full<bytes::Bytes>>, addr| async move {
        let t = Instant::now();
        let resp = sender.send_request(request(addr)).await.expect("h2 response");
        assert_eq!(resp.status(), 200);
        let text = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
        (text.matches("data: ").count(), t.elapsed())
    };
    let (events, baseline) = full(sender.clone(), g.addr).await;
    assert_eq!(events, 21);
    // 49 streams run while 1,000 others are opened and reset after their first chunk.
    let addr = g.addr;
    let healthy: Vec<_> = (0..49).map(|_| tokio::spawn(full(sender.clone(), addr))).collect();
    let resets = 1000;
    let mut handles = Vec::new();
    for _ in 0..resets {
        let mut s = sender.clone();
        handles.push(tokio::spawn(async move {
            let resp = s.send_request(request(addr)).await.expect("h2 response");
            let mut body = resp.into_body();
            let _ = body.frame().await;
            drop(body); // RST_STREAM(CANCEL)
        }));
        if handles.len() >= 25 {
            for h in handles.drain(..) {
                h.await.unwrap();
            }
        }
    }
    for h in handles {
        h.await.unwrap();
    }
    for h in healthy {
        let (events, _) = h.await.unwrap();
        assert_eq!(events, 21, "a stream beside the resets was hurt");
    }
    let (events, after) = full(sender.clone(), g.addr).await;
    assert_eq!(events, 21);
    eprintln!("a stream took {baseline:?} before the resets and {after:?} after");
    // Not left degraded: a 20-event stream (~0.4 s) is not held up by leftovers of the resets.
    assert!(after < baseline * 3 + Duration::from_secs(1), "{after:?} vs {baseline:?}");
    // Every reset stream's engine answer was cut off (its connection closed) long before its
    // 20 events were out, and no other one was. (Counting open connections instead counts the
    // idle pool too: the healthy streams' connections stay pooled when they end last.)
    eventually("every reset stream's engine answer was cut off", async || {
        engine.seen.streams_cut.load(Ordering::SeqCst) >= resets
    })
    .await;
    assert_eq!(engine.seen.streams_cut.load(Ordering::SeqCst), resets, "only the reset streams are cut off");
}

/// The names of a process's threads.
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

/// `requests` requests on one keep-alive connection: every status.
async fn on_one_connection(addr: SocketAddr, requests: usize) -> Vec<u16> {
    use http_body_util::{BodyExt, Full};
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let body = json!({"model": "m", "prompt": "keep-alive"}).to_string();
    let mut statuses = Vec::new();
    for _ in 0..requests {
        sender.ready().await.expect("the connection was kept open");
        let req = hyper::Request::post("/v1/completions")
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(body.clone())))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        statuses.push(resp.status().as_u16());
        resp.into_body().collect().await.unwrap();
    }
    statuses
}

/// Both thread models serve keep-alive clients and reuse engine connections: one runtime per
/// core (the default, threads `proxy-core-N`), each core keeping its own idle engine
/// connections, and pingora's work-stealing runtime with one shared pool. A core that put
/// its connections where it does not take them from would open one per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_thread_models_serve_keep_alive_clients_on_reused_engine_connections() {
    let engine = FaultEngine::start(Fault::Healthy).await;
    for (work_stealing, cores) in [(false, 2), (true, 0)] {
        let g = GatewayProc::start(
            &config(&[engine.url()]).threads(2).section("work_stealing", &work_stealing.to_string()),
        );
        wait_scraped(&g, 1).await;
        // The cores start with pingora's services, the scraper among them: not always before
        // its first scrape.
        let core_threads = || thread_names(g.pid()).iter().filter(|n| n.starts_with("proxy-core-")).count();
        eventually("the core threads started", async || core_threads() >= cores).await;
        let names = thread_names(g.pid());
        assert_eq!(core_threads(), cores, "work_stealing: {work_stealing}: {names:?}");
        let before = engine.seen.connections.load(Ordering::SeqCst);
        let clients: Vec<_> = (0..4).map(|_| tokio::spawn(on_one_connection(g.addr, 25))).collect();
        for c in clients {
            assert_eq!(c.await.unwrap(), vec![200; 25], "work_stealing: {work_stealing}");
        }
        // At most 4 at a time per core, scrapes aside: far fewer than the 100 requests.
        let opened = engine.seen.connections.load(Ordering::SeqCst) - before;
        assert!(opened <= 12, "work_stealing: {work_stealing}: {opened} engine connections for 100 requests");
    }
}

/// With one runtime per core, each new connection goes to the core serving fewest, so a
/// load balancer's few long-lived connections are spread over the cores rather than left to
/// whichever core won the race for `accept` — and a core's count drops when one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_connections_go_to_the_core_serving_fewest() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = FaultEngine::start(Fault::Healthy).await;
    let g = GatewayProc::start(&config(&[engine.url()]).threads(2));
    wait_scraped(&g, 1).await;
    let per_core = async || {
        let m = scrape(g.admin).await;
        ["0", "1"].map(|core| metric_where(&m, "switchyard_core_client_connections", "core", core))
    };
    // Each connection is open and has been answered before the next one connects.
    let mut open = Vec::new();
    for _ in 0..6 {
        let mut s = tokio::net::TcpStream::connect(g.addr).await.unwrap();
        s.write_all(b"GET /-/healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 256];
        assert!(s.read(&mut buf).await.unwrap() > 0);
        open.push(s);
    }
    assert_eq!(per_core().await, [3.0, 3.0], "six connections over two cores");
    open.truncate(4);
    eventually("two closed connections counted out", async || per_core().await.iter().sum::<f64>() == 4.0).await;
}
