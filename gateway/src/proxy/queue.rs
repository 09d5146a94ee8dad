//! The `queue` phase: hold a request while no engine can take it
//! ([`crate::config::AdmissionConfig`], order from [`crate::admission`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::active::Active;
use crate::admission::{Full, TenantCap, Ticket};
use crate::error::ProxyError;
use crate::metrics::GatewayMetrics;

use super::{routable, ProxyApp};

/// How often the first waiter looks at the cluster view again (scrapes update it).
const RECHECK: Duration = Duration::from_millis(20);

/// How a request leaves the queue.
pub(crate) enum Admitted {
    /// An engine can take it; the ticket (if it queued) is let go once it is in flight.
    Go(Option<Ticket>),
    /// Refused (503 with `Retry-After`): the queue is full or the wait was too long.
    Refused(ProxyError),
    /// The client went away while waiting: its place is given up at once.
    ClientGone,
}

/// Counts a request in the queue gauge and its wait in the histogram on every way out,
/// the handler dropped mid-wait included.
struct Queued<'a>(&'a GatewayMetrics, Instant);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queue_depth.dec();
        self.0.queue_wait.observe(self.1.elapsed().as_secs_f64());
    }
}

impl ProxyApp {
    /// Returns at once when an engine is up and not saturated for `model` (or the model is
    /// unknown while others are known: a 404 is due) and nobody waits; else waits in
    /// priority order until it is first and an engine can take it, or until the deadline
    /// (503 with `Retry-After`), or until `gone` resolves: the client left (its place is given up at once, so
    /// abandoned requests neither hold the queue nor inflate `switchyard_queue_depth`, which
    /// autoscaling reads). The first waiter re-checks the cluster view every [`RECHECK`] and
    /// whenever the waiter before it left. The ticket returned is kept until the request is
    /// counted in flight on a backend, so the next waiter sees that engine one request busier.
    pub(crate) async fn queue(
        &self,
        gone: impl std::future::Future,
        active: &Active,
        model: &str,
        started: Instant,
        priority: i32,
        tenant: Option<&str>,
    ) -> Admitted {
        let ready_in = |active: &Active| {
            let (candidates, known) = routable(active, model, &[], Instant::now());
            let adm = &active.config.admission;
            candidates.iter().any(|c| !adm.saturated(c.signal.as_ref()))
                || (!known && !active.cluster.models().is_empty())
        };
        let queue = &self.state.queue;
        // The usual case, decided on the snapshot the request was planned under.
        if active.config.admission.max_wait_ms == 0 || (queue.is_empty() && ready_in(active)) {
            return Admitted::Go(None);
        }
        let ready = || ready_in(&self.state.active.load());
        let adm = self.state.active.load().config.admission.clone();
        let tenant: Option<Arc<str>> = tenant.filter(|_| adm.max_queue_per_tenant.is_some()).map(Into::into);
        let cap = tenant.as_ref().zip(adm.max_queue_per_tenant).map(|(tenant, max)| TenantCap { tenant, max });
        let ticket = match queue.try_enter(priority, adm.max_queue, cap) {
            Ok(t) => t,
            Err(Full::Queue) => return Admitted::Refused(ProxyError::NoBackend(model.to_string())),
            Err(Full::Tenant) => {
                let (tenant, max) = (tenant.as_deref().unwrap_or_default().to_string(), cap.map_or(0, |c| c.max));
                return Admitted::Refused(ProxyError::TenantQueueFull { tenant, max });
            }
        };
        let metrics = &self.state.metrics;
        metrics.queue_depth.inc();
        let mut gone = std::pin::pin!(gone);
        let _queued = Queued(metrics, started);
        let deadline = tokio::time::Instant::from_std(started + Duration::from_millis(adm.max_wait_ms));
        loop {
            let moved = queue.changed();
            if ticket.is_first() && ready() {
                break Admitted::Go(Some(ticket));
            }
            tokio::select! {
                _ = moved => {}
                _ = tokio::time::sleep(RECHECK) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    break Admitted::Refused(ProxyError::NoBackend(model.to_string()));
                }
                _ = &mut gone => break Admitted::ClientGone,
            }
        }
    }
}
