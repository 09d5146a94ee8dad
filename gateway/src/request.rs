//! What routing needs from a request body, parsed without copying the body.
//!
//! The body itself is forwarded byte for byte; this only extracts `model` and `stream`,
//! and checks that the body is a JSON object (so malformed input gets a 400 from the
//! gateway instead of costing an engine a connection).

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::error::ProxyError;

/// Routing fields of an OpenAI request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingFields {
    /// `model`, if given.
    pub model: Option<String>,
    /// `stream`.
    pub stream: bool,
}

#[derive(Deserialize)]
struct Raw<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
}

/// Parse the routing fields; the error names what is wrong.
pub fn routing_fields(body: &[u8]) -> Result<RoutingFields, ProxyError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(ProxyError::BadRequest("request body must be a JSON object".into()));
    }
    // serde skips the bytes of fields it ignores without checking them: check UTF-8 first.
    let text = std::str::from_utf8(body).map_err(|e| {
        ProxyError::BadRequest(format!("request body is not valid JSON: invalid UTF-8 at byte {}", e.valid_up_to()))
    })?;
    let raw: Raw<'_> = serde_json::from_str(text)
        .map_err(|e| ProxyError::BadRequest(format!("request body is not valid JSON: {e}")))?;
    let model = match raw.model {
        None => None,
        Some(v) if v.get() == "null" => None,
        Some(v) => Some(
            serde_json::from_str::<String>(v.get())
                .map_err(|_| ProxyError::BadRequest(format!("model must be a string, got {}", truncate(v.get()))))?,
        ),
    };
    let stream = match raw.stream {
        None => false,
        Some(v) => match v.get() {
            "true" => true,
            "false" | "null" => false,
            other => return Err(ProxyError::BadRequest(format!("stream must be a boolean, got {}", truncate(other)))),
        },
    };
    Ok(RoutingFields { model, stream })
}

fn truncate(s: &str) -> &str {
    let mut end = s.len().min(40);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_model_and_stream() {
        let f = routing_fields(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#).unwrap();
        assert_eq!(f, RoutingFields { model: Some("m".into()), stream: true });
        assert_eq!(routing_fields(b" {}").unwrap(), RoutingFields { model: None, stream: false });
    }

    #[test]
    fn malformed_bodies_are_400_with_a_reason() {
        for (body, needle) in [
            (&b"[1]"[..], "JSON object"),
            (b"", "JSON object"),
            (b"{\"model\": ", "not valid JSON"),
            (b"{\"model\": 5}", "model must be a string"),
            (b"{\"model\": \"m\", \"stream\": \"yes\"}", "stream must be a boolean"),
            (b"{\"prompt\": \"\xff\"}", "not valid JSON"),
            (b"{\"a\":1} trailing", "not valid JSON"),
        ] {
            let e = routing_fields(body).expect_err(&String::from_utf8_lossy(body));
            assert_eq!(e.status(), 400);
            assert!(e.to_string().contains(needle), "{e}");
        }
    }
}
