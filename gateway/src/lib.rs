//! # switchyard-gateway
//!
//! The edge proxy in front of LLM engines, on pingora. It speaks the OpenAI API, streams
//! responses without buffering, and sends each request to the engine where it will start
//! soonest, judged by the engines' own queue and KV-cache signals (scraped in the
//! background) and by its own in-flight counts.
//!
//! Layout: [`config`] (file, validation) → [`state`] (what is in force, swapped atomically)
//! → [`cluster`] (backends, health) → [`policy`] (pure routing decisions) → [`proxy`] (the
//! request path) ; background services [`scrape`] and [`reload`]; [`admin`] and [`metrics`].

pub mod access_log;
pub mod admin;
pub mod admission;
pub mod auth;
pub mod cluster;
pub mod config;
pub mod dns;
pub mod drain;
pub mod error;
pub mod fuzzing;
pub mod k8s;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod prefix;
pub mod proxy;
pub mod reload;
pub mod request;
pub mod retry;
pub mod scrape;
pub mod state;
pub mod tls;

use std::path::PathBuf;

use pingora::listeners::ListenerConfig;
use pingora::protocols::l4::stream::L4BufferSettings;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server};
use pingora::services::background::background_service;
use pingora::services::listening::Service;

pub use config::GatewayConfig;

/// Buffers of a client connection. The write buffer holds a response header until the first
/// body write, so header and first chunk leave in one `write` (pingora's default of 1,460
/// bytes is smaller than a typical first SSE chunk plus header, which costs a second syscall
/// per response); it is allocated per connection, so 16 KiB × 1,000 connections = 16 MB.
fn client_buffers() -> L4BufferSettings {
    L4BufferSettings::default().write(16 * 1024)
}

/// Build the pingora server for a validated config and run it until shutdown
/// (SIGTERM: graceful drain, see [`drain`]; SIGINT: fast).
pub fn run(config: GatewayConfig, config_path: PathBuf) -> anyhow::Result<()> {
    let registry = prometheus::Registry::new();
    let metrics = metrics::GatewayMetrics::new(registry)?;
    let threads = match config.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let conf = ServerConf {
        threads,
        work_stealing: config.work_stealing,
        // pingora sleeps this long after closing the listeners; `drain` exits earlier
        // when nothing is left in flight.
        grace_period_seconds: Some(
            config.drain.grace_period_secs.saturating_sub(config.drain.close_listeners_after_ms / 1000),
        ),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let (listen, admin_listen) = (config.listen.clone(), config.admin_listen.clone());
    let certs = config.tls.as_ref().map(tls::CertStore::load).transpose().map_err(|e| anyhow::anyhow!("tls: {e}"))?;
    let http2 = config.tls.as_ref().is_some_and(|t| t.http2);
    let state = state::GatewayState::new(config, metrics);
    let drain_state = state.clone();

    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = Service::new("switchyard-proxy".into(), proxy::ProxyApp::new(state.clone()));
    match &certs {
        Some(store) => {
            let mut settings = pingora::listeners::tls::TlsSettings::intermediate("", "")?;
            settings.set_cert_resolver(store.clone());
            if http2 {
                settings.enable_h2();
            }
            proxy.add_listener(ListenerConfig::tcp(&listen).tls(settings).l4_buffer(client_buffers()));
        }
        None => proxy.add_listener(ListenerConfig::tcp(&listen).l4_buffer(client_buffers())),
    }
    let mut admin = Service::new("switchyard-admin".into(), admin::AdminApp::new(state.clone()));
    admin.add_tcp(&admin_listen);
    server.add_service(proxy);
    server.add_service(admin);
    server.add_service(background_service("scraper", scrape::Scraper::new(state.clone())));
    if let Some(d) = state.active.load().config.discovery.dns.clone() {
        server.add_service(background_service("dns-discovery", dns::DnsService::new(state.clone(), d)));
    }
    if let Some(k) = state.active.load().config.discovery.kubernetes.clone() {
        server.add_service(background_service("kubernetes-discovery", k8s::K8sDiscovery::new(state.clone(), k)));
    }
    server.add_service(background_service("config-reloader", reload::Reloader::new(state, config_path, certs.clone())));
    tracing::info!(%listen, %admin_listen, threads, tls = certs.is_some(), "switchyard-gateway starting");
    server.run(RunArgs { shutdown_signal: Box::new(drain::DrainSignal::new(drain_state)) });
    Ok(())
}
