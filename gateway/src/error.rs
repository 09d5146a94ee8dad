//! Errors: configuration problems, and the one table mapping request errors to HTTP.
//!
//! [`ProxyError`] is everything the gateway itself can answer to a client. Its status,
//! OpenAI `type` and stable `kind` label (used in metrics and the access log) live in one
//! place; bodies use the OpenAI error shape.

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
    /// Every attempt failed to reach an engine (502).
    #[error("could not reach an engine: {0}")]
    Upstream(String),
    /// The engine did not answer in time (504).
    #[error("the engine did not answer within {0} ms")]
    UpstreamTimeout(u64),
}

impl ProxyError {
    /// HTTP status.
    pub fn status(&self) -> u16 {
        match self {
            ProxyError::BadRequest(_) => 400,
            ProxyError::BodyTooLarge { .. } => 413,
            ProxyError::BodyTimeout(_) => 408,
            ProxyError::ModelNotFound(_) | ProxyError::NoRoute(_) => 404,
            ProxyError::MethodNotAllowed(_) => 405,
            ProxyError::NoBackend(_) => 503,
            ProxyError::Upstream(_) => 502,
            ProxyError::UpstreamTimeout(_) => 504,
        }
    }

    /// Stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ProxyError::BadRequest(_) => "bad_request",
            ProxyError::BodyTooLarge { .. } => "body_too_large",
            ProxyError::BodyTimeout(_) => "body_timeout",
            ProxyError::ModelNotFound(_) => "model_not_found",
            ProxyError::NoRoute(_) => "no_route",
            ProxyError::MethodNotAllowed(_) => "method_not_allowed",
            ProxyError::NoBackend(_) => "no_backend",
            ProxyError::Upstream(_) => "upstream_error",
            ProxyError::UpstreamTimeout(_) => "upstream_timeout",
        }
    }

    /// OpenAI error `type`.
    pub fn error_type(&self) -> &'static str {
        match self.status() {
            400 | 405 | 408 | 413 => "invalid_request_error",
            404 => "not_found_error",
            _ => "service_unavailable",
        }
    }

    /// OpenAI-shaped JSON body.
    pub fn body(&self) -> String {
        let code = match self {
            ProxyError::ModelNotFound(_) => serde_json::Value::from("model_not_found"),
            _ => serde_json::Value::Null,
        };
        serde_json::json!({
            "error": { "message": self.to_string(), "type": self.error_type(), "param": null, "code": code }
        })
        .to_string()
    }

    /// Seconds a client should wait before retrying, for 503s.
    pub fn retry_after_secs(&self) -> Option<u64> {
        matches!(self, ProxyError::NoBackend(_)).then_some(1)
    }
}
