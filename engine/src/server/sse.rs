//! OpenAI response bodies: streamed chunks (`chat.completion.chunk`, `text_completion`)
//! and whole responses, serialized from borrowed structs (no `Value` trees per token).

use bytes::Bytes;
use serde::Serialize;
use serde_json::{json, Value};

use crate::scheduler::TokenLogprobs;
use crate::tokenizer::{TokenId, Tokenizer};

/// Which endpoint a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Sum.
    pub total_tokens: usize,
    /// Cache details.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

impl Usage {
    /// Usage from counts.
    pub fn new(prompt: usize, completion: usize, cached: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: cached },
        }
    }
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<&'a Value>,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<&'a Value>,
    finish_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<&'a Value>,
    finish_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatMessageOut<'a> {
    role: &'static str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<&'a Value>,
}

/// One choice of a whole response.
#[derive(Debug, Clone)]
pub struct ChoiceOut {
    /// Its text (chat: the message content; `None` for a message of tool calls only).
    pub text: Option<String>,
    /// `stop`, `length`, `tool_calls`…
    pub finish_reason: &'static str,
    /// Rendered log probabilities.
    pub logprobs: Option<Value>,
    /// Chat: the message's `tool_calls`.
    pub tool_calls: Option<Value>,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessageOut<'a>,
    logprobs: Option<&'a Value>,
    finish_reason: &'a str,
}

#[derive(Serialize)]
struct Envelope<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

/// Identity of one response, repeated in every chunk.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Endpoint.
    pub endpoint: Endpoint,
}

impl ResponseMeta {
    fn envelope<C: Serialize>(&self, object: &'static str, choices: C, usage: Option<Usage>) -> Envelope<'_, C> {
        Envelope { id: &self.id, object, created: self.created, model: &self.model, choices, usage }
    }

    /// One SSE event of choice `index` carrying `text` (chat: as `delta.content`; `role` on
    /// the first chunk) and the log probabilities of its tokens ([`Logprobs::render`]).
    pub fn chunk(
        &self,
        index: u32,
        text: Option<&str>,
        first: bool,
        finish_reason: Option<&str>,
        logprobs: Option<&Value>,
    ) -> Bytes {
        self.chunk_with_calls(index, text, None, first, finish_reason, logprobs)
    }

    /// [`Self::chunk`] with a chat delta's `tool_calls` entries.
    pub fn chunk_with_calls(
        &self,
        index: u32,
        text: Option<&str>,
        tool_calls: Option<&Value>,
        first: bool,
        finish_reason: Option<&str>,
        logprobs: Option<&Value>,
    ) -> Bytes {
        let json = match self.endpoint {
            Endpoint::Chat => {
                let delta = Delta { role: first.then_some("assistant"), content: text, tool_calls };
                let choice = ChatChunkChoice { index, delta, logprobs, finish_reason };
                serde_json::to_vec(&self.envelope("chat.completion.chunk", [choice], None))
            }
            Endpoint::Completions => {
                let choice = TextChoice { index, text: text.unwrap_or(""), logprobs, finish_reason };
                serde_json::to_vec(&self.envelope("text_completion", [choice], None))
            }
        };
        sse_event(json.expect("chunk serializes"))
    }

    /// The final `usage` chunk of `stream_options.include_usage` (empty `choices`).
    pub fn usage_chunk(&self, usage: Usage) -> Bytes {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let choices: [(); 0] = [];
        sse_event(serde_json::to_vec(&self.envelope(object, choices, Some(usage))).expect("usage serializes"))
    }

    /// A whole (non-streamed) response with one choice per entry of `choices`, indexed in
    /// order.
    pub fn response(&self, choices: &[ChoiceOut], usage: Usage) -> Value {
        let v = match self.endpoint {
            Endpoint::Chat => {
                let choices: Vec<ChatChoice<'_>> = (0u32..)
                    .zip(choices)
                    .map(|(index, c)| ChatChoice {
                        index,
                        message: ChatMessageOut {
                            role: "assistant",
                            content: c.text.as_deref(),
                            tool_calls: c.tool_calls.as_ref(),
                        },
                        logprobs: c.logprobs.as_ref(),
                        finish_reason: c.finish_reason,
                    })
                    .collect();
                serde_json::to_value(self.envelope("chat.completion", choices, Some(usage)))
            }
            Endpoint::Completions => {
                let choices: Vec<TextChoice<'_>> = (0u32..)
                    .zip(choices)
                    .map(|(index, c)| TextChoice {
                        index,
                        text: c.text.as_deref().unwrap_or(""),
                        logprobs: c.logprobs.as_ref(),
                        finish_reason: Some(c.finish_reason),
                    })
                    .collect();
                serde_json::to_value(self.envelope("text_completion", choices, Some(usage)))
            }
        };
        v.expect("response serializes")
    }
}

/// Log probabilities of a response's tokens, gathered as they are generated and rendered
/// in the endpoint's shape: completions' `{tokens, token_logprobs, top_logprobs,
/// text_offset}` (each `top_logprobs` entry maps token text to log probability and, as in
/// vLLM, includes the chosen token), chat's `{content: [{token, logprob, bytes,
/// top_logprobs}]}`. Token text is each token decoded alone.
#[derive(Debug, Default)]
pub struct Logprobs {
    pending: Vec<TokenLogprobs>,
    /// Bytes of token text already rendered (completions' `text_offset`).
    offset: usize,
}

impl Logprobs {
    /// Gather a token's log probabilities (`None`: the request asked for none).
    pub fn extend(&mut self, lp: Option<TokenLogprobs>) {
        self.pending.extend(lp);
    }

    /// Render the tokens gathered since the last call (`None` when there are none).
    pub fn render(&mut self, endpoint: Endpoint, tok: &dyn Tokenizer) -> Option<Value> {
        if self.pending.is_empty() {
            return None;
        }
        let text = |t: TokenId| tok.decode(&[t]);
        let v = match endpoint {
            Endpoint::Completions => {
                let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
                for lp in self.pending.drain(..) {
                    let t = text(lp.token);
                    let mut top = serde_json::Map::new();
                    // Distinct tokens can decode to the same text (specials to "", broken
                    // UTF-8 to U+FFFD): the most likely keeps the key.
                    for &(id, l) in &lp.top {
                        top.entry(text(id)).or_insert(json!(l));
                    }
                    top.entry(t.clone()).or_insert(json!(lp.logprob));
                    offsets.push(self.offset);
                    self.offset += t.len();
                    tokens.push(t);
                    lps.push(lp.logprob);
                    tops.push(Value::Object(top));
                }
                json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
            }
            Endpoint::Chat => {
                let entry = |id: TokenId, l: f32| {
                    let t = text(id);
                    json!({"token": t, "logprob": l, "bytes": t.as_bytes()})
                };
                let content: Vec<Value> = self
                    .pending
                    .drain(..)
                    .map(|lp| {
                        let mut e = entry(lp.token, lp.logprob);
                        e["top_logprobs"] = lp.top.iter().map(|&(id, l)| entry(id, l)).collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
        };
        Some(v)
    }
}

/// `data: [DONE]`.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

fn sse_event(mut json: Vec<u8>) -> Bytes {
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(b"data: ");
    out.append(&mut json);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}
