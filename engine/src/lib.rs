//! # switchyard-engine
//!
//! Switchyard's bundled LLM engine. It behaves like a vLLM pod — OpenAI API, continuous
//! batching with chunked prefill, a paged KV cache with prefix caching, preemption, vLLM's
//! metric names — so the gateway, the load generator and every routing experiment can
//! run against it. Backends plug in under one scheduler and one block pool:
//! `sim` models a GPU's step times (an 8-pod H100 cluster runs on a laptop).
//!
//! Layout: [`kv`] (block pool and the KV cache manager, pure) → [`scheduler`] (step planning
//! in token space, pure) → [`backend`] (executes a step) → [`engine_core`] (the three
//! together, stepped by a caller) → [`runtime`] (the thread that paces the core and, through
//! the [`output_processor`], turns tokens into text) → [`server`] (HTTP).

pub mod backend;
pub mod config;
pub mod engine_core;
pub mod error;
pub mod kv;
pub mod kv_events;
pub mod metrics;
pub mod model;
pub mod output_processor;
pub mod runtime;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod structured;
pub mod tokenizer;

use std::future::{Future, IntoFuture};
use std::sync::Arc;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::{EngineArgs, EngineConfig};

/// A built engine: its HTTP routes and the thread behind them.
pub struct Engine {
    /// The axum router (usable without a socket in tests).
    pub router: axum::Router,
    /// Shared handler state.
    pub state: Arc<server::AppState>,
    /// The engine thread; it exits once the router and state are dropped.
    pub thread: std::thread::JoinHandle<()>,
    /// The configuration, completed by the model (cpu: context length, KV blocks).
    pub config: EngineConfig,
    /// Why the engine thread stopped, once it has failed (`None` while it works).
    pub failed: watch::Receiver<Option<String>>,
}

/// Build the engine a configuration describes and start its thread.
pub fn build(cfg: &EngineConfig) -> anyhow::Result<Engine> {
    let (cfg, core, tokenizer) = engine_core::EngineCore::load(cfg)?;
    let cfg = &cfg;
    let registry = prometheus::Registry::new();
    let metrics = metrics::EngineMetrics::new(&registry, &cfg.served_model_name, cfg.block_size, cfg.num_blocks)?;
    let output = output_processor::OutputProcessor::new(tokenizer.clone());
    let mut core = core;
    let kv_events = match &cfg.kv_events {
        Some(kv) => {
            core.scheduler.enable_kv_events();
            Some(kv_events::start(kv, metrics.kv_events_dropped.clone())?)
        }
        None => None,
    };
    let (handle, thread, failed) = runtime::spawn(core, output, metrics, kv_events);
    let limits = server::openai::Limits {
        max_model_len: cfg.scheduler.max_model_len,
        kv_capacity_tokens: cfg.kv_capacity_tokens(),
        block_size: cfg.block_size,
        // vLLM's default `--max-logprobs`; a timing model has no distribution to report.
        max_logprobs: match cfg.backend {
            config::BackendKind::Cpu => 20,
            config::BackendKind::Sim => 0,
        },
        max_prompt_bytes: cfg.prompt_byte_limit(),
    };
    let state = Arc::new(
        server::AppState::new(
            handle,
            tokenizer,
            cfg.served_model_name.clone(),
            limits,
            cfg.seed,
            registry,
            failed.clone(),
        )
        .with_prepare_threads(cfg.prepare_threads),
    );
    Ok(Engine { router: server::router(state.clone()), state, thread, config: cfg.clone(), failed })
}

/// Serve `engine` on `listener` until `shutdown` resolves or the engine fails. Then no new
/// connection is accepted, idle ones close, and the responses in flight run to their end
/// for at most `--shutdown-timeout` (a pod's drain: the streams of a terminating engine
/// finish). A failed engine is an error, so the process exits non-zero.
pub async fn serve(
    engine: Engine,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut failed = engine.failed.clone();
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let stop = async move {
        tokio::select! {
            _ = shutdown => {}
            // A closed channel means the engine thread is gone without a word: a failure too.
            _ = failed.wait_for(Option::is_some) => {}
        }
        let _ = stopping.send(());
    };
    let failed = engine.failed.clone();
    let grace = engine.config.shutdown_timeout;
    let listener = listener.tap_io(|tcp| {
        // SSE chunks are small: never let Nagle hold them back.
        let _ = tcp.set_nodelay(true);
    });
    let serving = axum::serve(listener, engine.router).with_graceful_shutdown(stop).into_future();
    let past_grace = async {
        if stopped.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        served = serving => served?,
        () = past_grace => tracing::warn!(
            shutdown_timeout_s = grace.as_secs(),
            "requests still in flight after --shutdown-timeout; exiting without them"
        ),
    }
    let reason = failed.borrow().clone();
    match reason {
        Some(r) => Err(std::io::Error::other(r)),
        None if failed.has_changed().is_err() => Err(std::io::Error::other("the engine thread stopped")),
        None => Ok(()),
    }
}
