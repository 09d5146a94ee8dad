//! The gateway as a Gateway API Inference Extension Endpoint Picker behind a real Envoy
//! (`config/envoy-epp.yaml`): requests reach the engine the policy picked, prefix groups stay
//! home, a dead engine stops being picked, Envoy without its picker follows
//! `failure_mode_allow`, large bodies pass intact through the echo, a client leaving frees the
//! engine; and the picker's gRPC side against bad input (no Envoy: a raw ext_proc client).

use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use serde_json::json;
use switchyard_testkit::*;

const MODEL: &str = "meta-llama/Meta-Llama-3-8B-Instruct";

/// A gateway serving only as the picker (`listen: null` is not used here: the API listener
/// stays, so the test can read its admin view), scraping every 100 ms.
fn picker(urls: impl IntoIterator<Item = String>) -> GatewayConfigBuilder {
    picker_with(urls, "")
}

/// [`picker`], with more `epp` settings (`key: value, …`).
fn picker_with(urls: impl IntoIterator<Item = String>, epp: &str) -> GatewayConfigBuilder {
    GatewayConfigBuilder::new()
        .backends(urls)
        .policy("cost")
        .scrape_interval_ms(100)
        .section("epp", &format!("{{ listen: 127.0.0.1:0, {epp} }}"))
}

fn sim_engines(n: usize) -> Vec<EngineProc> {
    (0..n).map(|_| EngineProc::start(&["--sim-profile", "h100-llama3-8b"])).collect()
}

/// Finished requests per engine (its own count).
async fn served(engines: &[EngineProc]) -> Vec<f64> {
    let mut v = Vec::new();
    for e in engines {
        v.push(metric(&scrape(e.addr).await, "vllm:request_success_total"));
    }
    v
}

/// Requests the gateway routed to each engine (its choices), in `engines`' order.
async fn picked(g: &GatewayProc, engines: &[EngineProc]) -> Vec<u64> {
    let b = backends(g).await;
    let list = b["backends"].as_array().unwrap();
    engines
        .iter()
        .map(|e| {
            let url = e.url();
            list.iter().find(|x| x["url"] == url.as_str()).map_or(0, |x| x["routed"].as_u64().unwrap())
        })
        .collect()
}

/// A streamed chat completion through Envoy; the answer's text.
async fn chat(envoy: &EnvoyProc, system: &str, question: &str) -> String {
    let body = json!({
        "model": MODEL, "stream": true, "max_tokens": 4, "ignore_eos": true,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    });
    let mut r = post(envoy.addr, "/v1/chat/completions", &body).await;
    if r.status != 200 {
        let status = r.status;
        panic!("status {status}: {}", r.text().await);
    }
    assert!(!r.headers.contains_key("x-gateway-destination-endpoint-served"), "the picker removes it");
    let mut text = String::new();
    while let Some(e) = r.next_event().await {
        if e == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&e).unwrap();
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    text
}

/// The one engine whose count rose between `before` and `after`.
fn the_one_that_rose<T: PartialOrd + std::fmt::Debug>(before: &[T], after: &[T]) -> usize {
    let rose: Vec<usize> = (0..before.len()).filter(|&i| after[i] > before[i]).collect();
    assert_eq!(rose.len(), 1, "{before:?} → {after:?}");
    rose[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_sends_each_request_to_the_picked_engine_and_prefix_groups_stay_home() {
    let engines = sim_engines(3);
    let g = GatewayProc::start(&picker(engines.iter().map(|e| e.url())));
    wait_scraped(&g, 3).await;
    let envoy = EnvoyProc::start(g.epp.expect("epp listening line"), false);

    // Four groups, each a 1,500-token document with four questions, sent one at a time.
    let mut homes = Vec::new();
    for (gi, salt) in ["a", "b", "c", "d"].into_iter().enumerate() {
        let doc = prompt_of(1500, salt);
        let mut group = Vec::new();
        for q in 0..4 {
            let (chose_before, served_before) = (picked(&g, &engines).await, served(&engines).await);
            let text = chat(&envoy, &doc, &format!("group {gi} question {q}")).await;
            assert!(!text.is_empty());
            let chose = the_one_that_rose(&chose_before, &picked(&g, &engines).await);
            let got = the_one_that_rose(&served_before, &served(&engines).await);
            assert_eq!(chose, got, "the picker chose engine {chose}, Envoy sent it to {got}");
            group.push(got);
        }
        assert!(group.iter().all(|&e| e == group[0]), "group {gi} went to {group:?}\n{}", g.log());
        homes.push(group[0]);
    }
    let gm = scrape(g.admin).await;
    let prefix_hits = metric_where(&gm, "switchyard_routing_decisions_total", "reason", "prefix_hit");
    assert_eq!(prefix_hits, 12.0, "followers routed by their cached prefix: {homes:?}");
    // Each request was counted in flight while it ran and released at its end.
    let b = backends(&g).await;
    assert!(b["backends"].as_array().unwrap().iter().all(|x| x["inflight"] == 0), "{b}");
    // The access log has one line per request, with the engine that served it.
    let chats = || g.log().lines().filter(|l| l.contains("\"path\":\"/v1/chat/completions\"")).count();
    eventually("one access-log line per request", async || chats() == 16).await;
    // A GET goes to a ready engine as it is.
    let models = send(envoy.addr, "GET", "/v1/models", Bytes::new()).await;
    assert_eq!(models.status, 200);
    assert!(models.text().await.contains(MODEL));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_stops_being_picked_within_the_scrape_window() {
    let mut engines = sim_engines(2);
    let g = GatewayProc::start(&picker(engines.iter().map(|e| e.url())).down_after_failures(1));
    wait_scraped(&g, 2).await;
    let envoy = EnvoyProc::start(g.epp.unwrap(), false);
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
    for _ in 0..8 {
        let r = post(envoy.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200);
        r.text().await;
    }
    engines[0].kill();
    let killed = Instant::now();
    // Requests may still be sent to the dead engine (Envoy then answers 503) until a scrape
    // fails; after that every one succeeds on the live engine.
    let mut ok_in_a_row = 0;
    while ok_in_a_row < 10 {
        let r = post(envoy.addr, "/v1/completions", &body).await;
        ok_in_a_row = if r.status == 200 { ok_in_a_row + 1 } else { 0 };
        r.text().await;
        assert!(killed.elapsed() < Duration::from_secs(5), "the dead engine was still picked after 5 s\n{}", g.log());
    }
    let window = killed.elapsed();
    eprintln!("the dead engine stopped being picked {} ms after the kill", window.as_millis());
    let live = served(&engines[1..]).await;
    assert!(live[0] >= 10.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_its_picker_envoy_follows_failure_mode_allow() {
    let engines = sim_engines(1);
    let g = GatewayProc::start(&picker(engines.iter().map(|e| e.url())));
    wait_scraped(&g, 1).await;
    let strict = EnvoyProc::start(g.epp.unwrap(), false);
    let lenient = EnvoyProc::start(g.epp.unwrap(), true);
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2}).to_string();
    // A client naming the engine itself: the picker overwrites the header while it runs.
    let own = [("x-gateway-destination-endpoint", engines[0].addr.to_string())];
    let own: Vec<(&str, &str)> = own.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for envoy in [&strict, &lenient] {
        let r = send_with(envoy.addr, "POST", "/v1/completions", &own, body.clone()).await;
        assert_eq!(r.status, 200);
        r.text().await;
    }
    drop(g);
    // failure_mode_allow: false: no picker, no request.
    for (method, path, body) in [("POST", "/v1/completions", body.clone()), ("GET", "/v1/models", String::new())] {
        let r = send_with(strict.addr, method, path, &own, body).await;
        assert!(r.status >= 500, "{method} {path}: status {}", r.status);
        r.text().await;
    }
    // failure_mode_allow: true: a request passes unprocessed, here to the engine the client
    // named. Envoy 1.40 applies this only to requests without a body: in FULL_DUPLEX_STREAMED
    // mode a POST whose picker is gone gets 500 even when failing open (docs/epp.md).
    let r = send_with(lenient.addr, "GET", "/v1/models", &own, String::new()).await;
    assert_eq!(r.status, 200, "{}", lenient.log());
    assert!(r.text().await.contains(MODEL));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_engine_envoy_answers_503_after_the_queue_as_http_does_and_keys_still_apply() {
    // Pickers without the HTTP API (`listen: null`), for an engine that is down.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let base = || {
        GatewayConfigBuilder::new()
            .without_api_listener()
            .backend_serving(&dead, &[MODEL])
            .section("epp", "{ listen: 127.0.0.1:0 }")
    };
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
    let down = async |g: &GatewayProc| {
        eventually("the engine is down", async || backends(g).await["backends"][0]["state"] == "down").await;
    };
    // No admission queue: 503, in the OpenAI error shape.
    let g = GatewayProc::start(&base());
    down(&g).await;
    let envoy = EnvoyProc::start(g.epp.expect("epp listening line"), false);
    let r = post(envoy.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 503, "{}", g.log());
    assert!(r.json().await["error"]["message"].is_string());
    // A queue that waits 300 ms, and an API key.
    const KEY: &str = "sk-epp-0123456789";
    let key = ApiKey::new("team-a", &sha256(KEY));
    let g = GatewayProc::start(&base().api_key(key).section("admission", "{ max_queue: 8, max_wait_ms: 300 }"));
    down(&g).await;
    let envoy = EnvoyProc::start(g.epp.unwrap(), false);
    let r = post(envoy.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 401, "no key, no request");
    assert_eq!(r.json().await["error"]["code"], "invalid_api_key");
    let auth = format!("Bearer {KEY}");
    let started = Instant::now();
    let r = send_with(envoy.addr, "POST", "/v1/completions", &[("authorization", &auth)], body.to_string()).await;
    // The same status as over HTTP (one driver): 503 with Retry-After.
    assert_eq!(r.status, 503, "past the queue's wait the request is refused");
    assert!(started.elapsed() >= Duration::from_millis(300), "it waited in the queue first");
    assert!(r.headers.contains_key("retry-after"));
    eventually("the shed request is logged with its tenant", async || g.log().contains("\"tenant\":\"team-a\"")).await;
    assert!(!g.log().contains(KEY));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_through_envoy_reaches_its_target_and_comes_back_named() {
    // The picker rewrites the body's model (a different length: Content-Length goes) and
    // writes the alias back over the engine's answers, streamed or not.
    let engines = sim_engines(1);
    let alias = format!("{{ short: {{ targets: [ {{ model: {MODEL}, weight: 1 }} ], rewrite_response: true }} }}");
    let g = GatewayProc::start(&picker(engines.iter().map(|e| e.url())).section("models", &alias));
    wait_scraped(&g, 1).await;
    let envoy = EnvoyProc::start(g.epp.unwrap(), false);
    let r = post(
        envoy.addr,
        "/v1/completions",
        &json!({"model": "short", "prompt": "hello", "max_tokens": 3, "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", g.log());
    let v = r.json().await;
    assert_eq!(v["model"], "short", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let body = json!({"model": "short", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true,
               "ignore_eos": true});
    let mut r = post(envoy.addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200);
    let mut events = 0;
    while let Some(e) = r.next_event().await {
        if e == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(&e).unwrap();
        assert_eq!(chunk["model"], "short", "{e}");
        events += 1;
    }
    assert!(events >= 3);
    let served = served(&engines).await;
    assert_eq!(served[0], 2.0, "both reached the engine as its own model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_megabyte_prompt_passes_intact_through_the_body_echo() {
    let engine = FaultEngine::start(Fault::Healthy).await;
    let g = GatewayProc::start(&picker([engine.url()]).section("limits", "{ max_body_bytes: 4194304 }"));
    wait_scraped(&g, 1).await;
    let envoy = EnvoyProc::start(g.epp.unwrap(), false);
    // 1 MiB of varied text: a lost, repeated or reordered 62,000-byte chunk shows.
    let prompt: String = (0..(1 << 20) / 8).map(|i| format!("{:07x} ", i)).collect();
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string();
    let r = send(envoy.addr, "POST", "/v1/completions", body.clone()).await;
    assert_eq!(r.status, 200);
    r.text().await;
    let got = engine.seen.requests.lock().unwrap().last().cloned().expect("the engine got the request");
    let head_end = got.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    assert_eq!(got.len() - head_end, body.len());
    assert!(got[head_end..] == *body.as_bytes(), "the body arrived changed");
    // Over the limit: the picker answers 413 itself and the engine sees nothing.
    let big = "x".repeat(5 << 20);
    let posts = engine.posts();
    let r = send(envoy.addr, "POST", "/v1/completions", big).await;
    assert_eq!(r.status, 413);
    assert_eq!(r.json().await["error"]["type"], "invalid_request_error");
    assert_eq!(engine.posts(), posts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_through_envoy_frees_the_engine_request() {
    let engines = sim_engines(1);
    let g = GatewayProc::start(&picker(engines.iter().map(|e| e.url())));
    wait_scraped(&g, 1).await;
    let envoy = EnvoyProc::start(g.epp.unwrap(), false);
    let body = json!({"model": MODEL, "prompt": "tell me everything", "max_tokens": 4000, "ignore_eos": true,
        "stream": true});
    let mut r = post(envoy.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200);
    for _ in 0..3 {
        r.next_event().await.expect("an event");
    }
    let running = || async { metric(&scrape(engines[0].addr).await, "vllm:num_requests_running") };
    assert_eq!(running().await, 1.0);
    r.disconnect();
    eventually("the engine aborts the request", async || running().await == 0.0).await;
    eventually("the picker releases it", async || backends(&g).await["backends"][0]["inflight"] == 0).await;
    eventually("the access log has the request, cut short", async || g.log().contains("client_gone")).await;
}

// --- the ext_proc protocol without Envoy ---------------------------------------------------

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    let headers = HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue { key: k.to_string(), raw_value: v.as_bytes().to_vec(), ..Default::default() })
            .collect(),
    };
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(headers),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

const POST_COMPLETIONS: &[(&str, &str)] = &[(":method", "POST"), (":path", "/v1/completions")];

type Client = ExternalProcessorClient<tonic::transport::Channel>;

async fn client(g: &GatewayProc) -> Client {
    ExternalProcessorClient::connect(format!("http://{}", g.epp.unwrap())).await.expect("connect to the picker")
}

/// Send `messages` on one stream (then half-close it) and collect the answers until the
/// picker ends the stream: the answers, and the gRPC error that ended it, if any.
async fn exchange(
    c: &mut Client,
    messages: Vec<ProcessingRequest>,
) -> (Vec<ProcessingResponse>, Option<tonic::Status>) {
    let mut answers = Vec::new();
    let stream = match c.process(tokio_stream::iter(messages)).await {
        Ok(s) => s,
        Err(e) => return (answers, Some(e)),
    };
    let mut stream = stream.into_inner();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.message()).await.expect("the picker answers") {
            Ok(Some(m)) => answers.push(m),
            Ok(None) => return (answers, None),
            Err(e) => return (answers, Some(e)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_answers_health_and_routes_a_raw_ext_proc_stream() {
    let engine = FaultEngine::start(Fault::Healthy).await;
    let g = GatewayProc::start(&picker([engine.url()]));
    wait_scraped(&g, 1).await;
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", g.epp.unwrap())).unwrap().connect().await.unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for service in ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        let r = health.check(tonic_health::pb::HealthCheckRequest { service: service.into() }).await.unwrap();
        assert_eq!(r.into_inner().status, 1, "{service} is SERVING");
    }

    let mut c = client(&g).await;
    let payload = br#"{"model":"m","prompt":"hi","max_tokens":1}"#;
    let (answers, error) = exchange(&mut c, vec![headers(POST_COMPLETIONS, false), body(payload, true)]).await;
    assert!(error.is_none(), "{error:?}");
    let Some(processing_response::Response::RequestHeaders(h)) = &answers[0].response else { panic!("{answers:?}") };
    let set = &h.response.as_ref().unwrap().header_mutation.as_ref().unwrap().set_headers;
    let dest = set[0].header.as_ref().unwrap();
    assert_eq!(dest.key, "x-gateway-destination-endpoint");
    assert_eq!(String::from_utf8_lossy(&dest.raw_value), engine.url().trim_start_matches("http://"));
    assert!(answers[0].dynamic_metadata.as_ref().unwrap().fields.contains_key("envoy.lb"));
    let Some(processing_response::Response::RequestBody(_)) = &answers[1].response else { panic!("{answers:?}") };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ext_proc_streams_get_errors_and_leave_nothing_behind() {
    let engine = FaultEngine::start(Fault::Healthy).await;
    let g = GatewayProc::start(&picker([engine.url()]).section("limits", "{ header_read_timeout_ms: 500 }"));
    wait_scraped(&g, 1).await;
    let mut c = client(&g).await;

    // A body before the headers; a response phase before any request; headers without a path.
    for (what, messages) in [
        ("body first", vec![body(b"{}", true)]),
        (
            "response first",
            vec![ProcessingRequest {
                request: Some(processing_request::Request::ResponseHeaders(HttpHeaders::default())),
                ..Default::default()
            }],
        ),
        ("no :path", vec![headers(&[(":method", "POST")], false), body(b"{}", true)]),
        ("headers twice", vec![headers(POST_COMPLETIONS, false), headers(POST_COMPLETIONS, false)]),
    ] {
        let (answers, error) = exchange(&mut c, messages).await;
        let refused = error.is_some_and(|e| e.code() == tonic::Code::InvalidArgument)
            || answers.iter().any(|a| matches!(a.response, Some(processing_response::Response::ImmediateResponse(_))));
        assert!(refused, "{what}: {answers:?}");
    }
    // Not JSON: the OpenAI error shape in an immediate answer.
    let (answers, _) = exchange(&mut c, vec![headers(POST_COMPLETIONS, false), body(b"not json", true)]).await;
    let Some(processing_response::Response::ImmediateResponse(i)) = &answers[0].response else { panic!("{answers:?}") };
    assert_eq!(i.status.as_ref().unwrap().code, 400);
    let v: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // A stream cut mid-body: its buffer is given back.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(headers(POST_COMPLETIONS, false)).await.unwrap();
    tx.send(body(&vec![b' '; 100_000], false)).await.unwrap();
    let cut = c.process(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap();
    eventually("the body is held", async || metric(&scrape(g.admin).await, "switchyard_buffered_body_bytes") > 0.0)
        .await;
    drop(cut);
    drop(tx);
    eventually("the cut body is given back", async || {
        metric(&scrape(g.admin).await, "switchyard_buffered_body_bytes") == 0.0
    })
    .await;

    // 10,000 streams open at once (half with headers, half silent), then all dropped; eight
    // times. Every stream's task ends, memory does not grow round over round, and the picker
    // still answers.
    let rss_before = rss_kb(g.pid());
    let mut rss_after = Vec::new();
    for _ in 0..8 {
        let (go, gate) = tokio::sync::watch::channel(false);
        let opened = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..10_000 {
            let (mut c, mut gate, opened) = (c.clone(), gate.clone(), opened.clone());
            let first = (i % 2 == 0).then(|| headers(POST_COMPLETIONS, false));
            tasks.push(tokio::spawn(async move {
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                if let Some(m) = first {
                    let _ = tx.send(m).await;
                }
                let s = c.process(tokio_stream::wrappers::ReceiverStream::new(rx)).await;
                opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = gate.wait_for(|go| *go).await;
                drop(tx);
                drop(s);
            }));
        }
        eventually("10,000 streams are open", async || opened.load(std::sync::atomic::Ordering::Relaxed) == 10_000)
            .await;
        go.send(true).unwrap();
        for t in tasks {
            t.await.unwrap();
        }
        eventually("every stream's task has ended", async || {
            metric(&scrape(g.admin).await, "switchyard_epp_streams") == 0.0
        })
        .await;
        rss_after.push(rss_kb(g.pid()));
    }
    eprintln!("picker RSS {rss_before} kB before, {rss_after:?} kB after each round of 10,000 streams");
    // 10,000 open streams cost tens of MB that the allocator keeps in its arenas, in amounts
    // that vary round to round; a leak would add to it every round.
    // A leak lifts every later round above the earlier ones.
    let (early, late) = rss_after.split_at(4);
    let (early_max, late_min) = (early.iter().max().unwrap(), late.iter().min().unwrap());
    assert!(late_min < &(early_max + 16 * 1024), "RSS grows round over round: {rss_after:?} kB");
    // 30 rounds measured here bounced between 65 and 250 MB with no trend.
    assert!(rss_after.iter().all(|&r| r < rss_before + 512 * 1024), "{rss_before} kB, then {rss_after:?} kB");
    let (answers, error) = exchange(
        &mut c,
        vec![headers(POST_COMPLETIONS, false), body(br#"{"model":"m","prompt":"hi","max_tokens":1}"#, true)],
    )
    .await;
    assert!(error.is_none() && matches!(answers[0].response, Some(processing_response::Response::RequestHeaders(_))));
    let gm = scrape(g.admin).await;
    assert!(metric(&gm, "switchyard_epp_protocol_errors_total") >= 3.0);
}

fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap()
}

// --- the picker's resources against a client that breaks the rules -------------------------

/// A hand-written HTTP/2 client: frames as an attacker writes them, whatever the server's
/// settings say.
mod raw_h2 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

    pub const DATA: u8 = 0;
    pub const HEADERS: u8 = 1;
    pub const RST_STREAM: u8 = 3;
    pub const SETTINGS: u8 = 4;
    pub const GOAWAY: u8 = 7;
    pub const REFUSED_STREAM: u32 = 7;

    pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// A gRPC call's request headers (HPACK literals, no table, no Huffman), END_HEADERS.
    pub fn call(stream: u32, path: &str) -> Vec<u8> {
        let mut block = Vec::new();
        for (name, value) in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "picker"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ] {
            block.push(0);
            block.push(name.len() as u8);
            block.extend_from_slice(name.as_bytes());
            block.push(value.len() as u8);
            block.extend_from_slice(value.as_bytes());
        }
        frame(HEADERS, 0x4, stream, &block)
    }

    /// A gRPC message's bytes (uncompressed).
    pub fn message(payload: &[u8]) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        m.extend_from_slice(payload);
        m
    }

    /// The next frame: kind, flags, stream, payload.
    pub async fn read_frame(r: &mut OwnedReadHalf) -> Option<(u8, u8, u32, Vec<u8>)> {
        let mut head = [0u8; 9];
        r.read_exact(&mut head).await.ok()?;
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let mut payload = vec![0; len];
        r.read_exact(&mut payload).await.ok()?;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        Some((head[3], head[4], stream, payload))
    }

    /// Preface and settings exchanged: the connection's halves.
    pub async fn connect(addr: std::net::SocketAddr) -> (OwnedReadHalf, OwnedWriteHalf) {
        let (mut r, mut w) = tokio::net::TcpStream::connect(addr).await.unwrap().into_split();
        w.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
        w.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
        loop {
            let (kind, flags, _, _) = read_frame(&mut r).await.expect("the server's settings");
            if kind == SETTINGS && flags & 1 == 0 {
                w.write_all(&frame(SETTINGS, 1, 0, &[])).await.unwrap();
                return (r, w);
            }
        }
    }
}

const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// Past `epp.max_streams`: 20,000 streams opened at once on one connection by a client that
/// ignores the picker's `SETTINGS_MAX_CONCURRENT_STREAMS` are refused beyond the first 100,
/// and memory stays put (each accepted stream used to cost ~22 kB: +450 MB); a second
/// connection, polite, gets `RESOURCE_EXHAUSTED` while the first holds them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_max_streams_are_refused_per_connection_and_in_all() {
    use tokio::io::AsyncWriteExt;
    let engine = FaultEngine::start(Fault::Healthy).await;
    let g = GatewayProc::start(&picker_with([engine.url()], "max_streams: 100").section(
        "limits",
        // The silent streams are held for the test's length.
        "{ header_read_timeout_ms: 60000 }",
    ));
    wait_scraped(&g, 1).await;
    let rss_before = rss_kb(g.pid());
    let (mut r, mut w) = raw_h2::connect(g.epp.unwrap()).await;
    let reader = tokio::spawn(async move {
        let (mut refused, mut goaway) = (0, false);
        while let Ok(Some((kind, _, _, payload))) =
            tokio::time::timeout(Duration::from_secs(5), raw_h2::read_frame(&mut r)).await
        {
            match kind {
                raw_h2::RST_STREAM if payload == raw_h2::REFUSED_STREAM.to_be_bytes() => refused += 1,
                raw_h2::GOAWAY => goaway = true,
                _ => {}
            }
        }
        (refused, goaway)
    });
    let mut flood = Vec::new();
    for i in 0..20_000u32 {
        flood.extend_from_slice(&raw_h2::call(2 * i + 1, PROCESS));
        if flood.len() > 64 * 1024 {
            if w.write_all(&flood).await.is_err() {
                break;
            }
            flood.clear();
        }
    }
    let _ = w.write_all(&flood).await;
    eventually("the first 100 streams are open", async || {
        metric(&scrape(g.admin).await, "switchyard_epp_streams") == 100.0
    })
    .await;
    let rss_during = rss_kb(g.pid());

    // Another connection's stream, within its own connection's limit, is past the total.
    let mut c = client(&g).await;
    let (_, error) = exchange(&mut c, vec![headers(POST_COMPLETIONS, false), body(br#"{"prompt":"hi"}"#, true)]).await;
    assert_eq!(error.map(|e| e.code()), Some(tonic::Code::ResourceExhausted));

    let (refused, goaway) = reader.await.unwrap();
    eprintln!("20,000 streams: {refused} refused (GOAWAY: {goaway}); RSS {rss_before} → {rss_during} kB");
    // h2 resets each stream past the limit, or gives up on the connection with GOAWAY.
    assert!(refused >= 1_000 || goaway, "{refused} streams refused");
    assert_eq!(metric(&scrape(g.admin).await, "switchyard_epp_streams"), 100.0, "never more than max_streams");
    assert!(rss_during < rss_before + 64 * 1024, "RSS {rss_before} → {rss_during} kB");
    drop(w);
    eventually("the streams end with their connection", async || {
        metric(&scrape(g.admin).await, "switchyard_epp_streams") == 0.0
    })
    .await;
}

/// A routed stream that goes silent (Envoy never passes the response) is counted in flight
/// on its engine only until `epp.response_timeout_ms`; then the count is released and the
/// stream ends with `DEADLINE_EXCEEDED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_routed_stream_is_released_after_the_response_timeout() {
    let engine = FaultEngine::start(Fault::Healthy).await;
    let g = GatewayProc::start(&picker_with([engine.url()], "response_timeout_ms: 1000"));
    wait_scraped(&g, 1).await;
    let mut c = client(&g).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(headers(POST_COMPLETIONS, false)).await.unwrap();
    tx.send(body(br#"{"model":"m","prompt":"hi","max_tokens":1}"#, true)).await.unwrap();
    let mut stream = c.process(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    let routed = stream.message().await.unwrap().unwrap();
    assert!(matches!(routed.response, Some(processing_response::Response::RequestHeaders(_))), "{routed:?}");
    let inflight = async || backends(&g).await["backends"][0]["inflight"].as_u64().unwrap();
    assert_eq!(inflight().await, 1, "counted on its engine while Envoy makes the exchange");
    let started = Instant::now();
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.message()).await.expect("the picker ends it") {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("ended without an error"),
            Err(e) => break e,
        }
    };
    assert_eq!(ended.code(), tonic::Code::DeadlineExceeded, "{ended:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    assert_eq!(inflight().await, 0, "released");
    eventually("the access line says why", async || g.log().contains("epp_response_timeout")).await;
    drop(tx);
}

/// A gRPC message still arriving holds its declared size against
/// `limits.max_buffered_body_bytes`: with a 32 MiB cap, three streams each sending the first
/// bytes of a 10 MiB body message hold 30 MiB, a fourth is answered 503 as HTTP would be, and
/// closing the streams gives it all back (tonic's buffer used to hold them unseen: +92 MB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_grpc_messages_count_against_the_body_cap() {
    use prost::Message;
    use tokio::io::AsyncWriteExt;
    let engine = FaultEngine::start(Fault::Healthy).await;
    let g = GatewayProc::start(
        &picker([engine.url()]).section("limits", "{ max_buffered_body_bytes: 33554432, body_read_timeout_ms: 60000 }"),
    );
    wait_scraped(&g, 1).await;
    let (mut r, mut w) = raw_h2::connect(g.epp.unwrap()).await;
    let held = async || metric(&scrape(g.admin).await, "switchyard_buffered_body_bytes");
    let ten_mib = 10 * 1024 * 1024;
    for i in 0..4u32 {
        let id = 2 * i + 1;
        w.write_all(&raw_h2::call(id, PROCESS)).await.unwrap();
        let first = raw_h2::message(&headers(POST_COMPLETIONS, false).encode_to_vec());
        // A body message declaring 10 MiB, of which 1 kB is sent.
        let mut partial = Vec::from([0u8]);
        partial.extend_from_slice(&(ten_mib as u32).to_be_bytes());
        partial.extend_from_slice(&[b' '; 1024]);
        w.write_all(&raw_h2::frame(raw_h2::DATA, 0, id, &[first, partial].concat())).await.unwrap();
        if i < 3 {
            let want = f64::from(i + 1) * (ten_mib + 5) as f64;
            eventually("the partial message is held", async || held().await >= want).await;
        }
    }
    // The fourth stream's answer: an immediate 503.
    let mut answer = None;
    while let Ok(Some((kind, _, stream, payload))) =
        tokio::time::timeout(Duration::from_secs(10), raw_h2::read_frame(&mut r)).await
    {
        if kind == raw_h2::DATA && stream == 7 && payload.len() > 5 {
            answer = Some(ProcessingResponse::decode(&payload[5..]).unwrap());
            break;
        }
    }
    let Some(processing_response::Response::ImmediateResponse(i)) = answer.and_then(|a| a.response) else {
        panic!("no immediate answer on the fourth stream")
    };
    assert_eq!(i.status.as_ref().unwrap().code, 503);
    assert!(held().await <= 32.0 * 1024.0 * 1024.0, "{}", held().await);
    drop((r, w));
    eventually("all given back", async || held().await == 0.0).await;
}
