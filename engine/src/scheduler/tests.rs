//! Scheduler planning tests on hand-built states with exact expected plans.

use super::*;
use crate::kv::BlockPool;
use crate::tokenizer::SimTokenizer;

fn sched(num_blocks: usize, budget: usize, max_seqs: usize) -> Scheduler {
    let cfg = SchedulerConfig { max_num_batched_tokens: budget, max_num_seqs: max_seqs, max_model_len: 10_000 };
    Scheduler::new(cfg, BlockPool::new(num_blocks, 4, true), SimTokenizer::EOS)
}

fn req(id: RequestId, prompt_len: usize, max_tokens: usize) -> Request {
    let prompt = (0..prompt_len as u32).map(|t| 100_000 + t + id as u32 * 1000).collect();
    Request::new(id, prompt, SamplingParams { max_tokens, ignore_eos: true, ..Default::default() })
}

/// Sample a word for every sampling sequence of the plan.
fn run_step(s: &mut Scheduler) -> (StepPlan, Vec<TokenOutput>) {
    let plan = s.schedule();
    let sampled =
        plan.seqs.iter().filter(|q| q.sample).map(|q| Sampled { id: q.id, token: 5, logprobs: None }).collect();
    let events = s.apply(&plan, sampled, Vec::new());
    (plan, events)
}

fn seq(id: RequestId, start: usize, len: usize, sample: bool) -> ScheduledSeq {
    ScheduledSeq { id, start, len, sample }
}

#[test]
fn decodes_go_first_then_prefills_fill_the_budget_in_chunks() {
    let mut s = sched(100, 10, 8);
    s.add(req(1, 3, 5));
    let (p, _) = run_step(&mut s);
    assert_eq!(p.seqs, vec![seq(1, 0, 3, true)]);
    s.add(req(2, 20, 5));
    let (p, _) = run_step(&mut s);
    // request 1 decodes one token, request 2 gets the remaining 9 as a chunk
    assert_eq!(p.seqs, vec![seq(1, 3, 1, true), seq(2, 0, 9, false)]);
    let (p, _) = run_step(&mut s);
    assert_eq!(p.seqs, vec![seq(1, 4, 1, true), seq(2, 9, 9, false)]);
    let (p, _) = run_step(&mut s);
    assert_eq!(p.seqs, vec![seq(1, 5, 1, true), seq(2, 18, 2, true)]);
}

#[test]
fn max_num_seqs_caps_the_running_set() {
    let mut s = sched(100, 100, 2);
    for id in 1..=3 {
        s.add(req(id, 2, 5));
    }
    let (p, _) = run_step(&mut s);
    assert_eq!(p.seqs.iter().map(|q| q.id).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
}

#[test]
fn the_youngest_running_request_is_preempted_and_recomputed() {
    // 4 blocks of 4 tokens. Two requests of 7 prompt tokens take 2 blocks each.
    let mut s = sched(4, 100, 8);
    s.add(req(1, 7, 10));
    s.add(req(2, 7, 10));
    let (p, _) = run_step(&mut s);
    assert_eq!(p.seqs, vec![seq(1, 0, 7, true), seq(2, 0, 7, true)]);
    assert_eq!(s.pool().num_free_blocks(), 0);
    // Token 8 of each still fits in the second block.
    let (p, _) = run_step(&mut s);
    assert_eq!(p.seqs, vec![seq(1, 7, 1, true), seq(2, 7, 1, true)]);
    // Token 9 needs a third block: 2 (the youngest) is preempted.
    let (p, _) = run_step(&mut s);
    assert_eq!(p.preempted, vec![2]);
    assert_eq!(p.seqs, vec![seq(1, 8, 1, true)]);
    assert_eq!(s.stats().preemptions, 1);
    assert_eq!(s.request(2).unwrap().num_computed_tokens, 0);
    // 2 waits at the head of the queue and is recomputed (prompt + its 2 outputs) later.
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn a_request_preempts_itself_when_it_is_the_youngest() {
    let mut s = sched(2, 100, 8);
    s.add(req(1, 8, 10));
    let (p, _) = run_step(&mut s);
    assert_eq!(p.seqs, vec![seq(1, 0, 8, true)]);
    let (p, _) = run_step(&mut s);
    assert_eq!(p.preempted, vec![1]);
    assert!(p.seqs.is_empty());
}

#[test]
fn prefix_cache_hits_skip_full_blocks_but_never_the_last_token() {
    let mut s = sched(100, 100, 8);
    let shared: Vec<u32> = (0..8).map(|t| 200_000 + t).collect();
    let params = SamplingParams { max_tokens: 1, ignore_eos: true, ..Default::default() };
    s.add(Request::new(1, shared.clone(), params.clone()));
    let (_, ev) = run_step(&mut s);
    assert!(matches!(ev[0], TokenOutput { finished: Some(_), cached_tokens: 0, .. }));
    // Same 8 tokens: only the first block can be reused (the last token must be computed).
    s.add(Request::new(2, shared.clone(), params.clone()));
    let (p, ev) = run_step(&mut s);
    assert_eq!(p.seqs, vec![seq(2, 4, 4, true)]);
    assert!(matches!(ev[0], TokenOutput { finished: Some(_), cached_tokens: 4, .. }));
    // 8 shared tokens + 3 more: both full blocks hit.
    let mut longer = shared.clone();
    longer.extend([7, 8, 9]);
    s.add(Request::new(3, longer, params));
    let (p, _) = run_step(&mut s);
    assert_eq!(p.seqs, vec![seq(3, 8, 3, true)]);
    assert_eq!(s.stats().prefix_hits, 12);
    assert_eq!(s.stats().prefix_queries, 8 + 8 + 11);
}

#[test]
fn abort_frees_blocks_wherever_the_request_is() {
    let mut s = sched(10, 100, 8);
    s.add(req(1, 9, 10));
    s.add(req(2, 5, 10));
    run_step(&mut s);
    s.add(req(3, 5, 10));
    assert!(s.abort(1));
    assert!(s.abort(3));
    assert!(!s.abort(3));
    assert_eq!(s.pool().num_free_blocks(), 10 - 2);
    assert!(s.abort(2));
    assert_eq!(s.pool().num_free_blocks(), 10);
    assert!(s.is_idle());
    s.pool().check_invariants().unwrap();
}

#[test]
fn every_request_completes_with_exactly_its_tokens_under_pressure() {
    let mut s = sched(12, 16, 8);
    for id in 1..=10 {
        s.add(req(id, 5 + id as usize, 12));
    }
    let mut done = std::collections::HashMap::new();
    let mut steps = 0;
    while !s.is_idle() {
        let (_, events) = run_step(&mut s);
        for e in events {
            if let TokenOutput { id, completion_tokens, finished: Some(reason), .. } = e {
                assert_eq!(reason, FinishReason::Length);
                done.insert(id, completion_tokens);
            }
        }
        s.pool().check_invariants().unwrap();
        steps += 1;
        assert!(steps < 10_000, "no progress");
    }
    assert_eq!(done.len(), 10);
    assert!(done.values().all(|&n| n == 12));
    assert!(s.stats().preemptions > 0, "the cache is small enough to force preemption");
    assert_eq!(s.pool().num_free_blocks(), 12);
}

#[test]
fn kv_waste_stays_under_4_percent_with_a_mixed_workload() {
    // Block size 16 (vLLM's default), prompts of 50..1,500 tokens, outputs of 1..400.
    let cfg = SchedulerConfig { max_num_batched_tokens: 2048, max_num_seqs: 64, max_model_len: 4096 };
    let mut s = Scheduler::new(cfg, BlockPool::new(8000, 16, true), SimTokenizer::EOS);
    let mut rng = 12345u64;
    let mut next = |m: u64| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (rng >> 33) % m
    };
    let mut samples = Vec::new();
    for id in 0..400u64 {
        s.add(req(id, 50 + next(1450) as usize, 1 + next(400) as usize));
        for _ in 0..4 {
            run_step(&mut s);
            if s.num_running() >= 16 {
                samples.push(s.kv_waste());
            }
        }
    }
    assert!(samples.len() > 500, "the workload keeps at least 16 requests running");
    let max = samples.iter().cloned().fold(0.0, f64::max);
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    assert!(max <= 0.04, "waste peaked at {:.2}% (mean {:.2}%)", max * 100.0, mean * 100.0);
    assert!(mean > 0.0, "the last blocks are partly filled");
}
