//! [`InflightGuard`]: a request counted on the engine it is on — its in-flight count, and its
//! pending prefill tokens until the first generated content, when the prefill rate is
//! learned — for as long as the guard lives, whichever transport delivered it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::cluster::Backend;

/// Keeps a backend's in-flight count, and its pending prefill tokens until the first
/// generated content, while a request is on it.
pub(crate) struct InflightGuard {
    backend: Arc<Backend>,
    /// This request's uncached prompt tokens, still counted as pending prefill.
    pending: u64,
    /// Prefill work ahead of and including this request at dispatch (for rate learning).
    work: u64,
    /// Learn the prefill rate from this request's first content (streams only: a
    /// non-streamed response's first byte comes after the whole generation).
    learn: bool,
    dispatched: Instant,
    /// The prefill is over (the first content arrived).
    prefilled: bool,
}

impl InflightGuard {
    /// Count a request on `backend` with its `pending` uncached prompt tokens, sent at
    /// `dispatched`.
    pub(crate) fn new(backend: Arc<Backend>, pending: u64, work: u64, learn: bool, dispatched: Instant) -> Self {
        backend.inflight.fetch_add(1, Ordering::Relaxed);
        backend.routed.fetch_add(1, Ordering::Relaxed);
        backend.pending_prefill_tokens.fetch_add(pending, Ordering::Relaxed);
        // Nothing waits on the first content when there is no pending prefill to release and
        // no sample to learn from (`observe_prefill` skips small ones): the response is then
        // not scanned for it.
        let prefilled = pending == 0 && (!learn || work < crate::cluster::MIN_SAMPLE_TOKENS);
        InflightGuard { backend, pending, work, learn, dispatched, prefilled }
    }

    /// Whether the first content has arrived.
    pub(crate) fn prefilled(&self) -> bool {
        self.prefilled
    }

    /// The first generated content arrived at `now` ([`crate::request::ContentDetector`];
    /// for a response that is not a stream, its first byte): the prefill is done.
    pub(crate) fn first_content(&mut self, now: Instant) {
        if std::mem::replace(&mut self.prefilled, true) {
            return;
        }
        if self.learn {
            self.backend.observe_prefill(self.work, now.duration_since(self.dispatched).as_secs_f64(), now);
        }
        self.backend.pending_prefill_tokens.fetch_sub(std::mem::take(&mut self.pending), Ordering::Relaxed);
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.backend.inflight.fetch_sub(1, Ordering::Relaxed);
        self.backend.pending_prefill_tokens.fetch_sub(self.pending, Ordering::Relaxed);
    }
}
