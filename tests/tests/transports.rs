//! One request driver for every transport (#43): the same table of cases — the route table,
//! engine administration refused, keys, token budgets, body caps, unknown models, aliases,
//! the admission queue — sent over HTTP/1.1, h2c and the Endpoint Picker (ext_proc, through
//! a real Envoy), each case held to the same status, and to not reaching the engine where it
//! is refused. A failure names the case and the transport.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::json;
use switchyard_testkit::*;

const KEY: &str = "sk-driver-0123456789";
/// Model served by a backend that is down: requests for it wait in the queue, then time out.
const QUEUED_MODEL: &str = "q";
const QUEUE_WAIT_MS: u64 = 300;
const MAX_BODY: usize = 4096;

/// The three ways in.
#[derive(Debug, Clone, Copy)]
enum Transport {
    Http1,
    H2c,
    /// Envoy with the gateway as its ext_proc Endpoint Picker.
    ExtProc,
}

/// An answer, read whole.
struct Answer {
    status: u16,
    headers: hyper::HeaderMap,
    body: String,
}

/// Send one request over `transport` (`addr`: the gateway's API listener, or Envoy's).
async fn send_over(
    transport: Transport,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Answer {
    match transport {
        Transport::Http1 | Transport::ExtProc => {
            let r = send_with(addr, method, path, headers, body).await;
            let (status, headers) = (r.status, r.headers.clone());
            Answer { status, headers, body: r.text().await }
        }
        Transport::H2c => {
            let (mut sender, _conn) = h2c_connect(addr).await;
            let mut req = hyper::Request::builder().method(method).uri(format!("http://{addr}{path}"));
            if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
                req = req.header("content-type", "application/json");
            }
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let resp = sender.send_request(req.body(Full::new(body)).unwrap()).await.expect("h2c response");
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            Answer {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body: String::from_utf8_lossy(&body).into_owned(),
            }
        }
    }
}

/// What the engine saw besides scrapes: the request lines of everything that reached it.
fn reached(engine: &FaultEngine) -> Vec<String> {
    let lines = engine.seen.lines.lock().unwrap();
    lines.iter().filter(|l| !l.starts_with("GET /metrics") && !l.starts_with("GET /v1/models")).cloned().collect()
}

/// One case of the table.
struct Case {
    name: &'static str,
    method: &'static str,
    path: &'static str,
    /// Send the API key.
    key: bool,
    /// The content type (JSON unless given).
    content_type: Option<&'static str>,
    body: Bytes,
    status: u16,
    /// The engine gets the request (else: refused before it).
    reaches_engine: bool,
}

fn completion(model: &str) -> Bytes {
    Bytes::from(json!({"model": model, "prompt": "hello", "max_tokens": 2}).to_string())
}

fn cases() -> Vec<Case> {
    let case = |name, method, path, key, body, status, reaches_engine| Case {
        name,
        method,
        path,
        key,
        content_type: None,
        body,
        status,
        reaches_engine,
    };
    let mut v = vec![
        case("unknown route", "GET", "/no/such/route", true, Bytes::new(), 404, false),
        case("unknown route, POSTed", "POST", "/invocations", false, completion("m"), 404, false),
        case("vLLM's /generate", "POST", "/generate", false, completion("m"), 404, false),
        case("known route, wrong method", "PUT", "/v1/completions", true, completion("m"), 405, false),
        case("missing key", "POST", "/v1/completions", false, completion("m"), 401, false),
        case("oversize body", "POST", "/v1/completions", true, Bytes::from(vec![b' '; 2 * MAX_BODY]), 413, false),
        case("not JSON", "POST", "/v1/completions", true, Bytes::from_static(b"not json"), 400, false),
        case("unknown model", "POST", "/v1/completions", true, completion("nope"), 404, false),
        case("queue timeout", "POST", "/v1/completions", true, completion(QUEUED_MODEL), 503, false),
        case("alias rewritten", "POST", "/v1/completions", true, completion("short"), 200, true),
        case("the gateway's model list", "GET", "/v1/models", true, Bytes::new(), 200, false),
    ];
    for path in ["/reset_prefix_cache", "/collective_rpc", "/v1/load_lora_adapter", "/start_profile", "/sleep"] {
        v.push(case("engine administration", "POST", path, true, completion("m"), 404, false));
    }
    // The same, disguised as an engine's server would read them (#44): routed on the normal form.
    for path in [
        "/v1/%6coad_lora_adapter",
        "/v1/load_lora_adapter/",
        "/v1/../collective_rpc",
        "/v1/%2e%2e/reset_prefix_cache",
        "/v1/chat/..%2F..%2Fcollective_rpc",
    ] {
        let status = if path.contains("%2F") { 400 } else { 404 };
        v.push(case("engine administration, disguised", "POST", path, true, completion("m"), status, false));
    }
    v.push(case("an inference route, escaped", "POST", "/v1/%63ompletions", true, completion("m"), 200, true));
    // A form that parsers read differently (#44): python-multipart, vLLM's, takes the last of
    // two boundaries or names, a first-wins reader the first. Refused.
    let form = |disposition: &str| {
        Bytes::from(format!(
            "--BBB\r\nContent-Disposition: {disposition}\r\n\r\nm\r\n--BBB\r\nContent-Disposition: form-data; \
             name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--BBB--\r\n"
        ))
    };
    let path = "/v1/audio/transcriptions";
    v.push(Case {
        content_type: Some("multipart/form-data; boundary=BBB; boundary=AAA"),
        ..case("a form with two boundaries", "POST", path, true, form("form-data; name=\"model\""), 400, false)
    });
    v.push(Case {
        content_type: Some("multipart/form-data; boundary=BBB"),
        ..case(
            "a form field with two names",
            "POST",
            path,
            true,
            form("form-data; name=\"model\"; name=\"x\""),
            400,
            false,
        )
    });
    v.push(Case {
        content_type: Some("multipart/form-data; boundary=BBB"),
        ..case("a form, well formed", "POST", path, true, form("form-data; name=\"model\""), 200, true)
    });
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rule_holds_the_same_on_http1_h2c_and_the_endpoint_picker() {
    let engine = FaultEngine::start(Fault::Healthy).await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let poor = ["poor-http1", "poor-h2c", "poor-extproc"];
    let mut config = GatewayConfigBuilder::new()
        .backends([engine.url()])
        .backend_serving(&dead, &[QUEUED_MODEL])
        .scrape_interval_ms(100)
        .api_key(ApiKey::new("team", &sha256(KEY)))
        .section("epp", "{ listen: 127.0.0.1:0 }")
        .section("limits", &format!("{{ max_body_bytes: {MAX_BODY} }}"))
        .section("admission", &format!("{{ max_queue: 8, max_wait_ms: {QUEUE_WAIT_MS} }}"))
        .section("models", "{ short: { targets: [ { model: m, weight: 1 } ] } }");
    // A key per transport whose token budget the first request spends: its charge is the
    // body's bytes at 4 a token, plus max_tokens (a request over the whole budget would be
    // refused outright, "Request too large").
    let one_charge = (completion("m").len() as f64 / 4.0).round() as u64 + 2;
    for tenant in poor {
        config = config.api_key(ApiKey::new(tenant, &sha256(&format!("sk-{tenant}"))).tokens_per_minute(one_charge));
    }
    let g = GatewayProc::start(&config);
    eventually("the engine is scraped and the dead one down", async || {
        let b = backends(&g).await;
        let list = b["backends"].as_array().cloned().unwrap_or_default();
        list.iter().any(|x| x["state"] == "up") && list.iter().any(|x| x["state"] == "down")
    })
    .await;
    let envoy = EnvoyProc::start(g.epp.expect("epp listening line"), false);
    let auth = format!("Bearer {KEY}");
    let mut failures = Vec::new();
    let transports = [(Transport::Http1, g.addr), (Transport::H2c, g.addr), (Transport::ExtProc, envoy.addr)];
    for (transport, addr) in transports {
        for c in cases() {
            let before = reached(&engine).len();
            let mut headers: Vec<(&str, &str)> = if c.key { vec![("authorization", auth.as_str())] } else { vec![] };
            if let Some(ct) = c.content_type {
                headers.push(("content-type", ct));
            }
            let started = Instant::now();
            let a = send_over(transport, addr, c.method, c.path, &headers, c.body.clone()).await;
            let mut wrong = Vec::new();
            if a.status != c.status {
                wrong.push(format!("status {} (expected {}): {}", a.status, c.status, a.body));
            }
            let now_reached = reached(&engine);
            if c.reaches_engine != (now_reached.len() > before) {
                wrong.push(format!("reached the engine: {:?}", &now_reached[before..]));
            }
            if c.status >= 400
                && serde_json::from_str::<serde_json::Value>(&a.body)
                    .map_or(true, |v| !v["error"]["message"].is_string())
            {
                wrong.push(format!("not the OpenAI error shape: {}", a.body));
            }
            match c.name {
                "unknown model" if !a.body.contains("model_not_found") => {
                    wrong.push(format!("no model_not_found: {}", a.body))
                }
                "queue timeout" => {
                    if started.elapsed() < Duration::from_millis(QUEUE_WAIT_MS) {
                        wrong.push(format!("answered after {:?}, before the queue's wait", started.elapsed()));
                    }
                    if !a.headers.contains_key("retry-after") {
                        wrong.push("no Retry-After".into());
                    }
                }
                "alias rewritten" => {
                    let body = engine.seen.requests.lock().unwrap().last().cloned().unwrap_or_default();
                    if !String::from_utf8_lossy(&body).contains(r#""model":"m""#) {
                        wrong.push(format!("the engine got {:?}", String::from_utf8_lossy(&body)));
                    }
                }
                "an inference route, escaped"
                    if now_reached.last().map(String::as_str) != Some("POST /v1/completions HTTP/1.1") =>
                {
                    wrong.push(format!("the engine got {:?}, not the normal form", now_reached.last()))
                }
                "the gateway's model list" if !a.body.contains("\"id\":\"m\"") => {
                    wrong.push(format!("not the gateway's list of the engines' models: {}", a.body))
                }
                _ => {}
            }
            if !wrong.is_empty() {
                failures.push(format!("{transport:?}: {} ({} {}): {}", c.name, c.method, c.path, wrong.join("; ")));
            }
        }
    }
    // Over the token budget: each transport's key spends it on a first request, the second is
    // refused with 429 and Retry-After, without reaching the engine.
    for ((transport, addr), tenant) in transports.into_iter().zip(poor) {
        let auth = format!("Bearer sk-{tenant}");
        let headers = [("authorization", auth.as_str())];
        let first = send_over(transport, addr, "POST", "/v1/completions", &headers, completion("m")).await;
        let before = reached(&engine).len();
        let second = send_over(transport, addr, "POST", "/v1/completions", &headers, completion("m")).await;
        let reached_engine = reached(&engine).len() > before;
        if first.status != 200 || second.status != 429 || !second.headers.contains_key("retry-after") || reached_engine
        {
            failures.push(format!(
                "{transport:?}: over budget: first {}, second {} ({}), retry-after {}, reached the engine {reached_engine}",
                first.status,
                second.status,
                second.body,
                second.headers.contains_key("retry-after")
            ));
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}\n{}", failures.len(), failures.join("\n"), g.log());
}
