//! The route table, pure: what the gateway does with a method and path, on every transport
//! (HTTP/1.1, HTTP/2, the Endpoint Picker's ext_proc streams).
//!
//! The gateway answers its own routes (`/-/healthz`, `/-/ready`, the model list), sends
//! inference routes to an engine, and refuses everything else — the engines' administrative
//! routes (`/reset_prefix_cache`, `/collective_rpc`, `/start_profile`, `/sleep`, LoRA loading)
//! included: a client must not change an engine it shares with others.
//!
//! Routing is on the normalized path ([`normalize_target`]), and that is what an engine gets:
//! an engine's server decodes and resolves what the gateway would otherwise not have
//! (`/v1/%6coad_lora_adapter`, `/v1/../collective_rpc` are the same routes to it).

use std::borrow::Cow;

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
/// `/v1/*` route but the model list and the engines' administrative routes (with or without a
/// trailing slash), and vLLM's model routes outside `/v1/` ([`ENGINE_ROUTES`]). The body
/// names the model (JSON, or the `model` field of a multipart form).
fn is_inference(path: &str) -> bool {
    let v1 = path.starts_with("/v1/") && path != "/v1/models" && !path.starts_with(MODEL_PREFIX);
    let bare = path.trim_end_matches('/');
    (v1 && !ENGINE_ADMIN_ROUTES.contains(&bare)) || ENGINE_ROUTES.contains(&path)
}

/// The request target (path and query) as routed and forwarded, RFC 3986 §6.2.2 on the
/// path: percent-escapes of unreserved characters decoded (`%6c` is `l`), dot segments
/// removed (`/v1/../x` is `/x`), repeated slashes merged (NGINX's `merge_slashes`); the query
/// as sent. Borrowed when the target is already normal (nearly every request: one scan).
///
/// # Errors
/// What is refused (400): a fragment, a malformed percent-escape, an escaped `/` or `\`
/// (an engine would decode it into a path separator), a path not starting with `/`.
pub(crate) fn normalize_target(target: &str) -> Result<Cow<'_, str>, &'static str> {
    let Some(path_len) = scan(target.as_bytes())? else { return Ok(Cow::Borrowed(target)) };
    let (path, query) = target.split_at(path_len);
    let decoded = decode_unreserved(path)?;
    let segments: Vec<&str> = decoded[1..].split('/').collect();
    let mut kept: Vec<&str> = Vec::with_capacity(segments.len());
    for s in &segments {
        match *s {
            "" | "." => {}
            ".." => {
                kept.pop();
            }
            s => kept.push(s),
        }
    }
    // `/a/b/`, `/a/b/.` and `/a/b/..` end in a directory (RFC 3986 §5.2.4).
    let trailing = segments.last().is_some_and(|s| matches!(*s, "" | "." | "..")) && !kept.is_empty();
    let mut out = String::with_capacity(target.len());
    out.push('/');
    out.push_str(&kept.join("/"));
    if trailing {
        out.push('/');
    }
    out.push_str(query);
    Ok(Cow::Owned(out))
}

/// One pass over `target`: refused (a fragment; a path not starting with `/`), normal
/// (`None`: no escape, no empty segment, no `.` or `..` segment in its path), or where its
/// path ends, to be normalized.
fn scan(target: &[u8]) -> Result<Option<usize>, &'static str> {
    if target.first() != Some(&b'/') {
        return Err("the request path must start with /");
    }
    let (mut path_end, mut normal, mut prev) = (None, true, 0u8);
    for (i, &b) in target.iter().enumerate() {
        match b {
            b'#' => return Err("a request target has no fragment (#)"),
            b'?' if path_end.is_none() => path_end = Some(i),
            _ if path_end.is_some() || !normal => {}
            b'%' => normal = false,
            b'/' if prev == b'/' => normal = false,
            b'.' if prev == b'/' => {
                let rest = &target[i + 1..];
                normal = !matches!(rest, [] | [b'/' | b'?', ..] | [b'.'] | [b'.', b'/' | b'?', ..]);
            }
            _ => {}
        }
        prev = b;
    }
    Ok((!normal).then(|| path_end.unwrap_or(target.len())))
}

/// `path` with its percent-escapes of unreserved characters (ALPHA, DIGIT, `-._~`) decoded and
/// the others kept (hex in upper case).
fn decode_unreserved(path: &str) -> Result<String, &'static str> {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            out.push(bytes[i]);
            i += 1;
            continue;
        }
        let hex = |b: u8| (b as char).to_digit(16);
        let (Some(hi), Some(lo)) = (bytes.get(i + 1).and_then(|&b| hex(b)), bytes.get(i + 2).and_then(|&b| hex(b)))
        else {
            return Err("a malformed percent-escape in the request path");
        };
        let c = (hi * 16 + lo) as u8;
        match c {
            b'/' | b'\\' => return Err("an escaped / or \\ in the request path"),
            c if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') => out.push(c),
            _ => out.extend_from_slice(format!("%{c:02X}").as_bytes()),
        }
        i += 3;
    }
    // Only ASCII was decoded, the rest copied from text.
    String::from_utf8(out).map_err(|_| "the request path is not UTF-8")
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
    fn targets_are_normalized_as_an_engine_would_read_them_or_refused() {
        for (target, normal) in [
            ("/v1/chat/completions", "/v1/chat/completions"),
            ("/v1/completions?x=%2F..", "/v1/completions?x=%2F.."),
            ("/v1/%6coad_lora_adapter", "/v1/load_lora_adapter"),
            ("/v1/%6C%6Fad_lora_adapter", "/v1/load_lora_adapter"),
            ("/v1/../collective_rpc", "/collective_rpc"),
            ("/v1/%2e%2e/reset_prefix_cache", "/reset_prefix_cache"),
            ("/v1/./chat//completions", "/v1/chat/completions"),
            ("//v1///models", "/v1/models"),
            ("/../../x", "/x"),
            ("/a/b/..", "/a/"),
            ("/a/b/.", "/a/b/"),
            ("/v1/models/meta-llama%3aLlama", "/v1/models/meta-llama%3ALlama"),
            ("/v1/models/caf%C3%A9", "/v1/models/caf%C3%A9"),
            ("/", "/"),
        ] {
            assert_eq!(normalize_target(target).as_deref(), Ok(normal), "{target}");
        }
        for normal in ["/v1/chat/completions", "/v1/models/a.b", "/.well-known/x", "/v1/x..y/", "/a?b=//./%2F"] {
            assert!(matches!(normalize_target(normal), Ok(Cow::Borrowed(_))), "{normal}");
        }
        for bad in
            ["/v1/load_lora_adapter#x", "/v1/a%2Fb", "/v1/a%5cb", "/v1/%", "/v1/%6", "/v1/%+1", "/v1/%zz", "v1/x", "*"]
        {
            assert!(normalize_target(bad).is_err(), "{bad}");
        }
        // Once normal, the trick routes where the engine would have taken it: nowhere.
        for trick in ["/v1/%6coad_lora_adapter", "/v1/load_lora_adapter/", "/v1/%2e%2e/reset_prefix_cache"] {
            let normal = normalize_target(trick).unwrap();
            assert_eq!(route("POST", &normal), Route::Unknown, "{trick}");
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
