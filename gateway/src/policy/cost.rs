//! `cost` (the default): pick the backend with the lowest predicted time to first token.
//!
//! ```text
//! queue_tokens  = max(pending_prefill_tokens, waiting · queued_prompt_tokens)
//! ttft(backend) = (queue_tokens + prompt_tokens − matched_tokens) / prefill_rate
//! ```
//!
//! - `pending_prefill_tokens`: prompt tokens this gateway sent there that have not produced
//!   a first byte yet — exact for our own traffic, available between scrapes.
//! - `waiting · queued_prompt_tokens`: the engine's own queue (scraped), for traffic that did
//!   not come through this gateway; each queued request is priced at the configured mean
//!   prompt. The larger of the two counts, as they mostly describe the same requests.
//! - `matched_tokens`: the leading prompt tokens the backend probably has cached (the
//!   gateway's prefix index); those skip prefill.
//! - `prefill_rate`: tokens/s learned per backend from observed TTFTs (an EWMA kept by the
//!   request path, see `Backend::observe_prefill`), `prefill_tokens_per_s` until learned.
//!
//! Ties (within `tie_epsilon_ms`) go to the lower `least_load` score. With a stale signal
//! anywhere, the waiting term is dropped for every candidate (same units for all; reason
//! `stale_signal_fallback`). Reasons: `prefix_hit` when the pick has matched tokens,
//! `shortest_queue` otherwise.

use serde::Deserialize;

use super::{argmin_random_tie, check_number, load_score, Candidate, Decision, LoadWeights, Policy, RouteInput};

/// Knobs of `cost`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostConfig {
    /// Prefill rate assumed until one is learned (tokens/s).
    pub prefill_tokens_per_s: f64,
    /// Price of one request in an engine's waiting queue, in prompt tokens.
    pub queued_prompt_tokens: f64,
    /// Predictions closer than this are ties, broken by load.
    pub tie_epsilon_ms: f64,
    /// Load weights for ties.
    pub weights: LoadWeights,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            prefill_tokens_per_s: 10_000.0,
            queued_prompt_tokens: 512.0,
            tie_epsilon_ms: 0.5,
            weights: LoadWeights::default(),
        }
    }
}

impl CostConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String, String)> {
        check_number("prefill_tokens_per_s", self.prefill_tokens_per_s, 1.0)?;
        check_number("queued_prompt_tokens", self.queued_prompt_tokens, 0.0)?;
        check_number("tie_epsilon_ms", self.tie_epsilon_ms, 0.0)?;
        self.weights.validate()
    }

    /// Predicted TTFT in ms of `input` on `c`; `fresh`: whether to count the scraped queue.
    pub fn predicted_ttft_ms(&self, input: &RouteInput<'_>, c: &Candidate, fresh: bool) -> f64 {
        let rate = if c.prefill_tokens_per_s > 0.0 { c.prefill_tokens_per_s } else { self.prefill_tokens_per_s };
        let queued = match (fresh, c.signal) {
            (true, Some(s)) => s.waiting * self.queued_prompt_tokens,
            _ => 0.0,
        };
        let queue = (c.pending_prefill_tokens as f64).max(queued);
        let own = input.prompt_tokens.saturating_sub(c.matched_tokens) as f64;
        (queue + own) / rate * 1e3
    }
}

pub(super) struct Cost(pub(super) CostConfig);

impl Policy for Cost {
    fn name(&self) -> &'static str {
        "cost"
    }

    fn uses_prefix(&self) -> bool {
        true
    }

    fn select(&self, input: &RouteInput<'_>, c: &[Candidate], rng: &mut dyn rand::RngCore) -> Decision {
        let cfg = &self.0;
        let fresh = c.iter().all(|x| x.signal.is_some());
        let ttft: Vec<f64> = c.iter().map(|x| cfg.predicted_ttft_ms(input, x, fresh)).collect();
        let best = ttft.iter().copied().fold(f64::INFINITY, f64::min);
        // Among the near-best predictions, the least loaded.
        let near: Vec<Candidate> =
            c.iter().zip(&ttft).filter(|(_, t)| **t <= best + cfg.tie_epsilon_ms).map(|(x, _)| *x).collect();
        let pick = near[argmin_random_tie(&near, rng, |x| load_score(&cfg.weights, x, fresh))];
        let reason = match (fresh, pick.matched_tokens > 0) {
            (false, _) => "stale_signal_fallback",
            (true, true) => "prefix_hit",
            (true, false) => "shortest_queue",
        };
        Decision { index: pick.index, reason }
    }
}
