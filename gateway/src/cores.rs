//! The API listener served by one single-threaded tokio runtime per core (`work_stealing:
//! false`, the default): NGINX's worker model inside one process.
//!
//! Each core thread accepts on the same listening socket (its own `dup` of it, registered
//! with its own epoll) and serves a new connection itself when no core has fewer open —
//! otherwise it hands the socket to the core with fewest ([`least_loaded`]; Envoy's
//! `exact_balance`), which registers it with its own reactor. Left to the race for `accept`,
//! a few long-lived connections (a load balancer's keep-alive pool) could all land on one
//! core. A connection is then served start to end on its core, and the engine connections
//! its requests open are kept in that core's idle pool ([`crate::pool::Pools`]), registered
//! with that core's reactor. No task moves between
//! threads and no wake-up crosses cores: under pingora's work-stealing runtime a socket's
//! readiness could wake a task on the other thread (a `futex` to unpark it, ~0.6 per request)
//! and a connection's memory moved between the cores' caches with it. pingora's own
//! one-runtime-per-thread mode does not avoid that: it accepts on one thread and spawns each
//! connection on a random one, whose socket stays registered with the accepting thread's
//! reactor. Measured in `docs/performance.md` (issue 23).
//!
//! The rest of the gateway (admin listener, scraper, discovery, reloads, the EPP) runs on
//! pingora's runtimes as before, except the engines' KV-event streams, which the cores
//! follow between connections ([`Cores::runtimes`]). The cores start with pingora's services ([`Cores`] is one)
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
use prometheus::{IntGauge, IntGaugeVec};
use tokio::sync::mpsc;

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

/// The core the calling thread serves, if it is one of [`Cores`]' threads.
pub fn current() -> Option<usize> {
    CORE.with(Cell::get)
}

/// An accepted connection on its way to the core that will serve it.
type Accepted = (std::net::TcpStream, SocketAddr);

/// What every core reads to place a new connection, and where it hands one over.
struct Balance {
    /// Connections open on each core (`switchyard_core_client_connections`): counted in when
    /// a core decides where a connection goes, out when it closes.
    open: Box<[IntGauge]>,
    /// Each core's inbox of connections handed to it.
    inboxes: Box<[mpsc::UnboundedSender<Accepted>]>,
}

/// The core to serve a new connection: one with the fewest open, `me` when it is one of
/// them (no hand-over), else the first such.
pub fn least_loaded(open: &[i64], me: usize) -> usize {
    let fewest = open.iter().copied().min().unwrap_or(0);
    if open.get(me) == Some(&fewest) {
        return me;
    }
    open.iter().position(|&n| n == fewest).unwrap_or(me)
}

/// One core, set up and waiting for its thread.
struct Core {
    runtime: tokio::runtime::Runtime,
    listener: tokio::net::TcpListener,
    inbox: mpsc::UnboundedReceiver<Accepted>,
}

/// The API listener's cores, set up (runtimes built, the socket registered with each) and
/// waiting for pingora to start its services: [`BackgroundService::start`] starts their
/// threads then, beside the scraper and discovery, and hands them pingora's shutdown watch.
/// `A` serves each connection ([`crate::connection::Edge`]).
pub struct Cores<A> {
    ready: Mutex<Vec<Core>>,
    handles: Vec<tokio::runtime::Handle>,
    balance: Arc<Balance>,
    edge: Arc<A>,
    tls: Option<Arc<Acceptor>>,
}

impl<A: ServerApp + Send + Sync + 'static> Cores<A> {
    /// `cores` single-threaded runtimes, each with its own `dup` of `socket` registered with
    /// its reactor, serving connections through `edge` (after a TLS handshake by `tls`, when
    /// given) and counting them in `open` (a gauge per core). Fails when a runtime or a
    /// socket cannot be set up.
    pub fn new(
        socket: TcpListener,
        cores: usize,
        edge: Arc<A>,
        tls: Option<Arc<Acceptor>>,
        open: &IntGaugeVec,
    ) -> anyhow::Result<Self> {
        let mut ready = Vec::with_capacity(cores);
        let mut inboxes = Vec::with_capacity(cores);
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
            let (tx, inbox) = mpsc::unbounded_channel();
            inboxes.push(tx);
            ready.push(Core { runtime, listener, inbox });
        }
        let handles = ready.iter().map(|core| core.runtime.handle().clone()).collect();
        let open = (0..cores).map(|core| open.with_label_values(&[core.to_string()])).collect();
        let balance = Arc::new(Balance { open, inboxes: inboxes.into() });
        Ok(Cores { ready: Mutex::new(ready), handles, balance, edge, tls })
    }

    /// The cores' runtimes, for other work that belongs on them (the KV-event streams): a
    /// task spawned there runs once the core's thread has started, between connections.
    pub fn runtimes(&self) -> Vec<tokio::runtime::Handle> {
        self.handles.clone()
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> BackgroundService for Cores<A> {
    async fn start(&self, shutdown: ShutdownWatch) {
        let ready = std::mem::take(&mut *self.ready.lock());
        for (me, core) in ready.into_iter().enumerate() {
            let serving = Serving { me, balance: self.balance.clone(), edge: self.edge.clone(), tls: self.tls.clone() };
            let shutdown = shutdown.clone();
            let started = std::thread::Builder::new().name(format!("proxy-core-{me}")).spawn(move || {
                CORE.with(|c| c.set(Some(me)));
                let Core { runtime, listener, inbox } = core;
                runtime.block_on(serving.run(listener, inbox, shutdown));
            });
            if let Err(e) = started {
                // Nothing else can serve the API listener: better no gateway than one short of cores.
                tracing::error!(core = me, error = %e, "cannot start a core thread; exiting");
                std::process::exit(1);
            }
        }
    }
}

/// Counts a connection out of its core when dropped, however its task ends (a count left
/// behind would steer new connections away from that core for good).
struct CountedOut(IntGauge);

impl Drop for CountedOut {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// What woke a core's loop.
enum Next {
    /// A connection it accepted.
    Accepted(tokio::net::TcpStream, SocketAddr),
    /// A connection another core accepted and handed over.
    HandedOver(std::net::TcpStream, SocketAddr),
}

/// What one core serves with.
struct Serving<A> {
    me: usize,
    balance: Arc<Balance>,
    edge: Arc<A>,
    tls: Option<Arc<Acceptor>>,
}

impl<A: ServerApp + Send + Sync + 'static> Serving<A> {
    /// Accept (and take connections handed over) until shutdown; then only take those
    /// handed over, while the connections still open finish on this runtime until they end
    /// or the process exits (the drain decides when).
    async fn run(
        self,
        listener: tokio::net::TcpListener,
        mut inbox: mpsc::UnboundedReceiver<Accepted>,
        mut shutdown: ShutdownWatch,
    ) {
        loop {
            let accepted = tokio::select! {
                biased;
                _ = shutdown.wait_for(|&down| down) => break,
                Some((socket, peer)) = inbox.recv() => Ok(Next::HandedOver(socket, peer)),
                accepted = listener.accept() => accepted.map(|(socket, peer)| Next::Accepted(socket, peer)),
            };
            match accepted {
                Ok(Next::Accepted(socket, peer)) => self.place(socket, peer, &shutdown),
                Ok(Next::HandedOver(socket, peer)) => self.take_over(socket, peer, &shutdown),
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    if e.raw_os_error() == Some(libc::EMFILE) || e.raw_os_error() == Some(libc::ENFILE) {
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                }
            }
        }
        // This core's copy of the listening socket closes; the last copy closed stops the
        // kernel accepting for the gateway.
        drop(listener);
        while let Some((socket, peer)) = inbox.recv().await {
            self.take_over(socket, peer, &shutdown);
        }
    }

    /// Serve a connection another core handed over (counted in for this core already).
    fn take_over(&self, socket: std::net::TcpStream, peer: SocketAddr, shutdown: &ShutdownWatch) {
        match tokio::net::TcpStream::from_std(socket) {
            Ok(socket) => self.spawn(socket, peer, shutdown),
            Err(e) => {
                self.balance.open[self.me].dec();
                tracing::warn!(error = %e, "registering a connection handed over failed; closed");
            }
        }
    }

    /// Serve a connection this core accepted here, or hand it to the core with fewest open.
    fn place(&self, socket: tokio::net::TcpStream, peer: SocketAddr, shutdown: &ShutdownWatch) {
        let open: Vec<i64> = self.balance.open.iter().map(IntGauge::get).collect();
        let target = least_loaded(&open, self.me);
        self.balance.open[target].inc();
        if target == self.me {
            return self.spawn(socket, peer, shutdown);
        }
        // Out of this core's reactor, into the target's when it picks it up.
        match socket.into_std() {
            Ok(socket) => {
                if let Err(mpsc::error::SendError((socket, peer))) = self.balance.inboxes[target].send((socket, peer)) {
                    // The target core is gone (its thread ended): serve it here after all.
                    self.balance.open[target].dec();
                    self.balance.open[self.me].inc();
                    self.take_over(socket, peer, shutdown);
                }
            }
            Err(e) => {
                self.balance.open[target].dec();
                tracing::debug!(error = %e, "could not hand a connection over; closed");
            }
        }
    }

    /// Serve `socket` in a task of this core's runtime; counted out of this core when it ends.
    fn spawn(&self, socket: tokio::net::TcpStream, peer: SocketAddr, shutdown: &ShutdownWatch) {
        let (edge, tls, shutdown) = (self.edge.clone(), self.tls.clone(), shutdown.clone());
        let counted = CountedOut(self.balance.open[self.me].clone());
        tokio::spawn(async move {
            serve(socket, peer, &edge, tls.as_deref(), &shutdown).await;
            drop(counted);
        });
    }
}

/// One client connection, from the accepted socket to its last request.
async fn serve<A: ServerApp + Send + Sync + 'static>(
    socket: tokio::net::TcpStream,
    peer: SocketAddr,
    edge: &Arc<A>,
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

#[cfg(test)]
mod tests {
    use super::least_loaded;

    #[test]
    fn a_new_connection_goes_to_the_core_with_fewest_and_stays_where_it_was_accepted_on_a_tie() {
        assert_eq!(least_loaded(&[3, 1, 2], 0), 1);
        assert_eq!(least_loaded(&[3, 1, 1], 2), 2, "a tie with the accepting core keeps it there");
        assert_eq!(least_loaded(&[3, 1, 1], 0), 1, "else the first of the fewest");
        assert_eq!(least_loaded(&[0, 0], 1), 1);
        assert_eq!(least_loaded(&[5], 0), 0);
        assert_eq!(least_loaded(&[], 0), 0, "no cores: nowhere else to go");
    }
}
