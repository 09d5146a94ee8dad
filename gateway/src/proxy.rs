//! The request path: one OpenAI request from the client to an engine and back.
//!
//! The gateway owns the upstream leg instead of using pingora's stock proxy loop, whose
//! retry buffer silently drops request bodies over 64 KiB (see PINGORA-NOTES.md). Per request:
//!
//! 1. read the whole body, capped at `limits.max_body_bytes` (413, checked against
//!    `Content-Length` before reading) and `timeouts.request_body_ms` (408);
//! 2. parse just `model` and `stream` ([`crate::request`]); the body is forwarded untouched;
//! 3. build candidates from the current snapshot (backends serving the model, up, not yet
//!    tried) and let the policy pick; count the request in flight at once;
//! 4. on pingora's pooled connector: connect, send header and body, wait for the response
//!    header — while watching the client, so a client that leaves during a long prefill
//!    closes the upstream connection and the engine aborts the request;
//! 5. a connection failure, or a failure on a *reused* pooled connection before any response
//!    byte, is retried on another backend (never after anything reached the client);
//! 6. stream the body chunk by chunk as it arrives (chunked HTTP/1 writes are flushed
//!    each time); if the engine dies mid-stream, an SSE stream ends with a final
//!    `data: {"error": …}` event instead of a silent truncation;
//! 7. release the upstream connection to the pool only after a clean end.
//!
//! Every request leaves one JSON access-log line ([`crate::access_log`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::apps::{HttpPersistentSettings, HttpServerApp, HttpServerOptions, ReusedHttpStream};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::client::HttpSession;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use pingora::upstreams::peer::HttpPeer;

use crate::access_log::{now_ms, AccessLine};
use crate::cluster::{Backend, BackendState};
use crate::config::GatewayConfig;
use crate::error::ProxyError;
use crate::policy::prefix_index::block_hashes;
use crate::policy::RouteInput;
use crate::request::{canonical_prompt, routing_fields};
use crate::state::{Active, GatewayState};

/// Headers that describe one hop and are never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
];

/// The OpenAI API listener.
pub struct ProxyApp {
    state: Arc<GatewayState>,
    options: HttpServerOptions,
}

impl ProxyApp {
    /// A proxy over `state`; accepts HTTP/1.1 and cleartext HTTP/2 (h2c).
    pub fn new(state: Arc<GatewayState>) -> Self {
        let mut options = HttpServerOptions::default();
        options.h2c = true;
        ProxyApp { state, options }
    }
}

/// What one request did, for the access log and metrics.
#[derive(Debug, Default)]
struct Log {
    model: Option<String>,
    backend: Option<String>,
    status: u16,
    reason: Option<&'static str>,
    ttft: Option<Duration>,
    request_bytes: usize,
    response_bytes: usize,
    chunks: usize,
    retries: u32,
    error_kind: Option<&'static str>,
    stream: bool,
}

/// Outcome of one attempt on one backend before anything reached the client.
enum AttemptError {
    /// Nothing reached the engine's application (or a pooled connection was dead): try another.
    Retryable { kind: &'static str, message: String },
    /// Answer the client with this.
    Fatal { kind: &'static str, error: ProxyError },
    /// The client went away.
    ClientGone,
}

/// Keeps a backend's in-flight count, and its pending prefill tokens until the first
/// byte, while a request is on it.
struct InflightGuard<'a> {
    backend: &'a Backend,
    /// This request's uncached prompt tokens, still counted as pending prefill.
    pending: u64,
    /// Prefill work ahead of and including this request at dispatch (for rate learning).
    work: u64,
    /// Learn the prefill rate from this request's first byte (streams only: a
    /// non-streamed response's first byte comes after the whole generation).
    learn: bool,
    dispatched: Instant,
}

impl<'a> InflightGuard<'a> {
    fn new(backend: &'a Backend, pending: u64, work: u64, learn: bool) -> Self {
        backend.inflight.fetch_add(1, Ordering::Relaxed);
        backend.routed.fetch_add(1, Ordering::Relaxed);
        backend.pending_prefill_tokens.fetch_add(pending, Ordering::Relaxed);
        InflightGuard { backend, pending, work, learn, dispatched: Instant::now() }
    }

    /// The first response chunk arrived: the prefill is done.
    fn first_byte(&mut self) {
        if self.learn {
            self.backend.observe_prefill(self.work, self.dispatched.elapsed().as_secs_f64());
        }
        self.backend.pending_prefill_tokens.fetch_sub(std::mem::take(&mut self.pending), Ordering::Relaxed);
    }
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.backend.inflight.fetch_sub(1, Ordering::Relaxed);
        self.backend.pending_prefill_tokens.fetch_sub(self.pending, Ordering::Relaxed);
    }
}

#[async_trait]
impl HttpServerApp for ProxyApp {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        match session.read_request().await {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                tracing::debug!(error = %e, "failed to read a request header");
                return None;
            }
        }
        session.set_keepalive(if *shutdown.borrow() { None } else { Some(60) });
        let reusable = self.handle(&mut session).await;
        if !reusable {
            return None;
        }
        let settings = HttpPersistentSettings::for_session(&session);
        match session.finish().await {
            Ok(stream) => stream.map(|s| ReusedHttpStream::from_reusable_stream(s, settings)),
            Err(_) => None,
        }
    }

    fn server_options(&self) -> Option<&HttpServerOptions> {
        Some(&self.options)
    }
}

impl ProxyApp {
    /// Serve one request; true when the downstream connection may be reused.
    async fn handle(&self, s: &mut ServerSession) -> bool {
        let started = Instant::now();
        let method = s.req_header().method.as_str().to_string();
        let path = s.req_header().uri.path().to_string();
        let mut log = Log::default();
        let reusable = match (method.as_str(), path.as_str()) {
            ("GET", "/-/healthz") => respond(s, 200, "text/plain", Bytes::from_static(b"ok\n"), None).await,
            ("GET", "/-/ready") => {
                let (status, body) = self.readiness();
                respond(s, status, "text/plain", Bytes::from(body), None).await
            }
            ("GET", "/v1/models") => {
                let body = self.models_body();
                respond(s, 200, "application/json", Bytes::from(body), None).await
            }
            ("POST", "/v1/chat/completions" | "/v1/completions") => self.proxy(s, &path, started, &mut log).await,
            (_, "/-/healthz" | "/-/ready" | "/v1/models" | "/v1/chat/completions" | "/v1/completions") => {
                self.fail(s, ProxyError::MethodNotAllowed(method.clone()), &mut log).await
            }
            _ => self.fail(s, ProxyError::NoRoute(path.clone()), &mut log).await,
        };
        if log.status == 0 && !path.starts_with("/-/") {
            log.status = 200;
        }
        self.finish_log(&method, &path, started, &log);
        reusable
    }

    fn readiness(&self) -> (u16, String) {
        if self.state.draining.load(Ordering::SeqCst) {
            return (503, "draining\n".into());
        }
        let active = self.state.active.load();
        let now = Instant::now();
        let down_after = active.config.scrape.down_after_failures;
        let up = active.cluster.backends.iter().filter(|b| b.state(now, down_after) == BackendState::Up).count();
        if up > 0 {
            (200, format!("ready: {up} routable backends\n"))
        } else {
            (503, "no routable backend\n".into())
        }
    }

    fn models_body(&self) -> String {
        let active = self.state.active.load();
        let data: Vec<_> = active
            .cluster
            .models()
            .into_iter()
            .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "switchyard"}))
            .collect();
        serde_json::json!({"object": "list", "data": data}).to_string()
    }

    async fn fail(&self, s: &mut ServerSession, e: ProxyError, log: &mut Log) -> bool {
        log.status = e.status();
        log.error_kind = Some(e.kind());
        let retry_after = e.retry_after_secs();
        // A request whose body was not (fully) read cannot leave a reusable connection.
        let body_done = s.is_body_done();
        if !body_done {
            s.set_keepalive(None);
        }
        respond(s, e.status(), "application/json", Bytes::from(e.body()), retry_after).await && body_done
    }

    /// The admission queue ([`crate::config::AdmissionConfig`]): returns at once when an
    /// engine is up and not saturated for `model` (or the model is unknown while others are
    /// known: a 404 is due), else waits for one until the deadline. Errors are 503 with
    /// `Retry-After`. Waiters poll the cluster view (updated by every scrape) every 20 ms.
    async fn admit(&self, model: &str, started: Instant) -> Result<(), ProxyError> {
        let ready = || {
            let active = self.state.active.load();
            let cfg = &active.config;
            let (candidates, known) = active.cluster.candidates(
                model,
                &[],
                Instant::now(),
                cfg.scrape.down_after_failures,
                cfg.scrape.stale_after(),
            );
            let adm = &cfg.admission;
            candidates.iter().any(|c| !adm.saturated(c.signal.as_ref()))
                || (!known && !active.cluster.models().is_empty())
        };
        let adm = self.state.active.load().config.admission.clone();
        if adm.max_wait_ms == 0 || ready() {
            return Ok(());
        }
        let metrics = &self.state.metrics;
        if metrics.queue_depth.get() as usize >= adm.max_queue {
            return Err(ProxyError::NoBackend(model.to_string()));
        }
        // Counted out on every path, the handler dropped mid-wait included.
        struct Queued<'a>(&'a crate::metrics::GatewayMetrics, Instant);
        impl Drop for Queued<'_> {
            fn drop(&mut self) {
                self.0.queue_depth.dec();
                self.0.queue_wait.observe(self.1.elapsed().as_secs_f64());
            }
        }
        metrics.queue_depth.inc();
        let _queued = Queued(metrics, started);
        let deadline = started + Duration::from_millis(adm.max_wait_ms);
        loop {
            // Scrapes (every scrape.interval_ms) are what make an engine routable.
            tokio::time::sleep(Duration::from_millis(20)).await;
            if ready() {
                break Ok(());
            }
            if Instant::now() >= deadline {
                break Err(ProxyError::NoBackend(model.to_string()));
            }
        }
    }

    async fn proxy(&self, s: &mut ServerSession, path: &str, started: Instant, log: &mut Log) -> bool {
        let active = self.state.active.load_full();
        let cfg = &active.config;
        let body = match read_body(s, cfg).await {
            Ok(b) => b,
            Err(e) => return self.fail(s, e, log).await,
        };
        log.request_bytes = body.len();
        let fields = match routing_fields(&body) {
            Ok(f) => f,
            Err(e) => return self.fail(s, e, log).await,
        };
        log.stream = fields.stream;
        let model = match fields.model {
            Some(m) => m,
            None => match active.cluster.models().as_slice() {
                [only] => only.clone(),
                _ => return self.fail(s, ProxyError::BadRequest("model is required".into()), log).await,
            },
        };
        log.model = Some(model.clone());
        // Hold the request while no engine can take it; then route on what is current.
        if let Err(e) = self.admit(&model, started).await {
            return self.fail(s, e, log).await;
        }
        let active = self.state.active.load_full();
        let cfg = &active.config;

        // What the prefix-aware policies need: block hashes of the canonical prompt, and
        // the session header for `session`.
        let policy = &active.policy;
        let pcfg = &cfg.prefix_index;
        let (hashes, prompt_tokens) = if policy.uses_prefix() {
            let text = canonical_prompt(&body);
            (block_hashes(text.as_bytes(), pcfg.block_bytes), pcfg.tokens(text.len()))
        } else {
            (Vec::new(), 0)
        };
        let session = policy
            .session_header()
            .and_then(|h| s.req_header().headers.get(h))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);

        let mut tried: Vec<usize> = Vec::new();
        let mut last_error: Option<ProxyError> = None;
        loop {
            let now = Instant::now();
            let (candidates, known) = active.cluster.candidates(
                &model,
                &tried,
                now,
                cfg.scrape.down_after_failures,
                cfg.scrape.stale_after(),
            );
            if !known {
                return self.fail(s, ProxyError::ModelNotFound(model), log).await;
            }
            if candidates.is_empty() {
                let e = last_error.unwrap_or_else(|| ProxyError::NoBackend(model.clone()));
                return self.fail(s, e, log).await;
            }
            let mut candidates = candidates;
            if !hashes.is_empty() {
                let keys: Vec<(u64, u32)> = candidates
                    .iter()
                    .map(|c| {
                        let b = &active.cluster.backends[c.index];
                        (b.key, b.restarts.load(Ordering::Relaxed))
                    })
                    .collect();
                let blocks = self.state.prefix.matched_blocks(&hashes, &keys);
                for (c, n) in candidates.iter_mut().zip(blocks) {
                    c.matched_tokens = pcfg.tokens(n * pcfg.block_bytes).min(prompt_tokens);
                }
            }
            let input = RouteInput { model: &model, prompt_tokens, session: session.as_deref() };
            let decision = policy.select(&input, &candidates, &mut rand::rng());
            self.state.metrics.decisions.with_label_values(&[policy.name(), decision.reason]).inc();
            let chosen = *candidates.iter().find(|c| c.index == decision.index).expect("policy picks a candidate");
            let backend = active.cluster.backends[decision.index].clone();
            log.backend = Some(backend.url.clone());
            log.reason = Some(decision.reason);
            if !hashes.is_empty() {
                let m = &self.state.metrics;
                m.prefix_match_ratio.observe(chosen.matched_tokens as f64 / prompt_tokens.max(1) as f64);
                m.prefix_index_bytes.set(self.state.prefix.insert(backend.key, &hashes) as i64);
            }
            let uncached = prompt_tokens - chosen.matched_tokens;
            let work = chosen.pending_prefill_tokens + uncached;
            let mut inflight = InflightGuard::new(&backend, uncached, work, fields.stream);
            match self.start_exchange(s, &backend, path, &body, cfg).await {
                Ok((up, peer)) => {
                    return self
                        .stream_response(s, up, peer, &active, decision.index, started, log, &mut inflight)
                        .await
                }
                Err(AttemptError::ClientGone) => {
                    log.status = 499;
                    log.error_kind = Some("client_gone");
                    return false;
                }
                Err(AttemptError::Fatal { kind, error }) => {
                    self.state.metrics.upstream_errors.with_label_values(&[kind]).inc();
                    active.cluster.record_failure(decision.index, kind, Instant::now(), &cfg.health);
                    return self.fail(s, error, log).await;
                }
                Err(AttemptError::Retryable { kind, message }) => {
                    self.state.metrics.upstream_errors.with_label_values(&[kind]).inc();
                    active.cluster.record_failure(decision.index, kind, Instant::now(), &cfg.health);
                    tracing::warn!(backend = %backend.url, kind, error = %message, "upstream attempt failed");
                    tried.push(decision.index);
                    last_error = Some(ProxyError::Upstream(message));
                    if tried.len() as u32 >= cfg.retries.max_attempts {
                        let e = last_error.take().expect("just set");
                        return self.fail(s, e, log).await;
                    }
                    self.state.metrics.retries.inc();
                    log.retries += 1;
                }
            }
        }
    }

    /// Connect, send the request and wait for the response header (or the client leaving).
    async fn start_exchange(
        &self,
        s: &mut ServerSession,
        backend: &Backend,
        path: &str,
        body: &Bytes,
        cfg: &GatewayConfig,
    ) -> Result<(HttpSession, HttpPeer), AttemptError> {
        let Some(addr) = backend.addr else {
            return Err(AttemptError::Retryable {
                kind: "unresolved",
                message: format!("{} does not resolve", backend.authority),
            });
        };
        let mut peer = HttpPeer::new(addr, false, String::new());
        peer.options.connection_timeout = Some(cfg.timeouts.connect());
        peer.options.total_connection_timeout = Some(cfg.timeouts.connect());
        peer.options.read_timeout = Some(cfg.timeouts.first_byte());
        peer.options.write_timeout = Some(cfg.timeouts.idle());
        peer.options.idle_timeout = Some(Duration::from_secs(60));
        let (mut up, reused) = match self.state.connector.get_http_session(&peer).await {
            Ok(x) => x,
            Err(e) => return Err(AttemptError::Retryable { kind: "connect", message: e.to_string() }),
        };
        let req = upstream_request(s.req_header(), path, &backend.authority, body.len());
        let sent = async {
            up.write_request_header(Box::new(req)).await?;
            up.write_request_body(body.clone(), true).await?;
            up.read_response_header().await
        };
        let result = tokio::select! {
            r = sent => r,
            _ = s.read_body_or_idle(true) => return Err(AttemptError::ClientGone),
        };
        match result {
            Ok(()) => Ok((up, peer)),
            Err(e) if e.etype() == &pingora::ErrorType::ReadTimedout => Err(AttemptError::Fatal {
                kind: "first_byte_timeout",
                error: ProxyError::UpstreamTimeout(cfg.timeouts.first_byte_ms),
            }),
            Err(e) if reused => Err(AttemptError::Retryable { kind: "reused_connection", message: e.to_string() }),
            Err(e) => Err(AttemptError::Fatal { kind: "upstream_io", error: ProxyError::Upstream(e.to_string()) }),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn stream_response(
        &self,
        s: &mut ServerSession,
        mut up: HttpSession,
        peer: HttpPeer,
        active: &Active,
        index: usize,
        started: Instant,
        log: &mut Log,
        inflight: &mut InflightGuard<'_>,
    ) -> bool {
        let cfg = &active.config;
        let backend = &active.cluster.backends[index];
        let upstream = up.response_header().expect("header was read");
        let status = upstream.status.as_u16();
        log.status = status;
        if status >= 500 {
            self.state.metrics.upstream_errors.with_label_values(&["status_5xx"]).inc();
            active.cluster.record_failure(index, &format!("status {status}"), Instant::now(), &cfg.health);
        } else {
            backend.record_success();
        }
        let mut resp = match ResponseHeader::build(status, None) {
            Ok(r) => r,
            Err(_) => return false,
        };
        let mut has_length = false;
        let mut is_sse = false;
        for (name, value) in upstream.headers.iter() {
            let n = name.as_str();
            if n == "content-length" {
                has_length = true;
            } else if HOP_BY_HOP.contains(&n) {
                continue;
            }
            if n == "content-type" && value.as_bytes().starts_with(b"text/event-stream") {
                is_sse = true;
            }
            let _ = resp.append_header(name.clone(), value.clone());
        }
        if !has_length && !s.is_http2() {
            let _ = resp.insert_header("transfer-encoding", "chunked");
        }
        if s.write_response_header(Box::new(resp)).await.is_err() {
            log.error_kind = Some("client_gone");
            return false;
        }
        up.set_read_timeout(Some(cfg.timeouts.idle()));
        loop {
            let next = tokio::select! {
                r = up.read_response_body() => r,
                _ = s.read_body_or_idle(true) => {
                    // The client left: dropping `up` closes the engine connection (abort).
                    log.error_kind = Some("client_gone");
                    return false;
                }
            };
            // Chunks the engine sent together leave in one downstream write.
            let (data, next) = match next {
                Ok(Some(chunk)) => coalesce(&mut up, chunk, &mut log.chunks),
                other => (Bytes::new(), other),
            };
            if !data.is_empty() {
                if log.ttft.is_none() {
                    inflight.first_byte();
                    let t = started.elapsed();
                    log.ttft = Some(t);
                    self.state.metrics.ttft.with_label_values(&[backend.url.as_str()]).observe(t.as_secs_f64());
                }
                log.response_bytes += data.len();
                if s.write_response_body(data, false).await.is_err() {
                    log.error_kind = Some("client_gone");
                    return false;
                }
            }
            match next {
                Ok(Some(_)) => {}
                Ok(None) => {
                    if s.write_response_body(Bytes::new(), true).await.is_err() {
                        return false;
                    }
                    if up.response_done() {
                        self.state.connector.release_http_session(up, &peer, peer.options.idle_timeout).await;
                    }
                    return true;
                }
                Err(e) => {
                    let kind =
                        if e.etype() == &pingora::ErrorType::ReadTimedout { "idle_timeout" } else { "stream_broken" };
                    self.state.metrics.upstream_errors.with_label_values(&[kind]).inc();
                    active.cluster.record_failure(index, kind, Instant::now(), &cfg.health);
                    log.error_kind = Some(kind);
                    tracing::warn!(backend = %backend.url, kind, error = %e, "upstream failed mid-response");
                    if is_sse {
                        let msg = serde_json::json!({"error": {
                            "message": format!("the engine stream failed: {kind}"),
                            "type": "upstream_error", "param": null, "code": 502}});
                        let event = Bytes::from(format!("data: {msg}\n\n"));
                        let _ = s.write_response_body(event, true).await;
                    }
                    s.set_keepalive(None);
                    return false;
                }
            }
        }
    }

    fn finish_log(&self, method: &str, path: &str, started: Instant, log: &Log) {
        let elapsed = started.elapsed();
        let m = &self.state.metrics;
        let code = log.status.to_string();
        if path.starts_with("/v1/") {
            m.requests.with_label_values(&[log.backend.as_deref().unwrap_or("none"), code.as_str()]).inc();
            m.duration.observe(elapsed.as_secs_f64());
        }
        self.state.access_log.log(&AccessLine {
            ts_ms: now_ms(),
            method,
            path,
            status: log.status,
            model: log.model.as_deref(),
            backend: log.backend.as_deref(),
            reason: log.reason,
            stream: log.stream,
            ttft_ms: log.ttft.map(|t| t.as_secs_f64() * 1e3),
            duration_ms: elapsed.as_secs_f64() * 1e3,
            request_bytes: log.request_bytes,
            response_bytes: log.response_bytes,
            chunks: log.chunks,
            retries: log.retries,
            error: log.error_kind,
        });
    }
}

/// Largest coalesced write.
const COALESCE_BYTES: usize = 64 * 1024;

/// Join `first` with every body chunk the upstream has already delivered (polled without
/// waiting). Returns the bytes to write and what follows them: `Ok(Some(_))` keep reading,
/// `Ok(None)` the body ended, `Err` the upstream failed.
fn coalesce(up: &mut HttpSession, first: Bytes, chunks: &mut usize) -> (Bytes, pingora::Result<Option<Bytes>>) {
    use futures_util::FutureExt;
    *chunks += 1;
    let mut acc: Option<BytesMut> = None;
    let mut next = Ok(Some(Bytes::new()));
    while acc.as_ref().map_or(first.len(), BytesMut::len) < COALESCE_BYTES {
        match up.read_response_body().now_or_never() {
            Some(Ok(Some(more))) => {
                *chunks += 1;
                acc.get_or_insert_with(|| BytesMut::from(&first[..])).extend_from_slice(&more);
            }
            Some(done_or_err) => {
                next = done_or_err;
                break;
            }
            None => break,
        }
    }
    (acc.map_or(first, BytesMut::freeze), next)
}

/// Read the request body within the size cap and deadline.
async fn read_body(s: &mut ServerSession, cfg: &GatewayConfig) -> Result<Bytes, ProxyError> {
    let limit = cfg.limits.max_body_bytes;
    if let Some(cl) = s.get_header("content-length") {
        let declared: u64 = cl
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| ProxyError::BadRequest("invalid Content-Length".into()))?;
        if declared > limit {
            return Err(ProxyError::BodyTooLarge { limit });
        }
    }
    let read = async {
        let mut buf = BytesMut::new();
        while let Some(chunk) = s
            .read_request_body()
            .await
            .map_err(|e| ProxyError::BadRequest(format!("could not read the request body: {e}")))?
        {
            if (buf.len() + chunk.len()) as u64 > limit {
                return Err(ProxyError::BodyTooLarge { limit });
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf.freeze())
    };
    match tokio::time::timeout(cfg.timeouts.request_body(), read).await {
        Ok(r) => r,
        Err(_) => Err(ProxyError::BodyTimeout(cfg.timeouts.request_body_ms)),
    }
}

/// The engine-bound request: the client's end-to-end headers, our host and length.
fn upstream_request(client: &RequestHeader, path: &str, authority: &str, body_len: usize) -> RequestHeader {
    let mut req = RequestHeader::build("POST", path.as_bytes(), None).expect("static method and path");
    for (name, value) in client.headers.iter() {
        if !HOP_BY_HOP.contains(&name.as_str()) {
            let _ = req.append_header(name.clone(), value.clone());
        }
    }
    let _ = req.insert_header("host", authority);
    let _ = req.insert_header("content-length", body_len.to_string());
    req
}

/// Write a complete small response; true when it was written.
pub async fn respond(
    s: &mut ServerSession,
    status: u16,
    content_type: &str,
    body: Bytes,
    retry_after: Option<u64>,
) -> bool {
    let Ok(mut resp) = ResponseHeader::build(status, Some(4)) else { return false };
    let _ = resp.insert_header("content-type", content_type);
    let _ = resp.insert_header("content-length", body.len().to_string());
    if let Some(secs) = retry_after {
        let _ = resp.insert_header("retry-after", secs.to_string());
    }
    s.write_response_header(Box::new(resp)).await.is_ok() && s.write_response_body(body, true).await.is_ok()
}
