//! Heap allocations the gateway makes per request, counted by a counting global allocator
//! (issue #23: where the CPU goes is measured, not guessed).
//!
//! The gateway runs in this process (`switchyard_gateway::run`, its default configuration:
//! the `cost` policy, the access log, metrics) over the binary's allocator (`switchyard_gateway::alloc`), in front
//! of a real `switchyard-engine --sim-profile instant` process. One client thread sends
//! streamed 16-in/16-out completions one after another on one keep-alive connection; its own
//! allocations are not counted. Everything else in the process is: the request path on
//! pingora's threads, and whatever the background tasks (the scraper) do meanwhile, spread
//! over the requests.
//!
//! `cargo bench -p switchyard-tests --bench gateway_allocations` (loadtest/bench/allocations.sh
//! builds the engine first and applies the bar). Prints allocations and bytes per request on
//! stderr (stdout carries the access log); exits 1 when `SWITCHYARD_ALLOC_BAR` (allocations
//! per request) is set and exceeded, 2 on a setup error.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Requests counted, after `WARMUP` that open the engine connection and fill the pools.
const REQUESTS: u64 = 2000;
const WARMUP: u64 = 200;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the client thread: what the load generator allocates is not the gateway's.
    static NOT_COUNTED: Cell<bool> = const { Cell::new(false) };
}

/// The gateway binary's allocator, counting every allocation and reallocation.
struct Counting;

impl Counting {
    fn count(size: usize) {
        if !NOT_COUNTED.get() {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(size as u64, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call is forwarded unchanged to the gateway's allocator; counting touches no memory it hands out.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::count(layout.size());
        unsafe { switchyard_gateway::alloc::Mimalloc.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::count(layout.size());
        unsafe { switchyard_gateway::alloc::Mimalloc.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::count(new_size);
        unsafe { switchyard_gateway::alloc::Mimalloc.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { switchyard_gateway::alloc::Mimalloc.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn main() -> ExitCode {
    NOT_COUNTED.set(true);
    match measure() {
        Ok((allocations, bytes)) => {
            eprintln!(
                "gateway allocations per request (default config, streamed 16/16 completions, \
                 {REQUESTS} after {WARMUP} warm-up): {allocations:.1} allocations, {bytes:.0} bytes"
            );
            match std::env::var("SWITCHYARD_ALLOC_BAR").ok().map(|b| b.parse::<f64>()) {
                None => ExitCode::SUCCESS,
                Some(Ok(bar)) if allocations <= bar => {
                    eprintln!("bar: ≤ {bar} allocations per request: met ({allocations:.1})");
                    ExitCode::SUCCESS
                }
                Some(Ok(bar)) => {
                    eprintln!("bar: ≤ {bar} allocations per request: MISSED ({allocations:.1})");
                    ExitCode::from(1)
                }
                Some(Err(e)) => {
                    eprintln!("setup error: SWITCHYARD_ALLOC_BAR: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Err(e) => {
            eprintln!("setup error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Allocations and bytes per request.
fn measure() -> Result<(f64, f64), String> {
    let engine_bin = std::env::var_os("SWITCHYARD_ENGINE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/switchyard-engine"));
    let mut engine = Engine::start(&engine_bin)?;
    let model = engine.model()?;

    let dir = std::env::temp_dir().join(format!("switchyard-alloc-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (listen, admin) = (free_addr()?, free_addr()?);
    let path = dir.join("gateway.yaml");
    let yaml =
        format!("listen: {listen}\nadmin_listen: {admin}\ndiscovery:\n  static:\n    - url: http://{}\n", engine.addr);
    std::fs::write(&path, yaml).map_err(|e| format!("{}: {e}", path.display()))?;
    let config = switchyard_gateway::GatewayConfig::load(&path).map_err(|e| format!("gateway config: {e}"))?;
    std::thread::spawn(move || {
        if let Err(e) = switchyard_gateway::run(config, path) {
            eprintln!("setup error: the gateway stopped: {e:#}");
            std::process::exit(2);
        }
    });
    wait_ready(listen)?;

    let body = format!(
        r#"{{"model":"{model}","prompt":"The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun","max_tokens":16,"stream":true,"ignore_eos":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {listen}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut client = Client::connect(listen)?;
    for _ in 0..WARMUP {
        client.exchange(request.as_bytes())?;
    }
    let (a0, b0) = (ALLOCATIONS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
    for _ in 0..REQUESTS {
        client.exchange(request.as_bytes())?;
    }
    let (a1, b1) = (ALLOCATIONS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
    engine.stop();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(((a1 - a0) as f64 / REQUESTS as f64, (b1 - b0) as f64 / REQUESTS as f64))
}

fn free_addr() -> Result<SocketAddr, String> {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| format!("bind 127.0.0.1:0: {e}"))
}

/// The `instant` sim engine as a child process.
struct Engine {
    child: Child,
    addr: String,
}

impl Engine {
    fn start(bin: &PathBuf) -> Result<Engine, String> {
        let mut child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", "0", "--backend", "sim", "--sim-profile", "instant"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e} (build it: cargo build --release -p switchyard-engine)", bin.display()))?;
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or("engine stdout")?;
        BufReader::new(stdout).read_line(&mut line).map_err(|e| format!("engine stdout: {e}"))?;
        match line.trim().strip_prefix("listening on http://") {
            Some(addr) => Ok(Engine { addr: addr.to_string(), child }),
            None => {
                let _ = child.kill();
                Err(format!("the engine did not start: {line:?}"))
            }
        }
    }

    /// The served model's id, from `/v1/models`.
    fn model(&self) -> Result<String, String> {
        let (status, body) = get(&self.addr, "/v1/models")?;
        let json: serde_json::Value = serde_json::from_str(&body).map_err(|e| format!("/v1/models: {e}"))?;
        match (status, json["data"][0]["id"].as_str()) {
            (200, Some(id)) => Ok(id.to_string()),
            _ => Err(format!("/v1/models answered {status}: {body}")),
        }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A one-shot `GET` (connection closed after): status and body.
fn get(addr: &str, path: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").map_err(|e| e.to_string())?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(|e| format!("GET {path}: {e}"))?;
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    Ok((status, body))
}

fn wait_ready(addr: SocketAddr) -> Result<(), String> {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        if matches!(get(&addr.to_string(), "/-/ready"), Ok((200, _))) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("the gateway on {addr} did not become ready in 30 s"))
}

/// One keep-alive connection sending a request and reading its chunked response whole.
struct Client {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    fn connect(addr: SocketAddr) -> Result<Client, String> {
        let stream = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        Ok(Client { stream, buf: Vec::with_capacity(1 << 16) })
    }

    fn exchange(&mut self, request: &[u8]) -> Result<(), String> {
        self.stream.write_all(request).map_err(|e| format!("send: {e}"))?;
        self.buf.clear();
        let mut chunk = [0u8; 16 * 1024];
        while !self.complete() {
            let n = self
                .stream
                .read(&mut chunk)
                .map_err(|e| format!("read: {e}; so far: {}", String::from_utf8_lossy(&self.buf)))?;
            if n == 0 {
                return Err(format!("the gateway closed the connection: {}", String::from_utf8_lossy(&self.buf)));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
        if !self.buf.starts_with(b"HTTP/1.1 200") || !self.buf.windows(12).any(|w| w == b"data: [DONE]") {
            return Err(format!("unexpected response: {}", String::from_utf8_lossy(&self.buf)));
        }
        Ok(())
    }

    /// Whether `buf` holds a whole response: its `Content-Length`, or the last chunk.
    fn complete(&self) -> bool {
        let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") else { return false };
        let head = String::from_utf8_lossy(&self.buf[..end]).to_ascii_lowercase();
        match head.split("\r\n").find_map(|l| l.strip_prefix("content-length:")) {
            Some(len) => len.trim().parse::<usize>().is_ok_and(|len| self.buf.len() >= end + 4 + len),
            None => self.buf.ends_with(b"\r\n0\r\n\r\n"),
        }
    }
}
