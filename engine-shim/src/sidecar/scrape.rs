//! The scrape loop, the sidecar's one background task: every `scrape_interval` it fetches the
//! engine's `/metrics`, `/health` and `/v1/models`, one after the other and each within
//! [`FETCH_TIMEOUT`], lets [`assess`] decide, and swaps the snapshot and the ready flag in.
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

impl Sidecar {
    /// `GET path` on the engine, the whole body collected.
    async fn fetch(&self, path: &str) -> Fetched {
        let uri = super::proxy::engine_uri(&self.config.engine, path).map_err(|e| e.to_string())?;
        let req = axum::http::Request::get(uri).body(Body::empty()).map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(FETCH_TIMEOUT, self.client.request(req))
            .await
            .map_err(|_| format!("{path}: no answer within 5 s"))?
            .map_err(|e| format!("{path}: {e}"))?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| format!("{path}: {e}"))?.to_bytes();
        Ok((status, body))
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
