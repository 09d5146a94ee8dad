//! `cost` (the default): pick the backend with the lowest predicted time to first token.
//!
//! ```text
//! queue_tokens  = max(pending_prefill_tokens, waiting · max(queued_prompt_tokens, uncached))
//!                 + running · running_token_cost
//! ttft(backend) = (queue_tokens + prompt_tokens − matched_tokens) / prefill_rate
//! ```
//!
//! - `pending_prefill_tokens`: prompt tokens this gateway sent there that have not produced
//!   a first byte yet — exact for our own traffic, available between scrapes.
//! - `waiting · queued_prompt_tokens`: the engine's own queue (scraped), for traffic that did
//!   not come through this gateway; each queued request is priced like this request's
//!   uncached prompt on that backend, `uncached = prompt_tokens − matched_tokens` (at least
//!   `queued_prompt_tokens`): requests of one workload are mostly alike,
//!   and a fixed price underrated queues of long prompts (no-prefix benchmark, 1.14×). The larger of the two counts, as they mostly describe the same requests.
//! - `running · running_token_cost`: every sequence in the running batch takes a share of
//!   each step (decode tokens come first in a chunked-prefill step, and the step grows with
//!   the batch), so a big batch delays a new prefill. Without this term a cache hit would
//!   pile every request of a group onto one engine until its KV cache overflowed.
//! - `matched_tokens`: the leading prompt tokens the backend probably has cached (the
//!   gateway's prefix index); those skip prefill.
//! - `prefill_rate`: tokens/s learned per backend from observed TTFTs (an EWMA kept by the
//!   request path, see `Backend::observe_prefill`). A backend not learned yet is assumed to
//!   run at the mean of the candidates' learned rates (engines behind one gateway are usually
//!   alike), or at `prefill_tokens_per_s` when none is learned: pricing an unknown engine at
//!   a pessimistic prior would starve it of the very traffic it needs to be learned. For the
//!   same reason a learned rate is clamped to 0.9–1.1× that mean: a rate learned while the
//!   engine was busy is low, and an engine priced as slow gets no traffic, so no new samples.
//!
//! Predictions are estimates: ones within `tie_epsilon_ms` or `tie_ratio` (25%) of the best
//! are ties, and go to the lower `least_load` score. The band is wider than the rate clamp,
//! so rate noise between alike engines never decides alone; a cache hit (a prompt mostly
//! cached is many times cheaper) or a real queue difference does. With a stale signal
//! anywhere, the waiting term is dropped for every candidate (same units for all; reason
//! `stale_signal_fallback`). Reasons: `prefix_hit` when the pick has matched tokens,
//! `shortest_queue` otherwise.

use serde::Deserialize;

use super::{argmin_among, check_number, load_score, Candidate, Decision, LoadWeights, Policy, RouteInput};

/// Knobs of `cost`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostConfig {
    /// Prefill rate assumed until one is learned (tokens/s).
    pub prefill_tokens_per_s: f64,
    /// Price of one request in an engine's waiting queue, in prompt tokens.
    pub queued_prompt_tokens: f64,
    /// Price of one sequence in an engine's running batch, in prompt tokens.
    pub running_token_cost: f64,
    /// Predictions closer than this are ties, broken by load.
    pub tie_epsilon_ms: f64,
    /// Predictions within this fraction of the best are ties too.
    pub tie_ratio: f64,
    /// Load weights for ties.
    pub weights: LoadWeights,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            prefill_tokens_per_s: 10_000.0,
            queued_prompt_tokens: 512.0,
            running_token_cost: 64.0,
            tie_epsilon_ms: 0.5,
            tie_ratio: 0.25,
            weights: LoadWeights::default(),
        }
    }
}

impl CostConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String, String)> {
        check_number("prefill_tokens_per_s", self.prefill_tokens_per_s, 1.0)?;
        check_number("queued_prompt_tokens", self.queued_prompt_tokens, 0.0)?;
        check_number("running_token_cost", self.running_token_cost, 0.0)?;
        check_number("tie_epsilon_ms", self.tie_epsilon_ms, 0.0)?;
        check_number("tie_ratio", self.tie_ratio, 0.0)?;
        self.weights.validate()
    }

    /// Predicted TTFT in ms of `input` on `c`; `fresh`: whether to count the scraped
    /// queue; `default_rate`: the rate of a backend not learned yet.
    pub fn predicted_ttft_ms(&self, input: &RouteInput<'_>, c: &Candidate, fresh: bool, default_rate: f64) -> f64 {
        let rate = if c.prefill_tokens_per_s > 0.0 { c.prefill_tokens_per_s } else { default_rate };
        let own = input.prompt_tokens.saturating_sub(c.matched_tokens) as f64;
        let (queued, running) = match (fresh, c.signal) {
            // A queued request is priced like this one would be here (workloads are mostly
            // alike), at least `queued_prompt_tokens`.
            (true, Some(s)) => (s.waiting * self.queued_prompt_tokens.max(own), s.running * self.running_token_cost),
            _ => (0.0, 0.0),
        };
        let queue = (c.pending_prefill_tokens as f64).max(queued) + running;
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
        let (sum, learned) = c
            .iter()
            .map(|x| x.prefill_tokens_per_s)
            .filter(|r| *r > 0.0)
            .fold((0.0, 0usize), |(sum, n), r| (sum + r, n + 1));
        let default_rate = if learned == 0 { cfg.prefill_tokens_per_s } else { sum / learned as f64 };
        // A learned rate counts only within ±10% of the mean: a backend that learned a low
        // rate while busy would otherwise get no traffic, hence no new samples, ever.
        let ttft = |i: usize| {
            let mut x = c[i];
            if x.prefill_tokens_per_s > 0.0 {
                x.prefill_tokens_per_s = x.prefill_tokens_per_s.clamp(0.9 * default_rate, 1.1 * default_rate);
            }
            cfg.predicted_ttft_ms(input, &x, fresh, default_rate)
        };
        let best = (0..c.len()).map(ttft).fold(f64::INFINITY, f64::min);
        // Among the near-best predictions, the least loaded.
        let slack = cfg.tie_epsilon_ms.max(best * cfg.tie_ratio);
        let near = (0..c.len()).filter(|&i| ttft(i) <= best + slack);
        let pick = argmin_among(near, rng, |i| load_score(&cfg.weights, &c[i], fresh)).unwrap_or(0);
        let reason = match (fresh, c[pick].matched_tokens > 0) {
            (false, _) => "stale_signal_fallback",
            (true, true) => "prefix_hit",
            (true, false) => "shortest_queue",
        };
        Decision { pick, reason }
    }
}
