//! Tenant limits that hold across gateway replicas (#19): with `auth.shared_limits` every
//! replica keeps a key's request rate in one real `redis-server`, so four replicas admit what
//! one would; with Redis gone each replica falls back to its share (limit ÷ replicas seen),
//! and no request gets a 5xx.

use std::time::{Duration, Instant};

use serde_json::json;
use switchyard_testkit::*;

/// The key's burst: GCRA with a burst of 1 loses the part of each interval before the next
/// arrival; a few requests of tolerance let the admitted rate settle at the limit.
const BURST: u32 = 8;

/// The key's token budget: large enough never to refuse here; its hash in Redis shows the
/// charges went there.
const TOKENS_PER_MINUTE: u64 = 1_000_000;

/// A field of a Redis hash, read with `redis-cli` (installed with `redis-server`).
fn hget(redis: &RedisProc, key: &str, field: &str) -> Option<f64> {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &redis.addr.port().to_string(), "HGET", key, field])
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// SHA-256 of `test`, the key every request presents.
const KEY_SHA256: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

/// Offer `rate` requests/s for `secs`, spread over `gateways` in turn, each request on its own
/// task (so a slow answer does not slow the offer). Returns (admitted, refused with 429,
/// other statuses, the seconds between the first and the last request).
async fn offer(gateways: &[GatewayProc], rate: f64, secs: f64) -> (usize, usize, Vec<u16>, f64) {
    let body = json!({"model": "m", "prompt": "hi", "max_tokens": 1}).to_string();
    let n = (rate * secs) as usize;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        tokio::time::sleep_until((start + Duration::from_secs_f64(i as f64 / rate)).into()).await;
        let addr = gateways[i % gateways.len()].addr;
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            send_with(addr, "POST", "/v1/completions", &[("authorization", "Bearer test")], body).await.status
        }));
    }
    let elapsed = start.elapsed().as_secs_f64();
    let (mut ok, mut limited, mut other) = (0, 0, Vec::new());
    for t in tasks {
        match t.await.unwrap() {
            200 => ok += 1,
            429 => limited += 1,
            s => other.push(s),
        }
    }
    (ok, limited, other, elapsed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_replicas_admit_one_keys_rate_once_and_fall_back_to_shares_without_redis() {
    let mut redis = RedisProc::start();
    let engine = FaultEngine::start(Fault::Healthy).await;
    let config = GatewayConfigBuilder::new()
        .backend_serving(&engine.url(), &["m"])
        .api_key(
            ApiKey::new("t", KEY_SHA256).requests_per_second(10.0).burst(BURST).tokens_per_minute(TOKENS_PER_MINUTE),
        )
        .shared_limits(&format!("{{ redis_url: \"{}\", key_prefix: test }}", redis.url()));
    let replicas: Vec<GatewayProc> = (0..4).map(|_| GatewayProc::start(&config)).collect();
    for g in &replicas {
        wait_scraped(g, 1).await;
    }
    // Every replica has seen the four beat (the fallback divides by that).
    eventually("every replica sees four replicas", async || {
        let mut all = true;
        for g in &replicas {
            all &= backends(g).await["shared_limits"]["replicas_seen"] == 4;
        }
        all
    })
    .await;

    // 40 requests/s offered over four replicas for 5 s: Redis admits the key's 10/s.
    let (ok, limited, other, secs) = offer(&replicas, 40.0, 5.0).await;
    let rate = (ok as f64 - f64::from(BURST)) / secs;
    eprintln!("shared: {ok} admitted, {limited} refused in {secs:.2} s: {rate:.1} req/s");
    assert!(other.is_empty(), "only 200 and 429: {other:?}");
    assert!((8.0..=12.0).contains(&rate), "the cluster admitted {rate:.1} req/s for a key limited to 10");
    // The token budget lives in Redis too: charged by every replica and settled there (it
    // refills faster than these small requests use it, so only its presence is checked).
    let key = format!("test:tokens:{KEY_SHA256}");
    let level = hget(&redis, &key, "level").expect("the budget is kept in Redis");
    assert!(level <= TOKENS_PER_MINUTE as f64 && hget(&redis, &key, "ts").is_some(), "{key}: level {level}");

    // Redis dies: each replica enforces a quarter of the rate on its own; nothing fails.
    redis.kill();
    let (ok, limited, other, secs) = offer(&replicas, 40.0, 5.0).await;
    // Each replica's share: a quarter of the rate, a quarter of the burst.
    let rate = (ok as f64 - f64::from(BURST)) / secs;
    eprintln!("fallback: {ok} admitted, {limited} refused in {secs:.2} s: {rate:.1} req/s");
    assert!(other.is_empty(), "no 5xx while Redis is gone: {other:?}");
    assert!((6.0..=14.0).contains(&rate), "the replicas' shares admitted {rate:.1} req/s for a key limited to 10");
    let mut fallbacks = 0.0;
    for g in &replicas {
        fallbacks +=
            metric_where(&scrape(g.admin).await, "switchyard_shared_limits_unavailable_total", "decision", "local");
        assert_eq!(backends(g).await["shared_limits"]["redis_available"], false);
    }
    assert!(fallbacks >= 150.0, "every decision without Redis is counted: {fallbacks}");
}
