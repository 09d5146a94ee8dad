//! What routing needs from a request body, parsed without copying the body and without a
//! document tree: the routing fields and prompt sizes here, the canonical prompt in
//! [`prompt`].
//!
//! The body itself is forwarded byte for byte; this only extracts `model`, `stream` and the
//! token limit, counts the prompt's messages and items against [`PromptLimits`], and checks
//! that the body is a JSON object (so malformed input gets a 400 from the gateway instead
//! of costing an engine a connection). [`tokens`] reads the prompt as the engine does, for
//! precise prefix routing.

mod content;
mod derived;
mod multipart;
mod prompt;
pub mod tokens;

use serde_json::value::RawValue;

use crate::error::ProxyError;
use tokens::SeenPrompt;

pub use content::ContentDetector;
pub use multipart::form_data_boundary;
#[cfg(any(test, feature = "fuzzing"))]
pub use prompt::canonical_prompt;
pub use prompt::canonical_prompt_blocks;
#[cfg(feature = "fuzzing")]
pub use prompt::canonical_prompt_from_tree;

/// The longest model name accepted (it becomes a label, a log field and a lookup key).
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// Routing fields of an OpenAI request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingFields {
    /// `model`, if given.
    pub model: Option<String>,
    /// Where its value stands in the body (a JSON string with its quotes, or a form field's
    /// bytes), for an alias to rewrite.
    pub model_span: Option<std::ops::Range<usize>>,
    /// `stream`.
    pub stream: bool,
    /// Choices asked for (`n`, read as [`max_tokens`](Self::max_tokens) is; at least 1).
    pub choices: u64,
    /// `max_completion_tokens` (else `max_tokens`, the engines' precedence) when it is a
    /// non-negative integer; other values are left for the engine to reject.
    pub max_tokens: Option<u64>,
}

/// How large a prompt may be, in items: what `limits.max_messages` and
/// `limits.max_prompt_items` allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLimits {
    /// Entries of `messages`.
    pub max_messages: usize,
    /// Items of `prompt`: its strings or token ids, counting those of nested arrays.
    pub max_prompt_items: usize,
}

impl PromptLimits {
    /// No limit (the fuzz target and tests that are not about limits).
    #[cfg(any(test, feature = "fuzzing"))]
    pub const NONE: PromptLimits = PromptLimits { max_messages: usize::MAX, max_prompt_items: usize::MAX };
}

/// Parse the routing fields and check the prompt's size; the error names what is wrong.
pub fn routing_fields(body: &[u8], limits: &PromptLimits) -> Result<RoutingFields, ProxyError> {
    read_request(body, limits, prompt::NoText, false).map(|(fields, ..)| fields)
}

/// What prefix routing reads from the routing pass over a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptPass {
    /// The canonical prompt's block hashes and length (what [`canonical_prompt_blocks`]
    /// gives).
    pub blocks: (Vec<u64>, usize),
    /// The prompt as the engine reads it, when asked for and the pass could tell.
    pub seen: SeenPrompt,
}

/// [`routing_fields`] and, from the same pass over the body, the canonical prompt's block
/// hashes and length, and, with `see`, the prompt as the engine reads it (for precise
/// routing: see [`prompt::parse_seeing`]).
pub fn routing_fields_and_blocks(
    body: &[u8],
    limits: &PromptLimits,
    block_bytes: usize,
    see: bool,
) -> Result<(RoutingFields, PromptPass), ProxyError> {
    let (fields, hasher, seen) = read_request(body, limits, prompt::BlockHasher::new(block_bytes, 0), see)?;
    Ok((fields, PromptPass { blocks: (hasher.hashes, hasher.len), seen }))
}

/// One pass over `body`: the routing fields, checked, the canonical prompt in `proto`'s kind
/// of sink, and with `see` the prompt as the engine reads it.
fn read_request<S: prompt::PromptSink>(
    body: &[u8],
    limits: &PromptLimits,
    proto: S,
    see: bool,
) -> Result<(RoutingFields, S, SeenPrompt), ProxyError> {
    let text = json_text(body)?;
    let empty = proto.fresh(0);
    let read = if see { prompt::parse_seeing(text, proto) } else { prompt::parse(text, proto) };
    let Ok(raw) = read else {
        // The derived reader decides what the one pass could not read; no prompt text.
        return derived::routing_fields(text, limits).map(|fields| (fields, empty, SeenPrompt::Unknown));
    };
    if let Some(top) = raw.messages {
        if top > limits.max_messages {
            return Err(ProxyError::too_long("messages", "an array", limits.max_messages, top));
        }
    }
    if let Some(all) = raw.prompt_items {
        if all > limits.max_prompt_items {
            return Err(ProxyError::too_long("prompt", "prompts or token ids", limits.max_prompt_items, all));
        }
    }
    let fields = checked_fields(text, raw.model, raw.stream, [raw.max_tokens, raw.max_completion_tokens, raw.n])?;
    Ok((fields, raw.prompt, raw.seen))
}

/// `body` as text, when it may be a JSON object: it starts with `{` and is UTF-8.
fn json_text(body: &[u8]) -> Result<&str, ProxyError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(ProxyError::BadRequest("request body must be a JSON object".into()));
    }
    // serde skips the bytes of fields it ignores without checking them: check UTF-8 first.
    std::str::from_utf8(body).map_err(|e| {
        ProxyError::BadRequest(format!("request body is not valid JSON: invalid UTF-8 at byte {}", e.valid_up_to()))
    })
}

/// The string a raw JSON value (already parsed once) holds, if it is a string: the text
/// between its quotes when it has no escape, else what serde_json makes of it.
fn json_string(raw: &str) -> Option<String> {
    match raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
        Some(inner) if !inner.contains('\\') => Some(inner.to_owned()),
        _ => serde_json::from_str::<String>(raw).ok(),
    }
}

/// The routing fields from their raw values in `text`.
fn checked_fields(
    text: &str,
    model: Option<&RawValue>,
    stream: Option<&RawValue>,
    [max_tokens, max_completion_tokens, n]: [Option<&RawValue>; 3],
) -> Result<RoutingFields, ProxyError> {
    let (model, model_span) =
        match model {
            None => (None, None),
            Some(v) if v.get() == "null" => (None, None),
            Some(v) => (
                Some(json_string(v.get()).ok_or_else(|| {
                    ProxyError::BadRequest(format!("model must be a string, got {}", truncate(v.get())))
                })?),
                Some(span_in(text.as_bytes(), v.get().as_bytes())),
            ),
        };
    if let Some(m) = &model {
        check_model_name(m)?;
    }
    let stream = match stream {
        None => false,
        Some(v) => match v.get() {
            "true" => true,
            "false" | "null" => false,
            other => return Err(ProxyError::BadRequest(format!("stream must be a boolean, got {}", truncate(other)))),
        },
    };
    // The engines' precedence (vLLM, ours): `max_completion_tokens` first. Charging
    // `max_tokens` first let `{"max_tokens":1,"max_completion_tokens":100000}` pay for one.
    let max_tokens = max_completion_tokens.or(max_tokens).and_then(lax_count);
    let choices = n.and_then(lax_count).unwrap_or(1).max(1);
    Ok(RoutingFields { model, model_span, stream, choices, max_tokens })
}

/// A count as vLLM's request models (pydantic, lax mode) read one, so the budget charges
/// what the engine will run: an integer, a number with no fraction (`1e5`, `100000.0`), or a
/// string holding either (`"100000"`); one past `u64` saturates. `None` for anything else
/// (negative, fractional, not a number: the engine refuses it, and nothing is used).
fn lax_count(raw: &RawValue) -> Option<u64> {
    let text = raw.get();
    let unquoted = json_string(text);
    let number = unquoted.as_deref().map_or(text, str::trim);
    if let Ok(n) = number.parse::<u64>() {
        return Some(n);
    }
    // Rust's float parser also takes `inf` and `NaN`: only finite, whole, non-negative (the
    // cast saturates past `u64::MAX`).
    let f: f64 = number.parse().ok()?;
    (f.is_finite() && f >= 0.0 && f.fract() == 0.0).then_some(f as u64)
}

/// Where `part`, a subslice of `whole`, stands in it.
fn span_in(whole: &[u8], part: &[u8]) -> std::ops::Range<usize> {
    let start = part.as_ptr() as usize - whole.as_ptr() as usize;
    debug_assert!(start + part.len() <= whole.len());
    start..start + part.len()
}

/// The routing fields of a `multipart/form-data` upload with `boundary` (an audio file for
/// `/v1/audio/transcriptions`): its `model` and `stream` form fields. A form has no prompt
/// to count and no token limit.
pub fn form_routing_fields(body: &[u8], boundary: &str) -> Result<RoutingFields, ProxyError> {
    let [model, stream] =
        multipart::text_fields(body, boundary, ["model", "stream"]).map_err(ProxyError::BadRequest)?;
    if let Some(m) = model {
        check_model_name(m)?;
    }
    let stream = match stream.map(str::trim) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(ProxyError::BadRequest(format!("stream must be true or false, got {}", truncate(other))))
        }
    };
    let model_span = model.map(|m| span_in(body, m.as_bytes()));
    Ok(RoutingFields { model: model.map(str::to_string), model_span, stream, choices: 1, max_tokens: None })
}

/// A model name may become a metric label, a log field and a header: at most
/// [`MAX_MODEL_NAME_BYTES`] bytes and no control characters.
fn check_model_name(m: &str) -> Result<(), ProxyError> {
    if m.len() > MAX_MODEL_NAME_BYTES {
        return Err(ProxyError::BadRequest(format!(
            "model names are at most {MAX_MODEL_NAME_BYTES} bytes, got one of {}",
            m.len()
        )));
    }
    // An ASCII name (the usual one) is checked byte by byte: C0 and DEL.
    let control = if m.is_ascii() { m.bytes().any(|c| c < 0x20 || c == 0x7F) } else { m.chars().any(char::is_control) };
    if control {
        return Err(ProxyError::BadRequest("model names hold no control characters".into()));
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
        let f = routing_fields(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
            &PromptLimits::NONE,
        )
        .unwrap();
        assert_eq!(
            f,
            RoutingFields {
                model: Some("m".into()),
                model_span: Some(9..12),
                stream: true,
                choices: 1,
                max_tokens: None
            }
        );
        assert_eq!(
            routing_fields(b" {}", &PromptLimits::NONE).unwrap(),
            RoutingFields { model: None, model_span: None, stream: false, choices: 1, max_tokens: None }
        );
        // The span is the value as written, escapes and all; a form field's is its bytes.
        let escaped = br#"{"stream":false, "model" : "a/b"}"#;
        let f = routing_fields(escaped, &PromptLimits::NONE).unwrap();
        assert_eq!((f.model.as_deref(), &escaped[f.model_span.unwrap()]), (Some("a/b"), &br#""a/b""#[..]));
        let form = b"--B\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--B--\r\n";
        let f = form_routing_fields(form, "B").unwrap();
        assert_eq!(&form[f.model_span.unwrap()], b"whisper");
        assert_eq!(routing_fields(br#"{"max_tokens":7}"#, &PromptLimits::NONE).unwrap().max_tokens, Some(7));
        assert_eq!(routing_fields(br#"{"max_completion_tokens":9}"#, &PromptLimits::NONE).unwrap().max_tokens, Some(9));
        let both = br#"{"max_tokens":1,"max_completion_tokens":100000}"#;
        assert_eq!(
            routing_fields(both, &PromptLimits::NONE).unwrap().max_tokens,
            Some(100_000),
            "the engine's precedence"
        );
        assert_eq!(routing_fields(br#"{"max_tokens":-1}"#, &PromptLimits::NONE).unwrap().max_tokens, None);
        let max = |body: &[u8]| routing_fields(body, &PromptLimits::NONE).unwrap().max_tokens;
        // As pydantic reads them (vLLM), so the budget charges what the engine runs.
        assert_eq!(max(br#"{"max_tokens":1e99}"#), Some(u64::MAX));
        assert_eq!(max(br#"{"max_completion_tokens":"100000"}"#), Some(100_000));
        assert_eq!(max(br#"{"max_completion_tokens":1e5}"#), Some(100_000));
        assert_eq!(max(br#"{"max_tokens":100000.0}"#), Some(100_000));
        assert_eq!(max(br#"{"max_tokens":" 7 "}"#), Some(7));
        for bad in [
            &br#"{"max_tokens":1.5}"#[..],
            br#"{"max_tokens":"NaN"}"#,
            br#"{"max_tokens":"inf"}"#,
            br#"{"max_tokens":true}"#,
        ] {
            assert_eq!(max(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        let n = |body: &[u8]| routing_fields(body, &PromptLimits::NONE).unwrap().choices;
        assert_eq!((n(br#"{"n":16}"#), n(br#"{"n":"4"}"#), n(br#"{"n":0}"#), n(br#"{}"#)), (16, 4, 1, 1));
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
    fn prompts_over_the_item_limits_are_400_naming_the_field() {
        let limits = PromptLimits { max_messages: 2, max_prompt_items: 4 };
        let ok = [
            &br#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}"#[..],
            br#"{"prompt":[1,2,3,4]}"#,
            br#"{"prompt":[[1,2],[3,4]]}"#,
            br#"{"prompt":["a",[1,2],"b"]}"#,
            br#"{"prompt":"one long string counts once"}"#,
            br#"{"messages":[{"content":[1,2,3,4,5,6]}],"other":[1,2,3,4,5,6]}"#,
        ];
        for body in ok {
            assert!(routing_fields(body, &limits).is_ok(), "{}", String::from_utf8_lossy(body));
        }
        let e = routing_fields(br#"{"messages":[{},{},{}]}"#, &limits).unwrap_err();
        assert_eq!((e.status(), e.kind()), (400, "prompt_too_long"));
        assert!(e.body().contains(r#""param":"messages""#) && e.to_string().contains("at most 2, but got 3"), "{e}");
        for body in [
            &br#"{"prompt":[1,2,3,4,5]}"#[..],
            br#"{"prompt":[[1,2,3],[4,5]]}"#,
            br#"{"prompt":[[1],[2],[3],[4],[5]]}"#,
        ] {
            let e = routing_fields(body, &limits).unwrap_err();
            assert!(e.to_string().contains("Invalid 'prompt'") && e.to_string().contains("got 5"), "{e}");
        }
    }

    #[test]
    fn malformed_bodies_are_400_with_a_reason() {
        for (body, needle) in [
            (&b"[1]"[..], "JSON object"),
            (b"", "JSON object"),
            (b"{\"model\": ", "not valid JSON"),
            (b"{\"model\": 5}", "model must be a string"),
            (format!("{{\"model\": \"{}\"}}", "m".repeat(257)).leak().as_bytes(), "at most 256 bytes"),
            (b"{\"model\": \"m\", \"stream\": \"yes\"}", "stream must be a boolean"),
            (b"{\"prompt\": \"\xff\"}", "not valid JSON"),
            (b"{\"a\":1} trailing", "not valid JSON"),
        ] {
            let e = routing_fields(body, &PromptLimits::NONE).expect_err(&String::from_utf8_lossy(body));
            assert_eq!(e.status(), 400);
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    /// A random value for a request body's field: the shapes requests have and the ones
    /// they do not (wrong types, nesting, escapes, repeated keys).
    fn value(rng: &mut rand::rngs::StdRng, depth: u32) -> String {
        use rand::Rng;
        let leaf = [
            "null",
            "true",
            "false",
            "0",
            "-1",
            "7",
            "1.5",
            "1e400",
            "18446744073709551616",
            r#""m""#,
            r#""caf\u00e9 \"q\"""#,
            r#""\ud83d\ude00""#,
            r#""""#,
        ];
        match if depth > 3 { 0 } else { rng.random_range(0..6) } {
            0 | 1 => leaf[rng.random_range(0..leaf.len())].to_string(),
            2 | 3 => {
                let n = rng.random_range(0..5);
                let items: Vec<String> = (0..n).map(|_| value(rng, depth + 1)).collect();
                format!("[{}]", items.join(" , "))
            }
            _ => {
                let keys = ["role", "content", "text", "type", "model", "x"];
                let n = rng.random_range(0..4);
                let items: Vec<String> = (0..n)
                    .map(|_| format!(r#""{}":{}"#, keys[rng.random_range(0..keys.len())], value(rng, depth + 1)))
                    .collect();
                format!("{{{}}}", items.join(","))
            }
        }
    }

    #[test]
    fn the_one_pass_reader_agrees_with_the_derived_one_and_the_prompt_visitor() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(23);
        let keys = ["model", "stream", "max_tokens", "max_completion_tokens", "messages", "prompt", "n", "model"];
        let limits = [PromptLimits::NONE, PromptLimits { max_messages: 2, max_prompt_items: 3 }];
        let (mut ok, mut refused, mut one_pass) = (0, 0, 0);
        // Prompts the pass saw: none, a chat, a text.
        let mut seen = [0; 3];
        for case in 0..20_000 {
            let n = rng.random_range(0..5);
            let fields: Vec<String> = (0..n)
                .map(|_| format!(r#""{}": {}"#, keys[rng.random_range(0..keys.len())], value(&mut rng, 0)))
                .collect();
            let mut body = format!("{{{}}}", fields.join(","));
            match case % 10 {
                0 => body.truncate(rng.random_range(0..=body.len())),
                1 => body.push_str(" x"),
                _ => {}
            }
            let body = body.as_bytes();
            one_pass += usize::from(json_text(body).is_ok_and(|t| prompt::parse(t, prompt::NoText).is_ok()));
            for limits in &limits {
                let one = routing_fields(body, limits).map_err(|e| e.to_string());
                let reference =
                    json_text(body).and_then(|t| derived::routing_fields(t, limits)).map_err(|e| e.to_string());
                assert_eq!(one, reference, "{}", String::from_utf8_lossy(body));
                let both = routing_fields_and_blocks(body, limits, 5, true).map_err(|e| e.to_string());
                match both {
                    Ok((fields, pass)) => {
                        ok += 1;
                        assert_eq!(Ok(fields), one);
                        assert_eq!(pass.blocks, canonical_prompt_blocks(body, 5), "{}", String::from_utf8_lossy(body));
                        // What the pass saw of the prompt is what the engine's reader gives.
                        if let SeenPrompt::Known(input) = pass.seen {
                            seen[match input {
                                None => 0,
                                Some(tokens::PromptInput::Chat(_)) => 1,
                                Some(_) => 2,
                            }] += 1;
                            assert_eq!(input, tokens::prompt_input(body), "{}", String::from_utf8_lossy(body));
                        }
                    }
                    Err(e) => {
                        refused += 1;
                        assert_eq!(Err(e), one);
                    }
                }
            }
        }
        // Both answers, and mostly the one pass rather than the derived reader behind it.
        assert!(ok > 5_000 && refused > 5_000, "{ok} accepted, {refused} refused");
        assert!(one_pass > 8_000, "the one pass read {one_pass} bodies");
        eprintln!(
            "{ok} accepted, {refused} refused; the one pass read {one_pass} of 20000 bodies, saw {seen:?} prompts"
        );
    }

    /// A random request body built around a prompt: `messages` of message-like objects
    /// (the shapes requests send and the ones the engines refuse: a missing, repeated or
    /// null role, content as parts, numbers, objects) and `prompt`s of every kind.
    fn prompt_body(rng: &mut rand::rngs::StdRng) -> String {
        use rand::Rng;
        let strings = [r#""user""#, r#""system""#, r#""hi "there"""#, r#""café""#, r#""""#];
        let mut pick = |rng: &mut rand::rngs::StdRng| -> String {
            match rng.random_range(0..10) {
                0..=5 => strings[rng.random_range(0..strings.len())].to_string(),
                6 => "null".into(),
                7 => r#"[{"type":"text","text":"a"},{"type":"text","text":"b"}]"#.into(),
                8 => value(rng, 2),
                _ => "7".into(),
            }
        };
        let message = |rng: &mut rand::rngs::StdRng, pick: &mut dyn FnMut(&mut rand::rngs::StdRng) -> String| {
            match rng.random_range(0..20) {
                0 => return value(rng, 2),
                1..=8 => {
                    let (role, content) = (strings[rng.random_range(0..2)], pick(rng));
                    return format!(r#"{{"content":{content},"name":"x","role":{role}}}"#);
                }
                _ => {}
            }
            let keys = ["role", "content", "role", "content", "name", "role"];
            let n = rng.random_range(1..4);
            let fields: Vec<String> =
                (0..n).map(|_| format!(r#""{}":{}"#, keys[rng.random_range(0..keys.len())], pick(rng))).collect();
            format!("{{{}}}", fields.join(","))
        };
        let mut fields = vec![r#""model":"m""#.to_string()];
        if rng.random_range(0..3) > 0 {
            let messages = match rng.random_range(0..12) {
                0 => "null".into(),
                1 => value(rng, 1),
                _ => {
                    let n = rng.random_range(0..4);
                    let items: Vec<String> = (0..n).map(|_| message(rng, &mut pick)).collect();
                    format!("[{}]", items.join(","))
                }
            };
            fields.push(format!(r#""messages":{messages}"#));
        }
        if rng.random_range(0..2) > 0 {
            let prompt = match rng.random_range(0..6) {
                0..=2 => pick(rng),
                3 => "[1,2,3]".into(),
                _ => value(rng, 1),
            };
            fields.push(format!(r#""prompt":{prompt}"#));
        }
        let n = fields.len();
        fields.swap(rng.random_range(0..n), rng.random_range(0..n));
        format!("{{{}}}", fields.join(","))
    }

    #[test]
    fn the_pass_sees_the_prompt_the_engine_reads() {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        // Bodies the pass read: its prompt none, a chat, a text; left to `prompt_input`.
        let (mut seen, mut unknown) = ([0; 3], 0);
        for _ in 0..20_000 {
            let body = prompt_body(&mut rng);
            let body = body.as_bytes();
            let Ok((_, pass)) = routing_fields_and_blocks(body, &PromptLimits::NONE, 5, true) else { continue };
            match pass.seen {
                SeenPrompt::Known(input) => {
                    seen[match &input {
                        None => 0,
                        Some(tokens::PromptInput::Chat(_)) => 1,
                        Some(_) => 2,
                    }] += 1;
                    assert_eq!(input, tokens::prompt_input(body), "{}", String::from_utf8_lossy(body));
                }
                SeenPrompt::Unknown => unknown += 1,
            }
            // Not asked: not seen.
            let (_, pass) = routing_fields_and_blocks(body, &PromptLimits::NONE, 5, false).unwrap();
            assert_eq!(pass.seen, SeenPrompt::Unknown);
        }
        assert!(
            seen.iter().all(|&n| n > 1_000) && unknown > 1_000,
            "seen (none, chat, text) {seen:?}, unknown {unknown}"
        );
    }

    #[test]
    fn model_names_with_control_characters_are_refused_as_char_is_control_says() {
        for c in ['\0', '\n', '\x1f', '\x7f', '\u{80}', '\u{85}', '\u{9f}'] {
            assert!(c.is_control());
            assert!(check_model_name(&format!("m{c}x")).is_err(), "{c:?}");
        }
        for c in [' ', '~', '\u{a0}', '\u{c2}', '\u{100}', '\u{2028}', '\u{1f600}', '\u{e000}'] {
            assert_eq!(check_model_name(&format!("m{c}x")).is_err(), c.is_control(), "{c:?}");
        }
        // Every character agrees with `char::is_control`.
        for c in (0..0x3000).filter_map(char::from_u32) {
            assert_eq!(check_model_name(&format!("a{c}")).is_err(), c.is_control(), "{c:?}");
        }
    }

    #[test]
    fn a_model_string_reads_as_serde_json_reads_it() {
        for raw in
            [r#""m""#, r#""""#, r#""caf\u00e9""#, r#""a\"b""#, r#""a\\""#, r#""é ü""#, "5", "null", "[]", r#"{"a":1}"#]
        {
            assert_eq!(json_string(raw), serde_json::from_str::<String>(raw).ok(), "{raw}");
        }
    }
}
