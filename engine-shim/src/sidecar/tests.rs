//! The sidecar driven in-process: its [`app`] and [`run`] on loopback listeners in front of
//! a fake engine (an axum router whose `/v1/completions` streams what the test sends it), so
//! the proxy, the in-flight count, `/load`, readiness and the drain are checked without
//! spawning a process.

use std::convert::Infallible;
use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderMap, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, Incoming};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use super::scrape::scrape_once;
use super::*;

const VLLM: &str = include_str!("../testdata/vllm_v1.prom");
/// How long a condition the test waits for may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(10);

/// A response body that yields what the test sends, and ends when the sender is dropped.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl HttpBody for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// The engine behind the sidecar: vLLM metrics, model `llama`, a switchable `/health`, and a
/// completion stream fed by the test.
#[derive(Default)]
struct FakeEngine {
    sick: AtomicBool,
    stream: Mutex<Option<mpsc::Receiver<Bytes>>>,
}

impl FakeEngine {
    /// The next completion streams what is sent on the returned sender.
    fn next_stream(&self) -> mpsc::Sender<Bytes> {
        let (tx, rx) = mpsc::channel(8);
        *self.stream.lock().unwrap() = Some(rx);
        tx
    }

    fn router(self: &Arc<Self>) -> Router {
        let (health, complete) = (self.clone(), self.clone());
        Router::new()
            .route("/metrics", get(|| async { VLLM }))
            .route("/v1/models", get(|| async { r#"{"object":"list","data":[{"id":"llama"}]}"# }))
            .route(
                "/health",
                get(move || async move {
                    if health.sick.load(Ordering::SeqCst) {
                        StatusCode::SERVICE_UNAVAILABLE
                    } else {
                        StatusCode::OK
                    }
                }),
            )
            .route(
                "/v1/completions",
                post(move || async move {
                    let rx = complete.stream.lock().unwrap().take().expect("the test set up a stream");
                    ([(header::CONTENT_TYPE, "text/event-stream")], Body::new(ChannelBody(rx))).into_response()
                }),
            )
            .route("/tokenize", get(echo))
            .route("/collective_rpc", get(echo))
    }
}

/// The fake engine's echo: the Host it got, the target, and whether an admin token arrived.
async fn echo(headers: HeaderMap, uri: axum::http::Uri) -> String {
    let token = if headers.contains_key(ADMIN_TOKEN_HEADER) { " +token" } else { "" };
    format!("{} {uri}{token}", headers[header::HOST].to_str().unwrap())
}

/// Serve `router` on a fresh loopback port.
async fn serve(router: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, router).into_future());
    addr
}

async fn fake_engine() -> (SocketAddr, Arc<FakeEngine>) {
    let engine = Arc::new(FakeEngine::default());
    (serve(engine.router()).await, engine)
}

fn config(engine: SocketAddr) -> SidecarConfig {
    SidecarConfig {
        engine: parse_engine_url(&format!("http://{engine}")).unwrap(),
        dialect: None,
        served_model_name: None,
        scrape_interval: MIN_SCRAPE_INTERVAL,
        drain_timeout: Duration::from_secs(20),
        access: AccessPolicy::new(&[], None),
    }
}

fn sidecar(config: SidecarConfig) -> Arc<Sidecar> {
    Arc::new(Sidecar::new(config).unwrap())
}

async fn send(addr: SocketAddr, method: Method, path: &str) -> Response<Incoming> {
    let client: Client<HttpConnector, Body> = Client::builder(TokioExecutor::new()).build_http();
    let req = Request::builder().method(method).uri(format!("http://{addr}{path}")).body(Body::from("{}")).unwrap();
    client.request(req).await.unwrap()
}

async fn text(addr: SocketAddr, path: &str) -> (StatusCode, String) {
    let resp = send(addr, Method::GET, path).await;
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

async fn load(addr: SocketAddr) -> serde_json::Value {
    serde_json::from_str(&text(addr, "/load").await.1).unwrap()
}

/// Poll `check` until it holds, failing after [`PATIENCE`].
async fn eventually<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < PATIENCE, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn next_chunk(resp: &mut Response<Incoming>) -> Bytes {
    resp.body_mut().frame().await.expect("a frame").expect("no error").into_data().expect("data")
}

#[tokio::test]
async fn a_request_counts_in_flight_until_its_body_ends_and_ttft_is_observed_once() {
    let (engine, fake) = fake_engine().await;
    let sh = sidecar(config(engine));
    let addr = serve(app(sh.clone())).await;

    let tx = fake.next_stream();
    tx.send(Bytes::from("data: 1\n\n")).await.unwrap();
    let mut resp = send(addr, Method::POST, "/v1/completions").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()[header::CONTENT_TYPE], "text/event-stream");
    assert_eq!(next_chunk(&mut resp).await, "data: 1\n\n", "the first chunk arrives before the stream ends");
    assert_eq!(load(addr).await["in_flight"], 1, "counted while the body is open");
    tx.send(Bytes::from("data: 2\n\n")).await.unwrap();
    assert_eq!(next_chunk(&mut resp).await, "data: 2\n\n");
    drop(tx);
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "");
    eventually("in_flight back to 0 once the body ended", || async { load(addr).await["in_flight"] == 0 }).await;
    let (_, metrics) = text(addr, "/metrics").await;
    assert!(metrics.contains("switchyard_shim_ttft_seconds_count 1\n"), "{metrics}");
    assert!(metrics.contains("switchyard_shim_in_flight_requests 0\n"));

    // A client that goes away mid-stream ends the request too.
    let tx = fake.next_stream();
    tx.send(Bytes::from("data: 1\n\n")).await.unwrap();
    let mut resp = send(addr, Method::POST, "/v1/completions").await;
    next_chunk(&mut resp).await;
    assert_eq!(sh.in_flight.get(), 1);
    drop(resp);
    eventually("in_flight back to 0 once the client left", || async { sh.in_flight.get() == 0 }).await;
    drop(tx);

    // Path and query pass through; Host is the engine's.
    assert_eq!(text(addr, "/tokenize?x=1").await, (StatusCode::OK, format!("{engine} /tokenize?x=1")));
}

#[tokio::test]
async fn admin_paths_need_the_token_and_the_token_never_reaches_the_engine() {
    let (engine, _fake) = fake_engine().await;
    let sh = sidecar(SidecarConfig { access: AccessPolicy::new(&[], Some("s3cret")), ..config(engine) });
    let addr = serve(app(sh.clone())).await;

    let (status, body) = text(addr, "/collective_rpc").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let err: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["type"], "permission_error", "{body}");
    let (_, metrics) = text(addr, "/metrics").await;
    assert!(metrics.contains("switchyard_shim_refused_requests_total 1"), "{metrics}");

    let with_token = |path: &'static str, token: &'static str| {
        let client: Client<HttpConnector, Body> = Client::builder(TokioExecutor::new()).build_http();
        async move {
            let req = Request::get(format!("http://{addr}{path}"))
                .header(ADMIN_TOKEN_HEADER, token)
                .body(Body::empty())
                .unwrap();
            let resp = client.request(req).await.unwrap();
            let status = resp.status();
            (status, String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap())
        }
    };
    assert_eq!(with_token("/collective_rpc", "s3cret").await, (StatusCode::OK, format!("{engine} /collective_rpc")));
    assert_eq!(with_token("/collective_rpc", "guess").await.0, StatusCode::FORBIDDEN);
    assert_eq!(
        with_token("/tokenize", "guess").await,
        (StatusCode::OK, format!("{engine} /tokenize")),
        "an inference route passes whatever the token, and the header is removed"
    );
}

#[tokio::test]
async fn load_and_healthz_follow_the_last_scrape() {
    let (engine, fake) = fake_engine().await;
    let sh = sidecar(config(engine));
    let addr = serve(app(sh.clone())).await;
    assert_eq!(
        text(addr, "/-/healthz").await,
        (StatusCode::SERVICE_UNAVAILABLE, "not ready: the engine has not been checked yet\n".into())
    );

    scrape_once(&sh).await;
    assert_eq!(text(addr, "/-/healthz").await, (StatusCode::OK, "ok\n".into()));
    let resp = send(addr, Method::GET, "/load").await;
    assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
    let want = crate::parse_load_signal(VLLM, 0).unwrap();
    let got = load(addr).await;
    assert_eq!(got["dialect"], "vllm");
    assert_eq!((got["waiting"].as_f64(), got["running"].as_f64()), (Some(want.waiting), Some(want.running)));
    assert_eq!(
        (got["in_flight"].as_u64(), &got["ready"], &got["draining"], &got["error"]),
        (Some(0), &true.into(), &false.into(), &serde_json::Value::Null)
    );
    let back = crate::expose::parse_load_json(&text(addr, "/load").await.1, 0).unwrap();
    assert_eq!((back.waiting, back.running, back.kv_usage), (want.waiting, want.running, want.kv_usage));
    let (_, metrics) = text(addr, "/metrics").await;
    assert!(metrics.contains(&format!("vllm:num_requests_running{{engine_dialect=\"vllm\"}} {}\n", want.running)));
    assert!(metrics.contains("switchyard_shim_ready 1\n"));

    fake.sick.store(true, Ordering::SeqCst);
    scrape_once(&sh).await;
    assert_eq!(
        text(addr, "/-/healthz").await,
        (StatusCode::SERVICE_UNAVAILABLE, "not ready: the engine's /health is failing\n".into())
    );
    let got = load(addr).await;
    assert_eq!((&got["ready"], &got["error"]), (&false.into(), &"the engine's /health is failing".into()));

    let other = sidecar(SidecarConfig { dialect: Some(Dialect::Tgi), ..config(engine) });
    scrape_once(&other).await;
    assert_eq!(other.last_scrape().error.as_deref(), Some("the engine's metrics are vllm, --dialect says tgi"));
}

#[tokio::test]
async fn shutdown_turns_readiness_off_at_once_and_waits_for_the_open_stream() {
    let (engine, fake) = fake_engine().await;
    let sh = sidecar(config(engine));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(run(sh, listener, async {
        let _ = stopped.await;
    }));
    eventually("ready", || async { text(addr, "/-/healthz").await.0 == StatusCode::OK }).await;

    let tx = fake.next_stream();
    tx.send(Bytes::from("data: 1\n\n")).await.unwrap();
    let mut resp = send(addr, Method::POST, "/v1/completions").await;
    next_chunk(&mut resp).await;
    stop.send(()).unwrap();
    eventually("not ready once the signal came", || async {
        text(addr, "/-/healthz").await == (StatusCode::SERVICE_UNAVAILABLE, "not ready: draining\n".into())
    })
    .await;
    let got = load(addr).await;
    assert_eq!((&got["draining"], &got["ready"], got["in_flight"].as_u64()), (&true.into(), &false.into(), Some(1)));
    assert!(crate::expose::parse_load_json(&got.to_string(), 0).is_err(), "a gateway reading /load stops routing here");
    assert_eq!(text(addr, "/v1/models").await.0, StatusCode::OK, "what still arrives is served");
    assert!(!running.is_finished(), "the open stream holds the drain");

    tx.send(Bytes::from("data: [DONE]\n\n")).await.unwrap();
    drop(tx);
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "data: [DONE]\n\n");
    let left = tokio::time::timeout(PATIENCE, running).await.expect("run returns after the drain").unwrap();
    assert_eq!(left, 0);
}

#[tokio::test]
async fn a_stream_open_past_the_drain_timeout_is_left_behind() {
    let (engine, fake) = fake_engine().await;
    let sh = sidecar(SidecarConfig { drain_timeout: Duration::from_millis(50), ..config(engine) });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(run(sh, listener, async {
        let _ = stopped.await;
    }));
    let tx = fake.next_stream();
    tx.send(Bytes::from("data: 1\n\n")).await.unwrap();
    let mut resp = send(addr, Method::POST, "/v1/completions").await;
    next_chunk(&mut resp).await;
    stop.send(()).unwrap();
    let left = tokio::time::timeout(PATIENCE, running).await.expect("run returns after the timeout").unwrap();
    assert_eq!(left, 1);
    drop(tx);
}

#[tokio::test]
async fn an_unreachable_engine_answers_502_in_the_openai_shape() {
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let sh = sidecar(config(gone));
    let addr = serve(app(sh.clone())).await;
    let resp = send(addr, Method::POST, "/v1/completions").await;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
    let body: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("engine unreachable: "), "{body}");
    assert_eq!(body, crate::openai_error::error_body(message, "service_unavailable", None, None));
    assert_eq!(sh.in_flight.get(), 0, "a failed request is not left in flight");

    scrape_once(&sh).await;
    let (status, why) = text(addr, "/-/healthz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(why.starts_with("not ready: /metrics: "), "{why}");
}

#[test]
fn the_engine_url_must_be_http_with_a_host() {
    assert!(parse_engine_url("http://127.0.0.1:8000").is_ok());
    for bad in ["https://e:8000", "127.0.0.1:8000", "/v1", "http://"] {
        let e = parse_engine_url(bad).unwrap_err();
        assert_eq!(e.to_string(), format!("--engine-url `{bad}` must be http://HOST:PORT"));
    }
}

/// An engine whose `/metrics` floods or trickles fails the check instead of holding the
/// scrape loop or the sidecar's memory (#24, low).
#[tokio::test]
async fn a_flooding_or_trickling_metrics_answer_fails_the_check() {
    let flood = Router::new()
        .route("/metrics", get(|| async { "x".repeat(scrape::MAX_FETCH_BYTES + 1) }))
        .route("/health", get(|| async { "" }))
        .route("/v1/models", get(|| async { r#"{"object":"list","data":[{"id":"llama"}]}"# }));
    let sh = sidecar(config(serve(flood).await));
    scrape_once(&sh).await;
    let error = sh.last_scrape().error.clone().unwrap_or_default();
    assert!(error.contains("at most"), "{error}");

    // A header, then a body that never ends.
    let trickle = Router::new()
        .route(
            "/metrics",
            get(|| async {
                let (tx, rx) = mpsc::channel(1);
                tokio::spawn(async move {
                    let _ = tx.send(Bytes::from_static(b"# HELP ")).await;
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    drop(tx);
                });
                Body::new(ChannelBody(rx))
            }),
        )
        .route("/health", get(|| async { "" }))
        .route("/v1/models", get(|| async { r#"{"object":"list","data":[{"id":"llama"}]}"# }));
    let sh = sidecar(config(serve(trickle).await));
    let started = Instant::now();
    tokio::time::timeout(scrape::FETCH_TIMEOUT * 4, scrape_once(&sh)).await.expect("the scrape ended");
    let error = sh.last_scrape().error.clone().unwrap_or_default();
    assert!(error.contains("no whole answer"), "{error} after {:?}", started.elapsed());
}
