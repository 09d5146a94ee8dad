//! Sampling: logits → token, pure and seeded.
//!
//! [`penalize`] applies vLLM's repetition, presence and frequency penalties; [`sample`] is
//! greedy at temperature 0 (or top-k 1), otherwise temperature → top-k → min-p → top-p over
//! a softmax, drawn from an RNG seeded by the request's seed and the index of the token being
//! generated — the same request with the same seed gives the same text whatever else shares
//! its batches. [`logprobs`] reports the raw distribution's log probabilities.

use rand::{Rng, SeedableRng};

use crate::scheduler::{SamplingParams, TokenLogprobs};
use crate::tokenizer::TokenId;

/// Apply vLLM's penalties to `logits`: repetition over every token seen (`seen`: prompt +
/// output), presence and frequency over the generated `output`.
pub fn penalize(logits: &mut [f32], p: &SamplingParams, seen: &[TokenId], output: &[TokenId]) {
    if p.repetition_penalty != 1.0 {
        let mut done = std::collections::HashSet::new();
        for &t in seen {
            if let Some(l) = logits.get_mut(t as usize) {
                if done.insert(t) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts = std::collections::HashMap::new();
        for &t in output {
            *counts.entry(t).or_insert(0u32) += 1;
        }
        for (t, n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * n as f32;
            }
        }
    }
}

/// Pick the next token from `logits` (modified in place) under `p`; `index` is how many
/// tokens the request has generated so far (it seeds the draw).
pub fn sample(logits: &mut [f32], p: &SamplingParams, index: usize) -> TokenId {
    if p.temperature <= 0.0 || p.top_k == 1 {
        return argmax(logits);
    }
    let inv_t = 1.0 / p.temperature;
    let mut cand: Vec<(TokenId, f32)> =
        logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (i as TokenId, l * inv_t)).collect();
    if cand.is_empty() {
        return argmax(logits);
    }
    // Highest first, ties by lower id — only as far as the filters need: top-k selects its k
    // first; top-p and min-p need the order; plain sampling needs none (id order).
    let by_logit = |a: &(TokenId, f32), b: &(TokenId, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.top_k > 0 && (p.top_k as usize) < cand.len() {
        cand.select_nth_unstable_by(p.top_k as usize - 1, by_logit);
        cand.truncate(p.top_k as usize);
    }
    if p.top_p < 1.0 || p.min_p > 0.0 || p.top_k > 0 {
        cand.sort_unstable_by(by_logit);
    }
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0.0f64;
    for c in cand.iter_mut() {
        c.1 = (c.1 - max).exp();
        total += f64::from(c.1);
    }
    if p.min_p > 0.0 {
        // Probabilities relative to the most likely token are exp(l - max) = c.1 here.
        let keep = cand.iter().position(|c| c.1 < p.min_p).unwrap_or(cand.len()).max(1);
        cand.truncate(keep);
        total = cand.iter().map(|c| f64::from(c.1)).sum();
    }
    if p.top_p < 1.0 {
        let mut acc = 0.0f64;
        let keep = cand
            .iter()
            .position(|c| {
                acc += f64::from(c.1) / total;
                acc >= f64::from(p.top_p)
            })
            .map_or(cand.len(), |i| i + 1);
        cand.truncate(keep);
        total = cand.iter().map(|c| f64::from(c.1)).sum();
    }
    let seed = p.seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut u = rng.random::<f64>() * total;
    for c in &cand {
        u -= f64::from(c.1);
        if u <= 0.0 {
            return c.0;
        }
    }
    cand[cand.len() - 1].0
}

/// `token`'s log probability under `logits` and the `n` most likely tokens' (most likely
/// first, lower id first among ties), from a log-softmax computed in f64.
pub fn logprobs(logits: &[f32], token: TokenId, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_z = f64::from(max) + sum.ln();
    let lp = |l: f32| (f64::from(l) - log_z) as f32;
    let mut top: Vec<(TokenId, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as TokenId, l)).collect();
    let by_logit = |a: &(TokenId, f32), b: &(TokenId, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let n = n.min(top.len());
    if n > 0 && n < top.len() {
        top.select_nth_unstable_by(n - 1, by_logit);
    }
    top.truncate(n);
    top.sort_unstable_by(by_logit);
    let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| lp(l));
    TokenLogprobs { token, logprob, top: top.into_iter().map(|(t, l)| (t, lp(l))).collect() }
}

/// Index of the largest logit (lowest index among ties).
pub fn argmax(logits: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as TokenId
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: i32, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, seed, ..SamplingParams::default() }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut l = vec![0.1, 3.0, -1.0, 3.0];
        assert_eq!(sample(&mut l, &params(0.0, 0, 1.0, 0), 0), 1);
        let mut l = vec![0.1, 3.0, -1.0, 3.0];
        assert_eq!(sample(&mut l, &params(0.7, 1, 1.0, 0), 0), 1, "top_k 1 is greedy");
    }

    #[test]
    fn the_same_seed_and_index_give_the_same_token() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let draw = |seed, index| sample(&mut logits.clone(), &params(1.0, 0, 1.0, seed), index);
        for index in 0..20 {
            assert_eq!(draw(42, index), draw(42, index));
        }
        let a: Vec<_> = (0..20).map(|i| draw(42, i)).collect();
        let b: Vec<_> = (0..20).map(|i| draw(43, i)).collect();
        assert_ne!(a, b, "different seeds differ somewhere in 20 draws");
    }

    #[test]
    fn penalties_follow_vllm() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::default()
        };
        let mut l = vec![4.0, -4.0, 1.0, 1.0];
        // Token 0 in the prompt only, token 1 generated twice, token 2 once.
        penalize(&mut l, &p, &[0, 3, 1, 2, 1], &[1, 2, 1]);
        assert_eq!(l, vec![2.0, -8.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, 0.5]);
        // Greedy sees the penalties too.
        let mut l = vec![3.0, 2.9];
        penalize(&mut l, &SamplingParams { presence_penalty: 1.0, ..SamplingParams::default() }, &[0], &[0]);
        assert_eq!(sample(&mut l, &params(0.0, 0, 1.0, 0), 1), 1);
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_tokens_first() {
        let logits = vec![1.0f32, 3.0, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let want = |l: f32| (f64::from(l) - z.ln()) as f32;
        let lp = logprobs(&logits, 2, 3);
        assert_eq!(lp.token, 2);
        assert!((lp.logprob - want(2.0)).abs() < 1e-6);
        let ids: Vec<_> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2], "most likely first, lower id first among ties");
        for (t, l) in &lp.top {
            assert!((l - want(logits[*t as usize])).abs() < 1e-6);
        }
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(logprobs(&logits, 0, 99).top.len(), logits.len());
        // Large logits do not overflow.
        let lp = logprobs(&[1000.0, 1000.0], 0, 1);
        assert!((lp.logprob - (-std::f32::consts::LN_2)).abs() < 1e-6);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = vec![2.0, 1.9, -3.0, -4.0];
        let mut p = params(1.0, 0, 1.0, 0);
        p.min_p = 0.5;
        for seed in 0..200 {
            p.seed = seed;
            assert!(sample(&mut logits.clone(), &p, 0) <= 1);
        }
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let logits = vec![5.0, 4.9, 0.0, -1.0, -2.0];
        for seed in 0..200 {
            let t = sample(&mut logits.clone(), &params(1.0, 2, 1.0, seed), 0);
            assert!(t <= 1, "top_k 2 keeps ids 0 and 1, drew {t}");
            let t = sample(&mut logits.clone(), &params(1.0, 0, 0.5, seed), 0);
            assert_eq!(t, 0, "top_p 0.5 keeps only the most likely token");
        }
        // Disallowed tokens (−∞) are never drawn.
        let mut l = vec![f32::NEG_INFINITY, 0.0, 0.0];
        for seed in 0..50 {
            assert_ne!(sample(&mut l, &params(1.5, 0, 1.0, seed), 3), 0);
        }
    }
}
