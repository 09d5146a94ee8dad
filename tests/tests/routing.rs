//! Prefix-aware routing end to end: the gateway's `cost` policy keeps a conversation on the
//! engine that has it cached, and that engine's prefix cache proves it.

use serde_json::json;
use switchyard_testkit::*;

const MODEL: &str = "meta-llama/Meta-Llama-3-8B-Instruct";

async fn routed(g: &GatewayProc) -> Vec<(String, u64)> {
    let b = backends(g).await;
    b["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| (x["url"].as_str().unwrap().to_string(), x["routed"].as_u64().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_conversation_stays_on_the_engine_that_cached_it() {
    let engines = [
        EngineProc::start(&["--sim-profile", "h100-llama3-8b"]),
        EngineProc::start(&["--sim-profile", "h100-llama3-8b"]),
    ];
    let g = GatewayProc::start(&GatewayConfigBuilder::new().backends(engines.iter().map(|e| e.url())).policy("cost"));
    wait_scraped(&g, 2).await;
    let hits_before: Vec<f64> = {
        let mut v = Vec::new();
        for e in &engines {
            v.push(metric(&scrape(e.addr).await, "vllm:prefix_cache_hits_total"));
        }
        v
    };

    // A 2,000-token system prompt (a document), then 10 turns of the same conversation.
    let mut messages = vec![json!({"role": "system", "content": prompt_of(2000, "d")})];
    let mut homes = Vec::new();
    for turn in 0..10 {
        messages
            .push(json!({"role": "user", "content": format!("question number {turn}: what does part {turn} say?")}));
        let before = routed(&g).await;
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8, "ignore_eos": true, "stream": true});
        let mut stream = post(g.addr, "/v1/chat/completions", &body).await;
        assert_eq!(stream.status, 200);
        let mut answer = String::new();
        while let Some(e) = stream.next_event().await {
            if e == "[DONE]" {
                break;
            }
            let v: serde_json::Value = serde_json::from_str(&e).unwrap();
            answer.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        }
        assert!(!answer.is_empty(), "turn {turn}: empty answer");
        messages.push(json!({"role": "assistant", "content": answer}));
        let after = routed(&g).await;
        let home: Vec<usize> = (0..2).filter(|&i| after[i].1 > before[i].1).collect();
        assert_eq!(home.len(), 1, "turn {turn}: {before:?} → {after:?}");
        homes.push(home[0]);
    }
    let home = homes[0];
    assert!(homes.iter().all(|&h| h == home), "turns went to {homes:?}\n{}", g.log());

    // The home engine's prefix cache served every later turn's conversation so far
    // (≥ 2,000 tokens each); the other engine saw nothing.
    let mut hits = Vec::new();
    for (i, e) in engines.iter().enumerate() {
        hits.push(metric(&scrape(e.addr).await, "vllm:prefix_cache_hits_total") - hits_before[i]);
    }
    assert!(hits[home] >= 9.0 * 2000.0, "prefix hits per engine: {hits:?}");
    assert_eq!(hits[1 - home], 0.0, "prefix hits per engine: {hits:?}");

    // The gateway's own view: 9 decisions by cache hit, match ratios recorded, index non-empty.
    let gm = scrape(g.admin).await;
    let prefix_hits = metric_where(&gm, "switchyard_routing_decisions_total", "reason", "prefix_hit");
    assert_eq!(prefix_hits, 9.0, "{}", g.log());
    assert!(metric(&gm, "switchyard_prefix_index_bytes") > 0.0);
    let ratio = gm.iter().find(|s| s.name == "switchyard_prefix_match_ratio").expect("match ratio histogram");
    match &ratio.value {
        SeriesValue::Histogram { count, buckets } => {
            assert_eq!(*count, 10.0);
            // The first turn matched nothing; every later turn matched ≥ 90% of its prompt.
            let below_09 = buckets.iter().find(|(le, _)| (*le - 0.9).abs() < 1e-9).unwrap().1;
            assert_eq!(below_09, 1.0, "{buckets:?}");
        }
        _ => panic!("not a histogram"),
    }
}

/// `cost` learns an engine's prefill rate from the first chunk that carries generated
/// content, not from the first byte (#19): an engine that flushes a role-only chunk at once
/// and its first token 600 ms later is learned at prompt ÷ ~0.6 s, shown in `/admin/backends`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_rate_is_learned_from_the_first_content_not_the_first_byte() {
    let engine = FaultEngine::start(Fault::RoleFirst { prefill_ms: 600 }).await;
    let g = GatewayProc::start(&GatewayConfigBuilder::new().backend_serving(&engine.url(), &["m"]).policy("cost"));
    wait_scraped(&g, 1).await;
    // ~2,000 prompt tokens by the gateway's estimate (4 bytes a token), well over the minimum sample.
    let prompt = "word ".repeat(1600);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": true});
    let r = post(g.addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200);
    let events = r.events().await;
    assert!(events.iter().any(|(_, e)| e == "[DONE]"), "{events:?}");
    let rate = eventually_value(&g).await;
    // Learned from the first byte it would be ~2,000 tokens in a millisecond or two: ≥ 500,000/s.
    assert!((1_000.0..=5_000.0).contains(&rate), "learned {rate:.0} tokens/s; ~3,300 expected (2,000 in 0.6 s)");
}

async fn eventually_value(g: &GatewayProc) -> f64 {
    let mut rate = None;
    eventually("a learned prefill rate", async || {
        rate = backends(g).await["backends"][0]["prefill_tokens_per_s"].as_f64();
        rate.is_some()
    })
    .await;
    rate.unwrap()
}

/// Two gateway replicas in front of the same idle engines send each prompt to the same
/// engine (#19): `cost` breaks ties by the request, not by a per-replica RNG. With random
/// tie-breaks 24 prompts would all agree with probability 2^-24.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_break_ties_alike() {
    let (e1, e2) = (FaultEngine::start(Fault::Healthy).await, FaultEngine::start(Fault::Healthy).await);
    let replica = || {
        GatewayProc::start(
            &GatewayConfigBuilder::new()
                .backend_serving(&e1.url(), &["m"])
                .backend_serving(&e2.url(), &["m"])
                .policy("cost")
                // The subject is the tie-break: a scrape made late on a busy machine must not
                // leave one replica with a stale signal (another score) and the other fresh.
                .stale_after_ms(60_000),
        )
    };
    let (a, b) = (replica(), replica());
    wait_scraped(&a, 2).await;
    wait_scraped(&b, 2).await;
    let engine_of = |before: usize, after: (usize, usize)| if after.0 > before { 0 } else { 1 };
    for i in 0..24 {
        let body = json!({"model": "m", "prompt": format!("prompt number {i} {}", "x".repeat(200))});
        let mut picks = Vec::new();
        for g in [&a, &b] {
            let before = e1.posts();
            assert_eq!(post(g.addr, "/v1/completions", &body).await.status, 200);
            picks.push(engine_of(before, (e1.posts(), e2.posts())));
        }
        assert_eq!(picks[0], picks[1], "prompt {i}: the replicas disagree");
    }
}
