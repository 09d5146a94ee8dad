//! Errors of the engine library, and their mapping to HTTP responses.
//!
//! One table ([`ApiError::status`], [`ApiError::error_type`]) maps every API error to a
//! status code and a stable type label; bodies use the OpenAI error shape
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// A flag or setting is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `field` has an unusable `value`.
    #[error("{field}: {reason} (got {value})")]
    Invalid {
        /// Flag name.
        field: &'static str,
        /// Given value.
        value: String,
        /// What is wrong.
        reason: String,
    },
}

/// An error answered to an API client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or violates a limit (400).
    #[error("{message}")]
    InvalidRequest {
        /// The offending field, when there is one.
        param: Option<String>,
        /// What is wrong, naming the field, the limit and the value.
        message: String,
    },
    /// The model is not served here (404).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// The engine is shutting down (503).
    #[error("the engine is shutting down")]
    Unavailable,
    /// A bug met while handling the request (500); the details are in the engine's log.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { param: Some(param.into()), message: message.into() }
    }

    /// HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI error `type`, also a stable label.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest { .. } => "invalid_request_error",
            ApiError::ModelNotFound(_) => "not_found_error",
            ApiError::Unavailable => "service_unavailable",
            ApiError::Internal(_) => "internal_server_error",
        }
    }

    /// OpenAI error `code`.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::Unavailable | ApiError::Internal(_) => None,
            ApiError::ModelNotFound(_) => Some("model_not_found"),
        }
    }

    /// The JSON body: the OpenAI error shape every Switchyard binary answers with
    /// ([`switchyard_shim::openai_error::error_body`]).
    pub fn body(&self) -> serde_json::Value {
        let param = match self {
            ApiError::InvalidRequest { param, .. } => param.as_deref(),
            ApiError::ModelNotFound(_) => Some("model"),
            ApiError::Unavailable | ApiError::Internal(_) => None,
        };
        switchyard_shim::openai_error::error_body(&self.to_string(), self.error_type(), param, self.code())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.body())).into_response()
    }
}
