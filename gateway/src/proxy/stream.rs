//! The `stream` phase: the engine's response to the client, chunk by chunk as it arrives.
//!
//! Chunked HTTP/1 writes are flushed each time; chunks the engine sent together leave in
//! one write; a body that is complete when its header arrives leaves with a
//! `Content-Length`, header and body in one write. If the engine dies mid-stream, an SSE
//! stream ends with a final error event ([`ProxyError::StreamBroken`]) instead of a silent
//! truncation. The upstream connection goes back to the pool only after a clean end.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use tokio::time::timeout;

use crate::active::Active;
use crate::cluster::Backend;
use crate::downstream::Downstream;
use crate::error::{ProxyError, UpstreamErrorKind};
use crate::upstream::{EngineConnection, EngineIoError, Framing, Progress, ResponseHead};

use super::ctx::{Outcome, RequestCtx, Reuse};
use super::inflight::InflightGuard;
use super::ProxyApp;

/// The body bytes already taken when the head was sent, and where the body stood then.
type Started = (BytesMut, Result<Progress, EngineIoError>);

impl ProxyApp {
    /// Stream `up`'s response (its `head` already read) from backend `index` to the client
    /// (the [`Engine`] it is on: `inflight` counts it there).
    pub(super) async fn stream(
        &self,
        s: &mut Downstream<'_>,
        mut up: EngineConnection,
        head: ResponseHead,
        engine: Engine<'_>,
        ctx: &mut RequestCtx,
        inflight: &mut InflightGuard,
    ) -> Outcome {
        let (status, is_sse) = (head.status, head.is_sse);
        let Some((mut buf, mut next)) = self.send_head(s, &mut up, head, engine, ctx).await else {
            return Outcome::client_gone(status);
        };
        // Nothing of the body yet (a stream in prefill): the head leaves now.
        if buf.is_empty() && matches!(next, Ok(Progress::More)) && !s.flush_head().await {
            return Outcome::client_gone(status);
        }
        let idle = engine.active.config.timeouts.idle();
        loop {
            let end = matches!(next, Ok(Progress::Ended));
            if (!buf.is_empty() || end) && !self.forward(s, &mut buf, end, engine, ctx, inflight).await {
                return Outcome::client_gone(status);
            }
            match next {
                Ok(Progress::More) => {}
                Ok(Progress::Ended) => {
                    self.release(up, engine);
                    return Outcome::answered(status, Reuse::Keep);
                }
                Err(e) => return self.broken(s, &e, is_sse, engine, status).await,
            }
            // The engine's side first: while it has bytes ready, the client is not read as well.
            next = tokio::select! {
                biased;
                r = timeout(idle, up.read_body(&mut buf)) => r.unwrap_or(Err(EngineIoError::ReadTimeout)),
                // The client left: dropping `up` closes the engine connection (abort).
                () = s.closed() => return Outcome::client_gone(status),
            };
        }
    }

    /// Count the engine's status ([`Self::engine_answered`]), and send the client-bound head
    /// with what of the body has already arrived; `None` when the client is gone or the
    /// head cannot be built.
    async fn send_head(
        &self,
        s: &mut Downstream<'_>,
        up: &mut EngineConnection,
        head: ResponseHead,
        engine: Engine<'_>,
        ctx: &mut RequestCtx,
    ) -> Option<Started> {
        self.engine_answered(engine, head.status);
        ctx.sse = head.is_sse;
        // The alias written back changes the length: the engine's is not kept then.
        let engine_length = match head.framing {
            Framing::Length(n) if ctx.writeback.is_none() => Some(n),
            _ => None,
        };
        // What the engine has sent already, taken without waiting. When that is the whole
        // body (a short or non-streamed answer), the response leaves with a Content-Length,
        // its head and body in one write. Otherwise it is chunked (HTTP/1.1), and the head
        // leaves with the first bytes of the body.
        let mut buf = BytesMut::with_capacity(4096);
        let next = up.take_buffered(&mut buf);
        if matches!(next, Ok(Progress::Ended)) {
            // The whole body is here: written back now, so its length is known.
            if let Some(mut w) = ctx.writeback.take() {
                buf = BytesMut::from(&w.apply(&buf, true)[..]);
            }
        }
        let length = match engine_length {
            Some(n) => usize::try_from(n).ok(),
            None if matches!(next, Ok(Progress::Ended)) => Some(buf.len()),
            None => None,
        };
        let id = ctx.request_id.as_deref().filter(|id| http::HeaderValue::from_str(id).is_ok());
        let fields = head.fields();
        let fields = fields.chain(id.map(|id| (crate::http::REQUEST_ID.as_bytes(), id.as_bytes())));
        if !s.write_head(head.status, fields, length).await {
            return None;
        }
        Some((buf, next))
    }

    /// The engine failed mid-response: count it, and end an SSE stream with the OpenAI
    /// error event instead of a silent truncation. The connection is not reusable.
    async fn broken(
        &self,
        s: &mut Downstream<'_>,
        e: &EngineIoError,
        is_sse: bool,
        engine: Engine<'_>,
        status: u16,
    ) -> Outcome {
        let kind = if matches!(e, EngineIoError::ReadTimeout) {
            UpstreamErrorKind::IdleTimeout
        } else {
            UpstreamErrorKind::StreamBroken
        };
        self.upstream_failed(engine.active, Some(engine.index), kind, e);
        if is_sse {
            s.write_body(ProxyError::StreamBroken(kind).sse_event().into(), true).await;
        }
        s.close_after();
        Outcome::broken(status, kind)
    }

    /// Write what `buf` holds to the client, accounted ([`RequestCtx::observe_response`]);
    /// false when the client is gone.
    async fn forward(
        &self,
        s: &mut Downstream<'_>,
        buf: &mut BytesMut,
        end: bool,
        engine: Engine<'_>,
        ctx: &mut RequestCtx,
        inflight: &mut InflightGuard,
    ) -> bool {
        if let Some(w) = ctx.writeback.as_mut() {
            let rewritten = w.apply(buf, end);
            buf.clear();
            buf.extend_from_slice(&rewritten);
        }
        if let Some(ttft) = ctx.observe_response(buf, inflight) {
            self.state.metrics.of(engine.backend()).ttft.observe(ttft.as_secs_f64());
        }
        s.write_body_from(buf, end).await
    }

    /// A response that ended cleanly leaves its connection to the pool.
    fn release(&self, up: EngineConnection, engine: Engine<'_>) {
        if let Some(conn) = up.into_reusable() {
            self.state.pools.of(crate::cores::current()).put(engine.backend().pool_key, conn, Instant::now());
        }
    }

    /// The engine answered `status`: a 5xx counts against it (outlier ejection), anything
    /// else is a success. HTTP's stream phase and the picker's response phase both call it.
    pub(crate) fn engine_answered(&self, engine: Engine<'_>, status: u16) {
        if status >= 500 {
            let detail = format!("status {status}");
            self.upstream_failed(engine.active, Some(engine.index), UpstreamErrorKind::Status5xx, &detail);
        } else {
            engine.backend().record_success();
        }
    }
}

/// The engine a request is on: its position in the cluster view of the snapshot `active`.
#[derive(Clone, Copy)]
pub(crate) struct Engine<'a> {
    /// The snapshot the request was routed in.
    pub active: &'a Active,
    /// The backend's position in `active`'s cluster view.
    pub index: usize,
}

impl Engine<'_> {
    /// The backend.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.active.cluster.backends[self.index]
    }
}
