//! The request driver: one function, [`ProxyApp::drive`], runs a request's phases over any
//! [`Transport`] — the gateway's HTTP/1.1 session, pingora's HTTP/2 session
//! ([`crate::downstream::Downstream`] holds either) and an Endpoint Picker's ext_proc stream
//! ([`crate::epp`]).
//!
//! Every rule lives here once: the route table ([`super::routes`]), API keys and rates, the
//! body caps and deadline, the plan, the token budget, aliases, the admission queue, the
//! re-plan after a reload mid-queue, and the `finish` phase (metrics, token settlement, one
//! access line). A transport differs only where its protocol does: how it reads a body, how
//! it notices the client leaving, how it answers on the gateway's behalf, and how it
//! delivers a planned request ([`Transport::deliver`]: HTTP makes the exchange with an
//! engine and streams the answer; the picker names the engine and lets the other gateway
//! make the exchange).

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use crate::access_log::AccessLine;
use crate::active::Active;
use crate::admission::Ticket;
use crate::body_budget::{BodyBudget, BodyReservation};
use crate::config::LimitsConfig;
use crate::downstream::head::BodyFraming;
use crate::downstream::RequestHead;
use crate::error::ProxyError;
use crate::http::REQUEST_ID;

use super::ctx::{Outcome, RequestCtx, Reuse};
use super::plan::{plan_request, RoutePlan};
use super::queue::Admitted;
use super::routes::{normalize_target, route, Route};
use super::ProxyApp;

/// Why a request body could not be read.
pub(crate) enum BodyError {
    /// The body is refused (malformed, too large, too slow): answered.
    Refused(ProxyError),
    /// The client (or the gateway in front) went away before its end: nothing to answer.
    Gone,
}

/// A request planned and admitted: what [`Transport::deliver`] sends on.
pub(crate) struct Planned {
    /// The snapshot the plan fits (the one in force after the queue, when it waited).
    pub active: Arc<Active>,
    /// Model, stream, charge, prefix hashes…
    pub plan: RoutePlan,
    /// The body the engine gets (an alias's model rewritten).
    pub body: Bytes,
    /// The admission queue's ticket, when the request waited: let go once it is counted in
    /// flight on an engine, so the next waiter sees that engine one request busier.
    pub ticket: Option<Ticket>,
}

/// The client side of one request, whatever carries it.
pub(crate) trait Transport {
    /// The request head.
    fn head(&self) -> &RequestHead;

    /// The next piece of the request body; `None` at its end.
    fn read_body(&mut self) -> impl Future<Output = Result<Option<Bytes>, BodyError>> + Send;

    /// Resolves when the client has left (its body already read): watched while the request
    /// waits in the queue, so an abandoned request gives up its place.
    fn closed(&mut self) -> impl Future<Output = ()> + Send;

    /// Answer on the gateway's own behalf: a whole small response.
    fn respond(
        &mut self,
        status: u16,
        content_type: &str,
        body: Bytes,
        fields: &[(&str, &str)],
    ) -> impl Future<Output = Reuse> + Send;

    /// Send a planned request on to an engine, and the answer back (HTTP), or name the engine
    /// for the gateway in front and watch the answer pass (the picker).
    fn deliver(
        &mut self,
        app: &ProxyApp,
        planned: Planned,
        ctx: &mut RequestCtx,
    ) -> impl Future<Output = Outcome> + Send;
}

impl ProxyApp {
    /// One request over `t`, under the snapshot `active` (loaded once, when its head
    /// arrived): admit → route → (read and plan → queue → deliver) → finish. Returns whether
    /// the client's connection may carry another request.
    pub(crate) async fn drive<T: Transport + Send>(&self, t: &mut T, active: Arc<Active>) -> Reuse {
        let head = t.head();
        // Routed on the normal form, and forwarded as such when it differs from what was sent.
        let (mut ctx, refused) = match normalize_target(head.path_and_query()) {
            Ok(Cow::Borrowed(_)) => (RequestCtx::new(head.method(), head.path()), None),
            Ok(Cow::Owned(normal)) => {
                let mut ctx = RequestCtx::new(head.method(), path_of(&normal));
                ctx.target = Some(normal);
                (ctx, None)
            }
            Err(why) => (RequestCtx::new(head.method(), head.path()), Some(ProxyError::BadRequest(why.into()))),
        };
        let outcome = match refused {
            Some(e) => self.fail(t, e, &ctx).await,
            None => match self.admit(&active, head.get("authorization"), &mut ctx).await {
                Err(e) => self.reject(t, e, &ctx).await,
                Ok(()) => self.route(t, active, &mut ctx).await,
            },
        };
        self.finish(&mut ctx, outcome);
        outcome.reuse
    }

    /// The answer for `ctx`'s method and path ([`super::routes`]).
    async fn route<T: Transport + Send>(&self, t: &mut T, active: Arc<Active>, ctx: &mut RequestCtx) -> Outcome {
        match route(&ctx.method, &ctx.path) {
            Route::Healthz => self.answer(t, 200, "text/plain", Bytes::from_static(b"ok\n")).await,
            Route::Ready => {
                let (status, body) = self.readiness(&active);
                self.answer(t, status, "text/plain", Bytes::from(body)).await
            }
            Route::Models => self.answer(t, 200, "application/json", Bytes::from(models_body(&active))).await,
            Route::Model(id) => match model_body(&active, id) {
                Ok(body) => self.answer(t, 200, "application/json", Bytes::from(body)).await,
                Err(e) => self.fail(t, e, ctx).await,
            },
            Route::Inference => self.infer(t, active, ctx).await,
            Route::MethodNotAllowed => {
                let e = ProxyError::MethodNotAllowed(ctx.method.to_string());
                self.fail(t, e, ctx).await
            }
            Route::Unknown => {
                let e = ProxyError::NoRoute(ctx.path.to_string());
                self.fail(t, e, ctx).await
            }
        }
    }

    /// An inference request: read and plan → queue → deliver.
    async fn infer<T: Transport + Send>(&self, t: &mut T, active: Arc<Active>, ctx: &mut RequestCtx) -> Outcome {
        ctx.take_request_id(t.head().get(REQUEST_ID));
        let body = match read_body(t, &active.config.limits, &self.state.bodies, &mut ctx.body_held).await {
            Ok(body) => body,
            Err(BodyError::Refused(e)) => return self.reject_or_fail(t, e, ctx).await,
            Err(BodyError::Gone) => return Outcome::client_gone(499),
        };
        ctx.request_bytes = body.len();
        let tokenizes = self.state.prompt_tokenizer.is_some();
        let mut plan = match plan_request(t.head(), &body, &active, ctx.tenant.as_deref(), tokenizes) {
            Ok(plan) => plan,
            Err(refused) => {
                ctx.stream = refused.stream;
                return self.fail(t, refused.error, ctx).await;
            }
        };
        ctx.stream = plan.stream;
        ctx.model = Some(plan.model.clone());
        if let Err(e) = self.charge_tokens(&plan, ctx).await {
            return self.reject(t, e, ctx).await;
        }
        self.tokenize(&mut plan, &body).await;
        self.state.metrics.count_alias(plan.alias.as_deref(), &plan.model);
        ctx.writeback = plan.writeback(&active);
        let body = plan.engine_body(body);
        // Hold the request while no engine can take it; the body was read whole, so anything
        // the client does now is leaving.
        let tenant = ctx.tenant.as_ref().map(|t| t.name.as_str());
        let admitted = self.queue(t.closed(), &active, &plan.model, ctx.started, plan.priority, tenant).await;
        let (active, ticket) = match admitted {
            Admitted::Go(None) => (active, None),
            // It waited: a reload meanwhile may have changed the policy. The one re-plan.
            Admitted::Go(Some(ticket)) => {
                let now = self.state.active.load_full();
                if !Arc::ptr_eq(&now, &active) {
                    plan.fit_policy(t.head(), &body, &now, tokenizes);
                    self.tokenize(&mut plan, &body).await;
                }
                (now, Some(ticket))
            }
            Admitted::Refused(e) => return self.reject_or_fail(t, e, ctx).await,
            Admitted::ClientGone => return Outcome::client_gone(499),
        };
        t.deliver(self, Planned { active, plan, body, ticket }, ctx).await
    }

    /// The plan's prompt tokenized into the precise index's block keys, on the tokenizing
    /// pool ([`crate::kv_events::prompt`]), when the plan has one to tokenize.
    async fn tokenize(&self, plan: &mut RoutePlan, body: &Bytes) {
        let (Some(kv), Some(seen)) = (&self.state.prompt_tokenizer, plan.unread_prompt.take()) else { return };
        plan.precise = kv.precise(body.clone(), seen).await;
    }

    /// A whole answer of the gateway's own.
    async fn answer<T: Transport + Send>(&self, t: &mut T, status: u16, content_type: &str, body: Bytes) -> Outcome {
        Outcome::answered(status, t.respond(status, content_type, body, &[]).await)
    }

    /// [`Self::reject`] for the gateway's own refusals (limits, keys, rates), [`Self::fail`]
    /// for everything else.
    async fn reject_or_fail<T: Transport + Send>(&self, t: &mut T, e: ProxyError, ctx: &RequestCtx) -> Outcome {
        if e.is_refusal() {
            self.reject(t, e, ctx).await
        } else {
            self.fail(t, e, ctx).await
        }
    }

    /// [`Self::fail`] for a request the gateway refuses on its own (header limits, keys,
    /// rates), counted in `switchyard_rejected_total{reason,tenant}`.
    pub(crate) async fn reject<T: Transport + Send>(&self, t: &mut T, e: ProxyError, ctx: &RequestCtx) -> Outcome {
        self.state.metrics.rejected.with_label_values(&[e.kind(), ctx.tenant_name()]).inc();
        self.fail(t, e, ctx).await
    }

    /// Answer `e` in the OpenAI shape, with `Retry-After` when it has one and the request id.
    pub(crate) async fn fail<T: Transport + Send>(&self, t: &mut T, e: ProxyError, ctx: &RequestCtx) -> Outcome {
        let retry_after = e.retry_after_secs().map(|secs| secs.to_string());
        let fields = [("retry-after", retry_after.as_deref()), (REQUEST_ID, ctx.request_id.as_deref())];
        let fields: Vec<(&str, &str)> = fields.iter().filter_map(|(k, v)| v.map(|v| (*k, v))).collect();
        let reuse = t.respond(e.status(), "application/json", Bytes::from(e.body()), &fields).await;
        Outcome::failed(&e, reuse)
    }
}

/// The path of a target (its query left out).
fn path_of(target: &str) -> &str {
    target.split_once('?').map_or(target, |(path, _)| path)
}

/// `GET /v1/models`: the union of the engines' models, each as its engine describes it.
fn models_body(active: &Active) -> String {
    let data = active.cluster.model_cards();
    serde_json::json!({"object": "list", "data": data}).to_string()
}

/// `GET /v1/models/{id}` (`id` as in the path, percent-encoded or not).
fn model_body(active: &Active, id: &str) -> Result<String, ProxyError> {
    let id = percent_encoding::percent_decode_str(id).decode_utf8_lossy();
    match active.cluster.model_cards().into_iter().find(|c| c["id"] == *id) {
        Some(card) => Ok(card.to_string()),
        None => Err(ProxyError::ModelNotFound(id.into_owned())),
    }
}

/// Read the request body within `limits.max_body_bytes`, the process-wide buffer cap and
/// `limits.body_read_timeout_ms`, on any transport. The buffer's bytes are held in `held` (a
/// declared length before any byte is read; a body of unknown length's allocation as it
/// grows) until the request ends.
async fn read_body<T: Transport>(
    t: &mut T,
    limits: &LimitsConfig,
    bodies: &Arc<BodyBudget>,
    held: &mut Option<BodyReservation>,
) -> Result<Bytes, BodyError> {
    let limit = limits.max_body_bytes;
    let cap = limits.max_buffered_body_bytes;
    // The session checked the framing: a length is one number of digits.
    let declared = match t.head().body_framing() {
        BodyFraming::Length(n) => n,
        BodyFraming::Chunked => 0,
    };
    let refused = |e| Err(BodyError::Refused(e));
    if declared > limit {
        return refused(ProxyError::BodyTooLarge { limit });
    }
    let Some(reservation) = bodies.reserve(declared, cap) else { return refused(ProxyError::BodyBufferFull) };
    let reservation = held.insert(reservation);
    let read = async {
        // A body that arrives in one piece (the usual one, read with its head) is kept as
        // it is (`whole`); one in several pieces is gathered into `buf`.
        let mut whole: Option<Bytes> = None;
        let mut buf = BytesMut::new();
        while let Some(chunk) = t.read_body().await? {
            let len = whole.as_ref().map_or(buf.len(), Bytes::len) + chunk.len();
            if len as u64 > limit {
                return refused(ProxyError::BodyTooLarge { limit });
            }
            if whole.is_none() && buf.is_empty() {
                if !reservation.grow_to(chunk.len() as u64, cap) {
                    return refused(ProxyError::BodyBufferFull);
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
                return refused(ProxyError::BodyBufferFull);
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(whole.unwrap_or_else(|| buf.freeze()))
    };
    match crate::deadline::within(limits.body_read_timeout(), read).await {
        Ok(r) => r,
        Err(_) => refused(ProxyError::BodyTimeout(limits.body_read_timeout_ms)),
    }
}

impl ProxyApp {
    /// Phase `finish`: settle the tenant's token charge, count the request and write its
    /// access-log line — once per request, from its [`Outcome`], whatever path it took.
    fn finish(&self, ctx: &mut RequestCtx, outcome: Outcome) {
        let status = outcome.status;
        self.settle_tokens(ctx, status);
        let elapsed = ctx.started.elapsed();
        let m = &self.state.metrics;
        if ctx.path.starts_with("/v1/") {
            match &ctx.backend {
                Some(b) if status == 200 => m.of(b).ok.inc(),
                b => {
                    let url = b.as_ref().map_or("none", |b| b.url.as_str());
                    m.requests.with_label_values(&[url, itoa::Buffer::new().format(status)]).inc();
                }
            }
            m.duration.observe(elapsed.as_secs_f64());
        }
        self.state.access_log.log(&AccessLine {
            ts_ms: switchyard_shim::process::unix_ms(),
            method: &ctx.method,
            path: &ctx.path,
            status,
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
            error: outcome.error,
            request_id: ctx.request_id.as_deref(),
        });
    }
}
