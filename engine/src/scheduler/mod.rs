//! Continuous-batching scheduler with chunked prefill and preemption by recompute.
//!
//! The scheduler is pure: it owns the waiting and running queues and, through the
//! [`KvCacheManager`], the KV blocks; it plans one step at a time and applies the step's
//! sampled tokens. It decides in token space only — `max_tokens`, the context length, EOS
//! and stop token ids; text and stop strings are the
//! [output processor's](crate::output_processor), which aborts a request here when a stop
//! string ends it. It has no clock, no channels and no threads; the runtime around it
//! ([`crate::runtime`]) does the I/O.
//!
//! ## One step ([`Scheduler::schedule`]), vLLM V1's unified policy
//! 1. **Running requests first**, oldest first. Each asks for the tokens it still has to
//!    compute: one for a decode, the rest of its prompt for a prefill cut short by the
//!    budget. Each takes at most what is left of `max_num_batched_tokens`.
//! 2. If a running request needs a new block and none is free, the **youngest** running
//!    request is preempted: its blocks are freed and it goes back to the front of the
//!    waiting queue, to be recomputed (prompt and generated tokens) later. If the youngest
//!    is the request itself, it is the one preempted.
//! 3. If nothing was preempted, **waiting requests** are admitted in arrival order while
//!    budget, `max_num_seqs` and free blocks allow. A newly admitted request first looks up
//!    its full blocks in the prefix cache (always leaving at least one token to compute, so
//!    there are logits to sample from); its prefill is **chunked** when the remaining budget
//!    is smaller than its uncached tokens. Admission is FCFS: the first request that does not
//!    fit stops admission.
//!
//! [`Scheduler::apply`] then advances every scheduled request, caches its newly full
//! blocks, appends sampled tokens, checks the token-space stop conditions and frees finished
//! requests.
//! Blocks are the manager's: the scheduler asks it for prefix hits
//! ([`KvCacheManager::get_computed_blocks`]), slots ([`KvCacheManager::allocate_slots`]) and
//! to cache and free blocks, and never touches reference counts or hashes.
//!
//! ## Knobs ([`SchedulerConfig`])
//! - `max_num_batched_tokens`: tokens computed per step (decodes + prefill chunks).
//! - `max_num_seqs`: requests running at once.
//! - `max_model_len`: a request ends (`length`) when prompt + output reaches it.

pub mod request;

use std::collections::{HashMap, VecDeque};

pub use request::{FinishReason, Request, RequestId, SamplingParams};

use crate::kv::{BlockPool, ComputedBlocks, KvCacheManager};
use crate::tokenizer::TokenId;

/// Scheduler limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Maximum running requests.
    pub max_num_seqs: usize,
    /// Maximum prompt + output length.
    pub max_model_len: usize,
}

/// One request's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// Which request.
    pub id: RequestId,
    /// Tokens already computed before this step (the position of the first new token).
    pub start: usize,
    /// Tokens to compute in this step.
    pub len: usize,
    /// Whether this step reaches the end of the known tokens, so a token is sampled.
    pub sample: bool,
}

/// The plan of one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Scheduled requests, running ones first.
    pub seqs: Vec<ScheduledSeq>,
    /// Requests preempted while planning.
    pub preempted: Vec<RequestId>,
}

impl StepPlan {
    /// Total tokens computed in the step.
    pub fn num_batched_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }

    /// True when nothing is scheduled.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// What a backend sees of one scheduled request.
#[derive(Debug, Clone, Copy)]
pub struct SeqView<'a> {
    /// The scheduling decision.
    pub sched: ScheduledSeq,
    /// All tokens known so far (prompt + output); the step computes `tokens[start..start+len]`.
    pub tokens: &'a [TokenId],
    /// Block table covering at least `start + len` tokens.
    pub block_table: &'a [crate::kv::BlockId],
    /// Sampling parameters.
    pub params: &'a SamplingParams,
    /// Tokens generated so far.
    pub num_output_tokens: usize,
    /// Whether EOS may be sampled now (`ignore_eos`, `min_tokens`).
    pub eos_allowed: bool,
    /// The only tokens its grammar allows now (structured output; see
    /// [`Scheduler::prepare_constraints`]). The grammar decides about EOS then.
    pub allowed: Option<&'a toktrie::SimpleVob>,
}

/// One token a backend generated for a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// Which request.
    pub id: RequestId,
    /// The token.
    pub token: TokenId,
    /// Its log probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// Log probabilities of one generated token under the model's raw distribution (before
/// penalties, temperature and filters, as vLLM reports them by default).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The generated token.
    pub token: TokenId,
    /// Its log probability.
    pub logprob: f32,
    /// The most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(TokenId, f32)>,
}

/// A request's new token after a step, in token space (the
/// [output processor](crate::output_processor) turns it into text).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    /// Which request.
    pub id: RequestId,
    /// The token.
    pub token: TokenId,
    /// Its log probabilities, when asked for.
    pub logprobs: Option<TokenLogprobs>,
    /// Set when the scheduler ended the request with this token — EOS or a stop token id
    /// (`Stop`), a completed grammar (`Stop`), `max_tokens` or the context length
    /// (`Length`); its blocks are free already.
    pub finished: Option<FinishReason>,
    /// The token is EOS or a stop token id that ended the request: not part of the text.
    pub stop_token: bool,
    /// A pooling request's embedding (the mean of its prompt's final hidden states), with
    /// which it ends.
    pub embedding: Option<Vec<f32>>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated so far, this one included.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at its (last) admission.
    pub cached_tokens: usize,
}

/// Monotonic counters kept by the scheduler (exported as vLLM metrics by the runtime).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Tokens found in the prefix cache.
    pub prefix_hits: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Prompt tokens of requests that produced their first token.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
}

/// The scheduler. See the module documentation.
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    eos: TokenId,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    stats: SchedulerStats,
}

impl Scheduler {
    /// A scheduler over `pool`, for a model whose end-of-sequence token is `eos`.
    pub fn new(cfg: SchedulerConfig, pool: BlockPool, eos: TokenId) -> Self {
        Scheduler {
            cfg,
            kv: KvCacheManager::new(pool),
            eos,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: SchedulerStats::default(),
        }
    }

    /// Queue a request. Its id must be new.
    pub fn add(&mut self, req: Request) {
        debug_assert!(!self.requests.contains_key(&req.id));
        self.waiting.push_back(req.id);
        self.requests.insert(req.id, req);
    }

    /// Remove a request wherever it is and free its blocks (the client went away, or the
    /// output processor saw a stop string). Returns whether it existed.
    pub fn abort(&mut self, id: RequestId) -> bool {
        if self.requests.remove(&id).is_none() {
            return false;
        }
        self.kv.free(id);
        self.kv.free_block_hashes(id);
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
        true
    }

    /// Requests waiting to be (re)admitted.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests holding KV blocks and being computed.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Record KV events from now on ([`crate::kv::events`]).
    pub fn enable_kv_events(&mut self) {
        self.kv.enable_events();
    }

    /// Forget the prefix cache (`POST /reset_prefix_cache`); refused while requests hold
    /// blocks (`Err` with how many).
    pub fn reset_prefix_cache(&mut self) -> Result<(), usize> {
        self.kv.reset_prefix_cache()
    }

    /// The KV events since the last call (empty unless enabled).
    pub fn take_kv_events(&mut self) -> Vec<crate::kv::KvEvent> {
        self.kv.take_events()
    }

    /// No request at all.
    pub fn is_idle(&self) -> bool {
        self.requests.is_empty()
    }

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        self.kv.pool()
    }

    /// KV waste: token slots allocated to running requests but not (yet) holding a computed
    /// token, over all slots of blocks in use (0..1). Only a request's last, partly filled
    /// block wastes slots; shared prefix blocks are full. PagedAttention's claim is that this
    /// stays near zero (vs 60–80% for contiguous pre-allocation).
    pub fn kv_waste(&self) -> f64 {
        let pool = self.kv.pool();
        let bs = pool.block_size();
        let in_use = (pool.num_blocks() - pool.num_free_blocks()) * bs;
        if in_use == 0 {
            return 0.0;
        }
        let unused: usize = self
            .running
            .iter()
            .filter_map(|id| self.requests.get(id))
            .map(|r| (self.kv.block_table(r.id).len() * bs).saturating_sub(r.num_computed_tokens))
            .sum();
        unused as f64 / in_use as f64
    }

    /// Counters so far.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// The limits.
    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }

    /// A request by id.
    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    /// Plan the next step (see the module documentation).
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_num_batched_tokens;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let req = &self.requests[&id];
            let n = (req.tokens.len() - req.num_computed_tokens).min(budget);
            let (start, total) = (req.num_computed_tokens, req.tokens.len());
            let mut scheduled_self = true;
            while self.kv.allocate_slots(id, start + n, &ComputedBlocks::default()).is_err() {
                let victim = *self.running.last().expect("running is not empty");
                self.preempt(victim);
                plan.preempted.push(victim);
                if victim == id {
                    scheduled_self = false;
                    break;
                }
            }
            if !scheduled_self {
                break;
            }
            plan.seqs.push(ScheduledSeq { id, start, len: n, sample: start + n == total });
            budget -= n;
            i += 1;
        }

        if plan.preempted.is_empty() {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.front() else { break };
                match self.admit(id, budget) {
                    Some(seq) => {
                        self.waiting.pop_front();
                        self.running.push(id);
                        budget -= seq.len;
                        plan.seqs.push(seq);
                    }
                    None => break,
                }
            }
        }
        plan
    }

    /// Try to start a waiting request within `budget` tokens.
    fn admit(&mut self, id: RequestId, budget: usize) -> Option<ScheduledSeq> {
        let req = self.requests.get_mut(&id).expect("waiting request exists");
        debug_assert_eq!(req.num_computed_tokens, 0);
        let total = req.tokens.len();
        // A pooling request needs every prompt token's hidden state: no cache hits.
        let hits = match req.params.pooling {
            true => ComputedBlocks::default(),
            false => self.kv.get_computed_blocks(id, &req.tokens),
        };
        let cached = hits.num_tokens;
        let n = (total - cached).min(budget);
        self.kv.allocate_slots(id, cached + n, &hits).ok()?;
        req.num_computed_tokens = cached;
        req.num_cached_tokens = cached;
        self.stats.prefix_queries += total as u64;
        self.stats.prefix_hits += cached as u64;
        Some(ScheduledSeq { id, start: cached, len: n, sample: cached + n == total })
    }

    fn preempt(&mut self, id: RequestId) {
        let req = self.requests.get_mut(&id).expect("preempted request exists");
        self.kv.free(id);
        req.num_computed_tokens = 0;
        req.num_preemptions += 1;
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        self.stats.preemptions += 1;
    }

    /// What the backend needs for `plan`, in plan order.
    pub fn batch<'a>(&'a self, plan: &StepPlan) -> Vec<SeqView<'a>> {
        plan.seqs
            .iter()
            .map(|s| {
                let r = &self.requests[&s.id];
                SeqView {
                    sched: *s,
                    tokens: &r.tokens,
                    block_table: self.kv.block_table(s.id),
                    params: &r.params,
                    num_output_tokens: r.num_output_tokens(),
                    eos_allowed: r.eos_allowed(),
                    allowed: r.constraint.as_ref().filter(|_| s.sample).and_then(|c| c.mask()),
                }
            })
            .collect()
    }

    /// Compute the allowed tokens of every constrained request that samples in `plan`
    /// (before [`Self::batch`]).
    pub fn prepare_constraints(&mut self, plan: &StepPlan) {
        for s in plan.seqs.iter().filter(|s| s.sample) {
            if let Some(c) = self.requests.get_mut(&s.id).and_then(|r| r.constraint.as_mut()) {
                c.prepare();
            }
        }
    }

    /// Apply a computed step: advance progress, cache full blocks, append `sampled`
    /// tokens (one per scheduled request with `sample`), finish what is done in token space.
    pub fn apply(
        &mut self,
        plan: &StepPlan,
        sampled: Vec<Sampled>,
        pooled: Vec<(RequestId, Vec<f32>)>,
    ) -> Vec<TokenOutput> {
        for s in &plan.seqs {
            let Some(req) = self.requests.get_mut(&s.id) else { continue };
            req.num_computed_tokens = s.start + s.len;
            self.kv.cache_full_blocks(s.id, &req.tokens, req.num_computed_tokens);
            if s.start == 0 {
                req.pool_sum.clear();
            }
        }
        for (id, sum) in pooled {
            let Some(req) = self.requests.get_mut(&id) else { continue };
            req.pool_sum.resize(sum.len(), 0.0);
            req.pool_sum.iter_mut().zip(&sum).for_each(|(a, b)| *a += b);
        }
        let mut outputs = Vec::with_capacity(sampled.len());
        for Sampled { id, token, logprobs } in sampled {
            let Some(req) = self.requests.get_mut(&id) else { continue };
            if req.num_output_tokens() == 0 {
                self.stats.prompt_tokens += req.num_prompt_tokens as u64;
            }
            if req.params.pooling {
                // Its prefill is done: the mean of the prompt's hidden states ends it.
                let n = req.num_prompt_tokens.max(1) as f32;
                let embedding = req.pool_sum.iter().map(|v| v / n).collect();
                let (prompt_tokens, cached_tokens) = (req.num_prompt_tokens, req.num_cached_tokens);
                self.requests.remove(&id);
                self.kv.free(id);
                self.kv.free_block_hashes(id);
                self.running.retain(|&r| r != id);
                outputs.push(TokenOutput {
                    id,
                    token,
                    logprobs: None,
                    finished: Some(FinishReason::Stop),
                    stop_token: true,
                    embedding: Some(embedding),
                    prompt_tokens,
                    completion_tokens: 0,
                    cached_tokens,
                });
                continue;
            }
            self.stats.generation_tokens += 1;
            let mut finished = req.append_token(token, self.eos, self.cfg.max_model_len);
            let stop_token = finished == Some(FinishReason::Stop);
            // A complete grammar ends the request, whatever `ignore_eos` says.
            if let Some(c) = req.constraint.as_mut().filter(|_| finished.is_none()) {
                if c.accept(token) {
                    finished = Some(FinishReason::Stop);
                }
            }
            let (prompt_tokens, completion_tokens) = (req.num_prompt_tokens, req.num_output_tokens());
            let cached_tokens = req.num_cached_tokens;
            if finished.is_some() {
                self.requests.remove(&id);
                self.kv.free(id);
                self.kv.free_block_hashes(id);
                self.running.retain(|&r| r != id);
            }
            outputs.push(TokenOutput {
                id,
                token,
                logprobs,
                finished,
                stop_token,
                embedding: None,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            });
        }
        outputs
    }
}

#[cfg(test)]
mod tests;
