//! `prefix_affinity`: send a request where its prompt prefix is probably cached, unless that
//! creates a hotspot.
//!
//! 1. Take the candidate with the most matched prefix tokens (ties: lower load, then random).
//! 2. If it matched less than `min_match_ratio` of the prompt, the cache is not worth a
//!    detour: route by `least_load` (reason `low_match`).
//! 3. **Guard** (SGLang's router does the same with its balance thresholds): if its load
//!    exceeds the least-loaded candidate's by more than `balance_abs_threshold` *and* is more
//!    than `balance_rel_threshold` times it, route by `least_load` (reason `guard_diverted`).
//! 4. Otherwise pick it (reason `prefix_match`).
//!
//! Load is the `least_load` score ([`LoadWeights`]), with the same stale-signal fallback:
//! if any candidate's signal is stale, every candidate's load is its in-flight count.

use serde::Deserialize;

use super::{argmin_random_tie, check_number, load_score, Candidate, Decision, LoadWeights, Policy, RouteInput};

/// Knobs of `prefix_affinity`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AffinityConfig {
    /// Below this share of the prompt matched, route by load alone.
    pub min_match_ratio: f64,
    /// The guard trips only when the match's load exceeds the least load by more than this…
    pub balance_abs_threshold: f64,
    /// …and is more than this multiple of it.
    pub balance_rel_threshold: f64,
    /// Load weights.
    pub weights: LoadWeights,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            min_match_ratio: 0.1,
            balance_abs_threshold: 8.0,
            balance_rel_threshold: 1.5,
            weights: LoadWeights::default(),
        }
    }
}

impl AffinityConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String, String)> {
        check_number("min_match_ratio", self.min_match_ratio, 0.0)?;
        if self.min_match_ratio > 1.0 {
            return Err(("min_match_ratio".into(), self.min_match_ratio.to_string(), "must be <= 1".into()));
        }
        check_number("balance_abs_threshold", self.balance_abs_threshold, 0.0)?;
        check_number("balance_rel_threshold", self.balance_rel_threshold, 1.0)?;
        self.weights.validate()
    }
}

pub(super) struct PrefixAffinity(pub(super) AffinityConfig);

impl Policy for PrefixAffinity {
    fn name(&self) -> &'static str {
        "prefix_affinity"
    }

    fn uses_prefix(&self) -> bool {
        true
    }

    fn select(&self, input: &RouteInput<'_>, c: &[Candidate], rng: &mut dyn rand::RngCore) -> Decision {
        let cfg = &self.0;
        let fresh = c.iter().all(|x| x.signal.is_some());
        let load = |x: &Candidate| load_score(&cfg.weights, x, fresh);
        let least = argmin_random_tie(c, rng, load);
        let by_load = |reason| Decision { pick: least, reason: if fresh { reason } else { "stale_signal_fallback" } };
        // Most matched tokens first, then lower load.
        let pick = argmin_random_tie(c, rng, |x| (std::cmp::Reverse(x.matched_tokens), load(x)));
        let best = c[pick];
        let ratio =
            if input.prompt_tokens == 0 { 0.0 } else { best.matched_tokens as f64 / input.prompt_tokens as f64 };
        if best.matched_tokens == 0 || ratio < cfg.min_match_ratio {
            return by_load("low_match");
        }
        let (lb, ll) = (load(&best), load(&c[least]));
        if lb - ll > cfg.balance_abs_threshold && lb > ll * cfg.balance_rel_threshold {
            return by_load("guard_diverted");
        }
        Decision { pick, reason: "prefix_match" }
    }
}
