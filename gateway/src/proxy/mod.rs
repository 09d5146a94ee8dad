//! The request path: one OpenAI request from the client to an engine and back.
//!
//! The gateway owns the upstream leg instead of using pingora's stock proxy loop, whose
//! retry buffer silently drops request bodies over 64 KiB (see docs/design/PINGORA-NOTES.md).
//! A request runs through named phases over one [`RequestCtx`]:
//!
//! | phase | where | what |
//! |---|---|---|
//! | `read_head` | [`ProxyApp::read_head`] | the head within `limits.header_read_timeout_ms` (else the connection closes), the size and field limits (431), one framing (400) |
//! | `admit` | [`ProxyApp::admit`] | the API key (401) and its request rate (429), [`crate::auth`] |
//! | `read_and_plan` | [`ProxyApp::read_and_plan`] | the body within `limits.max_body_bytes` (413) and `limits.body_read_timeout_ms` (408); the pure [`plan_request`] (model, stream, priority, token charge, prompt hashes, session); the key's token budget (429) |
//! | `queue` | [`ProxyApp::queue`] | held while no engine can take it ([`crate::admission`]) |
//! | `attempt` | [`ProxyApp::attempt_loop`] | pick ([`crate::policy`]), exchange, retry decision ([`attempt`]) |
//! | `stream` | [`ProxyApp::stream`] | the response chunk by chunk, SSE error event on a broken stream ([`stream`]) |
//! | `finish` | [`ProxyApp::finish`] | settle the token charge, metrics, one access-log line |
//!
//! While waiting for the engine the client is watched, so a client that leaves during a
//! long prefill closes the upstream connection and the engine aborts the request.

mod attempt;
mod ctx;
mod plan;
mod queue;
mod stream;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::apps::{HttpServerApp, HttpServerOptions, ReusedHttpStream};
use pingora::protocols::http::v2::server::{default_h2_options, H2Options};
use pingora::protocols::http::ServerSession;
use pingora::protocols::Stream;
use pingora::server::ShutdownWatch;

use crate::access_log::AccessLine;
use crate::auth::{Denied, Tenant};
use crate::body_budget::{BodyBudget, BodyReservation};
use crate::cluster::BackendState;
use crate::config::GatewayConfig;
use crate::downstream::{Downstream, H1Connection, H1Request, PingoraRequest};
use crate::error::ProxyError;
use crate::http::REQUEST_ID;
use crate::shared_limits::{Fallback, Verdict};
use crate::state::{Active, GatewayState};
use ctx::Ledger;

pub(crate) use attempt::InflightGuard;
pub(crate) use ctx::RequestCtx;
pub use plan::{plan_request, RoutePlan};
pub(crate) use queue::Admitted;

/// The OpenAI API listener.
pub struct ProxyApp {
    state: Arc<GatewayState>,
    options: HttpServerOptions,
}

impl ProxyApp {
    /// A proxy over `state`; accepts HTTP/1.1, and cleartext HTTP/2 (h2c) when the config's
    /// `h2c` is on (HTTP/2 over TLS is negotiated by ALPN instead). An HTTP/2 connection with
    /// no open stream is closed after `limits.idle_connection_timeout_ms` (read here, once).
    pub fn new(state: Arc<GatewayState>) -> Self {
        let mut options = HttpServerOptions::default();
        let config = &state.active.load().config;
        options.h2c = config.h2c;
        options.h2_idle_timeout = Some(config.limits.idle_connection_timeout());
        ProxyApp { state, options }
    }
}

/// pingora serves HTTP/2 (each stream a session); HTTP/1.1 connections are served by
/// [`ProxyApp::serve_h1`] instead ([`crate::connection::Edge`] hands them over).
#[async_trait]
impl HttpServerApp for ProxyApp {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        let _in_flight = self.state.lifecycle.in_flight.enter();
        let limits = self.state.active.load().config.limits.clone();
        let mut shutdown_rx = shutdown.clone();
        let read = tokio::select! {
            r = tokio::time::timeout(limits.header_read_timeout(), session.read_request()) => r,
            _ = shutdown_rx.changed() => return None,
        };
        match read {
            Ok(Ok(true)) => {}
            Ok(Ok(false) | Err(_)) => return None,
            Err(_) => {
                self.state.metrics.header_timeouts.inc();
                return None;
            }
        }
        let mut s = Downstream::Pingora(Box::new(PingoraRequest::new(session)));
        // HTTP/2's decoded header list is capped by the h2 settings (`h2_options`); the
        // field count is checked here.
        if s.head().len() > limits.max_headers {
            let e = ProxyError::HeaderTooLarge(format!(
                "request has {} header fields; at most {}",
                s.head().len(),
                limits.max_headers
            ));
            self.reject(&mut s, e, &mut RequestCtx::new("", "")).await;
            return None;
        }
        self.handle(&mut s).await;
        if let Downstream::Pingora(p) = s {
            let _ = p.into_session().finish().await;
        }
        None
    }

    fn server_options(&self) -> Option<&HttpServerOptions> {
        Some(&self.options)
    }

    /// pingora's bounded defaults, with `limits.max_header_bytes` as the decoded header
    /// list limit (HTTP/1 heads are checked by [`RequestHead::parse`](crate::downstream::RequestHead::parse)).
    fn h2_options(&self) -> Option<H2Options> {
        let max = self.state.active.load().config.limits.max_header_bytes;
        let mut options = default_h2_options();
        options.max_header_list_size(u32::try_from(max).unwrap_or(u32::MAX));
        Some(options)
    }
}

impl ProxyApp {
    /// Serve an HTTP/1.1 connection: its requests one after the other while both sides
    /// keep it alive. Phase `read_head` for each: the head within
    /// `limits.header_read_timeout_ms` — counted from the connection's start, or from the
    /// first byte of a kept-alive connection's next request, which may take up to
    /// `limits.idle_connection_timeout_ms` to arrive — and the head limits (431, 400).
    /// Closed past a deadline, on EOF, or when the gateway shuts down (between requests).
    pub(crate) async fn serve_h1(&self, stream: Stream, shutdown: &ShutdownWatch) {
        let mut conn = H1Connection::new(stream);
        let mut shutdown = shutdown.clone();
        let mut first = true;
        loop {
            let limits = self.state.active.load().config.limits.clone();
            if !first && !conn.has_buffered() {
                let read = tokio::select! {
                    r = tokio::time::timeout(limits.idle_connection_timeout(), conn.wait_readable()) => r,
                    _ = shutdown.changed() => return,
                };
                match read {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(_) => {
                        self.state.metrics.idle_connections_closed.inc();
                        return;
                    }
                }
            }
            first = false;
            let read = tokio::select! {
                r = tokio::time::timeout(
                    limits.header_read_timeout(),
                    conn.read_head(limits.max_header_bytes, limits.max_headers),
                ) => r,
                _ = shutdown.changed() => return,
            };
            let head = match read {
                Ok(Ok(Some(head))) => head,
                Ok(Ok(None)) => return,
                Ok(Err(e)) => {
                    // Only the kind: the head may hold an `Authorization` key.
                    tracing::debug!(error = e.kind(), "failed to read a request header");
                    self.state.metrics.rejected.with_label_values(&[e.kind(), ""]).inc();
                    conn.refuse(&e).await;
                    conn.linger().await;
                    return;
                }
                Err(_) => {
                    self.state.metrics.header_timeouts.inc();
                    return;
                }
            };
            let in_flight = self.state.lifecycle.in_flight.enter();
            let keepalive = !*shutdown.borrow();
            let mut s = Downstream::H1(H1Request::new(&mut conn, head, keepalive));
            let reusable = self.handle(&mut s).await;
            let (reusable, body_unread) = match &s {
                Downstream::H1(r) => (reusable && r.reusable(), !r.is_body_done()),
                Downstream::Pingora(_) => (false, false),
            };
            if !reusable {
                drop(s);
                if body_unread {
                    conn.linger().await;
                }
                return;
            }
            // Waiting for the next request is not in flight: a drain does not wait for it.
            drop(in_flight);
        }
    }

    /// One request, routed by method and path; true when the connection may be reused.
    async fn handle(&self, s: &mut Downstream<'_>) -> bool {
        let head = s.head();
        let mut ctx = RequestCtx::new(head.method(), head.path());
        let authorization = head.get("authorization");
        let reusable = match self.admit(authorization, &mut ctx).await {
            Err(e) => self.reject(s, e, &mut ctx).await,
            Ok(()) => self.route(s, &mut ctx).await,
        };
        self.finish(&mut ctx);
        reusable
    }

    /// The answer for `ctx`'s method and path.
    async fn route(&self, s: &mut Downstream<'_>, ctx: &mut RequestCtx) -> bool {
        match (ctx.method.as_ref(), ctx.path.as_ref()) {
            ("GET", "/-/healthz") => {
                ctx.status = 200;
                s.respond(200, "text/plain", Bytes::from_static(b"ok\n"), &[]).await
            }
            ("GET", "/-/ready") => {
                let (status, body) = self.readiness();
                ctx.status = status;
                s.respond(status, "text/plain", Bytes::from(body), &[]).await
            }
            ("GET", "/v1/models") => {
                ctx.status = 200;
                s.respond(200, "application/json", Bytes::from(self.models_body()), &[]).await
            }
            ("GET", path) if path.starts_with(MODEL_PREFIX) => match self.model_body(&path[MODEL_PREFIX.len()..]) {
                Ok(body) => {
                    ctx.status = 200;
                    s.respond(200, "application/json", Bytes::from(body), &[]).await
                }
                Err(e) => self.fail(s, e, ctx).await,
            },
            ("POST", path) if is_model_route(path) => self.proxy(s, ctx).await,
            (_, path)
                if matches!(path, "/-/healthz" | "/-/ready" | "/v1/models")
                    || path.starts_with(MODEL_PREFIX)
                    || is_model_route(path) =>
            {
                let e = ProxyError::MethodNotAllowed(ctx.method.to_string());
                self.fail(s, e, ctx).await
            }
            _ => {
                let e = ProxyError::NoRoute(ctx.path.to_string());
                self.fail(s, e, ctx).await
            }
        }
    }

    /// Phase `admit`: for `/v1/` requests, the API key (the `Authorization` header's value)
    /// and its request rate; the key's tenant goes into `ctx` (refused or not).
    pub(crate) async fn admit(&self, authorization: Option<&[u8]>, ctx: &mut RequestCtx) -> Result<(), ProxyError> {
        if !(ctx.path.starts_with("/v1/") || is_model_route(&ctx.path)) {
            return Ok(());
        }
        let authenticated = self.state.active.load().auth.authenticate(authorization);
        match authenticated {
            Ok(None) => Ok(()),
            Ok(Some(tenant)) => {
                let rate = self
                    .check_rate(&tenant)
                    .await
                    .map_err(|wait| ProxyError::rate_limited("requests", "second", &tenant.name, wait));
                ctx.tenant = Some(tenant);
                rate
            }
            Err(Denied::Missing) => Err(ProxyError::Unauthorized(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
            )),
            Err(Denied::Unknown) => Err(ProxyError::Unauthorized("Incorrect API key provided.")),
        }
    }

    /// The key's request rate: in Redis with `auth.shared_limits` (or its fallback while
    /// Redis cannot answer), else this replica's limiter.
    async fn check_rate(&self, tenant: &Tenant) -> Result<(), Duration> {
        let Some(shared) = &self.state.shared_limits else { return tenant.check_rate() };
        let Some((rps, burst)) = tenant.rate_limit() else { return Ok(()) };
        match shared.check_rate(tenant.key_id(), rps, burst).await {
            Verdict::Allowed => Ok(()),
            Verdict::Limited(wait) => Err(wait),
            Verdict::Unavailable => {
                shared.count_unavailable();
                match shared.fallback() {
                    Fallback::Local => tenant.fallback(shared.replicas()).check_rate(),
                    Fallback::Open => Ok(()),
                    Fallback::Closed => Err(Duration::from_secs(1)),
                }
            }
        }
    }

    /// Charge `charge` tokens to the key's budget: the ledger it went to, `None` when the key
    /// has no budget (or Redis is down and `fail_open` admits), or how long until it fits.
    async fn take_tokens(&self, tenant: &Tenant, charge: u64) -> Result<Option<Ledger>, Duration> {
        let Some(shared) = &self.state.shared_limits else {
            let Some(budget) = &tenant.tokens else { return Ok(None) };
            return budget.take(charge, Instant::now()).map(|()| Some(Ledger::Local));
        };
        let Some(per_minute) = tenant.tokens_per_minute() else { return Ok(None) };
        match shared.take_tokens(tenant.key_id(), per_minute, charge).await {
            Verdict::Allowed => Ok(Some(Ledger::Shared)),
            Verdict::Limited(wait) => Err(wait),
            Verdict::Unavailable => {
                shared.count_unavailable();
                match shared.fallback() {
                    Fallback::Local => {
                        let share = tenant.fallback(shared.replicas());
                        let budget = share.tokens.as_ref().expect("a key with tokens_per_minute has a share");
                        budget.take(charge, Instant::now())?;
                        Ok(Some(Ledger::Fallback(share)))
                    }
                    Fallback::Open => Ok(None),
                    Fallback::Closed => Err(Duration::from_secs(1)),
                }
            }
        }
    }

    /// A completion: `read_and_plan` → `queue` → `attempt` (→ `stream`).
    async fn proxy(&self, s: &mut Downstream<'_>, ctx: &mut RequestCtx) -> bool {
        ctx.take_request_id(s.head().get(REQUEST_ID));
        let (body, mut plan, planned_with) = match self.read_and_plan(s, ctx).await {
            Ok(x) => x,
            Err(e) => return self.reject_or_fail(s, e, ctx).await,
        };
        self.state.metrics.count_alias(plan.alias.as_deref(), &plan.model);
        ctx.writeback = plan.writeback(&planned_with);
        let body = plan.engine_body(body);
        // Hold the request while no engine can take it; then route on what is current.
        let tenant = ctx.tenant.as_ref().map(|t| t.name.as_str());
        // The body was read whole: anything the client does now is leaving.
        let gone = s.closed();
        let ticket = match self.queue(gone, &planned_with, &plan.model, ctx.started, plan.priority, tenant).await {
            queue::Admitted::Go(t) => t,
            queue::Admitted::Refused(e) => return self.reject_or_fail(s, e, ctx).await,
            queue::Admitted::ClientGone => {
                ctx.status = 499;
                ctx.client_gone();
                return false;
            }
        };
        self.attempt_loop(s, ctx, &mut plan, &planned_with, &body, ticket).await
    }

    /// Phase `read_and_plan`: the body, its [`RoutePlan`], and the tenant's token charge.
    /// Also returns the snapshot the plan was made under.
    async fn read_and_plan(
        &self,
        s: &mut Downstream<'_>,
        ctx: &mut RequestCtx,
    ) -> Result<(Bytes, RoutePlan, Arc<Active>), ProxyError> {
        let active = self.state.active.load_full();
        let body = read_body(s, &active.config, &self.state.bodies, &mut ctx.body_held).await?;
        ctx.request_bytes = body.len();
        let plan = plan_request(s.head(), &body, &active, ctx.tenant.as_deref(), self.state.kv_events.as_deref());
        if let Ok(p) = &plan {
            ctx.stream = p.stream;
            ctx.model = Some(p.model.clone());
        } else if let Ok(f) = crate::request::routing_fields(&body, &active.config.limits.prompt_limits()) {
            ctx.stream = f.stream;
        }
        let plan = plan?;
        self.charge_tokens(&plan, ctx).await?;
        Ok((body, plan, active))
    }

    /// Charge the tenant's token budget what `plan` may use (429 when it does not fit).
    pub(crate) async fn charge_tokens(&self, plan: &RoutePlan, ctx: &mut RequestCtx) -> Result<(), ProxyError> {
        let Some(tenant) = ctx.tenant.clone() else { return Ok(()) };
        match self.take_tokens(&tenant, plan.charge).await {
            Ok(Some(ledger)) => {
                ctx.charged = Some((plan.charge, plan.prompt_charge));
                ctx.ledger = ledger;
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(wait) => Err(ProxyError::rate_limited("tokens", "minute", ctx.tenant_name(), wait)),
        }
    }

    /// The shared state the proxy works on.
    pub(crate) fn state(&self) -> &Arc<GatewayState> {
        &self.state
    }

    /// [`Self::reject`] for the gateway's own refusals (limits, keys, rates), [`Self::fail`]
    /// for everything else.
    async fn reject_or_fail(&self, s: &mut Downstream<'_>, e: ProxyError, ctx: &mut RequestCtx) -> bool {
        if matches!(e, ProxyError::RateLimited { .. } | ProxyError::TenantQueueFull { .. } | ProxyError::BodyBufferFull)
        {
            self.reject(s, e, ctx).await
        } else {
            self.fail(s, e, ctx).await
        }
    }

    /// [`Self::fail`] for a request the gateway refuses on its own (header limits, keys,
    /// rates), counted in `switchyard_rejected_total{reason,tenant}`.
    pub(crate) async fn reject(&self, s: &mut Downstream<'_>, e: ProxyError, ctx: &mut RequestCtx) -> bool {
        self.state.metrics.rejected.with_label_values(&[e.kind(), ctx.tenant_name()]).inc();
        self.fail(s, e, ctx).await
    }

    /// Answer `e` in the OpenAI shape; true when the connection may be reused.
    async fn fail(&self, s: &mut Downstream<'_>, e: ProxyError, ctx: &mut RequestCtx) -> bool {
        ctx.status = e.status();
        ctx.error_kind = Some(e.kind());
        let retry_after = e.retry_after_secs();
        // A request whose body was not (fully) read cannot leave a reusable connection.
        let body_done = s.is_body_done();
        if !body_done {
            s.close_after();
        }
        let retry_after = retry_after.map(|secs| secs.to_string());
        let fields = [("retry-after", retry_after.as_deref()), (REQUEST_ID, ctx.request_id.as_deref())];
        let fields: Vec<(&str, &str)> = fields.iter().filter_map(|(k, v)| v.map(|v| (*k, v))).collect();
        s.respond(e.status(), "application/json", Bytes::from(e.body()), &fields).await && body_done
    }

    /// Phase `finish`: settle the tenant's token charge, count the request and write its
    /// access-log line — once per request, whatever path it took.
    pub(crate) fn finish(&self, ctx: &mut RequestCtx) {
        if ctx.status == 0 && !ctx.path.starts_with("/-/") {
            ctx.status = 200;
        }
        self.settle_tokens(ctx);
        let elapsed = ctx.started.elapsed();
        let m = &self.state.metrics;
        if ctx.path.starts_with("/v1/") {
            match &ctx.backend {
                Some(b) if ctx.status == 200 => m.of(b).ok.inc(),
                b => {
                    let url = b.as_ref().map_or("none", |b| b.url.as_str());
                    m.requests.with_label_values(&[url, itoa::Buffer::new().format(ctx.status)]).inc();
                }
            }
            m.duration.observe(elapsed.as_secs_f64());
        }
        self.state.access_log.log(&AccessLine {
            ts_ms: switchyard_shim::process::unix_ms(),
            method: &ctx.method,
            path: &ctx.path,
            status: ctx.status,
            model: ctx.model.as_deref(),
            backend: ctx.backend.as_ref().map(|b| b.url.as_str()),
            reason: ctx.reason,
            stream: ctx.stream,
            ttft_ms: ctx.ttft.map(|t| t.as_secs_f64() * 1e3),
            duration_ms: elapsed.as_secs_f64() * 1e3,
            request_bytes: ctx.request_bytes,
            response_bytes: ctx.response_bytes,
            chunks: ctx.chunks,
            retries: ctx.retries,
            tenant: ctx.tenant.as_ref().map(|t| t.name.as_str()),
            error: ctx.error_kind,
            request_id: ctx.request_id.as_deref(),
        });
    }

    /// Settle the tenant's token budget: refund what the request did not use, or take more.
    fn settle_tokens(&self, ctx: &RequestCtx) {
        let (Some(tenant), Some((charged, prompt))) = (&ctx.tenant, ctx.charged) else { return };
        let used = if ctx.status < 400 && ctx.response_bytes > 0 { ctx.usage.used(prompt) } else { 0 };
        match &ctx.ledger {
            Ledger::Local => {
                if let Some(budget) = &tenant.tokens {
                    budget.settle(charged, used, Instant::now());
                }
            }
            Ledger::Fallback(share) => {
                if let Some(budget) = &share.tokens {
                    budget.settle(charged, used, Instant::now());
                }
            }
            Ledger::Shared => {
                let (Some(shared), Some(per_minute)) = (self.state.shared_limits.clone(), tenant.tokens_per_minute())
                else {
                    return;
                };
                // As the local budget settles: the charge (capped at the whole budget) back,
                // what was used taken.
                let give = charged.min(per_minute) as f64 - used as f64;
                let key = tenant.key_id().to_string();
                tokio::spawn(async move { shared.give_tokens(&key, per_minute, give).await });
            }
        }
    }

    pub(crate) fn readiness(&self) -> (u16, String) {
        if self.state.lifecycle.is_draining() {
            return (503, "draining\n".into());
        }
        let active = self.state.active.load();
        let now = Instant::now();
        let down_after = active.config.scrape.down_after_failures;
        let up = active.cluster.backends.iter().filter(|b| b.state(now, down_after) == BackendState::Up).count();
        match (up, active.config.readiness.require_backend) {
            (0, true) => (503, "no routable backend\n".into()),
            // Requests wait in the admission queue (scale from zero).
            (0, false) => (200, "ready: no routable backend yet; requests are queued\n".into()),
            (up, _) => (200, format!("ready: {up} routable backends\n")),
        }
    }

    /// `GET /v1/models`: the union of the engines' models, each as its engine describes it.
    fn models_body(&self) -> String {
        let data = self.state.active.load().cluster.model_cards();
        serde_json::json!({"object": "list", "data": data}).to_string()
    }

    /// `GET /v1/models/{id}` (`id` as in the path, percent-encoded or not).
    fn model_body(&self, id: &str) -> Result<String, ProxyError> {
        let id = percent_encoding::percent_decode_str(id).decode_utf8_lossy();
        let cards = self.state.active.load().cluster.model_cards();
        match cards.into_iter().find(|c| c["id"] == *id) {
            Some(card) => Ok(card.to_string()),
            None => Err(ProxyError::ModelNotFound(id.into_owned())),
        }
    }
}

/// Where `GET /v1/models/{id}` starts.
const MODEL_PREFIX: &str = "/v1/models/";

/// vLLM's model routes outside `/v1/`.
const ENGINE_ROUTES: [&str; 7] =
    ["/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank", "/v2/rerank"];

/// vLLM's administrative routes under `/v1/`, never proxied: a client with an API key must
/// not load adapters into engines it shares with others.
const ENGINE_ADMIN_ROUTES: [&str; 2] = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"];

/// Whether `path` is an inference route the gateway proxies when POSTed: every `/v1/*`
/// route but the model list and the engines' administrative routes, and vLLM's model
/// routes outside `/v1/` ([`ENGINE_ROUTES`]). The body names the model (JSON, or the
/// `model` field of a multipart form).
pub(crate) fn is_model_route(path: &str) -> bool {
    let v1 = path.starts_with("/v1/") && path != "/v1/models" && !path.starts_with(MODEL_PREFIX);
    (v1 && !ENGINE_ADMIN_ROUTES.contains(&path)) || ENGINE_ROUTES.contains(&path)
}

/// Backends that may take a request for `model` now, `tried` excluded: up, not ejected,
/// under the circuit breaker's in-flight limit, as of `now`. Also whether any backend serves
/// the model.
pub(crate) fn routable(
    active: &Active,
    model: &str,
    tried: &[usize],
    now: Instant,
) -> (Vec<crate::policy::Candidate>, bool) {
    let cfg = &active.config;
    let (mut candidates, known) =
        active.cluster.candidates(model, tried, now, cfg.scrape.down_after_failures, cfg.scrape.stale_after());
    let max = cfg.health.max_inflight_per_backend;
    if max > 0 {
        candidates.retain(|c| c.inflight < max);
    }
    (candidates, known)
}

/// Read the request body within the size cap, the process-wide buffer cap and the
/// deadline. The buffer's bytes are held in `held` (a declared length before any byte is
/// read; a chunked body's allocation as it grows) until the request ends.
async fn read_body(
    s: &mut Downstream<'_>,
    cfg: &GatewayConfig,
    bodies: &Arc<BodyBudget>,
    held: &mut Option<BodyReservation>,
) -> Result<Bytes, ProxyError> {
    let limit = cfg.limits.max_body_bytes;
    let cap = cfg.limits.max_buffered_body_bytes;
    // The session checked the framing: a length is one number of digits.
    let declared = match s.head().body_framing() {
        crate::downstream::head::BodyFraming::Length(n) => n,
        crate::downstream::head::BodyFraming::Chunked => 0,
    };
    if declared > limit {
        return Err(ProxyError::BodyTooLarge { limit });
    }
    let reservation = held.insert(bodies.reserve(declared, cap).ok_or(ProxyError::BodyBufferFull)?);
    let read = async {
        // A body that arrives in one piece (the usual one, read with its head) is kept as
        // it is (`whole`); one in several pieces is gathered into `buf`.
        let mut whole: Option<Bytes> = None;
        let mut buf = BytesMut::new();
        while let Some(chunk) =
            s.read_body().await.map_err(|e| ProxyError::BadRequest(format!("could not read the request body: {e}")))?
        {
            let len = whole.as_ref().map_or(buf.len(), Bytes::len) + chunk.len();
            if len as u64 > limit {
                return Err(ProxyError::BodyTooLarge { limit });
            }
            if whole.is_none() && buf.is_empty() {
                if !reservation.grow_to(chunk.len() as u64, cap) {
                    return Err(ProxyError::BodyBufferFull);
                }
                whole = Some(chunk);
                continue;
            }
            if let Some(first) = whole.take() {
                buf.reserve(len.max(declared as usize));
                buf.extend_from_slice(&first);
            }
            buf.reserve(chunk.len());
            if !reservation.grow_to(buf.capacity() as u64, cap) {
                return Err(ProxyError::BodyBufferFull);
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(whole.unwrap_or_else(|| buf.freeze()))
    };
    match crate::deadline::within(cfg.limits.body_read_timeout(), read).await {
        Ok(r) => r,
        Err(_) => Err(ProxyError::BodyTimeout(cfg.limits.body_read_timeout_ms)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_id_is_kept_when_sane_and_made_otherwise() {
        let mut ctx = RequestCtx::new("POST", "/v1/completions");
        ctx.take_request_id(Some(b"req-42"));
        assert_eq!(ctx.request_id.as_deref(), Some("req-42"));
        for bad in [&b""[..], b"has space", &[b'x'; 129]] {
            ctx.take_request_id(Some(bad));
            let id = ctx.request_id.clone().unwrap();
            assert!(id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
    }

    /// Size of what `f` returns, without calling it.
    fn returned_size<A, B, R>(_f: impl FnOnce(A, B) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// pingora boxes each connection's handler future (async_trait), which copies the whole
    /// state machine once per request: at 12 KB (pingora's connect future inlined) that copy
    /// was 9% of the gateway's instructions. Rare paths with big futures get their own box.
    #[test]
    fn the_per_request_future_stays_small() {
        let handle = returned_size(|app: &'static ProxyApp, s: &'static mut Downstream<'static>| app.handle(s));
        // 4,192 bytes in a debug build with pingora 0.9.1 before the request path was split
        // into phases, 3,632 after (release builds are smaller).
        eprintln!("the request handler's future: {handle} bytes");
        assert!(handle <= 6 * 1024, "the request handler's future grew to {handle} bytes");
    }
}
