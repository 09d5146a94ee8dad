//! The route table, pure: what the gateway does with a method and path, on every transport
//! (HTTP/1.1, HTTP/2, the Endpoint Picker's ext_proc streams).
//!
//! The gateway answers its own routes (`/-/healthz`, `/-/ready`, the model list), sends
//! inference routes to an engine, and refuses everything else — the engines' administrative
//! routes (`/reset_prefix_cache`, `/collective_rpc`, `/start_profile`, `/sleep`, LoRA loading)
//! included: a client must not change an engine it shares with others.

/// What to do with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route<'p> {
    /// `GET /-/healthz`: the process answers.
    Healthz,
    /// `GET /-/ready`: whether a backend can take requests.
    Ready,
    /// `GET /v1/models`: the union of the engines' models.
    Models,
    /// `GET /v1/models/{id}` (the id as in the path, percent-encoded or not).
    Model(&'p str),
    /// `POST` to an inference route: planned, queued and sent to an engine.
    Inference,
    /// A known path with another method (405).
    MethodNotAllowed,
    /// Anything else (404).
    Unknown,
}

/// Where `GET /v1/models/{id}` starts.
const MODEL_PREFIX: &str = "/v1/models/";

/// vLLM's model routes outside `/v1/`.
const ENGINE_ROUTES: [&str; 7] =
    ["/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank", "/v2/rerank"];

/// vLLM's administrative routes under `/v1/`, never proxied: a client with an API key must
/// not load adapters into engines it shares with others. (Those outside `/v1/` are not
/// inference routes to begin with.)
const ENGINE_ADMIN_ROUTES: [&str; 2] = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"];

/// The route of `method` and `path` (without its query).
pub(crate) fn route<'p>(method: &str, path: &'p str) -> Route<'p> {
    match (method, path) {
        ("GET", "/-/healthz") => Route::Healthz,
        ("GET", "/-/ready") => Route::Ready,
        ("GET", "/v1/models") => Route::Models,
        ("GET", p) if p.starts_with(MODEL_PREFIX) => Route::Model(&p[MODEL_PREFIX.len()..]),
        ("POST", p) if is_inference(p) => Route::Inference,
        (_, p)
            if matches!(p, "/-/healthz" | "/-/ready" | "/v1/models")
                || p.starts_with(MODEL_PREFIX)
                || is_inference(p) =>
        {
            Route::MethodNotAllowed
        }
        _ => Route::Unknown,
    }
}

/// Whether requests to `path` carry an API key: every `/v1/` path and the inference routes.
pub(crate) fn needs_key(path: &str) -> bool {
    path.starts_with("/v1/") || is_inference(path)
}

/// Whether `path` is an inference route the gateway sends to an engine when POSTed: every
/// `/v1/*` route but the model list and the engines' administrative routes, and vLLM's model
/// routes outside `/v1/` ([`ENGINE_ROUTES`]). The body names the model (JSON, or the `model`
/// field of a multipart form).
fn is_inference(path: &str) -> bool {
    let v1 = path.starts_with("/v1/") && path != "/v1/models" && !path.starts_with(MODEL_PREFIX);
    (v1 && !ENGINE_ADMIN_ROUTES.contains(&path)) || ENGINE_ROUTES.contains(&path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_answers_its_own_routes_sends_inference_and_refuses_engine_admin() {
        assert_eq!(route("GET", "/-/healthz"), Route::Healthz);
        assert_eq!(route("GET", "/-/ready"), Route::Ready);
        assert_eq!(route("GET", "/v1/models"), Route::Models);
        assert_eq!(route("GET", "/v1/models/a%2Fb"), Route::Model("a%2Fb"));
        for p in
            ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/tokenize", "/v2/rerank"]
        {
            assert_eq!(route("POST", p), Route::Inference, "{p}");
            assert_eq!(route("PUT", p), Route::MethodNotAllowed, "{p}");
        }
        assert_eq!(route("POST", "/v1/models"), Route::MethodNotAllowed);
        for p in [
            "/reset_prefix_cache",
            "/collective_rpc",
            "/start_profile",
            "/stop_profile",
            "/sleep",
            "/wake_up",
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/invocations",
            "/generate",
            "/metrics",
            "/",
        ] {
            assert_eq!(route("POST", p), Route::Unknown, "{p}");
            assert_eq!(route("GET", p), Route::Unknown, "{p}");
        }
    }

    #[test]
    fn keys_guard_every_v1_path_and_the_inference_routes() {
        for p in ["/v1/models", "/v1/chat/completions", "/v1/load_lora_adapter", "/tokenize"] {
            assert!(needs_key(p), "{p}");
        }
        for p in ["/-/healthz", "/-/ready", "/reset_prefix_cache"] {
            assert!(!needs_key(p), "{p}");
        }
    }
}
