//! Why the sidecar cannot start: a bad engine URL or metrics that fail to register.
//!
//! Both are found before the first request is served; the binary prints the message and
//! exits non-zero. Once running, the sidecar has no fatal errors: an engine that fails is
//! reported on `/-/healthz` and `/load`, and a proxied request that fails gets a 502.

/// What stops the sidecar from starting.
#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    /// `--engine-url` is not an absolute `http://HOST:PORT` URL.
    #[error("--engine-url `{url}` must be http://HOST:PORT")]
    EngineUrl {
        /// The URL as given.
        url: String,
    },
    /// The sidecar's own Prometheus metrics could not be created or registered.
    #[error("registering the sidecar's metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}
