//! Errors: configuration problems, the one table mapping request errors to HTTP, and the
//! closed set of ways an engine exchange can fail.
//!
//! [`ProxyError`] is everything the gateway itself can answer to a client. Its status,
//! OpenAI `type` and stable `kind` label (used in metrics and the access log) live in one
//! place; bodies use the OpenAI error shape ([`switchyard_shim::openai_error`]), the same
//! object whether it is an HTTP answer or the SSE error event that ends a broken stream.
//!
//! [`UpstreamErrorKind`] is every failure of an exchange with an engine: it owns its metric
//! label, whether another engine may take the request, and whether it counts towards the
//! backend's ejection.

use std::fmt;

/// One invalid field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted path (`discovery.static[0].url`).
    pub field: String,
    /// Value given.
    pub value: String,
    /// What is wrong.
    pub reason: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} (got {:?})", self.field, self.reason, self.value)
    }
}

/// The field errors found while validating a configuration, in the order found.
#[derive(Debug, Default)]
pub struct Errors(Vec<FieldError>);

impl Errors {
    /// `field` (a dotted path) has `value`, which is wrong because of `reason`.
    pub fn add(&mut self, field: impl Into<String>, value: impl ToString, reason: impl Into<String>) {
        self.0.push(FieldError { field: field.into(), value: value.to_string(), reason: reason.into() });
    }

    /// Take over `other`'s errors.
    pub fn append(&mut self, mut other: Errors) {
        self.0.append(&mut other.0);
    }

    /// What was found.
    pub fn list(&self) -> &[FieldError] {
        &self.0
    }

    /// Whether nothing was found.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `Ok` when nothing was found, else every error at once.
    pub fn into_result(self) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(self.0))
        }
    }
}

/// A configuration file could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Unreadable file.
    #[error("cannot read {path}: {reason}")]
    Io {
        /// File.
        path: String,
        /// OS error.
        reason: String,
    },
    /// Not valid YAML for the schema (syntax, unknown key, wrong type).
    #[error("{0}")]
    Parse(String),
    /// Parsed but invalid.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<FieldError>),
}

/// What the gateway answers a client when it cannot proxy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    /// Body is not the JSON we need (400).
    #[error("{0}")]
    BadRequest(String),
    /// Body over `limits.max_body_bytes` (413).
    #[error("request body is larger than the limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: u64,
    },
    /// A prompt array over `limits.max_messages` or `limits.max_prompt_items` (400).
    #[error("Invalid '{param}': too many {what}. Expected at most {max}, but got {got} instead.")]
    TooLong {
        /// The request field.
        param: &'static str,
        /// What its entries are.
        what: &'static str,
        /// The limit.
        max: usize,
        /// What the request has.
        got: usize,
    },
    /// Bodies being buffered process-wide are at `limits.max_buffered_body_bytes` (503).
    #[error("the gateway is buffering too many request bodies; retry shortly")]
    BodyBufferFull,
    /// The client did not send its body in time (408).
    #[error("the request body was not received within {0} ms")]
    BodyTimeout(u64),
    /// No backend serves this model (404).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// No route (404).
    #[error("no route for {0}")]
    NoRoute(String),
    /// Method not allowed on this path (405).
    #[error("method {0} is not allowed here")]
    MethodNotAllowed(String),
    /// The model exists but no backend can take the request now (503).
    #[error("no backend available for model `{0}`")]
    NoBackend(String),
    /// Every attempt failed to reach an engine (502). The detail (an engine's address, the
    /// OS error) is for the logs ([`ProxyError::log_detail`]); the client's body says only
    /// that no engine could be reached.
    #[error("could not reach an engine")]
    Upstream(String),
    /// The engine did not answer in time (504).
    #[error("the engine did not answer within {0} ms")]
    UpstreamTimeout(u64),
    /// No API key, or one that is not configured (401). The key is never part of it.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// A key over its limit (429).
    #[error("rate limit reached for {tenant}: {what} per {period}; retry after {retry_after_secs} s")]
    RateLimited {
        /// `requests` or `tokens` (the OpenAI error type).
        what: &'static str,
        /// `second` or `minute`.
        period: &'static str,
        /// The key's tenant.
        tenant: String,
        /// Seconds until the request would pass.
        retry_after_secs: u64,
    },
    /// One request that may use more tokens than its key gets in a whole minute (429, as
    /// OpenAI's "Request too large"): waiting would not help.
    #[error(
        "Request too large for {tenant} on tokens per minute: limit {limit}, requested {requested} (the prompt's \
         estimate plus n x max_tokens); send a shorter prompt, fewer choices or a lower max_tokens"
    )]
    TokensTooLarge {
        /// The key's tenant.
        tenant: String,
        /// Its tokens per minute.
        limit: u64,
        /// What the request was charged.
        requested: u64,
    },
    /// The tenant already has `admission.max_queue_per_tenant` requests waiting (429).
    #[error(
        "{tenant} already has {max} requests waiting for an engine (admission.max_queue_per_tenant); retry shortly"
    )]
    TenantQueueFull {
        /// The key's tenant.
        tenant: String,
        /// Its cap.
        max: usize,
    },
    /// Header block over `limits.max_header_bytes` or `limits.max_headers` (431).
    #[error("{0}")]
    HeaderTooLarge(String),
    /// The engine failed after the response began: sent as the SSE event that ends the
    /// stream (the status line is long gone).
    #[error("the engine stream failed: {}", .0.label())]
    StreamBroken(UpstreamErrorKind),
}

/// How an exchange with an engine failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    /// The backend's name does not resolve.
    Unresolved,
    /// No connection could be opened.
    Connect,
    /// A pooled connection turned out dead when used.
    ReusedConnection,
    /// The engine closed or reset the connection before answering.
    UpstreamIo,
    /// No response header within `timeouts.first_byte_ms`.
    FirstByteTimeout,
    /// The engine answered 5xx (passed on to the client).
    Status5xx,
    /// The engine answered a status in `retries.retry_on_status`, retried elsewhere.
    RetriedStatus,
    /// No body chunk within `timeouts.idle_ms` mid-response.
    IdleTimeout,
    /// The connection broke mid-response.
    StreamBroken,
    /// A retry was due but the retry budget was spent.
    RetryBudgetSpent,
}

impl UpstreamErrorKind {
    /// Label of `switchyard_upstream_errors_total{kind}` and of the access log's `error`.
    pub fn label(self) -> &'static str {
        match self {
            UpstreamErrorKind::Unresolved => "unresolved",
            UpstreamErrorKind::Connect => "connect",
            UpstreamErrorKind::ReusedConnection => "reused_connection",
            UpstreamErrorKind::UpstreamIo => "upstream_io",
            UpstreamErrorKind::FirstByteTimeout => "first_byte_timeout",
            UpstreamErrorKind::Status5xx => "status_5xx",
            UpstreamErrorKind::RetriedStatus => "retried_status",
            UpstreamErrorKind::IdleTimeout => "idle_timeout",
            UpstreamErrorKind::StreamBroken => "stream_broken",
            UpstreamErrorKind::RetryBudgetSpent => "retry_budget_spent",
        }
    }

    /// Whether another engine may take the request: nothing reached the engine's
    /// application or the client (a first-byte timeout is not retried: the engine may
    /// still be working on it).
    pub fn retryable(self) -> bool {
        matches!(
            self,
            UpstreamErrorKind::Unresolved
                | UpstreamErrorKind::Connect
                | UpstreamErrorKind::ReusedConnection
                | UpstreamErrorKind::UpstreamIo
                | UpstreamErrorKind::RetriedStatus
        )
    }

    /// Whether it counts towards the backend's consecutive failures (outlier ejection).
    pub fn ejects(self) -> bool {
        !matches!(self, UpstreamErrorKind::RetryBudgetSpent)
    }
}

impl ProxyError {
    /// A key over its limit of `what` (`requests`, `tokens`) per `period`, allowed again after
    /// `wait` (`Retry-After` rounds it up, at least 1 s).
    pub fn rate_limited(what: &'static str, period: &'static str, tenant: &str, wait: std::time::Duration) -> Self {
        ProxyError::RateLimited {
            what,
            period,
            tenant: tenant.to_string(),
            retry_after_secs: wait.as_secs_f64().ceil().max(1.0) as u64,
        }
    }

    /// `param` of the request has `got` entries (`what`), more than `max`.
    pub fn too_long(param: &'static str, what: &'static str, max: usize, got: usize) -> Self {
        ProxyError::TooLong { param, what, max, got }
    }

    /// What a log line says about it: the error, or for [`ProxyError::Upstream`] the detail
    /// its client-facing text leaves out.
    pub fn log_detail(&self) -> &dyn std::fmt::Display {
        match self {
            ProxyError::Upstream(detail) => detail,
            other => other,
        }
    }

    /// HTTP status.
    pub fn status(&self) -> u16 {
        match self {
            ProxyError::BadRequest(_) | ProxyError::TooLong { .. } => 400,
            ProxyError::BodyTooLarge { .. } => 413,
            ProxyError::BodyTimeout(_) => 408,
            ProxyError::ModelNotFound(_) | ProxyError::NoRoute(_) => 404,
            ProxyError::MethodNotAllowed(_) => 405,
            ProxyError::NoBackend(_) | ProxyError::BodyBufferFull => 503,
            ProxyError::Upstream(_) => 502,
            ProxyError::UpstreamTimeout(_) => 504,
            ProxyError::Unauthorized(_) => 401,
            ProxyError::RateLimited { .. } | ProxyError::TenantQueueFull { .. } | ProxyError::TokensTooLarge { .. } => {
                429
            }
            ProxyError::HeaderTooLarge(_) => 431,
            ProxyError::StreamBroken(_) => 502,
        }
    }

    /// Stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ProxyError::BadRequest(_) => "bad_request",
            ProxyError::BodyTooLarge { .. } => "body_too_large",
            ProxyError::TooLong { .. } => "prompt_too_long",
            ProxyError::BodyBufferFull => "body_buffer_full",
            ProxyError::BodyTimeout(_) => "body_timeout",
            ProxyError::ModelNotFound(_) => "model_not_found",
            ProxyError::NoRoute(_) => "no_route",
            ProxyError::MethodNotAllowed(_) => "method_not_allowed",
            ProxyError::NoBackend(_) => "no_backend",
            ProxyError::Upstream(_) => "upstream_error",
            ProxyError::UpstreamTimeout(_) => "upstream_timeout",
            ProxyError::Unauthorized(_) => "unauthorized",
            ProxyError::RateLimited { what: "tokens", .. } => "rate_limited_tokens",
            ProxyError::RateLimited { .. } => "rate_limited_requests",
            ProxyError::TokensTooLarge { .. } => "tokens_too_large",
            ProxyError::TenantQueueFull { .. } => "tenant_queue_full",
            ProxyError::HeaderTooLarge(_) => "header_too_large",
            ProxyError::StreamBroken(kind) => kind.label(),
        }
    }

    /// OpenAI error `type`.
    pub fn error_type(&self) -> &'static str {
        match self {
            ProxyError::RateLimited { what, .. } => return what,
            ProxyError::TenantQueueFull { .. } => return "requests",
            ProxyError::TokensTooLarge { .. } => return "tokens",
            _ => {}
        }
        match self.status() {
            400 | 401 | 405 | 408 | 413 | 431 => "invalid_request_error",
            404 => "not_found_error",
            _ => "service_unavailable",
        }
    }

    /// OpenAI error `code`, where a client may branch on it.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            ProxyError::ModelNotFound(_) => Some("model_not_found"),
            ProxyError::Unauthorized(_) => Some("invalid_api_key"),
            ProxyError::RateLimited { .. } | ProxyError::TenantQueueFull { .. } => Some("rate_limit_exceeded"),
            ProxyError::TokensTooLarge { .. } => Some("request_too_large"),
            ProxyError::StreamBroken(kind) => Some(kind.label()),
            _ => None,
        }
    }

    /// OpenAI-shaped JSON body.
    pub fn body(&self) -> String {
        let param = match self {
            ProxyError::ModelNotFound(_) => Some("model"),
            ProxyError::TooLong { param, .. } => Some(*param),
            _ => None,
        };
        switchyard_shim::openai_error::error_body(&self.to_string(), self.error_type(), param, self.code()).to_string()
    }

    /// The SSE event that ends a stream with this error: `data: {"error": …}` and a blank line.
    pub fn sse_event(&self) -> String {
        format!("data: {}\n\n", self.body())
    }

    /// Whether the gateway refuses the request on its own account (a key's limits, the
    /// process-wide body buffer): counted in `switchyard_rejected_total` besides being answered.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            ProxyError::RateLimited { .. }
                | ProxyError::TenantQueueFull { .. }
                | ProxyError::TokensTooLarge { .. }
                | ProxyError::BodyBufferFull
        )
    }

    /// Seconds a client should wait before retrying (503, 429).
    pub fn retry_after_secs(&self) -> Option<u64> {
        match self {
            ProxyError::NoBackend(_) | ProxyError::BodyBufferFull | ProxyError::TenantQueueFull { .. } => Some(1),
            ProxyError::RateLimited { retry_after_secs, .. } => Some(*retry_after_secs),
            _ => None,
        }
    }
}
