//! One ext_proc stream: one request through the proxy's own phases, with the other gateway
//! (Envoy) making the exchange with the engine.
//!
//! | phase | what Envoy sends | what the picker does |
//! |---|---|---|
//! | `head` | request headers | the head, the request id; the API key and its rate ([`ProxyApp::admit`]); a request without a body goes to a random ready engine at once |
//! | `body` | request body chunks, maybe trailers | held within `limits.max_body_bytes`, the process-wide buffer cap and `limits.body_read_timeout_ms`; nothing is answered yet (the headers answer waits for the pick) |
//! | `plan`, `queue`, `pick` | — | [`plan_request`], the token charge, the admission queue (a refusal is a 429: GIE's "shed"), the policy's pick within the subset hint, with fallbacks |
//! | `route` | — | the headers answer naming the engine(s), then the body echoed, then the trailers |
//! | `response` | response headers, body chunks, trailers | the engine that served (in-flight and TTFT are counted there), its status, the first content, the usage; each passed on unchanged |
//! | `finish` | the response's end, or the stream cancelled | in-flight released, tokens settled, one access-log line ([`ProxyApp::finish`]) |

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::protocol;
use crate::cluster::{Backend, BackendState};
use crate::config::EppConfig;
use crate::downstream::RequestHead;
use crate::error::{ProxyError, UpstreamErrorKind};
use crate::http::{EDGE_ONLY, REQUEST_ID};
use crate::proxy::{plan_request, Admitted, InflightGuard, ProxyApp, RequestCtx};
use crate::state::Active;

/// Where the picker's answers go (the gRPC response stream).
pub(super) type Outbound = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// Why a stream ends before its response phase.
enum Stop {
    /// Envoy closed or cancelled the stream (the client left, or Envoy gave up).
    Gone,
    /// The picker answered: an immediate response, or an error for a protocol violation.
    Answered,
}

/// What the request phases leave to the response phase.
struct Routed {
    /// The snapshot the pick was made in.
    active: Arc<Active>,
    /// The engine counted as serving the request (in the cluster view of `active`).
    index: usize,
    /// Its in-flight count and pending prefill while the request is on it.
    guard: InflightGuard,
}

/// One open stream in `switchyard_epp_streams`, for as long as it lives.
struct OpenStream(prometheus::IntGauge);

impl OpenStream {
    fn count(gauge: &prometheus::IntGauge) -> Self {
        gauge.inc();
        OpenStream(gauge.clone())
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// How a request body ended.
enum BodyEnd {
    /// With the last body chunk.
    Chunk,
    /// With trailers (echoed after the body).
    Trailers,
}

/// One stream's state.
pub(super) struct Exchange {
    app: Arc<ProxyApp>,
    epp: Arc<EppConfig>,
    inbound: Streaming<ProcessingRequest>,
    out: Outbound,
}

/// The `ip:port` the gateway knows an engine by.
fn endpoint(b: &Backend) -> String {
    b.addr.map_or_else(|| b.authority.clone(), |a| a.to_string())
}

impl Exchange {
    /// A stream Envoy opened.
    pub(super) fn new(
        app: Arc<ProxyApp>,
        epp: Arc<EppConfig>,
        inbound: Streaming<ProcessingRequest>,
        out: Outbound,
    ) -> Self {
        Exchange { app, epp, inbound, out }
    }

    /// Serve the stream to its end. Its request counts as in flight for a drain.
    pub(super) async fn run(mut self) {
        let state = self.app.state().clone();
        let _in_flight = state.lifecycle.in_flight.enter();
        let _open = OpenStream::count(&state.metrics.epp_streams);
        let deadline = state.active.load().config.limits.header_read_timeout();
        // A stream that says nothing is closed like a connection that sends no head.
        let (headers, meta) = match tokio::time::timeout(deadline, self.next()).await {
            Ok(Some((Msg::RequestHeaders(h), meta))) => (h, meta),
            Ok(Some(_)) => return self.refuse("the request headers must come first").await,
            Ok(None) => return,
            Err(_) => {
                state.metrics.header_timeouts.inc();
                return;
            }
        };
        let head = match protocol::request_head(headers.headers.as_ref()) {
            Ok(h) => RequestHead::from_pingora(&h),
            Err(e) => return self.refuse(&e).await,
        };
        let mut ctx = RequestCtx::new(head.method(), head.path());
        ctx.take_request_id(head.get(REQUEST_ID));
        match self.request(&head, headers.end_of_stream, meta.as_ref(), &mut ctx).await {
            Ok(mut routed) => {
                let ended = self.response(&mut routed, &mut ctx).await;
                // The request is over for the engine: released before the log line.
                drop(routed);
                self.app.finish(&mut ctx);
                if ended {
                    self.drain().await;
                }
            }
            Err(stop) => {
                if matches!(stop, Stop::Gone) && ctx.status == 0 {
                    ctx.status = 499;
                    ctx.client_gone();
                }
                self.app.finish(&mut ctx);
            }
        }
    }

    /// Phases `head` to `route`.
    async fn request(
        &mut self,
        head: &RequestHead,
        headers_only: bool,
        meta: Option<&Metadata>,
        ctx: &mut RequestCtx,
    ) -> Result<Routed, Stop> {
        let authorization = head.get("authorization");
        if let Err(e) = self.app.admit(authorization, ctx).await {
            return Err(self.reject(e, ctx).await);
        }
        let subset = protocol::subset_hint(meta);
        if headers_only {
            return self.route_any(subset.as_deref(), ctx).await;
        }
        let (body, end) = self.read_body(ctx).await?;
        let state = self.app.state().clone();
        let planned_with = state.active.load_full();
        ctx.request_bytes = body.len();
        let tenant = ctx.tenant.clone();
        let mut plan = match plan_request(head, &body, &planned_with, tenant.as_deref(), state.kv_events.as_deref()) {
            Ok(p) => p,
            Err(e) => return Err(self.fail(e, ctx).await),
        };
        ctx.stream = plan.stream;
        ctx.model = Some(plan.model.clone());
        state.metrics.count_alias(plan.alias.as_deref(), &plan.model);
        ctx.writeback = plan.writeback(&planned_with);
        let body = plan.engine_body(body.freeze());
        if let Err(e) = self.app.charge_tokens(&plan, ctx).await {
            return Err(self.reject(e, ctx).await);
        }
        // Nothing is due from Envoy before the answer: a message, or the stream's end, is
        // the client leaving (or Envoy giving up).
        let inbound = &mut self.inbound;
        let gone = async move {
            let _ = inbound.message().await;
        };
        let name = tenant.as_ref().map(|t| t.name.as_str());
        let ticket = match self.app.queue(gone, &planned_with, &plan.model, ctx.started, plan.priority, name).await {
            Admitted::Go(t) => t,
            Admitted::Refused(ProxyError::NoBackend(model)) => {
                return Err(self.reject(ProxyError::Shed(model), ctx).await)
            }
            Admitted::Refused(e) => return Err(self.reject(e, ctx).await),
            Admitted::ClientGone => return Err(Stop::Gone),
        };
        let active = state.active.load_full();
        if !Arc::ptr_eq(&active, &planned_with) {
            plan.fit_policy(head, &body, &active, state.kv_events.as_deref());
        }
        let excluded: Vec<usize> = match &subset {
            None => Vec::new(),
            Some(allowed) => (0..active.cluster.backends.len())
                .filter(|&i| !allowed.contains(&endpoint(&active.cluster.backends[i])))
                .collect(),
        };
        let (pick, fallbacks) = match self.app.pick_with_fallbacks(&active, &plan, ctx, &excluded, self.epp.fallbacks) {
            Ok(x) => x,
            Err(e) => return Err(self.fail(e, ctx).await),
        };
        let backend = active.cluster.backends[pick.index].clone();
        let guard = InflightGuard::new(backend.clone(), pick.uncached, pick.work, plan.stream, Instant::now());
        drop(ticket);
        let mut endpoints = endpoint(&backend);
        for i in fallbacks {
            endpoints.push(',');
            endpoints.push_str(&endpoint(&active.cluster.backends[i]));
        }
        self.send_route(&endpoints, &active, ctx, body.len() != ctx.request_bytes).await?;
        let trailers = matches!(end, BodyEnd::Trailers);
        for part in protocol::request_body(&body, !trailers) {
            self.send(part).await?;
        }
        if trailers {
            self.send(protocol::request_trailers()).await?;
        }
        Ok(Routed { active, index: pick.index, guard })
    }

    /// A request without a body (a GET): a random ready engine, within the subset hint.
    async fn route_any(&mut self, subset: Option<&[String]>, ctx: &mut RequestCtx) -> Result<Routed, Stop> {
        let active = self.app.state().active.load_full();
        let (now, down_after) = (Instant::now(), active.config.scrape.down_after_failures);
        let ready: Vec<usize> = (0..active.cluster.backends.len())
            .filter(|&i| {
                let b = &active.cluster.backends[i];
                b.state(now, down_after) == BackendState::Up && subset.is_none_or(|s| s.contains(&endpoint(b)))
            })
            .collect();
        if ready.is_empty() {
            return Err(self.fail(ProxyError::NoBackend("*".into()), ctx).await);
        }
        let index = ready[rand::random_range(0..ready.len())];
        let backend = active.cluster.backends[index].clone();
        ctx.backend = Some(backend.clone());
        ctx.reason = Some("random");
        let guard = InflightGuard::new(backend.clone(), 0, 0, false, Instant::now());
        self.send_route(&endpoint(&backend), &active, ctx, false).await?;
        Ok(Routed { active, index, guard })
    }

    /// Phase `body`: the whole request body, and how it ended.
    async fn read_body(&mut self, ctx: &mut RequestCtx) -> Result<(BytesMut, BodyEnd), Stop> {
        let state = self.app.state().clone();
        let limits = state.active.load().config.limits.clone();
        let (limit, cap) = (limits.max_body_bytes, limits.max_buffered_body_bytes);
        let Some(held) = state.bodies.reserve(0, cap) else {
            return Err(self.reject(ProxyError::BodyBufferFull, ctx).await);
        };
        let held = ctx.body_held.insert(held);
        let mut body = BytesMut::new();
        let read = async {
            loop {
                match self.next().await {
                    None => return Err(None),
                    Some((Msg::RequestBody(b), _)) => {
                        let len = (body.len() + b.body.len()) as u64;
                        if len > limit {
                            return Err(Some(ProxyError::BodyTooLarge { limit }));
                        }
                        if !held.grow_to(len, cap) {
                            return Err(Some(ProxyError::BodyBufferFull));
                        }
                        body.extend_from_slice(&b.body);
                        if b.end_of_stream {
                            return Ok(BodyEnd::Chunk);
                        }
                    }
                    Some((Msg::RequestTrailers(_), _)) => return Ok(BodyEnd::Trailers),
                    Some(_) => return Err(Some(ProxyError::BadRequest("ext_proc: expected the request body".into()))),
                }
            }
        };
        let end = match tokio::time::timeout(limits.body_read_timeout(), read).await {
            Ok(Ok(end)) => end,
            Ok(Err(None)) => return Err(Stop::Gone),
            Ok(Err(Some(e @ ProxyError::BodyBufferFull))) => return Err(self.reject(e, ctx).await),
            Ok(Err(Some(e))) => return Err(self.fail(e, ctx).await),
            Err(_) => return Err(self.fail(ProxyError::BodyTimeout(limits.body_read_timeout_ms), ctx).await),
        };
        Ok((body, end))
    }

    /// Phase `response`: each message passed on, the request accounted on the engine that
    /// served it. True when the response ended, false when the stream did first.
    async fn response(&mut self, r: &mut Routed, ctx: &mut RequestCtx) -> bool {
        loop {
            let Some((msg, meta)) = self.next().await else {
                ctx.client_gone();
                if ctx.status == 0 {
                    ctx.status = 499;
                }
                return false;
            };
            let (reply, end) = match msg {
                Msg::ResponseHeaders(h) => {
                    self.served(r, meta.as_ref(), h.headers.as_ref(), ctx);
                    self.response_status(r, h.headers.as_ref(), ctx);
                    let id = ctx.request_id.as_deref().unwrap_or("");
                    // The alias written back changes the length.
                    let remove: &[&str] = match ctx.writeback {
                        Some(_) => &[protocol::SERVED_KEY, "content-length"],
                        None => &[protocol::SERVED_KEY],
                    };
                    (protocol::response_headers(&[(REQUEST_ID, id)], remove), h.end_of_stream)
                }
                Msg::ResponseBody(b) => {
                    let body = match ctx.writeback.as_mut() {
                        Some(w) => w.apply(&b.body, b.end_of_stream),
                        None => b.body,
                    };
                    self.observe(r, &body, ctx);
                    (protocol::response_body(&body, b.end_of_stream), b.end_of_stream)
                }
                Msg::ResponseTrailers(_) => (protocol::response_trailers(), true),
                Msg::RequestHeaders(_) | Msg::RequestBody(_) | Msg::RequestTrailers(_) => {
                    self.refuse("a request message after the request was routed").await;
                    return false;
                }
            };
            if self.send(reply).await.is_err() {
                ctx.client_gone();
                return false;
            }
            if end {
                return true;
            }
        }
    }

    /// The engine's status: a 5xx counts against it (outlier ejection), anything else is
    /// a success; an SSE body is watched for its first content.
    fn response_status(&self, r: &Routed, headers: Option<&HeaderMap>, ctx: &mut RequestCtx) {
        ctx.status = protocol::response_status(headers).unwrap_or(0);
        if ctx.status >= 500 {
            let detail = format!("status {}", ctx.status);
            self.app.upstream_failed(&r.active, Some(r.index), UpstreamErrorKind::Status5xx, &detail);
        } else {
            r.active.cluster.backends[r.index].record_success();
        }
        ctx.sse = protocol::find_header(headers, "content-type").is_some_and(|v| v.starts_with(b"text/event-stream"));
    }

    /// The gateway says which engine served (it went down the fallback list): the request
    /// is counted there from now on.
    fn served(&self, r: &mut Routed, meta: Option<&Metadata>, headers: Option<&HeaderMap>, ctx: &mut RequestCtx) {
        let Some(served) = protocol::served_endpoint(meta, headers) else { return };
        let backends = &r.active.cluster.backends;
        if endpoint(&backends[r.index]) == served {
            return;
        }
        let Some(index) = backends.iter().position(|b| endpoint(b) == served) else { return };
        let backend = backends[index].clone();
        ctx.backend = Some(backend.clone());
        ctx.retries += 1;
        r.guard = InflightGuard::new(backend, 0, 0, false, Instant::now());
        r.index = index;
    }

    /// A response body chunk: the first bytes are the TTFT, the first generated content ends
    /// the prefill the policy learns from, the usage settles the token charge.
    fn observe(&self, r: &mut Routed, chunk: &[u8], ctx: &mut RequestCtx) {
        if chunk.is_empty() {
            return;
        }
        ctx.chunks += 1;
        ctx.response_bytes += chunk.len();
        if !r.guard.prefilled() && (!ctx.sse || ctx.content.observe(chunk)) {
            r.guard.first_content(Instant::now());
        }
        if ctx.ttft.is_none() {
            let t = ctx.started.elapsed();
            ctx.ttft = Some(t);
            let url = r.active.cluster.backends[r.index].url.as_str();
            self.app.state().metrics.ttft.with_label_values(&[url]).observe(t.as_secs_f64());
        }
        if ctx.charged.is_some() {
            ctx.usage.observe(chunk);
        }
    }

    /// After the response's end: answer what Envoy may still send (trailers) until it closes
    /// the stream, for at most the idle timeout.
    async fn drain(&mut self) {
        let idle = self.app.state().active.load().config.timeouts.idle();
        let rest = async {
            while let Some((msg, _)) = self.next().await {
                let reply = match msg {
                    Msg::ResponseTrailers(_) => protocol::response_trailers(),
                    Msg::ResponseBody(b) => protocol::response_body(&b.body, b.end_of_stream),
                    _ => break,
                };
                if self.send(reply).await.is_err() {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(idle.max(Duration::from_secs(1)), rest).await;
    }

    /// The headers answer: the engines in `destination_header` and `envoy.lb`, the request
    /// id, and what must not reach an engine removed (the edge's credentials; the tenant's
    /// key when keys are on; a client's claim of the served endpoint).
    /// `resized`: the body echoed differs in length from the client's (an alias rewrote its
    /// model), so the client's `Content-Length` goes (Envoy then sends the body chunked).
    async fn send_route(&self, endpoints: &str, active: &Active, ctx: &RequestCtx, resized: bool) -> Result<(), Stop> {
        let id = ctx.request_id.as_deref().unwrap_or("");
        let mut remove = vec![protocol::SERVED_KEY];
        remove.extend_from_slice(EDGE_ONLY);
        if active.config.auth.enabled() {
            remove.push("authorization");
        }
        if resized {
            remove.push("content-length");
        }
        let reply = protocol::route_to(&self.epp.destination_header, endpoints, &[(REQUEST_ID, id)], &remove);
        self.send(reply).await
    }

    /// The next message with a request, and the metadata Envoy sent with it; `None` when the
    /// stream ended or broke.
    async fn next(&mut self) -> Option<(Msg, Option<Metadata>)> {
        loop {
            match self.inbound.message().await {
                Ok(Some(ProcessingRequest { request: Some(m), metadata_context, .. })) => {
                    return Some((m, metadata_context))
                }
                // Nothing to process (flow control only): wait for the next one.
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => return None,
            }
        }
    }

    async fn send(&self, reply: ProcessingResponse) -> Result<(), Stop> {
        self.out.send(Ok(reply)).await.map_err(|_| Stop::Gone)
    }

    /// Answer `e` to the client in the OpenAI shape (an immediate response).
    async fn fail(&self, e: ProxyError, ctx: &mut RequestCtx) -> Stop {
        ctx.status = e.status();
        ctx.error_kind = Some(e.kind());
        let reply = protocol::immediate(e.status(), e.body(), e.retry_after_secs(), ctx.request_id.as_deref());
        match self.send(reply).await {
            Ok(()) => Stop::Answered,
            Err(stop) => stop,
        }
    }

    /// [`Self::fail`] for the gateway's own refusals (keys, rates, queue), counted in
    /// `switchyard_rejected_total`.
    async fn reject(&self, e: ProxyError, ctx: &mut RequestCtx) -> Stop {
        self.app.state().metrics.rejected.with_label_values(&[e.kind(), ctx.tenant_name()]).inc();
        self.fail(e, ctx).await
    }

    /// End the stream with a gRPC error: Envoy sent something the protocol does not allow
    /// here (Envoy then applies its `failure_mode_allow`).
    async fn refuse(&self, why: &str) {
        tracing::debug!(why, "ext_proc stream refused");
        self.app.state().metrics.epp_protocol_errors.inc();
        let _ = self.out.send(Err(Status::invalid_argument(format!("switchyard epp: {why}")))).await;
    }
}
