//! Connection-level guards of the API listener: how many client connections may be open at
//! once, and how long a new one may take to start speaking.
//!
//! pingora's stock server for an HTTP app (its `ServerApp` for every `HttpServerApp`) waits
//! for the 24-byte HTTP/2 preface with no deadline — by peeking on a cleartext connection
//! when h2c is on, inside the h2 handshake on a TLS connection that negotiated `h2` — so a
//! client that sends 10 bytes holds its connection forever. [`Edge`] runs first: it refuses
//! a connection past `limits.max_connections`, gives both preface waits the header deadline
//! (`limits.header_read_timeout_ms`), then hands an HTTP/2 connection to pingora and an
//! HTTP/1.1 one to the gateway's own session ([`crate::proxy::ProxyApp::serve_h1`]). The
//! rest of a connection's life is bounded elsewhere: HTTP/1 request heads and keep-alive
//! waits in `serve_h1`, HTTP/2 connections with no open stream by pingora's `h2_idle_timeout`.

use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, ServerApp};
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::tls::{SslDigest, TlsRef};
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream, TimingDigest,
    UniqueID, UniqueIDType, ALPN,
};
use pingora::server::ShutdownWatch;
use prometheus::{IntCounter, IntGauge};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::proxy::ProxyApp;
use crate::state::GatewayState;

/// The HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const H2_PREFACE_LEN: usize = H2_PREFACE.len();

/// Client connections open now against a cap that may change with each reload.
#[derive(Debug, Default)]
pub struct ConnectionSlots {
    open: AtomicUsize,
}

/// One open connection; dropping it frees the slot.
pub struct Slot<'a> {
    slots: &'a ConnectionSlots,
    gauge: &'a IntGauge,
}

impl ConnectionSlots {
    /// A slot when fewer than `max` connections are open.
    pub fn try_open<'a>(&'a self, max: usize, gauge: &'a IntGauge) -> Option<Slot<'a>> {
        self.open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)).ok()?;
        gauge.inc();
        Some(Slot { slots: self, gauge })
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.slots.open.fetch_sub(1, Ordering::AcqRel);
        self.gauge.dec();
    }
}

/// The API listener's app: the proxy behind the connection cap and the preface deadline.
pub struct Edge {
    app: Arc<ProxyApp>,
    state: Arc<GatewayState>,
    slots: ConnectionSlots,
}

impl Edge {
    /// `app` behind the limits of `state`'s live config.
    pub fn new(app: Arc<ProxyApp>, state: Arc<GatewayState>) -> Self {
        Edge { app, state, slots: ConnectionSlots::default() }
    }
}

#[async_trait]
impl ServerApp for Edge {
    async fn process_new(self: &Arc<Self>, mut stream: Stream, shutdown: &ShutdownWatch) -> Option<Stream> {
        let (max, deadline) = {
            let limits = &self.state.active.load().config.limits;
            (limits.max_connections, limits.header_read_timeout())
        };
        let metrics = &self.state.metrics;
        let Some(_slot) = self.slots.try_open(max, &metrics.client_connections) else {
            metrics.connections_refused.inc();
            return None;
        };
        let tls = stream.get_ssl_digest().is_some();
        let h2c = !tls && self.app.server_options().is_some_and(|o| o.h2c);
        if h2c {
            // pingora peeks again, for as long as the client likes; a peek rewinds, so its
            // peek returns at once with what this one read.
            let mut preface = [0u8; H2_PREFACE_LEN];
            match tokio::time::timeout(deadline, stream.try_peek(&mut preface)).await {
                Ok(Ok(_)) => {}
                Ok(Err(_)) => return None,
                Err(_) => {
                    metrics.header_timeouts.inc();
                    return None;
                }
            }
            if &preface == H2_PREFACE {
                return ServerApp::process_new(&self.app, stream, shutdown).await;
            }
        }
        if tls && matches!(stream.selected_alpn_proto(), Some(ALPN::H2)) {
            return self.serve_h2_over_tls(stream, shutdown, deadline, &metrics.header_timeouts).await;
        }
        self.app.serve_h1(stream, shutdown).await;
        None
    }
}

impl Edge {
    /// Serve an HTTP/2-over-TLS connection, closing it if its preface has not arrived by
    /// `deadline` (the h2 handshake inside pingora reads it, so the bytes read are counted).
    async fn serve_h2_over_tls(
        &self,
        stream: Stream,
        shutdown: &ShutdownWatch,
        deadline: Duration,
        timeouts: &IntCounter,
    ) -> Option<Stream> {
        let read = Arc::new(AtomicUsize::new(0));
        let stream: Stream = Box::new(Counted { inner: stream, read: read.clone() });
        let preface_late = async {
            tokio::time::sleep(deadline).await;
            if read.load(Ordering::Relaxed) >= H2_PREFACE_LEN {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            r = ServerApp::process_new(&self.app, stream, shutdown) => r,
            () = preface_late => {
                timeouts.inc();
                None
            }
        }
    }
}

/// A stream that counts the bytes read from it and passes everything else through.
struct Counted {
    inner: Stream,
    read: Arc<AtomicUsize>,
}

impl fmt::Debug for Counted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Counted").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl AsyncRead for Counted {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        self.read.fetch_add(buf.filled().len() - before, Ordering::Relaxed);
        polled
    }
}

impl AsyncWrite for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for Counted {
    async fn shutdown(&mut self) {
        self.inner.shutdown().await
    }
}

impl UniqueID for Counted {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for Counted {
    fn get_ssl(&self) -> Option<&TlsRef> {
        self.inner.get_ssl()
    }
    fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
        self.inner.get_ssl_digest()
    }
    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for Counted {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }
    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }
    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for Counted {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }
    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest)
    }
}

impl GetSocketDigest for Counted {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }
    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest)
    }
}

#[async_trait]
impl Peek for Counted {
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_refuse_past_the_cap_and_free_on_drop() {
        let slots = ConnectionSlots::default();
        let gauge = IntGauge::new("g", "g").unwrap();
        let a = slots.try_open(2, &gauge).unwrap();
        let _b = slots.try_open(2, &gauge).unwrap();
        assert!(slots.try_open(2, &gauge).is_none());
        assert_eq!(gauge.get(), 2);
        drop(a);
        assert!(slots.try_open(2, &gauge).is_some());
        // A lowered cap (a reload) refuses until enough connections close.
        assert!(slots.try_open(1, &gauge).is_none());
        assert_eq!(gauge.get(), 1);
    }
}
