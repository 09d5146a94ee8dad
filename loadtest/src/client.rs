//! The OpenAI client: one request, timed token by token.
//!
//! Requests go over a pooled HTTP/1.1 keep-alive client (hyper; `https://` targets over
//! rustls, trusting the CA given with `--ca-file`). A streamed response is
//! parsed as SSE while it arrives: each `data:` event with non-empty content (chat
//! `delta.content` or completions `text`) is a token arrival; the first gives TTFT, the
//! gaps between them ITL. `usage` (sent when `stream_options.include_usage` is on) gives
//! the token counts; without it the content chunks are counted. Failures are classified,
//! never raised: every request ends as a [`RequestRecord`].

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::record::RequestRecord;

/// Which OpenAI endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

impl Endpoint {
    /// URL path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// A target server: one base URL, or several replicas of one service that the requests are
/// spread over (`NAME=URL1,URL2,…`: request `i` goes to replica `i mod n`, as clients behind
/// a load balancer would).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Target {
    /// Name in reports.
    pub name: String,
    /// Base URL (`http://host:port`) of the first replica.
    pub base_url: String,
    /// The other replicas' base URLs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
}

impl Target {
    /// A target with one base URL.
    pub fn new(name: impl Into<String>, base_url: impl Into<String>) -> Target {
        Target { name: name.into(), base_url: base_url.into(), replicas: Vec::new() }
    }

    /// Every replica's base URL, the first one first.
    pub fn base_urls(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.base_url.as_str()).chain(self.replicas.iter().map(String::as_str))
    }

    /// The base URL request `id` goes to.
    pub fn url_for(&self, id: u64) -> &str {
        match (id % (1 + self.replicas.len() as u64)) as usize {
            0 => &self.base_url,
            i => &self.replicas[i - 1],
        }
    }
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, urls) = s.split_once('=').ok_or_else(|| format!("--target wants NAME=URL, got {s:?}"))?;
        if name.is_empty() {
            return Err(format!("--target {s:?}: empty name"));
        }
        let mut parsed = Vec::new();
        for url in urls.split(',') {
            let url = url.trim_end_matches('/').trim_end_matches("/v1");
            if !url.starts_with("http://") && !url.starts_with("https://") {
                return Err(format!("--target {s:?}: each URL must start with http:// or https://"));
            }
            url.parse::<hyper::Uri>().map_err(|e| format!("--target {s:?}: {e}"))?;
            parsed.push(url.to_string());
        }
        let base_url = parsed.remove(0);
        Ok(Target { name: name.to_string(), base_url, replicas: parsed })
    }
}

/// The shared HTTP client.
#[derive(Clone)]
pub struct OpenAiClient {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    api_key: Option<String>,
    timeout: Duration,
}

/// What the caller asks for.
pub struct Call<'a> {
    /// The base URL to send to (one of the target's replicas).
    pub base_url: &'a str,
    /// Endpoint.
    pub endpoint: Endpoint,
    /// JSON body (already containing `stream`).
    pub body: Bytes,
    /// Whether the body asks for streaming.
    pub stream: bool,
}

/// A finished call: the record and the generated text (multi-turn needs it).
pub struct CallResult {
    /// Measurements.
    pub record: RequestRecord,
    /// Concatenated output text.
    pub text: String,
}

impl OpenAiClient {
    /// A client with an optional API key, a per-request timeout, and the CA certificates
    /// (PEM) trusted for `https://` targets.
    pub fn new(api_key: Option<String>, timeout: Duration, ca_file: Option<&std::path::Path>) -> anyhow::Result<Self> {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.enforce_http(false);
        let mut roots = rustls::RootCertStore::empty();
        if let Some(path) = ca_file {
            let pem = std::fs::read(path).map_err(|e| anyhow::anyhow!("--ca-file {}: {e}", path.display()))?;
            use rustls::pki_types::pem::PemObject;
            for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
                roots.add(cert.map_err(|e| anyhow::anyhow!("--ca-file {}: {e}", path.display()))?)?;
            }
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(usize::MAX)
            .build(https);
        Ok(OpenAiClient { http, api_key, timeout })
    }

    /// The first model `base_url/v1/models` lists.
    pub async fn first_model(&self, base_url: &str) -> anyhow::Result<String> {
        use anyhow::Context;
        let mut req = hyper::Request::get(format!("{base_url}/v1/models"));
        if let Some(k) = &self.api_key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let resp = self
            .http
            .request(req.body(Full::new(Bytes::new()))?)
            .await
            .with_context(|| format!("GET {base_url}/v1/models"))?;
        let body = resp.into_body().collect().await?.to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).context("/v1/models is not JSON")?;
        v["data"][0]["id"].as_str().map(str::to_string).context("no model listed by the first target; pass --model")
    }

    /// Fill the pool with `n` keep-alive connections to `base_url` (n concurrent
    /// `GET /v1/models`).
    pub async fn prewarm(&self, base_url: &str, n: usize) -> anyhow::Result<()> {
        for listed in futures_util::future::join_all((0..n).map(|_| self.first_model(base_url))).await {
            listed?;
        }
        Ok(())
    }

    /// Run one call; never fails, the outcome is in the record.
    pub async fn call(&self, c: Call<'_>, mut record: RequestRecord) -> CallResult {
        let start = Instant::now();
        let mut text = String::new();
        let outcome = tokio::time::timeout(self.timeout, self.exchange(&c, start, &mut record, &mut text)).await;
        record.e2e_ms = ms(start.elapsed());
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(kind)) => record.error = Some(kind),
            Err(_) => record.error = Some("timeout".into()),
        }
        CallResult { record, text }
    }

    async fn exchange(
        &self,
        c: &Call<'_>,
        start: Instant,
        r: &mut RequestRecord,
        text: &mut String,
    ) -> Result<(), String> {
        let uri = format!("{}{}", c.base_url, c.endpoint.path());
        let mut req = hyper::Request::post(uri).header("content-type", "application/json");
        if let Some(k) = &self.api_key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let req = req.body(Full::new(c.body.clone())).map_err(|_| "bad_request".to_string())?;
        let resp = self.http.request(req).await.map_err(|e| {
            if e.is_connect() {
                "connect".to_string()
            } else {
                "http_error".to_string()
            }
        })?;
        let status = resp.status().as_u16();
        r.status = Some(status);
        let mut body = resp.into_body();
        if status >= 400 {
            let _ = body.collect().await;
            return Err(if status >= 500 { "http_5xx".into() } else { "http_4xx".into() });
        }
        if !c.stream {
            let bytes = body.collect().await.map_err(|_| "body_error".to_string())?.to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|_| "malformed_response".to_string())?;
            let choice = &v["choices"][0];
            text.push_str(choice["message"]["content"].as_str().or(choice["text"].as_str()).unwrap_or(""));
            read_usage(&v, r);
            if r.output_tokens == 0 {
                r.output_tokens = u64::from(!text.is_empty());
            }
            return Ok(());
        }
        let mut sse = SseParser::default();
        let mut last_token: Option<Instant> = None;
        let mut chunks = 0u64;
        let mut done = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| "stream_broken".to_string())?;
            let Ok(data) = frame.into_data() else { continue };
            let now = Instant::now();
            for event in sse.push(&data) {
                if event == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(&event).map_err(|_| "malformed_stream".to_string())?;
                if v.get("error").is_some() {
                    return Err("stream_error".into());
                }
                read_usage(&v, r);
                let choice = &v["choices"][0];
                let piece = choice["delta"]["content"].as_str().or(choice["text"].as_str()).unwrap_or("");
                if !piece.is_empty() {
                    text.push_str(piece);
                    chunks += 1;
                    match last_token {
                        None => r.ttft_ms = Some(ms(now - start)),
                        Some(t) => r.itl_ms.push(ms(now - t)),
                    }
                    last_token = Some(now);
                }
            }
        }
        if !done {
            return Err("truncated".into());
        }
        if r.output_tokens == 0 {
            r.output_tokens = chunks;
        }
        Ok(())
    }
}

fn read_usage(v: &serde_json::Value, r: &mut RequestRecord) {
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        r.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(r.prompt_tokens);
        r.output_tokens = u["completion_tokens"].as_u64().unwrap_or(r.output_tokens);
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Incremental SSE parser: bytes in, `data:` payloads out.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Feed bytes; returns the `data` payload of every complete event.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end + sep).collect();
            let event = String::from_utf8_lossy(&event[..end]);
            let mut data = String::new();
            for line in event.lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    if !data.is_empty() {
                        data.push('\n');
                    }
                    data.push_str(d.strip_prefix(' ').unwrap_or(d));
                }
            }
            if !data.is_empty() {
                out.push(data);
            }
        }
        out
    }
}

fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_chunks() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b":1}\n\ndata: [DONE]\n"), vec!["{\"a\":1}".to_string()]);
        assert_eq!(p.push(b"\n"), vec!["[DONE]".to_string()]);
        assert_eq!(p.push(b": comment\r\n\r\ndata:x\r\n\r\n"), vec!["x".to_string()]);
    }

    #[test]
    fn targets_parse_name_and_url() {
        let t: Target = "gw=http://127.0.0.1:8080/v1/".parse().unwrap();
        assert_eq!(t, Target::new("gw", "http://127.0.0.1:8080"));
        assert!("http://x".parse::<Target>().is_err());
        let t: Target = "gw=http://a:1,http://b:2/v1".parse().unwrap();
        assert_eq!(t.base_urls().collect::<Vec<_>>(), ["http://a:1", "http://b:2"]);
        assert_eq!([t.url_for(0), t.url_for(1), t.url_for(2)], ["http://a:1", "http://b:2", "http://a:1"]);
        assert!("gw=http://a:1,ftp://b".parse::<Target>().is_err());
        assert!("a=ftp://x".parse::<Target>().is_err());
    }
}
