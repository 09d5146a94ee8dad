//! The scrape loop, the sidecar's one background task: every `scrape_interval` it fetches the
//! engine's `/metrics`, `/health` and `/v1/models`, one after the other and each within
//! [`FETCH_TIMEOUT`] and [`MAX_FETCH_BYTES`] (an engine that trickles or floods its answer
//! fails the check instead of holding the loop or the sidecar's memory), lets [`assess`]
//! decide, and swaps the snapshot and the ready flag in.
//!
//! [`super::run`] starts it and aborts it on the way out; nothing else starts tasks.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http_body_util::BodyExt;

use super::readiness::{assess, Checks, Fetched};
use super::Sidecar;
use crate::process::unix_ms;

/// How long one fetch from the engine may take, body included.
pub(crate) const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest answer read from the engine (vLLM's `/metrics` with many LoRA adapters is a
/// few hundred KiB; the gateway's scraper has the same cap).
pub(crate) const MAX_FETCH_BYTES: usize = 8 * 1024 * 1024;

impl Sidecar {
    /// `GET path` on the engine, the whole body collected, within [`FETCH_TIMEOUT`] and
    /// [`MAX_FETCH_BYTES`].
    async fn fetch(&self, path: &str) -> Fetched {
        let uri = super::proxy::engine_uri(&self.config.engine, path).map_err(|e| e.to_string())?;
        let req = axum::http::Request::get(uri).body(Body::empty()).map_err(|e| e.to_string())?;
        let whole = async {
            let resp = self.client.request(req).await.map_err(|e| format!("{path}: {e}"))?;
            let status = resp.status();
            let body = http_body_util::Limited::new(resp.into_body(), MAX_FETCH_BYTES)
                .collect()
                .await
                .map_err(|e| format!("{path}: {e} (at most {MAX_FETCH_BYTES} bytes are read)"))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(FETCH_TIMEOUT, whole)
            .await
            .map_err(|_| format!("{path}: no whole answer within {} s", FETCH_TIMEOUT.as_secs()))?
    }
}

/// One round of checks: fetch, decide, publish.
pub(crate) async fn scrape_once(sh: &Sidecar) {
    let metrics = sh.fetch("/metrics").await;
    let scraped_at_unix_ms = unix_ms();
    let health = sh.fetch("/health").await;
    let models = sh.fetch("/v1/models").await;
    let (snapshot, ready) = assess(Checks { metrics, scraped_at_unix_ms, health, models }, sh.expected());
    sh.publish(snapshot, ready);
}

/// Check the engine every `interval`, forever (the caller aborts the task).
pub(crate) async fn scrape_loop(sh: Arc<Sidecar>, interval: Duration) {
    loop {
        scrape_once(&sh).await;
        tokio::time::sleep(interval).await;
    }
}
