//! `session`: requests carrying the same session header value go to the same backend, with
//! bounded load.
//!
//! Rendezvous (highest-random-weight) hashing: every candidate scores
//! `hash(session, backend key)` and the highest wins, so adding or removing a backend moves
//! only the sessions that belonged to it. **Bounded load** (consistent hashing with bounded
//! loads, Mirrokni et al.): a candidate whose in-flight count is at or above
//! `ceil(load_factor · (total_inflight + 1) / n)` is skipped for the next in score order
//! (reason `session_overflow`). Requests without the header go by `least_load`
//! (reason `no_session`).

use serde::Deserialize;

use super::least_load::LeastLoad;
use super::{check_number, Candidate, Decision, LoadWeights, Policy, RouteInput};

/// Knobs of `session`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    /// Request header holding the session id.
    pub header: String,
    /// Bounded-load factor (> 1): how far above the mean in-flight a sticky backend may go.
    pub load_factor: f64,
    /// Weights of the `least_load` fallback.
    pub weights: LoadWeights,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig { header: "x-session-id".into(), load_factor: 1.25, weights: LoadWeights::default() }
    }
}

impl SessionConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String, String)> {
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if self.header.is_empty() || !self.header.bytes().all(token) {
            return Err(("header".into(), self.header.clone(), "must be a valid HTTP header name".into()));
        }
        check_number("load_factor", self.load_factor, 1.0)?;
        self.weights.validate()
    }
}

pub(super) struct Session(pub(super) SessionConfig);

impl Policy for Session {
    fn name(&self) -> &'static str {
        "session"
    }

    fn session_header(&self) -> Option<&str> {
        Some(&self.0.header)
    }

    fn select(&self, input: &RouteInput<'_>, c: &[Candidate], rng: &mut dyn rand::RngCore) -> Decision {
        let Some(session) = input.session else {
            let d = LeastLoad { weights: self.0.weights }.select(input, c, rng);
            return Decision { pick: d.pick, reason: "no_session" };
        };
        let total: u64 = c.iter().map(|x| x.inflight).sum();
        let cap = (self.0.load_factor * (total + 1) as f64 / c.len() as f64).ceil() as u64;
        let mut order: Vec<(u64, usize)> = c
            .iter()
            .enumerate()
            .map(|(i, x)| (xxhash_rust::xxh3::xxh3_64_with_seed(session.as_bytes(), x.key), i))
            .collect();
        order.sort_by_key(|o| std::cmp::Reverse(o.0));
        for (rank, &(_, i)) in order.iter().enumerate() {
            if c[i].inflight < cap {
                return Decision { pick: i, reason: if rank == 0 { "session_sticky" } else { "session_overflow" } };
            }
        }
        // Unreachable in practice (the cap exceeds the mean); keep the sticky pick.
        Decision { pick: order[0].1, reason: "session_sticky" }
    }
}
