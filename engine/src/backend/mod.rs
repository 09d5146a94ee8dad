//! Backends execute one planned step.
//!
//! Every backend runs under the same scheduler and block pool: it receives the step's
//! sequences ([`SeqView`]: which tokens to compute, at which positions, through which
//! block table) and returns one sampled token for every sequence whose step reaches the
//! end of its known tokens. A backend that only *models* time (`sim`) also returns how
//! long the step would have taken on its hardware; the runtime then waits until that
//! much time has passed since the step began.

pub mod cpu;
pub mod sim;
pub mod tp_group;

use std::time::Duration;

use crate::scheduler::{Sampled, SeqView};

/// Result of one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    /// A token for every sequence scheduled with `sample`.
    pub sampled: Vec<Sampled>,
    /// For every pooling sequence of the step: the sum of its step tokens' final hidden
    /// states (see [`crate::scheduler::SamplingParams::pooling`]).
    pub pooled: Vec<(crate::scheduler::RequestId, Vec<f32>)>,
    /// Modelled duration of the step (simulated backends only).
    pub model_time: Option<Duration>,
}

/// The backend can no longer compute (a tensor-parallel rank died): the engine must stop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("backend failed: {0}")]
pub struct BackendFailure(pub String);

/// A model executor.
pub trait Backend: Send {
    /// Compute one step over `batch`. An error is fatal for the engine; a problem limited
    /// to some requests ends those requests instead.
    fn execute(&mut self, batch: &[SeqView<'_>]) -> Result<StepOutput, BackendFailure>;
}
