//! The pingora server: listeners, services and the order they start in.
//!
//! Listeners are bound here, before pingora starts, so that `listen: 127.0.0.1:0` works: the
//! gateway binds, learns the port the kernel gave, prints it (`listening on http://ADDR`,
//! `admin listening on http://ADDR`, like the engine's line) and hands the listening socket
//! to pingora through its file-descriptor table ([`PreBound`]) — the same table pingora uses
//! to take over sockets during a zero-downtime upgrade. Connections that arrive between the
//! print and pingora's first accept wait in the kernel's backlog.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::IntoRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::listeners::ListenerConfig;
use pingora::protocols::l4::stream::L4BufferSettings;
use pingora::server::configuration::ServerConf;
use pingora::server::{ListenFds, RunArgs, Server, ShutdownWatch};
use pingora::services::background::background_service;
use pingora::services::listening::Service;
use pingora::services::{ServiceReadyNotifier, ServiceWithDependents};

use crate::config::GatewayConfig;
use crate::{admin, connection, cores, discovery, drain, metrics, proxy, reload, scrape, state, tls};

/// Buffers of a TLS client connection accepted by pingora (`work_stealing: true`; the cores
/// of [`cores`] hand rustls an unbuffered socket). The write buffer holds a response header
/// until the first body write, so header and first chunk leave in one `write` (pingora's
/// default of 1,460 bytes is smaller than a typical first SSE chunk plus header, which costs
/// a second syscall per response); it is allocated per connection, so 16 KiB × 1,000
/// connections = 16 MB.
fn tls_client_buffers() -> L4BufferSettings {
    L4BufferSettings::default().write(16 * 1024)
}

/// Buffers of a cleartext client connection: none. The HTTP/1.1 session keeps its own read
/// buffer and writes a response's head and data in one vectored write
/// ([`crate::downstream::H1Connection`]); h2 frames its own. A buffer between them and the
/// socket only copied every byte once more (~1k instructions per request).
fn cleartext_client_buffers() -> L4BufferSettings {
    L4BufferSettings::unbuffered()
}

/// Bind `addr` (port 0: any free port) and listen; the socket is handed to pingora later.
fn bind(what: &str, addr: &str) -> anyhow::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).map_err(|e| anyhow::anyhow!("binding {what} {addr}: {e}"))?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    Ok((listener, bound))
}

/// A listening service whose sockets were bound before pingora started: they are put into
/// pingora's descriptor table under the address the service listens on, so pingora adopts
/// them instead of binding again.
struct PreBound<S> {
    inner: S,
    sockets: Vec<(SocketAddr, TcpListener)>,
}

#[async_trait]
impl<S: ServiceWithDependents> ServiceWithDependents for PreBound<S> {
    async fn start_service(
        &mut self,
        fds: Option<ListenFds>,
        shutdown: ShutdownWatch,
        listeners_per_fd: usize,
        ready: ServiceReadyNotifier,
    ) {
        if let Some(table) = &fds {
            let mut table = table.lock();
            for (addr, socket) in self.sockets.drain(..) {
                // pingora owns (and closes) the socket from here on.
                table.add(addr.to_string(), socket.into_raw_fd());
            }
        }
        self.inner.start_service(fds, shutdown, listeners_per_fd, ready).await
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn threads(&self) -> Option<usize> {
        self.inner.threads()
    }

    fn on_startup_delay(&self, waited: Duration) {
        self.inner.on_startup_delay(waited)
    }

    fn listen_addresses(&self) -> Option<Vec<String>> {
        self.inner.listen_addresses()
    }
}

/// Build the pingora server for a validated config and run it until shutdown
/// (SIGTERM: graceful drain, see [`drain`]; SIGINT: fast).
pub fn run(config: GatewayConfig, config_path: PathBuf) -> anyhow::Result<()> {
    let registry = prometheus::Registry::new();
    let metrics = metrics::GatewayMetrics::new(registry)?;
    let conf = server_conf(&config);
    let threads = conf.threads;
    let api = config.listen.as_deref().map(|addr| bind("listen", addr)).transpose()?;
    let (admin_socket, admin_addr) = bind("admin_listen", &config.admin_listen)?;
    let epp = config.epp.clone().map(|e| bind("epp.listen", &e.listen).map(|s| (e, s))).transpose()?;
    let certs = config.tls.as_ref().map(tls::CertStore::load).transpose().map_err(|e| anyhow::anyhow!("tls: {e}"))?;
    let tokenizer = load_tokenizer(&config)?;
    let state = state::GatewayState::new(config, metrics, tokenizer);

    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let app = Arc::new(proxy::ProxyApp::new(state.clone()));
    let api_addr = api.as_ref().map(|(_, addr)| *addr);
    // The cores' runtimes (`work_stealing: false`), where the KV-event streams are followed.
    let core_runtimes = match api {
        Some(api) => add_api_listener(&mut server, &app, &state, api, certs.as_ref())?,
        None => Vec::new(),
    };
    let mut admin = Service::new("switchyard-admin".into(), admin::AdminApp::new(state.clone()));
    admin.add_tcp(&admin_addr.to_string());
    server.add_service(PreBound { inner: admin, sockets: vec![(admin_addr, admin_socket)] });
    let epp_addr = epp.as_ref().map(|(_, (_, addr))| *addr);
    if let Some((settings, (socket, _))) = epp {
        server.add_service(background_service("epp", crate::epp::EppService::new(app, settings, socket)));
    }
    add_background_services(&mut server, &state, core_runtimes);
    let drain = {
        let (settings, flush) = (state.clone(), state.clone());
        drain::DrainSignal::new(
            state.lifecycle.clone(),
            move || settings.active.load().config.drain.clone(),
            move || flush.access_log.flush(),
        )
    };
    let work_stealing = state.active.load().config.work_stealing;
    server.add_service(background_service("config-reloader", reload::Reloader::new(state, config_path, certs.clone())));
    tracing::info!(listen = ?api_addr, admin_listen = %admin_addr, epp_listen = ?epp_addr, threads,
        work_stealing, tls = certs.is_some(), "switchyard-gateway starting");
    // Lines a supervisor (or a test that asked for port 0) waits for: the sockets listen now.
    if let Some(addr) = epp_addr {
        println!("epp listening on grpc://{addr}");
    }
    if let Some(addr) = api_addr {
        println!("listening on {}://{addr}", if certs.is_some() { "https" } else { "http" });
    }
    println!("admin listening on http://{admin_addr}");
    server.run(RunArgs { shutdown_signal: Box::new(drain) });
    Ok(())
}

/// pingora's settings for `config`: its own runtimes (the admin listener, background
/// services; the API listener too with `work_stealing: true`) and the drain's timings.
fn server_conf(config: &GatewayConfig) -> ServerConf {
    ServerConf {
        threads: config.worker_threads(),
        // pingora's one-runtime-per-thread mode is not used: `work_stealing: false` serves
        // the API listener from `cores`.
        work_stealing: true,
        // pingora sleeps this long after closing the listeners; `drain` exits earlier
        // when nothing is left in flight.
        grace_period_seconds: Some(
            config.drain.grace_period_secs.saturating_sub(config.drain.close_listeners_after_ms / 1000),
        ),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    }
}

/// `kv_events.tokenizer`, loaded (once, at start).
fn load_tokenizer(config: &GatewayConfig) -> anyhow::Result<Option<Arc<switchyard_tokenizer::ModelTokenizer>>> {
    let Some(path) = config.kv_events.as_ref().and_then(|k| k.tokenizer.as_ref()) else { return Ok(None) };
    let started = std::time::Instant::now();
    let t = switchyard_tokenizer::load(path).map_err(|e| anyhow::anyhow!("kv_events.tokenizer: {e}"))?;
    tracing::info!(path = %path.display(), vocab = t.vocab_len(), chat_template = t.has_chat_template(),
        ms = started.elapsed().as_millis() as u64, "tokenizer loaded");
    Ok(Some(Arc::new(t)))
}

/// The API listener on its bound socket: pingora's service (`work_stealing: true`) or the
/// gateway's own cores, behind TLS when `certs` are given. Returns the cores' runtimes (none
/// with pingora's).
fn add_api_listener(
    server: &mut Server,
    app: &Arc<proxy::ProxyApp>,
    state: &Arc<state::GatewayState>,
    (api_socket, api_addr): (TcpListener, SocketAddr),
    certs: Option<&Arc<tls::CertStore>>,
) -> anyhow::Result<Vec<tokio::runtime::Handle>> {
    let (work_stealing, cores, http2) = {
        let config = &state.active.load().config;
        (config.work_stealing, config.core_threads(), config.tls.as_ref().is_some_and(|t| t.http2))
    };
    let edge = connection::Edge::new(app.clone(), state.clone());
    let tls_settings = || -> anyhow::Result<Option<pingora::listeners::tls::TlsSettings>> {
        let Some(store) = certs else { return Ok(None) };
        let mut settings = pingora::listeners::tls::TlsSettings::intermediate("", "")?;
        settings.set_cert_resolver(store.clone());
        if http2 {
            settings.enable_h2();
        }
        Ok(Some(settings))
    };
    if work_stealing {
        let mut proxy = Service::new("switchyard-proxy".into(), edge);
        let listen = api_addr.to_string();
        match tls_settings()? {
            Some(tls) => proxy.add_listener(ListenerConfig::tcp(&listen).tls(tls).l4_buffer(tls_client_buffers())),
            None => proxy.add_listener(ListenerConfig::tcp(&listen).l4_buffer(cleartext_client_buffers())),
        }
        server.add_service(PreBound { inner: proxy, sockets: vec![(api_addr, api_socket)] });
        return Ok(Vec::new());
    }
    let acceptor = tls_settings()?.map(|settings| Arc::new(settings.build()));
    let open = &state.metrics.core_connections;
    let serving = cores::Cores::new(api_socket, cores, Arc::new(edge), acceptor, open)?;
    let runtimes = serving.runtimes();
    server.add_service(background_service("switchyard-proxy", serving));
    Ok(runtimes)
}

/// The background services the config asks for: the scraper; DNS, Kubernetes and
/// InferencePool discovery; the shared limits' heartbeat; the KV-event streams (on
/// `core_runtimes` when there are any).
fn add_background_services(
    server: &mut Server,
    state: &Arc<state::GatewayState>,
    core_runtimes: Vec<tokio::runtime::Handle>,
) {
    server.add_service(background_service("scraper", scrape::Scraper::new(state.active.clone())));
    let discovery_cfg = state.active.load().config.discovery.clone();
    let publisher = || {
        let state = state.clone();
        discovery::Publisher::new(move |urls| state.set_discovered(urls))
    };
    if let Some(d) = discovery_cfg.dns {
        server.add_service(background_service("dns-discovery", discovery::dns::DnsService::new(publisher(), d)));
    }
    if let Some(k) = discovery_cfg.kubernetes {
        let service = discovery::kubernetes::K8sDiscovery::new(publisher(), k);
        server.add_service(background_service("kubernetes-discovery", service));
    }
    if let Some(p) = discovery_cfg.inference_pool {
        let service = discovery::inference_pool::PoolDiscovery::new(publisher(), p);
        server.add_service(background_service("inference-pool-discovery", service));
    }
    if let Some(limits) = state.shared_limits.clone() {
        server.add_service(background_service("shared-limits", crate::shared_limits::Heartbeat(limits)));
    }
    if let Some(events) = state.kv_events.clone() {
        let service =
            crate::kv_events::subscriber::KvEventsService::new(state.active.clone(), events, state.metrics.clone())
                .on_runtimes(core_runtimes);
        server.add_service(background_service("kv-events", service));
    }
}
