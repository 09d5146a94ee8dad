//! `switchyard-loadtest` against real engines: its numbers agree with the engine's own
//! histograms, its report files are valid, and `cluster` starts and tears down a cluster.

use std::process::Command;

use switchyard_testkit::*;

fn loadtest(args: &[&str]) -> std::process::Output {
    let out = Command::new(workspace_bin("switchyard-loadtest")).args(args).output().expect("run loadtest");
    assert!(out.status.success(), "loadtest failed:\n{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn histogram(s: &Scrape, name: &str) -> (Vec<(f64, f64)>, f64) {
    match &s.iter().find(|x| x.name == name).unwrap_or_else(|| panic!("no {name}")).value {
        SeriesValue::Histogram { buckets, count } => (buckets.clone(), *count),
        v => panic!("{name} is not a histogram: {v:?}"),
    }
}

fn hist_sum(text: &str, name: &str) -> f64 {
    let line = text.lines().find(|l| l.starts_with(&format!("{name}_sum"))).unwrap_or_else(|| panic!("no {name}_sum"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// The loadtest's samples and the engine's histogram describe the same distribution:
/// equal means (±10%, the histogram's sum is exact) and, at every bucket boundary, the
/// same share of samples below it (±0.1) — percentiles agree to the histogram's resolution.
/// The engine stamps a token when it sends it and the client when it reads it: on a loaded
/// machine a read can come a few milliseconds late (and the next gap is as much shorter), so
/// the client's share is taken a little either side of each boundary (5 ms + 10%).
fn agree(what: &str, samples_ms: &[f64], buckets: &[(f64, f64)], count: f64, sum_s: f64) {
    assert_eq!(samples_ms.len() as f64, count, "{what}: the engine saw as many as the client measured");
    let client_mean = samples_ms.iter().sum::<f64>() / samples_ms.len() as f64;
    let engine_mean = sum_s / count * 1e3;
    assert!(
        (client_mean - engine_mean).abs() / engine_mean < 0.10,
        "{what}: mean {client_mean:.2} ms vs engine {engine_mean:.2} ms"
    );
    for &(le, cum) in buckets {
        if !le.is_finite() {
            continue;
        }
        let share = |ms: f64| samples_ms.iter().filter(|&&x| x <= ms).count() as f64 / samples_ms.len() as f64;
        let slack_ms = 5.0 + 0.1 * le * 1e3;
        let (low, high) = (share(le * 1e3 - slack_ms), share(le * 1e3 + slack_ms));
        let engine = cum / count;
        assert!(
            low - 0.1 <= engine && engine <= high + 0.1,
            "{what}: share ≤ {le}s is {engine:.2} for the engine; the client's is {low:.2} at {slack_ms:.1} ms \
             below and {high:.2} at {slack_ms:.1} ms above ({:.2} at the boundary)",
            share(le * 1e3)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loadtest_latencies_agree_with_the_engine_histograms_and_reports_are_valid() {
    // ~3,800-token prompts: TTFT ≈ 160 ms (inside one histogram bucket), ITL ≈ 7.6 ms.
    let engine = EngineProc::start(&["--sim-profile", "h100-llama3-8b"]);
    let out = scratch_dir("loadtest");
    let url = format!("e={}", engine.url());
    let out_s = out.to_string_lossy().to_string();
    loadtest(&[
        "run",
        "--target",
        &url,
        "--endpoint",
        "completions",
        "--input-len",
        "3800",
        "--output-len",
        "20",
        "--concurrency",
        "1",
        "--requests",
        "8",
        "--seed",
        "3",
        "--out",
        &out_s,
    ]);
    let text = send(engine.addr, "GET", "/metrics", bytes::Bytes::new()).await.text().await;
    let metrics = parse_metrics(&text);

    let records: Vec<serde_json::Value> = std::fs::read_to_string(out.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 8);
    assert!(records.iter().all(|r| r["error"].is_null() && r["output_tokens"] == 20), "{records:?}");
    let ttft: Vec<f64> = records.iter().map(|r| r["ttft_ms"].as_f64().unwrap()).collect();
    let itl: Vec<f64> =
        records.iter().flat_map(|r| r["itl_ms"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap())).collect();
    let (b, c) = histogram(&metrics, "vllm:time_to_first_token_seconds");
    agree("TTFT", &ttft, &b, c, hist_sum(&text, "vllm:time_to_first_token_seconds"));
    let (b, c) = histogram(&metrics, "vllm:inter_token_latency_seconds");
    agree("ITL", &itl, &b, c, hist_sum(&text, "vllm:inter_token_latency_seconds"));

    // summary.json: the documented schema.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["schema_version"], 1);
    let t = &summary["targets"][0];
    for key in [
        "target",
        "point",
        "label",
        "completed",
        "failed",
        "errors",
        "duration_s",
        "requests_per_s",
        "output_tokens_per_s",
        "total_tokens_per_s",
    ] {
        assert!(t.get(key).is_some(), "summary.json target lacks {key}: {t}");
    }
    for dist in ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"] {
        for q in ["count", "mean", "p50", "p90", "p95", "p99", "max"] {
            assert!(t[dist][q].is_number(), "{dist}.{q} missing: {t}");
        }
    }
    assert_eq!(t["completed"], 8);
    // Plots: SVG text and decodable-looking PNGs.
    for name in ["ttft_cdf", "itl_cdf"] {
        let svg = std::fs::read_to_string(out.join(format!("{name}.svg"))).unwrap();
        assert!(svg.contains("<svg"), "{name}.svg");
        let png = std::fs::read(out.join(format!("{name}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{name}.png");
    }
    assert!(std::fs::read_to_string(out.join("report.md")).unwrap().contains("| e |"));
}

#[test]
fn cluster_runs_a_sweep_through_the_gateway_and_tears_everything_down() {
    let out = scratch_dir("cluster");
    let out_s = out.to_string_lossy().to_string();
    loadtest(&[
        "cluster",
        "--engines",
        "2",
        "--sim-profile",
        "instant",
        "--policy",
        "round_robin",
        "--",
        "--requests",
        "20",
        "--concurrency",
        "2,4",
        "--input-len",
        "20",
        "--output-len",
        "5",
        "--out",
        &out_s,
    ]);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let points = summary["targets"].as_array().unwrap();
    assert_eq!(points.len(), 2, "one summary per sweep point");
    assert!(points.iter().all(|p| p["completed"] == 20 && p["target"] == "gateway"));
    let cluster = &summary["config"]["cluster"];
    let engines = cluster["engines"].as_array().unwrap();
    assert_eq!(engines.len(), 2);
    let generated: f64 = engines.iter().map(|e| e["generation_tokens"].as_f64().unwrap()).sum();
    assert_eq!(generated, 200.0, "2 points × 20 requests × 5 tokens");
    assert!(engines.iter().all(|e| e["generation_tokens"].as_f64().unwrap() == 100.0), "round_robin splits evenly");
    assert!(out.join("latency_throughput.png").exists(), "a sweep draws the latency–throughput curve");
    // Torn down: nothing listens on the engines' ports any more.
    for e in engines {
        let addr = e["url"].as_str().unwrap().trim_start_matches("http://");
        assert!(std::net::TcpStream::connect(addr).is_err(), "{addr} still listening");
    }
}

/// `cluster --gateways 2 --kv-events --tokenizer` (#19's benchmark): two gateway replicas
/// subscribed to engines that publish KV events and tokenize with the real model; the
/// requests are spread over both replicas, and each replica's CPU time is reported.
#[test]
fn cluster_spreads_requests_over_gateway_replicas_with_kv_events() {
    let out = scratch_dir("cluster-replicas");
    let out_s = out.to_string_lossy().to_string();
    let model = switchyard_engine::model::default_model_path();
    loadtest(&[
        "cluster",
        "--engines",
        "2",
        "--sim-profile",
        "instant",
        "--gateways",
        "2",
        "--kv-events",
        "--tokenizer",
        model.to_str().unwrap(),
        "--",
        "--workload",
        "shared-prefix",
        "--groups",
        "2",
        "--prefix-len",
        "200",
        "--requests",
        "20",
        "--concurrency",
        "2",
        "--input-len",
        "20",
        "--output-len",
        "4",
        "--out",
        &out_s,
    ]);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let target = &summary["targets"][0];
    assert_eq!((&target["target"], &target["completed"]), (&serde_json::json!("gateway"), &serde_json::json!(20)));
    let cluster = &summary["config"]["cluster"];
    assert_eq!((&cluster["gateways"], &cluster["kv_events"]), (&serde_json::json!(2), &serde_json::json!(true)));
    let cpu = cluster["gateway_cpu_s"].as_array().unwrap();
    assert_eq!(cpu.len(), 2, "one CPU figure per replica: {cpu:?}");
    // Both replicas ran with the tokenizer (which replica each request goes to is `Target::url_for`'s
    // unit test: request i to replica i mod n).
    for n in 0..2 {
        let log = std::fs::read_to_string(out.join(format!("cluster/gateway{n}.log"))).unwrap();
        assert!(log.contains("tokenizer loaded"), "replica {n} loaded the tokenizer: {log}");
    }
    let hit = cluster["prefix_cache_hit_rate"].as_f64().unwrap();
    assert!(hit > 0.5, "two groups of a 200-token prefix, 20 requests: the engines' caches hit ({hit})");
}

#[test]
fn failures_are_counted_by_kind_and_never_crash_the_run() {
    let engine = EngineProc::start(&["--sim-profile", "instant"]);
    let dead = format!("dead=http://127.0.0.1:{}", free_port());
    let wrong_model = format!("wrong={}", engine.url());
    let out = scratch_dir("loadtest-errors");
    let out_s = out.to_string_lossy().to_string();
    loadtest(&[
        "run",
        "--target",
        &dead,
        "--target",
        &wrong_model,
        "--model",
        "no-such-model",
        "--endpoint",
        "completions",
        "--concurrency",
        "2",
        "--requests",
        "6",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--out",
        &out_s,
    ]);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let by_target =
        |name: &str| summary["targets"].as_array().unwrap().iter().find(|t| t["target"] == name).unwrap().clone();
    let dead = by_target("dead");
    assert_eq!((dead["completed"].as_u64(), dead["failed"].as_u64()), (Some(0), Some(6)), "{dead}");
    assert_eq!(dead["errors"]["connect"], 6, "{dead}");
    let wrong = by_target("wrong");
    assert_eq!(wrong["errors"]["http_4xx"], 6, "{wrong}");
    assert!(std::fs::read_to_string(out.join("report.md")).unwrap().contains("http_4xx"));
}
