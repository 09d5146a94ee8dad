//! Config hot reload and the shutdown hook.
//!
//! The file is polled every [`POLL_INTERVAL`] (content compared, which also catches the
//! symlink swap Kubernetes does for a mounted ConfigMap) and reloaded on SIGHUP; so is
//! `auth.keys_file`, whose change swaps in the new key table alone (a revoked key is refused
//! within a poll; an unreadable or invalid file keeps the keys in force). A valid
//! file is applied atomically ([`GatewayState::apply`]); an invalid one leaves the old
//! config in force, is logged with every field error and counted as
//! `switchyard_config_reloads_total{result="error"}`.
//!
//! It also resolves backend host names again every `discovery.resolve_interval_ms` (see
//! [`GatewayState::re_resolve`]), writes out the buffered access log, rotates changed TLS
//! certificates and sweeps the idle engine connections ([`crate::pool`]) every second, and
//! flushes the log once more at shutdown (the drain itself is [`crate::drain`]'s).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::config::GatewayConfig;
use crate::state::GatewayState;
use crate::tls::CertStore;

/// How often the config file is checked.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// How often the buffered access log is written out.
pub const ACCESS_LOG_FLUSH: Duration = Duration::from_secs(1);

/// The reloader service.
pub struct Reloader {
    state: Arc<GatewayState>,
    path: PathBuf,
    certs: Option<Arc<CertStore>>,
}

impl Reloader {
    /// Watch `path` for `state`, and the certificate files of `certs` when TLS is on.
    pub fn new(state: Arc<GatewayState>, path: PathBuf, certs: Option<Arc<CertStore>>) -> Self {
        Reloader { state, path, certs }
    }

    /// Rotate certificates whose files changed (a renewed Secret): new handshakes get
    /// them, established connections are left alone; unusable files keep the old ones.
    pub fn check_certificates(&self) {
        let (Some(store), Some(cfg)) = (&self.certs, self.state.active.load().config.tls.clone()) else { return };
        let counter = &self.state.metrics.certificate_reloads;
        match store.reload_if_changed(&cfg) {
            Ok(false) => {}
            Ok(true) => {
                counter.with_label_values(&["ok"]).inc();
                tracing::info!("TLS certificates reloaded");
            }
            Err(e) => {
                counter.with_label_values(&["error"]).inc();
                tracing::error!(error = %e, "TLS certificate reload rejected; keeping the previous certificates");
            }
        }
    }

    /// Reload now if the file's content differs from `last`; returns the content seen.
    pub fn check(&self, last: &Option<String>, force: bool) -> Option<String> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) => {
                if force {
                    tracing::error!(path = %self.path.display(), error = %e, "config reload failed: cannot read file");
                    self.state.metrics.config_reloads.with_label_values(&["error"]).inc();
                }
                return last.clone();
            }
        };
        if !force && last.as_deref() == Some(text.as_str()) {
            return Some(text);
        }
        match GatewayConfig::parse(&text) {
            Ok(cfg) => {
                self.state.apply(cfg);
                self.state.metrics.config_reloads.with_label_values(&["ok"]).inc();
                tracing::info!(path = %self.path.display(), "config reloaded");
            }
            Err(e) => {
                self.state.metrics.config_reloads.with_label_values(&["error"]).inc();
                tracing::error!(path = %self.path.display(), error = %e, "config reload rejected; keeping the previous config");
            }
        }
        Some(text)
    }
}

impl Reloader {
    /// What `auth.keys_file` holds now (`None` when there is none or it cannot be read).
    fn keys_file_text(&self) -> Option<String> {
        let path = self.state.active.load().config.auth.keys_file.clone()?;
        std::fs::read_to_string(path).ok()
    }

    /// Reload the API keys if `auth.keys_file` differs from `last`; returns the text seen.
    pub fn check_keys(&self, last: Option<String>) -> Option<String> {
        let now = self.keys_file_text();
        if now == last {
            return now;
        }
        let result = match self.state.reload_keys() {
            Ok(n) => {
                tracing::info!(keys = n, "API keys reloaded");
                "ok"
            }
            Err(e) => {
                tracing::error!(error = %e, "API key reload rejected; keeping the keys in force");
                "error"
            }
        };
        self.state.metrics.config_reloads.with_label_values(&[result]).inc();
        now
    }
}

#[async_trait]
impl BackgroundService for Reloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut last = std::fs::read_to_string(&self.path).ok();
        let mut last_keys = self.keys_file_text();
        let mut flush_due = std::time::Instant::now();
        let mut resolve_due = std::time::Instant::now();
        #[cfg(unix)]
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        loop {
            #[cfg(unix)]
            let hangup = async {
                match hup.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            #[cfg(not(unix))]
            let hangup = std::future::pending::<()>();
            tokio::select! {
                _ = shutdown.changed() => {
                    // Readiness already fails: `drain` marked the gateway at SIGTERM.
                    self.state.access_log.flush();
                    return;
                }
                _ = hangup => last = self.check(&last, true),
                _ = tokio::time::sleep(POLL_INTERVAL) => {
                    last = self.check(&last, false);
                    last_keys = self.check_keys(last_keys);
                    if flush_due.elapsed() >= ACCESS_LOG_FLUSH {
                        self.state.access_log.flush();
                        self.check_certificates();
                        self.state.pools.sweep(std::time::Instant::now());
                        flush_due = std::time::Instant::now();
                    }
                    let every = self.state.active.load().config.discovery.resolve_interval_ms;
                    if every > 0 && resolve_due.elapsed() >= Duration::from_millis(every) {
                        resolve_due = std::time::Instant::now();
                        // The system resolver blocks (and may wait for timeouts): off the runtime.
                        let state = self.state.clone();
                        let _ = tokio::task::spawn_blocking(move || state.re_resolve(&crate::discovery::system_resolve)).await;
                    }
                }
            }
        }
    }
}
