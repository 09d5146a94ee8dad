//! When a streamed response starts carrying what the model generated.
//!
//! The `cost` policy learns each engine's prefill rate from the time to the first token. The
//! first response *byte* is not that: engines flush the SSE header and a role-only chunk
//! (`{"delta":{"role":"assistant"}}`) before the prefill ends — ours does, vLLM does — and a
//! rate learned from it is absurdly high. [`ContentDetector`] reads the SSE events as they pass
//! and says when one carries generated content: text (`delta.content`, `text`), reasoning
//! (`delta.reasoning_content`), a tool call (`delta.tool_calls`) or log probabilities. It keeps
//! at most one partial event between chunks and stops looking once it has answered.

use std::sync::LazyLock;

use memchr::memmem::Finder;

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
        // Whole events are read in place; only a partial one is kept for the next chunk.
        let joined;
        let mut data: &[u8] = if self.pending.is_empty() {
            chunk
        } else {
            self.pending.extend_from_slice(chunk);
            joined = std::mem::take(&mut self.pending);
            &joined
        };
        while let Some(end) = find_event_end(data) {
            if event_has_content(&data[..end]) {
                self.found = true;
                return true;
            }
            data = &data[end + 2..];
        }
        if data.len() > MAX_PENDING_BYTES {
            self.found = true;
        } else {
            self.pending = data.to_vec();
        }
        self.found
    }
}

/// Where the event at the front of `data` ends (its blank line).
fn find_event_end(data: &[u8]) -> Option<usize> {
    static EVENT_END: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\n\n"));
    EVENT_END.find(data)
}

/// One SSE event (`data: {...}` lines): does a choice carry generated content? Read from the
/// serialized JSON without parsing it (this runs on every streamed response until its first
/// token): a key in quotes followed by a colon can only be structural, as quotes inside
/// strings are escaped.
fn event_has_content(event: &[u8]) -> bool {
    let data = event.strip_prefix(b"data:").unwrap_or(event).trim_ascii();
    if data.is_empty() || data.starts_with(b"[DONE]") {
        return false;
    }
    if !data.starts_with(b"{") {
        // Not JSON (an engine's own format): count it, as the first byte counted before.
        return true;
    }
    // Does any occurrence of `key` (quoted, then a colon) have a value `ok` accepts?
    let any = |key: &Finder<'static>, ok: &dyn Fn(&[u8]) -> bool| {
        key.find_iter(data).any(|at| {
            let tail = data[at + key.needle().len()..].trim_ascii_start();
            tail.strip_prefix(b":").is_some_and(|v| ok(v.trim_ascii_start()))
        })
    };
    let nonempty_string = |v: &[u8]| v.len() > 1 && v[0] == b'"' && v[1] != b'"';
    let keys = &*CONTENT_KEYS;
    any(&keys.content, &nonempty_string)
        || any(&keys.text, &nonempty_string)
        || any(&keys.reasoning_content, &nonempty_string)
        || any(&keys.tool_calls, &|v| v.starts_with(b"[") && !v[1..].trim_ascii_start().starts_with(b"]"))
        || any(&keys.logprobs, &|v| !v.starts_with(b"null"))
        || any(&keys.error, &|v| v.starts_with(b"{"))
}

/// The quoted keys [`event_has_content`] looks for, with their searchers built once
/// (building one per call was a third of its cost). Immutable after first use.
struct ContentKeys {
    content: Finder<'static>,
    text: Finder<'static>,
    reasoning_content: Finder<'static>,
    tool_calls: Finder<'static>,
    logprobs: Finder<'static>,
    error: Finder<'static>,
}

static CONTENT_KEYS: LazyLock<ContentKeys> = LazyLock::new(|| ContentKeys {
    content: Finder::new(b"\"content\""),
    text: Finder::new(b"\"text\""),
    reasoning_content: Finder::new(b"\"reasoning_content\""),
    tool_calls: Finder::new(b"\"tool_calls\""),
    logprobs: Finder::new(b"\"logprobs\""),
    error: Finder::new(b"\"error\""),
});

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
            r#"{"choices": [{"index": 0, "delta": {"content": "spaced"}}]}"#,
        ] {
            let mut d = ContentDetector::default();
            assert!(d.observe(format!("data: {event}\n\n").as_bytes()), "{event}");
        }
        for event in [
            r#"{"choices":[{"index":0,"text":""}]}"#,
            r#"{"choices":[]}"#,
            "[DONE]",
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[]},"logprobs":null}]}"#,
            // A key-like text inside a string is escaped: not structural.
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","name":"a \"content\":\"x\""}}]}"#,
        ] {
            let mut d = ContentDetector::default();
            assert!(!d.observe(format!("data: {event}\n\n").as_bytes()), "{event}");
        }
    }

    #[test]
    fn an_oversized_first_event_counts_rather_than_growing_without_bound() {
        let mut d = ContentDetector::default();
        let big = vec![b'a'; MAX_PENDING_BYTES + 1];
        assert!(d.observe(&big));
        assert!(d.pending.is_empty());
    }
}
