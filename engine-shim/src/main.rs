//! `switchyard-shim`: the sidecar in every engine pod.
//!
//! - proxies the engine's API unbuffered (every path but its own three), counting requests
//!   in flight until their response body ends and timing the first body chunk (TTFT);
//! - scrapes the engine's `/metrics` every `--scrape-interval-ms` and serves them
//!   normalized on `/metrics` (vLLM names, then the engine's own series) and as JSON on
//!   `/load` ([`switchyard_shim::expose`]);
//! - `/-/healthz` is 200 only while the engine answers `/health`, lists its model on
//!   `/v1/models`, speaks the expected dialect, and no SIGTERM has arrived;
//! - on SIGTERM it turns not-ready at once, keeps serving while in-flight requests finish
//!   (up to `--drain-timeout`), then exits 0.

use std::convert::Infallible;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, Incoming};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use switchyard_shim::expose::{load_json, metrics_text, SidecarState};
use switchyard_shim::{parse_load_signal, Dialect, LoadSignal};

/// Which engine sits behind the sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DialectArg {
    /// Detect from the metric names.
    Auto,
    /// vLLM V0/V1.
    Vllm,
    /// SGLang.
    Sglang,
    /// Text Generation Inference.
    Tgi,
    /// llama.cpp's llama-server.
    Llamacpp,
    /// Switchyard's engine (vLLM's names).
    Switchyard,
}

impl DialectArg {
    fn expected(self) -> Option<Dialect> {
        match self {
            DialectArg::Auto => None,
            DialectArg::Vllm | DialectArg::Switchyard => Some(Dialect::Vllm),
            DialectArg::Sglang => Some(Dialect::Sglang),
            DialectArg::Tgi => Some(Dialect::Tgi),
            DialectArg::Llamacpp => Some(Dialect::LlamaCpp),
        }
    }
}

/// Sidecar for an LLM engine: unbuffered proxy, normalized load, readiness and drain.
#[derive(Debug, Parser)]
#[command(name = "switchyard-shim", version)]
struct Args {
    /// The engine's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    engine_url: String,
    /// Where the sidecar listens.
    #[arg(long, default_value = "0.0.0.0:8001")]
    listen: SocketAddr,
    /// The engine's metric dialect.
    #[arg(long, value_enum, default_value = "auto")]
    dialect: DialectArg,
    /// Seconds to let in-flight requests finish after SIGTERM (a trailing `s` is allowed).
    #[arg(long, default_value = "30", value_parser = parse_secs)]
    drain_timeout: Duration,
    /// How often to scrape the engine's metrics and health.
    #[arg(long, default_value_t = 500)]
    scrape_interval_ms: u64,
    /// The model the engine must list before the pod is ready (default: any).
    #[arg(long)]
    served_model_name: Option<String>,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let n = s.strip_suffix('s').unwrap_or(s);
    n.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("`{s}` is not a number of seconds"))
}

/// What the background loop learned last.
#[derive(Default)]
struct Scraped {
    signal: Option<LoadSignal>,
    text: String,
    error: Option<String>,
}

struct Shared {
    engine: Uri,
    client: Client<HttpConnector, Body>,
    in_flight: AtomicU64,
    ready: AtomicBool,
    draining: AtomicBool,
    scraped: Mutex<Scraped>,
    ttft: prometheus::Histogram,
    registry: prometheus::Registry,
}

impl Shared {
    fn state(&self) -> SidecarState {
        SidecarState {
            in_flight: self.in_flight.load(Ordering::Acquire),
            ready: self.ready.load(Ordering::Acquire),
            draining: self.draining.load(Ordering::Acquire),
        }
    }

    fn url(&self, path_and_query: &str) -> Result<Uri, axum::http::Error> {
        let mut parts = self.engine.clone().into_parts();
        parts.path_and_query = Some(path_and_query.parse()?);
        Ok(Uri::from_parts(parts)?)
    }

    async fn get(&self, path: &str) -> Result<(StatusCode, Bytes), String> {
        let uri = self.url(path).map_err(|e| e.to_string())?;
        let req = axum::http::Request::get(uri).body(Body::empty()).map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(5), self.client.request(req))
            .await
            .map_err(|_| format!("{path}: no answer within 5 s"))?
            .map_err(|e| format!("{path}: {e}"))?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| format!("{path}: {e}"))?.to_bytes();
        Ok((status, body))
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// One scrape of metrics, health and models; updates `ready` and the last signal.
async fn scrape_once(sh: &Shared, expected: Option<Dialect>, model: Option<&str>) {
    let metrics = match sh.get("/metrics").await {
        Ok((s, body)) if s.is_success() => {
            let text = String::from_utf8_lossy(&body).into_owned();
            match parse_load_signal(&text, unix_ms()) {
                Ok(sig) if expected.is_some_and(|d| d != sig.dialect) => Err((
                    format!(
                        "the engine's metrics are {}, --dialect says {}",
                        sig.dialect,
                        expected.unwrap_or(sig.dialect)
                    ),
                    text,
                )),
                Ok(sig) => Ok((sig, text)),
                Err(e) => Err((format!("/metrics: {e}"), text)),
            }
        }
        Ok((s, _)) => Err((format!("/metrics answered {s}"), String::new())),
        Err(e) => Err((e, String::new())),
    };
    let healthy = matches!(sh.get("/health").await, Ok((s, _)) if s.is_success());
    let listed = match sh.get("/v1/models").await {
        Ok((s, body)) if s.is_success() => serde_json::from_slice::<serde_json::Value>(&body).ok().is_some_and(|v| {
            let ids: Vec<&str> = v["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str()).collect();
            match model {
                Some(m) => ids.contains(&m),
                None => !ids.is_empty(),
            }
        }),
        _ => false,
    };
    let mut last = sh.scraped.lock().unwrap_or_else(|e| e.into_inner());
    let ok = match metrics {
        Ok((sig, text)) => {
            *last = Scraped { signal: Some(sig), text, error: None };
            true
        }
        Err((e, text)) => {
            *last = Scraped { signal: None, text, error: Some(e) };
            false
        }
    };
    if !healthy && last.error.is_none() {
        last.error = Some("the engine's /health is failing".into());
    } else if !listed && last.error.is_none() {
        last.error = Some(match model {
            Some(m) => format!("the engine does not list model `{m}`"),
            None => "the engine lists no model".into(),
        });
    }
    sh.ready.store(ok && healthy && listed, Ordering::Release);
}

async fn healthz(State(sh): State<Arc<Shared>>) -> Response {
    let st = sh.state();
    if st.ready && !st.draining {
        return (StatusCode::OK, "ok\n").into_response();
    }
    let why = if st.draining {
        "draining".to_string()
    } else {
        let last = sh.scraped.lock().unwrap_or_else(|e| e.into_inner());
        last.error.clone().unwrap_or_else(|| "the engine has not been checked yet".into())
    };
    (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")).into_response()
}

async fn metrics(State(sh): State<Arc<Shared>>) -> Response {
    let mut body = {
        let last = sh.scraped.lock().unwrap_or_else(|e| e.into_inner());
        metrics_text(last.signal.as_ref(), sh.state(), &last.text)
    };
    let mut buf = Vec::new();
    let enc = prometheus::TextEncoder::new();
    if prometheus::Encoder::encode(&enc, &sh.registry.gather(), &mut buf).is_ok() {
        body.push_str(&String::from_utf8_lossy(&buf));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn load(State(sh): State<Arc<Shared>>) -> Response {
    let body = {
        let last = sh.scraped.lock().unwrap_or_else(|e| e.into_inner());
        load_json(last.signal.as_ref(), sh.state(), last.error.as_deref())
    };
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Counts a request in flight until its response body is done or dropped.
struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The engine's response body, passed through frame by frame (no buffering).
struct Tracked {
    inner: Incoming,
    started: Instant,
    first: bool,
    _guard: InFlight,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &polled {
            if self.first && f.is_data() {
                self.first = false;
                self._guard.0.ttft.observe(self.started.elapsed().as_secs_f64());
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

async fn proxy(State(sh): State<Arc<Shared>>, req: Request) -> Response {
    let started = Instant::now();
    sh.in_flight.fetch_add(1, Ordering::AcqRel);
    let guard = InFlight(sh.clone());
    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
    let (mut parts, body) = req.into_parts();
    parts.uri = match sh.url(&pq) {
        Ok(u) => u,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("bad request target: {e}")).into_response(),
    };
    parts.headers.remove(header::HOST);
    if let Some(h) = sh.engine.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()) {
        parts.headers.insert(header::HOST, h);
    }
    parts.version = axum::http::Version::HTTP_11;
    match sh.client.request(axum::http::Request::from_parts(parts, body)).await {
        Ok(resp) => {
            let (parts, inner) = resp.into_parts();
            let body = Tracked { inner, started, first: true, _guard: guard };
            Response::from_parts(parts, Body::new(body))
        }
        Err(e) => {
            let msg = serde_json::json!({"error": {"message": format!("engine unreachable: {e}"),
                "type": "service_unavailable", "param": null, "code": 503}});
            (StatusCode::BAD_GATEWAY, axum::Json(msg)).into_response()
        }
    }
}

async fn terminated() {
    #[cfg(unix)]
    {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            tokio::select! { _ = s.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[tokio::main]
async fn main() -> Result<(), Infallible> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let args = Args::parse();
    let engine: Uri = match args.engine_url.parse::<Uri>() {
        Ok(u) if u.scheme_str() == Some("http") && u.authority().is_some() => u,
        _ => {
            eprintln!("switchyard-shim: --engine-url `{}` must be http://HOST:PORT", args.engine_url);
            std::process::exit(2);
        }
    };
    let registry = prometheus::Registry::new();
    let ttft = prometheus::Histogram::with_opts(
        prometheus::HistogramOpts::new(
            "switchyard_shim_ttft_seconds",
            "Time to the first response byte, per proxied request.",
        )
        .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
    )
    .expect("valid histogram");
    registry.register(Box::new(ttft.clone())).expect("registered once");
    let sh = Arc::new(Shared {
        engine,
        client: Client::builder(TokioExecutor::new()).build_http(),
        in_flight: AtomicU64::new(0),
        ready: AtomicBool::new(false),
        draining: AtomicBool::new(false),
        scraped: Mutex::new(Scraped::default()),
        ttft,
        registry,
    });
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("switchyard-shim: binding {}: {e}", args.listen);
            std::process::exit(1);
        }
    };
    let addr = listener.local_addr().unwrap_or(args.listen);
    println!("listening on http://{addr}");
    tracing::info!(%addr, engine = %args.engine_url, dialect = ?args.dialect, "switchyard-shim listening");

    let (expected, model) = (args.dialect.expected(), args.served_model_name.clone());
    let interval = Duration::from_millis(args.scrape_interval_ms.max(10));
    let bg = sh.clone();
    tokio::spawn(async move {
        loop {
            scrape_once(&bg, expected, model.as_deref()).await;
            tokio::time::sleep(interval).await;
        }
    });

    let app = Router::new()
        .route("/-/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/load", get(load))
        .fallback(proxy)
        .with_state(sh.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .into_future(),
    );
    terminated().await;
    // Not ready at once (Kubernetes stops sending new requests), but keep serving what
    // still arrives while in-flight requests finish.
    sh.draining.store(true, Ordering::Release);
    tracing::info!(in_flight = sh.in_flight.load(Ordering::Acquire), "SIGTERM: draining");
    let deadline = Instant::now() + args.drain_timeout;
    while sh.in_flight.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::info!(left = sh.in_flight.load(Ordering::Acquire), "drained; exiting");
    let _ = stop_tx.send(());
    // Idle keep-alive connections close at once; a stream still open past the drain
    // timeout is cut.
    let _ = tokio::time::timeout(Duration::from_secs(1), server).await;
    std::process::exit(0);
}
