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

#[derive(Deserialize)]
struct PromptParts {
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    prompt: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<serde_json::Value>,
}

/// The canonical prompt text that prefix routing hashes: a completion's `prompt` (an array
/// of prompts joined by newlines; token ids written as numbers), or a chat's whole
/// conversation, every message in order as `<|role|>\n{content}\n` (content parts of type
/// text concatenated). Two requests share a prefix of this text exactly when they share the
/// corresponding prefix of conversation, which is what an engine's prefix cache rewards.
/// Empty when the body has neither (the engine will reject it anyway).
pub fn canonical_prompt(body: &[u8]) -> String {
    let Ok(parts) = serde_json::from_slice::<PromptParts>(body) else { return String::new() };
    let mut out = String::new();
    if let Some(messages) = parts.messages {
        for m in messages {
            out.push_str("<|");
            out.push_str(m.role.as_deref().unwrap_or(""));
            out.push_str("|>\n");
            if let Some(c) = &m.content {
                push_content(&mut out, c);
            }
            out.push('\n');
        }
    } else if let Some(p) = &parts.prompt {
        push_content(&mut out, p);
    }
    out
}

fn push_content(out: &mut String, v: &serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::String(s) => out.push_str(s),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::Object(o) => {
                        if let Some(Value::String(t)) = o.get("text") {
                            out.push_str(t);
                        }
                    }
                    Value::Number(n) => {
                        if i > 0 {
                            out.push(' ');
                        }
                        out.push_str(&n.to_string());
                    }
                    other => {
                        if i > 0 {
                            out.push('\n');
                        }
                        push_content(out, other);
                    }
                }
            }
        }
        _ => {}
    }
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
    fn canonical_prompt_renders_the_whole_conversation() {
        let chat = br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"assistant","content":null}]}"#;
        assert_eq!(canonical_prompt(chat), "<|system|>\nbe brief\n<|user|>\nab\n<|assistant|>\n\n");
        // A continued conversation extends the previous canonical text.
        let first = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let second = br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#;
        assert!(canonical_prompt(second).starts_with(&canonical_prompt(first)));
        assert_eq!(canonical_prompt(br#"{"prompt":"once upon"}"#), "once upon");
        assert_eq!(canonical_prompt(br#"{"prompt":["a","b"]}"#), "a\nb");
        assert_eq!(canonical_prompt(br#"{"prompt":[1,2,3]}"#), "1 2 3");
        assert_eq!(canonical_prompt(br#"{"messages":5}"#), "");
        assert_eq!(canonical_prompt(b"{}"), "");
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
