//! One ext_proc stream as a [`Transport`]: the request driver ([`ProxyApp::drive`]) runs the
//! same phases on it as on an HTTP request; the other gateway (Envoy) makes the exchange
//! with the engine.
//!
//! | phase | what Envoy sends | what the picker does |
//! |---|---|---|
//! | `head` | request headers (and metadata: the subset hint) | the head, as an HTTP request's; within `limits.header_read_timeout_ms` |
//! | driver | request body chunks, maybe trailers | every rule an HTTP request meets: the route table, keys and rates, the body caps, the plan, the token budget, aliases, the admission queue; a refusal or the gateway's own answer is an `ImmediateResponse` |
//! | `deliver` | — | the policy's pick within the subset hint, with fallbacks; the headers answer naming the engine(s), then the body echoed, then the trailers |
//! | `response` | response headers, body chunks, trailers | the engine that served (in-flight and TTFT are counted there), its status, the first content, the usage; each passed on unchanged (an alias written back) |
//! | `finish` | the response's end, or the stream cancelled | in-flight released, tokens settled, one access-log line (the driver's) |
//! | `drain` | trailers, late chunks | answered until Envoy closes the stream |

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::{budget, protocol};
use crate::active::Active;
use crate::cluster::Backend;
use crate::config::EppConfig;
use crate::downstream::RequestHead;
use crate::error::ProxyError;
use crate::http::{EDGE_ONLY, REQUEST_ID};
use crate::proxy::driver::{BodyError, Planned, Transport};
use crate::proxy::{Engine, InflightGuard, Outcome, ProxyApp, RequestCtx, Reuse};

/// Where the picker's answers go (the gRPC response stream).
pub(super) type Outbound = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// The error label of a stream Envoy broke the protocol on after the pick.
const PROTOCOL_ERROR: &str = "epp_protocol_error";
/// … and of one whose response did not pass in time (`epp.response_timeout_ms`, then
/// `timeouts.idle_ms` between messages).
const RESPONSE_TIMEOUT: &str = "epp_response_timeout";

/// The engine a routed request is counted on, while Envoy's exchange with it runs.
struct Routed {
    /// Its position in the cluster view the pick was made in.
    index: usize,
    /// Its in-flight count and pending prefill while the request is on it.
    guard: InflightGuard,
}

/// How a request body ended.
#[derive(Clone, Copy)]
enum BodyEnd {
    /// With the last body chunk (or with the headers: no body).
    Chunk,
    /// With trailers (echoed after the body).
    Trailers,
}

/// One stream, as the request driver's transport.
pub(super) struct ExtProcStream {
    epp: Arc<EppConfig>,
    inbound: Streaming<ProcessingRequest>,
    out: Outbound,
    head: RequestHead,
    /// What Envoy sent with the request headers (the subset hint).
    meta: Option<Metadata>,
    /// How the request body ended, once it has.
    body_end: Option<BodyEnd>,
    /// The response passed to its end: what Envoy still sends is answered after `finish`.
    response_ended: bool,
}

/// The `ip:port` the gateway knows an engine by.
fn endpoint(b: &Backend) -> String {
    b.addr.map_or_else(|| b.authority.clone(), |a| a.to_string())
}

/// Serve a stream Envoy opened, to its end. Its request counts as in flight for a drain.
pub(super) async fn serve(
    app: Arc<ProxyApp>,
    epp: Arc<EppConfig>,
    mut inbound: Streaming<ProcessingRequest>,
    out: Outbound,
) {
    let state = app.state().clone();
    let _in_flight = state.lifecycle.in_flight.enter();
    let deadline = state.active.load().config.limits.header_read_timeout();
    // A stream that says nothing is closed like a connection that sends no head.
    let (headers, meta) = match tokio::time::timeout(deadline, next(&mut inbound)).await {
        Ok(Some((Msg::RequestHeaders(h), meta))) => (h, meta),
        Ok(Some(_)) => return refuse(&app, &out, "the request headers must come first").await,
        Ok(None) => return,
        Err(_) => {
            state.metrics.header_timeouts.inc();
            return;
        }
    };
    let head = match protocol::request_head(headers.headers.as_ref()) {
        Ok(h) => RequestHead::from_pingora(&h),
        Err(e) => return refuse(&app, &out, &e).await,
    };
    let body_end = headers.end_of_stream.then_some(BodyEnd::Chunk);
    let mut stream = ExtProcStream { epp, inbound, out, head, meta, body_end, response_ended: false };
    // The request's one snapshot of the config, policy and backends.
    let active = state.active.load_full();
    let idle = active.config.timeouts.idle();
    app.drive(&mut stream, active).await;
    if stream.response_ended {
        stream.drain(idle).await;
    }
}

impl Transport for ExtProcStream {
    fn head(&self) -> &RequestHead {
        &self.head
    }

    /// The body chunks Envoy streams (`FULL_DUPLEX_STREAMED`), to the last one or the
    /// trailers; the stream ending first is the client leaving.
    async fn read_body(&mut self) -> Result<Option<Bytes>, BodyError> {
        if self.body_end.is_some() {
            return Ok(None);
        }
        match next_message(&mut self.inbound).await {
            // A message past the process-wide body cap (still arriving, in tonic's buffer).
            Err(status) if budget::is_budget_error(&status) => Err(BodyError::Refused(ProxyError::BodyBufferFull)),
            Err(_) | Ok(None) => Err(BodyError::Gone),
            Ok(Some((Msg::RequestBody(b), _))) => {
                if b.end_of_stream {
                    self.body_end = Some(BodyEnd::Chunk);
                }
                Ok(Some(Bytes::from(b.body)))
            }
            Ok(Some((Msg::RequestTrailers(_), _))) => {
                self.body_end = Some(BodyEnd::Trailers);
                Ok(None)
            }
            Ok(Some(_)) => {
                Err(BodyError::Refused(ProxyError::BadRequest("ext_proc: expected the request body".into())))
            }
        }
    }

    /// Nothing is due from Envoy before the answer: a message, or the stream's end, is the
    /// client leaving (or Envoy giving up).
    async fn closed(&mut self) {
        let _ = self.inbound.message().await;
    }

    /// An immediate response: Envoy answers the client itself.
    async fn respond(&mut self, status: u16, content_type: &str, body: Bytes, fields: &[(&str, &str)]) -> Reuse {
        let _ = send(&self.out, protocol::immediate(status, content_type, &body, fields)).await;
        Reuse::Close
    }

    /// The pick (with fallbacks, within the subset hint) named to Envoy, the body echoed,
    /// then the response watched as it passes.
    async fn deliver(&mut self, app: &ProxyApp, planned: Planned, ctx: &mut RequestCtx) -> Outcome {
        let Planned { active, plan, body, ticket } = planned;
        let excluded = self.excluded(&active);
        let (pick, fallbacks) = match app.pick_with_fallbacks(&active, &plan, ctx, &excluded, self.epp.fallbacks) {
            Ok(x) => x,
            Err(e) => return app.fail(self, e, ctx).await,
        };
        let backend = active.cluster.backends[pick.index].clone();
        let guard = InflightGuard::new(backend.clone(), pick.uncached, pick.work, plan.stream, Instant::now());
        let mut routed = Routed { index: pick.index, guard };
        drop(ticket);
        let mut endpoints = endpoint(&backend);
        for i in fallbacks {
            endpoints.push(',');
            endpoints.push_str(&endpoint(&active.cluster.backends[i]));
        }
        if self.route_to(&endpoints, &active, ctx, &body).await.is_err() {
            return Outcome::client_gone(499);
        }
        self.response(app, &active, &mut routed, ctx).await
    }
}

impl ExtProcStream {
    /// The cluster positions outside the subset hint (none without one).
    fn excluded(&self, active: &Active) -> Vec<usize> {
        let Some(allowed) = protocol::subset_hint(self.meta.as_ref()) else { return Vec::new() };
        let backends = &active.cluster.backends;
        (0..backends.len()).filter(|&i| !allowed.contains(&endpoint(&backends[i]))).collect()
    }

    /// The headers answer, then the body echoed (the engine's: an alias's model rewritten),
    /// then the trailers when the request had them. Err when the stream is gone.
    async fn route_to(&self, endpoints: &str, active: &Active, ctx: &RequestCtx, body: &[u8]) -> Result<(), ()> {
        // The body echoed differs in length from the client's: the `Content-Length` goes.
        send(&self.out, self.route_answer(endpoints, active, ctx, body.len() != ctx.request_bytes())).await?;
        let trailers = matches!(self.body_end, Some(BodyEnd::Trailers));
        for part in protocol::request_body(body, !trailers) {
            send(&self.out, part).await?;
        }
        if trailers {
            send(&self.out, protocol::request_trailers()).await?;
        }
        Ok(())
    }

    /// Phase `response`: each message passed on, the request accounted on the engine that
    /// served it. The headers are due within `epp.response_timeout_ms` of the pick, each
    /// message after them within `timeouts.idle_ms` of the last: past either the stream ends
    /// with `DEADLINE_EXCEEDED`, and the request stops counting on the engine.
    async fn response(&mut self, app: &ProxyApp, active: &Active, r: &mut Routed, ctx: &mut RequestCtx) -> Outcome {
        // The engine's status once its headers pass; 499 until then.
        let mut status = 499;
        let headers_due = Instant::now() + self.epp.response_timeout();
        let idle = active.config.timeouts.idle();
        loop {
            let due = if status == 499 { headers_due } else { Instant::now() + idle };
            let Ok(next) = tokio::time::timeout_at(due.into(), next(&mut self.inbound)).await else {
                let why = "switchyard epp: the response did not pass within epp.response_timeout_ms / timeouts.idle_ms";
                let _ = self.out.send(Err(Status::deadline_exceeded(why))).await;
                let status = if status == 499 { 504 } else { status };
                return Outcome { status, reuse: Reuse::Close, error: Some(RESPONSE_TIMEOUT) };
            };
            let Some((msg, meta)) = next else { return Outcome::client_gone(status) };
            let (reply, end) = match msg {
                Msg::ResponseHeaders(h) => {
                    self.served(active, r, meta.as_ref(), h.headers.as_ref(), ctx);
                    let headers = h.headers.as_ref();
                    status = protocol::response_status(headers).unwrap_or(0);
                    app.engine_answered(Engine { active, index: r.index }, status);
                    let sse = protocol::find_header(headers, "content-type");
                    ctx.answer_began(sse.is_some_and(|v| v.starts_with(b"text/event-stream")));
                    // The alias written back changes the length.
                    let remove: &[&str] = match ctx.writeback_mut() {
                        Some(_) => &[protocol::SERVED_KEY, "content-length"],
                        None => &[protocol::SERVED_KEY],
                    };
                    let id = ctx.request_id().unwrap_or("");
                    (protocol::response_headers(&[(REQUEST_ID, id)], remove), h.end_of_stream)
                }
                Msg::ResponseBody(b) => {
                    let body = match ctx.writeback_mut() {
                        Some(w) => w.apply(&b.body, b.end_of_stream),
                        None => b.body,
                    };
                    if let Some(ttft) = ctx.observe_response(&body, &mut r.guard) {
                        let backend = &active.cluster.backends[r.index];
                        app.state().metrics.of(backend).ttft.observe(ttft.as_secs_f64());
                    }
                    (protocol::response_body(&body, b.end_of_stream), b.end_of_stream)
                }
                Msg::ResponseTrailers(_) => (protocol::response_trailers(), true),
                Msg::RequestHeaders(_) | Msg::RequestBody(_) | Msg::RequestTrailers(_) => {
                    refuse(app, &self.out, "a request message after the request was routed").await;
                    return Outcome { status, reuse: Reuse::Close, error: Some(PROTOCOL_ERROR) };
                }
            };
            if send(&self.out, reply).await.is_err() {
                return Outcome::client_gone(status);
            }
            if end {
                self.response_ended = true;
                return Outcome::answered(status, Reuse::Close);
            }
        }
    }

    /// The gateway says which engine served (it went down the fallback list): the request
    /// is counted there from now on.
    fn served(
        &self,
        active: &Active,
        r: &mut Routed,
        meta: Option<&Metadata>,
        headers: Option<&HeaderMap>,
        ctx: &mut RequestCtx,
    ) {
        let Some(served) = protocol::served_endpoint(meta, headers) else { return };
        let backends = &active.cluster.backends;
        if endpoint(&backends[r.index]) == served {
            return;
        }
        let Some(index) = backends.iter().position(|b| endpoint(b) == served) else { return };
        let backend = backends[index].clone();
        ctx.moved_to(backend.clone());
        r.guard = InflightGuard::new(backend, 0, 0, false, Instant::now());
        r.index = index;
    }

    /// After the response's end: answer what Envoy may still send (trailers) until it closes
    /// the stream, for at most `idle` (at least a second).
    async fn drain(&mut self, idle: Duration) {
        let rest = async {
            while let Some((msg, _)) = next(&mut self.inbound).await {
                let reply = match msg {
                    Msg::ResponseTrailers(_) => protocol::response_trailers(),
                    Msg::ResponseBody(b) => protocol::response_body(&b.body, b.end_of_stream),
                    _ => break,
                };
                if send(&self.out, reply).await.is_err() {
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
    fn route_answer(&self, endpoints: &str, active: &Active, ctx: &RequestCtx, resized: bool) -> ProcessingResponse {
        let id = ctx.request_id().unwrap_or("");
        let mut set = vec![(REQUEST_ID, id)];
        // Envoy forwards `:path` as the client sent it: the normal form, routed on, replaces it.
        if let Some(target) = ctx.normalized_target() {
            set.push((":path", target));
        }
        let mut remove = vec![protocol::SERVED_KEY];
        remove.extend_from_slice(EDGE_ONLY);
        if active.config.auth.enabled() {
            remove.push("authorization");
        }
        if resized {
            remove.push("content-length");
        }
        protocol::route_to(&self.epp.destination_header, endpoints, &set, &remove)
    }
}

/// The next message with a request, and the metadata Envoy sent with it; `None` when the
/// stream ended or broke.
async fn next(inbound: &mut Streaming<ProcessingRequest>) -> Option<(Msg, Option<Metadata>)> {
    next_message(inbound).await.ok().flatten()
}

/// [`next`], with the error that broke the stream.
async fn next_message(inbound: &mut Streaming<ProcessingRequest>) -> Result<Option<(Msg, Option<Metadata>)>, Status> {
    loop {
        match inbound.message().await? {
            Some(ProcessingRequest { request: Some(m), metadata_context, .. }) => {
                return Ok(Some((m, metadata_context)))
            }
            // Nothing to process (flow control only): wait for the next one.
            Some(_) => continue,
            None => return Ok(None),
        }
    }
}

/// Send an answer; Err when the stream is gone.
async fn send(out: &Outbound, reply: ProcessingResponse) -> Result<(), ()> {
    out.send(Ok(reply)).await.map_err(|_| ())
}

/// End the stream with a gRPC error: Envoy sent something the protocol does not allow here
/// (Envoy then applies its `failure_mode_allow`).
async fn refuse(app: &ProxyApp, out: &Outbound, why: &str) {
    tracing::debug!(why, "ext_proc stream refused");
    app.state().metrics.epp_protocol_errors.inc();
    let _ = out.send(Err(Status::invalid_argument(format!("switchyard epp: {why}")))).await;
}
