//! Routing policies: pure functions from a request and the candidates to a pick.
//!
//! The request path turns the current cluster snapshot into a slice of [`Candidate`]s —
//! plain values: the backend's position, the gateway's own in-flight count for it, and its
//! scraped load signal if that is fresh — and asks the configured [`Policy`] to choose.
//! Policies do no I/O, read no clock and keep no global state; randomness comes from the
//! caller's RNG, so tests pass a seeded one and expect exact picks.
//!
//! **Stale signals.** If any candidate has no fresh signal, load-based policies compare
//! *every* candidate by in-flight count alone (reason `stale_signal_fallback`): mixing a
//! scraped queue length for one backend with an in-flight count for another would compare
//! different units and pile traffic onto whichever looks emptier by accident.
//!
//! | `type` | picks |
//! |---|---|
//! | `round_robin` | the next candidate in turn |
//! | `random` | a uniformly random candidate |
//! | `least_request` | the fewest gateway in-flight requests (ties at random) |
//! | `power_of_two` | the less loaded of two distinct random candidates (load as `least_load`) |
//! | `least_load` | the lowest weighted load (see [`LoadWeights`]) |
//! | `prefix_affinity` | the longest cached prefix unless that backend is overloaded ([`affinity`]) |
//! | `cost` (default) | the lowest predicted time to first token ([`cost`]) |
//! | `session` | a sticky backend per session header, with bounded load ([`session`]) |
//!
//! The prefix-aware policies read [`Candidate::matched_tokens`], which the request path fills
//! from the gateway's [`prefix_index`] before asking (only when [`Policy::uses_prefix`]).

pub mod affinity;
pub mod cost;
mod least_load;
pub mod prefix_index;
mod round_robin;
pub mod session;

use std::sync::atomic::AtomicUsize;

use rand::Rng;
use serde::Deserialize;

pub use least_load::{load_score, LoadWeights};

/// A fresh scraped signal, as the policies see it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SignalView {
    /// Requests queued in the engine.
    pub waiting: f64,
    /// Requests in the engine's running batch.
    pub running: f64,
    /// KV cache usage 0..=1 (0 when the engine does not report it).
    pub kv_usage: f64,
}

/// One backend that can take the request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Candidate {
    /// Position in the cluster snapshot (returned in the decision).
    pub index: usize,
    /// Stable identity of the backend across config reloads (hash of its URL): what
    /// consistent hashing hashes.
    pub key: u64,
    /// Requests this gateway has in flight to it.
    pub inflight: u64,
    /// Scraped signal, `None` when missing or stale.
    pub signal: Option<SignalView>,
    /// Estimated prompt tokens of this gateway's requests to it that have not yet produced
    /// a first byte (prefill work queued ahead of a new request).
    pub pending_prefill_tokens: u64,
    /// Learned prefill rate in tokens/s (0: nothing learned yet, the policy's prior applies).
    pub prefill_tokens_per_s: f64,
    /// Estimated leading prompt tokens this backend probably has cached.
    pub matched_tokens: u64,
}

/// What the policy knows of the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteInput<'a> {
    /// Requested model.
    pub model: &'a str,
    /// Estimated prompt tokens (0 when the policy does not use prompts).
    pub prompt_tokens: u64,
    /// The session header's value, for `session`.
    pub session: Option<&'a str>,
}

/// A policy's choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Position of the pick in the candidate slice the policy was given (so a pick is
    /// always a candidate; `candidates[pick].index` is its place in the cluster).
    pub pick: usize,
    /// Why (a metric label and access-log field).
    pub reason: &'static str,
}

/// A routing policy.
pub trait Policy: Send + Sync {
    /// The policy's `type` name.
    fn name(&self) -> &'static str;
    /// Choose among non-empty `candidates`; the decision names a position in the slice.
    fn select(&self, input: &RouteInput<'_>, candidates: &[Candidate], rng: &mut dyn rand::RngCore) -> Decision;
    /// Whether the policy reads prompts and matched prefixes (the request path skips the
    /// canonical text and the index otherwise).
    fn uses_prefix(&self) -> bool {
        false
    }
    /// The request header `session` reads, if any.
    fn session_header(&self) -> Option<&str> {
        None
    }
}

/// `policy:` in the config file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyConfig {
    /// Round robin.
    RoundRobin,
    /// Uniform random.
    Random,
    /// Fewest in-flight requests.
    LeastRequest,
    /// Power of two choices.
    PowerOfTwo {
        /// Load weights.
        #[serde(default)]
        weights: LoadWeights,
    },
    /// Least weighted load.
    LeastLoad {
        /// Load weights.
        #[serde(default)]
        weights: LoadWeights,
    },
    /// Longest cached prefix, guarded against hotspots.
    PrefixAffinity(affinity::AffinityConfig),
    /// Lowest predicted TTFT.
    Cost(cost::CostConfig),
    /// Sticky sessions by header.
    Session(session::SessionConfig),
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::Cost(cost::CostConfig::default())
    }
}

impl PolicyConfig {
    /// `Err((field, value, reason))` for an invalid knob.
    pub fn validate(&self) -> Result<(), (String, String, String)> {
        match self {
            PolicyConfig::PowerOfTwo { weights } | PolicyConfig::LeastLoad { weights } => weights.validate(),
            PolicyConfig::PrefixAffinity(c) => c.validate(),
            PolicyConfig::Cost(c) => c.validate(),
            PolicyConfig::Session(c) => c.validate(),
            _ => Ok(()),
        }
    }

    /// Build the policy.
    pub fn build(&self) -> Box<dyn Policy> {
        match self {
            PolicyConfig::RoundRobin => Box::new(round_robin::RoundRobin { next: AtomicUsize::new(0) }),
            PolicyConfig::Random => Box::new(RandomPolicy),
            PolicyConfig::LeastRequest => Box::new(LeastRequest),
            PolicyConfig::PowerOfTwo { weights } => Box::new(PowerOfTwo { weights: *weights }),
            PolicyConfig::LeastLoad { weights } => Box::new(least_load::LeastLoad { weights: *weights }),
            PolicyConfig::PrefixAffinity(c) => Box::new(affinity::PrefixAffinity(c.clone())),
            PolicyConfig::Cost(c) => Box::new(cost::Cost(c.clone())),
            PolicyConfig::Session(c) => Box::new(session::Session(c.clone())),
        }
    }
}

/// A finite number `>= min` or a field error.
fn check_number(field: &str, v: f64, min: f64) -> Result<(), (String, String, String)> {
    if v.is_finite() && v >= min {
        Ok(())
    } else {
        Err((field.into(), v.to_string(), format!("must be a finite number >= {min}")))
    }
}

/// Index into `candidates` of a minimum of `key`, ties broken uniformly at random.
pub(crate) fn argmin_random_tie<K: PartialOrd + Copy>(
    candidates: &[Candidate],
    rng: &mut dyn rand::RngCore,
    key: impl Fn(&Candidate) -> K,
) -> usize {
    argmin_among(0..candidates.len(), rng, |i| key(&candidates[i])).unwrap_or(0)
}

/// The position among `positions` with the least `key`, ties broken uniformly at random
/// (reservoir sampling: the k-th tie replaces the pick with probability 1/k); `None` when
/// `positions` is empty. Allocates nothing.
pub(crate) fn argmin_among<K: PartialOrd + Copy>(
    positions: impl IntoIterator<Item = usize>,
    rng: &mut dyn rand::RngCore,
    key: impl Fn(usize) -> K,
) -> Option<usize> {
    let mut positions = positions.into_iter();
    let first = positions.next()?;
    let (mut best, mut best_key, mut ties) = (first, key(first), 1u32);
    for i in positions {
        let k = key(i);
        if k < best_key {
            (best, best_key, ties) = (i, k, 1);
        } else if k == best_key {
            ties += 1;
            if rng.random_range(0..ties) == 0 {
                best = i;
            }
        }
    }
    Some(best)
}

struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }
    fn select(&self, _: &RouteInput<'_>, c: &[Candidate], rng: &mut dyn rand::RngCore) -> Decision {
        Decision { pick: rng.random_range(0..c.len()), reason: "random" }
    }
}

struct LeastRequest;

impl Policy for LeastRequest {
    fn name(&self) -> &'static str {
        "least_request"
    }
    fn select(&self, _: &RouteInput<'_>, c: &[Candidate], rng: &mut dyn rand::RngCore) -> Decision {
        let i = argmin_random_tie(c, rng, |x| x.inflight);
        Decision { pick: i, reason: "least_inflight" }
    }
}

struct PowerOfTwo {
    weights: LoadWeights,
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }
    fn select(&self, _: &RouteInput<'_>, c: &[Candidate], rng: &mut dyn rand::RngCore) -> Decision {
        if c.len() == 1 {
            return Decision { pick: 0, reason: "single_candidate" };
        }
        // Two distinct positions: draw a in 0..n, b in 0..n-1 and skip over a.
        let a = rng.random_range(0..c.len());
        let mut b = rng.random_range(0..c.len() - 1);
        if b >= a {
            b += 1;
        }
        let fresh = c.iter().all(|x| x.signal.is_some());
        let (sa, sb) = (load_score(&self.weights, &c[a], fresh), load_score(&self.weights, &c[b], fresh));
        let pick = if sb < sa { b } else { a };
        Decision { pick, reason: if fresh { "p2c_load" } else { "stale_signal_fallback" } }
    }
}

#[cfg(test)]
mod tests;
