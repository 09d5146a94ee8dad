//! The `stream` phase: the engine's response to the client, chunk by chunk as it arrives.
//!
//! Chunked HTTP/1 writes are flushed each time; chunks the engine sent together leave in
//! one write; a body that is complete when its header arrives leaves with a
//! `Content-Length`, header and body in one write. If the engine dies mid-stream, an SSE
//! stream ends with a final error event ([`ProxyError::StreamBroken`]) instead of a silent
//! truncation. The upstream connection goes back to the pool only after a clean end.

use std::time::Instant;

use bytes::BytesMut;
use tokio::time::timeout;

use crate::cluster::Backend;
use crate::downstream::Downstream;
use crate::error::{ProxyError, UpstreamErrorKind};
use crate::state::Active;
use crate::upstream::{EngineConnection, EngineIoError, Framing, Progress, ResponseHead};

use super::attempt::InflightGuard;
use super::ctx::RequestCtx;
use super::ProxyApp;

/// The body bytes already taken when the head was sent, and where the body stood then.
type Started = (BytesMut, Result<Progress, EngineIoError>);

impl ProxyApp {
    /// Stream `up`'s response (its `head` already read) from backend `index` to the client;
    /// true when the client connection may be reused.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn stream(
        &self,
        s: &mut Downstream<'_>,
        mut up: EngineConnection,
        head: ResponseHead,
        active: &Active,
        index: usize,
        ctx: &mut RequestCtx,
        inflight: &mut InflightGuard,
    ) -> bool {
        let is_sse = head.is_sse;
        let Some((mut buf, mut next)) = self.send_head(s, &mut up, head, active, index, ctx).await else {
            return false;
        };
        // Nothing of the body yet (a stream in prefill): the head leaves now.
        if buf.is_empty() && matches!(next, Ok(Progress::More)) && !s.flush_head().await {
            ctx.client_gone();
            return false;
        }
        let idle = active.config.timeouts.idle();
        let backend = &active.cluster.backends[index];
        loop {
            let end = matches!(next, Ok(Progress::Ended));
            if (!buf.is_empty() || end) && !self.forward(s, &mut buf, end, backend, ctx, inflight).await {
                return false;
            }
            match next {
                Ok(Progress::More) => {}
                Ok(Progress::Ended) => {
                    self.release(up, active, index);
                    return true;
                }
                Err(e) => return self.broken(s, &e, is_sse, active, index, ctx).await,
            }
            // The engine's side first: while it has bytes ready, the client is not read as well.
            next = tokio::select! {
                biased;
                r = timeout(idle, up.read_body(&mut buf)) => r.unwrap_or(Err(EngineIoError::ReadTimeout)),
                () = s.closed() => {
                    // The client left: dropping `up` closes the engine connection (abort).
                    ctx.client_gone();
                    return false;
                }
            };
        }
    }

    /// Count the engine's status (a 5xx is a failure of the backend), and send the
    /// client-bound head with what of the body has already arrived; `None` when the
    /// client is gone or the head cannot be built.
    async fn send_head(
        &self,
        s: &mut Downstream<'_>,
        up: &mut EngineConnection,
        head: ResponseHead,
        active: &Active,
        index: usize,
        ctx: &mut RequestCtx,
    ) -> Option<Started> {
        ctx.status = head.status;
        if ctx.status >= 500 {
            let detail = format!("status {}", ctx.status);
            self.upstream_failed(active, Some(index), UpstreamErrorKind::Status5xx, &detail);
        } else {
            active.cluster.backends[index].record_success();
        }
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
            ctx.client_gone();
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
        active: &Active,
        index: usize,
        ctx: &mut RequestCtx,
    ) -> bool {
        let kind = if matches!(e, EngineIoError::ReadTimeout) {
            UpstreamErrorKind::IdleTimeout
        } else {
            UpstreamErrorKind::StreamBroken
        };
        self.upstream_failed(active, Some(index), kind, e);
        ctx.error_kind = Some(kind.label());
        if is_sse {
            s.write_body(ProxyError::StreamBroken(kind).sse_event().into(), true).await;
        }
        s.close_after();
        false
    }

    /// Write what `buf` holds to the client (the first bytes are the TTFT metric; the first
    /// generated content ends the prefill the policy learns from); false when the client is
    /// gone.
    async fn forward(
        &self,
        s: &mut Downstream<'_>,
        buf: &mut BytesMut,
        end: bool,
        backend: &Backend,
        ctx: &mut RequestCtx,
        inflight: &mut InflightGuard,
    ) -> bool {
        if let Some(w) = ctx.writeback.as_mut() {
            let rewritten = w.apply(buf, end);
            buf.clear();
            buf.extend_from_slice(&rewritten);
        }
        let first_content = !inflight.prefilled() && !buf.is_empty() && (!ctx.sse || ctx.content.observe(buf));
        let first_bytes = !buf.is_empty() && ctx.ttft.is_none();
        if first_content || first_bytes {
            let now = Instant::now();
            if first_content {
                inflight.first_content(now);
            }
            if first_bytes {
                let t = now.saturating_duration_since(ctx.started);
                ctx.ttft = Some(t);
                self.state.metrics.of(backend).ttft.observe(t.as_secs_f64());
            }
        }
        ctx.response_bytes += buf.len();
        ctx.chunks += 1;
        if ctx.charged.is_some() {
            ctx.usage.observe(buf);
        }
        if !s.write_body_from(buf, end).await {
            ctx.client_gone();
            return false;
        }
        true
    }

    /// A response that ended cleanly leaves its connection to the pool.
    fn release(&self, up: EngineConnection, active: &Active, index: usize) {
        if let Some(conn) = up.into_reusable() {
            self.state.pool().put(active.cluster.backends[index].pool_key, conn, Instant::now());
        }
    }
}
