//! Errors of the shim.
//!
//! There are exactly two ways a `/metrics` body can fail to become a
//! [`LoadSignal`](crate::LoadSignal): the text is not valid Prometheus text
//! exposition (a truncated scrape, a proxy's HTML error page, a broken
//! exporter), or it is valid but carries none of the engine metrics the shim
//! knows. Both are worth telling apart in the gateway's logs, so they are
//! separate variants, and a syntax error always names the 1-based line.

/// Why a `/metrics` body could not be turned into a load signal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShimError {
    /// A line is not valid Prometheus text exposition format 0.0.4.
    #[error("malformed metrics text at line {line}: {reason}")]
    Syntax {
        /// 1-based number of the offending line.
        line: usize,
        /// What is wrong with it, e.g. ``expected `=` after label name `model_name`, found `:` ``.
        reason: String,
    },
    /// The body is valid but holds no metric of a known engine family
    /// (vLLM, SGLang, TGI, llama.cpp).
    #[error("no known engine metrics (vLLM, SGLang, TGI or llama.cpp) in the metrics text")]
    NoKnownMetrics,
    /// A sidecar's `/load` body is not the JSON [`crate::expose::load_json`] writes, or
    /// says the engine behind it is not ready.
    #[error("sidecar /load: {0}")]
    Load(String),
}
