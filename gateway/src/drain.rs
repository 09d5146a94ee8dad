//! Graceful drain on SIGTERM ([`crate::config::DrainConfig`]).
//!
//! pingora's own SIGTERM handling closes the listeners at once and then always sleeps the
//! whole grace period. At the edge we want the Kubernetes order instead:
//!
//! 1. SIGTERM: `/-/ready` fails at once ([`Lifecycle::is_draining`]);
//! 2. listeners keep accepting for `close_listeners_after_ms` while endpoints and load
//!    balancers catch up, so no client is refused — then pingora is told to shut down,
//!    which closes the listeners and idle keep-alive connections;
//! 3. requests in flight finish; the process exits 0 as soon as none is left, or when
//!    `grace_period_secs` (from the signal) is up ([`switchyard_shim::process::wait_until_idle`]).
//!
//! SIGINT is pingora's fast shutdown. This module knows nothing of the gateway's state: it
//! gets the [`Lifecycle`] it marks and watches, the drain settings in force when the
//! signal comes, and what to do last before exiting.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};
use tokio::signal::unix::{signal, SignalKind};

use crate::config::DrainConfig;

/// Whether the gateway is draining, and what it still serves.
#[derive(Debug, Default)]
pub struct Lifecycle {
    draining: AtomicBool,
    /// Connections being served by the proxy (a request read or in flight).
    pub in_flight: InFlight,
}

impl Lifecycle {
    /// Set on SIGTERM: readiness fails so load balancers stop sending.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Start draining.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }
}

/// A count of connections being served.
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
    lifecycle: Arc<Lifecycle>,
    settings: Box<dyn Fn() -> DrainConfig + Send + Sync>,
    before_exit: Arc<dyn Fn() + Send + Sync>,
}

impl DrainSignal {
    /// A watcher that marks and watches `lifecycle`, reads the drain `settings` in force
    /// when SIGTERM comes, and runs `before_exit` (flushing logs) last.
    pub fn new(
        lifecycle: Arc<Lifecycle>,
        settings: impl Fn() -> DrainConfig + Send + Sync + 'static,
        before_exit: impl Fn() + Send + Sync + 'static,
    ) -> Self {
        DrainSignal { lifecycle, settings: Box::new(settings), before_exit: Arc::new(before_exit) }
    }
}

#[async_trait]
impl ShutdownSignalWatch for DrainSignal {
    async fn recv(&self) -> ShutdownSignal {
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
            tracing::error!("cannot install the SIGTERM/SIGINT handlers; shutting down");
            return ShutdownSignal::FastShutdown;
        };
        tokio::select! {
            _ = int.recv() => return ShutdownSignal::FastShutdown,
            _ = term.recv() => {}
        }
        let signalled = Instant::now();
        let drain = (self.settings)();
        self.lifecycle.start_draining();
        tracing::info!(
            close_listeners_after_ms = drain.close_listeners_after_ms,
            grace_period_secs = drain.grace_period_secs,
            "SIGTERM: readiness fails now; listeners close after the delay"
        );
        tokio::select! {
            _ = int.recv() => return ShutdownSignal::FastShutdown,
            _ = tokio::time::sleep(Duration::from_millis(drain.close_listeners_after_ms)) => {}
        }
        // From here pingora closes the listeners and waits out the rest of the grace
        // period; this thread ends the process as soon as nothing is in flight.
        let (lifecycle, before_exit) = (self.lifecycle.clone(), self.before_exit.clone());
        let deadline = signalled + Duration::from_secs(drain.grace_period_secs);
        std::thread::spawn(move || {
            // Let pingora's shutdown broadcast reach the connections first.
            std::thread::sleep(Duration::from_millis(50));
            let left = switchyard_shim::process::wait_until_idle(|| lifecycle.in_flight.get(), deadline);
            tracing::info!(in_flight = left, "drained; exiting");
            before_exit();
            std::process::exit(0);
        });
        ShutdownSignal::GracefulTerminate
    }
}
