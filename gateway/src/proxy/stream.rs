//! The `stream` phase: the engine's response to the client, chunk by chunk as it arrives.
//!
//! Chunked HTTP/1 writes are flushed each time; chunks the engine sent together leave in
//! one write; a body that is complete when its header arrives leaves with a
//! `Content-Length`, header and body in one write. If the engine dies mid-stream, an SSE
//! stream ends with a final error event ([`ProxyError::StreamBroken`]) instead of a silent
//! truncation. The upstream connection goes back to the pool only after a clean end.

use std::time::Instant;

use bytes::BytesMut;
use futures_util::FutureExt;
use pingora::http::ResponseHeader;
use pingora::protocols::http::v1::client::HttpSession;
use pingora::protocols::http::ServerSession;

use crate::cluster::Backend;
use crate::error::{ProxyError, UpstreamErrorKind};
use crate::http::HOP_BY_HOP;
use crate::state::Active;

use super::attempt::InflightGuard;
use super::ctx::RequestCtx;
use super::ProxyApp;

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

/// The client-bound head for the engine's `upstream` head: its status and end-to-end
/// headers. Also whether the engine gave a length, and whether the body is an SSE stream.
fn response_head(upstream: &ResponseHeader) -> Option<(ResponseHeader, bool, bool)> {
    let mut resp = ResponseHeader::build(upstream.status.as_u16(), None).ok()?;
    let (mut has_length, mut is_sse) = (false, false);
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
    Some((resp, has_length, is_sse))
}

/// The body bytes already taken when the head was sent, where the body stood then, and
/// whether it is an SSE stream.
type Started = (BytesMut, pingora::Result<Body>, bool);

impl ProxyApp {
    /// Stream `up`'s response (header already read) from backend `index` to the client;
    /// true when the client connection may be reused.
    pub(super) async fn stream(
        &self,
        s: &mut ServerSession,
        mut up: HttpSession,
        active: &Active,
        index: usize,
        ctx: &mut RequestCtx,
        inflight: &mut InflightGuard,
    ) -> bool {
        // `up` stays in this frame: it is large, and moving it costs a copy each time.
        let Some((mut buf, mut next, is_sse)) = self.send_head(s, &mut up, active, index, ctx).await else {
            return false;
        };
        up.read_timeout = Some(active.config.timeouts.idle());
        let backend = &active.cluster.backends[index];
        loop {
            let end = matches!(next, Ok(Body::Ended));
            if (!buf.is_empty() || end) && !self.forward(s, &mut buf, end, backend, ctx, inflight).await {
                return false;
            }
            match next {
                Ok(Body::More) => {}
                Ok(Body::Ended) => {
                    self.release(up, active, index);
                    return true;
                }
                Err(e) => return self.broken(s, &e, is_sse, active, index, ctx).await,
            }
            let read = tokio::select! {
                r = up.read_body_ref() => r.map(|chunk| match chunk {
                    Some(chunk) => {
                        ctx.chunks += 1;
                        buf.extend_from_slice(chunk);
                        Body::More
                    }
                    None => Body::Ended,
                }),
                _ = s.read_body_or_idle(true) => {
                    // The client left: dropping `up` closes the engine connection (abort).
                    ctx.client_gone();
                    return false;
                }
            };
            next = match read {
                Ok(Body::More) => take_ready(&mut up, &mut buf, &mut ctx.chunks),
                other => other,
            };
        }
    }

    /// Count the engine's status (a 5xx is a failure of the backend), and send the
    /// client-bound head with what of the body has already arrived; `None` when the
    /// client is gone or the head cannot be built.
    async fn send_head(
        &self,
        s: &mut ServerSession,
        up: &mut HttpSession,
        active: &Active,
        index: usize,
        ctx: &mut RequestCtx,
    ) -> Option<Started> {
        let upstream = up.resp_header()?;
        ctx.status = upstream.status.as_u16();
        if ctx.status >= 500 {
            let detail = format!("status {}", ctx.status);
            self.upstream_failed(active, Some(index), UpstreamErrorKind::Status5xx, &detail);
        } else {
            active.cluster.backends[index].record_success();
        }
        let (mut resp, mut has_length, is_sse) = response_head(upstream)?;
        ctx.sse = is_sse;
        if ctx.writeback.is_some() && has_length {
            // The alias written back changes the length.
            resp.remove_header("content-length");
            has_length = false;
        }
        if let Some(id) = &ctx.request_id {
            let _ = resp.insert_header(crate::http::REQUEST_ID, id.as_str());
        }
        // What the engine has sent already, taken without waiting. When that is the whole
        // body (a short or non-streamed answer), the response leaves with a Content-Length:
        // pingora then holds the header until the body is written and both go out in one
        // write. Otherwise it is chunked and pingora flushes the header at once.
        let mut buf = BytesMut::with_capacity(4096);
        let next = take_ready(up, &mut buf, &mut ctx.chunks);
        if matches!(next, Ok(Body::Ended)) {
            // The whole body is here: written back now, so its length is known.
            if let Some(mut w) = ctx.writeback.take() {
                buf = BytesMut::from(&w.apply(&buf, true)[..]);
            }
        }
        if !has_length && matches!(next, Ok(Body::Ended)) {
            let _ = resp.insert_header("content-length", buf.len().to_string());
        } else if !has_length && !s.is_http2() {
            let _ = resp.insert_header("transfer-encoding", "chunked");
        }
        if s.write_response_header(Box::new(resp)).await.is_err() {
            ctx.client_gone();
            return None;
        }
        Some((buf, next, is_sse))
    }

    /// The engine failed mid-response: count it, and end an SSE stream with the OpenAI
    /// error event instead of a silent truncation. The connection is not reusable.
    async fn broken(
        &self,
        s: &mut ServerSession,
        e: &pingora::Error,
        is_sse: bool,
        active: &Active,
        index: usize,
        ctx: &mut RequestCtx,
    ) -> bool {
        let kind = if e.etype() == &pingora::ErrorType::ReadTimedout {
            UpstreamErrorKind::IdleTimeout
        } else {
            UpstreamErrorKind::StreamBroken
        };
        self.upstream_failed(active, Some(index), kind, e);
        ctx.error_kind = Some(kind.label());
        if is_sse {
            let _ = s.write_response_body(ProxyError::StreamBroken(kind).sse_event().into(), true).await;
        }
        s.set_keepalive(None);
        false
    }

    /// Write what `buf` holds to the client (the first bytes are the TTFT metric; the first
    /// generated content ends the prefill the policy learns from); false when the client is
    /// gone.
    async fn forward(
        &self,
        s: &mut ServerSession,
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
        if !inflight.prefilled() && !buf.is_empty() && (!ctx.sse || ctx.content.observe(buf)) {
            inflight.first_content();
        }
        if !buf.is_empty() && ctx.ttft.is_none() {
            let t = ctx.started.elapsed();
            ctx.ttft = Some(t);
            self.state.metrics.ttft.with_label_values(&[backend.url.as_str()]).observe(t.as_secs_f64());
        }
        ctx.response_bytes += buf.len();
        if ctx.charged.is_some() {
            ctx.usage.observe(buf);
        }
        if s.write_response_body(buf.split().freeze(), end).await.is_err() {
            ctx.client_gone();
            return false;
        }
        true
    }

    /// A response that ended cleanly leaves its connection to the pool.
    fn release(&self, mut up: HttpSession, active: &Active, index: usize) {
        if !up.is_body_done() {
            return;
        }
        up.respect_keepalive();
        // Completes at once for a finished body (kept out of the request's future, where it
        // would add 2 KB); if not, the connection closes.
        if let Some(Some(stream)) = up.reuse().now_or_never() {
            self.state.pool.put(active.cluster.backends[index].pool_key, stream, Instant::now());
        }
    }
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
