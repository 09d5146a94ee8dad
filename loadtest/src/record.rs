//! One request's measurements, as the client recorded them.

use serde::{Deserialize, Serialize};

/// What happened to one request (a line of `requests.jsonl`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Target name (`--target NAME=URL`).
    pub target: String,
    /// Sequence number within the run (the same id gets the same request on every target).
    pub id: u64,
    /// Sweep point this request belongs to (0 without a sweep).
    pub point: usize,
    /// Start time, ms since the run (or sweep point) started.
    pub start_ms: f64,
    /// Time to first token (first non-empty content chunk), ms.
    pub ttft_ms: Option<f64>,
    /// Gaps between consecutive content chunks, ms.
    pub itl_ms: Vec<f64>,
    /// Start to last byte, ms.
    pub e2e_ms: f64,
    /// Prompt tokens (server `usage` when given).
    pub prompt_tokens: u64,
    /// Output tokens (server `usage` when given, else content chunks counted).
    pub output_tokens: u64,
    /// HTTP status, when a response header arrived.
    pub status: Option<u16>,
    /// Error kind when the request failed (`connect`, `http_4xx`, `http_5xx`, `timeout`,
    /// `stream_error`, `malformed_stream`, `truncated`…); `None` on success.
    pub error: Option<String>,
    /// Whether it was in the warm-up (excluded from statistics).
    pub warmup: bool,
}

impl RequestRecord {
    /// A record for a request about to be sent; the client fills in the rest.
    pub fn started(target: &str, id: u64, point: usize, start_ms: f64, warmup: bool) -> Self {
        RequestRecord {
            target: target.to_string(),
            id,
            point,
            start_ms,
            ttft_ms: None,
            itl_ms: Vec::new(),
            e2e_ms: 0.0,
            prompt_tokens: 0,
            output_tokens: 0,
            status: None,
            error: None,
            warmup,
        }
    }

    /// Time per output token after the first: (e2e − ttft) / (output − 1), ms.
    pub fn tpot_ms(&self) -> Option<f64> {
        let ttft = self.ttft_ms?;
        (self.output_tokens > 1).then(|| (self.e2e_ms - ttft) / (self.output_tokens - 1) as f64)
    }
}
