//! [`RequestCtx`]: everything one request carries from phase to phase (pingora's `CTX`).
//!
//! What drives behaviour (the tenant, its token charge, the backends already tried, the
//! last upstream error) and what is reported at the end (status, timings, bytes, the
//! routing reason) live in one struct, filled in as the phases run and read once by
//! [`super::ProxyApp::finish`].

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::Tenant;
use crate::body_budget::BodyReservation;
use crate::error::ProxyError;
use crate::request::UsageMeter;

/// Which token budget a request was charged to.
#[derive(Clone)]
pub enum Ledger {
    /// This replica's budget for the key.
    Local,
    /// The key's budget in Redis (`auth.shared_limits`).
    Shared,
    /// This replica's share while Redis could not be reached.
    Fallback(Arc<crate::auth::FallbackLimits>),
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ledger::Local => f.write_str("Local"),
            Ledger::Shared => f.write_str("Shared"),
            Ledger::Fallback(l) => write!(f, "Fallback(1/{})", l.replicas),
        }
    }
}

/// One request's state, from its head to its access-log line.
#[derive(Debug)]
pub(crate) struct RequestCtx {
    /// When the head was read.
    pub started: Instant,
    /// Request method.
    pub method: Cow<'static, str>,
    /// Request path (no query).
    pub path: Cow<'static, str>,
    /// Status sent (0 until one is; 499: the client left).
    pub status: u16,
    /// Requested (or defaulted) model.
    pub model: Option<String>,
    /// Streamed response asked for.
    pub stream: bool,
    /// The API key's tenant, refused or not.
    pub tenant: Option<Arc<Tenant>>,
    /// Charged to the tenant's token budget: (total, prompt estimate).
    pub charged: Option<(u64, u64)>,
    /// Which budget the charge went to (where it is settled).
    pub ledger: Ledger,
    /// What the response used, for settling the charge.
    pub usage: UsageMeter,
    /// Watches a streamed response for its first generated content (prefill-rate learning).
    pub content: crate::request::ContentDetector,
    /// The response is an SSE stream.
    pub sse: bool,
    /// An alias to write back over its target in the response (`rewrite_response`).
    pub writeback: Option<Box<crate::aliases::Writeback>>,
    /// Cluster positions already tried.
    pub tried: Vec<usize>,
    /// The last failed attempt's error (answered when no attempt is left).
    pub last_error: Option<ProxyError>,
    /// The backend of the last attempt.
    pub backend: Option<Arc<crate::cluster::Backend>>,
    /// The policy's reason for it.
    pub reason: Option<&'static str>,
    /// Arrival → first response chunk.
    pub ttft: Option<Duration>,
    /// Request body bytes.
    pub request_bytes: usize,
    /// Response body bytes.
    pub response_bytes: usize,
    /// Response body writes to the client (each carries every body byte the engine had
    /// sent by then, so one write may hold several SSE events).
    pub chunks: usize,
    /// Retries on other backends.
    pub retries: u32,
    /// Error label for metrics and the access log.
    pub error_kind: Option<&'static str>,
    /// `X-Request-Id` (the client's, else made here), for completions.
    pub request_id: Option<String>,
    /// The body's bytes in the process-wide buffer budget, given back with the context.
    pub body_held: Option<BodyReservation>,
}

impl RequestCtx {
    /// A request whose head was just read.
    pub fn new(method: &str, path: &str) -> Self {
        RequestCtx {
            started: Instant::now(),
            method: common(method),
            path: common(path),
            status: 0,
            model: None,
            stream: false,
            tenant: None,
            charged: None,
            ledger: Ledger::Local,
            usage: UsageMeter::default(),
            content: crate::request::ContentDetector::default(),
            writeback: None,
            sse: false,
            tried: Vec::new(),
            last_error: None,
            backend: None,
            reason: None,
            ttft: None,
            request_bytes: 0,
            response_bytes: 0,
            chunks: 0,
            retries: 0,
            error_kind: None,
            request_id: None,
            body_held: None,
        }
    }

    /// The tenant's name, or "" without API keys.
    pub fn tenant_name(&self) -> &str {
        self.tenant.as_ref().map_or("", |t| t.name.as_str())
    }

    /// The client's `X-Request-Id` when it is one to keep (1 to 128 visible ASCII
    /// characters), else a new random one.
    pub fn take_request_id(&mut self, client: Option<&[u8]>) {
        let sane = |v: &[u8]| !v.is_empty() && v.len() <= 128 && v.iter().all(|b| b.is_ascii_graphic());
        let id = match client.filter(|v| sane(v)).map(std::str::from_utf8) {
            Some(Ok(v)) => v.to_owned(),
            _ => {
                let n = rand::random::<u128>();
                let mut hex = [0u8; 32];
                for (i, digit) in hex.iter_mut().enumerate() {
                    *digit = b"0123456789abcdef"[(n >> (124 - 4 * i)) as usize & 0xf];
                }
                // 32 ASCII hex digits.
                String::from_utf8(hex.to_vec()).unwrap_or_default()
            }
        };
        self.request_id = Some(id);
    }

    /// The client went away.
    pub fn client_gone(&mut self) {
        self.error_kind = Some("client_gone");
    }
}

/// Methods and paths most requests carry: kept as they are instead of copied.
const COMMON: &[&str] = &[
    "POST",
    "GET",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/models",
    "/-/ready",
    "/-/healthz",
];

fn common(s: &str) -> Cow<'static, str> {
    COMMON.iter().find(|c| **c == s).map_or_else(|| Cow::Owned(s.to_owned()), |c| Cow::Borrowed(*c))
}
