//! The drain, run once the shutdown signal (SIGTERM) has arrived.
//!
//! The sidecar turns not-ready at once (`/-/healthz` 503 `draining`, `/load` says
//! `"draining":true`), so Kubernetes and the gateway stop sending it new requests, but it
//! keeps serving whatever still arrives. It then waits until no request is in flight or
//! `drain_timeout` has passed, whichever is first, with the shared blocking drain loop
//! ([`crate::process::wait_until_idle`]) on a blocking thread.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Sidecar;
use crate::process::wait_until_idle;

/// Mark the sidecar draining and wait for in-flight requests, at most `timeout`; returns how
/// many were still in flight (0 when all finished).
pub(crate) async fn drain(sh: &Arc<Sidecar>, timeout: Duration) -> u64 {
    sh.draining.store(true, Ordering::Release);
    tracing::info!(in_flight = sh.in_flight.get(), "SIGTERM: draining");
    let deadline = Instant::now() + timeout;
    let in_flight = sh.in_flight.clone();
    let count = move || usize::try_from(in_flight.get()).unwrap_or(usize::MAX);
    let left = match tokio::task::spawn_blocking(move || wait_until_idle(count, deadline)).await {
        Ok(n) => n as u64,
        Err(_) => sh.in_flight.get(),
    };
    tracing::info!(left, "drained; exiting");
    left
}
