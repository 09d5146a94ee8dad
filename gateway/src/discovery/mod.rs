//! Discovery: where backends come from.
//!
//! | source | module | what it publishes |
//! |---|---|---|
//! | `static` | [`static_list`] | the config's `discovery.static` list; names resolved when a config is applied and every `discovery.resolve_interval_ms` |
//! | `dns` | [`dns`] | every address of a (headless Service) name |
//! | `kubernetes` | [`kubernetes`] | the ready endpoints of a Service's EndpointSlices |
//! | `inference_pool` | [`inference_pool`] | the ready Pods an `InferencePool` selects, at its target ports |
//!
//! A dynamic source is a background service holding a [`Publisher`] — not the gateway's
//! state — and calls [`Publisher::publish`] with the complete set of URLs it sees now;
//! the publisher drops repeats and hands a changed set, off the async runtime, to what
//! applies it (the gateway state rebuilds its cluster view; backends that stay keep their
//! counters). **Adding a source**: a module here with a pure core (answer → URLs) and a
//! background service around it, a section in [`crate::config::DiscoveryConfig`] that
//! validates itself, and one line in `server.rs` that starts it with a publisher.

pub mod dns;
pub mod inference_pool;
pub mod kubernetes;
pub mod static_list;

use std::sync::Arc;

use parking_lot::Mutex;

pub use static_list::{backend_specs, backend_specs_with, system_resolve};

/// The handle a discovery source publishes through.
#[derive(Clone)]
pub struct Publisher {
    apply: Arc<dyn Fn(Vec<String>) + Send + Sync>,
    last: Arc<Mutex<Option<Vec<String>>>>,
}

impl Publisher {
    /// A publisher that hands each changed set to `apply` (which may block: it runs on a
    /// blocking thread).
    pub fn new(apply: impl Fn(Vec<String>) + Send + Sync + 'static) -> Self {
        Publisher { apply: Arc::new(apply), last: Arc::new(Mutex::new(None)) }
    }

    /// The complete set `source` sees now; nothing happens when it did not change.
    pub async fn publish(&self, urls: Vec<String>, source: &'static str) {
        {
            let mut last = self.last.lock();
            if last.as_ref() == Some(&urls) {
                return;
            }
            *last = Some(urls.clone());
        }
        tracing::info!(source, backends = ?urls, "discovery: backends changed");
        let apply = self.apply.clone();
        let _ = tokio::task::spawn_blocking(move || apply(urls)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_changed_sets_are_applied() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let p = Publisher::new(move |urls| sink.lock().push(urls));
        p.publish(vec!["http://a:1".into()], "test").await;
        p.publish(vec!["http://a:1".into()], "test").await;
        p.publish(vec![], "test").await;
        assert_eq!(*seen.lock(), vec![vec!["http://a:1".to_string()], vec![]]);
    }
}
