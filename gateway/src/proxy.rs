//! The request path: one OpenAI request from the client to an engine and back.
//!
//! The gateway owns the upstream leg instead of using pingora's stock proxy loop, whose
//! retry buffer silently drops request bodies over 64 KiB (see PINGORA-NOTES.md). Per request:
//!
//! 0. the head arrives within `limits.header_read_timeout_ms` (else the connection is
//!    closed), within the size and field limits (431), with one framing (400); then the
//!    API key (401) and its request rate (429) are checked ([`crate::auth`]);
//! 1. read the whole body, capped at `limits.max_body_bytes` (413, checked against
//!    `Content-Length` before reading) and `limits.body_read_timeout_ms` (408); charge the
//!    key's token budget (429);
//! 2. parse just `model` and `stream` ([`crate::request`]); the body is forwarded untouched;
//! 3. build candidates from the current snapshot (backends serving the model, up, not yet
//!    tried) and let the policy pick; count the request in flight at once;
//! 4. take an idle connection from [`crate::pool`] (or connect with pingora's connector),
//!    send header and body, wait for the response header — while watching the client, so a client that leaves during a long prefill
//!    closes the upstream connection and the engine aborts the request;
//! 5. a connection failure, or the engine closing or resetting the connection before any
//!    response byte (a dead pooled connection, a crashed engine), or an answer in
//!    `retries.retry_on_status`, is retried on another backend within the retry budget
//!    (never after anything reached the client; never after a first-byte timeout);
//! 6. stream the body chunk by chunk as it arrives (chunked HTTP/1 writes are flushed
//!    each time; a body that is complete when its header arrives leaves with a
//!    `Content-Length`, header and body in one write); if the engine dies mid-stream, an
//!    SSE stream ends with a final `data: {"error": …}` event instead of a silent
//!    truncation;
//! 7. release the upstream connection to the pool only after a clean end.
//!
//! Every request leaves one JSON access-log line ([`crate::access_log`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, HttpServerOptions, ReusedHttpStream};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::v1::client::HttpSession;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use pingora::upstreams::peer::HttpPeer;

use crate::access_log::{now_ms, AccessLine};
use crate::admission::Ticket;
use crate::auth::{Denied, Tenant};
use crate::cluster::{Backend, BackendState};
use crate::config::GatewayConfig;
use crate::error::ProxyError;
use crate::policy::prefix_index::block_hashes;
use crate::policy::RouteInput;
use crate::request::{canonical_prompt, check_head, routing_fields, UsageMeter};
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
    /// A proxy over `state`; accepts HTTP/1.1, and cleartext HTTP/2 (h2c) when the config's
    /// `h2c` is on (HTTP/2 over TLS is negotiated by ALPN instead).
    pub fn new(state: Arc<GatewayState>) -> Self {
        let mut options = HttpServerOptions::default();
        options.h2c = state.active.load().config.h2c;
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
    tenant: Option<Arc<Tenant>>,
    /// What was charged to the tenant's token budget, and the prompt part of it.
    charged: Option<(u64, u64)>,
    usage: UsageMeter,
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
        let _in_flight = self.state.in_flight.enter();
        let limits = self.state.active.load().config.limits.clone();
        let mut shutdown_rx = shutdown.clone();
        // The deadline also bounds an idle keep-alive connection waiting for its next request.
        let read = tokio::select! {
            r = tokio::time::timeout(limits.header_read_timeout(), session.read_request()) => r,
            // Shutting down: an idle connection is closed rather than kept for a request.
            _ = shutdown_rx.changed() => return None,
        };
        match read {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => return None,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "failed to read a request header");
                if e.etype() == &pingora::ErrorType::InvalidHTTPHeader {
                    let _ = session.respond_error(400).await;
                }
                return None;
            }
            Err(_) => {
                self.state.metrics.header_timeouts.inc();
                return None;
            }
        }
        if let Some(h1) = session.as_http1() {
            let fields = session.req_header().headers.len();
            if let Err(e) = check_head(&h1.get_headers_raw_bytes(), fields, limits.max_header_bytes, limits.max_headers)
            {
                session.set_keepalive(None);
                self.reject(&mut session, e, &mut Log::default()).await;
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
        let denied = if path.starts_with("/v1/") { self.authorize(s, &mut log).err() } else { None };
        let reusable = match (method.as_str(), path.as_str()) {
            _ if denied.is_some() => self.reject(s, denied.expect("checked"), &mut log).await,
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
        self.settle_tokens(&log);
        self.finish_log(&method, &path, started, &log);
        reusable
    }

    /// The API key and its request rate, for `/v1/` requests; the key's tenant goes into
    /// `log` (refused or not).
    fn authorize(&self, s: &ServerSession, log: &mut Log) -> Result<(), ProxyError> {
        let active = self.state.active.load();
        match active.auth.authenticate(s.get_header("authorization").map(|v| v.as_bytes())) {
            Ok(None) => Ok(()),
            Ok(Some(tenant)) => {
                let rate = tenant
                    .check_rate()
                    .map_err(|wait| ProxyError::rate_limited("requests", "second", &tenant.name, wait));
                log.tenant = Some(tenant);
                rate
            }
            Err(Denied::Missing) => Err(ProxyError::Unauthorized(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
            )),
            Err(Denied::Unknown) => Err(ProxyError::Unauthorized("Incorrect API key provided.")),
        }
    }

    /// [`Self::fail`] for a request the gateway refuses on its own (header limits, keys,
    /// rates), counted in `switchyard_rejected_total{reason,tenant}`.
    async fn reject(&self, s: &mut ServerSession, e: ProxyError, log: &mut Log) -> bool {
        let tenant = log.tenant.as_ref().map_or("", |t| t.name.as_str());
        self.state.metrics.rejected.with_label_values(&[e.kind(), tenant]).inc();
        self.fail(s, e, log).await
    }

    /// Settle the tenant's token budget: refund what the request did not use, or take more.
    fn settle_tokens(&self, log: &Log) {
        let (Some(tenant), Some((charged, prompt))) = (&log.tenant, log.charged) else { return };
        let Some(budget) = &tenant.tokens else { return };
        let used = if log.status < 400 && log.response_bytes > 0 { log.usage.used(prompt) } else { 0 };
        budget.settle(charged, used, Instant::now());
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
    /// known: a 404 is due) and nobody waits, else waits in [`crate::admission`]'s order
    /// until it is first and an engine can take it, or until the deadline. Errors are 503
    /// with `Retry-After`. The first waiter re-checks the cluster view (updated by every
    /// scrape) every 20 ms and whenever the waiter before it left. A waiter that leaves
    /// keeps its ticket until it is counted in flight on a backend, so the next one sees
    /// the engine one request busier.
    async fn admit(&self, model: &str, started: Instant, priority: i32) -> Result<Option<Ticket>, ProxyError> {
        let ready = || {
            let active = self.state.active.load();
            let (candidates, known) = routable(&active, model, &[]);
            let adm = &active.config.admission;
            candidates.iter().any(|c| !adm.saturated(c.signal.as_ref()))
                || (!known && !active.cluster.models().is_empty())
        };
        let adm = self.state.active.load().config.admission.clone();
        let queue = &self.state.queue;
        if adm.max_wait_ms == 0 || (queue.is_empty() && ready()) {
            return Ok(None);
        }
        let metrics = &self.state.metrics;
        let Some(ticket) = queue.try_enter(priority, adm.max_queue) else {
            return Err(ProxyError::NoBackend(model.to_string()));
        };
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
        let deadline = tokio::time::Instant::from_std(started + Duration::from_millis(adm.max_wait_ms));
        loop {
            let moved = queue.changed();
            if ticket.is_first() && ready() {
                break Ok(Some(ticket));
            }
            // Scrapes (every scrape.interval_ms) are what make an engine routable.
            let tick = tokio::time::sleep(Duration::from_millis(20));
            tokio::select! {
                _ = moved => {}
                _ = tick => {}
                _ = tokio::time::sleep_until(deadline) => break Err(ProxyError::NoBackend(model.to_string())),
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
        if let Some(budget) = log.tenant.as_ref().and_then(|t| t.tokens.as_ref()) {
            let prompt = cfg.prefix_index.tokens(body.len());
            let charge = prompt + fields.max_tokens.unwrap_or(cfg.auth.default_max_tokens);
            if let Err(wait) = budget.take(charge, Instant::now()) {
                let tenant = log.tenant.as_ref().map_or("", |t| t.name.as_str());
                let e = ProxyError::rate_limited("tokens", "minute", tenant, wait);
                return self.reject(s, e, log).await;
            }
            log.charged = Some((charge, prompt));
        }
        let priority = cfg
            .admission
            .priority_header
            .as_ref()
            .and_then(|h| s.get_header(h.as_str()))
            .and_then(|v| v.to_str().ok()?.trim().parse::<i32>().ok())
            .or(log.tenant.as_ref().map(|t| t.priority))
            .unwrap_or(0);
        // Hold the request while no engine can take it; then route on what is current.
        let mut ticket = match self.admit(&model, started, priority).await {
            Ok(t) => t,
            Err(e) => return self.fail(s, e, log).await,
        };
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
        self.state.retry_budget.lock().expect("retry budget lock").record_request(Instant::now());
        loop {
            let (candidates, known) = routable(&active, &model, &tried);
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
            drop(ticket.take());
            match self.start_exchange(s, &backend, path, &body, cfg).await {
                Ok(up) => {
                    let status = up.resp_header().map_or(0, |h| h.status.as_u16());
                    if cfg.retries.retry_on_status.contains(&status) {
                        tried.push(decision.index);
                        if self.may_retry(&active, &model, &tried) {
                            // Nothing reached the client: drop this answer (and its
                            // connection) and try another engine.
                            self.state.metrics.upstream_errors.with_label_values(&["retried_status"]).inc();
                            active.cluster.record_failure(
                                decision.index,
                                "retried status",
                                Instant::now(),
                                &cfg.health,
                            );
                            self.state.metrics.retries.inc();
                            log.retries += 1;
                            last_error = Some(ProxyError::Upstream(format!("engine answered {status}")));
                            continue;
                        }
                    }
                    return self
                        .stream_response(s, up, &active, decision.index, started, log, &mut inflight)
                        .await;
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
                    if !self.may_retry(&active, &model, &tried) {
                        let e = last_error.take().expect("just set");
                        return self.fail(s, e, log).await;
                    }
                    self.state.metrics.retries.inc();
                    log.retries += 1;
                }
            }
        }
    }

    /// Whether a request that failed on `tried` may have another attempt: attempts left,
    /// another backend to try, and the retry budget not spent (taken from it when true).
    fn may_retry(&self, active: &Active, model: &str, tried: &[usize]) -> bool {
        if tried.len() as u32 >= active.config.retries.max_attempts || routable(active, model, tried).0.is_empty() {
            return false;
        }
        let granted = self.state.retry_budget.lock().expect("retry budget lock").try_retry(Instant::now());
        if !granted {
            self.state.metrics.upstream_errors.with_label_values(&["retry_budget_spent"]).inc();
        }
        granted
    }

    /// Connect, send the request and wait for the response header (or the client leaving).
    async fn start_exchange(
        &self,
        s: &mut ServerSession,
        backend: &Backend,
        path: &str,
        body: &Bytes,
        cfg: &GatewayConfig,
    ) -> Result<HttpSession, AttemptError> {
        let Some(peer) = &backend.peer else {
            return Err(AttemptError::Retryable {
                kind: "unresolved",
                message: format!("{} does not resolve", backend.authority),
            });
        };
        // A pooled connection first. Connecting (TCP, maybe TLS) is a future of ~9 KB that
        // would otherwise be inlined into every request's state machine and copied when
        // pingora boxes it, so it gets its own box, on the rare path only.
        let pooled = self.state.pool.take(backend.pool_key, Instant::now());
        let (mut up, reused) = match pooled {
            Some(stream) => (HttpSession::new_with_options(stream, peer), true),
            None => match Box::pin(connect(&self.state.connector, peer, cfg)).await {
                Ok(x) => x,
                Err(e) => return Err(AttemptError::Retryable { kind: "connect", message: e.to_string() }),
            },
        };
        // The connector does not carry the peer's read/write timeouts over to the session.
        up.read_timeout = Some(cfg.timeouts.first_byte());
        up.write_timeout = Some(cfg.timeouts.idle());
        let req = upstream_request(s.req_header(), path, &backend.authority, body.len());
        let sent = async {
            up.write_request_header(Box::new(req)).await?;
            up.write_body(body).await?;
            up.read_response().await.map(drop)
        };
        let result = tokio::select! {
            r = sent => r,
            _ = s.read_body_or_idle(true) => return Err(AttemptError::ClientGone),
        };
        match result {
            Ok(()) => Ok(up),
            Err(e) if e.etype() == &pingora::ErrorType::ReadTimedout => Err(AttemptError::Fatal {
                kind: "first_byte_timeout",
                error: ProxyError::UpstreamTimeout(cfg.timeouts.first_byte_ms),
            }),
            Err(e) if reused => Err(AttemptError::Retryable { kind: "reused_connection", message: e.to_string() }),
            // The engine closed or reset the connection before answering (it died, or is
            // restarting): nothing reached the client, so another engine may take it —
            // within the attempt limit and the retry budget, which also bound a request
            // that kills every engine it reaches.
            Err(e) => Err(AttemptError::Retryable { kind: "upstream_io", message: e.to_string() }),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn stream_response(
        &self,
        s: &mut ServerSession,
        mut up: HttpSession,
        active: &Active,
        index: usize,
        started: Instant,
        log: &mut Log,
        inflight: &mut InflightGuard<'_>,
    ) -> bool {
        let cfg = &active.config;
        let backend = &active.cluster.backends[index];
        let upstream = up.resp_header().expect("header was read");
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
        // What the engine has sent already, taken without waiting. When that is the whole
        // body (a short or non-streamed answer), the response leaves with a Content-Length:
        // pingora then holds the header until the body is written and both go out in one
        // write. Otherwise it is chunked and pingora flushes the header at once.
        let mut buf = BytesMut::with_capacity(4096);
        let mut next = take_ready(&mut up, &mut buf, &mut log.chunks);
        let complete = matches!(next, Ok(Body::Ended));
        if !has_length && complete {
            let _ = resp.insert_header("content-length", buf.len().to_string());
        } else if !has_length && !s.is_http2() {
            let _ = resp.insert_header("transfer-encoding", "chunked");
        }
        if s.write_response_header(Box::new(resp)).await.is_err() {
            log.error_kind = Some("client_gone");
            return false;
        }
        up.read_timeout = Some(cfg.timeouts.idle());
        loop {
            let end = matches!(next, Ok(Body::Ended));
            if !buf.is_empty() || end {
                if !buf.is_empty() && log.ttft.is_none() {
                    inflight.first_byte();
                    let t = started.elapsed();
                    log.ttft = Some(t);
                    self.state.metrics.ttft.with_label_values(&[backend.url.as_str()]).observe(t.as_secs_f64());
                }
                log.response_bytes += buf.len();
                if log.charged.is_some() {
                    log.usage.observe(&buf);
                }
                if s.write_response_body(buf.split().freeze(), end).await.is_err() {
                    log.error_kind = Some("client_gone");
                    return false;
                }
            }
            match next {
                Ok(Body::More) => {}
                Ok(Body::Ended) => {
                    if up.is_body_done() {
                        up.respect_keepalive();
                        // Completes at once for a finished body (kept out of this future's
                        // state, where it would add 2 KB); if not, the connection closes.
                        if let Some(Some(stream)) = up.reuse().now_or_never() {
                            self.state.pool.put(backend.pool_key, stream, Instant::now());
                        }
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
            let read = tokio::select! {
                r = up.read_body_ref() => r.map(|chunk| match chunk {
                    Some(chunk) => {
                        log.chunks += 1;
                        buf.extend_from_slice(chunk);
                        Body::More
                    }
                    None => Body::Ended,
                }),
                _ = s.read_body_or_idle(true) => {
                    // The client left: dropping `up` closes the engine connection (abort).
                    log.error_kind = Some("client_gone");
                    return false;
                }
            };
            // Chunks the engine sent together leave in one downstream write.
            next = match read {
                Ok(Body::More) => take_ready(&mut up, &mut buf, &mut log.chunks),
                other => other,
            };
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
            tenant: log.tenant.as_ref().map(|t| t.name.as_str()),
            error: log.error_kind,
        });
    }
}

/// Backends that may take a request for `model` now, `tried` excluded: up, not ejected,
/// under the circuit breaker's in-flight limit. Also whether any backend serves the model.
fn routable(active: &Active, model: &str, tried: &[usize]) -> (Vec<crate::policy::Candidate>, bool) {
    let cfg = &active.config;
    let (mut candidates, known) = active.cluster.candidates(
        model,
        tried,
        Instant::now(),
        cfg.scrape.down_after_failures,
        cfg.scrape.stale_after(),
    );
    let max = cfg.health.max_inflight_per_backend;
    if max > 0 {
        candidates.retain(|c| c.inflight < max);
    }
    (candidates, known)
}

/// Open a new connection to `peer` with the configured timeouts.
async fn connect(
    connector: &pingora::connectors::http::v1::Connector,
    peer: &HttpPeer,
    cfg: &GatewayConfig,
) -> pingora::Result<(HttpSession, bool)> {
    let mut peer = peer.clone();
    peer.options.connection_timeout = Some(cfg.timeouts.connect());
    peer.options.total_connection_timeout = Some(cfg.timeouts.connect());
    connector.get_http_session(&peer).await
}

/// Largest coalesced write.
const COALESCE_BYTES: usize = 64 * 1024;

/// Where an upstream response body stands after a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    /// More may come.
    More,
    /// The body ended.
    Ended,
}

/// Append to `buf` every body chunk the upstream has already delivered (polled without
/// waiting, copied straight out of pingora's read buffer), up to [`COALESCE_BYTES`].
fn take_ready(up: &mut HttpSession, buf: &mut BytesMut, chunks: &mut usize) -> pingora::Result<Body> {
    while buf.len() < COALESCE_BYTES {
        match up.read_body_ref().now_or_never() {
            Some(Ok(Some(chunk))) => {
                *chunks += 1;
                buf.extend_from_slice(chunk);
            }
            Some(Ok(None)) => return Ok(Body::Ended),
            Some(Err(e)) => return Err(e),
            None => break,
        }
    }
    Ok(Body::More)
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
    match tokio::time::timeout(cfg.limits.body_read_timeout(), read).await {
        Ok(r) => r,
        Err(_) => Err(ProxyError::BodyTimeout(cfg.limits.body_read_timeout_ms)),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Size of what `f` returns, without calling it.
    fn returned_size<A, B, R>(_f: impl FnOnce(A, B) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// pingora boxes each connection's handler future (async_trait), which copies the whole
    /// state machine once per request: at 12 KB (pingora's connect future inlined) that copy
    /// was 9% of the gateway's instructions. Rare paths with big futures get their own box.
    #[test]
    fn the_per_request_future_stays_small() {
        let handle = returned_size(|app: &'static ProxyApp, s: &'static mut ServerSession| app.handle(s));
        // 4,192 bytes in a debug build with pingora 0.9.1 (release builds are smaller).
        assert!(handle <= 6 * 1024, "the request handler's future grew to {handle} bytes");
    }
}
