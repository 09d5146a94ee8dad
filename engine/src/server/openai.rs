//! OpenAI request types and their validation into engine parameters.
//!
//! Parsing goes through `serde_path_to_error`, so a wrong type names its field
//! (`max_tokens: invalid type: string "ten", expected i64`). Numbers are read as wide
//! integers and range-checked here, so messages name the limit and the value given.

use serde::Deserialize;

use crate::error::ApiError;
use crate::scheduler::SamplingParams;
use crate::structured::GuidedSpec;
use crate::tokenizer::{ChatMessage, TokenId};

/// `prompt` of `/v1/completions`: text, a one-element batch, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Plain text.
    Text(String),
    /// A batch of texts (only one is supported).
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<i64>),
    /// A batch of token-id lists (only one is supported).
    TokenBatches(Vec<Vec<i64>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    /// Model name.
    pub model: Option<String>,
    /// Tokens to generate.
    pub max_tokens: Option<i64>,
    /// Chat's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Nucleus mass.
    pub top_p: Option<f64>,
    /// Top-k (vLLM).
    pub top_k: Option<i64>,
    /// Seed.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Stop token ids (vLLM).
    pub stop_token_ids: Option<Vec<i64>>,
    /// Number of choices.
    pub n: Option<i64>,
    /// Stream with SSE.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Stream options.
    pub stream_options: Option<StreamOptions>,
    /// Keep generating past EOS (vLLM).
    pub ignore_eos: Option<bool>,
    /// Minimum tokens before EOS/stop (vLLM).
    pub min_tokens: Option<i64>,
    /// Presence penalty (applied by the cpu backend; the sim backend ignores it).
    pub presence_penalty: Option<f64>,
    /// vLLM extension: minimum probability relative to the most likely token.
    pub min_p: Option<f64>,
    /// vLLM extension: repetition penalty (> 0, 1 = off).
    pub repetition_penalty: Option<f64>,
    /// Frequency penalty (applied by the cpu backend; the sim backend ignores it).
    pub frequency_penalty: Option<f64>,
    /// Completions: how many top log probabilities per token; chat: whether to return them.
    pub logprobs: Option<serde_json::Value>,
    /// Chat: how many top log probabilities per token.
    pub top_logprobs: Option<serde_json::Value>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
    pub response_format: Option<serde_json::Value>,
    /// vLLM: a JSON Schema (object or JSON text) the output must follow.
    pub guided_json: Option<serde_json::Value>,
    /// vLLM: a regex the output must match.
    pub guided_regex: Option<serde_json::Value>,
    /// vLLM: the output is one of these strings.
    pub guided_choice: Option<serde_json::Value>,
    /// vLLM: a grammar (llguidance's Lark dialect) the output must follow.
    pub guided_grammar: Option<serde_json::Value>,
    /// vLLM's newer form of the four above: `{"json" | "regex" | "choice" | "grammar" |
    /// "json_object": ...}`.
    pub structured_outputs: Option<serde_json::Value>,
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Option<Prompt>,
}

/// Message content: text or a list of parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Text.
    Text(String),
    /// Parts; only `text` parts are supported.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Part type.
    #[serde(rename = "type")]
    pub kind: String,
    /// Text of a `text` part.
    pub text: Option<String>,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// Role.
    pub role: String,
    /// Content (may be null for assistant messages).
    pub content: Option<Content>,
    /// An assistant's calls: `[{"id", "type": "function", "function": {"name", "arguments"}}]`.
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message answers this call.
    pub tool_call_id: Option<String>,
    /// Name of the participant or function.
    pub name: Option<String>,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Option<Vec<Message>>,
    /// Function definitions (see [`super::tools`]).
    pub tools: Option<serde_json::Value>,
    /// `none`, `auto`, `required` or a named function.
    pub tool_choice: Option<serde_json::Value>,
    /// Accepted; a forced call is one call, `auto` returns every call the model writes.
    pub parallel_tool_calls: Option<bool>,
}

/// The fields of [`ChatRequest`].
pub const CHAT_FIELDS: &[&str] = &["messages", "tools", "tool_choice", "parallel_tool_calls"];

/// The fields [`CommonParams`] reads, plus `user` (OpenAI's end-user id, which changes no
/// output).
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "user",
];

/// OpenAI and vLLM request fields this engine knows of and does not implement: a request
/// that sets one is refused, naming it, rather than answered as if it had not.
const NOT_IMPLEMENTED: &[&str] = &[
    "functions",
    "function_call",
    "logit_bias",
    "best_of",
    "suffix",
    "echo",
    "prompt_logprobs",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "store",
    "metadata",
    "service_tier",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "lora_request",
];

/// Most choices one request may ask for (`n`).
pub const MAX_N: i64 = 16;

/// The choices a request asks for: `n`, 1 when absent, within 1..=[`MAX_N`].
pub fn choices(c: &CommonParams) -> Result<usize, ApiError> {
    match c.n {
        None => Ok(1),
        Some(n) if (1..=MAX_N).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid("n", format!("n must be in 1..={MAX_N}, got {n}"))),
    }
}

/// What structured output a request asks for, from whichever of `response_format`,
/// `guided_*` and `structured_outputs` it sets (at most one). Shapes are checked here;
/// whether the grammar compiles is the engine's [`crate::structured::Grammars::compile`].
pub fn guided_spec(c: &CommonParams) -> Result<Option<(String, GuidedSpec)>, ApiError> {
    use serde_json::Value;
    let mut found: Vec<(String, GuidedSpec)> = Vec::new();
    // A JSON Schema given as an object, or as JSON text (vLLM accepts both).
    let schema = |field: &str, v: &Value| -> Result<GuidedSpec, ApiError> {
        let v = match v {
            Value::String(text) => serde_json::from_str(text)
                .map_err(|e| ApiError::invalid(field, format!("{field} is not a valid JSON Schema document: {e}")))?,
            v => v.clone(),
        };
        match v {
            Value::Object(_) | Value::Bool(true) => Ok(GuidedSpec::JsonSchema(v)),
            _ => Err(ApiError::invalid(field, format!("{field} must be a JSON Schema object"))),
        }
    };
    let text = |field: &str, v: &Value| -> Result<String, ApiError> {
        v.as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| ApiError::invalid(field, format!("{field} must be a non-empty string")))
    };
    let choice = |field: &str, v: &Value| -> Result<GuidedSpec, ApiError> {
        let bad = || ApiError::invalid(field, format!("{field} must be a non-empty list of non-empty strings"));
        let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(bad)?;
        let strings = list.iter().map(|c| c.as_str().filter(|s| !s.is_empty()).map(str::to_owned));
        Ok(GuidedSpec::Choice(strings.collect::<Option<Vec<_>>>().ok_or_else(bad)?))
    };
    if let Some(rf) = c.response_format.as_ref().filter(|v| !v.is_null()) {
        let kind = rf.get("type").and_then(Value::as_str);
        match kind {
            Some("text") => {}
            Some("json_object") => found.push(("response_format".into(), GuidedSpec::JsonObject)),
            Some("json_schema") => {
                let field = "response_format.json_schema.schema";
                let s = rf.get("json_schema").and_then(|j| j.get("schema")).ok_or_else(|| {
                    ApiError::invalid(field, "response_format of type json_schema needs json_schema.schema")
                })?;
                found.push(("response_format".into(), schema(field, s)?));
            }
            _ => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    format!("response_format.type must be text, json_object or json_schema, got {}", rf["type"]),
                ))
            }
        }
    }
    let set = |v: &Option<Value>| v.clone().filter(|v| !v.is_null());
    if let Some(v) = set(&c.guided_json) {
        found.push(("guided_json".into(), schema("guided_json", &v)?));
    }
    if let Some(v) = set(&c.guided_regex) {
        found.push(("guided_regex".into(), GuidedSpec::Regex(text("guided_regex", &v)?)));
    }
    if let Some(v) = set(&c.guided_choice) {
        found.push(("guided_choice".into(), choice("guided_choice", &v)?));
    }
    if let Some(v) = set(&c.guided_grammar) {
        found.push(("guided_grammar".into(), GuidedSpec::Grammar(text("guided_grammar", &v)?)));
    }
    if let Some(v) = set(&c.structured_outputs) {
        let obj = v
            .as_object()
            .ok_or_else(|| ApiError::invalid("structured_outputs", "structured_outputs must be an object"))?;
        for (key, v) in obj.iter().filter(|(_, v)| !v.is_null()) {
            let field = format!("structured_outputs.{key}");
            let spec = match key.as_str() {
                "json" => schema(&field, v)?,
                "regex" => GuidedSpec::Regex(text(&field, v)?),
                "choice" => choice(&field, v)?,
                "grammar" => GuidedSpec::Grammar(text(&field, v)?),
                "json_object" if v == &Value::Bool(true) => GuidedSpec::JsonObject,
                "json_object" => continue,
                _ => {
                    return Err(ApiError::invalid(
                        field.clone(),
                        format!("{field}: supported are json, regex, choice, grammar and json_object"),
                    ))
                }
            };
            found.push(("structured_outputs".into(), spec));
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(f, _)| f.as_str()).collect();
        return Err(ApiError::invalid(
            found[1].0.clone(),
            format!("give one kind of structured output per request, got {}", names.join(" and ")),
        ));
    }
    Ok(found.pop())
}

/// `POST /v1/embeddings` body.
#[derive(Debug, Clone, Deserialize)]
pub struct EmbeddingRequest {
    /// Text, texts, token ids, or lists of token ids.
    pub input: Option<Prompt>,
    /// `float` (default) or `base64` (little-endian f32).
    pub encoding_format: Option<String>,
    /// Refused: the model's embeddings have one width.
    pub dimensions: Option<serde_json::Value>,
}

/// The fields of [`EmbeddingRequest`].
pub const EMBEDDING_FIELDS: &[&str] = &["input", "encoding_format", "dimensions"];

/// Most inputs one embeddings request may carry.
pub const MAX_EMBEDDING_INPUTS: usize = 256;

/// The inputs of an embeddings request, each text or token ids.
pub fn embedding_inputs(input: Option<Prompt>) -> Result<Vec<PromptInput>, ApiError> {
    let ids = |v: Vec<i64>| -> Result<PromptInput, ApiError> {
        v.into_iter()
            .map(|t| {
                u32::try_from(t)
                    .map_err(|_| ApiError::invalid("input", format!("input token ids must be in 0..2^32, got {t}")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(PromptInput::Tokens)
    };
    let inputs = match input.ok_or_else(|| ApiError::invalid("input", "input is required"))? {
        Prompt::Text(t) => vec![PromptInput::Text(t)],
        Prompt::Texts(v) => v.into_iter().map(PromptInput::Text).collect(),
        Prompt::Tokens(v) => vec![ids(v)?],
        Prompt::TokenBatches(v) => v.into_iter().map(ids).collect::<Result<_, _>>()?,
    };
    if inputs.is_empty() || inputs.len() > MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid("input", format!("input must hold 1 to {MAX_EMBEDDING_INPUTS} items")));
    }
    for (i, input) in inputs.iter().enumerate() {
        let empty = match input {
            PromptInput::Text(t) => t.is_empty(),
            PromptInput::Tokens(t) => t.is_empty(),
        };
        if empty {
            return Err(ApiError::invalid(format!("input[{i}]"), format!("input[{i}] must not be empty")));
        }
    }
    Ok(inputs)
}

/// `POST /tokenize` body (vLLM's).
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    /// Text to tokenize.
    pub prompt: Option<String>,
    /// Or a conversation, rendered with the chat template first.
    pub messages: Option<Vec<Message>>,
    /// Accepted for vLLM's clients; no special token is added either way.
    pub add_special_tokens: Option<bool>,
    /// Accepted; the template always ends with the assistant's turn opened.
    pub add_generation_prompt: Option<bool>,
    /// Also return each token's text.
    pub return_token_strs: Option<bool>,
}

/// `POST /detokenize` body (vLLM's).
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    /// Token ids.
    pub tokens: Option<Vec<i64>>,
}

/// Parse a JSON body into the endpoint's own fields (`fields`: their names) and the
/// shared ones, naming the offending field on error. A field the engine does not
/// implement, or does not know, is a 400 naming it, never ignored. (The two halves are
/// read from one parsed tree rather than with `#[serde(flatten)]`, which loses the field
/// path.)
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8], fields: &[&str]) -> Result<(T, CommonParams), ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| ApiError::InvalidRequest {
        param: None,
        message: format!("request body is not valid JSON: {e}"),
    })?;
    let Some(object) = value.as_object() else {
        return Err(ApiError::InvalidRequest { param: None, message: "request body must be a JSON object".into() });
    };
    for key in object.keys() {
        let key = key.as_str();
        if fields.contains(&key) || COMMON_FIELDS.contains(&key) {
            continue;
        }
        let message = if NOT_IMPLEMENTED.contains(&key) {
            format!("{key} is not supported by this engine")
        } else {
            format!("Unrecognized request argument supplied: {key}")
        };
        return Err(ApiError::invalid(key.to_string(), message));
    }
    Ok((typed(&value)?, typed(&value)?))
}

fn typed<T: serde::de::DeserializeOwned>(value: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        ApiError::invalid(path.clone(), format!("{path}: {inner}"))
    })
}

/// Flatten chat messages to text.
pub fn chat_messages(messages: Option<Vec<Message>>) -> Result<Vec<ChatMessage>, ApiError> {
    let messages = messages.ok_or_else(|| ApiError::invalid("messages", "messages is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must contain at least one message"));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!(
                        "messages[{i}].role must be one of system, developer, user, assistant, tool; got {:?}",
                        m.role
                    ),
                ));
            }
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for (j, p) in parts.into_iter().enumerate() {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => s.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content[{j}]"),
                                    format!(
                                        "messages[{i}].content[{j}]: only text parts are supported, got type {kind:?}"
                                    ),
                                ))
                            }
                        }
                    }
                    s
                }
            };
            // A template without tools support sees earlier calls as the Hermes blocks a
            // model writes them in (what the `auto` parser reads back).
            let mut content = content;
            for call in m.tool_calls.iter().flatten() {
                let f = &call["function"];
                let arguments = match &f["arguments"] {
                    serde_json::Value::String(s) => serde_json::from_str(s).unwrap_or(serde_json::json!(s)),
                    other => other.clone(),
                };
                let block = serde_json::json!({"name": f["name"], "arguments": arguments});
                content.push_str(&format!("<tool_call>\n{block}\n</tool_call>"));
            }
            Ok(ChatMessage { role: m.role, content })
        })
        .collect()
}

/// The conversation as JSON message objects for a template that renders tools: content
/// flattened to text, calls' `arguments` given as objects (what such templates `tojson`).
pub fn template_messages(messages: &[Message], flat: &[ChatMessage]) -> Vec<serde_json::Value> {
    use serde_json::{json, Value};
    messages
        .iter()
        .zip(flat)
        .map(|(m, f)| {
            let mut v =
                json!({"role": m.role, "content": if m.tool_calls.is_some() { Value::Null } else { json!(f.content) }});
            if let Some(calls) = &m.tool_calls {
                let calls: Vec<Value> = calls
                    .iter()
                    .map(|c| {
                        let mut c = c.clone();
                        if let Some(Value::String(a)) = c.pointer("/function/arguments") {
                            if let Ok(obj) = serde_json::from_str::<Value>(a) {
                                c["function"]["arguments"] = obj;
                            }
                        }
                        c
                    })
                    .collect();
                v["tool_calls"] = json!(calls);
            }
            if let Some(id) = &m.tool_call_id {
                v["tool_call_id"] = json!(id);
            }
            if let Some(name) = &m.name {
                v["name"] = json!(name);
            }
            v
        })
        .collect()
}

/// What the engine knows of a prompt before tokenizing.
pub enum PromptInput {
    /// Text to tokenize.
    Text(String),
    /// Token ids as given.
    Tokens(Vec<TokenId>),
}

/// Check a completions `prompt`.
pub fn completion_prompt(prompt: Option<Prompt>) -> Result<PromptInput, ApiError> {
    let tokens = |ids: Vec<i64>| -> Result<PromptInput, ApiError> {
        ids.into_iter()
            .map(|t| {
                u32::try_from(t)
                    .map_err(|_| ApiError::invalid("prompt", format!("prompt token ids must be in 0..2^32, got {t}")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(PromptInput::Tokens)
    };
    let input = match prompt.ok_or_else(|| ApiError::invalid("prompt", "prompt is required"))? {
        Prompt::Text(t) => PromptInput::Text(t),
        Prompt::Texts(mut v) if v.len() == 1 => PromptInput::Text(v.remove(0)),
        Prompt::TokenBatches(mut v) if v.len() == 1 => tokens(v.remove(0))?,
        Prompt::Tokens(v) => tokens(v)?,
        Prompt::Texts(_) | Prompt::TokenBatches(_) => {
            return Err(ApiError::invalid(
                "prompt",
                "batched prompts are not supported yet: send one prompt per request",
            ))
        }
    };
    match &input {
        PromptInput::Text(t) if t.is_empty() => Err(ApiError::invalid("prompt", "prompt must not be empty")),
        PromptInput::Tokens(t) if t.is_empty() => Err(ApiError::invalid("prompt", "prompt must not be empty")),
        _ => Ok(input),
    }
}

/// Limits a request is validated against.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Context length.
    pub max_model_len: usize,
    /// Total KV token slots.
    pub kv_capacity_tokens: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Most alternatives `logprobs`/`top_logprobs` may ask for (0: the backend has no
    /// distribution, so log probabilities are refused).
    pub max_logprobs: usize,
    /// Longest prompt text tokenized (`--max-prompt-bytes`).
    pub max_prompt_bytes: usize,
}

/// How many log probabilities a request asks for: completions' `logprobs: n`, chat's
/// `logprobs: true` with `top_logprobs: n`. `None`: none; `Some(n)`: the chosen token's and
/// the `n` most likely.
pub fn logprobs_request(c: &CommonParams, chat: bool, max: usize) -> Result<Option<usize>, ApiError> {
    use serde_json::Value;
    let asked = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null() && v != &Value::Bool(false));
    if max == 0 && (asked(&c.logprobs) || asked(&c.top_logprobs)) {
        return Err(ApiError::invalid("logprobs", "this engine's backend (sim) has no token distribution to report"));
    }
    let count = |field: &str, v: &Value| -> Result<usize, ApiError> {
        match v.as_u64() {
            Some(n) if n as usize <= max => Ok(n as usize),
            _ => Err(ApiError::invalid(field, format!("{field} must be an integer in [0, {max}], got {v}"))),
        }
    };
    let top = c.top_logprobs.as_ref().filter(|v| !v.is_null());
    let wanted = if chat {
        let on = match &c.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(v) => return Err(ApiError::invalid("logprobs", format!("logprobs must be a boolean, got {v}"))),
        };
        match (on, top) {
            (false, Some(_)) => {
                return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs set to true"));
            }
            (false, None) => None,
            (true, None) => Some(0),
            (true, Some(v)) => Some(count("top_logprobs", v)?),
        }
    } else {
        if top.is_some() {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs is a chat parameter; completions take logprobs: n",
            ));
        }
        match &c.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => None,
            Some(v) => Some(count("logprobs", v)?),
        }
    };
    Ok(wanted)
}

/// Validate the sampling fields against a prompt of `prompt_len` tokens; `prompt_field` is
/// where the endpoint takes its prompt (`messages` for chat, `prompt` for completions).
pub fn sampling_params(
    c: &CommonParams,
    prompt_len: usize,
    prompt_field: &str,
    limits: Limits,
    default_seed: u64,
) -> Result<SamplingParams, ApiError> {
    let logprobs = logprobs_request(c, prompt_field == "messages", limits.max_logprobs)?;
    let max_len = limits.max_model_len;
    if prompt_len >= max_len {
        return Err(ApiError::invalid(
            prompt_field,
            format!(
                "This model's maximum context length is {max_len} tokens. However, your prompt has {prompt_len} tokens, \
                 which leaves no room for output."
            ),
        ));
    }
    let room = max_len - prompt_len;
    if prompt_len >= limits.kv_capacity_tokens {
        return Err(ApiError::invalid(
            prompt_field,
            format!(
                "the prompt has {prompt_len} tokens but the whole KV cache holds {} tokens",
                limits.kv_capacity_tokens
            ),
        ));
    }
    let (field, requested) = match (c.max_completion_tokens, c.max_tokens) {
        (Some(v), _) => ("max_completion_tokens", Some(v)),
        (None, v) => ("max_tokens", v),
    };
    let max_tokens = match requested {
        // Unbounded: up to the context length, within what the cache can ever hold.
        None => room.min(limits.kv_capacity_tokens - prompt_len),
        Some(v) if v < 1 => return Err(ApiError::invalid(field, format!("{field} must be at least 1, got {v}"))),
        Some(v) if v as u64 > room as u64 => {
            return Err(ApiError::invalid(
                field,
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you requested {} tokens \
                     ({prompt_len} in the messages, {v} in the completion). Please reduce the length of the messages \
                     or completion ({field} must be <= {room}, got {v}).",
                    prompt_len as u64 + v as u64
                ),
            ))
        }
        Some(v) => v as usize,
    };
    let needed_blocks = (prompt_len + max_tokens).div_ceil(limits.block_size);
    let have_blocks = limits.kv_capacity_tokens / limits.block_size;
    if needed_blocks > have_blocks {
        return Err(ApiError::invalid(
            field,
            format!(
                "the request needs {} tokens of KV cache ({prompt_len} prompt + {max_tokens} output) but the whole cache \
                 holds {} tokens; lower {field} or the prompt",
                prompt_len + max_tokens,
                limits.kv_capacity_tokens
            ),
        ));
    }
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid("temperature", format!("temperature must be in [0, 2], got {temperature}")));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p", format!("top_p must be in (0, 1], got {top_p}")));
    }
    let top_k = c.top_k.unwrap_or(0);
    if top_k < -1 || top_k > i32::MAX as i64 {
        return Err(ApiError::invalid("top_k", format!("top_k must be -1, 0 (off) or a positive count, got {top_k}")));
    }
    for (name, v) in [("presence_penalty", c.presence_penalty), ("frequency_penalty", c.frequency_penalty)] {
        if let Some(v) = v {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ApiError::invalid(name, format!("{name} must be in [-2, 2], got {v}")));
            }
        }
    }
    let min_p = c.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid("min_p", format!("min_p must be in [0, 1], got {min_p}")));
    }
    let repetition_penalty = c.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty <= 10.0) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!("repetition_penalty must be in (0, 10], got {repetition_penalty}"),
        ));
    }
    let min_tokens = match c.min_tokens {
        None => 0,
        Some(v) if v < 0 => return Err(ApiError::invalid("min_tokens", format!("min_tokens must be >= 0, got {v}"))),
        Some(v) if v as u64 > max_tokens as u64 => {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("min_tokens must be <= {field} ({max_tokens}), got {v}"),
            ))
        }
        Some(v) => v as usize,
    };
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > 16 || stop.iter().any(|s| s.is_empty() || s.len() > 1024) {
        return Err(ApiError::invalid("stop", "stop takes at most 16 non-empty strings of at most 1024 bytes"));
    }
    let stop_token_ids = c
        .stop_token_ids
        .iter()
        .flatten()
        .map(|&t| {
            u32::try_from(t)
                .map_err(|_| ApiError::invalid("stop_token_ids", format!("stop_token_ids must be token ids, got {t}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(SamplingParams {
        max_tokens,
        min_tokens,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        stop,
        stop_token_ids,
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k: top_k as i32,
        min_p: min_p as f32,
        repetition_penalty: repetition_penalty as f32,
        presence_penalty: c.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0) as f32,
        seed: c.seed.map_or(default_seed, |s| s as u64),
        logprobs,
        pooling: false,
    })
}
