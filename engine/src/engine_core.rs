//! The engine core: one scheduler, one block pool, one backend, stepped by the caller.
//!
//! [`EngineCore::step`] plans a step, lets the backend compute it and applies the result.
//! It does no I/O and never sleeps: the runtime thread ([`crate::runtime`]) paces it in
//! wall-clock time, and the calibration harness steps it in virtual time.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::cpu::{self, CpuBackend};
use crate::backend::sim::SimBackend;
use crate::backend::{Backend, BackendFailure};
use crate::config::{BackendKind, EngineConfig};
use crate::kv::BlockPool;
use crate::model::llama::KvStore;
use crate::scheduler::{Scheduler, TokenOutput};
use crate::tokenizer::{LoadedTokenizer, SimTokenizer, Tokenizer};

/// What one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    /// New tokens, and the requests that ended in token space (for the output processor).
    pub outputs: Vec<TokenOutput>,
    /// Modelled step time (sim backends).
    pub model_time: Option<Duration>,
    /// Tokens computed.
    pub num_batched_tokens: usize,
    /// Requests preempted while planning.
    pub num_preempted: usize,
    /// What the step changed in the prefix cache (empty unless KV events are on).
    pub kv_events: Vec<crate::kv::KvEvent>,
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

    /// Build the core and tokenizer a configuration asks for, loading the model file for the
    /// `cpu` backend. Returns the configuration completed with what the model decides (its
    /// context length; the KV blocks that `--kv-cache-space` holds).
    pub fn load(cfg: &EngineConfig) -> anyhow::Result<(EngineConfig, Self, Arc<dyn Tokenizer>)> {
        let mut cfg = cfg.clone();
        let (tokenizer, backend): (Arc<dyn Tokenizer>, Box<dyn Backend>) = match cfg.backend {
            BackendKind::Sim => match &cfg.tokenizer_path {
                None => (Arc::new(SimTokenizer::new()), Box::new(SimBackend::new(cfg.sim_profile))),
                Some(path) => {
                    let tokenizer = switchyard_tokenizer::load(path)
                        .map_err(|e| anyhow::anyhow!("--tokenizer {}: {e}", path.display()))?;
                    let tokenizer = LoadedTokenizer::new(tokenizer);
                    let backend = SimBackend::with_tokenizer(cfg.sim_profile, &tokenizer);
                    (Arc::new(tokenizer), Box::new(backend))
                }
            },
            BackendKind::Cpu => load_cpu(&mut cfg)?,
        };
        Ok(Self::assemble(cfg, tokenizer, backend))
    }

    /// The block pool and scheduler `cfg` describes, over `backend`.
    fn assemble(
        cfg: EngineConfig,
        tokenizer: Arc<dyn Tokenizer>,
        backend: Box<dyn Backend>,
    ) -> (EngineConfig, Self, Arc<dyn Tokenizer>) {
        let pool = BlockPool::new(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching);
        let scheduler = Scheduler::new(cfg.scheduler, pool, tokenizer.eos_token_id());
        (cfg, EngineCore::new(scheduler, backend), tokenizer)
    }

    /// Run one step; `None` when there is nothing to schedule. An error means the backend
    /// cannot continue (the step is lost).
    pub fn step(&mut self) -> Result<Option<StepResult>, BackendFailure> {
        let plan = self.scheduler.schedule();
        if plan.is_empty() {
            return Ok(None);
        }
        self.scheduler.prepare_constraints(&plan);
        let out = {
            let batch = self.scheduler.batch(&plan);
            self.backend.execute(&batch)?
        };
        let outputs = self.scheduler.apply(&plan, out.sampled, out.pooled);
        Ok(Some(StepResult {
            outputs,
            model_time: out.model_time,
            num_batched_tokens: plan.num_batched_tokens(),
            num_preempted: plan.preempted.len(),
            kv_events: self.scheduler.take_kv_events(),
        }))
    }
}

/// Load the `cpu` backend's model file and complete `cfg` with what the model decides: the
/// context length when none was given, the KV blocks that `--kv-cache-space` holds.
fn load_cpu(cfg: &mut EngineConfig) -> anyhow::Result<(Arc<dyn Tokenizer>, Box<dyn Backend>)> {
    if !cfg.model_path.exists() && cfg.model_path == crate::model::default_model_path() {
        anyhow::bail!(
            "model file {} is missing: run `{}` to fetch it",
            cfg.model_path.display(),
            crate::model::FETCH_COMMAND
        );
    }
    let loaded = cpu::load(&cfg.model_path)?;
    let mc = &loaded.model.cfg;
    if cfg.scheduler.max_model_len == 0 {
        cfg.scheduler.max_model_len = mc.max_ctx;
    }
    if cfg.scheduler.max_model_len > mc.max_ctx {
        anyhow::bail!(
            "--max-model-len: {} exceeds the model's context length {}",
            cfg.scheduler.max_model_len,
            mc.max_ctx
        );
    }
    if cfg.num_blocks == 0 {
        let per_block = KvStore::bytes_per_token(mc) * cfg.block_size;
        cfg.num_blocks = cfg.kv_cache_bytes / per_block;
        if cfg.num_blocks == 0 {
            anyhow::bail!("--kv-cache-space: too small for one block of {per_block} bytes");
        }
    }
    let eos = loaded.tokenizer.eos_token_id();
    let (tp, blocks, block_size, threads) = (cfg.tensor_parallel_size, cfg.num_blocks, cfg.block_size, cfg.threads);
    let tokenizer: Arc<dyn Tokenizer> = Arc::new(LoadedTokenizer::new(loaded.tokenizer));
    #[cfg(feature = "fault-injection")]
    if let (Some(rank), true) = (crate::backend::tp_group::fail_rank_from_env(), tp > 1) {
        let backend = CpuBackend::with_failing_rank(loaded.model, eos, blocks, block_size, threads, tp, rank)?;
        return Ok((tokenizer, Box::new(backend)));
    }
    let backend = CpuBackend::new(loaded.model, eos, blocks, block_size, threads, tp)?;
    Ok((tokenizer, Box::new(backend)))
}
