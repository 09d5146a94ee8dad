//! The retry budget (Finagle's `RetryBudget`, Envoy's `retry_budget`): retries may add at
//! most `budget_percent` of the recent request rate, plus `min_retries_per_second` so a
//! quiet gateway can still retry. It keeps a failing cluster from being hit by a multiple
//! of its traffic — the retry storm that turns an overload into an outage.
//!
//! "Recent" is a sliding window of [`WINDOW_SECS`] one-second buckets. Pure: time is passed in.

use std::time::Instant;

/// Seconds of history the budget looks at.
pub const WINDOW_SECS: usize = 10;

/// Requests and retries over the last [`WINDOW_SECS`] seconds.
#[derive(Debug)]
pub struct RetryBudget {
    percent: f64,
    min_per_second: f64,
    start: Instant,
    /// Per second slot: (the second it holds, requests, retries).
    slots: [(u64, u64, u64); WINDOW_SECS],
}

impl RetryBudget {
    /// A budget of `percent` % of requests plus `min_per_second` retries per second.
    pub fn new(percent: u32, min_per_second: u32, now: Instant) -> Self {
        RetryBudget {
            percent: percent as f64,
            min_per_second: min_per_second as f64,
            start: now,
            slots: [(u64::MAX, 0, 0); WINDOW_SECS],
        }
    }

    /// Change the limits, keeping the history.
    pub fn set_limits(&mut self, percent: u32, min_per_second: u32) {
        self.percent = percent as f64;
        self.min_per_second = min_per_second as f64;
    }

    fn slot(&mut self, now: Instant) -> &mut (u64, u64, u64) {
        let second = now.saturating_duration_since(self.start).as_secs();
        let slot = &mut self.slots[(second % WINDOW_SECS as u64) as usize];
        if slot.0 != second {
            *slot = (second, 0, 0);
        }
        slot
    }

    fn totals(&self, now: Instant) -> (u64, u64) {
        let second = now.saturating_duration_since(self.start).as_secs();
        self.slots
            .iter()
            .filter(|s| s.0 != u64::MAX && s.0 + (WINDOW_SECS as u64) > second)
            .fold((0, 0), |(r, t), s| (r + s.1, t + s.2))
    }

    /// A new request (its first attempt).
    pub fn record_request(&mut self, now: Instant) {
        self.slot(now).1 += 1;
    }

    /// Take one retry from the budget; false when it is spent.
    pub fn try_retry(&mut self, now: Instant) -> bool {
        let (requests, retries) = self.totals(now);
        let allowed = requests as f64 * self.percent / 100.0 + self.min_per_second * WINDOW_SECS as f64;
        if (retries as f64) < allowed {
            self.slot(now).2 += 1;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn retries_are_a_share_of_requests_plus_a_floor() {
        let t0 = Instant::now();
        let mut b = RetryBudget::new(20, 1, t0);
        for _ in 0..100 {
            b.record_request(t0);
        }
        // 20 % of 100 plus 1/s over the 10 s window.
        let granted = (0..100).filter(|_| b.try_retry(t0)).count();
        assert_eq!(granted, 30);
    }

    #[test]
    fn the_window_slides() {
        let t0 = Instant::now();
        let mut b = RetryBudget::new(0, 1, t0);
        assert_eq!((0..50).filter(|_| b.try_retry(t0)).count(), 10);
        assert!(!b.try_retry(t0 + Duration::from_secs(5)));
        // Ten seconds later the old retries have left the window.
        assert!(b.try_retry(t0 + Duration::from_secs(10)));
    }

    #[test]
    fn a_zero_budget_never_retries() {
        let t0 = Instant::now();
        let mut b = RetryBudget::new(0, 0, t0);
        b.record_request(t0);
        assert!(!b.try_retry(t0));
    }
}
