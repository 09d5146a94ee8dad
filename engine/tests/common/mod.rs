//! Engine test helpers: an in-process engine on `127.0.0.1:0`; the HTTP client and metric
//! helpers come from the shared test kit.
#![allow(dead_code)]

use std::net::SocketAddr;

use clap::Parser;
use switchyard_engine::{EngineArgs, EngineConfig};
pub use switchyard_testkit::*;
use tokio::net::TcpListener;

/// Start an engine with `flags` (plus `--host 127.0.0.1 --port 0`) inside this runtime.
pub async fn spawn_engine(flags: &[&str]) -> SocketAddr {
    let mut argv = vec!["switchyard-engine", "--host", "127.0.0.1", "--port", "0"];
    argv.extend_from_slice(flags);
    let cfg = EngineConfig::from_args(&EngineArgs::parse_from(argv)).expect("valid flags");
    let listener = TcpListener::bind(cfg.listen).await.expect("bind");
    let addr = listener.local_addr().unwrap();
    let engine = switchyard_engine::build(&cfg).expect("build");
    tokio::spawn(switchyard_engine::serve(engine, listener, std::future::pending()));
    addr
}
