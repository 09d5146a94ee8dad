//! The engine core: one scheduler, one block pool, one backend, stepped by the caller.
//!
//! [`EngineCore::step`] plans a step, lets the backend compute it and applies the result.
//! It does no I/O and never sleeps: the runtime thread ([`crate::runtime`]) paces it in
//! wall-clock time, and the calibration harness steps it in virtual time.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::sim::SimBackend;
use crate::backend::Backend;
use crate::config::{BackendKind, EngineConfig};
use crate::kv::BlockPool;
use crate::scheduler::{Event, Scheduler};
use crate::tokenizer::{SimTokenizer, Tokenizer};

/// What one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    /// Tokens and completions to deliver.
    pub events: Vec<Event>,
    /// Modelled step time (sim backends).
    pub model_time: Option<Duration>,
    /// Tokens computed.
    pub num_batched_tokens: usize,
    /// Requests preempted while planning.
    pub num_preempted: usize,
}

/// Scheduler + backend.
pub struct EngineCore {
    /// The scheduler (queues, block pool, counters).
    pub scheduler: Scheduler,
    backend: Box<dyn Backend>,
}

impl EngineCore {
    /// Assemble a core.
    pub fn new(scheduler: Scheduler, backend: Box<dyn Backend>) -> Self {
        EngineCore { scheduler, backend }
    }

    /// Build the core and tokenizer a configuration asks for.
    pub fn from_config(cfg: &EngineConfig) -> (Self, Arc<dyn Tokenizer>) {
        let tokenizer: Arc<dyn Tokenizer> = Arc::new(SimTokenizer::new());
        let pool = BlockPool::new(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching);
        let scheduler = Scheduler::new(cfg.scheduler, pool, tokenizer.clone());
        let backend: Box<dyn Backend> = match cfg.backend {
            BackendKind::Sim => Box::new(SimBackend::new(cfg.sim_profile)),
        };
        (EngineCore::new(scheduler, backend), tokenizer)
    }

    /// Run one step; `None` when there is nothing to schedule.
    pub fn step(&mut self) -> Option<StepResult> {
        let plan = self.scheduler.schedule();
        if plan.is_empty() {
            return None;
        }
        let out = {
            let batch = self.scheduler.batch(&plan);
            self.backend.execute(&batch)
        };
        let events = self.scheduler.apply(&plan, &out.sampled);
        Some(StepResult {
            events,
            model_time: out.model_time,
            num_batched_tokens: plan.num_batched_tokens(),
            num_preempted: plan.preempted.len(),
        })
    }
}
