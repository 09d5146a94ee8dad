//! A raw HTTP/1.1 client for tests: one connection per request, chunk-by-chunk reads,
//! explicit disconnects, SSE parsing, and `/metrics` parsed by a real Prometheus parser.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

/// A response whose body is read chunk by chunk; dropping it closes the connection.
pub struct Resp {
    /// Status code.
    pub status: u16,
    /// Response headers.
    pub headers: hyper::HeaderMap,
    body: Incoming,
    conn: tokio::task::JoinHandle<()>,
    buf: String,
}

/// Send one request on a new connection and wait for the response header.
pub async fn send(addr: SocketAddr, method: &str, path: &str, body: impl Into<Bytes>) -> Resp {
    send_with(addr, method, path, &[], body).await
}

/// [`send`] with extra request headers.
pub async fn send_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Resp {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = hyper::Request::builder().method(method).uri(path).header("host", addr.to_string());
    // JSON unless the caller says otherwise.
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
        req = req.header("content-type", "application/json");
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into())).unwrap();
    let resp = sender.send_request(req).await.expect("response");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    Resp { status, headers, body: resp.into_body(), conn, buf: String::new() }
}

/// Write `bytes` on a new connection and read until the server closes it or `limit`
/// passes: what came back, and whether the server closed the connection.
pub async fn raw_exchange(addr: SocketAddr, bytes: &[u8], limit: Duration) -> (String, bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(bytes).await.expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&out).into(), true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&out).into(), false),
        }
    }
}

/// An HTTP/2 connection with prior knowledge (h2c) to `addr`: the request sender, and the
/// task that drives the connection (it ends when the connection closes).
pub async fn h2c_connect(
    addr: SocketAddr,
) -> (hyper::client::conn::http2::SendRequest<Full<Bytes>>, tokio::task::JoinHandle<hyper::Result<()>>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (sender, conn) = hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), TokioIo::new(tcp))
        .await
        .expect("h2c handshake");
    (sender, tokio::spawn(conn))
}

/// Read from `s` (what the server sends is dropped) until the server closes it: how long that
/// took from `since`, or `None` when it stayed open for [`PATIENCE`].
pub async fn closed_after(s: &mut (impl tokio::io::AsyncRead + Unpin), since: Instant) -> Option<Duration> {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(PATIENCE, s.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return Some(since.elapsed()),
            Ok(Ok(_)) => {}
            Err(_) => return None,
        }
    }
}

/// POST a JSON body.
pub async fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Resp {
    send(addr, "POST", path, body.to_string()).await
}

impl Resp {
    /// The whole body as text.
    pub async fn text(self) -> String {
        let bytes = self.body.collect().await.expect("body").to_bytes();
        String::from_utf8(bytes.to_vec()).expect("utf-8 body")
    }

    /// The whole body as JSON.
    pub async fn json(self) -> serde_json::Value {
        let t = self.text().await;
        serde_json::from_str(&t).unwrap_or_else(|e| panic!("not JSON ({e}): {t}"))
    }

    /// The next SSE `data:` payload, or `None` at the end of the body.
    pub async fn next_event(&mut self) -> Option<String> {
        self.try_next_event().await.unwrap_or_else(|e| panic!("body error: {e}"))
    }

    /// [`Resp::next_event`], with a broken body (the server cut the connection) as an error.
    pub async fn try_next_event(&mut self) -> Result<Option<String>, String> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                let data = event.trim_end().strip_prefix("data: ").unwrap_or_else(|| panic!("not SSE: {event:?}"));
                return Ok(Some(data.to_string()));
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.push_str(std::str::from_utf8(&d).expect("utf-8"));
                    }
                }
                Some(Err(e)) => return Err(e.to_string()),
                None => return Ok(None),
            }
        }
    }

    /// Every remaining event with its arrival time.
    pub async fn events(mut self) -> Vec<(Instant, String)> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event().await {
            out.push((Instant::now(), e));
        }
        out
    }

    /// Close the connection now (the client goes away).
    pub fn disconnect(self) {
        self.conn.abort();
        drop(self.body);
    }
}

/// One parsed series.
#[derive(Debug, Clone)]
pub struct Series {
    /// Metric name (`_total` kept, histogram suffixes folded).
    pub name: String,
    /// Labels.
    pub labels: std::collections::HashMap<String, String>,
    /// Value.
    pub value: SeriesValue,
}

/// A series' value.
#[derive(Debug, Clone)]
pub enum SeriesValue {
    /// Counter or gauge.
    Scalar(f64),
    /// `(upper bound, cumulative count)` per bucket, and the total count.
    Histogram {
        /// Buckets.
        buckets: Vec<(f64, f64)>,
        /// Observations.
        count: f64,
    },
}

/// All series of one scrape.
pub type Scrape = Vec<Series>;

/// Scrape `/metrics` and parse it with a real Prometheus text-format parser.
pub async fn scrape(addr: SocketAddr) -> Scrape {
    let text = send(addr, "GET", "/metrics", Bytes::new()).await.text().await;
    parse_metrics(&text)
}

/// Parse Prometheus text; panics with the text when it is invalid.
pub fn parse_metrics(text: &str) -> Scrape {
    use openmetrics_parser::PrometheusValue as V;
    let exposition = openmetrics_parser::prometheus::parse_prometheus(text)
        .unwrap_or_else(|e| panic!("invalid Prometheus text ({e:?}):\n{text}"));
    let mut out = Vec::new();
    for (name, family) in &exposition.families {
        for sample in family.iter_samples() {
            let labels = sample.get_labelset().expect("labels").iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            let value = match &sample.value {
                V::Counter(c) => SeriesValue::Scalar(c.value.as_f64()),
                V::Gauge(g) | V::Unknown(g) => SeriesValue::Scalar(g.as_f64()),
                V::Histogram(h) => SeriesValue::Histogram {
                    buckets: h.buckets.iter().map(|b| (b.upper_bound, b.count.as_f64())).collect(),
                    count: h.count.map_or(0.0, |c| c as f64),
                },
                V::Summary(_) => continue,
            };
            out.push(Series { name: name.clone(), labels, value });
        }
    }
    out
}

/// The value of a gauge or counter (summed over its label sets).
pub fn metric(s: &Scrape, name: &str) -> f64 {
    let mut found = false;
    let mut sum = 0.0;
    for x in s.iter().filter(|x| x.name == name) {
        found = true;
        match x.value {
            SeriesValue::Scalar(v) => sum += v,
            _ => panic!("{name} is not a scalar"),
        }
    }
    assert!(found, "no metric {name}");
    sum
}

/// The value of a gauge or counter summed over the label sets where `label` is `value`
/// (0 when there is none).
pub fn metric_where(s: &Scrape, name: &str, label: &str, value: &str) -> f64 {
    s.iter()
        .filter(|x| x.name == name && x.labels.get(label).is_some_and(|v| v == value))
        .map(|x| match x.value {
            SeriesValue::Scalar(v) => v,
            _ => panic!("{name} is not a scalar"),
        })
        .sum()
}

/// How long a test waits for something that should happen promptly (a scrape, a reload, a
/// freed request, a log line): generous, because a loaded 2-core machine may run a test
/// several times slower. A bound that is a measurement belongs to the `timing` test group or
/// to a benchmark, not here.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// Poll `cond` every 20 ms until it holds (how long that took), or panic naming `what`
/// after [`PATIENCE`].
pub async fn eventually(what: &str, mut cond: impl AsyncFnMut() -> bool) -> Duration {
    let start = Instant::now();
    loop {
        if cond().await {
            return start.elapsed();
        }
        assert!(start.elapsed() < PATIENCE, "{what}: not within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Poll until `cond` holds on a scrape, or panic after `within`.
pub async fn wait_for_metrics(
    addr: SocketAddr,
    within: Duration,
    what: &str,
    cond: impl Fn(&Scrape) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let s = scrape(addr).await;
        if cond(&s) {
            return start.elapsed();
        }
        assert!(start.elapsed() < within, "{what}: not reached within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A text of exactly `n` sim tokens (each " k123" is one token).
pub fn prompt_of(n: usize, salt: &str) -> String {
    assert_eq!(salt.len(), 1, "one letter + 3 digits = one token");
    (0..n).map(|i| format!(" {}{:03}", salt, i % 1000)).collect()
}

/// The gateway's `/admin/backends` as JSON.
pub async fn backends(g: &crate::procs::GatewayProc) -> serde_json::Value {
    send(g.admin, "GET", "/admin/backends", Bytes::new()).await.json().await
}

/// Wait until `n` of the gateway's backends are up with a signal and a model list.
pub async fn wait_scraped(g: &crate::procs::GatewayProc, n: usize) {
    let start = Instant::now();
    loop {
        let b = backends(g).await;
        let ready = b["backends"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| {
                x["state"] == "up" && !x["signal"].is_null() && x["models"].as_array().is_some_and(|m| !m.is_empty())
            })
            .count();
        if ready >= n {
            return;
        }
        assert!(start.elapsed() < PATIENCE, "backends not scraped: {b}\n{}", g.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
