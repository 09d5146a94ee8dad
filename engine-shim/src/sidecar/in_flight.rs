//! In-flight accounting: how many proxied requests have not finished yet.
//!
//! A request counts from the moment the proxy accepts it until its response body has been
//! sent to the end or dropped (the client went away, the engine failed, the answer was an
//! error). The count is what `/load`, `/metrics` and the drain read.
//!
//! The unit is held by an [`InFlightGuard`]: [`InFlight::enter`] adds one and returns the
//! guard, dropping the guard takes the one away. The proxy moves the guard into the response
//! body, so whichever way the body ends, the count comes down exactly once. Pure: no I/O, no
//! clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The number of requests in flight.
#[derive(Debug, Default)]
pub(crate) struct InFlight(AtomicU64);

impl InFlight {
    /// Count one more request; it stays counted until the returned guard is dropped.
    pub(crate) fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.0.fetch_add(1, Ordering::AcqRel);
        InFlightGuard(self.clone())
    }

    /// Requests in flight now.
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// One request's unit of [`InFlight`]; dropping it ends the request.
#[derive(Debug)]
pub(crate) struct InFlightGuard(Arc<InFlight>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_guard_counts_once_until_dropped() {
        let n = Arc::new(InFlight::default());
        let a = n.enter();
        let b = n.enter();
        assert_eq!(n.get(), 2);
        drop(a);
        assert_eq!(n.get(), 1);
        let moved = vec![b];
        assert_eq!(n.get(), 1, "moving a guard does not count again");
        drop(moved);
        assert_eq!(n.get(), 0);
    }
}
