//! [`RequestCtx`]: everything one request carries from phase to phase (pingora's `CTX`), and
//! [`Outcome`]: how it ended.
//!
//! What drives behaviour (the tenant, its token charge, the backends already tried, the
//! last upstream error) and what is reported at the end (timings, bytes, the routing
//! reason) live in one struct, filled in as the phases run and read once by
//! [`super::ProxyApp::finish`]. The status, the error label and whether the client's
//! connection may carry another request are not fields anyone writes: each phase returns
//! them as an [`Outcome`] (pingora's `FailToProxy { error_code, can_reuse_downstream }`), and
//! `finish` derives the metrics, the access line and the connection's reuse from it.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::Tenant;
use crate::body_budget::BodyReservation;
use crate::error::{ProxyError, UpstreamErrorKind};
use crate::request::UsageMeter;

use super::inflight::InflightGuard;

/// Whether the client's connection may carry another request after this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reuse {
    /// The exchange ended cleanly: the connection may carry the next request.
    Keep,
    /// Close it (the body was not read to its end, the answer was cut, the client left; or
    /// the transport has no connection to keep, as an ext_proc stream).
    Close,
}

/// How a request ended: the status sent (499: the client left first), whether its
/// connection may be reused, and the error label for metrics and the access log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Outcome {
    /// The status sent to the client (the engine's, or the gateway's own answer).
    pub status: u16,
    /// Whether the client's connection may carry another request.
    pub reuse: Reuse,
    /// What went wrong ([`ProxyError::kind`], [`UpstreamErrorKind::label`], `client_gone`).
    pub error: Option<&'static str>,
}

impl Outcome {
    /// An answer sent as `status`.
    pub fn answered(status: u16, reuse: Reuse) -> Self {
        Outcome { status, reuse, error: None }
    }

    /// The gateway answered `e`.
    pub fn failed(e: &ProxyError, reuse: Reuse) -> Self {
        Outcome { status: e.status(), reuse, error: Some(e.kind()) }
    }

    /// The client left: before any answer (`status` 499), or during the engine's
    /// (`status` the engine's).
    pub fn client_gone(status: u16) -> Self {
        Outcome { status, reuse: Reuse::Close, error: Some("client_gone") }
    }

    /// The engine failed after its answer (`status`) had begun.
    pub fn broken(status: u16, kind: UpstreamErrorKind) -> Self {
        Outcome { status, reuse: Reuse::Close, error: Some(kind.label()) }
    }
}

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

/// One request's state, from its head to its access-log line. Its fields are the request
/// path's own (`proxy`); another transport's phases (the picker's) use the methods below.
#[derive(Debug)]
pub(crate) struct RequestCtx {
    /// When the head was read.
    pub(super) started: Instant,
    /// Request method.
    pub(super) method: Cow<'static, str>,
    /// Request path (no query).
    pub(super) path: Cow<'static, str>,
    /// Requested (or defaulted) model.
    pub(super) model: Option<String>,
    /// Streamed response asked for.
    pub(super) stream: bool,
    /// The API key's tenant, refused or not.
    pub(super) tenant: Option<Arc<Tenant>>,
    /// Charged to the tenant's token budget: (total, prompt estimate).
    pub(super) charged: Option<(u64, u64)>,
    /// Which budget the charge went to (where it is settled).
    pub(super) ledger: Ledger,
    /// What the response used, for settling the charge.
    pub(super) usage: UsageMeter,
    /// Watches a streamed response for its first generated content (prefill-rate learning).
    pub(super) content: crate::request::ContentDetector,
    /// The response is an SSE stream.
    pub(super) sse: bool,
    /// An alias to write back over its target in the response (`rewrite_response`).
    pub(super) writeback: Option<Box<crate::aliases::Writeback>>,
    /// Cluster positions already tried.
    pub(super) tried: Vec<usize>,
    /// The last failed attempt's error (answered when no attempt is left).
    pub(super) last_error: Option<ProxyError>,
    /// The backend of the last attempt.
    pub(super) backend: Option<Arc<crate::cluster::Backend>>,
    /// The policy's reason for it.
    pub(super) reason: Option<&'static str>,
    /// Arrival → first response chunk.
    pub(super) ttft: Option<Duration>,
    /// Request body bytes.
    pub(super) request_bytes: usize,
    /// Response body bytes.
    pub(super) response_bytes: usize,
    /// Response body writes to the client (each carries every body byte the engine had
    /// sent by then, so one write may hold several SSE events).
    pub(super) chunks: usize,
    /// Retries on other backends.
    pub(super) retries: u32,
    /// The normalized path and query, when it differs from the one sent: what is routed and
    /// what an engine gets.
    pub(super) target: Option<String>,
    /// `X-Request-Id` (the client's, else made here), for completions.
    pub(super) request_id: Option<String>,
    /// The body's bytes in the process-wide buffer budget, given back with the context.
    pub(super) body_held: Option<BodyReservation>,
}

impl RequestCtx {
    /// A request whose head was just read.
    pub fn new(method: &str, path: &str) -> Self {
        RequestCtx {
            started: Instant::now(),
            method: common(method),
            path: common(path),
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
            target: None,
            request_id: None,
            body_held: None,
        }
    }

    /// `X-Request-Id`, once the request is an inference request.
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    /// The normalized path and query, when it differs from the one the client sent.
    pub fn normalized_target(&self) -> Option<&str> {
        self.target.as_deref()
    }

    /// The request body's length as the client sent it.
    pub fn request_bytes(&self) -> usize {
        self.request_bytes
    }

    /// The alias to write back over its target in the response, if any.
    pub fn writeback_mut(&mut self) -> Option<&mut crate::aliases::Writeback> {
        self.writeback.as_deref_mut()
    }

    /// The engine's answer began: an SSE stream or not (for the first content).
    pub fn answer_began(&mut self, sse: bool) {
        self.sse = sse;
    }

    /// The gateway in front went down its fallback list: the request is on `backend` now.
    pub fn moved_to(&mut self, backend: Arc<crate::cluster::Backend>) {
        self.backend = Some(backend);
        self.retries += 1;
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

    /// Account a piece of the engine's response body about to reach the client: the first
    /// bytes are the TTFT (returned, to be observed where the backend's histogram is), the
    /// first generated content ends the prefill the policy learns from (`inflight`), the
    /// usage settles the token charge. HTTP's stream phase and the picker's response phase
    /// both call it.
    pub fn observe_response(&mut self, chunk: &[u8], inflight: &mut InflightGuard) -> Option<Duration> {
        if chunk.is_empty() {
            return None;
        }
        let first_content = !inflight.prefilled() && (!self.sse || self.content.observe(chunk));
        let first_bytes = self.ttft.is_none();
        let mut ttft = None;
        if first_content || first_bytes {
            let now = Instant::now();
            if first_content {
                inflight.first_content(now);
            }
            if first_bytes {
                let t = now.saturating_duration_since(self.started);
                self.ttft = Some(t);
                ttft = Some(t);
            }
        }
        self.response_bytes += chunk.len();
        self.chunks += 1;
        if self.charged.is_some() {
            self.usage.observe(chunk);
        }
        ttft
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
