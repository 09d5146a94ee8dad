//! Tool calling: `tools` and `tool_choice` checked, turned into a grammar when a call is
//! forced, and the model's output turned back into `tool_calls`.
//!
//! | `tool_choice` | prompt | output |
//! |---|---|---|
//! | `none` | tools rendered when the template can | plain text |
//! | `auto` (default with tools) | tools rendered by the template (400 without one that reads `tools`) | Hermes `<tool_call>{"name", "arguments"}</tool_call>` blocks parsed into calls, the rest is content |
//! | `required` | as `auto` when the template can | constrained to one `{"name", "arguments"}` object of one of the tools |
//! | `{"type": "function", "function": {"name"}}` | as `auto` when the template can | constrained to that function's `parameters`: the output is its arguments |
//!
//! A forced call works with any model — the grammar writes it; the model sees the tools
//! only through a template that renders them.

use serde_json::{json, Value};

use crate::error::ApiError;
use crate::structured::GuidedSpec;

/// What the request's `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolMode {
    /// No call.
    None,
    /// The model decides; calls are parsed from its text.
    Auto,
    /// One call to one of the tools, forced by a grammar.
    Required,
    /// One call to this function, forced by a grammar.
    Named(String),
}

/// A request's tools.
#[derive(Debug, Clone)]
pub struct Tools {
    /// OpenAI's `tools` list as given (what the template renders).
    pub list: Value,
    /// `(name, parameters schema)` of every function.
    pub functions: Vec<(String, Value)>,
    /// `tool_choice`.
    pub mode: ToolMode,
}

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// Function name.
    pub name: String,
    /// Arguments as JSON text.
    pub arguments: String,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Check `tools` and `tool_choice` (`None` when the request has no tools).
pub fn parse(tools: Option<&Value>, choice: Option<&Value>) -> Result<Option<Tools>, ApiError> {
    let tools = tools.filter(|v| !v.is_null());
    let choice = choice.filter(|v| !v.is_null());
    let Some(list) = tools else {
        return match choice {
            None => Ok(None),
            Some(Value::String(s)) if s == "none" => Ok(None),
            Some(_) => Err(ApiError::invalid("tool_choice", "tool_choice needs tools")),
        };
    };
    let items = list.as_array().ok_or_else(|| ApiError::invalid("tools", "tools must be a list"))?;
    let mut functions = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let field = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(format!("{field}.type"), format!("{field}.type must be \"function\"")));
        }
        let f = t.get("function").ok_or_else(|| ApiError::invalid(&field, format!("{field}.function is required")))?;
        let name = f.get("name").and_then(Value::as_str).filter(|n| valid_name(n)).ok_or_else(|| {
            ApiError::invalid(
                format!("{field}.function.name"),
                format!("{field}.function.name must be 1-64 letters, digits, _ or -"),
            )
        })?;
        if functions.iter().any(|(n, _)| n == name) {
            return Err(ApiError::invalid(
                format!("{field}.function.name"),
                format!("{field}.function.name: {name} is defined twice"),
            ));
        }
        let params = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{field}.function.parameters"),
                    format!("{field}.function.parameters must be a JSON Schema object"),
                ))
            }
        };
        functions.push((name.to_string(), params));
    }
    if functions.is_empty() {
        return Err(ApiError::invalid("tools", "tools must not be empty"));
    }
    let mode = match choice {
        None => ToolMode::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolMode::None,
            "auto" => ToolMode::Auto,
            "required" => ToolMode::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice must be none, auto, required or a function, got {other:?}"),
                ))
            }
        },
        Some(obj) => {
            let name = obj.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(
                    "tool_choice",
                    "tool_choice must be {\"type\": \"function\", \"function\": {\"name\"}}",
                )
            })?;
            if !functions.iter().any(|(n, _)| n == name) {
                return Err(ApiError::invalid(
                    "tool_choice.function.name",
                    format!("tool_choice names {name:?}, which is not among the tools"),
                ));
            }
            ToolMode::Named(name.to_string())
        }
    };
    Ok(Some(Tools { list: list.clone(), functions, mode }))
}

impl Tools {
    /// The grammar that forces a call (`required`, a named function), if any.
    pub fn guided(&self) -> Option<GuidedSpec> {
        match &self.mode {
            ToolMode::None | ToolMode::Auto => None,
            ToolMode::Named(name) => {
                let params = self.functions.iter().find(|(n, _)| n == name).map(|(_, p)| p.clone());
                Some(GuidedSpec::JsonSchema(params.unwrap_or_else(|| json!({"type": "object"}))))
            }
            ToolMode::Required => {
                let any: Vec<Value> = self
                    .functions
                    .iter()
                    .map(|(name, params)| {
                        json!({"type": "object", "additionalProperties": false, "required": ["name", "arguments"],
                               "properties": {"name": {"const": name}, "arguments": params}})
                    })
                    .collect();
                Some(GuidedSpec::JsonSchema(json!({"anyOf": any})))
            }
        }
    }

    /// Split a finished output into content and calls.
    pub fn extract(&self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        match &self.mode {
            ToolMode::None => (Some(text.to_string()), Vec::new()),
            ToolMode::Named(name) => (None, vec![ToolCall { name: name.clone(), arguments: text.to_string() }]),
            ToolMode::Required => match call_of(text) {
                Some(call) => (None, vec![call]),
                // `max_tokens` cut the call short: what there is stays content.
                None => (Some(text.to_string()), Vec::new()),
            },
            ToolMode::Auto => {
                let (content, calls) = parse_hermes(text);
                ((!content.is_empty() || calls.is_empty()).then_some(content), calls)
            }
        }
    }
}

/// `{"name": ..., "arguments": {...} | "..."}` as a call.
fn call_of(text: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
        None => "{}".into(),
    };
    Some(ToolCall { name, arguments })
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Hermes-style calls: every `<tool_call>{json}</tool_call>` block that parses becomes a
/// call; the text around them (trimmed) is the content. A block that does not parse stays
/// in the content as written.
pub fn parse_hermes(text: &str) -> (String, Vec<ToolCall>) {
    let (mut content, mut calls) = (String::new(), Vec::new());
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        content.push_str(&rest[..start]);
        let body = &rest[start + OPEN.len()..];
        let (inner, after) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        match call_of(inner) {
            Some(call) => calls.push(call),
            None => content.push_str(&rest[start..rest.len() - after.len()]),
        }
        rest = after;
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

/// Streaming side of [`parse_hermes`]: content passes through as it comes, except what may
/// begin a `<tool_call>` tag; from a tag on, everything is held for [`Self::finish`].
#[derive(Debug, Default)]
pub struct HermesStream {
    held: String,
    in_call: bool,
}

impl HermesStream {
    /// Text that can be sent as content now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        if let Some(i) = self.held.find(OPEN) {
            self.in_call = true;
            let out = self.held[..i].to_string();
            self.held.drain(..i);
            return out;
        }
        // Keep the longest end of the text that could start the tag.
        let keep = (1..OPEN.len().min(self.held.len() + 1))
            .rev()
            .find(|&k| {
                self.held.is_char_boundary(self.held.len() - k) && OPEN.starts_with(&self.held[self.held.len() - k..])
            })
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    /// The rest: content still held and the calls.
    pub fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        if !self.in_call {
            return (held, Vec::new());
        }
        parse_hermes(&held)
    }
}

/// A call id, unique per call (`chatcmpl-tool-` + 128 random bits, vLLM's form).
pub fn call_id() -> String {
    format!("chatcmpl-tool-{:032x}", rand::random::<u128>())
}

/// The `tool_calls` entries of a whole message.
pub fn calls_json(calls: &[ToolCall]) -> Value {
    calls
        .iter()
        .map(|c| json!({"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
               {"type": "function", "function": {"name": "now"}}])
    }

    #[test]
    fn tool_choice_forms_and_their_errors() {
        let t = tools();
        assert_eq!(parse(Some(&t), None).unwrap().unwrap().mode, ToolMode::Auto);
        assert_eq!(parse(Some(&t), Some(&json!("required"))).unwrap().unwrap().mode, ToolMode::Required);
        let named = json!({"type": "function", "function": {"name": "now"}});
        assert_eq!(parse(Some(&t), Some(&named)).unwrap().unwrap().mode, ToolMode::Named("now".into()));
        let err = |tools: Option<&Value>, choice: Option<&Value>| match parse(tools, choice) {
            Err(ApiError::InvalidRequest { param, .. }) => param.unwrap(),
            other => panic!("{other:?}"),
        };
        let unknown = json!({"type": "function", "function": {"name": "fly"}});
        assert_eq!(err(Some(&t), Some(&unknown)), "tool_choice.function.name");
        assert_eq!(err(Some(&t), Some(&json!("sometimes"))), "tool_choice");
        assert_eq!(err(None, Some(&json!("required"))), "tool_choice");
        assert_eq!(err(Some(&json!([{"type": "web"}])), None), "tools[0].type");
        assert_eq!(
            err(Some(&json!([{"type": "function", "function": {"name": "a b"}}])), None),
            "tools[0].function.name"
        );
        assert!(parse(None, Some(&json!("none"))).unwrap().is_none());
    }

    #[test]
    fn forced_calls_get_a_grammar_and_come_back_as_calls() {
        let t = parse(Some(&tools()), Some(&json!("required"))).unwrap().unwrap();
        assert!(matches!(t.guided(), Some(GuidedSpec::JsonSchema(s)) if s["anyOf"].as_array().unwrap().len() == 2));
        let (content, calls) = t.extract(r#"{"name":"get_weather","arguments":{"city":"Oslo"}}"#);
        assert_eq!(content, None);
        assert_eq!(calls, vec![ToolCall { name: "get_weather".into(), arguments: r#"{"city":"Oslo"}"#.into() }]);
        let named = parse(Some(&tools()), Some(&json!({"type": "function", "function": {"name": "get_weather"}})));
        let named = named.unwrap().unwrap();
        assert_eq!(named.extract(r#"{"city":"Rome"}"#).1[0].arguments, r#"{"city":"Rome"}"#);
    }

    #[test]
    fn hermes_blocks_are_calls_and_the_rest_is_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>{\"name\":\"now\",\"arguments\":{}}</tool_call>";
        let (content, calls) = parse_hermes(text);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, r#"{"city":"Oslo"}"#);
        let (content, calls) = parse_hermes("<tool_call>not json</tool_call> ok");
        assert!(calls.is_empty());
        assert_eq!(content, "<tool_call>not json</tool_call> ok");
        // Streamed in any split, the same content and calls.
        for split in 1..text.len() {
            if !text.is_char_boundary(split) {
                continue;
            }
            let mut s = HermesStream::default();
            let mut sent = s.push(&text[..split]);
            sent.push_str(&s.push(&text[split..]));
            let (rest, calls) = s.finish();
            assert_eq!(sent.trim(), "Let me check.", "split {split}");
            assert_eq!((rest.as_str(), calls.len()), ("", 2), "split {split}");
        }
        let mut s = HermesStream::default();
        assert_eq!(s.push("a <"), "a ");
        assert_eq!(s.push("b"), "<b");
        assert_eq!(s.finish(), (String::new(), vec![]));
    }
}
