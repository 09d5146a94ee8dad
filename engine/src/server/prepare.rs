//! Request preparation off the threads that serve connections.
//!
//! Parsing a body, rendering a chat template, tokenizing a prompt and compiling a grammar
//! cost CPU in proportion to what the client sent: a megabyte of random letters is seconds
//! of tokenization. On the async workers that would stall every stream those workers carry
//! (two such prompts held another client's stream 15.6 s). [`Preparer`] runs preparation on
//! blocking threads while the workers go on serving streams, `/health` and `/metrics`; vLLM
//! gets the same from tokenizing in its API-server process, apart from the engine core.
//!
//! Two lanes, in arrival order within a lane: bodies up to [`LIGHT_BODY_BYTES`] (nearly every
//! request, well under a millisecond of work) on `--prepare-threads` threads (default twice
//! the CPUs: one thread per CPU capped the `instant` sim engine at 5.0k requests/s where the
//! async workers alone served 8.5k; four on two CPUs, 8.2k), and the rest on a quarter as
//! many (at least one). A chat message never waits behind someone's megabyte of prompt. A prompt longer than
//! `--max-prompt-bytes` is refused before it is tokenized ([`super::AppState::encode`]), so
//! one item of heavy work is bounded too.

use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::error::ApiError;

/// Requests with bodies up to this size are prepared in the light lane.
pub const LIGHT_BODY_BYTES: usize = 16 * 1024;

/// A bounded pool for CPU-bound request preparation.
pub struct Preparer {
    /// One permit per thread of each lane; tokio's semaphore is fair, so waiting requests
    /// go in order.
    light: Arc<Semaphore>,
    heavy: Arc<Semaphore>,
}

impl Preparer {
    /// At most `threads` light preparations at once, and a quarter as many heavy ones (at
    /// least one of each).
    pub fn new(threads: usize) -> Self {
        let lane = |n: usize| Arc::new(Semaphore::new(n.max(1)));
        Preparer { light: lane(threads), heavy: lane(threads / 4) }
    }

    /// Run `work`, for a body of `body_bytes`, on a blocking thread once a slot of its lane
    /// is free. Dropping the future before then (the client left) gives up its place; once
    /// started, `work` runs to its end.
    pub async fn run<T: Send + 'static>(
        &self,
        body_bytes: usize,
        work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let lane = if body_bytes <= LIGHT_BODY_BYTES { &self.light } else { &self.heavy };
        let slot = lane.clone().acquire_owned().await.map_err(|_| ApiError::Unavailable)?;
        let done = tokio::task::spawn_blocking(move || {
            let out = work();
            drop(slot);
            out
        })
        .await;
        done.unwrap_or_else(|e| {
            tracing::error!(error = %e, "request preparation panicked");
            Err(ApiError::Internal("request preparation failed".into()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// No more than a lane's threads run at once, and the async side stays free.
    #[tokio::test(flavor = "current_thread")]
    async fn runs_at_most_its_threads_at_once() {
        let p = Arc::new(Preparer::new(8));
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let jobs: Vec<_> = (0..8)
            .map(|i| {
                let (p, running, most) = (p.clone(), running.clone(), most.clone());
                tokio::spawn(async move {
                    p.run(LIGHT_BODY_BYTES + 1, move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(20));
                        running.fetch_sub(1, Ordering::SeqCst);
                        Ok(i)
                    })
                    .await
                })
            })
            .collect();
        // The one async worker is not held while the work runs.
        let ticks = tokio::spawn(async {
            let mut n = 0;
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(5)).await;
                n += 1;
            }
            n
        });
        let mut got = Vec::new();
        for j in jobs {
            got.push(j.await.unwrap().unwrap());
        }
        assert_eq!(got, (0..8).collect::<Vec<_>>());
        assert_eq!(most.load(Ordering::SeqCst), 2);
        assert_eq!(ticks.await.unwrap(), 10);
    }

    #[tokio::test]
    async fn a_panic_is_an_internal_error() {
        let p = Preparer::new(1);
        let err = p.run(0, || -> Result<(), ApiError> { panic!("bug") }).await.unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        // The slot came back.
        assert_eq!(p.run(0, || Ok(7)).await.unwrap(), 7);
    }

    /// A light request is not queued behind heavy ones.
    #[tokio::test]
    async fn light_work_passes_heavy_work() {
        let p = Arc::new(Preparer::new(1));
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let heavy = {
            let p = p.clone();
            tokio::spawn(async move {
                p.run(1 << 20, move || {
                    wait.recv().unwrap();
                    Ok(())
                })
                .await
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let light = tokio::time::timeout(Duration::from_secs(10), p.run(100, || Ok("light"))).await;
        assert_eq!(light.expect("light work waited for heavy work").unwrap(), "light");
        release.send(()).unwrap();
        heavy.await.unwrap().unwrap();
    }
}
