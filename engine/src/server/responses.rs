//! `POST /v1/responses`, the stateless subset of OpenAI's Responses API.
//!
//! `input` (text, or messages whose content is text or `input_text` parts) and
//! `instructions` (a system message first) become a chat; `max_output_tokens`,
//! `temperature`, `top_p`, `seed` and `text.format` (`text`, `json_object`, `json_schema`:
//! structured output) apply as on `/v1/chat/completions`. The answer is one `message` output
//! item with one `output_text` part; streamed, the Responses events from `response.created` to
//! `response.completed`, each with its `sequence_number`.
//!
//! Nothing is stored: `store: true`, `previous_response_id`, `background` and tools are 400s
//! naming the field (use `/v1/chat/completions` for tools).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use switchyard_shim::process::unix_secs;

use super::openai::{self, CommonParams};
use super::AppState;
use crate::error::ApiError;
use crate::output_processor::Event;
use crate::scheduler::FinishReason;
use crate::structured::GuidedSpec;
use crate::tokenizer::ChatMessage;

/// The request's own fields (the sampling ones are [`CommonParams`]'s).
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    /// Text, or a list of message items.
    pub input: Option<Value>,
    /// A system message put first.
    pub instructions: Option<String>,
    /// Output token limit.
    pub max_output_tokens: Option<i64>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", "schema": ...}}`.
    pub text: Option<Value>,
    /// Must be false or absent: nothing is stored.
    pub store: Option<bool>,
    /// Echoed back.
    pub metadata: Option<Value>,
    /// Refused: no state.
    pub previous_response_id: Option<Value>,
    /// Refused unless empty: tools go through `/v1/chat/completions`.
    pub tools: Option<Value>,
    /// Accepted when there are no tools.
    pub tool_choice: Option<Value>,
    /// Accepted.
    pub parallel_tool_calls: Option<bool>,
    /// Refused when true: no background jobs.
    pub background: Option<bool>,
    /// `disabled` only.
    pub truncation: Option<String>,
}

const FIELDS: &[&str] = &[
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "store",
    "metadata",
    "previous_response_id",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "background",
    "truncation",
];

/// The conversation a Responses `input` describes.
fn messages(req: &ResponsesRequest) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::new();
    if let Some(i) = req.instructions.as_ref().filter(|i| !i.is_empty()) {
        out.push(ChatMessage { role: "system".into(), content: i.clone() });
    }
    match req.input.as_ref() {
        None | Some(Value::Null) => return Err(ApiError::invalid("input", "input is required")),
        Some(Value::String(t)) if t.is_empty() => return Err(ApiError::invalid("input", "input must not be empty")),
        Some(Value::String(t)) => out.push(ChatMessage { role: "user".into(), content: t.clone() }),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                let field = format!("input[{i}]");
                let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
                if kind != "message" {
                    return Err(ApiError::invalid(
                        field.clone(),
                        format!("{field}: items of type {kind:?} are not supported (messages only)"),
                    ));
                }
                let role = item.get("role").and_then(Value::as_str).unwrap_or("");
                if !matches!(role, "system" | "developer" | "user" | "assistant") {
                    return Err(ApiError::invalid(
                        format!("{field}.role"),
                        format!("{field}.role must be system, developer, user or assistant"),
                    ));
                }
                let content = match item.get("content") {
                    Some(Value::String(t)) => t.clone(),
                    Some(Value::Array(parts)) => {
                        let mut text = String::new();
                        for (j, p) in parts.iter().enumerate() {
                            match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                                (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                                (kind, _) => {
                                    return Err(ApiError::invalid(
                                        format!("{field}.content[{j}]"),
                                        format!("{field}.content[{j}]: only text parts are supported, got {kind:?}"),
                                    ))
                                }
                            }
                        }
                        text
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{field}.content"),
                            format!("{field}.content must be text or a list of text parts"),
                        ))
                    }
                };
                out.push(ChatMessage { role: role.into(), content });
            }
        }
        Some(_) => return Err(ApiError::invalid("input", "input must be text or a non-empty list of messages")),
    }
    Ok(out)
}

/// `text.format` as a grammar, if it asks for one.
fn format_spec(text: Option<&Value>) -> Result<Option<GuidedSpec>, ApiError> {
    let Some(format) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else { return Ok(None) };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GuidedSpec::JsonObject)),
        Some("json_schema") => match format.get("schema") {
            Some(s @ Value::Object(_)) => Ok(Some(GuidedSpec::JsonSchema(s.clone()))),
            _ => Err(ApiError::invalid("text.format.schema", "text.format of type json_schema needs a schema object")),
        },
        _ => Err(ApiError::invalid("text.format.type", "text.format.type must be text, json_object or json_schema")),
    }
}

/// A parsed request, ready to run.
struct Plan {
    prepared: super::Prepared,
    /// What the response echoes back.
    echo: Value,
}

fn plan(st: &AppState, body: &[u8], id: u64) -> Result<Plan, ApiError> {
    let (req, common): (ResponsesRequest, CommonParams) = openai::parse_body(body, FIELDS)?;
    st.check_model(&common.model)?;
    let refuse = |field: &str, why: &str| Err(ApiError::invalid(field, format!("{field}: {why}")));
    if req.store == Some(true) {
        return refuse("store", "responses are not stored by this engine; send store: false");
    }
    if req.previous_response_id.as_ref().is_some_and(|v| !v.is_null()) {
        return refuse("previous_response_id", "responses are not stored, so none can be continued");
    }
    if req.background == Some(true) {
        return refuse("background", "background responses are not supported");
    }
    if req.tools.as_ref().and_then(Value::as_array).is_some_and(|t| !t.is_empty()) {
        return refuse("tools", "tools on /v1/responses are not supported yet; use /v1/chat/completions");
    }
    if req.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return refuse("truncation", "only disabled is supported");
    }
    for (field, set) in [("max_tokens", common.max_tokens.is_some()), ("n", common.n.is_some())] {
        if set {
            return refuse(field, "not a Responses API field (max_output_tokens; one output per response)");
        }
    }
    let messages = messages(&req)?;
    let text = st.tokenizer.render_chat(&messages).map_err(|e| ApiError::invalid("input", e))?;
    let prompt = st.encode("input", &text)?;
    let common = CommonParams { max_tokens: req.max_output_tokens, ..common };
    let mut prepared = st.prepare(&common, prompt, "input", id).map_err(|e| match e {
        // `max_tokens` is this API's `max_output_tokens`.
        ApiError::InvalidRequest { param: Some(p), message } if p == "max_tokens" => ApiError::InvalidRequest {
            param: Some("max_output_tokens".into()),
            message: message.replace("max_tokens", "max_output_tokens"),
        },
        e => e,
    })?;
    if let Some(spec) = format_spec(req.text.as_ref())? {
        prepared.constraint = Some(st.compile("text.format", &spec)?);
    }
    let echo = json!({
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": common.temperature.unwrap_or(1.0),
        "top_p": common.top_p.unwrap_or(1.0),
        "metadata": req.metadata.unwrap_or(json!({})),
        "text": req.text.unwrap_or(json!({"format": {"type": "text"}})),
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "tool_choice": req.tool_choice.unwrap_or(json!("auto")),
        "tools": [],
        "store": false,
        "truncation": "disabled",
        "previous_response_id": null,
        "error": null,
    });
    Ok(Plan { prepared, echo })
}

/// The parts of a response that change as it runs.
struct Snapshot<'a> {
    id: &'a str,
    item_id: &'a str,
    created_at: u64,
    model: &'a str,
    echo: &'a Value,
}

impl Snapshot<'_> {
    fn message(&self, text: Option<&str>, status: &str) -> Value {
        let content: Vec<Value> =
            text.map(|t| json!({"type": "output_text", "text": t, "annotations": []})).into_iter().collect();
        json!({"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content})
    }

    /// The response object; `done`: its text, finish reason and token counts.
    fn response(&self, done: Option<(&str, FinishReason, usize, usize, usize)>) -> Value {
        let mut v = self.echo.clone();
        let (status, output, usage, incomplete) = match done {
            None => ("in_progress", json!([]), Value::Null, Value::Null),
            Some((text, reason, prompt, completion, cached)) => {
                let incomplete = reason == FinishReason::Length;
                (
                    if incomplete { "incomplete" } else { "completed" },
                    json!([self.message(Some(text), if incomplete { "incomplete" } else { "completed" })]),
                    json!({"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                           "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                           "total_tokens": prompt + completion}),
                    if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
                )
            }
        };
        let fields = json!({"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                            "status": status, "output": output, "usage": usage, "incomplete_details": incomplete});
        v.as_object_mut().expect("an object").extend(fields.as_object().expect("an object").clone());
        v
    }
}

/// `POST /v1/responses`.
pub async fn responses(axum::extract::State(st): axum::extract::State<Arc<AppState>>, body: Bytes) -> Response {
    let arrival = Instant::now();
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let Plan { prepared: p, echo } = match st.off_loop(body.len(), move |st| plan(st, &body, id)).await {
        Ok(plan) => plan,
        Err(e) => return e.into_response(),
    };
    let mut stream = match st.engine.submit(id, p.prompt.clone(), p.params.clone(), p.constraint.clone(), arrival) {
        Ok(s) => s,
        Err(_) => return ApiError::Unavailable.into_response(),
    };
    let resp_id = format!("resp_{:032x}", rand::random::<u128>());
    let item_id = format!("msg_{:032x}", rand::random::<u128>());
    let (created_at, model) = (unix_secs(), st.model.clone());
    if !p.stream {
        let mut text = String::new();
        loop {
            match stream.next().await {
                Some(Event::Token { text: t, .. }) => text.push_str(&t),
                Some(Event::Finished { text: t, reason, prompt_tokens, completion_tokens, cached_tokens, .. }) => {
                    text.push_str(&t);
                    let snap = Snapshot { id: &resp_id, item_id: &item_id, created_at, model: &model, echo: &echo };
                    let done = (text.as_str(), reason, prompt_tokens, completion_tokens, cached_tokens);
                    return Json(snap.response(Some(done))).into_response();
                }
                None => return ApiError::Unavailable.into_response(),
            }
        }
    }
    // Streamed: the events are built as the engine's arrive; `pending` holds those still to
    // send, first in front.
    struct State {
        stream: crate::runtime::RequestStream,
        pending: std::collections::VecDeque<Bytes>,
        seq: u64,
        text: String,
        started: bool,
        done: bool,
        ids: (String, String, u64, String, Value),
    }
    impl State {
        fn push(&mut self, kind: &str, mut data: Value) {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(self.seq);
            self.seq += 1;
            self.pending.push_back(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")));
        }
        fn snap(&self) -> Snapshot<'_> {
            let (id, item_id, created_at, model, echo) = &self.ids;
            Snapshot { id, item_id, created_at: *created_at, model, echo }
        }
    }
    let state = State {
        stream,
        pending: Default::default(),
        seq: 0,
        text: String::new(),
        started: false,
        done: false,
        ids: (resp_id, item_id, created_at, model, echo),
    };
    let body = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(b) = s.pending.pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(b), s));
            }
            if s.done {
                return None;
            }
            let event = s.stream.next().await;
            // The opening events leave with the first token, as the chat role chunk does.
            if !s.started {
                s.started = true;
                let (response, item) = (s.snap().response(None), s.snap().message(None, "in_progress"));
                let item_id = s.ids.1.clone();
                s.push("response.created", json!({"response": response}));
                s.push("response.in_progress", json!({"response": response}));
                s.push("response.output_item.added", json!({"output_index": 0, "item": item}));
                s.push(
                    "response.content_part.added",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}}),
                );
            }
            let item_id = s.ids.1.clone();
            let delta = |s: &mut State, t: &str| {
                if !t.is_empty() {
                    s.text.push_str(t);
                    s.push(
                        "response.output_text.delta",
                        json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": t, "logprobs": []}),
                    );
                }
            };
            match event {
                Some(Event::Token { text, .. }) => delta(&mut s, &text),
                Some(Event::Finished { text, reason, prompt_tokens, completion_tokens, cached_tokens, .. }) => {
                    delta(&mut s, &text);
                    let full = s.text.clone();
                    let part = json!({"type": "output_text", "text": full, "annotations": []});
                    let ids = json!({"item_id": item_id, "output_index": 0, "content_index": 0});
                    s.push(
                        "response.output_text.done",
                        json!({"item_id": item_id, "output_index": 0,
                        "content_index": 0, "text": full, "logprobs": []}),
                    );
                    let mut part_done = ids.clone();
                    part_done["part"] = part;
                    s.push("response.content_part.done", part_done);
                    let response =
                        s.snap().response(Some((&full, reason, prompt_tokens, completion_tokens, cached_tokens)));
                    s.push("response.output_item.done", json!({"output_index": 0, "item": response["output"][0]}));
                    let last =
                        if reason == FinishReason::Length { "response.incomplete" } else { "response.completed" };
                    s.push(last, json!({"response": response}));
                    s.done = true;
                }
                None => {
                    let err = ApiError::Unavailable;
                    s.push("error", json!({"code": null, "message": err.to_string(), "param": null}));
                    s.done = true;
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
