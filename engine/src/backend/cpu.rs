//! The `cpu` backend: a real Llama model computed on the host CPU.
//!
//! Each step hands every scheduled sequence (prefill chunks and decodes) to
//! [`Llama::forward`] as one batch on the backend's own rayon pool, then samples one token
//! for each sequence whose step reached the end of its known tokens. K/V live in a
//! [`KvStore`] indexed by the block pool's block ids, so the scheduler's prefix cache and
//! preemption apply to real tensors unchanged.
//!
//! Sampling is [`crate::sampling`]'s (pure and seeded); K/V live in [`kv_store`].

use std::path::Path;

use super::tp_group::{GroupError, TpGroup};
use super::{Backend, BackendFailure, StepOutput};
use crate::model::gguf::GgufFile;
pub mod kv_store;

pub use kv_store::KvStore;

use crate::model::llama::{Llama, ModelError, SeqInput};
pub use crate::sampling::argmax;
use crate::sampling::{logprobs, penalize, sample};
use crate::scheduler::{Sampled, SeqView};
use crate::tokenizer::TokenId;
use switchyard_tokenizer::{ModelTokenizer, TokenizerError};

/// Why the model cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The weights.
    #[error("{path}: {source}")]
    Model {
        /// The file.
        path: String,
        /// What is wrong.
        source: ModelError,
    },
    /// The tokenizer.
    #[error("{path}: {source}")]
    Tokenizer {
        /// The file.
        path: String,
        /// What is wrong.
        source: TokenizerError,
    },
    /// An HF checkpoint directory.
    #[error("{path}: {source}")]
    Hf {
        /// The directory.
        path: String,
        /// What is wrong.
        source: crate::model::hf::HfError,
    },
    /// The thread pool.
    #[error("thread pool: {0}")]
    Threads(String),
    /// Tensor parallelism.
    #[error(transparent)]
    Tp(#[from] GroupError),
}

/// A model file loaded: weights and tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    /// Weights.
    pub model: Llama,
    /// Tokenizer and chat template.
    pub tokenizer: ModelTokenizer,
}

/// Load a model: a GGUF file, or an HF checkpoint directory.
pub fn load(path: &Path) -> Result<LoadedModel, LoadError> {
    let p = path.display().to_string();
    if path.is_dir() {
        let (model, tokenizer) = crate::model::hf::load(path).map_err(|source| LoadError::Hf { path: p, source })?;
        return Ok(LoadedModel { model, tokenizer });
    }
    let file = GgufFile::open(path).map_err(|e| LoadError::Model { path: p.clone(), source: e.into() })?;
    let model = Llama::from_gguf(&file).map_err(|source| LoadError::Model { path: p.clone(), source })?;
    let tokenizer =
        ModelTokenizer::from_gguf(&file.header).map_err(|source| LoadError::Tokenizer { path: p, source })?;
    Ok(LoadedModel { model, tokenizer })
}

/// The cpu executor.
pub struct CpuBackend {
    exec: Executor,
    eos: TokenId,
}

/// Where the logits are computed.
enum Executor {
    /// The whole model on one rayon pool.
    Single { model: Box<Llama>, kv: KvStore, pool: rayon::ThreadPool },
    /// A tensor-parallel group of rank threads.
    Group(TpGroup),
}

impl CpuBackend {
    /// A backend over `model` with K/V room for `num_blocks` blocks of `block_size` tokens,
    /// computing on `threads` threads, with `tp` tensor-parallel ranks (1: none).
    pub fn new(
        model: Llama,
        eos: TokenId,
        num_blocks: usize,
        block_size: usize,
        threads: usize,
        tp: usize,
    ) -> Result<Self, LoadError> {
        if tp > 1 {
            let group = TpGroup::spawn(&model, tp, threads, num_blocks, block_size)?;
            return Ok(Self { exec: Executor::Group(group), eos });
        }
        Self::single(model, eos, num_blocks, block_size, threads)
    }

    /// [`Self::new`] with `tp` > 1 ranks of which `fail_rank` panics at its first step
    /// (reliability tests; feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    pub fn with_failing_rank(
        model: Llama,
        eos: TokenId,
        num_blocks: usize,
        block_size: usize,
        threads: usize,
        tp: usize,
        fail_rank: usize,
    ) -> Result<Self, LoadError> {
        let group = TpGroup::spawn_with_failing_rank(&model, tp, threads, num_blocks, block_size, fail_rank)?;
        Ok(Self { exec: Executor::Group(group), eos })
    }

    fn single(
        model: Llama,
        eos: TokenId,
        num_blocks: usize,
        block_size: usize,
        threads: usize,
    ) -> Result<Self, LoadError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cpu-backend-{i}"))
            .build()
            .map_err(|e| LoadError::Threads(e.to_string()))?;
        let kv = KvStore::new(&model.cfg, num_blocks, block_size);
        Ok(Self { exec: Executor::Single { model: Box::new(model), kv, pool }, eos })
    }
}

impl Backend for CpuBackend {
    fn execute(&mut self, batch: &[SeqView<'_>]) -> Result<StepOutput, BackendFailure> {
        let inputs: Vec<SeqInput<'_>> = batch
            .iter()
            .map(|s| SeqInput {
                tokens: &s.tokens[s.sched.start..s.sched.start + s.sched.len],
                start: s.sched.start,
                block_table: s.block_table,
                logits: s.sched.sample && !s.params.pooling,
                pool: s.params.pooling,
            })
            .collect();
        let result = match &mut self.exec {
            Executor::Single { model, kv, pool } => pool.install(|| model.forward(kv, &inputs)),
            // A failed rank takes the group down: fatal for the engine.
            Executor::Group(group) => Ok(group.forward(&inputs).map_err(|e| BackendFailure(e.to_string()))?),
        };
        let rows = match result {
            Ok(rows) => rows,
            // The server validates token ids and the scheduler sizes block tables, so this is
            // a bug; end the affected requests rather than the engine.
            Err(e) => {
                tracing::error!(error = %e, "cpu backend step failed; ending its requests");
                let sampled = batch
                    .iter()
                    .filter(|s| s.sched.sample)
                    .map(|s| Sampled { id: s.sched.id, token: self.eos, logprobs: None })
                    .collect();
                return Ok(StepOutput { sampled, pooled: Vec::new(), model_time: None });
            }
        };
        // One row per pooling sequence (its hidden-state sum) and per sampling one (logits).
        let mut rows = rows.into_iter();
        let (mut sampled, mut pooled) = (Vec::new(), Vec::new());
        for s in batch {
            if s.params.pooling {
                pooled.extend(rows.next().map(|sum| (s.sched.id, sum)));
                if s.sched.sample {
                    sampled.push(Sampled { id: s.sched.id, token: self.eos, logprobs: None });
                }
                continue;
            }
            if !s.sched.sample {
                continue;
            }
            let Some(mut l) = rows.next() else { break };
            // Log probabilities come from the raw distribution, so keep it when asked.
            let raw = s.params.logprobs.map(|n| (l.clone(), n));
            match s.allowed {
                // The grammar decides which tokens, EOS included, may come next.
                Some(mask) => crate::structured::apply_mask(mask, &mut l),
                None => {
                    if let (false, Some(e)) = (s.eos_allowed, l.get_mut(self.eos as usize)) {
                        *e = f32::NEG_INFINITY;
                    }
                }
            }
            let output = &s.tokens[s.tokens.len().saturating_sub(s.num_output_tokens)..];
            penalize(&mut l, s.params, s.tokens, output);
            let token = sample(&mut l, s.params, s.num_output_tokens);
            let logprobs = raw.map(|(raw, n)| logprobs(&raw, token, n));
            sampled.push(Sampled { id: s.sched.id, token, logprobs });
        }
        Ok(StepOutput { sampled, pooled, model_time: None })
    }
}
