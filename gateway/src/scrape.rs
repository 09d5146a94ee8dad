//! Background scraper: every `scrape.interval_ms`, each backend's `/metrics` (or, with
//! `scrape.source: load`, its sidecar's `/load`) → `LoadSignal`.
//!
//! Parsing is the pure `switchyard_shim` library (vLLM V0/V1, our engine, SGLang, TGI,
//! llama.cpp). Each result is published by swapping the backend's [`Scraped`] cell, so
//! requests read it without locks. The scraper is also the active health probe: a backend
//! is down after `scrape.down_after_failures` failures in a row and up again on the next
//! success. Model lists come from `/v1/models` (unless configured) on the first success
//! and then every [`MODELS_REFRESH_EVERY`] scrapes. A counter going backwards means the
//! engine restarted; it is counted on the backend (the prefix index will use it).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::active::Active;
use crate::cluster::{Backend, Scraped};
use crate::config::SignalSource;

/// Model lists are refreshed every this many scrapes.
pub const MODELS_REFRESH_EVERY: u64 = 50;

/// Largest `/metrics` or `/v1/models` body read.
const MAX_SCRAPE_BYTES: usize = 8 * 1024 * 1024;

/// The scraper service.
pub struct Scraper {
    active: Arc<ArcSwap<Active>>,
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

/// The TLS client config for `https://` backends: `upstream_tls.ca_file`, else the
/// system's roots (as the proxy's pingora connector does).
fn upstream_tls_config(ca_file: Option<&str>) -> pingora::tls::ClientConfig {
    pingora::tls::install_default_crypto_provider();
    let mut roots = pingora::tls::RootCertStore::empty();
    let loaded = match ca_file {
        Some(path) => pingora::tls::load_ca_file_into_store(path, &mut roots),
        None => pingora::tls::load_platform_certs_incl_env_into_store(&mut roots),
    };
    if let Err(e) = loaded {
        tracing::warn!(error = %e, "no CA certificates for https backends; their scrapes will fail");
    }
    pingora::tls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth()
}

impl Scraper {
    /// A scraper over the backends of the snapshot `active` holds.
    pub fn new(active: Arc<ArcSwap<Active>>) -> Self {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.enforce_http(false);
        let ca_file = active.load().config.upstream_tls.ca_file.clone();
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(upstream_tls_config(ca_file.as_deref()))
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(https);
        Scraper { active, client }
    }

    /// GET `path` from backend `b` at `addr` (by name over TLS: the certificate is for it).
    async fn get(&self, b: &Backend, addr: SocketAddr, path: &str) -> Result<String, String> {
        let uri = if b.tls() { format!("https://{}{path}", b.authority) } else { format!("http://{addr}{path}") };
        let uri: hyper::Uri = uri.parse().map_err(|e| format!("{e}"))?;
        let resp = self.client.get(uri).await.map_err(|e| format!("GET {path}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("GET {path}: status {}", resp.status()));
        }
        let body = http_body_util::Limited::new(resp.into_body(), MAX_SCRAPE_BYTES)
            .collect()
            .await
            .map_err(|e| format!("GET {path}: {e}"))?
            .to_bytes();
        String::from_utf8(body.to_vec()).map_err(|_| format!("GET {path}: body is not UTF-8"))
    }

    /// The model ids of `/v1/models`, and its objects (those with a string `id`).
    async fn models(&self, b: &Backend, addr: SocketAddr) -> Result<(Vec<String>, Vec<serde_json::Value>), String> {
        let text = self.get(b, addr, "/v1/models").await?;
        let mut v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("/v1/models: {e}"))?;
        let serde_json::Value::Array(data) = v["data"].take() else {
            return Err("/v1/models: no data array".into());
        };
        let cards: Vec<serde_json::Value> = data.into_iter().filter(|m| m["id"].is_string()).collect();
        let ids = cards.iter().filter_map(|m| m["id"].as_str().map(str::to_string)).collect();
        Ok((ids, cards))
    }

    async fn scrape(&self, b: &Backend, timeout: Duration, source: SignalSource, round: u64) {
        let prev = b.scraped.load_full();
        let result = match b.addr {
            None => Err(format!("{} does not resolve", b.authority)),
            Some(addr) => match tokio::time::timeout(timeout, async {
                let unix_ms = switchyard_shim::process::unix_ms();
                let (signal, lora) = match source {
                    SignalSource::Metrics => {
                        let text = self.get(b, addr, "/metrics").await?;
                        let signal =
                            switchyard_shim::parse_load_signal(&text, unix_ms).map_err(|e| format!("/metrics: {e}"))?;
                        // A second pass only for engines that report adapters.
                        let lora = memchr::memmem::find(text.as_bytes(), switchyard_shim::lora::LORA_INFO.as_bytes())
                            .and_then(|_| switchyard_shim::parse_lora_info(&text).ok().flatten())
                            .map(Arc::new);
                        (signal, lora)
                    }
                    SignalSource::Load => {
                        let text = self.get(b, addr, "/load").await?;
                        let signal =
                            switchyard_shim::expose::parse_load_json(&text, unix_ms).map_err(|e| e.to_string())?;
                        (signal, switchyard_shim::expose::parse_load_lora(&text).map(Arc::new))
                    }
                };
                let refresh = b.configured_models.is_none()
                    && (prev.models.is_empty() || round.is_multiple_of(MODELS_REFRESH_EVERY));
                let models = if refresh { Some(self.models(b, addr).await?) } else { None };
                Ok::<_, String>((signal, lora, models))
            })
            .await
            {
                Ok(r) => r,
                Err(_) => Err(format!("scrape timed out after {} ms", timeout.as_millis())),
            },
        };
        let next = match result {
            Ok((signal, lora, models)) => {
                let went_back = prev.signal.as_ref().is_some_and(|(old, _)| {
                    matches!((old.generation_tokens_total, signal.generation_tokens_total), (Some(o), Some(n)) if n < o)
                });
                if went_back {
                    b.restarts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                let (models, cards) = match models {
                    Some((ids, cards)) => (ids, Arc::new(cards)),
                    None => (prev.models.clone(), prev.cards.clone()),
                };
                Scraped {
                    signal: Some((signal, Instant::now())),
                    models,
                    cards,
                    lora,
                    consecutive_failures: 0,
                    last_error: None,
                }
            }
            Err(e) => Scraped {
                signal: prev.signal,
                models: prev.models.clone(),
                cards: prev.cards.clone(),
                lora: prev.lora.clone(),
                consecutive_failures: prev.consecutive_failures.saturating_add(1),
                last_error: Some(e),
            },
        };
        b.scraped.store(Arc::new(next));
    }

    /// Scrape every backend once, concurrently.
    pub async fn scrape_all(&self, round: u64) {
        let active = self.active.load_full();
        let (timeout, source) = (active.config.scrape.timeout(), active.config.scrape.source);
        futures_util::future::join_all(active.cluster.backends.iter().map(|b| self.scrape(b, timeout, source, round)))
            .await;
    }
}

#[async_trait]
impl BackgroundService for Scraper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut round = 0u64;
        loop {
            let started = Instant::now();
            self.scrape_all(round).await;
            round += 1;
            let interval = self.active.load().config.scrape.interval();
            let wait = interval.saturating_sub(started.elapsed());
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}
