//! DNS discovery for headless Services: every `discovery.dns.interval_ms` the name is
//! resolved and each address becomes a backend (`http://ADDR:port`), published through a
//! [`Publisher`]. A failed lookup keeps the last known set (a resolver
//! hiccup must not empty the cluster); an empty answer empties it.

use std::net::IpAddr;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use super::Publisher;
use crate::config::DnsDiscovery;

/// Backend URLs for `addrs` on `port`: sorted, without repeats, IPv6 in brackets.
pub fn dns_urls(addrs: impl IntoIterator<Item = IpAddr>, port: u16) -> Vec<String> {
    let mut urls: Vec<String> = addrs
        .into_iter()
        .map(|a| match a {
            IpAddr::V4(v4) => format!("http://{v4}:{port}"),
            IpAddr::V6(v6) => format!("http://[{v6}]:{port}"),
        })
        .collect();
    urls.sort();
    urls.dedup();
    urls
}

/// The resolver service.
pub struct DnsService {
    publisher: Publisher,
    cfg: DnsDiscovery,
}

impl DnsService {
    /// Resolve what `cfg` names, publishing through `publisher`.
    pub fn new(publisher: Publisher, cfg: DnsDiscovery) -> Self {
        DnsService { publisher, cfg }
    }
}

#[async_trait]
impl BackgroundService for DnsService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            match tokio::net::lookup_host((self.cfg.name.as_str(), self.cfg.port)).await {
                Ok(addrs) => self.publisher.publish(dns_urls(addrs.map(|a| a.ip()), self.cfg.port), "dns").await,
                Err(e) => {
                    tracing::warn!(name = %self.cfg.name, error = %e, "dns discovery: lookup failed; keeping the last set")
                }
            }
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(Duration::from_millis(self.cfg.interval_ms)) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_become_sorted_unique_urls() {
        let a: Vec<IpAddr> =
            ["10.0.0.2", "10.0.0.1", "fd00::1", "10.0.0.2"].iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(dns_urls(a, 8001), vec!["http://10.0.0.1:8001", "http://10.0.0.2:8001", "http://[fd00::1]:8001"]);
        assert!(dns_urls(std::iter::empty(), 1).is_empty());
    }
}
