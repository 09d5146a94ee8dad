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
    /// `max_completion_tokens` (else `max_tokens`, the engines' precedence) when it is a
    /// non-negative integer; other values are left for the engine to reject.
    pub max_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Raw<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
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
    // The engines' precedence (vLLM, ours): `max_completion_tokens` first. Charging
    // `max_tokens` first let `{"max_tokens":1,"max_completion_tokens":100000}` pay for one.
    let max_tokens = raw.max_completion_tokens.or(raw.max_tokens).and_then(|v| v.get().parse::<u64>().ok());
    Ok(RoutingFields { model, stream, max_tokens })
}

/// Checks of a request head that pingora's parser leaves to us: the size and field count
/// limits, and a request that carried both `Content-Length` and `Transfer-Encoding`
/// (pingora drops the length and reads chunks, RFC 9112 §6.3; an edge proxy refuses such
/// a request outright, since the client and some other hop may disagree on where it
/// ends). `raw` is the head as received (HTTP/1), `fields` its field count.
pub fn check_head(raw: &[u8], fields: usize, max_bytes: usize, max_fields: usize) -> Result<(), ProxyError> {
    if raw.len() > max_bytes {
        return Err(ProxyError::HeaderTooLarge(format!(
            "request header of {} bytes is larger than the limit of {max_bytes}",
            raw.len()
        )));
    }
    if fields > max_fields {
        return Err(ProxyError::HeaderTooLarge(format!("request has {fields} header fields; at most {max_fields}")));
    }
    let has = |name: &[u8]| {
        raw.split(|&b| b == b'\n').skip(1).any(|line| {
            line.len() > name.len() && line[..name.len()].eq_ignore_ascii_case(name) && line[name.len()] == b':'
        })
    };
    if has(b"transfer-encoding") && has(b"content-length") {
        return Err(ProxyError::BadRequest("a request may not carry both Content-Length and Transfer-Encoding".into()));
    }
    Ok(())
}

/// Counts what a response used, for token budgets: the `usage.total_tokens` of the last
/// usage object seen (a non-streamed body, or a stream's `include_usage` chunk), else the
/// number of SSE data events (about one token each).
#[derive(Debug, Default)]
pub struct UsageMeter {
    tail: Vec<u8>,
    events: u64,
}

/// How much of a response's end the meter keeps.
const USAGE_TAIL_BYTES: usize = 4096;

impl UsageMeter {
    /// Account one response chunk.
    pub fn observe(&mut self, chunk: &[u8]) {
        self.events += chunk.windows(6).filter(|w| w == b"data: ").count() as u64;
        self.tail.extend_from_slice(chunk);
        if self.tail.len() > 2 * USAGE_TAIL_BYTES {
            self.tail.drain(..self.tail.len() - USAGE_TAIL_BYTES);
        }
    }

    /// Completion tokens plus prompt tokens, given the gateway's prompt estimate.
    pub fn used(&self, prompt_estimate: u64) -> u64 {
        match self.reported_total() {
            Some(total) => total,
            None => prompt_estimate + self.events.saturating_sub(1),
        }
    }

    fn reported_total(&self) -> Option<u64> {
        let key = b"\"total_tokens\":";
        let at = self.tail.windows(key.len()).rposition(|w| w == key)? + key.len();
        let digits: Vec<u8> = self.tail[at..]
            .iter()
            .skip_while(|b| b.is_ascii_whitespace())
            .take_while(|b| b.is_ascii_digit())
            .copied()
            .collect();
        std::str::from_utf8(&digits).ok()?.parse().ok()
    }
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
        assert_eq!(f, RoutingFields { model: Some("m".into()), stream: true, max_tokens: None });
        assert_eq!(routing_fields(b" {}").unwrap(), RoutingFields { model: None, stream: false, max_tokens: None });
        assert_eq!(routing_fields(br#"{"max_tokens":7}"#).unwrap().max_tokens, Some(7));
        assert_eq!(routing_fields(br#"{"max_completion_tokens":9}"#).unwrap().max_tokens, Some(9));
        let both = br#"{"max_tokens":1,"max_completion_tokens":100000}"#;
        assert_eq!(routing_fields(both).unwrap().max_tokens, Some(100_000), "the engine's precedence");
        assert_eq!(routing_fields(br#"{"max_tokens":-1}"#).unwrap().max_tokens, None);
        assert_eq!(routing_fields(br#"{"max_tokens":1e99}"#).unwrap().max_tokens, None);
    }

    #[test]
    fn heads_over_the_limits_or_with_two_framings_are_refused() {
        let ok = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n";
        assert!(check_head(ok, 2, 1024, 100).is_ok());
        assert_eq!(check_head(ok, 2, 16, 100).unwrap_err().status(), 431);
        assert_eq!(check_head(ok, 101, 1024, 100).unwrap_err().status(), 431);
        let both = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\ncontent-length: 5\r\n\r\n";
        assert_eq!(check_head(both, 2, 1024, 100).unwrap_err().status(), 400);
        let bare_lf = b"POST / HTTP/1.1\nTRANSFER-ENCODING: chunked\nContent-Length:5\n\n";
        assert_eq!(check_head(bare_lf, 2, 1024, 100).unwrap_err().status(), 400);
        // A field merely containing the name is not the field.
        let value = b"POST / HTTP/1.1\r\nX-Note: content-length: 5\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(check_head(value, 2, 1024, 100).is_ok());
    }

    #[test]
    fn the_usage_meter_prefers_reported_usage_then_counts_events() {
        let mut m = UsageMeter::default();
        m.observe(b"data: {\"choices\":[]}\n\ndata: {\"choices\":[]}\n\n");
        m.observe(b"data: [DONE]\n\n");
        assert_eq!(m.used(10), 12);
        m.observe(br#"{"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens": 8}}"#);
        assert_eq!(m.used(10), 8);
        let mut big = UsageMeter::default();
        big.observe(&vec![b'x'; 100_000]);
        big.observe(br#""total_tokens":42}"#);
        assert_eq!(big.used(0), 42);
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
