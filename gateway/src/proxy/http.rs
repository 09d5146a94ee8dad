//! The HTTP transports: the gateway's own HTTP/1.1 session ([`ProxyApp::serve_h1`], its
//! connection loop) and pingora's HTTP/2 session ([`HttpServerApp::process_new_http`], one
//! stream each), both as a [`Downstream`] the [driver](super::driver) runs the request over.
//! Delivering a request over HTTP is making the exchange with an engine and streaming its
//! answer back ([`super::attempt`], [`super::stream`]).

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use pingora::apps::{HttpServerApp, HttpServerOptions, ReusedHttpStream};
use pingora::protocols::http::v2::server::{default_h2_options, H2Options};
use pingora::protocols::http::ServerSession;
use pingora::protocols::Stream;
use pingora::server::ShutdownWatch;

use crate::downstream::{Downstream, H1Connection, H1Request, PingoraRequest, RequestHead};
use crate::error::ProxyError;

use super::ctx::{Outcome, RequestCtx, Reuse};
use super::driver::{BodyError, Planned, Transport};
use super::ProxyApp;

impl Transport for Downstream<'_> {
    fn head(&self) -> &RequestHead {
        Downstream::head(self)
    }

    async fn read_body(&mut self) -> Result<Option<Bytes>, BodyError> {
        Downstream::read_body(self)
            .await
            .map_err(|e| BodyError::Refused(ProxyError::BadRequest(format!("could not read the request body: {e}"))))
    }

    async fn closed(&mut self) {
        Downstream::closed(self).await
    }

    /// A request whose body was not (fully) read cannot leave a reusable connection.
    async fn respond(&mut self, status: u16, content_type: &str, body: Bytes, fields: &[(&str, &str)]) -> Reuse {
        let body_done = self.is_body_done();
        if !body_done {
            self.close_after();
        }
        match Downstream::respond(self, status, content_type, body, fields).await && body_done {
            true => Reuse::Keep,
            false => Reuse::Close,
        }
    }

    async fn deliver(&mut self, app: &ProxyApp, planned: Planned, ctx: &mut RequestCtx) -> Outcome {
        app.attempt_loop(self, ctx, planned).await
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
        let header_read_timeout = self.state.active.load().config.limits.header_read_timeout();
        let mut shutdown_rx = shutdown.clone();
        let read = tokio::select! {
            r = tokio::time::timeout(header_read_timeout, session.read_request()) => r,
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
        let active = self.state.active.load_full();
        let mut s = Downstream::Pingora(Box::new(PingoraRequest::new(session)));
        // HTTP/2's decoded header list is capped by the h2 settings (`h2_options`); the
        // field count is checked here.
        let max_headers = active.config.limits.max_headers;
        if s.head().len() > max_headers {
            let e = ProxyError::HeaderTooLarge(format!(
                "request has {} header fields; at most {max_headers}",
                s.head().len()
            ));
            self.reject(&mut s, e, &RequestCtx::new("", "")).await;
            return None;
        }
        self.drive(&mut s, active).await;
        if let Downstream::Pingora(p) = s {
            let _ = p.into_session().finish().await;
        }
        None
    }

    fn server_options(&self) -> Option<&HttpServerOptions> {
        Some(&self.options)
    }

    /// pingora's bounded defaults, with `limits.max_header_bytes` as the decoded header
    /// list limit (HTTP/1 heads are checked by [`RequestHead::parse`]).
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
            if !first && !conn.has_buffered() && !self.next_request_arrives(&mut conn, &mut shutdown).await {
                return;
            }
            first = false;
            let head = match self.read_h1_head(&mut conn, &mut shutdown).await {
                Ok(head) => head,
                Err(Linger(true)) => return conn.linger().await,
                Err(Linger(false)) => return,
            };
            // The request's one snapshot of the config, policy and backends.
            let active = self.state.active.load_full();
            let in_flight = self.state.lifecycle.in_flight.enter();
            let keepalive = !*shutdown.borrow();
            let mut s = Downstream::H1(H1Request::new(&mut conn, head, keepalive));
            let reuse = self.drive(&mut s, active).await;
            let (reusable, body_unread) = match &s {
                Downstream::H1(r) => (reuse == Reuse::Keep && r.reusable(), !r.is_body_done()),
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

    /// Wait for a kept-alive connection's next request to begin, within
    /// `limits.idle_connection_timeout_ms`; false when the connection is to close.
    async fn next_request_arrives(&self, conn: &mut H1Connection, shutdown: &mut ShutdownWatch) -> bool {
        let idle = self.state.active.load().config.limits.idle_connection_timeout();
        let read = tokio::select! {
            r = tokio::time::timeout(idle, conn.wait_readable()) => r,
            _ = shutdown.changed() => return false,
        };
        match read {
            Ok(readable) => readable,
            Err(_) => {
                self.state.metrics.idle_connections_closed.inc();
                false
            }
        }
    }

    /// The next request's head within `limits.header_read_timeout_ms` and the head limits;
    /// else the connection is to close — after lingering, when a refusal was answered.
    async fn read_h1_head(&self, conn: &mut H1Connection, shutdown: &mut ShutdownWatch) -> Result<RequestHead, Linger> {
        let (timeout, max_bytes, max_fields) = {
            let limits = &self.state.active.load().config.limits;
            (limits.header_read_timeout(), limits.max_header_bytes, limits.max_headers)
        };
        let read = tokio::select! {
            r = tokio::time::timeout(timeout, conn.read_head(max_bytes, max_fields)) => r,
            _ = shutdown.changed() => return Err(Linger(false)),
        };
        match read {
            Ok(Ok(Some(head))) => Ok(head),
            Ok(Ok(None)) => Err(Linger(false)),
            Ok(Err(e)) => {
                // Only the kind: the head may hold an `Authorization` key.
                tracing::debug!(error = e.kind(), "failed to read a request header");
                self.state.metrics.rejected.with_label_values(&[e.kind(), ""]).inc();
                conn.refuse(&e).await;
                Err(Linger(true))
            }
            Err(_) => {
                self.state.metrics.header_timeouts.inc();
                Err(Linger(false))
            }
        }
    }
}

/// Why no head was read: the connection closes, after lingering (so the client reads the
/// refusal before the close resets it) when true.
struct Linger(bool);
