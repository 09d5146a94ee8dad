//! Deadlines that cost nothing when the work is already done.
//!
//! `tokio::time::timeout` reads the clock and sets up a timer entry before it polls the work
//! (~300 instructions with its teardown), even when the work finishes on that first poll —
//! as a write to an engine's socket or a request body that arrived with its head nearly
//! always does. [`within`] polls the work once first and arms the timer only when it is
//! still pending.

use std::future::Future;
use std::time::Duration;

use futures_util::FutureExt;

/// `fut`'s output, or `Err(Elapsed)` when it takes longer than `limit`; no timer when `fut`
/// is ready at once.
pub(crate) async fn within<F: Future>(limit: Duration, fut: F) -> Result<F::Output, tokio::time::error::Elapsed> {
    let mut fut = std::pin::pin!(fut);
    // A poll with a no-op waker: a future still pending registers the real waker when the
    // timeout polls it next (the last waker given is the one woken).
    if let Some(out) = fut.as_mut().now_or_never() {
        return Ok(out);
    }
    tokio::time::timeout(limit, fut).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn ready_work_needs_no_timer_and_slow_work_times_out() {
        assert_eq!(within(Duration::ZERO, async { 7 }).await, Ok(7));
        let slow = tokio::time::sleep(Duration::from_secs(5));
        assert!(within(Duration::from_secs(1), slow).await.is_err());
        // Pending at first, done before the deadline: its real waker was registered.
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let _ = tx.send(3);
        });
        assert_eq!(within(Duration::from_secs(1), rx).await.map(Result::ok), Ok(Some(3)));
    }
}
