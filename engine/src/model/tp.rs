//! Tensor parallelism: how a Llama model is cut into ranks, and how the ranks talk.
//!
//! Megatron-style, as vLLM does it: Q/K/V and gate/up are *column-parallel* (rank `r` owns
//! its heads' rows of Q/K/V and its slice of the MLP's inner rows), O and down are
//! *row-parallel* (rank `r` owns the matching input columns), and one all-reduce after each
//! row-parallel layer sums the ranks' partial outputs — two per block. Every rank keeps the
//! full residual stream, so RMSNorm and RoPE need no communication. Each rank stores only
//! its K/V heads' part of every cached block; the block table is shared, so the scheduler
//! and the prefix cache do not know TP exists.
//!
//! The embedding is replicated (a lookup is a row copy; splitting it by vocabulary would
//! cost an all-reduce per step for nothing) and the LM head is vocabulary-parallel (the
//! biggest matrix of a small model: each rank computes its slice of the logits, rank 0
//! gathers them), as vLLM's `ParallelLMHead` does.
//!
//! Shape rules ([`TpPlan::new`]): query heads divide by N; K/V heads divide by N, or, when N
//! exceeds them, N divides by them and each K/V head is replicated on N / kv ranks (vLLM's
//! rule); the MLP's inner size divides by N; and every split of a row-parallel input falls
//! on a quantization block. SmolLM2-135M (9 heads, 3 K/V heads, MLP 1536) therefore runs
//! with N = 1 or 3. N = 2 is refused, as vLLM refuses it: 9 heads would split 5 + 4, and
//! uneven shards would break the equal-size collectives a GPU implementation (NCCL) needs.
//!
//! Ranks talk through a [`Communicator`]. [`ShmCommunicator`] is the shared-memory one for
//! threads of one process: each rank writes its part to its own slot, waits at a barrier,
//! and sums (or gathers) every slot **in rank order**, so all ranks hold the same bits; a
//! second barrier keeps the slots until everyone has read them. A rank that dies poisons
//! the communicator: every other rank's wait returns [`CommError::PeerFailed`] instead of
//! hanging.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// A collective failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// Another rank died; the group cannot make progress.
    #[error("a tensor-parallel rank failed")]
    PeerFailed,
}

/// Collectives among the ranks of a tensor-parallel group. A GPU build fills this with NCCL
/// (`ncclAllReduce`, `ncclAllGather`) on the ranks' streams.
pub trait Communicator: Send + Sync {
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// Sum partial results over the group: `parts` is this rank's consecutive partials (each
    /// `out.len()` long); `out` becomes every rank's partials summed in rank order, then part
    /// order ([`sum_parts`] over the concatenation) — the same bits on every rank, and the
    /// bits one rank holding every part would get.
    fn all_reduce_sum(&self, rank: usize, parts: &[f32], out: &mut [f32]) -> Result<(), CommError>;
    /// Every rank's `part`, in rank order (parts may differ in length), on rank 0; other
    /// ranks get an empty list.
    fn gather_to_first(&self, rank: usize, part: &[f32]) -> Result<Vec<Vec<f32>>, CommError>;
    /// Mark the group failed: every current and future collective returns an error.
    fn poison(&self);
}

/// `out` = the sum of the consecutive partials in `parts` (each `out.len()` long), added
/// one after another in order: `((p0 + p1) + p2) + …`.
pub fn sum_parts(parts: &[f32], out: &mut [f32]) {
    let n = out.len();
    if let Some(first) = parts.get(..n) {
        out.copy_from_slice(first);
        add_parts(&parts[n..], out);
    }
}

/// Add the consecutive partials in `parts` (each `out.len()` long) to `out`, one after
/// another in order — [`sum_parts`] continued.
pub fn add_parts(parts: &[f32], out: &mut [f32]) {
    for part in parts.chunks_exact(out.len().max(1)) {
        out.iter_mut().zip(part).for_each(|(a, b)| *a += b);
    }
}

/// A reusable barrier that spins briefly, then yields, and gives up when poisoned.
#[derive(Debug)]
struct Barrier {
    n: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    poisoned: AtomicBool,
}

impl Barrier {
    fn new(n: usize) -> Self {
        Self { n, arrived: AtomicUsize::new(0), generation: AtomicUsize::new(0), poisoned: AtomicBool::new(false) }
    }

    fn wait(&self) -> Result<(), CommError> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(CommError::PeerFailed);
        }
        let gen = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.arrived.store(0, Ordering::Release);
            self.generation.fetch_add(1, Ordering::AcqRel);
            return Ok(());
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == gen {
            if self.poisoned.load(Ordering::Acquire) {
                return Err(CommError::PeerFailed);
            }
            // Ranks may outnumber cores: after a short spin, let the others run.
            if spins < 64 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
        Ok(())
    }
}

/// Shared-memory collectives for ranks that are threads of one process.
#[derive(Debug)]
pub struct ShmCommunicator {
    slots: Vec<Mutex<Vec<f32>>>,
    barrier: Barrier,
    /// Nanoseconds rank 0 spent inside collectives (waiting included).
    comm_nanos: AtomicU64,
}

impl ShmCommunicator {
    /// A group of `n` ranks.
    pub fn new(n: usize) -> Self {
        Self {
            slots: (0..n.max(1)).map(|_| Mutex::new(Vec::new())).collect(),
            barrier: Barrier::new(n.max(1)),
            comm_nanos: AtomicU64::new(0),
        }
    }

    /// Time rank 0 has spent in collectives so far (the all-reduce share of a step).
    pub fn comm_seconds(&self) -> f64 {
        self.comm_nanos.load(Ordering::Relaxed) as f64 * 1e-9
    }

    fn put(&self, rank: usize, data: &[f32]) {
        let mut slot = self.slots[rank].lock().unwrap_or_else(|e| e.into_inner());
        slot.clear();
        slot.extend_from_slice(data);
    }

    fn timed<T>(&self, rank: usize, f: impl FnOnce() -> Result<T, CommError>) -> Result<T, CommError> {
        let start = Instant::now();
        let r = f();
        if rank == 0 {
            self.comm_nanos.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        r
    }
}

impl Communicator for ShmCommunicator {
    fn world_size(&self) -> usize {
        self.slots.len()
    }

    fn all_reduce_sum(&self, rank: usize, parts: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        if self.slots.len() == 1 {
            sum_parts(parts, out);
            return Ok(());
        }
        self.timed(rank, || {
            self.put(rank, parts);
            self.barrier.wait()?;
            // Rank order, then part order, on every rank: the same bits everywhere.
            for (r, slot) in self.slots.iter().enumerate() {
                let theirs = slot.lock().unwrap_or_else(|e| e.into_inner());
                if r == 0 {
                    sum_parts(&theirs, out);
                } else {
                    add_parts(&theirs, out);
                }
            }
            self.barrier.wait()
        })
    }

    fn gather_to_first(&self, rank: usize, part: &[f32]) -> Result<Vec<Vec<f32>>, CommError> {
        self.timed(rank, || {
            self.put(rank, part);
            self.barrier.wait()?;
            let all = if rank == 0 {
                self.slots.iter().map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).clone()).collect()
            } else {
                Vec::new()
            };
            self.barrier.wait()?;
            Ok(all)
        })
    }

    fn poison(&self) {
        self.barrier.poisoned.store(true, Ordering::Release);
    }
}

/// The largest group the cpu backend runs (vLLM's usual ceiling within one node). It also
/// bounds the row-parallel segment count ([`crate::model::llama::RowParallel`]).
pub const MAX_SIZE: usize = 8;

/// Why a tensor-parallel size does not fit a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--tensor-parallel-size {size}: {reason} (sizes that fit this model: {valid})")]
pub struct TpShapeError {
    /// The requested size.
    pub size: usize,
    /// What does not divide.
    pub reason: String,
    /// The sizes that would work.
    pub valid: String,
}

/// The model dimensions a split must respect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpDims {
    /// Query heads.
    pub n_heads: usize,
    /// K/V heads.
    pub n_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// MLP inner size.
    pub ffn_dim: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Quantization block of the O projection's rows (1 for float types).
    pub o_block: usize,
    /// Quantization block of the down projection's rows.
    pub down_block: usize,
}

/// What rank `rank` of `size` owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpPlan {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
    /// Query heads.
    pub heads: Range<usize>,
    /// K/V heads (one replicated head when the group is larger than the K/V heads).
    pub kv_heads: Range<usize>,
    /// Rows of the MLP's inner dimension.
    pub ffn: Range<usize>,
    /// Rows of the LM head (vocabulary entries).
    pub vocab: Range<usize>,
}

impl TpPlan {
    /// The plan of `rank` in a group of `size`, or why `size` does not fit.
    pub fn new(d: TpDims, size: usize, rank: usize) -> Result<Self, TpShapeError> {
        if let Some(reason) = Self::misfit(d, size) {
            let valid: Vec<String> = Self::valid_sizes(d).iter().map(|n| n.to_string()).collect();
            return Err(TpShapeError { size, reason, valid: valid.join(", ") });
        }
        let hl = d.n_heads / size;
        let kv_heads = if d.n_kv_heads >= size {
            let k = d.n_kv_heads / size;
            rank * k..(rank + 1) * k
        } else {
            let h = rank / (size / d.n_kv_heads);
            h..h + 1
        };
        let fl = d.ffn_dim / size;
        // The vocabulary need not divide: the first `vocab % size` ranks take one more row.
        let (q, extra) = (d.vocab / size, d.vocab % size);
        let v0 = rank * q + rank.min(extra);
        let v1 = v0 + q + usize::from(rank < extra);
        Ok(TpPlan {
            rank,
            size,
            heads: rank * hl..(rank + 1) * hl,
            kv_heads,
            ffn: rank * fl..(rank + 1) * fl,
            vocab: v0..v1,
        })
    }

    /// Every group size that fits the model, smallest first.
    pub fn valid_sizes(d: TpDims) -> Vec<usize> {
        (1..=d.n_heads.max(1)).filter(|&n| Self::misfit(d, n).is_none()).collect()
    }

    fn misfit(d: TpDims, n: usize) -> Option<String> {
        if n == 0 {
            return Some("must be at least 1".into());
        }
        if n > MAX_SIZE {
            return Some(format!("the cpu backend runs at most {MAX_SIZE} ranks"));
        }
        if d.vocab < n {
            return Some(format!("the vocabulary ({}) is smaller than {n}", d.vocab));
        }
        if !d.n_heads.is_multiple_of(n) {
            return Some(format!("the model's {} attention heads do not divide by {n}", d.n_heads));
        }
        if !(d.n_kv_heads.is_multiple_of(n) || (n > d.n_kv_heads && n.is_multiple_of(d.n_kv_heads))) {
            return Some(format!(
                "the model's {} K/V heads neither divide by {n} nor divide {n} (to be replicated)",
                d.n_kv_heads
            ));
        }
        if !d.ffn_dim.is_multiple_of(n) {
            return Some(format!("the model's MLP size {} does not divide by {n}", d.ffn_dim));
        }
        let (o_cols, down_cols) = (d.n_heads / n * d.head_dim, d.ffn_dim / n);
        if !o_cols.is_multiple_of(d.o_block) || !down_cols.is_multiple_of(d.down_block) {
            return Some(format!(
                "a rank's {o_cols} attention and {down_cols} MLP input columns do not fall on the weights' \
                 quantization blocks ({} and {})",
                d.o_block, d.down_block
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm2() -> TpDims {
        TpDims { n_heads: 9, n_kv_heads: 3, head_dim: 64, ffn_dim: 1536, vocab: 49152, o_block: 32, down_block: 32 }
    }

    #[test]
    fn smollm2_splits_into_one_or_three_ranks_only() {
        let e = TpPlan::new(smollm2(), 2, 0).unwrap_err();
        assert_eq!(e.to_string(), "--tensor-parallel-size 2: the model's 9 attention heads do not divide by 2 (sizes that fit this model: 1, 3)");
        let p = TpPlan::new(smollm2(), 3, 2).unwrap();
        assert_eq!((p.heads, p.kv_heads, p.ffn, p.vocab), (6..9, 2..3, 1024..1536, 32768..49152));
        // 9 ranks would replicate K/V heads, but the MLP (1536) does not divide by 9 — and
        // the cpu backend stops at 8 ranks anyway.
        assert!(TpPlan::new(smollm2(), 9, 0).unwrap_err().reason.contains("at most 8 ranks"));
        let wide = TpDims { n_heads: 12, ffn_dim: 1536, ..smollm2() };
        assert!(TpPlan::new(wide, 12, 0).unwrap_err().reason.contains("at most 8"));
        let tiny_vocab = TpDims { vocab: 2, ..smollm2() };
        assert!(TpPlan::new(tiny_vocab, 3, 0).unwrap_err().reason.contains("vocabulary (2) is smaller than 3"));
    }

    #[test]
    fn kv_heads_are_replicated_when_ranks_outnumber_them() {
        let d = TpDims { n_heads: 8, n_kv_heads: 2, head_dim: 16, ffn_dim: 64, vocab: 10, o_block: 1, down_block: 1 };
        let kv: Vec<_> = (0..8).map(|r| TpPlan::new(d, 8, r).unwrap().kv_heads).collect();
        assert_eq!(kv, vec![0..1, 0..1, 0..1, 0..1, 1..2, 1..2, 1..2, 1..2]);
        // Uneven vocabularies: the first ranks take one more entry; the slices tile 0..10.
        let v: Vec<_> = (0..4).map(|r| TpPlan::new(d, 4, r).unwrap().vocab).collect();
        assert_eq!(v, vec![0..3, 3..6, 6..8, 8..10]);
        assert!(TpPlan::new(d, 3, 0).unwrap_err().reason.contains("8 attention heads"));
    }

    #[test]
    fn all_reduce_sums_in_rank_order_and_a_poisoned_group_fails_fast() {
        let comm = ShmCommunicator::new(3);
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let comm = &comm;
                    s.spawn(move || {
                        let mut v = vec![r as f32 + 0.5; 4];
                        for _ in 0..100 {
                            // Two partials per rank: v and v / 2.
                            let parts: Vec<f32> = v.iter().copied().chain(v.iter().map(|x| x / 2.0)).collect();
                            comm.all_reduce_sum(r, &parts, &mut v).unwrap();
                            v.iter_mut().for_each(|x| *x /= 4.5);
                        }
                        let parts = comm.gather_to_first(r, &v[..r + 1]).unwrap();
                        assert_eq!(parts.len(), if r == 0 { 3 } else { 0 });
                        v
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.windows(2).all(|w| w[0] == w[1]), "every rank holds the same bits");
        assert!((results[0][0] - 1.5).abs() < 1e-5);

        comm.poison();
        assert_eq!(comm.all_reduce_sum(0, &[1.0], &mut [0.0]), Err(CommError::PeerFailed));
        // A rank already waiting is released by the poison too.
        let comm = ShmCommunicator::new(2);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| comm.all_reduce_sum(0, &[1.0], &mut [0.0]));
            std::thread::sleep(std::time::Duration::from_millis(20));
            comm.poison();
            assert_eq!(waiting.join().unwrap(), Err(CommError::PeerFailed));
        });
    }
}
