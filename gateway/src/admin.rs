//! The admin listener: `/metrics` (Prometheus) and `/admin/backends` (JSON), both behind
//! `admin.token_sha256` when it is set; `/-/healthz` (liveness) always open.
//!
//! It is HTTP/1.1 only and holds each connection to the header deadline
//! (`limits.header_read_timeout_ms`), for the first request and every kept-alive one: a
//! Prometheus scraper reconnects when it waited longer, a slowloris is cut off.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;

use crate::auth::{bearer, key_digest};
use crate::config::auth::parse_sha256;
use crate::http::{respond, respond_headers};
use crate::kv_events::prompt::PromptTokenizer;
use crate::state::GatewayState;

/// The admin app.
pub struct AdminApp {
    state: Arc<GatewayState>,
}

impl AdminApp {
    /// Admin over `state`.
    pub fn new(state: Arc<GatewayState>) -> Self {
        AdminApp { state }
    }

    /// `/admin/backends`: each backend's url, state, signals, in-flight and routed count.
    pub fn backends_json(&self) -> serde_json::Value {
        let active = self.state.active.load();
        let now = Instant::now();
        let cfg = &active.config;
        let backends: Vec<_> = active
            .cluster
            .backends
            .iter()
            .map(|b| {
                let scraped = b.scraped.load();
                let health = b.health.lock().clone();
                let signal = scraped.signal.as_ref().map(|(s, at)| {
                    serde_json::json!({
                        "dialect": s.dialect.as_str(),
                        "waiting": s.waiting,
                        "running": s.running,
                        "kv_usage": s.kv_usage,
                        "prefix_hit_rate": s.prefix_hit_rate,
                        "age_ms": now.saturating_duration_since(*at).as_millis() as u64,
                        "stale": now.saturating_duration_since(*at) > cfg.scrape.stale_after(),
                    })
                });
                serde_json::json!({
                    "url": b.url,
                    "address": b.addr.map(|a| a.to_string()),
                    "state": b.state(now, cfg.scrape.down_after_failures).as_str(),
                    "models": scraped.models,
                    "signal": signal,
                    "inflight": b.inflight.load(Ordering::Relaxed),
                    "routed": b.routed.load(Ordering::Relaxed),
                    "scrape_failures": scraped.consecutive_failures,
                    "scrape_error": scraped.last_error,
                    "consecutive_request_failures": health.consecutive_failures,
                    "ejected_for_ms": health.ejected_until.map(|u| u.saturating_duration_since(now).as_millis() as u64),
                    "ejections": health.ejections,
                    "last_ejection_reason": health.last_ejection_reason,
                    "restarts_seen": b.restarts.load(Ordering::Relaxed),
                    "prefill_tokens_per_s": Some(b.prefill_tokens_per_s()).filter(|r| *r > 0.0),
                    "kv_events": self.state.kv_events.as_ref().and_then(|k| k.describe(b.key)),
                })
            })
            .collect();
        let tokenizer = self.state.prompt_tokenizer.as_ref().map(PromptTokenizer::describe);
        let shared_limits = self
            .state
            .shared_limits
            .as_ref()
            .map(|l| serde_json::json!({ "replicas_seen": l.replicas(), "redis_available": l.is_available() }));
        serde_json::json!({
            "policy": active.policy.name(), "backends": backends, "tokenizer": tokenizer,
            "shared_limits": shared_limits,
        })
    }
}

#[async_trait]
impl HttpServerApp for AdminApp {
    async fn process_new_http(
        self: &Arc<Self>,
        mut s: ServerSession,
        _shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        let (deadline, token) = {
            let config = &self.state.active.load().config;
            (config.limits.header_read_timeout(), config.admin.token_sha256.as_deref().and_then(parse_sha256))
        };
        match tokio::time::timeout(deadline, s.read_request()).await {
            Ok(Ok(true)) => {}
            Ok(_) => return None,
            Err(_) => {
                self.state.metrics.header_timeouts.inc();
                return None;
            }
        }
        let path = s.req_header().uri.path().to_string();
        let authorized = || {
            let presented = bearer(s.get_header("authorization").map(|v| v.as_bytes()));
            token.is_none_or(|digest| presented.is_ok_and(|t| key_digest(t) == digest))
        };
        let ok = match path.as_str() {
            "/-/healthz" => respond(&mut s, 200, "text/plain", Bytes::from_static(b"ok\n"), None).await,
            _ if !authorized() => {
                let body = Bytes::from_static(b"an admin token is required: Authorization: Bearer <token>\n");
                let challenge = [("www-authenticate", "Bearer realm=\"switchyard-admin\"")];
                respond_headers(&mut s, 401, "text/plain", body, &challenge).await
            }
            "/metrics" => {
                let active = self.state.active.load();
                let body = self.state.metrics.render(
                    &active.cluster,
                    Instant::now(),
                    active.config.scrape.down_after_failures,
                );
                respond(&mut s, 200, "text/plain; version=0.0.4; charset=utf-8", Bytes::from(body), None).await
            }
            "/admin/backends" => {
                let body = serde_json::to_vec_pretty(&self.backends_json()).expect("json");
                respond(&mut s, 200, "application/json", Bytes::from(body), None).await
            }
            _ => respond(&mut s, 404, "text/plain", Bytes::from_static(b"not found\n"), None).await,
        };
        if !ok {
            return None;
        }
        let settings = HttpPersistentSettings::for_session(&s);
        s.finish().await.ok().flatten().map(|st| ReusedHttpStream::from_reusable_stream(st, settings))
    }
}
