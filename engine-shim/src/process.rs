//! Process-level helpers every Switchyard binary shares (feature `process`): the wall clock
//! as Unix time, waiting for SIGTERM, and the drain loop that waits for in-flight work.
//!
//! Kept apart from the pure parsers of this crate: these read the clock and the signals.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_secs() -> u64 {
    unix_ms() / 1000
}

/// Resolves on the first SIGTERM or SIGINT (Ctrl-C). If the SIGTERM handler cannot be
/// installed, only Ctrl-C is awaited.
pub async fn terminated() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! { _ = term.recv() => {}, _ = ctrl_c => {} }
        }
        Err(_) => ctrl_c.await,
    }
}

/// How often [`wait_until_idle`] looks at the in-flight count.
pub const DRAIN_POLL: Duration = Duration::from_millis(20);

/// The drain loop: blocks the calling thread until `in_flight()` is 0 or `deadline` passes,
/// and returns what is still in flight (0 when drained). A thread, not a task, so it keeps
/// running while an async runtime shuts down around it.
pub fn wait_until_idle(in_flight: impl Fn() -> usize, deadline: Instant) -> usize {
    loop {
        let n = in_flight();
        if n == 0 || Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(DRAIN_POLL.min(deadline.saturating_duration_since(Instant::now())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn the_drain_loop_returns_when_work_ends_or_time_is_up() {
        assert_eq!(wait_until_idle(|| 0, Instant::now() + Duration::from_secs(60)), 0);
        assert_eq!(wait_until_idle(|| 3, Instant::now()), 3);
        let n = Arc::new(AtomicUsize::new(2));
        let m = n.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            m.store(0, Ordering::SeqCst);
        });
        assert_eq!(wait_until_idle(|| n.load(Ordering::SeqCst), Instant::now() + Duration::from_secs(60)), 0);
        t.join().unwrap();
    }

    #[test]
    fn unix_time_is_after_2020() {
        assert!(unix_secs() > 1_577_836_800);
        assert!(unix_ms() / 1000 >= unix_secs() - 1);
    }
}
