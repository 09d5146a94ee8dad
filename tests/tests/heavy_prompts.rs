//! Prompts that cost CPU (#44). A megabyte of random letters is one "word" to a BPE
//! tokenizer and seconds of work; tokenized on the threads that serve connections, a few
//! such prompts stalled every other client's stream for seconds. The engine and a
//! tokenizing gateway must keep other streams flowing while they work, and refuse what
//! could never fit before spending the work.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use switchyard_testkit::*;

/// The attack's prompt size.
const ATTACK_BYTES: usize = 1536 * 1024;

/// The attack on the gateway.
const GATEWAY_ATTACK_BYTES: usize = 1024 * 1024;

/// `n` pseudo-random lowercase letters.
fn random_letters(n: usize, seed: u64) -> String {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

/// Streams `body` from `addr`'s `path` again and again until `stop` is set: the longest gap
/// between two events of one stream, and how many streams ran to their end.
async fn longest_gap(addr: SocketAddr, path: &'static str, body: Value, stop: Arc<AtomicBool>) -> (Duration, usize) {
    let (mut worst, mut streams) = (Duration::ZERO, 0);
    while !stop.load(Ordering::SeqCst) {
        let mut r = post(addr, path, &body).await;
        assert_eq!(r.status, 200);
        let mut last = None;
        while let Some(event) = r.next_event().await {
            let now = Instant::now();
            if let Some(before) = last.replace(now) {
                worst = worst.max(now - before);
            }
            if event == "[DONE]" {
                streams += 1;
            }
        }
    }
    (worst, streams)
}

/// While `attack` runs, streams run back to back beside it: the longest gap between two of
/// their events.
async fn worst_gap_during<T>(
    addr: SocketAddr,
    path: &'static str,
    body: Value,
    attack: impl Future<Output = T>,
) -> (Duration, T) {
    let stop = Arc::new(AtomicBool::new(false));
    let streaming = tokio::spawn(longest_gap(addr, path, body, stop.clone()));
    // The first stream is under way before the attack starts.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = attack.await;
    stop.store(true, Ordering::SeqCst);
    let (worst, streams) = streaming.await.unwrap();
    assert!(streams >= 1, "no stream ran beside the attack");
    (worst, out)
}

/// `n` requests at once, each with its own `bytes` of random letters as `prompt`: their
/// statuses and bodies.
async fn at_once(addr: SocketAddr, path: &str, n: usize, bytes: usize) -> Vec<(u16, String)> {
    let sends = (0..n).map(|i| {
        let b = json!({"prompt": random_letters(bytes, 7 + i as u64), "max_tokens": 1});
        async move {
            let r = post(addr, path, &b).await;
            let status = r.status;
            (status, r.text().await)
        }
    });
    futures_util::future::join_all(sends).await
}

fn tokenizer_path() -> String {
    switchyard_engine::model::default_model_path().to_str().unwrap().to_string()
}

/// Four 1.5 MiB random-letter prompts at the engine: with a cap above them they are
/// tokenized — on the preparation threads, while another client's stream goes on at its
/// pace — and refused for their token count; at the default cap they are refused unread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn megabyte_prompts_do_not_stall_the_engines_other_streams() {
    let tok = tokenizer_path();
    let stream = json!({"prompt": "hi", "max_tokens": 150, "ignore_eos": true, "stream": true});
    let engine =
        EngineProc::start(&["--sim-profile", "h100-llama3-8b", "--tokenizer", &tok, "--max-prompt-bytes", "2000000"]);
    let started = Instant::now();
    let (gap, answers) = worst_gap_during(engine.addr, "/v1/completions", stream.clone(), async {
        at_once(engine.addr, "/v1/completions", 4, ATTACK_BYTES).await
    })
    .await;
    eprintln!(
        "engine: longest inter-token gap {gap:?} while four 1.5 MiB prompts were tokenized ({:?})",
        started.elapsed()
    );
    for (status, body) in &answers {
        assert_eq!(*status, 400, "{body}");
        assert!(body.contains("maximum context length"), "tokenized, then refused for its length: {body}");
    }
    assert!(gap < Duration::from_secs(1), "another client's stream stalled {gap:?}");

    // The default cap (8,192 tokens x 32 bytes) refuses them before tokenizing, on every
    // route that tokenizes.
    let engine = EngineProc::start(&["--sim-profile", "h100-llama3-8b", "--tokenizer", &tok]);
    let started = Instant::now();
    let long = random_letters(ATTACK_BYTES, 1);
    for (path, body) in [
        ("/v1/completions", json!({"prompt": long})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": long}]})),
        ("/tokenize", json!({"prompt": long})),
        ("/v1/embeddings", json!({"input": ["short", long]})),
        ("/v1/responses", json!({"input": long})),
    ] {
        let r = post(engine.addr, path, &body).await;
        assert_eq!(r.status, 400, "{path}");
        let err = r.json().await;
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains("--max-prompt-bytes") && message.contains("262144"), "{path}: {err}");
    }
    assert!(started.elapsed() < Duration::from_secs(5), "refused unread: {:?}", started.elapsed());
    // A prompt at the cap is still served.
    let r = post(engine.addr, "/tokenize", &json!({"prompt": "hello ".repeat(1000)})).await;
    assert_eq!(r.status, 200);
}

/// Four 1 MiB random-letter prompts at a gateway that tokenizes for the precise index, on
/// one core beside another client's stream: over `kv_events.tokenize_max_bytes` (the
/// default 512 KiB) they are routed by the approximate index untokenized; under a cap that
/// lets them in, they are tokenized on the pool while the stream goes on, and routed
/// without their keys once `tokenize_timeout_ms` passes. Each outcome is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn megabyte_prompts_do_not_stall_a_tokenizing_gateway() {
    let engine = EngineProc::start(&["--sim-profile", "h100-llama3-8b"]);
    let tok = tokenizer_path();
    let stream = json!({"prompt": "hi", "max_tokens": 150, "ignore_eos": true, "stream": true});
    for (kv, outcome) in [
        (format!("{{ block_size: 16, tokenizer: {tok:?} }}"), "too_large"),
        (
            format!("{{ block_size: 16, tokenizer: {tok:?}, tokenize_max_bytes: 2000000, tokenize_timeout_ms: 100 }}"),
            "timeout",
        ),
    ] {
        let config =
            GatewayConfigBuilder::new().backends([engine.url()]).policy("cost").threads(1).section("kv_events", &kv);
        let g = GatewayProc::start(&config);
        wait_scraped(&g, 1).await;
        let started = Instant::now();
        let (gap, answers) = worst_gap_during(g.addr, "/v1/completions", stream.clone(), async {
            at_once(g.addr, "/v1/completions", 4, GATEWAY_ATTACK_BYTES).await
        })
        .await;
        eprintln!(
            "gateway ({outcome}): longest inter-token gap {gap:?} beside four 1 MiB prompts ({:?})",
            started.elapsed()
        );
        // The engine refuses them (over its --max-prompt-bytes): what matters is the way there.
        for (status, body) in &answers {
            assert_eq!(*status, 400, "{body}");
        }
        assert!(gap < Duration::from_secs(1), "{outcome}: another client's stream stalled {gap:?}");
        let m = scrape(g.admin).await;
        let counted = |o: &str| metric_where(&m, "switchyard_prompt_tokenizations_total", "outcome", o);
        assert_eq!(counted(outcome), 4.0, "{outcome}");
        assert!(counted("precise") >= 1.0, "the streams' own prompts were tokenized");
        let b = backends(&g).await;
        assert_eq!(b["tokenizer"]["outcomes"][outcome], 4, "{b}");
    }
}
