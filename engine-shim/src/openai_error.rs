//! The OpenAI error shape, the one body every Switchyard binary answers an error with.
//!
//! `{"error": {"message": …, "type": …, "param": …, "code": …}}` — the same object is the
//! body of an HTTP error answer and the `data:` of an SSE error event sent mid-stream, so a
//! client has one shape to parse whichever way the failure reached it.

/// The OpenAI error object for `message`, with its `type` (`invalid_request_error`,
/// `not_found_error`, …), the offending `param` and a machine-readable `code`, when known.
///
/// ```
/// let v = switchyard_shim::openai_error::error_body("bad", "invalid_request_error", Some("n"), None);
/// assert_eq!(v.to_string(), r#"{"error":{"code":null,"message":"bad","param":"n","type":"invalid_request_error"}}"#);
/// ```
pub fn error_body(message: &str, error_type: &str, param: Option<&str>, code: Option<&str>) -> serde_json::Value {
    serde_json::json!({
        "error": { "message": message, "type": error_type, "param": param, "code": code }
    })
}
