//! When a streamed response starts carrying what the model generated.
//!
//! The `cost` policy learns each engine's prefill rate from the time to the first token. The
//! first response *byte* is not that: engines flush the SSE header and a role-only chunk
//! (`{"delta":{"role":"assistant"}}`) before the prefill ends — ours does, vLLM does — and a
//! rate learned from it is absurdly high. [`ContentDetector`] reads the SSE events as they pass
//! and says when one carries generated content: text (`delta.content`, `text`), reasoning
//! (`delta.reasoning_content`), a tool call (`delta.tool_calls`) or log probabilities. It keeps
//! at most one partial event between chunks and stops looking once it has answered.

/// The longest partial event kept between chunks; past it the stream counts as content
/// (nothing legitimate sends a first event this large without content).
const MAX_PENDING_BYTES: usize = 64 * 1024;

/// See the module documentation.
#[derive(Debug, Default)]
pub struct ContentDetector {
    pending: Vec<u8>,
    found: bool,
}

impl ContentDetector {
    /// Whether content has been seen, `chunk` included.
    pub fn observe(&mut self, chunk: &[u8]) -> bool {
        if self.found {
            return true;
        }
        self.pending.extend_from_slice(chunk);
        while let Some(end) = find(&self.pending, b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            if event_has_content(&event) {
                self.found = true;
                self.pending = Vec::new();
                return true;
            }
        }
        if self.pending.len() > MAX_PENDING_BYTES {
            self.found = true;
            self.pending = Vec::new();
        }
        self.found
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// One SSE event (`data: {...}` lines): does a choice carry generated content?
fn event_has_content(event: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(event) else { return true };
    let data: String = text.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim).collect();
    if data.is_empty() || data == "[DONE]" {
        return false;
    }
    // Not JSON (an engine's own format): count it, as the first byte counted before.
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) else { return true };
    if v.get("error").is_some() {
        return true;
    }
    let Some(choices) = v.get("choices").and_then(|c| c.as_array()) else { return false };
    choices.iter().any(|c| {
        let nonempty = |x: Option<&serde_json::Value>| x.and_then(|x| x.as_str()).is_some_and(|s| !s.is_empty());
        let present = |x: Option<&serde_json::Value>| x.is_some_and(|x| !x.is_null());
        let delta = c.get("delta");
        nonempty(c.get("text"))
            || nonempty(delta.and_then(|d| d.get("content")))
            || nonempty(delta.and_then(|d| d.get("reasoning_content")))
            || delta.and_then(|d| d.get("tool_calls")).and_then(|t| t.as_array()).is_some_and(|t| !t.is_empty())
            || present(c.get("logprobs"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_role_only_chunk_is_not_content_and_a_token_is() {
        let mut d = ContentDetector::default();
        assert!(
            !d.observe(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n")
        );
        // An event split across chunks.
        assert!(!d.observe(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"con"));
        assert!(d.observe(b"tent\":\"Hel\"}}]}\n\n"));
        assert!(d.observe(b"anything after"));
    }

    #[test]
    fn completions_tool_calls_reasoning_and_logprobs_are_content() {
        for event in [
            r#"{"choices":[{"index":0,"text":"x"}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"hmm"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"logprobs":{"content":[]}}]}"#,
            r#"{"error":{"message":"boom"}}"#,
        ] {
            let mut d = ContentDetector::default();
            assert!(d.observe(format!("data: {event}\n\n").as_bytes()), "{event}");
        }
        for event in [r#"{"choices":[{"index":0,"text":""}]}"#, r#"{"choices":[]}"#, "[DONE]"] {
            let mut d = ContentDetector::default();
            assert!(!d.observe(format!("data: {event}\n\n").as_bytes()), "{event}");
        }
    }

    #[test]
    fn an_oversized_first_event_counts_rather_than_growing_without_bound() {
        let mut d = ContentDetector::default();
        let big = vec![b'a'; MAX_PENDING_BYTES + 1];
        assert!(d.observe(&big));
        assert!(d.pending.capacity() == 0);
    }
}
