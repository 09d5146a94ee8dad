//! `least_load`: the backend with the lowest weighted load.
//!
//! ```text
//! load = waiting·w_waiting + running·w_running + kv_usage·w_kv_usage + inflight·w_inflight
//! ```
//!
//! - `waiting` and `running` are the engine's own queue and batch (scraped, e.g.
//!   `vllm:num_requests_waiting`); a queued request is what delays time to first token, so
//!   `waiting` weighs most. `running` weighs less: a bigger batch slows every token a little.
//! - `kv_usage` (0..1) anticipates queueing: a nearly full cache stops admitting soon.
//! - `inflight` is the gateway's own count, updated at dispatch, so a burst that arrives
//!   between two scrapes spreads out instead of piling onto the backend that looked idlest.
//!
//! When any candidate's signal is stale, every candidate is scored by `inflight` alone
//! (see the module [`super`]). Ties are broken at random.

use serde::Deserialize;

use super::{argmin_random_tie, Candidate, Decision, Policy, RouteInput};

/// Weights of the load score.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadWeights {
    /// Per queued request.
    pub waiting: f64,
    /// Per running request.
    pub running: f64,
    /// Per unit of KV usage (a full cache counts like this many queued requests).
    pub kv_usage: f64,
    /// Per gateway in-flight request.
    pub inflight: f64,
}

impl Default for LoadWeights {
    fn default() -> Self {
        LoadWeights { waiting: 1.0, running: 0.25, kv_usage: 4.0, inflight: 1.0 }
    }
}

impl LoadWeights {
    pub(super) fn validate(&self) -> Result<(), (String, String, String)> {
        for (name, v) in [
            ("waiting", self.waiting),
            ("running", self.running),
            ("kv_usage", self.kv_usage),
            ("inflight", self.inflight),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err((format!("weights.{name}"), v.to_string(), "must be a finite number >= 0".into()));
            }
        }
        Ok(())
    }
}

/// The load of one candidate; with `fresh == false`, its in-flight count alone.
pub fn load_score(w: &LoadWeights, c: &Candidate, fresh: bool) -> f64 {
    match (fresh, c.signal) {
        (true, Some(s)) => {
            s.waiting * w.waiting + s.running * w.running + s.kv_usage * w.kv_usage + c.inflight as f64 * w.inflight
        }
        _ => c.inflight as f64,
    }
}

pub(super) struct LeastLoad {
    pub(super) weights: LoadWeights,
}

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }
    fn select(&self, _: &RouteInput<'_>, c: &[Candidate], rng: &mut dyn rand::RngCore) -> Decision {
        let fresh = c.iter().all(|x| x.signal.is_some());
        let i = argmin_random_tie(c, rng, |x| load_score(&self.weights, x, fresh));
        Decision { pick: i, reason: if fresh { "least_load" } else { "stale_signal_fallback" } }
    }
}
