//! Gateway configuration: the YAML file, its defaults and its validation.
//!
//! `GatewayConfig::load(path)` reads, parses (unknown keys are errors), validates — each
//! section checks itself next to its struct, pure — and then checks the files the config
//! names (certificates, CA bundle, key sources: [`GatewayConfig::check_files`]); every
//! problem is reported with its field path, the value given and the reason, all at once
//! (`switchyard-gateway --validate FILE` prints them). Defaults are the `DEFAULT_*` constants. Durations are milliseconds in the
//! file (`_ms` keys) and [`Duration`]s through the accessors.

pub mod auth;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{ConfigError, Errors};
use crate::policy::PolicyConfig;
use crate::tls::TlsConfig;
pub use auth::{ApiKeyConfig, AuthConfig, SharedLimitsConfig};

/// Default `listen`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Default `admin_listen`.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";
/// Default `limits.max_body_bytes` (16 MiB).
pub const DEFAULT_MAX_BODY_BYTES: u64 = 16 * 1024 * 1024;
/// Default `limits.max_buffered_body_bytes` (256 MiB).
pub const DEFAULT_MAX_BUFFERED_BODY_BYTES: u64 = 256 * 1024 * 1024;
/// Default `limits.max_messages` (OpenAI's limit on a chat's messages).
pub const DEFAULT_MAX_MESSAGES: usize = 2048;
/// Default `limits.max_prompt_items` (2^20 prompts or token ids).
pub const DEFAULT_MAX_PROMPT_ITEMS: usize = 1 << 20;
/// Default `discovery.resolve_interval_ms`.
pub const DEFAULT_RESOLVE_INTERVAL_MS: u64 = 5000;
/// Default `discovery.dns.interval_ms`.
pub const DEFAULT_DNS_INTERVAL_MS: u64 = 5000;
/// Default `scrape.interval_ms`.
pub const DEFAULT_SCRAPE_INTERVAL_MS: u64 = 100;
/// Default `scrape.timeout_ms`.
pub const DEFAULT_SCRAPE_TIMEOUT_MS: u64 = 500;
/// Default `scrape.stale_after_ms`.
pub const DEFAULT_STALE_AFTER_MS: u64 = 2000;
/// Default `scrape.down_after_failures`.
pub const DEFAULT_DOWN_AFTER_FAILURES: u32 = 3;
/// Default `prefix_index.block_bytes` (≈ one 16-token KV block).
pub const DEFAULT_PREFIX_BLOCK_BYTES: usize = 64;
/// Default `prefix_index.max_bytes` (64 MiB).
pub const DEFAULT_PREFIX_MAX_BYTES: usize = 64 * 1024 * 1024;
/// Default `prefix_index.bytes_per_token`.
pub const DEFAULT_BYTES_PER_TOKEN: f64 = 4.0;
/// Default `limits.header_read_timeout_ms`.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default `limits.idle_connection_timeout_ms`.
pub const DEFAULT_IDLE_CONNECTION_TIMEOUT_MS: u64 = 60_000;
/// Default `limits.max_connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Default `limits.max_header_bytes` (64 KiB).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// Default `limits.max_headers`.
pub const DEFAULT_MAX_HEADERS: usize = 100;
/// Default `limits.body_read_timeout_ms`.
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;
/// Default `timeouts.connect_ms`.
pub const DEFAULT_CONNECT_MS: u64 = 1000;
/// Default `timeouts.first_byte_ms` (ten minutes: queueing and prefill of a long prompt).
pub const DEFAULT_FIRST_BYTE_MS: u64 = 600_000;
/// Default `timeouts.idle_ms`.
pub const DEFAULT_IDLE_MS: u64 = 60_000;
/// Default `admission.max_queue`.
pub const DEFAULT_MAX_QUEUE: usize = 1000;
/// Default `retries.max_attempts`.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// Default `retries.budget_percent`.
pub const DEFAULT_RETRY_BUDGET_PERCENT: u32 = 20;
/// Default `retries.min_retries_per_second`.
pub const DEFAULT_MIN_RETRIES_PER_SECOND: u32 = 10;
/// Default `health.consecutive_failures`.
pub const DEFAULT_CONSECUTIVE_FAILURES: u32 = 5;
/// Default `health.ejection_ms`.
pub const DEFAULT_EJECTION_MS: u64 = 10_000;
/// Default `health.max_ejection_percent`.
pub const DEFAULT_MAX_EJECTION_PERCENT: u32 = 50;
/// Default `drain.grace_period_secs` (below Kubernetes' 30 s termination grace).
pub const DEFAULT_GRACE_PERIOD_SECS: u64 = 25;
/// Default `drain.close_listeners_after_ms`.
pub const DEFAULT_CLOSE_LISTENERS_AFTER_MS: u64 = 5000;

/// The whole file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// OpenAI API listener (also `/-/healthz`, `/-/ready`); `null` turns it off when `epp`
    /// serves instead.
    pub listen: Option<String>,
    /// Admin listener (`/metrics`, `/admin/backends`).
    pub admin_listen: String,
    /// Who may read the admin listener.
    pub admin: AdminConfig,
    /// Worker threads of the proxy (0 = one per CPU).
    pub threads: usize,
    /// One single-threaded runtime per thread, each serving the connections it accepted and
    /// keeping its own idle engine connections (false, the default: NGINX's worker model,
    /// see [`crate::cores`]), or pingora's work-stealing runtime over the threads (true).
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
    /// What `/-/ready` requires.
    pub readiness: ReadinessConfig,
    /// Subscribe to the engines' KV-cache events (vLLM's `--kv-events-config`); read at start.
    pub kv_events: Option<KvEventsConfig>,
    /// Serve as a Gateway API Inference Extension Endpoint Picker (Envoy ext_proc) beside
    /// or instead of `listen`; read at start.
    pub epp: Option<EppConfig>,
    /// Model aliases and weighted splits (see [`crate::aliases`]).
    pub models: std::collections::BTreeMap<String, crate::aliases::ModelAlias>,
}

/// Default `epp.destination_header` (GIE's endpoint picker protocol).
pub const DEFAULT_DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

/// `epp`: the Endpoint Picker. A gateway (Envoy, Istio, kgateway, …) sends each request's
/// headers and body over ext_proc; the picker answers with the engine to use in
/// `destination_header` and in the dynamic metadata `envoy.lb`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EppConfig {
    /// gRPC listener (plaintext h2c; GIE's port is 9002).
    pub listen: String,
    /// The header naming the picked endpoint (llm-d: `x-llm-d-gateway-destination-endpoint`).
    pub destination_header: String,
    /// Endpoints after the primary in the header, for a gateway that retries down the list
    /// (Istio, kgateway). 0 for plain Envoy, whose `ORIGINAL_DST` cluster reads one address.
    pub fallbacks: usize,
    /// ext_proc streams open at most, on one connection (HTTP/2's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`: a client past it has streams refused) and in all (a
    /// stream past it ends with `RESOURCE_EXHAUSTED`). Each stream lives as long as its
    /// request, response included. Read at start.
    pub max_streams: usize,
    /// From naming the engine to the response's headers passing back through the picker: past
    /// it the request stops counting in flight on the engine and its stream ends with
    /// `DEADLINE_EXCEEDED` (a stream gone silent would otherwise skew routing forever). After
    /// the headers, response messages may be at most `timeouts.idle_ms` apart.
    pub response_timeout_ms: u64,
}

impl Default for EppConfig {
    fn default() -> Self {
        EppConfig {
            listen: "127.0.0.1:9002".into(),
            destination_header: DEFAULT_DESTINATION_HEADER.into(),
            fallbacks: 0,
            max_streams: 10_000,
            response_timeout_ms: DEFAULT_FIRST_BYTE_MS,
        }
    }
}

impl EppConfig {
    /// [`Self::response_timeout_ms`] as a duration.
    pub fn response_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.response_timeout_ms)
    }

    fn validate(&self, errs: &mut Errors) {
        if self.listen.parse::<SocketAddr>().is_err() {
            errs.add("epp.listen", &self.listen, "must be IP:PORT");
        }
        let h = &self.destination_header;
        if h.is_empty() || !h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') {
            errs.add("epp.destination_header", h, "must be a lower-case header name");
        }
        if !(1..=1_000_000).contains(&self.max_streams) {
            errs.add("epp.max_streams", self.max_streams, "must be in 1..=1000000");
        }
        if self.response_timeout_ms == 0 {
            errs.add("epp.response_timeout_ms", 0, "must be > 0");
        }
        if self.fallbacks > 16 {
            errs.add("epp.fallbacks", self.fallbacks, "must be in 0..=16");
        }
    }
}

/// `kv_events`: the engines' KV-cache events, for a precise block index every gateway
/// replica builds alike.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// The engines' block size (tokens).
    pub block_size: usize,
    /// The served model's tokenizer (a `.gguf` file, a `tokenizer.json`, or a Hugging Face
    /// directory): requests are rendered with its chat template and tokenized as the engine
    /// does, so their blocks can be looked up in the index. Without it the index is built
    /// but routing uses the approximate prefix index only.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Token ids of long prompt pieces (between the tokenizer's special tokens: a system
    /// prompt, a conversation's turns) kept for the requests that repeat them.
    pub tokenizer_cache_bytes: usize,
    /// For discovered engines (DNS, Kubernetes): their PUB socket is `tcp://<address>:<port>`.
    pub port: Option<u16>,
    /// … and their replay ROUTER socket `tcp://<address>:<replay_port>`.
    pub replay_port: Option<u16>,
    /// Hard memory bound of the index.
    pub max_bytes: usize,
    /// Threads that tokenize prompts, apart from the cores serving connections (default:
    /// as many as those cores).
    pub tokenizer_threads: Option<usize>,
    /// Bodies larger than this are not tokenized: routed by the approximate index (counted).
    pub tokenize_max_bytes: usize,
    /// How long a request waits for its prompt's keys before it is routed by the
    /// approximate index (counted).
    pub tokenize_timeout_ms: u64,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            block_size: 16,
            tokenizer: None,
            tokenizer_cache_bytes: 32 * 1024 * 1024,
            port: None,
            replay_port: None,
            max_bytes: 64 * 1024 * 1024,
            tokenizer_threads: None,
            // 128k tokens of English; random letters this long take ~1 s.
            tokenize_max_bytes: 512 * 1024,
            tokenize_timeout_ms: 250,
        }
    }
}

impl KvEventsConfig {
    fn validate(&self, errs: &mut Errors) {
        if !(1..=1024).contains(&self.block_size) {
            errs.add("kv_events.block_size", self.block_size, "must be in 1..=1024");
        }
        if self.max_bytes < 1024 * 1024 {
            errs.add("kv_events.max_bytes", self.max_bytes, "must be >= 1 MiB");
        }
        if let Some(path) = &self.tokenizer {
            if !path.exists() {
                errs.add("kv_events.tokenizer", path.display(), "no such file or directory");
            }
        }
        if let Some(n) = self.tokenizer_threads.filter(|n| !(1..=256).contains(n)) {
            errs.add("kv_events.tokenizer_threads", n, "must be in 1..=256");
        }
        if self.tokenize_max_bytes < 1024 {
            errs.add("kv_events.tokenize_max_bytes", self.tokenize_max_bytes, "must be >= 1024");
        }
        if !(1..=60_000).contains(&self.tokenize_timeout_ms) {
            errs.add("kv_events.tokenize_timeout_ms", self.tokenize_timeout_ms, "must be in 1..=60000");
        }
    }
}

/// `readiness`: when the gateway tells its load balancer (a Kubernetes Service) it is ready.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReadinessConfig {
    /// Ready only while an engine is routable (true), or whenever the config is loaded and
    /// the gateway is not draining (false). False when engines scale from zero: a gateway
    /// that left its Service could never receive the request that holds the admission queue
    /// and wakes the engines.
    pub require_backend: bool,
}

impl Default for ReadinessConfig {
    fn default() -> Self {
        ReadinessConfig { require_backend: true }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: Some(DEFAULT_LISTEN.into()),
            admin_listen: DEFAULT_ADMIN_LISTEN.into(),
            admin: AdminConfig::default(),
            threads: 0,
            work_stealing: false,
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
            readiness: ReadinessConfig::default(),
            kv_events: None,
            epp: None,
            models: std::collections::BTreeMap::new(),
        }
    }
}

/// `admin`: access to the admin listener, whose `/metrics` carries tenant names and whose
/// `/admin/backends` lists engine addresses and errors.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Lowercase hex SHA-256 of a bearer token (`printf %s "$TOKEN" | sha256sum`): set, every
    /// admin route but `/-/healthz` needs `Authorization: Bearer <token>` (401 without).
    pub token_sha256: Option<String>,
}

impl AdminConfig {
    fn validate(&self, errs: &mut Errors) {
        if let Some(t) = &self.token_sha256 {
            if auth::parse_sha256(t).is_none() {
                errs.add("admin.token_sha256", t, "must be 64 hex digits (the SHA-256 of the token)");
            }
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

impl UpstreamTlsConfig {
    fn check_files(&self, errs: &mut Errors) {
        if let Some(ca) = &self.ca_file {
            if let Err(e) = std::fs::read(ca) {
                errs.add("upstream_tls.ca_file", ca, e.to_string());
            }
        }
    }
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
    /// Engines found through a Gateway API Inference Extension `InferencePool`: its selector
    /// and target ports over the Pods of its namespace (read at start; the pool's own changes
    /// apply as they happen).
    pub inference_pool: Option<InferencePoolDiscovery>,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            static_backends: Vec::new(),
            resolve_interval_ms: DEFAULT_RESOLVE_INTERVAL_MS,
            kubernetes: None,
            dns: None,
            inference_pool: None,
        }
    }
}

impl DiscoveryConfig {
    fn validate(&self, errs: &mut Errors) {
        let mut seen = std::collections::HashSet::new();
        for (i, b) in self.static_backends.iter().enumerate() {
            if let Err(reason) = parse_backend_url(&b.url) {
                errs.add(format!("discovery.static[{i}].url"), &b.url, reason);
            } else if !seen.insert(b.url.trim_end_matches('/')) {
                errs.add(format!("discovery.static[{i}].url"), &b.url, "listed twice");
            }
            for (name, endpoint) in [("kv_events", &b.kv_events), ("kv_events_replay", &b.kv_events_replay)] {
                if let Some(e) = endpoint {
                    if !e.starts_with("tcp://")
                        || e[6..].rsplit_once(':').is_none_or(|(_, p)| p.parse::<u16>().is_err())
                    {
                        errs.add(format!("discovery.static[{i}].{name}"), e, "must be tcp://HOST:PORT");
                    }
                }
            }
            if let Some(models) = &b.models {
                if models.is_empty() || models.iter().any(|m| m.is_empty()) {
                    errs.add(
                        format!("discovery.static[{i}].models"),
                        format!("{models:?}"),
                        "must list non-empty model names",
                    );
                }
            }
        }
        if let Some(k) = &self.kubernetes {
            k.validate(errs);
        }
        if let Some(d) = &self.dns {
            d.validate(errs);
            if self.kubernetes.is_some() {
                errs.add("discovery.dns", &d.name, "use either discovery.dns or discovery.kubernetes");
            }
        }
        if let Some(p) = &self.inference_pool {
            p.validate(errs);
            if self.kubernetes.is_some() || self.dns.is_some() {
                errs.add(
                    "discovery.inference_pool",
                    &p.name,
                    "use one of discovery.inference_pool, discovery.kubernetes and discovery.dns",
                );
            }
        }
    }
}

/// `discovery.inference_pool`: the engines of a Gateway API Inference Extension
/// `InferencePool` (`inference.networking.k8s.io/v1`): every ready, non-terminating Pod its
/// selector matches, at each of its target ports.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferencePoolDiscovery {
    /// The pool's name.
    pub name: String,
    /// The pool's namespace (its Pods are in the same one).
    pub namespace: String,
    /// The API server (default: in-cluster service account, else the kubeconfig).
    #[serde(default)]
    pub api_server: Option<String>,
}

impl InferencePoolDiscovery {
    fn validate(&self, errs: &mut Errors) {
        if !is_dns_label(&self.name, 253) {
            errs.add("discovery.inference_pool.name", &self.name, "must be a Kubernetes object name");
        }
        if !is_dns_label(&self.namespace, 63) {
            errs.add("discovery.inference_pool.namespace", &self.namespace, "must be a Kubernetes namespace");
        }
        if let Some(url) = &self.api_server {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                errs.add("discovery.inference_pool.api_server", url, "must be an http(s) URL");
            }
        }
    }
}

/// A lowercase RFC 1123 name (`[a-z0-9]([-.a-z0-9]*[a-z0-9])?`) of at most `max` bytes.
fn is_dns_label(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
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
    DEFAULT_DNS_INTERVAL_MS
}

impl DnsDiscovery {
    fn validate(&self, errs: &mut Errors) {
        if self.name.is_empty() || self.name.contains(['/', ':', ' ']) {
            errs.add("discovery.dns.name", &self.name, "must be a host name");
        }
        if self.port == 0 {
            errs.add("discovery.dns.port", 0, "must be a port (1-65535)");
        }
        if !(100..=3_600_000).contains(&self.interval_ms) {
            errs.add("discovery.dns.interval_ms", self.interval_ms, "must be in 100..=3600000");
        }
    }
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
    /// Only slices whose `endpointslice.kubernetes.io/managed-by` label is this are used
    /// (default: Kubernetes' own EndpointSlice controller), so a slice someone else created
    /// with the Service's name cannot steer traffic; empty: any slice the selector matches.
    #[serde(default = "default_managed_by")]
    pub managed_by: String,
}

/// The label EndpointSlice controllers sign their slices with.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// Default `discovery.kubernetes.managed_by`: Kubernetes' EndpointSlice controller.
pub const DEFAULT_MANAGED_BY: &str = "endpointslice-controller.k8s.io";

fn default_managed_by() -> String {
    DEFAULT_MANAGED_BY.into()
}

impl KubernetesDiscovery {
    fn validate(&self, errs: &mut Errors) {
        if self.namespace.is_empty() {
            errs.add("discovery.kubernetes.namespace", "", "must name a namespace");
        }
        if self.service.is_some() == self.label_selector.is_some() {
            errs.add(
                "discovery.kubernetes.service",
                format!("{:?} / {:?}", self.service, self.label_selector),
                "give exactly one of service and label_selector",
            );
        }
        if let Some(url) = &self.api_server {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                errs.add("discovery.kubernetes.api_server", url, "must be an http(s) URL");
            }
        }
    }

    /// The label selector over EndpointSlices (the managed-by requirement included).
    pub fn selector(&self) -> String {
        let base = match (&self.service, &self.label_selector) {
            (Some(s), _) => format!("kubernetes.io/service-name={s}"),
            (None, Some(l)) => l.clone(),
            (None, None) => String::new(),
        };
        match (base.is_empty(), self.managed_by.is_empty()) {
            (_, true) => base,
            (true, false) => format!("{MANAGED_BY_LABEL}={}", self.managed_by),
            (false, false) => format!("{base},{MANAGED_BY_LABEL}={}", self.managed_by),
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
    /// Its KV-event PUB socket, `tcp://host:port` (needs the top-level `kv_events`).
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its KV-event replay ROUTER socket, `tcp://host:port`.
    #[serde(default)]
    pub kv_events_replay: Option<String>,
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
            interval_ms: DEFAULT_SCRAPE_INTERVAL_MS,
            timeout_ms: DEFAULT_SCRAPE_TIMEOUT_MS,
            stale_after_ms: DEFAULT_STALE_AFTER_MS,
            down_after_failures: DEFAULT_DOWN_AFTER_FAILURES,
            source: SignalSource::Metrics,
        }
    }
}

impl ScrapeConfig {
    fn validate(&self, errs: &mut Errors) {
        if !(10..=60_000).contains(&self.interval_ms) {
            errs.add("scrape.interval_ms", self.interval_ms, "must be in 10..=60000");
        }
        if self.timeout_ms == 0 {
            errs.add("scrape.timeout_ms", 0, "must be > 0");
        }
        if self.stale_after_ms < self.interval_ms {
            errs.add("scrape.stale_after_ms", self.stale_after_ms, "must be >= scrape.interval_ms");
        }
        if self.down_after_failures == 0 {
            errs.add("scrape.down_after_failures", 0, "must be >= 1");
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
        PrefixIndexConfig {
            block_bytes: DEFAULT_PREFIX_BLOCK_BYTES,
            max_bytes: DEFAULT_PREFIX_MAX_BYTES,
            bytes_per_token: DEFAULT_BYTES_PER_TOKEN,
        }
    }
}

impl PrefixIndexConfig {
    fn validate(&self, errs: &mut Errors) {
        if !(1..=65_536).contains(&self.block_bytes) {
            errs.add("prefix_index.block_bytes", self.block_bytes, "must be in 1..=65536");
        }
        if self.max_bytes < 4096 {
            errs.add("prefix_index.max_bytes", self.max_bytes, "must be >= 4096");
        }
        if !(self.bytes_per_token.is_finite() && self.bytes_per_token > 0.0) {
            errs.add("prefix_index.bytes_per_token", self.bytes_per_token, "must be a number > 0");
        }
    }

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
    /// the request): the slowloris guard. It also bounds what comes before a request: the
    /// first request's head from the connection's accept, and the 24-byte HTTP/2 preface
    /// (h2c). The connection is closed.
    pub header_read_timeout_ms: u64,
    /// How long a connection with no request in flight is kept: an HTTP/1.1 keep-alive
    /// connection waiting for its next request's first byte, an HTTP/2 connection with no
    /// open stream. Closed past it (counted in `switchyard_idle_connections_closed_total`).
    /// HTTP/2's value is read when a connection opens, HTTP/1's when it goes idle.
    pub idle_connection_timeout_ms: u64,
    /// Client connections open at once on the API listener; a connection past it is closed
    /// as soon as it is accepted (`switchyard_connections_refused_total`). Connections still in
    /// their TLS handshake are not counted (pingora bounds that handshake by 60 s).
    pub max_connections: usize,
    /// Largest request header block (431 above it).
    pub max_header_bytes: usize,
    /// Most header fields in one request (431 above it).
    pub max_headers: usize,
    /// Reading the whole request body (408 past it).
    pub body_read_timeout_ms: u64,
    /// Request bodies held by the whole process at once (they are buffered whole, for
    /// retries): past it a request gets 503 with `Retry-After` before its body is read.
    pub max_buffered_body_bytes: u64,
    /// Most entries in a chat's `messages` (400 above it).
    pub max_messages: usize,
    /// Most items in a completion's `prompt`: prompts or token ids, those of nested arrays
    /// counted (400 above it).
    pub max_prompt_items: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            header_read_timeout_ms: DEFAULT_HEADER_READ_TIMEOUT_MS,
            idle_connection_timeout_ms: DEFAULT_IDLE_CONNECTION_TIMEOUT_MS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_headers: DEFAULT_MAX_HEADERS,
            body_read_timeout_ms: DEFAULT_BODY_READ_TIMEOUT_MS,
            max_buffered_body_bytes: DEFAULT_MAX_BUFFERED_BODY_BYTES,
            max_messages: DEFAULT_MAX_MESSAGES,
            max_prompt_items: DEFAULT_MAX_PROMPT_ITEMS,
        }
    }
}

impl LimitsConfig {
    fn validate(&self, errs: &mut Errors) {
        if self.max_body_bytes == 0 {
            errs.add("limits.max_body_bytes", 0, "must be > 0");
        }
        if self.max_buffered_body_bytes < self.max_body_bytes {
            errs.add(
                "limits.max_buffered_body_bytes",
                self.max_buffered_body_bytes,
                format!("must be >= limits.max_body_bytes ({})", self.max_body_bytes),
            );
        }
        for (name, v) in [
            ("limits.max_messages", self.max_messages),
            ("limits.max_prompt_items", self.max_prompt_items),
            ("limits.max_connections", self.max_connections),
        ] {
            if v == 0 {
                errs.add(name, 0, "must be > 0");
            }
        }
        if !(1024..=1 << 20).contains(&self.max_header_bytes) {
            // A head is buffered whole while it is read: at most 1 MiB per connection.
            errs.add("limits.max_header_bytes", self.max_header_bytes, "must be in 1024..=1048576");
        }
        if !(8..=crate::downstream::head::MAX_FIELDS).contains(&self.max_headers) {
            // The head parser has room for 256 fields.
            errs.add("limits.max_headers", self.max_headers, "must be in 8..=256");
        }
        for (name, v) in [
            ("limits.header_read_timeout_ms", self.header_read_timeout_ms),
            ("limits.body_read_timeout_ms", self.body_read_timeout_ms),
            ("limits.idle_connection_timeout_ms", self.idle_connection_timeout_ms),
        ] {
            if v == 0 {
                errs.add(name, 0, "must be > 0");
            }
        }
    }

    /// Header read deadline.
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }
    /// How long an idle client connection is kept.
    pub fn idle_connection_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_connection_timeout_ms)
    }
    /// Request body deadline.
    pub fn body_read_timeout(&self) -> Duration {
        Duration::from_millis(self.body_read_timeout_ms)
    }

    /// The prompt size limits.
    pub fn prompt_limits(&self) -> crate::request::PromptLimits {
        crate::request::PromptLimits { max_messages: self.max_messages, max_prompt_items: self.max_prompt_items }
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
        TimeoutsConfig {
            connect_ms: DEFAULT_CONNECT_MS,
            first_byte_ms: DEFAULT_FIRST_BYTE_MS,
            idle_ms: DEFAULT_IDLE_MS,
        }
    }
}

impl TimeoutsConfig {
    fn validate(&self, errs: &mut Errors) {
        for (name, v) in [
            ("timeouts.connect_ms", self.connect_ms),
            ("timeouts.first_byte_ms", self.first_byte_ms),
            ("timeouts.idle_ms", self.idle_ms),
        ] {
            if v == 0 {
                errs.add(name, 0, "must be > 0");
            }
        }
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
    /// Requests one tenant (API key's `tenant`) may have held at once (unset: only
    /// `max_queue`): past it 429, so one tenant's burst cannot fill the queue for all.
    pub max_queue_per_tenant: Option<usize>,
    /// Longest wait of one request.
    pub max_wait_ms: u64,
    /// A request header carrying an integer priority (higher leaves the queue first);
    /// without it a request has its API key's `priority`, else 0. The header may only
    /// lower a key's priority; without API keys it is capped at `max_header_priority`.
    pub priority_header: Option<String>,
    /// Without API keys, the highest priority the priority header may ask for (a client
    /// must not put itself ahead of everyone by sending a large number).
    pub max_header_priority: i32,
    /// A backend whose scraped waiting queue is at least this is saturated (unset: never).
    pub saturated_waiting: Option<f64>,
    /// A backend whose scraped KV-cache usage is at least this is saturated (unset: never).
    pub saturated_kv_usage: Option<f64>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_queue: DEFAULT_MAX_QUEUE,
            max_queue_per_tenant: None,
            max_wait_ms: 0,
            priority_header: None,
            max_header_priority: 0,
            saturated_waiting: None,
            saturated_kv_usage: None,
        }
    }
}

impl AdmissionConfig {
    fn validate(&self, errs: &mut Errors) {
        if self.max_wait_ms > 0 && self.max_queue == 0 {
            errs.add("admission.max_queue", 0, "must be >= 1 when admission.max_wait_ms > 0");
        }
        if self.max_queue_per_tenant == Some(0) {
            errs.add("admission.max_queue_per_tenant", 0, "must be >= 1 (unset: no per-tenant cap)");
        }
        if self.saturated_waiting.is_some_and(|t| !(t >= 0.0 && t.is_finite())) {
            errs.add("admission.saturated_waiting", format!("{:?}", self.saturated_waiting), "must be >= 0");
        }
        if self.saturated_kv_usage.is_some_and(|t| !(t > 0.0 && t <= 1.0)) {
            errs.add("admission.saturated_kv_usage", format!("{:?}", self.saturated_kv_usage), "must be in (0, 1]");
        }
        if self.max_wait_ms > 3_600_000 {
            errs.add("admission.max_wait_ms", self.max_wait_ms, "must be at most 3600000 (one hour)");
        }
    }

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
        RetriesConfig {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_on_status: vec![503],
            budget_percent: DEFAULT_RETRY_BUDGET_PERCENT,
            min_retries_per_second: DEFAULT_MIN_RETRIES_PER_SECOND,
        }
    }
}

impl RetriesConfig {
    fn validate(&self, errs: &mut Errors) {
        if !(1..=10).contains(&self.max_attempts) {
            errs.add("retries.max_attempts", self.max_attempts, "must be in 1..=10");
        }
        for (i, code) in self.retry_on_status.iter().enumerate() {
            if !(500..=599).contains(code) {
                errs.add(format!("retries.retry_on_status[{i}]"), code, "must be a 5xx status");
            }
        }
        if self.budget_percent > 1000 {
            errs.add("retries.budget_percent", self.budget_percent, "must be <= 1000");
        }
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
            consecutive_failures: DEFAULT_CONSECUTIVE_FAILURES,
            ejection_ms: DEFAULT_EJECTION_MS,
            max_ejection_percent: DEFAULT_MAX_EJECTION_PERCENT,
            max_inflight_per_backend: 0,
        }
    }
}

impl HealthConfig {
    fn validate(&self, errs: &mut Errors) {
        if self.consecutive_failures == 0 {
            errs.add("health.consecutive_failures", 0, "must be >= 1");
        }
        if self.max_ejection_percent > 100 {
            errs.add("health.max_ejection_percent", self.max_ejection_percent, "must be <= 100");
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
        DrainConfig {
            grace_period_secs: DEFAULT_GRACE_PERIOD_SECS,
            close_listeners_after_ms: DEFAULT_CLOSE_LISTENERS_AFTER_MS,
        }
    }
}

impl DrainConfig {
    fn validate(&self, errs: &mut Errors) {
        if self.close_listeners_after_ms > self.grace_period_secs * 1000 {
            errs.add(
                "drain.close_listeners_after_ms",
                self.close_listeners_after_ms,
                "must not be past drain.grace_period_secs",
            );
        }
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
    /// The proxy's threads: `threads`, or one per CPU when it is 0.
    pub fn worker_threads(&self) -> usize {
        match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }

    /// The threads of [`crate::cores`] serving the API listener: [`Self::worker_threads`]
    /// with one runtime per core, none under pingora's work-stealing runtime.
    pub fn core_threads(&self) -> usize {
        if self.work_stealing {
            0
        } else {
            self.worker_threads()
        }
    }

    /// Read, parse and validate a YAML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Io { path: path.display().to_string(), reason: e.to_string() })?;
        Self::parse(&text)
    }

    /// Parse YAML text, validate it and check the files it names.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let cfg: GatewayConfig = if text.trim().is_empty() {
            GatewayConfig::default()
        } else {
            serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?
        };
        cfg.validate()?;
        cfg.check_files()?;
        Ok(cfg)
    }

    /// Check every field (pure: no file is read); all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut errs = Errors::default();
        let listeners = [("listen", self.listen.as_ref()), ("admin_listen", Some(&self.admin_listen))];
        for (name, v) in listeners.into_iter().filter_map(|(n, v)| Some((n, v?))) {
            if v.parse::<SocketAddr>().is_err() {
                errs.add(name, v, "must be IP:PORT");
            }
        }
        if self.listen.as_ref() == Some(&self.admin_listen) && !self.admin_listen.ends_with(":0") {
            errs.add("admin_listen", &self.admin_listen, "must differ from listen");
        }
        match &self.epp {
            Some(epp) => {
                epp.validate(&mut errs);
                if [self.listen.as_ref(), Some(&self.admin_listen)].contains(&Some(&epp.listen))
                    && !epp.listen.ends_with(":0")
                {
                    errs.add("epp.listen", &epp.listen, "must differ from listen and admin_listen");
                }
            }
            None if self.listen.is_none() => errs.add("listen", "null", "must be set unless epp serves instead"),
            None => {}
        }
        self.admin.validate(&mut errs);
        if let Some(k) = &self.kv_events {
            k.validate(&mut errs);
        }
        for (i, b) in self.discovery.static_backends.iter().enumerate() {
            if self.kv_events.is_none() && (b.kv_events.is_some() || b.kv_events_replay.is_some()) {
                errs.add(format!("discovery.static[{i}].kv_events"), &b.url, "needs the top-level kv_events section");
            }
        }
        self.discovery.validate(&mut errs);
        self.admission.validate(&mut errs);
        self.scrape.validate(&mut errs);
        if let Err((field, value, reason)) = self.policy.validate() {
            errs.add(format!("policy.{field}"), value, reason);
        }
        self.prefix_index.validate(&mut errs);
        self.limits.validate(&mut errs);
        self.drain.validate(&mut errs);
        self.timeouts.validate(&mut errs);
        self.retries.validate(&mut errs);
        self.health.validate(&mut errs);
        self.auth.validate(&mut errs);
        crate::aliases::validate(&self.models, &mut errs);
        errs.into_result()
    }

    /// Read the files (and the environment variable) the config names — TLS certificates
    /// and keys, the upstream CA bundle, API key sources — and check what they hold.
    pub fn check_files(&self) -> Result<(), ConfigError> {
        let mut errs = Errors::default();
        self.auth.check_files(&mut errs);
        if let Some(t) = &self.tls {
            t.check_files(&mut errs);
        }
        self.upstream_tls.check_files(&mut errs);
        errs.into_result()
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
        let readme = include_str!("../../../README.md");
        let section = readme.split("### `switchyard-gateway --config").nth(1).expect("README has the gateway section");
        let yaml = section.split("```yaml\n").nth(1).and_then(|b| b.split("```").next()).expect("a yaml block");
        let cfg: GatewayConfig = serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("README gateway config: {e}"));
        assert!(!cfg.work_stealing);
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
    fn an_inference_pool_is_named_and_alone() {
        let cfg =
            GatewayConfig::parse("discovery:\n  inference_pool: { name: llama-pool, namespace: serving }\n").unwrap();
        let pool = cfg.discovery.inference_pool.unwrap();
        assert_eq!((pool.name.as_str(), pool.namespace.as_str(), pool.api_server), ("llama-pool", "serving", None));
        let err = GatewayConfig::parse(
            r#"
discovery:
  inference_pool: { name: "Pool!", namespace: "", api_server: "ftp://k" }
  dns: { name: engines, port: 8000 }
"#,
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "discovery.inference_pool.name",
            "discovery.inference_pool.namespace",
            "discovery.inference_pool.api_server",
            "use one of discovery.inference_pool, discovery.kubernetes and discovery.dns",
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
