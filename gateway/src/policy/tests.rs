//! Policies on hand-built candidate sets, seeded RNGs, exact picks.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::*;

fn cand(index: usize, inflight: u64, signal: Option<(f64, f64, f64)>) -> Candidate {
    Candidate {
        index,
        key: index as u64 * 7919,
        inflight,
        signal: signal.map(|(waiting, running, kv_usage)| SignalView { waiting, running, kv_usage }),
        ..Default::default()
    }
}

fn matched(mut c: Candidate, tokens: u64) -> Candidate {
    c.matched_tokens = tokens;
    c
}

fn pick_for(cfg: &PolicyConfig, input: &RouteInput<'_>, c: &[Candidate], seed: u64) -> Decision {
    cfg.build().select(input, c, &mut StdRng::seed_from_u64(seed))
}

fn prompt(tokens: u64) -> RouteInput<'static> {
    RouteInput { model: "m", prompt_tokens: tokens, session: None }
}

fn affinity() -> PolicyConfig {
    PolicyConfig::PrefixAffinity(affinity::AffinityConfig::default())
}

fn cost() -> PolicyConfig {
    PolicyConfig::Cost(cost::CostConfig::default())
}

fn pick(cfg: &PolicyConfig, c: &[Candidate], seed: u64) -> Decision {
    cfg.build().select(&RouteInput { model: "m", ..Default::default() }, c, &mut StdRng::seed_from_u64(seed))
}

fn least_load() -> PolicyConfig {
    PolicyConfig::LeastLoad { weights: LoadWeights::default() }
}

#[test]
fn least_load_avoids_the_engine_with_a_queue() {
    let c = [cand(0, 0, Some((12.0, 64.0, 0.9))), cand(1, 2, Some((0.0, 3.0, 0.1))), cand(2, 1, Some((0.0, 8.0, 0.2)))];
    // scores: 0 → 12 + 16 + 3.6 = 31.6; 1 → 0.75 + 0.4 + 2 = 3.15; 2 → 2 + 0.8 + 1 = 3.8
    assert_eq!(pick(&least_load(), &c, 1), Decision { pick: 1, reason: "least_load" });
}

#[test]
fn inflight_counts_spread_a_burst_between_scrapes() {
    // Same scraped signal everywhere; the gateway already sent 3 to backend 0.
    let s = Some((0.0, 0.0, 0.0));
    let c = [cand(0, 3, s), cand(1, 0, s), cand(2, 1, s)];
    assert_eq!(pick(&least_load(), &c, 7).pick, 1);
}

#[test]
fn one_stale_signal_makes_every_candidate_fall_back_to_inflight() {
    // Backend 0 looks idle by its scraped signal but it is stale for 1: compare in-flight only.
    let c = [cand(0, 5, Some((0.0, 0.0, 0.0))), cand(1, 2, None), cand(2, 4, Some((0.0, 0.0, 0.0)))];
    assert_eq!(pick(&least_load(), &c, 3), Decision { pick: 1, reason: "stale_signal_fallback" });
    let p2c = PolicyConfig::PowerOfTwo { weights: LoadWeights::default() };
    let d = pick(&p2c, &c, 3);
    assert_eq!(d.reason, "stale_signal_fallback");
}

#[test]
fn ties_are_broken_at_random_but_reproducibly() {
    let c = [cand(0, 1, None), cand(1, 1, None), cand(2, 1, None)];
    let picks: Vec<_> = (0..12).map(|seed| pick(&PolicyConfig::LeastRequest, &c, seed).pick).collect();
    let again: Vec<_> = (0..12).map(|seed| pick(&PolicyConfig::LeastRequest, &c, seed).pick).collect();
    assert_eq!(picks, again);
    for i in 0..3 {
        assert!(picks.contains(&i), "tie-break never picks {i}: {picks:?}");
    }
}

#[test]
fn round_robin_cycles_through_candidates() {
    let p = PolicyConfig::RoundRobin.build();
    let c = [cand(4, 0, None), cand(7, 0, None), cand(9, 0, None)];
    let mut rng = StdRng::seed_from_u64(0);
    let picks: Vec<_> = (0..6).map(|_| c[p.select(&RouteInput::default(), &c, &mut rng).pick].index).collect();
    assert_eq!(picks, vec![4, 7, 9, 4, 7, 9]);
}

#[test]
fn power_of_two_never_compares_a_backend_with_itself() {
    let p = PolicyConfig::PowerOfTwo { weights: LoadWeights::default() }.build();
    // Backend 1 is the worst; with two distinct draws it can never win.
    let s = |w| Some((w, 0.0, 0.0));
    let c = [cand(0, 0, s(1.0)), cand(1, 0, s(100.0)), cand(2, 0, s(2.0))];
    let mut rng = StdRng::seed_from_u64(42);
    for _ in 0..10_000 {
        assert_ne!(p.select(&RouteInput::default(), &c, &mut rng).pick, 1);
    }
    let one = [cand(5, 9, None)];
    assert_eq!(p.select(&RouteInput::default(), &one, &mut rng), Decision { pick: 0, reason: "single_candidate" });
}

#[test]
fn random_is_reproducible_with_a_seed() {
    let c = [cand(0, 0, None), cand(1, 0, None), cand(2, 0, None), cand(3, 0, None)];
    let a: Vec<_> = (0..8).map(|s| pick(&PolicyConfig::Random, &c, s).pick).collect();
    let b: Vec<_> = (0..8).map(|s| pick(&PolicyConfig::Random, &c, s).pick).collect();
    assert_eq!(a, b);
}

#[test]
fn prefix_affinity_longest_match_wins() {
    let idle = Some((0.0, 1.0, 0.1));
    let c = [matched(cand(0, 0, idle), 100), matched(cand(1, 1, idle), 900), matched(cand(2, 0, idle), 0)];
    assert_eq!(pick_for(&affinity(), &prompt(1000), &c, 1), Decision { pick: 1, reason: "prefix_match" });
    // Nothing matched (or too little): least load.
    let c = [matched(cand(0, 2, idle), 0), matched(cand(1, 0, idle), 50), matched(cand(2, 1, idle), 0)];
    assert_eq!(pick_for(&affinity(), &prompt(1000), &c, 1), Decision { pick: 1, reason: "low_match" });
}

#[test]
fn prefix_affinity_guard_diverts_from_an_overloaded_match() {
    // The match has 20 queued: load 20 + 2 + 0.5 + 3 = 25.5 vs 0.25 → diverted to least load.
    let c = [matched(cand(0, 3, Some((20.0, 8.0, 0.125))), 900), matched(cand(1, 0, Some((0.0, 1.0, 0.0))), 0)];
    assert_eq!(pick_for(&affinity(), &prompt(1000), &c, 1), Decision { pick: 1, reason: "guard_diverted" });
    // A modest queue (load 5.25 vs 0.25: within the absolute threshold 8) keeps the affinity.
    let c = [matched(cand(0, 1, Some((3.0, 5.0, 0.0))), 900), matched(cand(1, 0, Some((0.0, 1.0, 0.0))), 0)];
    assert_eq!(pick_for(&affinity(), &prompt(1000), &c, 1), Decision { pick: 0, reason: "prefix_match" });
}

#[test]
fn prefix_aware_policies_fall_back_consistently_on_stale_signals() {
    // Backend 0 looks idle by its (fresh) scrape but has 5 in flight; backend 1 is stale.
    let c = [cand(0, 5, Some((0.0, 0.0, 0.0))), cand(1, 1, None)];
    assert_eq!(pick_for(&affinity(), &prompt(1000), &c, 3), Decision { pick: 1, reason: "stale_signal_fallback" });
    // cost ignores every scraped queue and goes by its own pending tokens, then in-flight.
    let c = [cand(0, 5, Some((0.0, 0.0, 0.0))), cand(1, 1, None)];
    assert_eq!(pick_for(&cost(), &prompt(1000), &c, 3), Decision { pick: 1, reason: "stale_signal_fallback" });
}

#[test]
fn cost_prefers_a_short_queue_over_a_small_cache_hit() {
    // 0: 100 of 2,000 tokens cached but 8 queued (8·512 = 4,096 tokens ahead);
    // 1: nothing cached, empty. 10k tok/s: 0 → 600 ms, 1 → 200 ms.
    let c = [matched(cand(0, 0, Some((8.0, 4.0, 0.5))), 100), cand(1, 0, Some((0.0, 4.0, 0.5)))];
    assert_eq!(pick_for(&cost(), &prompt(2000), &c, 1), Decision { pick: 1, reason: "shortest_queue" });
}

#[test]
fn cost_prefers_a_big_cache_hit_over_a_short_queue() {
    // 0: 7,800 of 8,000 cached, one queued (512) → 71 ms; 1: empty, nothing cached → 800 ms.
    let c = [matched(cand(0, 0, Some((1.0, 4.0, 0.5))), 7800), cand(1, 0, Some((0.0, 4.0, 0.5)))];
    assert_eq!(pick_for(&cost(), &prompt(8000), &c, 1), Decision { pick: 0, reason: "prefix_hit" });
}

#[test]
fn cost_uses_pending_tokens_and_learned_rates() {
    // Between scrapes the gateway's own pending prefill counts: 0 has 6,000 tokens pending.
    let mut busy = cand(0, 3, Some((0.0, 0.0, 0.0)));
    busy.pending_prefill_tokens = 6000;
    let c = [busy, cand(1, 0, Some((0.0, 0.0, 0.0)))];
    assert_eq!(pick_for(&cost(), &prompt(1000), &c, 1).pick, 1);
    // A learned rate enters the prediction (clamped to 0.9–1.1× the mean).
    let mut fast = cand(0, 0, Some((1.0, 0.0, 0.0)));
    fast.prefill_tokens_per_s = 40_000.0;
    let cc = cost::CostConfig::default();
    let (f, d) = (
        cc.predicted_ttft_ms(&prompt(4000), &fast, true, 25_000.0),
        cc.predicted_ttft_ms(&prompt(4000), &cand(1, 0, Some((1.0, 0.0, 0.0))), true, 25_000.0),
    );
    assert!((f - 8000.0 / 40_000.0 * 1e3).abs() < 1e-9 && (d - 8000.0 / 25_000.0 * 1e3).abs() < 1e-9, "{f} {d}");
    // …but a low learned rate cannot price a backend out for good: 1,000 vs 100,000 tok/s
    // count as 45,450 vs 55,550: idle 88 ms beats 8 queued 648 ms.
    let mut starved = cand(0, 0, Some((0.0, 0.0, 0.0)));
    starved.prefill_tokens_per_s = 1_000.0;
    let mut quick = cand(1, 0, Some((8.0, 0.0, 0.0)));
    quick.prefill_tokens_per_s = 100_000.0;
    assert_eq!(pick_for(&cost(), &prompt(4000), &[starved, quick], 1).pick, 0);
    // A backend not learned yet is priced at the learned mean, not at the (low) prior: with
    // equal queues the two tie and the less loaded, unlearned one gets the request.
    let mut learned = cand(0, 2, Some((0.0, 0.0, 0.0)));
    learned.prefill_tokens_per_s = 40_000.0;
    let c = [learned, cand(1, 0, Some((0.0, 0.0, 0.0)))];
    assert_eq!(pick_for(&cost(), &prompt(4000), &c, 1).pick, 1);
    // A big running batch counts as queued work (8 · 0 + 200 · 64 = 12,800 tokens ahead).
    let c = [matched(cand(0, 0, Some((0.0, 200.0, 0.8))), 3000), cand(1, 0, Some((0.0, 2.0, 0.1)))];
    assert_eq!(pick_for(&cost(), &prompt(4000), &c, 1), Decision { pick: 1, reason: "shortest_queue" });
    // Equal predictions: the lower load wins.
    let c = [cand(0, 4, Some((0.0, 9.0, 0.9))), cand(1, 0, Some((0.0, 1.0, 0.1)))];
    assert_eq!(pick_for(&cost(), &prompt(100), &c, 1), Decision { pick: 1, reason: "shortest_queue" });
}

#[test]
fn session_is_sticky_and_bounded() {
    let cfg = PolicyConfig::Session(session::SessionConfig::default());
    let s = Some((0.0, 0.0, 0.0));
    let c = [cand(0, 0, s), cand(1, 0, s), cand(2, 0, s), cand(3, 0, s)];
    fn input(id: &str) -> RouteInput<'_> {
        RouteInput { model: "m", prompt_tokens: 0, session: Some(id) }
    }
    let home = pick_for(&cfg, &input("user-42"), &c, 1);
    assert_eq!(home.reason, "session_sticky");
    for seed in 0..20 {
        assert_eq!(pick_for(&cfg, &input("user-42"), &c, seed), home);
    }
    // Sessions spread over the backends.
    let homes: std::collections::HashSet<_> =
        (0..64).map(|i| pick_for(&cfg, &input(&format!("s{i}")), &c, 1).pick).collect();
    assert_eq!(homes.len(), 4);
    // The home backend holds far more than its share (cap = ceil(1.25·(8+1)/4) = 3): overflow.
    let mut c2 = c;
    c2[home.pick].inflight = 8;
    let d = pick_for(&cfg, &input("user-42"), &c2, 1);
    assert_ne!(d.pick, home.pick);
    assert_eq!(d.reason, "session_overflow");
    // Removing another backend does not move this session.
    let others: Vec<_> = c.iter().copied().filter(|x| x.index == home.pick || x.index != (home.pick + 1) % 4).collect();
    let moved = pick_for(&cfg, &input("user-42"), &others, 1).pick;
    assert_eq!(others[moved].index, home.pick);
    // No header: least load.
    let mut c3 = c;
    c3[0].inflight = 1;
    c3[1].inflight = 1;
    c3[3].inflight = 1;
    assert_eq!(pick_for(&cfg, &prompt(0), &c3, 1), Decision { pick: 2, reason: "no_session" });
}

#[test]
fn prefix_policy_configs_validate_their_knobs() {
    let bad =
        PolicyConfig::PrefixAffinity(affinity::AffinityConfig { balance_rel_threshold: 0.5, ..Default::default() });
    assert_eq!(bad.validate().unwrap_err().0, "balance_rel_threshold");
    let bad = PolicyConfig::Cost(cost::CostConfig { prefill_tokens_per_s: 0.0, ..Default::default() });
    assert_eq!(bad.validate().unwrap_err().0, "prefill_tokens_per_s");
    let bad = PolicyConfig::Session(session::SessionConfig { header: "x y".into(), ..Default::default() });
    assert_eq!(bad.validate().unwrap_err().0, "header");
    assert!(PolicyConfig::default().validate().is_ok());
    assert_eq!(PolicyConfig::default().build().name(), "cost");
}
