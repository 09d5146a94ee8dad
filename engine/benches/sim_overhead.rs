//! Is the engine ever the bottleneck of a simulation?
//!
//! 1. `h100-llama3-8b`, 256 concurrent streams: CPU time of the engine process (from
//!    `/proc/PID/stat`) over wall time. Target: < 20% of one core.
//! 2. `instant` (zero-time steps), 256 concurrent streams: generated tokens/s delivered to
//!    clients with the engine pinned to one core. Target: ≥ 20,000 tokens/s.
//!
//! The engine runs as its own process, pinned to CPU 0 with `taskset` when available; this
//! client runs on the remaining core(s).
//!
//! `cargo bench -p switchyard-engine --bench sim_overhead`

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

const STREAMS: usize = 256;

struct Engine {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_engine(profile: &str) -> Engine {
    let bin = env!("CARGO_BIN_EXE_switchyard-engine");
    let args = ["--host", "127.0.0.1", "--port", "0", "--sim-profile", profile];
    let pinned = Command::new("taskset").arg("--version").output().is_ok();
    let mut cmd = if pinned {
        let mut c = Command::new("taskset");
        c.args(["-c", "0", bin]);
        c
    } else {
        eprintln!("taskset not found: the engine is not pinned");
        Command::new(bin)
    };
    let mut child = cmd.args(args).env("RUST_LOG", "warn").stdout(Stdio::piped()).spawn().expect("start engine");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("engine output");
    let addr = line.trim().strip_prefix("listening on http://").expect("listening line").parse().unwrap();
    Engine { child, addr }
}

/// CPU seconds (user + system) the process has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc stat");
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0 // USER_HZ is 100 on Linux
}

/// Keep one stream going until `until`, counting SSE events received.
async fn stream_loop(addr: SocketAddr, max_tokens: usize, until: Instant, tokens: Arc<AtomicU64>) {
    let body =
        format!(r#"{{"prompt":"{}","max_tokens":{max_tokens},"ignore_eos":true,"stream":true}}"#, " word".repeat(100));
    while Instant::now() < until {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        let conn = tokio::spawn(conn);
        let req = hyper::Request::post("/v1/completions")
            .header("host", "engine")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap();
        let mut resp = tx.send_request(req).await.unwrap().into_body();
        while let Some(frame) = resp.frame().await {
            if Instant::now() >= until {
                break;
            }
            if let Ok(data) = frame.unwrap().into_data() {
                let n = data.windows(6).filter(|w| w == b"data: ").count() as u64;
                tokens.fetch_add(n, Ordering::Relaxed);
            }
        }
        conn.abort();
    }
}

async fn drive(engine: &Engine, max_tokens: usize, warmup: Duration, window: Duration) -> (f64, f64) {
    let end = Instant::now() + warmup + window;
    let tokens = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> =
        (0..STREAMS).map(|_| tokio::spawn(stream_loop(engine.addr, max_tokens, end, tokens.clone()))).collect();
    tokio::time::sleep(warmup).await;
    let (t0, c0, n0) = (Instant::now(), cpu_seconds(engine.child.id()), tokens.load(Ordering::Relaxed));
    tokio::time::sleep(window).await;
    let (t1, c1, n1) = (Instant::now(), cpu_seconds(engine.child.id()), tokens.load(Ordering::Relaxed));
    for t in tasks {
        let _ = t.await;
    }
    let wall = (t1 - t0).as_secs_f64();
    ((c1 - c0) / wall, (n1 - n0) as f64 / wall)
}

#[tokio::main]
async fn main() {
    let engine = start_engine("h100-llama3-8b");
    let (cpu, tps) = drive(&engine, 400, Duration::from_secs(3), Duration::from_secs(10)).await;
    drop(engine);
    println!(
        "h100-llama3-8b, {STREAMS} streams: engine CPU {:.1}% of one core ({tps:.0} tokens/s delivered) — target < 20%: {}",
        cpu * 100.0,
        if cpu < 0.20 { "PASS" } else { "FAIL" }
    );

    let engine = start_engine("instant");
    let (cpu, tps) = drive(&engine, 2000, Duration::from_secs(2), Duration::from_secs(8)).await;
    drop(engine);
    println!(
        "instant, {STREAMS} streams, engine pinned to one core: {tps:.0} generated tokens/s (engine CPU {:.0}%) — target ≥ 20,000: {}",
        cpu * 100.0,
        if tps >= 20_000.0 { "PASS" } else { "FAIL" }
    );
}
