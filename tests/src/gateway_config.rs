//! One typed way for a test to write a gateway config: [`GatewayConfigBuilder`] renders the
//! YAML that `switchyard-gateway --config` reads.
//!
//! Defaults suit a test on loopback: both listeners on port 0 (the gateway prints the
//! addresses it bound, which [`crate::GatewayProc`] reads), two proxy threads, scrapes every
//! 50 ms (timeout 500 ms, stale after 1 s), no policy line (the gateway's default, `cost`). Sections the builder has
//! no typed setter for (`limits`, `timeouts`, `retries`, `health`, `admission`, `drain`, …)
//! are set whole with [`GatewayConfigBuilder::section`]; setting any key twice panics, so a
//! test never ends up with a YAML file holding two `policy:` lines.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;

/// Builder of a gateway config file (YAML).
#[derive(Debug, Clone)]
pub struct GatewayConfigBuilder {
    listen: Option<SocketAddr>,
    /// `listen: null` (an Endpoint Picker without the HTTP API).
    no_api: bool,
    admin_listen: Option<SocketAddr>,
    threads: u32,
    discovery: Discovery,
    policy: Option<String>,
    scrape: Scrape,
    auth_keys: Vec<ApiKey>,
    keys_file: Option<String>,
    shared_limits: Option<String>,
    tls: Option<Tls>,
    upstream_ca: Option<String>,
    sections: Vec<(String, String)>,
    /// Static backends' KV-event endpoints: url → (PUB, replay).
    kv_event_endpoints: Vec<(String, String, Option<String>)>,
}

#[derive(Debug, Clone, Default)]
enum Discovery {
    #[default]
    None,
    Static(Vec<(String, Vec<String>)>),
    Kubernetes {
        namespace: String,
        service: String,
        port_name: String,
        api_server: String,
    },
    Dns {
        name: String,
        port: u16,
        interval_ms: u64,
    },
    InferencePool {
        name: String,
        namespace: String,
        api_server: String,
    },
}

#[derive(Debug, Clone)]
struct Scrape {
    source: Option<String>,
    interval_ms: u64,
    timeout_ms: u64,
    stale_after_ms: u64,
    down_after_failures: Option<u32>,
}

#[derive(Debug, Clone)]
struct Tls {
    cert_file: String,
    key_file: String,
    sni_certs: Vec<(String, String)>,
}

/// One entry of `auth.keys`.
#[derive(Debug, Clone)]
pub struct ApiKey {
    tenant: String,
    key_sha256: String,
    requests_per_second: Option<f64>,
    burst: Option<u32>,
    tokens_per_minute: Option<u64>,
}

impl ApiKey {
    /// A key of `tenant`, known by the hex SHA-256 of its text.
    pub fn new(tenant: &str, key_sha256: &str) -> ApiKey {
        ApiKey {
            tenant: tenant.into(),
            key_sha256: key_sha256.into(),
            requests_per_second: None,
            burst: None,
            tokens_per_minute: None,
        }
    }

    /// Its request rate.
    pub fn requests_per_second(mut self, rps: f64) -> ApiKey {
        self.requests_per_second = Some(rps);
        self
    }

    /// Its burst.
    pub fn burst(mut self, burst: u32) -> ApiKey {
        self.burst = Some(burst);
        self
    }

    /// Its token budget.
    pub fn tokens_per_minute(mut self, tpm: u64) -> ApiKey {
        self.tokens_per_minute = Some(tpm);
        self
    }

    fn render(&self) -> String {
        let mut s = format!("{{ tenant: {}, key_sha256: {}", self.tenant, self.key_sha256);
        if let Some(v) = self.requests_per_second {
            let _ = write!(s, ", requests_per_second: {v}");
        }
        if let Some(v) = self.burst {
            let _ = write!(s, ", burst: {v}");
        }
        if let Some(v) = self.tokens_per_minute {
            let _ = write!(s, ", tokens_per_minute: {v}");
        }
        s + " }"
    }
}

/// Default `listen`: any free port on loopback.
pub const LISTEN_ANY_PORT: &str = "127.0.0.1:0";
/// Default `admin_listen`: any free port on loopback (the gateway prints which it got).
pub const ADMIN_LISTEN_ANY_PORT: &str = "127.0.0.1:0";

/// Top-level keys the builder writes itself.
const TYPED_KEYS: &[&str] =
    &["listen", "admin_listen", "threads", "discovery", "policy", "scrape", "auth", "tls", "upstream_tls"];

impl Default for GatewayConfigBuilder {
    fn default() -> Self {
        GatewayConfigBuilder::new()
    }
}

impl GatewayConfigBuilder {
    /// A config with no backends yet and the test defaults.
    pub fn new() -> GatewayConfigBuilder {
        GatewayConfigBuilder {
            listen: None,
            no_api: false,
            admin_listen: None,
            threads: 2,
            discovery: Discovery::None,
            policy: None,
            scrape: Scrape {
                source: None,
                interval_ms: 50,
                timeout_ms: 500,
                stale_after_ms: 1000,
                down_after_failures: None,
            },
            auth_keys: Vec::new(),
            keys_file: None,
            shared_limits: None,
            tls: None,
            upstream_ca: None,
            sections: Vec::new(),
            kv_event_endpoints: Vec::new(),
        }
    }

    /// No HTTP API listener (`listen: null`): the gateway serves only as an Endpoint Picker
    /// (set `epp`) and its admin listener.
    pub fn without_api_listener(mut self) -> GatewayConfigBuilder {
        self.no_api = true;
        self
    }

    /// Fixed API and admin listeners (default: port 0, see the module docs).
    pub fn listeners(mut self, listen: SocketAddr, admin_listen: SocketAddr) -> GatewayConfigBuilder {
        self.listen = Some(listen);
        self.admin_listen = Some(admin_listen);
        self
    }

    /// Proxy worker threads (default 2).
    pub fn threads(mut self, n: u32) -> GatewayConfigBuilder {
        self.threads = n;
        self
    }

    /// Static backends, each serving what its `/v1/models` lists.
    pub fn backends<S: AsRef<str>>(mut self, urls: impl IntoIterator<Item = S>) -> GatewayConfigBuilder {
        for u in urls {
            self.static_entries().push((u.as_ref().to_string(), Vec::new()));
        }
        self
    }

    /// One static backend declared to serve `models` (routable before its first scrape).
    pub fn backend_serving(mut self, url: &str, models: &[&str]) -> GatewayConfigBuilder {
        self.static_entries().push((url.to_string(), models.iter().map(|m| m.to_string()).collect()));
        self
    }

    /// One static backend whose KV events come from `endpoint` (and replays from `replay`);
    /// the config needs a `kv_events` section too.
    pub fn backend_with_kv_events(mut self, url: &str, endpoint: &str, replay: Option<&str>) -> GatewayConfigBuilder {
        self.static_entries().push((url.to_string(), Vec::new()));
        self.kv_event_endpoints.push((url.to_string(), endpoint.to_string(), replay.map(str::to_string)));
        self
    }

    fn static_entries(&mut self) -> &mut Vec<(String, Vec<String>)> {
        if matches!(self.discovery, Discovery::None) {
            self.discovery = Discovery::Static(Vec::new());
        }
        match &mut self.discovery {
            Discovery::Static(v) => v,
            other => panic!("static backends and {other:?} in one config"),
        }
    }

    /// Backends from a Service's EndpointSlices.
    pub fn kubernetes(mut self, namespace: &str, service: &str, port_name: &str, api_server: &str) -> Self {
        assert!(matches!(self.discovery, Discovery::None), "two discovery sources");
        self.discovery = Discovery::Kubernetes {
            namespace: namespace.into(),
            service: service.into(),
            port_name: port_name.into(),
            api_server: api_server.into(),
        };
        self
    }

    /// Backends from an InferencePool's Pods.
    pub fn inference_pool(mut self, namespace: &str, name: &str, api_server: &str) -> Self {
        assert!(matches!(self.discovery, Discovery::None), "two discovery sources");
        self.discovery =
            Discovery::InferencePool { name: name.into(), namespace: namespace.into(), api_server: api_server.into() };
        self
    }

    /// Backends from every address of a DNS name.
    pub fn dns(mut self, name: &str, port: u16, interval_ms: u64) -> GatewayConfigBuilder {
        assert!(matches!(self.discovery, Discovery::None), "two discovery sources");
        self.discovery = Discovery::Dns { name: name.into(), port, interval_ms };
        self
    }

    /// `policy: { type: NAME }`.
    pub fn policy(mut self, name: &str) -> GatewayConfigBuilder {
        assert!(self.policy.is_none(), "policy set twice");
        self.policy = Some(name.into());
        self
    }

    /// `scrape.source` (`metrics` or `load`).
    pub fn scrape_source(mut self, source: &str) -> GatewayConfigBuilder {
        self.scrape.source = Some(source.into());
        self
    }

    /// `scrape.interval_ms` (default 50).
    pub fn scrape_interval_ms(mut self, ms: u64) -> GatewayConfigBuilder {
        self.scrape.interval_ms = ms;
        self
    }

    /// `scrape.timeout_ms` (default 500).
    pub fn scrape_timeout_ms(mut self, ms: u64) -> GatewayConfigBuilder {
        self.scrape.timeout_ms = ms;
        self
    }

    /// `scrape.stale_after_ms` (default 1000).
    pub fn stale_after_ms(mut self, ms: u64) -> GatewayConfigBuilder {
        self.scrape.stale_after_ms = ms;
        self
    }

    /// `scrape.down_after_failures` (default: the gateway's).
    pub fn down_after_failures(mut self, n: u32) -> GatewayConfigBuilder {
        self.scrape.down_after_failures = Some(n);
        self
    }

    /// One more entry of `auth.keys`.
    pub fn api_key(mut self, key: ApiKey) -> GatewayConfigBuilder {
        self.auth_keys.push(key);
        self
    }

    /// `auth.keys_file`.
    pub fn keys_file(mut self, path: &Path) -> GatewayConfigBuilder {
        self.keys_file = Some(path.display().to_string());
        self
    }

    /// `auth.shared_limits`, as a YAML flow mapping (`{ redis_url: …, … }`).
    pub fn shared_limits(mut self, yaml: &str) -> GatewayConfigBuilder {
        self.shared_limits = Some(yaml.to_string());
        self
    }

    /// TLS on the API listener with this default certificate.
    pub fn tls(mut self, cert_file: &str, key_file: &str) -> GatewayConfigBuilder {
        assert!(self.tls.is_none(), "tls set twice");
        self.tls = Some(Tls { cert_file: cert_file.into(), key_file: key_file.into(), sni_certs: Vec::new() });
        self
    }

    /// One more certificate, served by SNI (`tls.certs`); needs [`Self::tls`] first.
    pub fn sni_cert(mut self, cert_file: &str, key_file: &str) -> GatewayConfigBuilder {
        self.tls.as_mut().expect("tls() before sni_cert()").sni_certs.push((cert_file.into(), key_file.into()));
        self
    }

    /// `upstream_tls.ca_file`.
    pub fn upstream_ca(mut self, ca_file: &Path) -> GatewayConfigBuilder {
        self.upstream_ca = Some(ca_file.display().to_string());
        self
    }

    /// Any other top-level key with its YAML value, e.g.
    /// `.section("limits", "{ max_body_bytes: 4096 }")` or `.section("h2c", "false")`.
    pub fn section(mut self, key: &str, value: &str) -> GatewayConfigBuilder {
        assert!(!TYPED_KEYS.contains(&key), "`{key}` has a typed setter; use it");
        assert!(self.sections.iter().all(|(k, _)| k != key), "`{key}` set twice");
        self.sections.push((key.into(), value.into()));
        self
    }

    /// The YAML file.
    pub fn render(&self) -> String {
        let addr = |a: Option<SocketAddr>, any: &str| a.map_or_else(|| any.to_string(), |a| a.to_string());
        let listen = if self.no_api { "null".to_string() } else { addr(self.listen, LISTEN_ANY_PORT) };
        let mut y = format!(
            "listen: {}\nadmin_listen: {}\nthreads: {}\n",
            listen,
            addr(self.admin_listen, ADMIN_LISTEN_ANY_PORT),
            self.threads
        );
        match &self.discovery {
            Discovery::None => {}
            Discovery::Static(entries) => {
                y.push_str("discovery:\n  static:\n");
                for (url, models) in entries {
                    let mut fields = format!("url: {url}");
                    if !models.is_empty() {
                        let _ = write!(fields, ", models: [{}]", models.join(", "));
                    }
                    if let Some((_, endpoint, replay)) = self.kv_event_endpoints.iter().find(|(u, _, _)| u == url) {
                        let _ = write!(fields, ", kv_events: \"{endpoint}\"");
                        if let Some(r) = replay {
                            let _ = write!(fields, ", kv_events_replay: \"{r}\"");
                        }
                    }
                    let _ = writeln!(y, "    - {{ {fields} }}");
                }
            }
            Discovery::Kubernetes { namespace, service, port_name, api_server } => {
                let _ = writeln!(
                    y,
                    "discovery:\n  kubernetes: {{ namespace: {namespace}, service: {service}, port_name: {port_name}, \
                     api_server: \"{api_server}\" }}"
                );
            }
            Discovery::Dns { name, port, interval_ms } => {
                let _ = writeln!(y, "discovery:\n  dns: {{ name: {name}, port: {port}, interval_ms: {interval_ms} }}");
            }
            Discovery::InferencePool { name, namespace, api_server } => {
                let _ = writeln!(
                    y,
                    "discovery:\n  inference_pool: {{ name: {name}, namespace: {namespace}, api_server: \"{api_server}\" }}"
                );
            }
        }
        if let Some(p) = &self.policy {
            let _ = writeln!(y, "policy: {{ type: {p} }}");
        }
        let s = &self.scrape;
        y.push_str("scrape: { ");
        if let Some(source) = &s.source {
            let _ = write!(y, "source: {source}, ");
        }
        let _ = write!(
            y,
            "interval_ms: {}, timeout_ms: {}, stale_after_ms: {}",
            s.interval_ms, s.timeout_ms, s.stale_after_ms
        );
        if let Some(n) = s.down_after_failures {
            let _ = write!(y, ", down_after_failures: {n}");
        }
        y.push_str(" }\n");
        if !self.auth_keys.is_empty() || self.keys_file.is_some() {
            y.push_str("auth:\n");
            if let Some(f) = &self.keys_file {
                let _ = writeln!(y, "  keys_file: {f}");
            }
            if let Some(l) = &self.shared_limits {
                let _ = writeln!(y, "  shared_limits: {l}");
            }
            if !self.auth_keys.is_empty() {
                y.push_str("  keys:\n");
                for k in &self.auth_keys {
                    let _ = writeln!(y, "    - {}", k.render());
                }
            }
        }
        if let Some(t) = &self.tls {
            let _ = writeln!(y, "tls:\n  cert_file: {}\n  key_file: {}", t.cert_file, t.key_file);
            if !t.sni_certs.is_empty() {
                y.push_str("  certs:\n");
                for (c, k) in &t.sni_certs {
                    let _ = writeln!(y, "    - {{ cert_file: {c}, key_file: {k} }}");
                }
            }
        }
        if let Some(ca) = &self.upstream_ca {
            let _ = writeln!(y, "upstream_tls: {{ ca_file: {ca} }}");
        }
        for (k, v) in &self.sections {
            let _ = writeln!(y, "{k}: {v}");
        }
        debug_assert_eq!(
            y.lines()
                .filter(|l| !l.starts_with(' '))
                .map(|l| l.split(':').next().unwrap())
                .collect::<BTreeSet<_>>()
                .len(),
            y.lines().filter(|l| !l.starts_with(' ')).count(),
            "a top-level key twice:\n{y}"
        );
        y
    }
}

/// The hex SHA-256 of an API key, as `auth.keys[].key_sha256` wants it (`sha256sum`).
pub fn sha256(key: &str) -> String {
    let out = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(key.as_bytes())?;
            c.wait_with_output()
        })
        .expect("sha256sum");
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_typed_part_once() {
        let l: SocketAddr = "127.0.0.1:1000".parse().unwrap();
        let a: SocketAddr = "127.0.0.1:1001".parse().unwrap();
        let y = GatewayConfigBuilder::new()
            .listeners(l, a)
            .backends(["http://127.0.0.1:1", "http://127.0.0.1:2"])
            .backend_serving("http://127.0.0.1:3", &["m"])
            .backend_with_kv_events("http://127.0.0.1:4", "tcp://127.0.0.1:5", Some("tcp://127.0.0.1:6"))
            .policy("least_load")
            .scrape_source("load")
            .down_after_failures(100)
            .api_key(ApiKey::new("a", "00ff").requests_per_second(0.5).burst(2))
            .tls("a.crt", "a.key")
            .sni_cert("b.crt", "b.key")
            .section("limits", "{ max_body_bytes: 4096 }")
            .render();
        assert_eq!(
            y,
            "listen: 127.0.0.1:1000\nadmin_listen: 127.0.0.1:1001\nthreads: 2\ndiscovery:\n  static:\n    \
             - { url: http://127.0.0.1:1 }\n    - { url: http://127.0.0.1:2 }\n    - { url: http://127.0.0.1:3, models: [m] }\n    \
             - { url: http://127.0.0.1:4, kv_events: \"tcp://127.0.0.1:5\", kv_events_replay: \"tcp://127.0.0.1:6\" }\n\
             policy: { type: least_load }\nscrape: { source: load, interval_ms: 50, timeout_ms: 500, stale_after_ms: 1000, \
             down_after_failures: 100 }\nauth:\n  keys:\n    - { tenant: a, key_sha256: 00ff, requests_per_second: 0.5, \
             burst: 2 }\ntls:\n  cert_file: a.crt\n  key_file: a.key\n  certs:\n    - { cert_file: b.crt, key_file: b.key }\n\
             limits: { max_body_bytes: 4096 }\n"
        );
    }

    #[test]
    #[should_panic(expected = "typed setter")]
    fn a_typed_key_cannot_come_in_as_a_section() {
        let _ = GatewayConfigBuilder::new().section("policy", "{ type: cost }");
    }

    #[test]
    #[should_panic(expected = "set twice")]
    fn a_section_cannot_be_set_twice() {
        let _ = GatewayConfigBuilder::new().section("limits", "{}").section("limits", "{}");
    }
}
