//! The load generator's own ceiling, on one core.
//!
//! 1. Overhead: 300 sequential short streamed completions against `switchyard-engine
//!    --sim-profile instant`, timed by a minimal reference client (one raw keep-alive TCP
//!    socket, a pre-serialized request, TTFT = first `data:` bytes) and by
//!    switchyard-loadtest's client; prints both TTFT p50/mean and the difference (target ≤ 1 ms).
//! 2. Ceiling: 1,000 concurrent streams of short completions; prints requests/s
//!    (target ≥ 2,000 with 1,000 streams open).
//!
//! The engine is pinned to CPU 0 and this process to CPU 1 (`taskset`).
//! `cargo build --release -p switchyard-engine && cargo bench -p switchyard-loadtest --bench ceiling`

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use switchyard_loadtest::client::{Call, Endpoint, OpenAiClient, Target};
use switchyard_loadtest::record::RequestRecord;
use switchyard_loadtest::runner::{self, Arrival, Load, RunPlan};
use switchyard_loadtest::workload::{LengthDist, Workload, WorkloadKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MODEL: &str = "meta-llama/Meta-Llama-3-8B-Instruct";
const BODY: &str = r#"{"model":"meta-llama/Meta-Llama-3-8B-Instruct","prompt":"hello there my old friend","max_tokens":4,"ignore_eos":true,"stream":true}"#;

fn p50(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Minimal client: one socket, raw bytes, stop at `[DONE]`.
async fn reference_ttfts(addr: &str, n: usize) -> Vec<f64> {
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.set_nodelay(true).unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: e\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let mut buf = vec![0u8; 64 * 1024];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        sock.write_all(req.as_bytes()).await.unwrap();
        let mut seen = Vec::new();
        let mut ttft = None;
        loop {
            let k = sock.read(&mut buf).await.unwrap();
            assert!(k > 0, "engine closed the connection");
            seen.extend_from_slice(&buf[..k]);
            assert!(seen.len() < 12 || seen.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&seen));
            if ttft.is_none() && seen.windows(6).any(|w| w == b"data: ") {
                ttft = Some(start.elapsed().as_secs_f64() * 1e3);
            }
            if seen.windows(12).any(|w| w == b"data: [DONE]") && seen.ends_with(b"0\r\n\r\n") {
                break;
            }
        }
        out.push(ttft.unwrap());
    }
    out
}

fn main() {
    let pinned = Command::new("taskset").args(["-cp", "1", &std::process::id().to_string()]).output().is_ok();
    let bin = std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().join("switchyard-engine");
    assert!(bin.exists(), "{} missing: cargo build --release -p switchyard-engine", bin.display());
    let mut cmd = if pinned {
        let mut c = Command::new("taskset");
        c.args(["-c", "0"]).arg(&bin);
        c
    } else {
        Command::new(&bin)
    };
    let mut engine = cmd
        .args(["--host", "127.0.0.1", "--port", "0", "--sim-profile", "instant", "--max-num-seqs", "1024"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(engine.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on http://").unwrap().to_string();

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    rt.block_on(async {
        let n = 300;
        reference_ttfts(&addr, 50).await; // warm-up
        let reference = reference_ttfts(&addr, n).await;
        let client = OpenAiClient::new(None, Duration::from_secs(60), None).expect("client");
        let target = Target::new("e", format!("http://{addr}"));
        let mut ours = Vec::with_capacity(n);
        for i in 0..(n + 50) {
            let call = Call { base_url: &target.base_url, endpoint: Endpoint::Completions, body: bytes::Bytes::from(BODY), stream: true };
            let record = RequestRecord::started("e", i as u64, 0, 0.0, false);
            let r = client.call(call, record).await.record;
            assert!(r.error.is_none(), "{:?}", r.error);
            if i >= 50 {
                ours.push(r.ttft_ms.unwrap());
            }
        }
        let (rp, op) = (p50(reference.clone()), p50(ours.clone()));
        println!(
            "TTFT, {n} sequential requests: reference client p50 {rp:.3} ms (mean {:.3}), switchyard-loadtest p50 {op:.3} ms (mean {:.3}); overhead p50 {:+.3} ms — target ≤ 1 ms: {}",
            mean(&reference),
            mean(&ours),
            op - rp,
            if op - rp <= 1.0 { "PASS" } else { "FAIL" }
        );

        let plan = RunPlan {
            targets: vec![target.clone()],
            model: MODEL.into(),
            endpoint: Endpoint::Completions,
            workload: Workload {
                kind: WorkloadKind::Synthetic,
                input: LengthDist::Fixed { n: 8 },
                output: LengthDist::Fixed { n: 4 },
                seed: 1,
            },
            loads: vec![Load::Concurrency(1000)],
            arrival: Arrival::Poisson,
            burst_size: 1,
            requests: None,
            duration_s: Some(8.0),
            warmup: 0,
            stream: true,
            ignore_eos: true,
        };
        let pb = indicatif::ProgressBar::hidden();
        let res = runner::run_point(&plan, &client, &target, 0, pb).await;
        let ok = res.records.iter().filter(|r| r.error.is_none()).count();
        let rps = ok as f64 / res.duration_s;
        println!(
            "1,000 concurrent streams on one core: {rps:.0} requests/s ({ok} ok, {} failed) — target ≥ 2,000: {}",
            res.records.len() - ok,
            if rps >= 2000.0 { "PASS" } else { "FAIL" }
        );
    });
    let _ = engine.kill();
    let _ = engine.wait();
}
