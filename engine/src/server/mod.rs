//! The HTTP server: OpenAI-compatible routes over the engine runtime.
//!
//! | route | what |
//! |---|---|
//! | `GET /health` | 200 while the engine thread runs |
//! | `GET /v1/models` | the served model |
//! | `POST /v1/completions` | text completion, streamed (SSE) or not |
//! | `POST /v1/chat/completions` | chat completion, streamed (SSE) or not; structured output ([`crate::structured`]), tools ([`tools`]) |
//! | `POST /v1/embeddings` | mean-pooled, L2-normalized final hidden states (float or base64) |
//! | `POST /tokenize`, `/detokenize` | vLLM's |
//! | `POST /v1/responses` | the stateless subset of the Responses API ([`responses`]) |
//! | `GET /metrics` | Prometheus text, vLLM names |
//!
//! A handler parses and validates the body, tokenizes — on the [`prepare`] pool, not on the
//! threads that serve connections — submits to the engine and turns the request's events
//! into a response. The response body owns the engine stream: when
//! the client disconnects, hyper drops the body, the stream's drop aborts the request.

pub mod openai;
pub mod prepare;
pub mod responses;
pub mod sse;
pub mod tools;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use prometheus::{Encoder, Registry, TextEncoder};
use switchyard_shim::process::unix_secs;

use crate::backend::sim::splitmix64;
use crate::error::ApiError;
use crate::output_processor::Event;
use crate::runtime::{EngineHandle, RequestStream};
use crate::scheduler::{FinishReason, SamplingParams};
use crate::structured::{Constraint, Grammars, GuidedSpec};
use crate::tokenizer::{TokenId, Tokenizer};
use openai::{Limits, PromptInput};
use sse::{ChoiceOut, Endpoint, Logprobs, ResponseMeta, Usage};
use tools::{ToolMode, Tools};

/// Largest request body accepted (a 1 MiB prompt with room to spare).
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Everything a handler needs.
pub struct AppState {
    /// The engine thread.
    pub engine: EngineHandle,
    /// Tokenizer.
    pub tokenizer: Arc<dyn Tokenizer>,
    /// Served model name.
    pub model: String,
    /// Request limits.
    pub limits: Limits,
    /// Seed mixed into requests without a seed.
    pub seed: u64,
    /// Metrics registry served on `/metrics`.
    pub registry: Registry,
    /// Why the engine failed, once it has (`/health` then answers 503).
    pub failed: tokio::sync::watch::Receiver<Option<String>>,
    next_id: AtomicU64,
    started: u64,
    /// The model's grammar compiler, built on the first structured-output request.
    grammars: std::sync::OnceLock<Result<Grammars, String>>,
    /// Where requests are parsed, rendered and tokenized.
    preparer: prepare::Preparer,
}

impl AppState {
    /// Build the state.
    pub fn new(
        engine: EngineHandle,
        tokenizer: Arc<dyn Tokenizer>,
        model: String,
        limits: Limits,
        seed: u64,
        registry: Registry,
        failed: tokio::sync::watch::Receiver<Option<String>>,
    ) -> Self {
        AppState {
            engine,
            tokenizer,
            model,
            limits,
            seed,
            registry,
            failed,
            next_id: AtomicU64::new(1),
            started: unix_secs(),
            grammars: std::sync::OnceLock::new(),
            preparer: prepare::Preparer::new(1),
        }
    }

    /// Prepare requests on `threads` threads (one unless set).
    pub fn with_prepare_threads(mut self, threads: usize) -> Self {
        self.preparer = prepare::Preparer::new(threads);
        self
    }

    /// Run a handler's CPU-bound part, for a body of `body_bytes`, on the [`prepare`] pool.
    async fn off_loop<T: Send + 'static>(
        self: &Arc<Self>,
        body_bytes: usize,
        work: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let st = self.clone();
        self.preparer.run(body_bytes, move || work(&st)).await
    }
}

/// The application's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses::responses))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .fallback(|| async {
            let err = ApiError::InvalidRequest { param: None, message: "no such route".into() };
            (StatusCode::NOT_FOUND, Json(err.body()))
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// `POST /tokenize` (vLLM's): `{prompt}` or `{messages}` (rendered with the chat template,
/// as a chat request is) → `{count, max_model_len, tokens, token_strs}`. No special
/// token is added either way, as for a completion's prompt.
async fn tokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let answer = st
        .off_loop(body.len(), move |st| -> Result<serde_json::Value, ApiError> {
            let fields = ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"];
            let (req, common): (openai::TokenizeRequest, _) = openai::parse_body(&body, &fields)?;
            st.check_model(&common.model)?;
            let ids = match (req.prompt, req.messages) {
                (Some(p), None) => st.encode("prompt", &p)?,
                (None, Some(m)) => {
                    let messages = openai::chat_messages(Some(m))?;
                    let text = st.tokenizer.render_chat(&messages).map_err(|e| ApiError::invalid("messages", e))?;
                    st.encode("messages", &text)?
                }
                _ => return Err(ApiError::invalid("prompt", "give exactly one of prompt and messages")),
            };
            let strs = req
                .return_token_strs
                .unwrap_or(false)
                .then(|| ids.iter().map(|&id| st.tokenizer.decode(&[id])).collect::<Vec<_>>());
            Ok(serde_json::json!({"count": ids.len(), "max_model_len": st.limits.max_model_len, "tokens": ids,
                              "token_strs": strs}))
        })
        .await;
    match answer {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize` (vLLM's): `{tokens}` → `{prompt}`.
async fn detokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let answer = st
        .off_loop(body.len(), move |st| -> Result<serde_json::Value, ApiError> {
            let (req, common): (openai::DetokenizeRequest, _) = openai::parse_body(&body, &["tokens"])?;
            st.check_model(&common.model)?;
            let tokens = req.tokens.ok_or_else(|| ApiError::invalid("tokens", "tokens is required"))?;
            let vocab = st.tokenizer.vocab_size().unwrap_or(TokenId::MAX as usize);
            let ids = tokens
                .iter()
                .map(|&t| TokenId::try_from(t).ok().filter(|&id| (id as usize) < vocab))
                .collect::<Option<Vec<TokenId>>>()
                .ok_or_else(|| {
                    ApiError::invalid("tokens", format!("tokens must be ids of the vocabulary (0..{vocab})"))
                })?;
            Ok(serde_json::json!({"prompt": st.tokenizer.decode(&ids)}))
        })
        .await;
    match answer {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/embeddings`: each input runs as a pooling request (its prompt computed, no
/// token generated); the embedding is the mean of the prompt's final hidden states,
/// L2-normalized.
async fn embeddings(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let arrival = Instant::now();
    let prepared = st
        .off_loop(body.len(), move |st| {
            let (req, common): (openai::EmbeddingRequest, _) = openai::parse_body(&body, openai::EMBEDDING_FIELDS)?;
            st.check_model(&common.model)?;
            if req.dimensions.as_ref().is_some_and(|d| !d.is_null()) {
                return Err(ApiError::invalid(
                    "dimensions",
                    "dimensions is not supported: this model's embeddings have one width (leave it out)",
                ));
            }
            let base64 = match req.encoding_format.as_deref() {
                None | Some("float") => false,
                Some("base64") => true,
                Some(other) => {
                    return Err(ApiError::invalid(
                        "encoding_format",
                        format!("encoding_format must be float or base64, got {other:?}"),
                    ))
                }
            };
            let mut prompts = Vec::new();
            for input in openai::embedding_inputs(req.input)? {
                let prompt = match input {
                    PromptInput::Text(t) => st.encode("input", &t)?,
                    PromptInput::Tokens(t) => st.check_vocab(t, "input")?,
                };
                let mut params = openai::sampling_params(&common, prompt.len(), "input", st.limits, 0)?;
                (params.max_tokens, params.pooling) = (1, true);
                prompts.push((prompt, params));
            }
            Ok((prompts, base64))
        })
        .await;
    let (prompts, base64) = match prepared {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let mut streams = Vec::with_capacity(prompts.len());
    for (prompt, params) in prompts {
        let id = st.next_id.fetch_add(1, Ordering::Relaxed);
        match st.engine.submit(id, prompt, params, None, arrival) {
            Ok(s) => streams.push(s),
            Err(_) => return ApiError::Unavailable.into_response(),
        }
    }
    let (mut data, mut tokens) = (Vec::with_capacity(streams.len()), 0);
    for (i, mut stream) in streams.into_iter().enumerate() {
        loop {
            match stream.next().await {
                Some(Event::Finished { embedding: Some(e), prompt_tokens, .. }) => {
                    tokens += prompt_tokens;
                    let norm = e.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
                    let unit: Vec<f32> = e.iter().map(|v| v / norm).collect();
                    let embedding = if base64 {
                        use base64::Engine as _;
                        let bytes: Vec<u8> = unit.iter().flat_map(|v| v.to_le_bytes()).collect();
                        serde_json::json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                    } else {
                        serde_json::json!(unit)
                    };
                    data.push(serde_json::json!({"object": "embedding", "index": i, "embedding": embedding}));
                    break;
                }
                Some(Event::Token { .. }) => {}
                Some(Event::Finished { .. }) | None => return ApiError::Unavailable.into_response(),
            }
        }
    }
    Json(serde_json::json!({"object": "list", "data": data, "model": st.model,
                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))
    .into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.failed.borrow().clone() {
        None => StatusCode::OK.into_response(),
        Some(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason).into_response(),
    }
}

/// `POST /reset_prefix_cache` (vLLM's admin route): forget every cached prefix — refused
/// with 409 while requests hold KV blocks — and publish `AllBlocksCleared`.
async fn reset_prefix_cache(State(st): State<Arc<AppState>>) -> Response {
    match st.engine.reset_prefix_cache().await {
        Ok(Ok(())) => StatusCode::OK.into_response(),
        Ok(Err(held)) => {
            let message = format!("the prefix cache cannot be reset while requests hold {held} KV blocks");
            let err = ApiError::InvalidRequest { param: None, message };
            (StatusCode::CONFLICT, Json(err.body())).into_response()
        }
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped").into_response(),
    }
}

async fn models(State(st): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "object": "list",
        "data": [{
            "id": st.model,
            "object": "model",
            "created": st.started,
            "owned_by": "switchyard",
            "root": st.model,
            "max_model_len": st.limits.max_model_len,
        }]
    }))
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let mut buf = Vec::new();
    match TextEncoder::new().encode(&st.registry.gather(), &mut buf) {
        Ok(()) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], buf).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// A validated request ready for the engine.
struct Prepared {
    prompt: Vec<TokenId>,
    params: SamplingParams,
    stream: bool,
    include_usage: bool,
    /// Choices asked for (`n`).
    n: usize,
    /// The grammar every choice's output follows (structured output).
    constraint: Option<Constraint>,
    /// The request's tools, when its output may hold calls.
    tools: Option<Arc<Tools>>,
    /// The request gave its `seed`: the choices' seeds follow from it.
    seeded: bool,
}

impl AppState {
    /// `text`, from request field `field`, as token ids; refused unread when it is longer
    /// than `--max-prompt-bytes`.
    fn encode(&self, field: &str, text: &str) -> Result<Vec<TokenId>, ApiError> {
        let max = self.limits.max_prompt_bytes;
        if text.len() > max {
            return Err(ApiError::invalid(
                field,
                format!(
                    "{field} is {} bytes of text; this engine tokenizes at most {max} (--max-prompt-bytes; its \
                     context holds {} tokens)",
                    text.len(),
                    self.limits.max_model_len
                ),
            ));
        }
        Ok(self.tokenizer.encode(text))
    }

    fn check_model(&self, model: &Option<String>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != &self.model => Err(ApiError::ModelNotFound(m.clone())),
            _ => Ok(()),
        }
    }

    /// Token ids given in a request's `field`, each checked against the vocabulary.
    fn check_vocab(&self, ids: Vec<TokenId>, field: &str) -> Result<Vec<TokenId>, ApiError> {
        if let Some(v) = self.tokenizer.vocab_size() {
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= v) {
                return Err(ApiError::invalid(
                    field,
                    format!("token id {bad} is outside the vocabulary of {v} tokens"),
                ));
            }
        }
        Ok(ids)
    }

    /// Compile `spec` (from request field `field`) with the model's vocabulary.
    fn compile(&self, field: &str, spec: &GuidedSpec) -> Result<Constraint, ApiError> {
        let grammars = self.grammars.get_or_init(|| Grammars::new(self.tokenizer.clone()));
        let grammars = grammars.as_ref().map_err(|e| {
            ApiError::invalid(field, format!("{field}: this model's vocabulary cannot be used for grammars: {e}"))
        })?;
        grammars.compile(spec).map_err(|e| ApiError::invalid(field, format!("{field}: {e}")))
    }

    fn prepare(
        &self,
        common: &openai::CommonParams,
        prompt: Vec<TokenId>,
        prompt_field: &str,
        id: u64,
    ) -> Result<Prepared, ApiError> {
        // Without a `seed`, each request draws its own (two engines, or two runs, never
        // sample alike); `--seed` fixes them for reproducible runs.
        let default_seed = match self.seed {
            0 => rand::random(),
            fixed => fixed ^ splitmix64(id),
        };
        let n = openai::choices(common)?;
        let params = openai::sampling_params(common, prompt.len(), prompt_field, self.limits, default_seed)?;
        let constraint = match openai::guided_spec(common)? {
            None => None,
            Some((field, spec)) => Some(self.compile(&field, &spec)?),
        };
        Ok(Prepared {
            n,
            constraint,
            tools: None,
            seeded: common.seed.is_some(),
            prompt,
            params,
            stream: common.stream.unwrap_or(false),
            include_usage: common.stream_options.as_ref().is_some_and(|o| o.include_usage),
        })
    }
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let arrival = Instant::now();
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let prepared = st
        .off_loop(body.len(), move |st| {
            let (req, common): (openai::CompletionRequest, _) = openai::parse_body(&body, &["prompt"])?;
            st.check_model(&common.model)?;
            let prompt = match openai::completion_prompt(req.prompt)? {
                PromptInput::Text(t) => st.encode("prompt", &t)?,
                PromptInput::Tokens(t) => st.check_vocab(t, "prompt")?,
            };
            st.prepare(&common, prompt, "prompt", id)
        })
        .await;
    execute(st, prepared, Endpoint::Completions, response_id("cmpl"), id, arrival).await
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let arrival = Instant::now();
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let prepared = st
        .off_loop(body.len(), move |st| {
            let (req, common): (openai::ChatRequest, _) = openai::parse_body(&body, openai::CHAT_FIELDS)?;
            st.check_model(&common.model)?;
            let tools = tools::parse(req.tools.as_ref(), req.tool_choice.as_ref())?;
            let raw = if tools.is_some() { req.messages.clone() } else { None };
            let messages = openai::chat_messages(req.messages)?;
            let text =
                match &tools {
                    Some(t) if st.tokenizer.renders_tools() => {
                        let json = openai::template_messages(raw.as_deref().unwrap_or_default(), &messages);
                        st.tokenizer.render_chat_with_tools(&json, &t.list)
                    }
                    Some(t) if t.mode == ToolMode::Auto => return Err(ApiError::invalid(
                        "tool_choice",
                        "tool_choice auto (the default with tools) needs a chat template that renders tools, and this \
                     model's does not: name a function in tool_choice, or use \"required\" (the call is then written \
                     under a grammar)",
                    )),
                    _ => st.tokenizer.render_chat(&messages),
                };
            let prompt = st.encode("messages", &text.map_err(|e| ApiError::invalid("messages", e))?)?;
            let mut p = st.prepare(&common, prompt, "messages", id)?;
            if let Some(spec) = tools.as_ref().and_then(Tools::guided) {
                if p.constraint.is_some() {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "a forced tool call and response_format (or guided_*) cannot both constrain the output",
                    ));
                }
                p.constraint = Some(st.compile("tool_choice", &spec)?);
            }
            p.tools = tools.filter(|t| t.mode != ToolMode::None).map(Arc::new);
            Ok(p)
        })
        .await;
    execute(st, prepared, Endpoint::Chat, response_id("chatcmpl"), id, arrival).await
}

/// A response id as vLLM makes them: the prefix and 128 random bits in hex, unique across
/// engines and restarts.
fn response_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

async fn execute(
    st: Arc<AppState>,
    prepared: Result<Prepared, ApiError>,
    endpoint: Endpoint,
    response_id: String,
    id: u64,
    arrival: Instant,
) -> Response {
    let p = match prepared {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let meta = ResponseMeta { id: response_id, created: unix_secs(), model: st.model.clone(), endpoint };
    let first = match st.engine.submit(id, p.prompt.clone(), p.params.clone(), p.constraint.clone(), arrival) {
        Ok(s) => s,
        Err(_) => return ApiError::Unavailable.into_response(),
    };
    let choices = match fan_out(&st, first, &p, arrival).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    if p.stream {
        sse_response(meta, choices, p.include_usage, st.tokenizer.clone(), p.tools.clone())
    } else {
        collect_response(meta, choices, st.tokenizer.clone(), p.tools.as_deref()).await
    }
}

/// One choice's engine request, with an event already taken from it in front.
struct Choice {
    stream: RequestStream,
    pending: Option<Event>,
}

impl Choice {
    async fn next(&mut self) -> Option<Event> {
        match self.pending.take() {
            Some(ev) => Some(ev),
            None => self.stream.next().await,
        }
    }
}

/// The requests behind `n` choices. With `n` > 1 the first runs alone until its first
/// token — its prompt's full blocks are in the prefix cache by then — and the others start
/// then: they share those blocks (the block pool's ref counts: one prompt's blocks, not
/// `n`), compute only the prompt's last partial block again (a copy of their own), and
/// sample with their own seeds (the request's `seed` + i when it gave one).
async fn fan_out(
    st: &AppState,
    mut first: RequestStream,
    p: &Prepared,
    arrival: Instant,
) -> Result<Vec<Choice>, ApiError> {
    if p.n == 1 {
        return Ok(vec![Choice { stream: first, pending: None }]);
    }
    let pending = Some(first.next().await.ok_or(ApiError::Unavailable)?);
    let mut choices = vec![Choice { stream: first, pending }];
    for i in 1..p.n as u64 {
        let mut params = p.params.clone();
        params.seed = if p.seeded { p.params.seed.wrapping_add(i) } else { rand::random() };
        let id = st.next_id.fetch_add(1, Ordering::Relaxed);
        let stream = st
            .engine
            .submit(id, p.prompt.clone(), params, p.constraint.clone(), arrival)
            .map_err(|_| ApiError::Unavailable)?;
        choices.push(Choice { stream, pending: None });
    }
    Ok(choices)
}

/// A finished choice's finish reason with tools: `tool_calls` when the model (`auto`,
/// `required`) made calls; a named call is `stop`, as OpenAI's; `length` stays.
fn tool_finish(tools: &Tools, reason: FinishReason, made_calls: bool) -> &'static str {
    match (reason, made_calls, &tools.mode) {
        (FinishReason::Stop, true, ToolMode::Auto | ToolMode::Required) => "tool_calls",
        _ => reason.as_str(),
    }
}

async fn collect_response(
    meta: ResponseMeta,
    mut choices: Vec<Choice>,
    tok: Arc<dyn Tokenizer>,
    tools: Option<&Tools>,
) -> Response {
    let mut outs = Vec::with_capacity(choices.len());
    let (mut prompt, mut completion, mut cached) = (0, 0, 0);
    for (i, c) in choices.iter_mut().enumerate() {
        let mut text = String::new();
        let mut logprobs = Logprobs::default();
        loop {
            match c.next().await {
                Some(Event::Token { text: t, logprobs: lp, .. }) => {
                    text.push_str(&t);
                    logprobs.extend(lp);
                }
                Some(Event::Finished {
                    text: t,
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    logprobs: lp,
                    ..
                }) => {
                    text.push_str(&t);
                    logprobs.extend(lp);
                    // The prompt counts once; every choice's tokens count.
                    if i == 0 {
                        (prompt, cached) = (prompt_tokens, cached_tokens);
                    }
                    completion += completion_tokens;
                    let lp = logprobs.render(meta.endpoint, tok.as_ref());
                    let out = match tools {
                        None => ChoiceOut {
                            text: Some(text),
                            finish_reason: reason.as_str(),
                            logprobs: lp,
                            tool_calls: None,
                        },
                        Some(t) => {
                            let (content, calls) = t.extract(&text);
                            ChoiceOut {
                                text: content,
                                finish_reason: tool_finish(t, reason, !calls.is_empty()),
                                logprobs: lp,
                                tool_calls: (!calls.is_empty()).then(|| tools::calls_json(&calls)),
                            }
                        }
                    };
                    outs.push(out);
                    break;
                }
                None => return ApiError::Unavailable.into_response(),
            }
        }
    }
    Json(meta.response(&outs, Usage::new(prompt, completion, cached))).into_response()
}

/// What a stream keeps per choice.
#[derive(Default)]
struct ChoiceState {
    /// Log probabilities of tokens whose text is still held back.
    logprobs: Logprobs,
    /// A chat's `role` chunk was sent (with the choice's first generated token).
    role_sent: bool,
    finished: bool,
    /// `auto` tools: content passes, calls are held.
    hermes: tools::HermesStream,
    /// `required` tools: the whole call, held to the end.
    held: String,
    /// A named call's first delta (id, name) was sent.
    call_opened: bool,
}

struct SseState {
    meta: ResponseMeta,
    /// Every choice's events, tagged with its index, as they come.
    events: futures_util::stream::SelectAll<futures_util::stream::BoxStream<'static, (u32, Event)>>,
    choices: Vec<ChoiceState>,
    include_usage: bool,
    tokenizer: Arc<dyn Tokenizer>,
    /// The request's tools, when its output may hold calls.
    tools: Option<Arc<Tools>>,
    usage: Usage,
    /// Chunks still to send, popped from the end (the token after the role, usage, `[DONE]`).
    tail: Vec<Bytes>,
    done: bool,
}

impl SseState {
    /// Choice `i`'s `role` chunk, once, for a chat; `None` after it or for a completion.
    fn role_chunk(&mut self, i: u32) -> Option<Bytes> {
        let chat = self.meta.endpoint == Endpoint::Chat;
        let c = &mut self.choices[i as usize];
        let first = !std::mem::replace(&mut c.role_sent, true);
        (chat && first).then(|| self.meta.chunk(i, Some(""), true, None, None))
    }

    /// Choice `i`'s new `text` as content and `tool_calls` deltas (see [`tools`]); `end`:
    /// its last text. Without tools the text is the content.
    fn split_calls(&mut self, i: u32, text: &str, end: bool) -> (Option<String>, Option<serde_json::Value>) {
        let Some(t) = self.tools.clone() else {
            return ((!text.is_empty()).then(|| text.to_string()), None);
        };
        let c = &mut self.choices[i as usize];
        let opened = |calls: &[tools::ToolCall]| -> serde_json::Value {
            (0..)
                .zip(calls)
                .map(|(j, call): (u32, _)| {
                    serde_json::json!({"index": j, "id": tools::call_id(), "type": "function",
                                       "function": {"name": call.name, "arguments": call.arguments}})
                })
                .collect()
        };
        let nonempty = |s: String| (!s.is_empty()).then_some(s);
        match &t.mode {
            ToolMode::None => (nonempty(text.to_string()), None),
            ToolMode::Named(name) => {
                if text.is_empty() && (c.call_opened || !end) {
                    return (None, None);
                }
                if std::mem::replace(&mut c.call_opened, true) {
                    (None, Some(serde_json::json!([{"index": 0, "function": {"arguments": text}}])))
                } else {
                    (None, Some(opened(&[tools::ToolCall { name: name.clone(), arguments: text.to_string() }])))
                }
            }
            ToolMode::Required => {
                c.held.push_str(text);
                if !end {
                    return (None, None);
                }
                let (content, calls) = t.extract(&std::mem::take(&mut c.held));
                (content, (!calls.is_empty()).then(|| opened(&calls)))
            }
            ToolMode::Auto => {
                let mut content = c.hermes.push(text);
                if !end {
                    return (nonempty(content), None);
                }
                let (rest, calls) = c.hermes.finish();
                content.push_str(&rest);
                (nonempty(content), (!calls.is_empty()).then(|| opened(&calls)))
            }
        }
    }

    /// `chunk`, preceded by choice `i`'s role chunk when it is its first.
    fn with_role(&mut self, i: u32, chunk: Option<Bytes>) -> Option<Bytes> {
        match (self.role_chunk(i), chunk) {
            (Some(role), Some(chunk)) => {
                self.tail.push(chunk);
                Some(role)
            }
            (role, chunk) => role.or(chunk),
        }
    }
}

fn sse_response(
    meta: ResponseMeta,
    choices: Vec<Choice>,
    include_usage: bool,
    tok: Arc<dyn Tokenizer>,
    tools: Option<Arc<Tools>>,
) -> Response {
    let n = choices.len();
    let events = futures_util::stream::select_all((0u32..).zip(choices).map(|(i, c)| {
        futures_util::stream::unfold(c, |mut c| async move { c.next().await.map(|ev| (ev, c)) })
            .map(move |ev| (i, ev))
            .boxed()
    }));
    let state = SseState {
        meta,
        events,
        choices: (0..n).map(|_| ChoiceState::default()).collect(),
        include_usage,
        tokenizer: tok,
        tools,
        usage: Usage::new(0, 0, 0),
        tail: Vec::new(),
        done: false,
    };
    // A chat's first chunk per choice (the `role` delta) leaves with its first generated
    // token, as vLLM's does: a client timing the first event sees the prefill.
    let body = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(b) = s.tail.pop() {
                return Some((Ok::<_, std::convert::Infallible>(b), s));
            }
            if s.done {
                return None;
            }
            match s.events.next().await {
                Some((i, Event::Token { text, logprobs, .. })) => {
                    let (content, calls) = s.split_calls(i, &text, false);
                    let c = &mut s.choices[i as usize];
                    c.logprobs.extend(logprobs);
                    let chunk = (content.is_some() || calls.is_some()).then(|| {
                        let lp = c.logprobs.render(s.meta.endpoint, s.tokenizer.as_ref());
                        s.meta.chunk_with_calls(i, content.as_deref(), calls.as_ref(), false, None, lp.as_ref())
                    });
                    if let Some(out) = s.with_role(i, chunk) {
                        return Some((Ok(out), s));
                    }
                }
                Some((
                    i,
                    Event::Finished { text, reason, prompt_tokens, completion_tokens, cached_tokens, logprobs, .. },
                )) => {
                    let (content, calls) = s.split_calls(i, &text, true);
                    let finish = match &s.tools {
                        Some(t) => tool_finish(t, reason, calls.is_some()),
                        None => reason.as_str(),
                    };
                    let c = &mut s.choices[i as usize];
                    c.logprobs.extend(logprobs);
                    c.finished = true;
                    let lp = c.logprobs.render(s.meta.endpoint, s.tokenizer.as_ref());
                    // The prompt counts once; every choice's tokens count.
                    if i == 0 {
                        s.usage = Usage::new(prompt_tokens, s.usage.completion_tokens, cached_tokens);
                    }
                    s.usage = Usage::new(
                        s.usage.prompt_tokens,
                        s.usage.completion_tokens + completion_tokens,
                        s.usage.prompt_tokens_details.cached_tokens,
                    );
                    let last = s.meta.chunk_with_calls(
                        i,
                        content.as_deref(),
                        calls.as_ref(),
                        false,
                        Some(finish),
                        lp.as_ref(),
                    );
                    if s.choices.iter().all(|c| c.finished) {
                        s.done = true;
                        // `tail` is popped from its end: pushed last, sent first.
                        s.tail.push(Bytes::from_static(sse::DONE));
                        if s.include_usage {
                            s.tail.push(s.meta.usage_chunk(s.usage));
                        }
                    }
                    let out = s.with_role(i, Some(last)).expect("a chunk");
                    return Some((Ok(out), s));
                }
                None => {
                    s.done = true;
                    let err = ApiError::Unavailable.body();
                    return Some((Ok(Bytes::from(format!("data: {err}\n\n"))), s));
                }
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .expect("static response parts")
}
