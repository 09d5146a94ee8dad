//! A scripted fault engine: a minimal HTTP/1.1 server, in the test process, that speaks
//! just enough of an engine's API (`/metrics` in vLLM's names, `/v1/models`, POSTs) to be
//! scraped and routed to, and then misbehaves as told: error statuses, stalls before or
//! during a stream, resets. It records what reached it, so tests can prove what did not.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How the engine answers a POST (scrapes and `/v1/models` always succeed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// 200 with a small completion (`stream: true` bodies get a short SSE stream).
    Healthy,
    /// Answer with this status and an OpenAI-shaped error (`Retry-After: 1` on 503); a 204
    /// with no body and `content-length: 0`.
    Status(u16),
    /// Answer every POST with exactly these bytes (a response head and body as an engine
    /// that breaks the rules writes them), keeping the connection.
    Raw(&'static str),
    /// Read the request, never answer.
    StallBeforeHeader,
    /// Send the SSE header and `n` events, then never send more.
    StallMidStream(usize),
    /// Close the connection as soon as the request is read.
    Reset,
    /// A stream that flushes a role-only chat chunk at once and its first token only after
    /// `prefill_ms` (what engines do during a long prefill), then a few more tokens.
    RoleFirst {
        /// Time from the role chunk to the first token.
        prefill_ms: u64,
    },
    /// A healthy stream of `events` events, `gap_ms` apart (a long generation).
    Slow {
        /// Events before `[DONE]`.
        events: usize,
        /// Pause between two events.
        gap_ms: u64,
    },
}

/// What the engine has seen.
#[derive(Debug, Default)]
pub struct Seen {
    /// Every request line read (`GET /metrics HTTP/1.1`, scrapes included), in order.
    pub lines: Mutex<Vec<String>>,
    /// POST requests read (head as received, body decoded when chunked).
    pub requests: Mutex<Vec<Vec<u8>>>,
    /// Connections accepted (scrapes included).
    pub connections: AtomicUsize,
    /// Connections currently open.
    pub open: AtomicUsize,
    /// Stalled exchanges whose connection the peer closed.
    pub stalls_closed: AtomicUsize,
    /// Streamed answers cut off before their end because the peer closed the connection.
    pub streams_cut: AtomicUsize,
    /// POSTs that came on a connection an earlier POST came on (the peer reused it).
    pub reused_posts: AtomicUsize,
}

/// A running fault engine; dropping it stops accepting.
pub struct FaultEngine {
    /// Where it listens.
    pub addr: SocketAddr,
    fault: Arc<Mutex<Fault>>,
    /// What reached it.
    pub seen: Arc<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultEngine {
    /// Start on a free loopback port serving model `m`.
    pub async fn start(fault: Fault) -> FaultEngine {
        Self::start_on(0, fault).await
    }

    /// Start on loopback `port` (0: any) serving model `m`.
    pub async fn start_on(port: u16, fault: Fault) -> FaultEngine {
        let listener = TcpListener::bind(("127.0.0.1", port)).await.expect("bind");
        let addr = listener.local_addr().unwrap();
        let fault = Arc::new(Mutex::new(fault));
        let seen = Arc::new(Seen::default());
        let (f, s) = (fault.clone(), seen.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                s.connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream, f.clone(), s.clone()));
            }
        });
        FaultEngine { addr, fault, seen, task }
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Change the behaviour of later requests.
    pub fn set(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
    }

    /// POSTs received so far.
    pub fn posts(&self) -> usize {
        self.seen.requests.lock().unwrap().len()
    }
}

impl Drop for FaultEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Open(Arc<Seen>);
impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn serve(mut stream: TcpStream, fault: Arc<Mutex<Fault>>, seen: Arc<Seen>) {
    seen.open.fetch_add(1, Ordering::SeqCst);
    let _open = Open(seen.clone());
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::new();
    let mut posts = 0;
    loop {
        let Some((head_len, body_len)) = read_request(&mut stream, &mut buf).await else { return };
        let request: Vec<u8> = buf.drain(..head_len + body_len).collect();
        let head = String::from_utf8_lossy(&request[..head_len]).to_string();
        let line = head.lines().next().unwrap_or("").to_string();
        seen.lines.lock().unwrap().push(line.clone());
        let ok = if line.starts_with("GET /metrics") {
            write(&mut stream, 200, "text/plain", METRICS).await
        } else if line.starts_with("GET /v1/models") {
            write(&mut stream, 200, "application/json", r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#)
                .await
        } else if line.starts_with("GET /health") {
            write(&mut stream, 200, "text/plain", "ok").await
        } else if line.starts_with("POST ") {
            let body = &request[head_len..];
            let streamed = String::from_utf8_lossy(body).contains("\"stream\":true");
            seen.requests.lock().unwrap().push(request.clone());
            if posts > 0 {
                seen.reused_posts.fetch_add(1, Ordering::SeqCst);
            }
            posts += 1;
            let now = fault.lock().unwrap().clone();
            match now {
                Fault::Healthy if streamed => sse(&mut stream, 3, 5, &seen).await,
                Fault::Slow { events, gap_ms } => sse(&mut stream, events, gap_ms, &seen).await,
                Fault::RoleFirst { prefill_ms } => {
                    let head =
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                    let role =
                        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
                    if stream.write_all(format!("{head}{}", chunk(role)).as_bytes()).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(prefill_ms)).await;
                    let mut rest = String::new();
                    for event in
                        ["data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n", "data: [DONE]\n\n"]
                    {
                        rest.push_str(&chunk(event));
                    }
                    rest.push_str("0\r\n\r\n");
                    stream.write_all(rest.as_bytes()).await.is_ok()
                }
                Fault::Healthy => {
                    let b = r#"{"id":"cmpl-f","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
                    write(&mut stream, 200, "application/json", b).await
                }
                Fault::Raw(bytes) => stream.write_all(bytes.as_bytes()).await.is_ok(),
                Fault::Status(204) => {
                    stream.write_all(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n").await.is_ok()
                }
                Fault::Status(code) => {
                    let b = format!(
                        r#"{{"error":{{"message":"scripted {code}","type":"server_error","param":null,"code":{code}}}}}"#
                    );
                    write(&mut stream, code, "application/json", &b).await
                }
                Fault::StallBeforeHeader => {
                    // Hold the connection open, answering nothing, until the peer leaves.
                    let mut sink = [0u8; 1024];
                    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                    seen.stalls_closed.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                Fault::StallMidStream(n) => {
                    if !sse_events(&mut stream, n, 5).await {
                        return;
                    }
                    let mut sink = [0u8; 1024];
                    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                    seen.stalls_closed.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                Fault::Reset => return,
            }
        } else {
            write(&mut stream, 404, "text/plain", "not found").await
        };
        if !ok {
            return;
        }
    }
}

/// Read more of the connection into `buf`; None at EOF.
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 16 * 1024];
    let n = stream.read(&mut chunk).await.ok().filter(|&n| n > 0)?;
    buf.extend_from_slice(&chunk[..n]);
    Some(())
}

/// The end of the line starting at `at` in `buf` (reading more as needed).
async fn line_end(stream: &mut TcpStream, buf: &mut Vec<u8>, at: usize) -> Option<usize> {
    loop {
        if let Some(i) = buf[at..].windows(2).position(|w| w == b"\r\n") {
            return Some(at + i);
        }
        fill(stream, buf).await?;
    }
}

/// Decode the chunked body that starts at `head_len` in `buf`: afterwards `buf` holds the head,
/// the decoded body and whatever followed. The decoded length, or None at EOF.
async fn dechunk(stream: &mut TcpStream, buf: &mut Vec<u8>, head_len: usize) -> Option<usize> {
    let (mut body, mut at) = (Vec::new(), head_len);
    loop {
        let end = line_end(stream, buf, at).await?;
        let size = String::from_utf8_lossy(&buf[at..end]).split(';').next()?.trim().to_string();
        let size = usize::from_str_radix(&size, 16).ok()?;
        at = end + 2;
        if size == 0 {
            // Trailers, up to an empty line.
            loop {
                let end = line_end(stream, buf, at).await?;
                let empty = end == at;
                at = end + 2;
                if empty {
                    break;
                }
            }
            break;
        }
        while buf.len() < at + size + 2 {
            fill(stream, buf).await?;
        }
        body.extend_from_slice(&buf[at..at + size]);
        at += size + 2;
    }
    let rest = buf.split_off(at);
    buf.truncate(head_len);
    buf.extend_from_slice(&body);
    buf.extend_from_slice(&rest);
    Some(body.len())
}

/// Read one request into `buf` (a chunked body decoded): (head length, body length), or None
/// at EOF.
async fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(usize, usize)> {
    let mut chunk = [0u8; 16 * 1024];
    let head_len = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await.ok().filter(|&n| n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_len]).to_ascii_lowercase();
    if head.lines().any(|l| l.starts_with("transfer-encoding:") && l.contains("chunked")) {
        let body_len = dechunk(stream, buf, head_len).await?;
        return Some((head_len, body_len));
    }
    let body_len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
        .unwrap_or(0);
    while buf.len() < head_len + body_len {
        let n = stream.read(&mut chunk).await.ok().filter(|&n| n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    }
    Some((head_len, body_len))
}

async fn write(stream: &mut TcpStream, status: u16, content_type: &str, body: &str) -> bool {
    let retry = if status == 503 { "retry-after: 1\r\n" } else { "" };
    let msg = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n{retry}\r\n{body}",
        body.len()
    );
    stream.write_all(msg.as_bytes()).await.is_ok()
}

/// Header and `n` events of an SSE stream (chunked), `gap_ms` apart; false when the peer left.
async fn sse_events(stream: &mut TcpStream, n: usize, gap_ms: u64) -> bool {
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    if stream.write_all(head.as_bytes()).await.is_err() {
        return false;
    }
    for i in 0..n {
        let event = format!("data: {{\"choices\":[{{\"index\":0,\"text\":\"t{i}\"}}]}}\n\n");
        if stream.write_all(chunk(&event).as_bytes()).await.is_err() {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(gap_ms)).await;
    }
    true
}

/// `data` as one HTTP/1.1 chunk.
fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

/// `n` events and `[DONE]`; a write failing on the way is counted in `streams_cut`.
async fn sse(stream: &mut TcpStream, n: usize, gap_ms: u64, seen: &Seen) -> bool {
    let tail = format!("{}0\r\n\r\n", chunk("data: [DONE]\n\n"));
    let whole = sse_events(stream, n, gap_ms).await && stream.write_all(tail.as_bytes()).await.is_ok();
    if !whole {
        seen.streams_cut.fetch_add(1, Ordering::SeqCst);
    }
    whole
}

const METRICS: &str = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 0\n\
# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 0\n\
# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.0\n";
