//! A scripted engine that answers every OpenAI and vLLM route (chat, completions, embeddings,
//! responses, audio transcriptions, rerank, score, tokenize, …) with a small body of the
//! route's shape naming itself, serves the models (and LoRA adapters) it is given in
//! `/v1/models`, and reports its loaded adapters in vLLM's `vllm:lora_requests_info` gauge.
//! It records every request it read and the exact bytes it answered, so a test can prove a
//! response crossed the gateway unchanged and a request reached the engine it should.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::Response;
use serde_json::{json, Value};

/// One POST the engine answered.
#[derive(Debug, Clone)]
pub struct Answered {
    /// Path with its query.
    pub path: String,
    /// Request headers, lowercase names.
    pub headers: Vec<(String, String)>,
    /// The request body as received.
    pub body: Bytes,
    /// The response body as sent.
    pub answer: Bytes,
}

struct Inner {
    name: String,
    cards: Vec<Value>,
    running_adapters: Vec<String>,
    answered: Vec<Answered>,
}

/// A running route engine; its server stops with the test's runtime.
#[derive(Clone)]
pub struct RouteEngine {
    inner: Arc<Mutex<Inner>>,
    /// Where it listens.
    pub addr: SocketAddr,
}

/// A `/v1/models` object for `id` (a base model), as vLLM describes one.
pub fn model_card(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 1_700_000_000, "owned_by": "vllm", "root": id,
           "parent": null, "max_model_len": 8192})
}

/// A `/v1/models` object for a LoRA adapter `id` on `parent`.
pub fn adapter_card(id: &str, parent: &str) -> Value {
    json!({"id": id, "object": "model", "created": 1_700_000_000, "owned_by": "vllm",
           "root": format!("/adapters/{id}"), "parent": parent, "max_model_len": null})
}

impl RouteEngine {
    /// Serve on a free loopback port as `name`, with these `/v1/models` objects.
    pub async fn start(name: &str, cards: Vec<Value>) -> RouteEngine {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let inner = Inner { name: name.into(), cards, running_adapters: Vec::new(), answered: Vec::new() };
        let engine = RouteEngine { inner: Arc::new(Mutex::new(inner)), addr };
        let app = axum::Router::new()
            .route("/metrics", axum::routing::get(metrics))
            .route("/v1/models", axum::routing::get(models))
            .route("/health", axum::routing::get(|| async { "" }))
            .fallback(answer)
            .with_state(engine.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        engine
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The adapters it reports as loaded (`running_lora_adapters`).
    pub fn set_running_adapters(&self, adapters: &[&str]) {
        self.inner.lock().unwrap().running_adapters = adapters.iter().map(|a| a.to_string()).collect();
    }

    /// Every POST answered so far.
    pub fn answered(&self) -> Vec<Answered> {
        self.inner.lock().unwrap().answered.clone()
    }
}

async fn metrics(State(e): State<RouteEngine>) -> String {
    let g = e.inner.lock().unwrap();
    let model = g.cards.first().and_then(|c| c["id"].as_str()).unwrap_or("m").to_string();
    format!(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{model}\"}} 0\n\
         # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{model}\"}} 0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"{model}\"}} 0.1\n\
         # TYPE vllm:lora_requests_info gauge\n\
         vllm:lora_requests_info{{max_lora=\"4\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"\"}} 1.7e9\n",
        g.running_adapters.join(",")
    )
}

async fn models(State(e): State<RouteEngine>) -> axum::Json<Value> {
    let g = e.inner.lock().unwrap();
    axum::Json(json!({"object": "list", "data": g.cards}))
}

async fn answer(State(e): State<RouteEngine>, req: Request) -> Response {
    let path = req.uri().path_and_query().map_or_else(|| req.uri().path().to_string(), |p| p.to_string());
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
        .collect();
    let body = axum::body::to_bytes(req.into_body(), 64 << 20).await.unwrap_or_default();
    let name = e.inner.lock().unwrap().name.clone();
    let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let model = json["model"].as_str().unwrap_or("").to_string();
    let stream = json["stream"] == true || form_says_stream(&body);
    let (content_type, answer) = if stream { streamed(&name, &path, &model) } else { whole(&name, &path, &model) };
    let answer = Bytes::from(answer);
    e.inner.lock().unwrap().answered.push(Answered { path, headers, body, answer: answer.clone() });
    Response::builder().header("content-type", content_type).body(Body::from(answer)).unwrap()
}

/// A multipart form with `stream` = `true` (no parser: the form is the test's own).
fn form_says_stream(body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(body);
    text.contains("name=\"stream\"\r\n\r\ntrue")
}

/// The whole (non-streamed) answer of `path`, in the route's shape.
fn whole(name: &str, path: &str, model: &str) -> (&'static str, String) {
    let text = format!("from {name}");
    let route = path.split('?').next().unwrap_or(path);
    let v = match route {
        "/v1/chat/completions" => json!({"id": format!("chatcmpl-{name}"), "object": "chat.completion", "created": 1,
            "model": model, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
            "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
        "/v1/completions" => json!({"id": format!("cmpl-{name}"), "object": "text_completion", "created": 1,
            "model": model, "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
        "/v1/embeddings" => json!({"object": "list", "model": model, "data": [{"object": "embedding", "index": 0,
            "embedding": [0.25, -0.5, 0.125]}], "usage": {"prompt_tokens": 3, "total_tokens": 3}}),
        "/v1/responses" => json!({"id": format!("resp_{name}"), "object": "response", "created_at": 1, "model": model,
            "status": "completed", "output": [{"type": "message", "id": "msg_1", "role": "assistant",
            "status": "completed", "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "parallel_tool_calls": false, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}),
        "/v1/audio/transcriptions" | "/v1/audio/translations" => json!({"text": text}),
        "/rerank" | "/v1/rerank" | "/v2/rerank" => json!({"id": format!("rerank-{name}"), "model": model,
            "results": [{"index": 1, "relevance_score": 0.75, "document": {"text": text}},
                        {"index": 0, "relevance_score": 0.25, "document": {"text": "other"}}],
            "usage": {"total_tokens": 7}}),
        "/score" | "/v1/score" => json!({"id": format!("score-{name}"), "object": "list", "model": model,
            "data": [{"index": 0, "object": "score", "score": 0.75}], "usage": {"prompt_tokens": 7}}),
        "/tokenize" => json!({"count": 3, "max_model_len": 8192, "tokens": [101, 2023, 102]}),
        "/detokenize" => json!({"prompt": text}),
        _ => json!({"engine": name, "path": path, "model": model}),
    };
    ("application/json", v.to_string())
}

/// The streamed answer of `path`: three content events and the end, in the route's shape.
fn streamed(name: &str, path: &str, model: &str) -> (&'static str, String) {
    let route = path.split('?').next().unwrap_or(path);
    let mut out = String::new();
    let words = ["from", " ", name];
    for (i, w) in words.iter().enumerate() {
        let event = match route {
            "/v1/chat/completions" => json!({"id": format!("chatcmpl-{name}"), "object": "chat.completion.chunk",
                "created": 1, "model": model, "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": null}]}),
            "/v1/responses" => json!({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                "content_index": 0, "delta": w, "sequence_number": i}),
            "/v1/audio/transcriptions" => json!({"type": "transcript.text.delta", "delta": w}),
            _ => json!({"id": format!("cmpl-{name}"), "object": "text_completion", "created": 1, "model": model,
                "choices": [{"index": 0, "text": w, "finish_reason": null}]}),
        };
        if route == "/v1/responses" {
            out.push_str("event: response.output_text.delta\n");
        }
        out.push_str(&format!("data: {event}\n\n"));
    }
    match route {
        "/v1/responses" => out.push_str(&format!(
            "event: response.completed\ndata: {}\n\n",
            json!({"type": "response.completed", "sequence_number": 3, "response": {"id": format!("resp_{name}"),
                "object": "response", "created_at": 1, "model": model, "status": "completed", "output": []}})
        )),
        "/v1/audio/transcriptions" => out.push_str(&format!(
            "data: {}\n\n",
            json!({"type": "transcript.text.done", "text": format!("from {name}")})
        )),
        _ => out.push_str("data: [DONE]\n\n"),
    }
    ("text/event-stream", out)
}
