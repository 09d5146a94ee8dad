//! `round_robin`: candidates in turn. The only state is a counter; it advances once per
//! decision, so with a stable candidate set each backend gets every n-th request.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidate, Decision, Policy, RouteInput};

pub(super) struct RoundRobin {
    pub(super) next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn select(&self, _: &RouteInput<'_>, c: &[Candidate], _: &mut dyn rand::RngCore) -> Decision {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Decision { pick: n % c.len(), reason: "round_robin" }
    }
}
