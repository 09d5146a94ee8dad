//! `switchyard-engine`: flags → config → engine → serve.

use anyhow::Context;
use clap::Parser;
use switchyard_engine::{EngineArgs, EngineConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let args = EngineArgs::parse();
    let cfg = match EngineConfig::from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("switchyard-engine: {e}");
            std::process::exit(2);
        }
    };
    let listener =
        tokio::net::TcpListener::bind(cfg.listen).await.with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let engine = match switchyard_engine::build(&cfg) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("switchyard-engine: {e:#}");
            std::process::exit(1);
        }
    };
    let cfg = engine.config.clone();
    tracing::info!(
        %addr,
        model = %cfg.served_model_name,
        backend = ?cfg.backend,
        sim_profile = cfg.sim_profile.name,
        num_gpu_blocks = cfg.num_blocks,
        block_size = cfg.block_size,
        max_model_len = cfg.scheduler.max_model_len,
        "switchyard-engine listening"
    );
    // A line a supervisor can wait for, with the real port when --port 0 was given.
    println!("listening on http://{addr}");
    switchyard_engine::serve(engine, listener, shutdown_signal()).await?;
    Ok(())
}

/// The first SIGTERM or Ctrl-C (the helper every Switchyard binary shares), logged.
async fn shutdown_signal() {
    switchyard_shim::process::terminated().await;
    tracing::info!("shutting down");
}
