//! The prompt a request gives its engine, as the engine reads it — for precise prefix
//! routing, which tokenizes it exactly as the engine does ([`prompt_token_ids`]).
//!
//! What an engine tokenizes: a chat's `messages` rendered with the model's chat template
//! (each message's content flattened: a string, or its `text` parts concatenated), or a
//! completion's single `prompt` (a string, tokenized without special tokens, or token ids
//! as given). Anything else — a batch of prompts, a content part that is not text, a body
//! the engine will reject — has no single token sequence: `None`, and the request is routed
//! by the approximate index.
//!
//! Read with serde's derive over small types: unknown fields are skipped without building a
//! tree, so a body costs about its own text here, plus 4 bytes per token. The routing pass
//! over the body (`request::prompt::parse_seeing`) reads the common shapes already
//! ([`SeenPrompt`]); this second read is for the others.

use std::fmt;

use serde::de::{Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use switchyard_tokenizer::{ChatMessage, ModelTokenizer, PieceCache, TokenId};

/// A request's prompt, before tokenization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// A conversation, content flattened to text.
    Chat(Vec<ChatMessage>),
    /// A completion's text prompt.
    Text(String),
    /// A completion's prompt given as token ids.
    Ids(Vec<TokenId>),
}

/// What the routing pass over a body saw of its prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeenPrompt {
    /// What [`prompt_input`] gives for the body.
    Known(Option<PromptInput>),
    /// A shape the routing pass leaves to [`prompt_input`].
    Unknown,
}

/// The prompt of `body`, when it has exactly one (see the module documentation).
pub fn prompt_input(body: &[u8]) -> Option<PromptInput> {
    let b: Body = serde_json::from_slice(body).ok()?;
    match (b.messages, b.prompt) {
        (Some(messages), _) => {
            let messages: Option<Vec<ChatMessage>> =
                messages.into_iter().map(|m| Some(ChatMessage { role: m.role, content: m.content.0? })).collect();
            messages.filter(|m| !m.is_empty()).map(PromptInput::Chat)
        }
        (None, Some(Prompt::Text(t))) => Some(PromptInput::Text(t)),
        (None, Some(Prompt::Ids(ids))) => Some(PromptInput::Ids(ids)),
        (None, Some(Prompt::Other) | None) => None,
    }
}

/// The token ids the engine prefills for `body`, rendered and tokenized with `tokenizer`
/// (`None` as for [`prompt_input`], or when the chat template rejects the conversation);
/// pieces seen before (a shared system prompt, earlier turns) come from `cache`. `seen`:
/// what the routing pass read of the prompt (`body` is read again only when that is
/// [`SeenPrompt::Unknown`]).
pub fn prompt_token_ids(
    body: &[u8],
    seen: SeenPrompt,
    tokenizer: &ModelTokenizer,
    cache: &PieceCache,
) -> Option<Vec<TokenId>> {
    let input = match seen {
        SeenPrompt::Known(input) => input,
        SeenPrompt::Unknown => prompt_input(body),
    };
    match input? {
        PromptInput::Chat(messages) => Some(tokenizer.encode_cached(&tokenizer.render(&messages).ok()?, cache)),
        PromptInput::Text(text) => Some(tokenizer.encode_cached(&text, cache)),
        PromptInput::Ids(ids) => Some(ids),
    }
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    prompt: Option<Prompt>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    /// Absent or null: empty (an assistant turn with tool calls only).
    #[serde(default)]
    content: MessageContent,
}

/// A message's content flattened (`None`: a part that is not text).
struct MessageContent(Option<String>);

impl Default for MessageContent {
    fn default() -> Self {
        MessageContent(Some(String::new()))
    }
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MessageContent;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E>(self, v: &str) -> Result<MessageContent, E> {
                Ok(MessageContent(Some(v.to_owned())))
            }
            fn visit_unit<E>(self) -> Result<MessageContent, E> {
                Ok(MessageContent(Some(String::new())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MessageContent, A::Error> {
                let mut text = Some(String::new());
                while let Some(part) = seq.next_element::<Part>()? {
                    match (part.kind.as_deref(), part.text, text.as_mut()) {
                        (Some("text"), Some(t), Some(out)) => out.push_str(&t),
                        _ => text = None,
                    }
                }
                Ok(MessageContent(text))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: Option<String>,
    text: Option<String>,
}

/// `prompt`: one string, one array of token ids, or something else (a batch).
enum Prompt {
    Text(String),
    Ids(Vec<TokenId>),
    Other,
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a prompt")
            }
            fn visit_str<E>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(v.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                // Token ids; anything else (a string: a batch of prompts) makes it `Other`,
                // and the rest is skipped.
                while let Some(item) = seq.next_element::<IdOrNot>()? {
                    match item {
                        IdOrNot::Id(id) => ids.push(id),
                        IdOrNot::Not => {
                            while seq.next_element::<IgnoredAny>()?.is_some() {}
                            return Ok(Prompt::Other);
                        }
                    }
                }
                Ok(if ids.is_empty() { Prompt::Other } else { Prompt::Ids(ids) })
            }
            fn visit_unit<E>(self) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Prompt, E> {
                Ok(Prompt::Other)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Prompt, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Prompt::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// One item of a prompt array: a token id (an integer that fits a `u32`) or not.
enum IdOrNot {
    Id(TokenId),
    Not,
}

impl<'de> Deserialize<'de> for IdOrNot {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IdOrNot;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id")
            }
            fn visit_u64<E>(self, v: u64) -> Result<IdOrNot, E> {
                Ok(TokenId::try_from(v).map_or(IdOrNot::Not, IdOrNot::Id))
            }
            fn visit_i64<E>(self, v: i64) -> Result<IdOrNot, E> {
                Ok(TokenId::try_from(v).map_or(IdOrNot::Not, IdOrNot::Id))
            }
            fn visit_f64<E>(self, _: f64) -> Result<IdOrNot, E> {
                Ok(IdOrNot::Not)
            }
            fn visit_str<E>(self, _: &str) -> Result<IdOrNot, E> {
                Ok(IdOrNot::Not)
            }
            fn visit_bool<E>(self, _: bool) -> Result<IdOrNot, E> {
                Ok(IdOrNot::Not)
            }
            fn visit_unit<E>(self) -> Result<IdOrNot, E> {
                Ok(IdOrNot::Not)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<IdOrNot, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(IdOrNot::Not)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<IdOrNot, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(IdOrNot::Not)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(pairs: &[(&str, &str)]) -> PromptInput {
        PromptInput::Chat(
            pairs.iter().map(|(r, c)| ChatMessage { role: r.to_string(), content: c.to_string() }).collect(),
        )
    }

    #[test]
    fn chats_flatten_their_text_parts_as_the_engine_does() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"be brief"},
            {"content":[{"type":"text","text":"hello "},{"type":"text","text":"world"}],"role":"user","name":"x"},
            {"role":"assistant","content":null},{"role":"tool"}],"stream":true}"#;
        assert_eq!(
            prompt_input(body),
            Some(chat(&[("system", "be brief"), ("user", "hello world"), ("assistant", ""), ("tool", "")]))
        );
    }

    #[test]
    fn completions_give_their_text_or_ids() {
        assert_eq!(prompt_input(br#"{"prompt":"once upon"}"#), Some(PromptInput::Text("once upon".into())));
        assert_eq!(prompt_input(br#"{"prompt":[1,2,3],"max_tokens":4}"#), Some(PromptInput::Ids(vec![1, 2, 3])));
    }

    #[test]
    fn what_has_no_single_token_sequence_is_none() {
        for body in [
            &br#"{"prompt":["a","b"]}"#[..],
            br#"{"prompt":[[1,2],[3]]}"#,
            br#"{"prompt":[1,-2]}"#,
            br#"{"prompt":[1,4294967296]}"#,
            br#"{"prompt":[]}"#,
            br#"{"prompt":null}"#,
            br#"{"messages":[]}"#,
            br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
            br#"{"messages":[{"content":"no role"}]}"#,
            br#"{"messages":"text"}"#,
            br#"{"prompt":"a","prompt":"b"}"#,
            b"[1,2]",
            b"{not json",
            b"",
        ] {
            assert_eq!(prompt_input(body), None, "{}", String::from_utf8_lossy(body));
        }
    }
}
