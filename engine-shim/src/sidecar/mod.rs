//! The sidecar in every engine pod (feature `sidecar`), as a library: the binary parses its
//! flags into a [`SidecarConfig`], builds the [`Sidecar`], binds the listener and calls
//! [`run`]; tests drive [`app`] and [`run`] in-process against a fake engine on loopback.
//!
//! What it does:
//!
//! - **Access** (`access.rs`): only inference routes reach the engine by default; more with
//!   `--allow-path`, every path with the admin token. The rest get 403 and never reach it.
//! - **Proxy** (`proxy.rs`): every allowed path but its own three goes to the engine unbuffered; a
//!   request counts in flight (`in_flight.rs`) until its response body ends, and the first
//!   body chunk is timed (TTFT, `switchyard_shim_ttft_seconds`). An unreachable engine
//!   answers 502 in the OpenAI error shape.
//! - **Scrape** (`scrape.rs`): every `scrape_interval` the engine's `/metrics`, `/health` and
//!   `/v1/models` are fetched; `readiness.rs` decides, purely, whether the engine is ready and
//!   why not. The load is served normalized on `/metrics` (vLLM names, the sidecar's own
//!   gauges, then the engine's own series and the TTFT histogram) and as JSON on `/load`
//!   ([`crate::expose`]).
//! - **Readiness**: `/-/healthz` is 200 only while the engine answers `/health`, lists its
//!   model on `/v1/models`, speaks the expected dialect, and no shutdown signal has arrived.
//! - **Drain** (`drain.rs`): on the shutdown signal (SIGTERM in the binary) it turns not-ready
//!   at once, keeps serving while in-flight requests finish (up to `drain_timeout`), then
//!   [`run`] returns.
//!
//! The knobs are the fields of [`SidecarConfig`].

mod access;
mod drain;
mod error;
mod in_flight;
mod proxy;
mod readiness;
mod scrape;
#[cfg(test)]
mod tests;

use std::future::{Future, IntoFuture};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

pub use access::{Access, AccessPolicy, ADMIN_TOKEN_HEADER, INFERENCE_ROUTES};
pub use error::SidecarError;

use crate::expose::{load_json, metrics_text, SidecarState};
use crate::Dialect;
use in_flight::InFlight;
use readiness::{Expected, ScrapeSnapshot};

/// The shortest scrape interval honoured; shorter ones are raised to it.
pub const MIN_SCRAPE_INTERVAL: Duration = Duration::from_millis(10);

/// How long the server gets, after the drain, to close its connections before it is stopped.
pub const SERVER_STOP_TIMEOUT: Duration = Duration::from_secs(1);

/// The TTFT histogram's buckets, in seconds.
const TTFT_BUCKETS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// What the sidecar is told, from its flags.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    /// The engine's base URL, `http://HOST:PORT` ([`parse_engine_url`]).
    pub engine: Uri,
    /// The dialect the engine's metrics must be in to be ready; `None` detects it.
    pub dialect: Option<Dialect>,
    /// The model the engine must list before it is ready; `None` for any.
    pub served_model_name: Option<String>,
    /// How often the engine is scraped (at least [`MIN_SCRAPE_INTERVAL`]).
    pub scrape_interval: Duration,
    /// How long in-flight requests get to finish after the shutdown signal.
    pub drain_timeout: Duration,
    /// Which paths reach the engine, and the admin token that reaches the rest.
    pub access: AccessPolicy,
}

/// Parse `--engine-url`: it must be an absolute `http://HOST:PORT` URL.
///
/// # Errors
///
/// [`SidecarError::EngineUrl`] for anything else (another scheme, no host, not a URL).
pub fn parse_engine_url(url: &str) -> Result<Uri, SidecarError> {
    match url.parse::<Uri>() {
        Ok(u) if u.scheme_str() == Some("http") && u.authority().is_some() => Ok(u),
        _ => Err(SidecarError::EngineUrl { url: url.to_owned() }),
    }
}

/// The sidecar's application context: the engine client, the counters, the last scrape and
/// the metrics registry. Built once in `main` (starting no task), shared by the handlers and
/// the scrape loop.
pub struct Sidecar {
    config: SidecarConfig,
    client: Client<HttpConnector, Body>,
    in_flight: Arc<InFlight>,
    ready: AtomicBool,
    draining: AtomicBool,
    scraped: Mutex<ScrapeSnapshot>,
    ttft: prometheus::Histogram,
    refused: prometheus::IntCounter,
    registry: prometheus::Registry,
}

impl Sidecar {
    /// The context for `config`: not ready until the first scrape passes, nothing in flight.
    ///
    /// # Errors
    ///
    /// [`SidecarError::Metrics`] if the TTFT histogram cannot be registered.
    pub fn new(config: SidecarConfig) -> Result<Self, SidecarError> {
        let registry = prometheus::Registry::new();
        let ttft = prometheus::Histogram::with_opts(
            prometheus::HistogramOpts::new(
                "switchyard_shim_ttft_seconds",
                "Time to the first response byte, per proxied request.",
            )
            .buckets(TTFT_BUCKETS.to_vec()),
        )?;
        registry.register(Box::new(ttft.clone()))?;
        let refused = prometheus::IntCounter::new(
            "switchyard_shim_refused_requests_total",
            "Requests answered 403 because their path is not forwarded to the engine.",
        )?;
        registry.register(Box::new(refused.clone()))?;
        Ok(Sidecar {
            config,
            client: Client::builder(TokioExecutor::new()).build_http(),
            in_flight: Arc::new(InFlight::default()),
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            scraped: Mutex::new(ScrapeSnapshot::default()),
            ttft,
            refused,
            registry,
        })
    }

    fn state(&self) -> SidecarState {
        SidecarState {
            in_flight: self.in_flight.get(),
            ready: self.ready.load(Ordering::Acquire),
            draining: self.draining.load(Ordering::Acquire),
        }
    }

    fn expected(&self) -> Expected<'_> {
        Expected { dialect: self.config.dialect, model: self.config.served_model_name.as_deref() }
    }

    fn last_scrape(&self) -> MutexGuard<'_, ScrapeSnapshot> {
        self.scraped.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Swap in a round's snapshot and readiness, together.
    fn publish(&self, snapshot: ScrapeSnapshot, ready: bool) {
        let mut last = self.last_scrape();
        *last = snapshot;
        self.ready.store(ready, Ordering::Release);
    }
}

/// The sidecar's HTTP application: `/-/healthz`, `/metrics`, `/load`, and the proxy for
/// every other path.
pub fn app(sidecar: Arc<Sidecar>) -> Router {
    Router::new()
        .route("/-/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/load", get(load))
        .fallback(proxy::proxy)
        .with_state(sidecar)
}

async fn healthz(State(sh): State<Arc<Sidecar>>) -> Response {
    let verdict = readiness::healthz(sh.state(), sh.last_scrape().error.as_deref());
    match verdict {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")).into_response(),
    }
}

async fn metrics(State(sh): State<Arc<Sidecar>>) -> Response {
    let mut body = {
        let last = sh.last_scrape();
        metrics_text(last.signal.as_ref(), sh.state(), &last.text)
    };
    let mut buf = Vec::new();
    let enc = prometheus::TextEncoder::new();
    if prometheus::Encoder::encode(&enc, &sh.registry.gather(), &mut buf).is_ok() {
        body.push_str(&String::from_utf8_lossy(&buf));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn load(State(sh): State<Arc<Sidecar>>) -> Response {
    let body = {
        let last = sh.last_scrape();
        // The engine's adapters pass on from its last metrics (vLLM's lora_requests_info).
        let lora = crate::parse_lora_info(&last.text).ok().flatten();
        load_json(last.signal.as_ref(), sh.state(), lora.as_ref(), last.error.as_deref())
    };
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Serve `sidecar` on `listener` and scrape its engine until `shutdown` resolves, then drain:
/// not ready at once, serving on while in-flight requests finish (up to the drain timeout),
/// then stop the server (connections still open after [`SERVER_STOP_TIMEOUT`] are cut) and
/// the scrape loop. Returns how many requests were still in flight when the drain ended.
pub async fn run(sidecar: Arc<Sidecar>, listener: tokio::net::TcpListener, shutdown: impl Future<Output = ()>) -> u64 {
    let interval = sidecar.config.scrape_interval.max(MIN_SCRAPE_INTERVAL);
    let scraper = tokio::spawn(scrape::scrape_loop(sidecar.clone(), interval));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(
        axum::serve(listener, app(sidecar.clone()))
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .into_future(),
    );
    shutdown.await;
    let left = drain::drain(&sidecar, sidecar.config.drain_timeout).await;
    let _ = stop_tx.send(());
    // Idle keep-alive connections close at once; a stream still open past the drain
    // timeout is cut.
    if tokio::time::timeout(SERVER_STOP_TIMEOUT, &mut server).await.is_err() {
        server.abort();
    }
    scraper.abort();
    left
}
