//! The process-wide cap on buffered request bodies (`limits.max_buffered_body_bytes`).
//!
//! Each body is held whole for the life of its request (a retry resends it), so
//! `limits.max_body_bytes` alone bounds one request, not the process: 100 streams on one
//! HTTP/2 connection could hold 1.6 GiB. A request reserves its body's bytes here before
//! reading them — all of a declared `Content-Length` at once, a chunked body as it
//! arrives — and a reservation that would pass the cap is refused (the proxy answers 503
//! with `Retry-After`). Dropping the [`BodyReservation`] gives the bytes back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus::IntGauge;

/// Bytes of request bodies held now, against a cap given per call (it hot-reloads).
#[derive(Debug)]
pub struct BodyBudget {
    held: AtomicU64,
    gauge: IntGauge,
}

impl BodyBudget {
    /// An empty budget reporting what it holds in `gauge`.
    pub fn new(gauge: IntGauge) -> Arc<Self> {
        Arc::new(BodyBudget { held: AtomicU64::new(0), gauge })
    }

    /// Bytes held now.
    #[cfg(test)]
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Reserve `bytes` if the total stays within `cap`.
    pub fn reserve(self: &Arc<Self>, bytes: u64, cap: u64) -> Option<BodyReservation> {
        let mut r = BodyReservation { budget: Arc::clone(self), bytes: 0 };
        r.grow(bytes, cap).then_some(r)
    }

    fn take(&self, bytes: u64, cap: u64) -> bool {
        let taken = self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            held.checked_add(bytes).filter(|&total| total <= cap)
        });
        if taken.is_ok() {
            self.gauge.add(bytes as i64);
        }
        taken.is_ok()
    }

    fn give_back(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
        self.gauge.sub(bytes as i64);
    }
}

/// Bytes one request holds; given back when dropped.
#[derive(Debug)]
pub struct BodyReservation {
    budget: Arc<BodyBudget>,
    bytes: u64,
}

impl BodyReservation {
    /// Bytes held.
    #[cfg(test)]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Hold `at_least` bytes in all (a chunked body growing); false, holding what it held,
    /// when that would pass `cap`.
    pub fn grow_to(&mut self, at_least: u64, cap: u64) -> bool {
        at_least <= self.bytes || self.grow(at_least - self.bytes, cap)
    }

    /// Hold exactly `bytes` (a gRPC message in progress: the next may be smaller); false,
    /// holding what it held, when growing would pass `cap`.
    pub fn resize(&mut self, bytes: u64, cap: u64) -> bool {
        if bytes < self.bytes {
            self.budget.give_back(self.bytes - bytes);
            self.bytes = bytes;
            return true;
        }
        self.grow_to(bytes, cap)
    }

    fn grow(&mut self, more: u64, cap: u64) -> bool {
        let ok = more == 0 || self.budget.take(more, cap);
        if ok {
            self.bytes += more;
        }
        ok
    }
}

impl Drop for BodyReservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.give_back(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> Arc<BodyBudget> {
        BodyBudget::new(IntGauge::new("held", "held").unwrap())
    }

    #[test]
    fn reservations_stay_within_the_cap_and_come_back_when_dropped() {
        let b = budget();
        let r1 = b.reserve(60, 100).unwrap();
        assert!(b.reserve(41, 100).is_none(), "61..101 passes the cap");
        let r2 = b.reserve(40, 100).unwrap();
        assert_eq!((b.held(), b.gauge.get()), (100, 100));
        drop(r1);
        assert_eq!((b.held(), b.gauge.get()), (40, 40));
        drop(r2);
        assert_eq!((b.held(), b.gauge.get()), (0, 0));
        assert!(b.reserve(u64::MAX, u64::MAX).is_some(), "no overflow at the edge");
        assert_eq!(b.held(), 0);
    }

    #[test]
    fn a_growing_body_takes_only_the_difference_and_keeps_what_it_had_when_refused() {
        let b = budget();
        let mut r = b.reserve(0, 100).unwrap();
        assert!(r.grow_to(30, 100) && r.grow_to(20, 100) && r.grow_to(80, 100));
        assert_eq!((r.bytes(), b.held()), (80, 80));
        let other = b.reserve(20, 100).unwrap();
        assert!(!r.grow_to(81, 100));
        assert_eq!((r.bytes(), b.held()), (80, 100));
        drop((r, other));
        assert_eq!(b.held(), 0);
        let mut r = b.reserve(70, 100).unwrap();
        assert!(r.resize(10, 100) && b.held() == 10);
        assert!(!r.resize(101, 100) && b.held() == 10);
        assert!(r.resize(100, 100) && b.held() == 100);
    }

    #[test]
    fn concurrent_reservations_never_pass_the_cap() {
        let b = budget();
        let peak = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (b, peak) = (Arc::clone(&b), Arc::clone(&peak));
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        if let Some(r) = b.reserve(7, 50) {
                            peak.fetch_max(b.held(), Ordering::Relaxed);
                            drop(r);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(Ordering::Relaxed) <= 50);
        assert_eq!(b.held(), 0);
    }
}
