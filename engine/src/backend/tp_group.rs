//! A tensor-parallel group on the host: one thread per rank, each owning its weight shard,
//! its K/V heads' cache and a rayon pool of its share of the threads.
//!
//! [`TpGroup::forward`] hands the same step to every rank; the ranks meet in the
//! [`ShmCommunicator`]'s collectives and rank 0 returns the logits. A rank that fails —
//! panics, or returns an error, which could leave the others waiting in a collective —
//! poisons the communicator, so every rank finishes the step with an error and the group
//! reports [`GroupError`]: the step and the group are lost, nothing hangs. The engine then
//! reports unhealthy and exits non-zero ([`crate::runtime`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use crate::kv::BlockId;
use crate::model::llama::{Llama, SeqInput};
use crate::model::tp::{CommError, Communicator, ShmCommunicator, TpPlan, TpShapeError};
use crate::tokenizer::TokenId;

/// The environment variable that makes a rank panic at its first step (the value is the
/// rank): a fault-injection hook for the reliability tests, compiled only with the cargo
/// feature `fault-injection` (which this crate's own tests turn on through a dev-dependency
/// on itself). A release build has neither the variable nor the failing rank.
#[cfg(any(test, feature = "fault-injection"))]
pub const FAIL_RANK_ENV: &str = "SWITCHYARD_TP_FAIL_RANK";

/// The rank [`FAIL_RANK_ENV`] names, if it is set; logs a warning when it is.
#[cfg(feature = "fault-injection")]
pub fn fail_rank_from_env() -> Option<usize> {
    let rank = std::env::var(FAIL_RANK_ENV).ok()?.parse().ok()?;
    tracing::warn!(rank, "{FAIL_RANK_ENV} is set: tensor-parallel rank {rank} will fail on purpose at its first step");
    Some(rank)
}

/// Why a group cannot start or stopped working.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GroupError {
    /// The size does not fit the model.
    #[error(transparent)]
    Shape(#[from] TpShapeError),
    /// Cutting the weights failed.
    #[error("sharding the weights: {0}")]
    Shard(String),
    /// A rank's thread or pool could not start.
    #[error("starting rank {rank}: {reason}")]
    Start {
        /// The rank.
        rank: usize,
        /// What failed.
        reason: String,
    },
    /// A rank failed during a step; the group is unusable.
    #[error("tensor-parallel rank {rank} failed: {reason}")]
    RankFailed {
        /// The rank that failed first.
        rank: usize,
        /// Its panic message or error.
        reason: String,
    },
}

/// One sequence of a step, owned: tokens, start, block table, logits, pool (see
/// [`SeqInput`]).
type OwnedSeq = (Vec<TokenId>, usize, Vec<BlockId>, bool, bool);

/// One step's sequences, owned so that every rank thread can read them.
struct Step {
    seqs: Vec<OwnedSeq>,
}

type Reply = (usize, Result<Vec<Vec<f32>>, String>);

/// The rank threads of one model.
pub struct TpGroup {
    steps: Vec<mpsc::Sender<Arc<Step>>>,
    replies: mpsc::Receiver<Reply>,
    threads: Vec<JoinHandle<()>>,
    comm: Arc<ShmCommunicator>,
    failed: Option<GroupError>,
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpGroup({} ranks)", self.steps.len())
    }
}

impl TpGroup {
    /// Shard `model` over `size` ranks sharing `threads` threads, each rank with K/V room
    /// for `num_blocks` blocks of `block_size` tokens.
    pub fn spawn(
        model: &Llama,
        size: usize,
        threads: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, GroupError> {
        Self::spawn_inner(model, size, threads, num_blocks, block_size, None)
    }

    /// [`Self::spawn`], with rank `fail_rank` panicking at its first step (reliability
    /// tests; feature `fault-injection`).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn spawn_with_failing_rank(
        model: &Llama,
        size: usize,
        threads: usize,
        num_blocks: usize,
        block_size: usize,
        fail_rank: usize,
    ) -> Result<Self, GroupError> {
        Self::spawn_inner(model, size, threads, num_blocks, block_size, Some(fail_rank))
    }

    fn spawn_inner(
        model: &Llama,
        size: usize,
        threads: usize,
        num_blocks: usize,
        block_size: usize,
        fail_rank: Option<usize>,
    ) -> Result<Self, GroupError> {
        let comm = Arc::new(ShmCommunicator::new(size));
        let (reply_tx, replies) = mpsc::channel();
        let (mut steps, mut handles) = (Vec::new(), Vec::new());
        let per_rank = (threads / size).max(1);
        for rank in 0..size {
            let plan = TpPlan::new(model.tp_dims(), size, rank)?;
            let shard = model.shard(&plan).map_err(|e| GroupError::Shard(e.to_string()))?;
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(per_rank)
                .thread_name(move |i| format!("tp{rank}-worker-{i}"))
                .build()
                .map_err(|e| GroupError::Start { rank, reason: e.to_string() })?;
            let (tx, rx) = mpsc::channel::<Arc<Step>>();
            let rank_thread = RankThread { rank, shard, pool, comm: comm.clone(), fail: fail_rank == Some(rank) };
            let (reply_tx, kv) = (reply_tx.clone(), (num_blocks, block_size));
            let join = thread::Builder::new()
                .name(format!("tp-rank-{rank}"))
                .spawn(move || rank_thread.run(rx, reply_tx, kv))
                .map_err(|e| GroupError::Start { rank, reason: e.to_string() })?;
            steps.push(tx);
            handles.push(join);
        }
        Ok(TpGroup { steps, replies, threads: handles, comm, failed: None })
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.steps.len()
    }

    /// Seconds rank 0 has spent in collectives (the all-reduce share of the steps).
    pub fn comm_seconds(&self) -> f64 {
        self.comm.comm_seconds()
    }

    /// Run one step on every rank; rank 0's logits.
    pub fn forward(&mut self, seqs: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, GroupError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let step = Arc::new(Step {
            seqs: seqs.iter().map(|s| (s.tokens.to_vec(), s.start, s.block_table.to_vec(), s.logits, s.pool)).collect(),
        });
        let mut sent = 0;
        for tx in &self.steps {
            if tx.send(step.clone()).is_ok() {
                sent += 1;
            }
        }
        let (mut logits, mut first, mut echo) = (None, None, None);
        for _ in 0..sent {
            match self.replies.recv() {
                Ok((0, Ok(l))) => logits = Some(l),
                Ok((_, Ok(_))) => {}
                // A rank released by another's failure reports `PeerFailed`: keep the cause.
                Ok((rank, Err(reason))) if reason == CommError::PeerFailed.to_string() => {
                    echo.get_or_insert(GroupError::RankFailed { rank, reason });
                }
                Ok((rank, Err(reason))) => {
                    first.get_or_insert(GroupError::RankFailed { rank, reason });
                }
                Err(_) => break,
            }
        }
        let error = first.or(echo).or_else(|| {
            (sent < self.steps.len() || logits.is_none())
                .then(|| GroupError::RankFailed { rank: 0, reason: "a rank thread is gone".into() })
        });
        match error {
            Some(e) => {
                self.failed = Some(e.clone());
                Err(e)
            }
            None => Ok(logits.unwrap_or_default()),
        }
    }
}

impl Drop for TpGroup {
    fn drop(&mut self) {
        // Closing the step channels ends the rank loops.
        self.steps.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// What one rank's thread owns: its weight shard and rayon pool, the group's communicator.
struct RankThread {
    rank: usize,
    shard: Llama,
    pool: rayon::ThreadPool,
    comm: Arc<ShmCommunicator>,
    /// Panic at the first step (feature `fault-injection`; never set otherwise, and the
    /// panic is not compiled in).
    fail: bool,
}

impl RankThread {
    /// The rank's loop: run each step it is handed on its K/V cache (`kv`: blocks, block
    /// size) and reply; the first failure poisons the communicator and ends the loop.
    fn run(self, steps: mpsc::Receiver<Arc<Step>>, replies: mpsc::Sender<Reply>, kv: (usize, usize)) {
        let RankThread { rank, shard, pool, comm, fail } = self;
        // Whatever panics in this thread (outside the step's own catch too) releases the
        // other ranks.
        let _poison_on_panic = PoisonOnPanic(comm.clone());
        let mut kv = shard.kv_store(kv.0, kv.1);
        for step in steps {
            let result = catch_unwind(AssertUnwindSafe(|| {
                #[cfg(any(test, feature = "fault-injection"))]
                if fail {
                    panic!("rank {rank} failed on purpose ({FAIL_RANK_ENV}={rank})");
                }
                #[cfg(not(any(test, feature = "fault-injection")))]
                let _ = fail;
                let seqs: Vec<SeqInput<'_>> = step
                    .seqs
                    .iter()
                    .map(|(tokens, start, table, logits, pool)| SeqInput {
                        tokens,
                        start: *start,
                        block_table: table,
                        logits: *logits,
                        pool: *pool,
                    })
                    .collect();
                pool.install(|| shard.forward_rank(&mut kv, &seqs, Some((comm.as_ref(), rank))))
            }));
            let reply = match result {
                Ok(Ok(logits)) => Ok(logits),
                Ok(Err(e)) => Err(e.to_string()),
                Err(panic) => Err(panic_message(panic.as_ref())),
            };
            let dead = reply.is_err();
            if dead {
                // Release the ranks waiting for this one in a collective.
                comm.poison();
            }
            if replies.send((rank, reply)).is_err() || dead {
                return;
            }
        }
    }
}

/// Poisons the communicator when dropped during a panic.
struct PoisonOnPanic(Arc<ShmCommunicator>);

impl Drop for PoisonOnPanic {
    fn drop(&mut self) {
        if thread::panicking() {
            self.0.poison();
        }
    }
}

/// The message of a caught panic.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panicked".into())
}
