//! Graceful drain on SIGTERM ([`crate::config::DrainConfig`]).
//!
//! pingora's own SIGTERM handling closes the listeners at once and then always sleeps the
//! whole grace period. At the edge we want the Kubernetes order instead:
//!
//! 1. SIGTERM: `/-/ready` fails at once (the gateway is marked draining);
//! 2. listeners keep accepting for `close_listeners_after_ms` while endpoints and load
//!    balancers catch up, so no client is refused — then pingora is told to shut down,
//!    which closes the listeners and idle keep-alive connections;
//! 3. requests in flight finish; the process exits 0 as soon as none is left, or when
//!    `grace_period_secs` (from the signal) is up.
//!
//! SIGINT is pingora's fast shutdown.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};
use tokio::signal::unix::{signal, SignalKind};

use crate::state::GatewayState;

/// Connections being served by the proxy (a request read or in flight).
#[derive(Debug, Default)]
pub struct InFlight(AtomicUsize);

/// Counts one connection's turn in [`InFlight`] while alive.
pub struct InFlightGuard<'a>(&'a InFlight);

impl InFlight {
    /// Count one in until the guard drops.
    pub fn enter(&self) -> InFlightGuard<'_> {
        self.0.fetch_add(1, Ordering::SeqCst);
        InFlightGuard(self)
    }

    /// How many are in.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// pingora's shutdown signal, with the drain order above.
pub struct DrainSignal {
    state: Arc<GatewayState>,
}

impl DrainSignal {
    /// The watcher for `state`.
    pub fn new(state: Arc<GatewayState>) -> Self {
        DrainSignal { state }
    }
}

#[async_trait]
impl ShutdownSignalWatch for DrainSignal {
    async fn recv(&self) -> ShutdownSignal {
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        tokio::select! {
            _ = int.recv() => return ShutdownSignal::FastShutdown,
            _ = term.recv() => {}
        }
        let signalled = Instant::now();
        let drain = self.state.active.load().config.drain.clone();
        self.state.draining.store(true, Ordering::SeqCst);
        tracing::info!(
            close_listeners_after_ms = drain.close_listeners_after_ms,
            grace_period_secs = drain.grace_period_secs,
            "SIGTERM: readiness fails now; listeners close after the delay"
        );
        let close_after = Duration::from_millis(drain.close_listeners_after_ms);
        tokio::select! {
            _ = int.recv() => return ShutdownSignal::FastShutdown,
            _ = tokio::time::sleep(close_after) => {}
        }
        // From here pingora closes the listeners and waits out the rest of the grace
        // period; this thread ends the process as soon as nothing is in flight.
        let state = self.state.clone();
        let deadline = signalled + Duration::from_secs(drain.grace_period_secs);
        std::thread::spawn(move || {
            // Let pingora's shutdown broadcast reach the connections first.
            std::thread::sleep(Duration::from_millis(50));
            while state.in_flight.get() > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            tracing::info!(in_flight = state.in_flight.get(), "drained; exiting");
            state.access_log.flush();
            std::process::exit(0);
        });
        ShutdownSignal::GracefulTerminate
    }
}
