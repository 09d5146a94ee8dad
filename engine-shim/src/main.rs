//! `switchyard-shim`: the sidecar in every engine pod — an unbuffered proxy that counts
//! requests in flight, the engine's load normalized on `/metrics` and `/load`, readiness on
//! `/-/healthz`, and a drain on SIGTERM ([`switchyard_shim::sidecar`] has the details).
//!
//! This binary only parses the flags into a [`SidecarConfig`], builds the [`Sidecar`], binds
//! the listener, prints `listening on http://ADDR` and runs until SIGTERM, then exits 0.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use switchyard_shim::process::terminated;
use switchyard_shim::sidecar::{parse_engine_url, run, AccessPolicy, Sidecar, SidecarConfig};
use switchyard_shim::Dialect;

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
    /// Also forward paths under PREFIX to the engine (repeatable). By default only inference
    /// routes are (the OpenAI `/v1/*` inference routes, `/tokenize`, `/detokenize`,
    /// `/v1/models`, `/health`); `/` forwards every path.
    #[arg(long = "allow-path", value_name = "PREFIX")]
    allow_paths: Vec<String>,
    /// A caller sending this token in `X-Switchyard-Admin-Token` reaches every engine path.
    #[arg(long, env = "SWITCHYARD_SHIM_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let n = s.strip_suffix('s').unwrap_or(s);
    n.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("`{s}` is not a number of seconds"))
}

#[tokio::main]
async fn main() -> Result<(), Infallible> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let args = Args::parse();
    let engine = parse_engine_url(&args.engine_url).unwrap_or_else(|e| {
        eprintln!("switchyard-shim: {e}");
        std::process::exit(2);
    });
    let config = SidecarConfig {
        engine,
        dialect: args.dialect.expected(),
        served_model_name: args.served_model_name.clone(),
        scrape_interval: Duration::from_millis(args.scrape_interval_ms),
        drain_timeout: args.drain_timeout,
        access: AccessPolicy::new(&args.allow_paths, args.admin_token.as_deref()),
    };
    let sidecar = Sidecar::new(config).unwrap_or_else(|e| {
        eprintln!("switchyard-shim: {e}");
        std::process::exit(1);
    });
    let listener = tokio::net::TcpListener::bind(args.listen).await.unwrap_or_else(|e| {
        eprintln!("switchyard-shim: binding {}: {e}", args.listen);
        std::process::exit(1);
    });
    let addr = listener.local_addr().unwrap_or(args.listen);
    println!("listening on http://{addr}");
    tracing::info!(%addr, engine = %args.engine_url, dialect = ?args.dialect, "switchyard-shim listening");
    run(Arc::new(sidecar), listener, terminated()).await;
    std::process::exit(0);
}
