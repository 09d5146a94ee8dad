//! Gateway configuration: the YAML file, its defaults and its validation.
//!
//! `GatewayConfig::load(path)` reads, parses (unknown keys are errors) and validates; every
//! problem is reported with its field path, the value given and the reason, all at once
//! (`switchyard-gateway --validate FILE` prints them). Durations are milliseconds in the
//! file (`_ms` keys) and [`Duration`]s through the accessors.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::auth::AuthConfig;
use crate::error::{ConfigError, FieldError};
use crate::policy::PolicyConfig;
use crate::tls::TlsConfig;

/// Default `listen`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Default `admin_listen`.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";
/// Default `limits.max_body_bytes` (16 MiB).
pub const DEFAULT_MAX_BODY_BYTES: u64 = 16 * 1024 * 1024;

/// The whole file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// OpenAI API listener (also `/-/healthz`, `/-/ready`).
    pub listen: String,
    /// Admin listener (`/metrics`, `/admin/backends`).
    pub admin_listen: String,
    /// Worker threads of the proxy (0 = one per CPU).
    pub threads: usize,
    /// One work-stealing runtime over the worker threads (true), or one single-threaded
    /// runtime per thread, each serving the connections it accepted (false, NGINX's model).
    /// Read at start.
    pub work_stealing: bool,
    /// Where backends come from.
    pub discovery: DiscoveryConfig,
    /// Metric scraping.
    pub scrape: ScrapeConfig,
    /// Routing policy.
    pub policy: PolicyConfig,
    /// The approximate prefix index behind `prefix_affinity` and `cost`.
    pub prefix_index: PrefixIndexConfig,
    /// Request limits.
    pub limits: LimitsConfig,
    /// Timeouts.
    pub timeouts: TimeoutsConfig,
    /// Retries.
    pub retries: RetriesConfig,
    /// Holding requests while no engine can take them.
    pub admission: AdmissionConfig,
    /// Passive health checking (ejection).
    pub health: HealthConfig,
    /// TLS on `listen` (absent: plain HTTP/1.1, and h2c when `h2c` is on).
    pub tls: Option<TlsConfig>,
    /// Accept cleartext HTTP/2 with prior knowledge (h2c) on a plain `listen` (read at start).
    pub h2c: bool,
    /// TLS to `https://` backends (read at start).
    pub upstream_tls: UpstreamTlsConfig,
    /// API keys and per-key limits.
    pub auth: AuthConfig,
    /// Graceful drain on SIGTERM (`shutdown` is the old name).
    #[serde(alias = "shutdown")]
    pub drain: DrainConfig,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: DEFAULT_LISTEN.into(),
            admin_listen: DEFAULT_ADMIN_LISTEN.into(),
            threads: 0,
            work_stealing: true,
            discovery: DiscoveryConfig::default(),
            scrape: ScrapeConfig::default(),
            policy: PolicyConfig::default(),
            prefix_index: PrefixIndexConfig::default(),
            limits: LimitsConfig::default(),
            timeouts: TimeoutsConfig::default(),
            retries: RetriesConfig::default(),
            admission: AdmissionConfig::default(),
            health: HealthConfig::default(),
            tls: None,
            h2c: true,
            upstream_tls: UpstreamTlsConfig::default(),
            auth: AuthConfig::default(),
            drain: DrainConfig::default(),
        }
    }
}

/// `upstream_tls`: how `https://` backends are verified.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamTlsConfig {
    /// PEM CA certificates that sign the engines' certificates (unset: the system's roots).
    pub ca_file: Option<String>,
}

/// Backend discovery.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// A fixed list of engines.
    #[serde(rename = "static")]
    pub static_backends: Vec<StaticBackend>,
    /// How often backend host names are resolved again (0: only when the config is
    /// applied). A name that did not resolve (a pod not created yet) or that now points
    /// elsewhere (a restarted pod) is picked up without a reload.
    pub resolve_interval_ms: u64,
    /// Engines found through a Service's EndpointSlices (read at start; changing this
    /// section needs a restart).
    pub kubernetes: Option<KubernetesDiscovery>,
    /// Engines found by resolving a name to all its addresses (a headless Service; read at
    /// start).
    pub dns: Option<DnsDiscovery>,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig { static_backends: Vec::new(), resolve_interval_ms: 5000, kubernetes: None, dns: None }
    }
}

/// `discovery.dns`: every address of `name` is an engine on `port`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsDiscovery {
    /// The name to resolve (e.g. a headless Service's `engines.serving.svc.cluster.local`).
    pub name: String,
    /// The engines' (or sidecars') port.
    pub port: u16,
    /// How often the name is resolved.
    #[serde(default = "default_dns_interval")]
    pub interval_ms: u64,
}

fn default_dns_interval() -> u64 {
    5000
}

/// `discovery.kubernetes`: watch the EndpointSlices of a Service (or of a label selector).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesDiscovery {
    /// Namespace of the EndpointSlices.
    pub namespace: String,
    /// The Service whose slices are watched (label `kubernetes.io/service-name`).
    #[serde(default)]
    pub service: Option<String>,
    /// Or any label selector over EndpointSlices.
    #[serde(default)]
    pub label_selector: Option<String>,
    /// The named port of the slices to send to (the sidecar's, e.g. `shim`); empty: the
    /// slice's only port.
    #[serde(default)]
    pub port_name: String,
    /// The API server (default: in-cluster service account, else the kubeconfig).
    #[serde(default)]
    pub api_server: Option<String>,
}

impl KubernetesDiscovery {
    /// The label selector over EndpointSlices.
    pub fn selector(&self) -> String {
        match (&self.service, &self.label_selector) {
            (Some(s), _) => format!("kubernetes.io/service-name={s}"),
            (None, Some(l)) => l.clone(),
            (None, None) => String::new(),
        }
    }
}

/// One statically configured engine.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticBackend {
    /// `http://host:port` of the engine (or its shim).
    pub url: String,
    /// Models it serves; when absent they are read from its `/v1/models`.
    #[serde(default)]
    pub models: Option<Vec<String>>,
}

/// Scraping of each backend's `/metrics`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScrapeConfig {
    /// Time between scrapes of one backend.
    pub interval_ms: u64,
    /// Deadline of one scrape.
    pub timeout_ms: u64,
    /// A signal older than this is stale: policies fall back to in-flight counts.
    pub stale_after_ms: u64,
    /// Consecutive failed scrapes after which a backend is marked down.
    pub down_after_failures: u32,
    /// Where the load comes from: the engine's `/metrics`, or the `switchyard-shim` sidecar's
    /// `/load` (backend URLs then point at the sidecars).
    pub source: SignalSource,
}

/// Which endpoint of a backend carries its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SignalSource {
    /// Prometheus text from `/metrics`, in any engine's dialect.
    #[default]
    Metrics,
    /// The sidecar's JSON `/load` (not ready or draining counts as a failed scrape).
    Load,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval_ms: 100,
            timeout_ms: 500,
            stale_after_ms: 2000,
            down_after_failures: 3,
            source: SignalSource::Metrics,
        }
    }
}

/// The gateway's approximate prefix index (see `policy::prefix_index`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixIndexConfig {
    /// Bytes of canonical prompt text per hashed block (64 ≈ one 16-token KV block).
    pub block_bytes: usize,
    /// Hard bound on the index's memory.
    pub max_bytes: usize,
    /// Bytes of prompt text per token, to estimate prompt tokens without a tokenizer.
    pub bytes_per_token: f64,
}

impl Default for PrefixIndexConfig {
    fn default() -> Self {
        PrefixIndexConfig { block_bytes: 64, max_bytes: 64 * 1024 * 1024, bytes_per_token: 4.0 }
    }
}

impl PrefixIndexConfig {
    /// Estimated tokens in `bytes` of prompt text.
    pub fn tokens(&self, bytes: usize) -> u64 {
        (bytes as f64 / self.bytes_per_token).round() as u64
    }
}

/// Limits on what a client may send, and how slowly.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest request body; larger ones get 413 before any upstream connection.
    pub max_body_bytes: u64,
    /// A request's header must arrive within this (from the connection's first byte of
    /// the request, or from its reuse): the slowloris guard. The connection is closed.
    pub header_read_timeout_ms: u64,
    /// Largest request header block (431 above it).
    pub max_header_bytes: usize,
    /// Most header fields in one request (431 above it).
    pub max_headers: usize,
    /// Reading the whole request body (408 past it).
    pub body_read_timeout_ms: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            header_read_timeout_ms: 10_000,
            max_header_bytes: 64 * 1024,
            max_headers: 100,
            body_read_timeout_ms: 30_000,
        }
    }
}

impl LimitsConfig {
    /// Header read deadline.
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }
    /// Request body deadline.
    pub fn body_read_timeout(&self) -> Duration {
        Duration::from_millis(self.body_read_timeout_ms)
    }
}

/// Timeouts of the upstream leg and of reading the request.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutsConfig {
    /// TCP connect to an engine.
    pub connect_ms: u64,
    /// From sending the request to the engine's response header (covers queueing + prefill).
    pub first_byte_ms: u64,
    /// Longest gap between two response chunks.
    pub idle_ms: u64,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        TimeoutsConfig { connect_ms: 1000, first_byte_ms: 600_000, idle_ms: 60_000 }
    }
}

/// The admission queue: while no engine can take a request for its model — none up yet
/// (scaling from zero, all restarting), or every one saturated — the request waits, up to
/// `max_wait_ms`, in a queue of at most `max_queue` requests; past either limit it gets 503
/// with `Retry-After`. `max_wait_ms: 0` turns it off (503 at once, no saturation check).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Requests held at most.
    pub max_queue: usize,
    /// Longest wait of one request.
    pub max_wait_ms: u64,
    /// A request header carrying an integer priority (higher leaves the queue first);
    /// without it a request has its API key's `priority`, else 0.
    pub priority_header: Option<String>,
    /// A backend whose scraped waiting queue is at least this is saturated (unset: never).
    pub saturated_waiting: Option<f64>,
    /// A backend whose scraped KV-cache usage is at least this is saturated (unset: never).
    pub saturated_kv_usage: Option<f64>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_queue: 1000,
            max_wait_ms: 0,
            priority_header: None,
            saturated_waiting: None,
            saturated_kv_usage: None,
        }
    }
}

impl AdmissionConfig {
    /// Whether `signal` (a backend's fresh scrape) is past a saturation threshold. A backend
    /// without a fresh signal is not: what is unknown is not held back.
    pub fn saturated(&self, signal: Option<&crate::policy::SignalView>) -> bool {
        let Some(s) = signal else { return false };
        self.saturated_waiting.is_some_and(|t| s.waiting >= t)
            || self.saturated_kv_usage.is_some_and(|t| s.kv_usage >= t)
    }
}

/// Retries on another backend — only ever before anything reached the client: after a
/// connection failure, a dead pooled connection, or an answer with a status in
/// `retry_on_status` (an engine saying it is overloaded). All within a retry budget
/// ([`crate::retry`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetriesConfig {
    /// Attempts in all (1 = no retry).
    pub max_attempts: u32,
    /// Engine answers retried elsewhere (the last one is passed on when no retry is left).
    pub retry_on_status: Vec<u16>,
    /// Retries may add this share of the request rate (over the last 10 s)…
    pub budget_percent: u32,
    /// …plus this many per second.
    pub min_retries_per_second: u32,
}

impl Default for RetriesConfig {
    fn default() -> Self {
        RetriesConfig { max_attempts: 3, retry_on_status: vec![503], budget_percent: 20, min_retries_per_second: 10 }
    }
}

/// Passive health: ejection of failing backends (Envoy's outlier detection).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Consecutive 5xx answers or connection errors that eject a backend.
    pub consecutive_failures: u32,
    /// How long an ejection lasts.
    pub ejection_ms: u64,
    /// At most this share of backends is ejected at once (at least one may always be).
    pub max_ejection_percent: u32,
    /// Circuit breaker: a backend with this many requests in flight from this gateway takes
    /// no more until one ends (0: no limit). When all are full, requests wait in the
    /// admission queue (or get 503).
    pub max_inflight_per_backend: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            consecutive_failures: 5,
            ejection_ms: 10_000,
            max_ejection_percent: 50,
            max_inflight_per_backend: 0,
        }
    }
}

/// Graceful drain on SIGTERM: `/-/ready` fails at once; the listeners keep accepting for
/// `close_listeners_after_ms` (while load balancers and EndpointSlices catch up, so no
/// connection is refused), then close; requests in flight get until `grace_period_secs`
/// (counted from the signal) to finish, and the process exits as soon as none is left.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DrainConfig {
    /// From SIGTERM to the forced exit.
    pub grace_period_secs: u64,
    /// From SIGTERM to closing the listeners.
    pub close_listeners_after_ms: u64,
}

impl Default for DrainConfig {
    fn default() -> Self {
        DrainConfig { grace_period_secs: 25, close_listeners_after_ms: 5000 }
    }
}

/// A backend address parsed from its URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendAddr {
    /// `host:port` as written.
    pub authority: String,
}

/// Parse `http://host:port[/]` or `https://host:port[/]`.
pub fn parse_backend_url(url: &str) -> Result<BackendAddr, String> {
    // `https://` backends are reached over TLS (`Backend::tls`), verified against
    // `upstream_tls.ca_file`.
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or("must start with http:// or https://")?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains('/') || authority.contains('@') {
        return Err("must be http(s)://host:port with no path".into());
    }
    let (host, port) = authority.rsplit_once(':').ok_or("must include a port (http://host:port)")?;
    if host.is_empty() {
        return Err("host is empty".into());
    }
    port.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| format!("port {port:?} is not a number in 1..65535"))?;
    Ok(BackendAddr { authority: authority.to_string() })
}

impl GatewayConfig {
    /// Read, parse and validate a YAML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Io { path: path.display().to_string(), reason: e.to_string() })?;
        Self::parse(&text)
    }

    /// Parse and validate YAML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let cfg: GatewayConfig = if text.trim().is_empty() {
            GatewayConfig::default()
        } else {
            serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check every field; all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut errs = Vec::new();
        let mut bad =
            |field: String, value: String, reason: &str| errs.push(FieldError { field, value, reason: reason.into() });
        for (name, v) in [("listen", &self.listen), ("admin_listen", &self.admin_listen)] {
            if v.parse::<SocketAddr>().is_err() {
                bad(name.into(), v.clone(), "must be IP:PORT");
            }
        }
        if self.listen == self.admin_listen {
            bad("admin_listen".into(), self.admin_listen.clone(), "must differ from listen");
        }
        let mut seen = std::collections::HashSet::new();
        for (i, b) in self.discovery.static_backends.iter().enumerate() {
            if let Err(reason) = parse_backend_url(&b.url) {
                bad(format!("discovery.static[{i}].url"), b.url.clone(), &reason);
            } else if !seen.insert(b.url.trim_end_matches('/')) {
                bad(format!("discovery.static[{i}].url"), b.url.clone(), "listed twice");
            }
            if let Some(models) = &b.models {
                if models.is_empty() || models.iter().any(|m| m.is_empty()) {
                    bad(
                        format!("discovery.static[{i}].models"),
                        format!("{models:?}"),
                        "must list non-empty model names",
                    );
                }
            }
        }
        if let Some(k) = &self.discovery.kubernetes {
            if k.namespace.is_empty() {
                bad("discovery.kubernetes.namespace".into(), String::new(), "must name a namespace");
            }
            if k.service.is_some() == k.label_selector.is_some() {
                bad(
                    "discovery.kubernetes.service".into(),
                    format!("{:?} / {:?}", k.service, k.label_selector),
                    "give exactly one of service and label_selector",
                );
            }
            if let Some(url) = &k.api_server {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    bad("discovery.kubernetes.api_server".into(), url.clone(), "must be an http(s) URL");
                }
            }
        }
        if let Some(d) = &self.discovery.dns {
            if d.name.is_empty() || d.name.contains(['/', ':', ' ']) {
                bad("discovery.dns.name".into(), d.name.clone(), "must be a host name");
            }
            if d.port == 0 {
                bad("discovery.dns.port".into(), "0".into(), "must be a port (1-65535)");
            }
            if !(100..=3_600_000).contains(&d.interval_ms) {
                bad("discovery.dns.interval_ms".into(), d.interval_ms.to_string(), "must be in 100..=3600000");
            }
            if self.discovery.kubernetes.is_some() {
                bad("discovery.dns".into(), d.name.clone(), "use either discovery.dns or discovery.kubernetes");
            }
        }
        let a = &self.admission;
        if a.max_wait_ms > 0 && a.max_queue == 0 {
            bad("admission.max_queue".into(), "0".into(), "must be >= 1 when admission.max_wait_ms > 0");
        }
        if a.saturated_waiting.is_some_and(|t| !(t >= 0.0 && t.is_finite())) {
            bad("admission.saturated_waiting".into(), format!("{:?}", a.saturated_waiting), "must be >= 0");
        }
        if a.saturated_kv_usage.is_some_and(|t| !(t > 0.0 && t <= 1.0)) {
            bad("admission.saturated_kv_usage".into(), format!("{:?}", a.saturated_kv_usage), "must be in (0, 1]");
        }
        if a.max_wait_ms > 3_600_000 {
            bad("admission.max_wait_ms".into(), a.max_wait_ms.to_string(), "must be at most 3600000 (one hour)");
        }
        let s = &self.scrape;
        if !(10..=60_000).contains(&s.interval_ms) {
            bad("scrape.interval_ms".into(), s.interval_ms.to_string(), "must be in 10..=60000");
        }
        if s.timeout_ms == 0 {
            bad("scrape.timeout_ms".into(), "0".into(), "must be > 0");
        }
        if s.stale_after_ms < s.interval_ms {
            bad("scrape.stale_after_ms".into(), s.stale_after_ms.to_string(), "must be >= scrape.interval_ms");
        }
        if s.down_after_failures == 0 {
            bad("scrape.down_after_failures".into(), "0".into(), "must be >= 1");
        }
        if let Err(e) = self.policy.validate() {
            bad(format!("policy.{}", e.0), e.1, &e.2);
        }
        let p = &self.prefix_index;
        if !(1..=65_536).contains(&p.block_bytes) {
            bad("prefix_index.block_bytes".into(), p.block_bytes.to_string(), "must be in 1..=65536");
        }
        if p.max_bytes < 4096 {
            bad("prefix_index.max_bytes".into(), p.max_bytes.to_string(), "must be >= 4096");
        }
        if !(p.bytes_per_token.is_finite() && p.bytes_per_token > 0.0) {
            bad("prefix_index.bytes_per_token".into(), p.bytes_per_token.to_string(), "must be a number > 0");
        }
        if self.limits.max_body_bytes == 0 {
            bad("limits.max_body_bytes".into(), "0".into(), "must be > 0");
        }
        if self.limits.max_header_bytes < 1024 {
            bad("limits.max_header_bytes".into(), self.limits.max_header_bytes.to_string(), "must be >= 1024");
        }
        if !(8..=256).contains(&self.limits.max_headers) {
            // pingora's parser stops at 256 fields.
            bad("limits.max_headers".into(), self.limits.max_headers.to_string(), "must be in 8..=256");
        }
        let d = &self.drain;
        if d.close_listeners_after_ms > d.grace_period_secs * 1000 {
            bad(
                "drain.close_listeners_after_ms".into(),
                d.close_listeners_after_ms.to_string(),
                "must not be past drain.grace_period_secs",
            );
        }
        let t = &self.timeouts;
        for (name, v) in [
            ("timeouts.connect_ms", t.connect_ms),
            ("timeouts.first_byte_ms", t.first_byte_ms),
            ("timeouts.idle_ms", t.idle_ms),
            ("limits.header_read_timeout_ms", self.limits.header_read_timeout_ms),
            ("limits.body_read_timeout_ms", self.limits.body_read_timeout_ms),
        ] {
            if v == 0 {
                bad(name.into(), "0".into(), "must be > 0");
            }
        }
        if !(1..=10).contains(&self.retries.max_attempts) {
            bad("retries.max_attempts".into(), self.retries.max_attempts.to_string(), "must be in 1..=10");
        }
        for (i, code) in self.retries.retry_on_status.iter().enumerate() {
            if !(500..=599).contains(code) {
                bad(format!("retries.retry_on_status[{i}]"), code.to_string(), "must be a 5xx status");
            }
        }
        if self.retries.budget_percent > 1000 {
            bad("retries.budget_percent".into(), self.retries.budget_percent.to_string(), "must be <= 1000");
        }
        if self.health.consecutive_failures == 0 {
            bad("health.consecutive_failures".into(), "0".into(), "must be >= 1");
        }
        if self.health.max_ejection_percent > 100 {
            bad("health.max_ejection_percent".into(), self.health.max_ejection_percent.to_string(), "must be <= 100");
        }
        self.auth.validate(&mut errs);
        if let Some(t) = &self.tls {
            t.validate(&mut errs);
        }
        if let Some(ca) = &self.upstream_tls.ca_file {
            if let Err(e) = std::fs::read(ca) {
                errs.push(FieldError {
                    field: "upstream_tls.ca_file".into(),
                    value: ca.clone(),
                    reason: e.to_string(),
                });
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(errs))
        }
    }

    /// `listen` as an address (validated).
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen.parse().expect("validated")
    }

    /// `admin_listen` as an address (validated).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_listen.parse().expect("validated")
    }
}

impl ScrapeConfig {
    /// Scrape period.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }
    /// Scrape deadline.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
    /// Staleness bound.
    pub fn stale_after(&self) -> Duration {
        Duration::from_millis(self.stale_after_ms)
    }
}

impl TimeoutsConfig {
    /// Connect timeout.
    pub fn connect(&self) -> Duration {
        Duration::from_millis(self.connect_ms)
    }
    /// First-byte timeout.
    pub fn first_byte(&self) -> Duration {
        Duration::from_millis(self.first_byte_ms)
    }
    /// Inter-chunk timeout.
    pub fn idle(&self) -> Duration {
        Duration::from_millis(self.idle_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example_parses() {
        let cfg = GatewayConfig::parse(
            r#"
listen: 127.0.0.1:8080
admin_listen: 127.0.0.1:9090
discovery:
  static:
    - url: http://127.0.0.1:8101
    - url: http://127.0.0.1:8102
      models: [meta-llama/Meta-Llama-3-8B-Instruct]
scrape: { interval_ms: 100, timeout_ms: 500, stale_after_ms: 2000 }
policy: { type: least_load }
limits: { max_body_bytes: 16777216 }
timeouts: { connect_ms: 1000, first_byte_ms: 600000, idle_ms: 60000 }
retries: { max_attempts: 3 }
"#,
        )
        .unwrap();
        assert_eq!(cfg.discovery.static_backends.len(), 2);
        assert_eq!(cfg.retries.max_attempts, 3);
        assert_eq!(GatewayConfig::parse("").unwrap(), GatewayConfig::default());
    }

    /// The configuration reference in the README has only keys and types this version knows
    /// (deserialized, not validated: the files it names exist in a pod, not here).
    #[test]
    fn the_readme_reference_parses() {
        let readme = include_str!("../../README.md");
        let section = readme.split("### `switchyard-gateway --config").nth(1).expect("README has the gateway section");
        let yaml = section.split("```yaml\n").nth(1).and_then(|b| b.split("```").next()).expect("a yaml block");
        let cfg: GatewayConfig = serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("README gateway config: {e}"));
        assert!(cfg.work_stealing);
        assert_eq!(cfg.discovery.static_backends.len(), 2);
    }

    #[test]
    fn saturation_needs_a_fresh_signal_past_a_threshold() {
        use crate::policy::SignalView;
        let a = AdmissionConfig { saturated_waiting: Some(4.0), saturated_kv_usage: Some(0.9), ..Default::default() };
        let s = |waiting, kv_usage| SignalView { waiting, running: 1.0, kv_usage };
        assert!(!a.saturated(None), "unknown is not saturated");
        assert!(!a.saturated(Some(&s(3.0, 0.5))));
        assert!(a.saturated(Some(&s(4.0, 0.5))));
        assert!(a.saturated(Some(&s(0.0, 0.95))));
        assert!(!AdmissionConfig::default().saturated(Some(&s(1e9, 1.0))), "no thresholds, never saturated");
    }

    #[test]
    fn every_problem_is_reported_with_its_field() {
        let err = GatewayConfig::parse(
            r#"
listen: nowhere
discovery:
  static:
    - url: ftp://x:1
    - url: http://a:99999
    - url: http://a:1
    - url: http://a:1/
scrape: { interval_ms: 5 }
retries: { max_attempts: 0 }
policy: { type: least_load, weights: { waiting: -1 } }
"#,
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "listen: must be IP:PORT (got \"nowhere\")",
            "discovery.static[0].url: must start with http://",
            "discovery.static[1].url: port \"99999\"",
            "discovery.static[3].url: listed twice",
            "scrape.interval_ms",
            "retries.max_attempts",
            "policy.weights.waiting",
        ] {
            assert!(err.contains(needle), "missing {needle:?} in:\n{err}");
        }
        let err = GatewayConfig::parse(
            r#"
admission: { max_queue: 0, max_wait_ms: 5, saturated_kv_usage: 1.5 }
discovery:
  dns: { name: "a b", port: 0, interval_ms: 1 }
  kubernetes: { namespace: "", service: x, label_selector: y, api_server: "ftp://k" }
"#,
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "discovery.dns.name",
            "discovery.dns.port",
            "discovery.dns.interval_ms",
            "use either discovery.dns or discovery.kubernetes",
            "discovery.kubernetes.namespace",
            "give exactly one of service and label_selector",
            "discovery.kubernetes.api_server",
            "admission.max_queue",
            "admission.saturated_kv_usage",
        ] {
            assert!(err.contains(needle), "missing {needle:?} in:\n{err}");
        }
    }

    #[test]
    fn unknown_keys_and_policies_are_rejected() {
        assert!(GatewayConfig::parse("lisen: 1.2.3.4:5").unwrap_err().to_string().contains("lisen"));
        assert!(GatewayConfig::parse("policy: { type: fastest }").unwrap_err().to_string().contains("fastest"));
    }
}
