//! The API listener served by one single-threaded tokio runtime per core (`work_stealing:
//! false`, the default): NGINX's worker model inside one process.
//!
//! Each core thread accepts on the same listening socket (its own `dup` of it, registered
//! with its own epoll), so the next connection goes to whichever core gets to `accept`
//! first — an idle core takes it. A connection is served start to end on the core that
//! accepted it, and the engine connections its requests open are kept in that core's idle
//! pool ([`crate::pool::Pools`]), registered with that core's reactor. No task moves between
//! threads and no wake-up crosses cores: under pingora's work-stealing runtime a socket's
//! readiness could wake a task on the other thread (a `futex` to unpark it, ~0.6 per request)
//! and a connection's memory moved between the cores' caches with it. pingora's own
//! one-runtime-per-thread mode does not avoid that: it accepts on one thread and spawns each
//! connection on a random one, whose socket stays registered with the accepting thread's
//! reactor. Measured in `docs/performance.md` (issue 23).
//!
//! The rest of the gateway (admin listener, scraper, discovery, reloads, the EPP) runs on
//! pingora's runtimes as before. The cores start with pingora's services ([`Cores`] is one)
//! and stop on its shutdown broadcast: their accept loops close their sockets while the
//! connections still open finish under the drain ([`crate::drain`]).

use std::cell::Cell;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use pingora::apps::ServerApp;
use pingora::listeners::tls::Acceptor;
use pingora::protocols::l4::stream::Stream as TcpStream;
use pingora::protocols::{GetSocketDigest, SocketDigest, Stream};
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::connection::Edge;

/// How long a TLS handshake may take (pingora's listener allows the same).
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long to wait before accepting again when the process is out of file descriptors
/// (every `accept` would fail at once until some close).
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

thread_local! {
    /// The core this thread serves: set once when a core thread starts, `None` on every
    /// other thread (pingora's runtimes, tests).
    static CORE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The core the calling thread serves, if it is one of [`start`]'s threads.
pub fn current() -> Option<usize> {
    CORE.with(Cell::get)
}

/// The API listener's cores, set up (runtimes built, the socket registered with each) and
/// waiting for pingora to start its services: [`BackgroundService::start`] starts their
/// threads then, beside the scraper and discovery, and hands them pingora's shutdown watch.
pub struct Cores {
    ready: Mutex<Vec<(tokio::runtime::Runtime, tokio::net::TcpListener)>>,
    edge: Arc<Edge>,
    tls: Option<Arc<Acceptor>>,
}

impl Cores {
    /// `cores` single-threaded runtimes, each with its own `dup` of `socket` registered with
    /// its reactor, serving connections through `edge` (after a TLS handshake by `tls`, when
    /// given). Fails when a runtime or a socket cannot be set up.
    pub fn new(socket: TcpListener, cores: usize, edge: Arc<Edge>, tls: Option<Arc<Acceptor>>) -> anyhow::Result<Self> {
        let mut ready = Vec::with_capacity(cores);
        for core in 0..cores {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| anyhow::anyhow!("core {core}: building its runtime: {e}"))?;
            let dup = socket.try_clone().map_err(|e| anyhow::anyhow!("core {core}: duplicating the listener: {e}"))?;
            // Registered with this core's reactor, so its readiness wakes this core only.
            let listener = {
                let _entered = runtime.enter();
                tokio::net::TcpListener::from_std(dup)
                    .map_err(|e| anyhow::anyhow!("core {core}: registering the listener: {e}"))?
            };
            ready.push((runtime, listener));
        }
        Ok(Cores { ready: Mutex::new(ready), edge, tls })
    }
}

#[async_trait]
impl BackgroundService for Cores {
    async fn start(&self, shutdown: ShutdownWatch) {
        let ready = std::mem::take(&mut *self.ready.lock());
        for (core, (runtime, listener)) in ready.into_iter().enumerate() {
            let (edge, tls, shutdown) = (self.edge.clone(), self.tls.clone(), shutdown.clone());
            let started = std::thread::Builder::new().name(format!("proxy-core-{core}")).spawn(move || {
                CORE.with(|c| c.set(Some(core)));
                runtime.block_on(async move {
                    accept_loop(listener, edge, tls, shutdown).await;
                    // Connections still open keep running on this runtime until they end or
                    // the process exits (the drain decides when).
                    std::future::pending::<()>().await
                })
            });
            if let Err(e) = started {
                // Nothing else can serve the API listener: better no gateway than one short of cores.
                tracing::error!(core, error = %e, "cannot start a core thread; exiting");
                std::process::exit(1);
            }
        }
    }
}

/// Accept until shutdown, serving each connection in a task of this core's runtime.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    edge: Arc<Edge>,
    tls: Option<Arc<Acceptor>>,
    mut shutdown: ShutdownWatch,
) {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.wait_for(|&down| down) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((socket, peer)) => {
                let (edge, tls, shutdown) = (edge.clone(), tls.clone(), shutdown.clone());
                tokio::spawn(async move { serve(socket, peer, &edge, tls.as_deref(), &shutdown).await });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                if e.raw_os_error() == Some(libc::EMFILE) || e.raw_os_error() == Some(libc::ENFILE) {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }
    // Dropping the listener closes this core's copy of the socket; the last copy closed
    // stops the kernel accepting for the gateway.
}

/// One client connection, from the accepted socket to its last request.
async fn serve(
    socket: tokio::net::TcpStream,
    peer: SocketAddr,
    edge: &Arc<Edge>,
    tls: Option<&Acceptor>,
    shutdown: &ShutdownWatch,
) {
    if let Err(e) = socket.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY refused; closing");
        return;
    }
    // pingora's stream, unbuffered (the HTTP/1.1 session keeps its own buffers and writes
    // a response's head and data in one vectored write), with the peer address recorded
    // the way pingora's listener records it.
    let mut tcp = TcpStream::from(socket);
    let digest = SocketDigest::from_raw_fd(tcp.as_raw_fd());
    let _ = digest.peer_addr.set(Some(peer.into()));
    tcp.set_socket_digest(digest);
    let stream: Stream = match tls {
        None => Box::new(tcp),
        Some(acceptor) => match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.tls_handshake(tcp)).await {
            Ok(Ok(tls)) => Box::new(tls),
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                return;
            }
        },
    };
    // As pingora's listener does: an app may hand the connection back for another turn.
    let mut next = edge.process_new(stream, shutdown).await;
    while let Some(stream) = next {
        next = edge.process_new(stream, shutdown).await;
    }
}
