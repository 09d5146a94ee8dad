//! An exponentially weighted moving average that decays with elapsed time, not per sample
//! (linkerd2-proxy's `Ewma`): a sample's weight depends on how long the old value went
//! unrefreshed, so a backend sampled ten times a second and one sampled once a minute
//! both forget at the same pace — `decay` is the time after which the old value's weight
//! has fallen to 1/e. Pure: time is an argument.

use std::time::{Duration, Instant};

/// A time-decayed average.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ewma {
    value: f64,
    at: Instant,
    decay: Duration,
}

impl Ewma {
    /// Starts at `first`, observed at `now`.
    pub fn new(first: f64, decay: Duration, now: Instant) -> Self {
        Ewma { value: first, at: now, decay }
    }

    /// The average now.
    pub fn value(&self) -> f64 {
        self.value
    }

    /// Fold in `sample`, observed at `now`: the old value keeps weight `exp(-Δt / decay)`.
    /// A `now` before the last observation counts as no time passed.
    pub fn observe(&mut self, sample: f64, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        let decay = self.decay.as_secs_f64().max(f64::MIN_POSITIVE);
        let keep = (-elapsed / decay).exp();
        self.value = self.value * keep + sample * (1.0 - keep);
        self.at = self.at.max(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_old_value_fades_with_time_not_with_samples() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut e = Ewma::new(100.0, s, t0);
        // No time passed: a sample changes nothing.
        e.observe(0.0, t0);
        assert_eq!(e.value(), 100.0);
        // One decay later, the old value weighs 1/e.
        e.observe(0.0, t0 + s);
        assert!((e.value() - 100.0 / std::f64::consts::E).abs() < 1e-9, "{}", e.value());
        // Long silence: the next sample is almost all that counts.
        e.observe(50.0, t0 + 60 * s);
        assert!((e.value() - 50.0).abs() < 1e-9);
        // Ten quick samples weigh what one sample after the same total time does.
        let (mut many, mut one) = (Ewma::new(0.0, s, t0), Ewma::new(0.0, s, t0));
        for i in 1..=10 {
            many.observe(10.0, t0 + i * s / 10);
        }
        one.observe(10.0, t0 + s);
        assert!((many.value() - one.value()).abs() < 1e-9);
        // Time going backwards is no time.
        let mut back = Ewma::new(1.0, s, t0 + s);
        back.observe(5.0, t0);
        assert_eq!(back.value(), 1.0);
    }
}
