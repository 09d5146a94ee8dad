//! Policies on hand-built candidate sets, seeded RNGs, exact picks.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::*;

fn cand(index: usize, inflight: u64, signal: Option<(f64, f64, f64)>) -> Candidate {
    Candidate {
        index,
        inflight,
        signal: signal.map(|(waiting, running, kv_usage)| SignalView { waiting, running, kv_usage }),
    }
}

fn pick(cfg: &PolicyConfig, c: &[Candidate], seed: u64) -> Decision {
    cfg.build().select(&RouteInput { model: "m" }, c, &mut StdRng::seed_from_u64(seed))
}

fn least_load() -> PolicyConfig {
    PolicyConfig::LeastLoad { weights: LoadWeights::default() }
}

#[test]
fn least_load_avoids_the_engine_with_a_queue() {
    let c = [cand(0, 0, Some((12.0, 64.0, 0.9))), cand(1, 2, Some((0.0, 3.0, 0.1))), cand(2, 1, Some((0.0, 8.0, 0.2)))];
    // scores: 0 → 12 + 16 + 3.6 = 31.6; 1 → 0.75 + 0.4 + 2 = 3.15; 2 → 2 + 0.8 + 1 = 3.8
    assert_eq!(pick(&least_load(), &c, 1), Decision { index: 1, reason: "least_load" });
}

#[test]
fn inflight_counts_spread_a_burst_between_scrapes() {
    // Same scraped signal everywhere; the gateway already sent 3 to backend 0.
    let s = Some((0.0, 0.0, 0.0));
    let c = [cand(0, 3, s), cand(1, 0, s), cand(2, 1, s)];
    assert_eq!(pick(&least_load(), &c, 7).index, 1);
}

#[test]
fn one_stale_signal_makes_every_candidate_fall_back_to_inflight() {
    // Backend 0 looks idle by its scraped signal but it is stale for 1: compare in-flight only.
    let c = [cand(0, 5, Some((0.0, 0.0, 0.0))), cand(1, 2, None), cand(2, 4, Some((0.0, 0.0, 0.0)))];
    assert_eq!(pick(&least_load(), &c, 3), Decision { index: 1, reason: "stale_signal_fallback" });
    let p2c = PolicyConfig::PowerOfTwo { weights: LoadWeights::default() };
    let d = pick(&p2c, &c, 3);
    assert_eq!(d.reason, "stale_signal_fallback");
}

#[test]
fn ties_are_broken_at_random_but_reproducibly() {
    let c = [cand(0, 1, None), cand(1, 1, None), cand(2, 1, None)];
    let picks: Vec<_> = (0..12).map(|seed| pick(&PolicyConfig::LeastRequest, &c, seed).index).collect();
    let again: Vec<_> = (0..12).map(|seed| pick(&PolicyConfig::LeastRequest, &c, seed).index).collect();
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
    let picks: Vec<_> = (0..6).map(|_| p.select(&RouteInput::default(), &c, &mut rng).index).collect();
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
        assert_ne!(p.select(&RouteInput::default(), &c, &mut rng).index, 1);
    }
    let one = [cand(5, 9, None)];
    assert_eq!(p.select(&RouteInput::default(), &one, &mut rng), Decision { index: 5, reason: "single_candidate" });
}

#[test]
fn random_is_reproducible_with_a_seed() {
    let c = [cand(0, 0, None), cand(1, 0, None), cand(2, 0, None), cand(3, 0, None)];
    let a: Vec<_> = (0..8).map(|s| pick(&PolicyConfig::Random, &c, s).index).collect();
    let b: Vec<_> = (0..8).map(|s| pick(&PolicyConfig::Random, &c, s).index).collect();
    assert_eq!(a, b);
}
