//! The canonical prompt that prefix routing hashes, read from the body by a streaming
//! visitor: the text is written as the parser walks the JSON, with no document tree.
//!
//! A tree (`serde_json::Value`) costs ~32 bytes per array item, so `{"prompt":[1,1,1,…]}`
//! — two body bytes per token id — grew ~16× in memory and a few 16 MiB bodies could take a
//! pod down. Here a body costs its text: at most about its own size (plus one message's
//! content held while that message's `role` may still follow).
//!
//! What the text is: a completion's `prompt` (an array of prompts joined by newlines, token
//! ids written as numbers separated by spaces), or a chat's whole conversation, every
//! message in order as `<|role|>\n{content}\n` (content parts of type text concatenated).
//! Two requests share a prefix of this text exactly when they share the corresponding
//! prefix of conversation, which is what an engine's prefix cache rewards. Empty when the
//! body has neither, or when its shape is not a request's (the engine will reject it).
//! A key given twice counts once, its last value, as the engines' JSON parsers read it.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use switchyard_tokenizer::ChatMessage;

use super::tokens::{PromptInput, SeenPrompt};

/// The canonical prompt of `body` (see the module docs). The request path needs only its
/// block hashes ([`canonical_prompt_blocks`]); the text is for tests and the fuzz target.
#[cfg(any(test, feature = "fuzzing"))]
pub fn canonical_prompt(body: &[u8]) -> String {
    render(body, String::new())
}

/// The chained block hashes of `body`'s canonical prompt (what
/// [`block_hashes`](crate::policy::prefix_index::block_hashes) gives for
/// [`canonical_prompt`]) and the text's length, without keeping the text: the gateway holds a
/// body, not a body and a copy of its prompt.
pub fn canonical_prompt_blocks(body: &[u8], block_bytes: usize) -> (Vec<u64>, usize) {
    let hasher = render(body, BlockHasher::new(block_bytes, 0));
    (hasher.hashes, hasher.len)
}

fn render<S: PromptSink>(body: &[u8], proto: S) -> S {
    let mut de = serde_json::Deserializer::from_slice(body);
    let empty = proto.fresh(0);
    (Request { capacity: body.len(), proto, strict: false, see: false })
        .deserialize(&mut de)
        .and_then(|parsed| de.end().map(|()| parsed.prompt))
        .unwrap_or(empty)
}

/// What one pass over a request body reads: the raw values of the fields routing reads,
/// the prompt's sizes, and the canonical prompt rendered into a [`PromptSink`].
pub struct Parsed<'de, S> {
    /// `model`, `stream`, `max_tokens`, `max_completion_tokens` as they stand in the body
    /// (`None` when absent or `null`).
    pub model: Option<&'de RawValue>,
    pub stream: Option<&'de RawValue>,
    pub max_tokens: Option<&'de RawValue>,
    pub max_completion_tokens: Option<&'de RawValue>,
    /// `n`, the choices asked for.
    pub n: Option<&'de RawValue>,
    /// The entries of `messages` when it is given (0 when it is not an array).
    pub messages: Option<usize>,
    /// The items of `prompt` when it is given: its entries, an array entry counted by its
    /// own entries (`[[1,2],[3]]`: 3); 1 when it is not an array.
    pub prompt_items: Option<usize>,
    /// The canonical prompt; empty when the body's shape is not a request's.
    pub prompt: S,
    /// The prompt as the engine reads it, when asked for ([`parse_seeing`]) and the body has
    /// one of the common shapes; else [`SeenPrompt::Unknown`].
    pub seen: SeenPrompt,
}

/// Read `text`, a whole request body, in one pass: routing's fields, the prompt's sizes and
/// its canonical text into a sink like `proto` ([`NoText`] when only the fields matter).
/// Like a derived `Deserialize`, a field routing reads may not be given twice.
///
/// # Errors
/// `text` is not one JSON object, or it repeats one of routing's fields.
pub fn parse<S: PromptSink>(text: &str, proto: S) -> Result<Parsed<'_, S>, serde_json::Error> {
    read(text, proto, false)
}

/// [`parse`], also keeping the prompt as the engine reads it (what
/// [`prompt_input`](super::tokens::prompt_input) gives) when the body has one of the common
/// shapes: a `prompt` string, or `messages` of objects with one string `role` and a string,
/// null or absent `content`, or neither. Any other shape is [`SeenPrompt::Unknown`] (left to
/// `prompt_input`, which reads the body again).
///
/// # Errors
/// As [`parse`].
pub fn parse_seeing<S: PromptSink>(text: &str, proto: S) -> Result<Parsed<'_, S>, serde_json::Error> {
    read(text, proto, true)
}

fn read<S: PromptSink>(text: &str, proto: S, see: bool) -> Result<Parsed<'_, S>, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = (Request { capacity: text.len(), proto, strict: true, see }).deserialize(&mut de)?;
    de.end()?;
    Ok(parsed)
}

/// A sink that keeps nothing: for reading a body's fields and sizes without its prompt.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoText;

impl fmt::Write for NoText {
    fn write_str(&mut self, _: &str) -> fmt::Result {
        Ok(())
    }
}

impl PromptSink for NoText {
    fn fresh(&self, _: usize) -> Self {
        NoText
    }
}

/// Where the visitor writes the canonical text: a `String`, or a [`BlockHasher`].
pub trait PromptSink: fmt::Write {
    /// An empty sink like this one, for about `capacity` bytes of text (a `prompt` and a
    /// `messages` are rendered apart: the latter wins, whichever comes first).
    fn fresh(&self, capacity: usize) -> Self;

    /// Append `s`.
    fn put(&mut self, s: &str) {
        let _ = self.write_str(s);
    }
}

impl PromptSink for String {
    fn fresh(&self, capacity: usize) -> Self {
        String::with_capacity(capacity)
    }
}

/// Hashes text block by block as it is written: chained 64-bit hashes of each full
/// `block_bytes`-sized block, as [`block_hashes`](crate::policy::prefix_index::block_hashes)
/// computes them over the whole text, keeping one partial block.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_bytes: usize,
    partial: Vec<u8>,
    parent: u64,
    /// The hashes of the full blocks so far.
    pub hashes: Vec<u64>,
    /// Bytes written.
    pub len: usize,
}

impl BlockHasher {
    /// A hasher of `block_bytes`-sized blocks, with room for about `capacity` bytes of text.
    pub fn new(block_bytes: usize, capacity: usize) -> Self {
        assert!(block_bytes > 0, "block_bytes must be > 0");
        BlockHasher {
            block_bytes,
            partial: Vec::with_capacity(block_bytes),
            parent: crate::policy::prefix_index::BLOCK_HASH_SEED,
            hashes: Vec::with_capacity(capacity / block_bytes),
            len: 0,
        }
    }
}

impl fmt::Write for BlockHasher {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.len += s.len();
        let mut rest = s.as_bytes();
        while !rest.is_empty() {
            let take = (self.block_bytes - self.partial.len()).min(rest.len());
            self.partial.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.partial.len() == self.block_bytes {
                self.parent = xxhash_rust::xxh3::xxh3_64_with_seed(&self.partial, self.parent);
                self.hashes.push(self.parent);
                self.partial.clear();
            }
        }
        Ok(())
    }
}

impl PromptSink for BlockHasher {
    fn fresh(&self, capacity: usize) -> Self {
        BlockHasher::new(self.block_bytes, capacity)
    }
}

/// The fields of a request object that make up the prompt.
enum Field {
    Model,
    Stream,
    MaxTokens,
    MaxCompletionTokens,
    N,
    Messages,
    Prompt,
    Role,
    Content,
    Text,
    Other,
}

impl Field {
    /// The name of a top-level field routing reads (one that may not repeat) and its bit.
    fn routing(&self) -> Option<(&'static str, u8)> {
        Some(match self {
            Field::Model => ("model", 1),
            Field::Stream => ("stream", 2),
            Field::MaxTokens => ("max_tokens", 4),
            Field::MaxCompletionTokens => ("max_completion_tokens", 8),
            Field::Messages => ("messages", 16),
            Field::Prompt => ("prompt", 32),
            Field::N => ("n", 64),
            _ => return None,
        })
    }
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names;
        impl Visitor<'_> for Names {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E>(self, v: &str) -> Result<Field, E> {
                Ok(match v {
                    "model" => Field::Model,
                    "stream" => Field::Stream,
                    "max_tokens" => Field::MaxTokens,
                    "max_completion_tokens" => Field::MaxCompletionTokens,
                    "messages" => Field::Messages,
                    "prompt" => Field::Prompt,
                    "n" => Field::N,
                    "role" => Field::Role,
                    "content" => Field::Content,
                    "text" => Field::Text,
                    _ => Field::Other,
                })
            }
        }
        d.deserialize_identifier(Names)
    }
}

/// The top-level object: renders `messages` if present (and not null), else `prompt`,
/// and keeps what routing reads. `capacity`: the body's length, about the most text it
/// renders (one allocation, no copies while the text grows); `proto`: the kind of sink to
/// render into; `strict`: a routing field given twice is an error (else the last counts);
/// `see`: keep the prompt as the engine reads it ([`parse_seeing`]).
struct Request<S> {
    capacity: usize,
    proto: S,
    strict: bool,
    see: bool,
}

impl<'de, S: PromptSink> DeserializeSeed<'de> for Request<S> {
    type Value = Parsed<'de, S>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, S: PromptSink> Visitor<'de> for Request<S> {
    type Value = Parsed<'de, S>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a request object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut p = Parsed {
            model: None,
            stream: None,
            max_tokens: None,
            max_completion_tokens: None,
            n: None,
            messages: None,
            prompt_items: None,
            prompt: self.proto.fresh(0),
            seen: SeenPrompt::Unknown,
        };
        let (mut messages, mut prompt) = (None, None);
        // What the engine reads (when `see`): `None` when absent or null; `Some(None)` when
        // given in a shape left to `prompt_input`.
        let (mut chat, mut prompt_text): (Option<Option<Vec<ChatMessage>>>, Option<Option<String>>) = (None, None);
        // A shape that is not a request's (a message that is not an object…): no text.
        let mut bad = false;
        let mut seen = 0u8;
        while let Some(key) = map.next_key::<Field>()? {
            if let Some((name, bit)) = key.routing() {
                if self.strict && seen & bit != 0 {
                    return Err(serde::de::Error::duplicate_field(name));
                }
                seen |= bit;
            }
            match key {
                Field::Model => p.model = map.next_value()?,
                Field::Stream => p.stream = map.next_value()?,
                Field::MaxTokens => p.max_tokens = map.next_value()?,
                Field::MaxCompletionTokens => p.max_completion_tokens = map.next_value()?,
                Field::N => p.n = map.next_value()?,
                Field::Messages => {
                    let seed = Messages { capacity: self.capacity, proto: &self.proto, bad: &mut bad, see: self.see };
                    let seen;
                    (messages, p.messages, seen) = map.next_value_seed(seed)?;
                    chat = p.messages.map(|_| seen);
                }
                Field::Prompt => {
                    let mut out = self.proto.fresh(self.capacity);
                    let mut text = None;
                    p.prompt_items =
                        map.next_value_seed(Prompt { out: &mut out, text: self.see.then_some(&mut text) })?;
                    prompt = Some(out);
                    prompt_text = p.prompt_items.map(|_| text);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !bad {
            if let Some(text) = messages.or(prompt) {
                p.prompt = text;
            }
        }
        if self.see && !bad {
            // As `prompt_input`: `messages` when given (none when empty), else `prompt`.
            p.seen = match (chat, prompt_text) {
                (Some(Some(m)), _) => SeenPrompt::Known((!m.is_empty()).then_some(PromptInput::Chat(m))),
                (None, Some(Some(t))) => SeenPrompt::Known(Some(PromptInput::Text(t))),
                (None, None) => SeenPrompt::Known(None),
                (Some(None), _) | (None, Some(None)) => SeenPrompt::Unknown,
            };
        }
        Ok(p)
    }
}

/// A request's `prompt`: rendered as a [`Content`]; its items counted (`None` for null).
/// `text`, when given, gets the prompt when it is a string.
struct Prompt<'a, S> {
    out: &'a mut S,
    text: Option<&'a mut Option<String>>,
}

impl<'de, S: PromptSink> DeserializeSeed<'de> for Prompt<'_, S> {
    type Value = Option<usize>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, S: PromptSink> Visitor<'de> for Prompt<'_, S> {
    type Value = Option<usize>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a prompt")
    }
    fn visit_unit<E>(self) -> Result<Option<usize>, E> {
        Ok(None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<usize>, A::Error> {
        let mut items = 0usize;
        let mut first = true;
        while seq.next_element_seed(Item { out: &mut *self.out, first, weight: Some(&mut items) })?.is_some() {
            first = false;
        }
        Ok(Some(items))
    }
    fn visit_str<E>(self, v: &str) -> Result<Option<usize>, E> {
        self.out.put(v);
        if let Some(text) = self.text {
            *text = Some(v.to_owned());
        }
        Ok(Some(1))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<usize>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Some(1))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Option<usize>, E> {
        Ok(Some(1))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Option<usize>, E> {
        Ok(Some(1))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Option<usize>, E> {
        Ok(Some(1))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Option<usize>, E> {
        Ok(Some(1))
    }
}

/// `messages`: null (absent) or an array of message objects.
struct Messages<'p, S> {
    capacity: usize,
    proto: &'p S,
    /// Set when `messages` or one of its entries has a shape no request has.
    bad: &'p mut bool,
    /// Keep the conversation as the engine reads it.
    see: bool,
}

/// The rendered conversation (`None` for null), the number of entries (`None` for null, 0
/// for anything that is not an array) and, when asked for, the conversation as the engine
/// reads it (`None` when not asked for, or not one of the shapes [`parse_seeing`] reads).
type MessagesValue<S> = (Option<S>, Option<usize>, Option<Vec<ChatMessage>>);

impl<'de, S: PromptSink> DeserializeSeed<'de> for Messages<'_, S> {
    type Value = MessagesValue<S>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<S> Messages<'_, S> {
    /// Not an array of messages: no text, no entries.
    fn not_an_array(self) -> MessagesValue<S> {
        *self.bad = true;
        (None, Some(0), None)
    }
}

impl<'de, S: PromptSink> Visitor<'de> for Messages<'_, S> {
    type Value = MessagesValue<S>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of messages")
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok((None, None, None))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = self.proto.fresh(self.capacity);
        // One message's content, kept until its object ends (its role may come after it).
        let mut content = String::new();
        let mut entries = 0usize;
        let mut chat = self.see.then(Vec::new);
        while seq
            .next_element_seed(Message { out: &mut out, content: &mut content, bad: &mut *self.bad, chat: &mut chat })?
            .is_some()
        {
            entries += 1;
        }
        Ok((Some(out), Some(entries), chat))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(self.not_an_array())
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(self.not_an_array())
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(self.not_an_array())
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(self.not_an_array())
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(self.not_an_array())
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(self.not_an_array())
    }
}

/// One message object, appended to `out` as `<|role|>\n{content}\n`; anything else sets
/// `bad`. Also appended to `chat`, when kept, if it has one string `role` and at most one
/// `content`, a string or null (else `chat` is given up: `None`).
struct Message<'a, S> {
    out: &'a mut S,
    content: &'a mut String,
    bad: &'a mut bool,
    chat: &'a mut Option<Vec<ChatMessage>>,
}

impl<'de, S: PromptSink> DeserializeSeed<'de> for Message<'_, S> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, S: PromptSink> Visitor<'de> for Message<'_, S> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut role: Option<String> = None;
        self.content.clear();
        // For `chat`: how often each was given, and whether the content was a string or null.
        let (mut roles, mut contents, mut plain) = (0, 0, true);
        while let Some(key) = map.next_key::<Field>()? {
            match key {
                Field::Role => {
                    role = map.next_value_seed(Role { bad: &mut *self.bad })?;
                    roles += 1;
                }
                Field::Content => {
                    self.content.clear();
                    plain = false;
                    map.next_value_seed(Content { out: self.content, count: None, plain: Some(&mut plain) })?;
                    contents += 1;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        self.out.put("<|");
        self.out.put(role.as_deref().unwrap_or(""));
        self.out.put("|>\n");
        self.out.put(self.content);
        self.out.put("\n");
        if let Some(chat) = self.chat {
            match (role, roles, contents <= 1 && plain) {
                (Some(role), 1, true) => chat.push(ChatMessage { role, content: self.content.clone() }),
                _ => *self.chat = None,
            }
        }
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        *self.bad = true;
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        *self.bad = true;
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        *self.bad = true;
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        *self.bad = true;
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        *self.bad = true;
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        *self.bad = true;
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        *self.bad = true;
        Ok(())
    }
}

/// A message's `role`: a string or null; anything else sets `bad`.
struct Role<'a> {
    bad: &'a mut bool,
}

impl<'de> DeserializeSeed<'de> for Role<'_> {
    type Value = Option<String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Role<'_> {
    type Value = Option<String>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a role")
    }
    fn visit_str<E>(self, v: &str) -> Result<Option<String>, E> {
        Ok(Some(v.to_owned()))
    }
    fn visit_unit<E>(self) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<String>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        *self.bad = true;
        Ok(None)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<String>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        *self.bad = true;
        Ok(None)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Option<String>, E> {
        *self.bad = true;
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Option<String>, E> {
        *self.bad = true;
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Option<String>, E> {
        *self.bad = true;
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Option<String>, E> {
        *self.bad = true;
        Ok(None)
    }
}

/// A prompt or a message's content: a string as is; an array item by item ([`Item`]);
/// anything else adds nothing. `count`, when given, gains an array's number of entries;
/// `plain`, when given, is set when the content is a string or null.
struct Content<'a, S> {
    out: &'a mut S,
    count: Option<&'a mut usize>,
    plain: Option<&'a mut bool>,
}

impl<'de, S: PromptSink> DeserializeSeed<'de> for Content<'_, S> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, S: PromptSink> Visitor<'de> for Content<'_, S> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a prompt")
    }
    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.out.put(v);
        if let Some(plain) = self.plain {
            *plain = true;
        }
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut entries = 0usize;
        while seq.next_element_seed(Item { out: &mut *self.out, first: entries == 0, weight: None })?.is_some() {
            entries += 1;
        }
        if let Some(count) = self.count {
            *count = count.saturating_add(entries);
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        if let Some(plain) = self.plain {
            *plain = true;
        }
        Ok(())
    }
}

/// One item of a content array: a content part (`{"type":"text","text":…}`) adds its text;
/// a token id adds itself, after a space unless first; anything else is a nested content,
/// after a newline unless first. `weight`, when given (an entry of a `prompt` array),
/// gains the item's size as a prompt limit counts it: a nested array's entries, else 1.
struct Item<'a, S> {
    out: &'a mut S,
    first: bool,
    weight: Option<&'a mut usize>,
}

impl<S: PromptSink> Item<'_, S> {
    /// An item that is not an array weighs 1.
    fn weigh(&mut self) {
        if let Some(w) = self.weight.as_deref_mut() {
            *w = w.saturating_add(1);
        }
    }

    fn number(mut self, n: impl fmt::Display) {
        self.weigh();
        if !self.first {
            self.out.put(" ");
        }
        let _ = write!(self.out, "{n}");
    }

    /// A nested content's separator.
    fn newline(&mut self) {
        if !self.first {
            self.out.put("\n");
        }
    }
}

impl<'de, S: PromptSink> DeserializeSeed<'de> for Item<'_, S> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, S: PromptSink> Visitor<'de> for Item<'_, S> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a prompt item")
    }
    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        self.weigh();
        let mut text: Option<String> = None;
        while let Some(key) = map.next_key::<Field>()? {
            match key {
                Field::Text => text = map.next_value::<StringOrNot>()?.0,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if let Some(t) = text {
            self.out.put(&t);
        }
        Ok(())
    }
    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.number(v);
        Ok(())
    }
    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.number(v);
        Ok(())
    }
    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        // Written as serde_json writes a number, so the text does not depend on the parser.
        match serde_json::Number::from_f64(v) {
            Some(n) => self.number(n),
            None => self.number(v),
        }
        Ok(())
    }
    fn visit_str<E>(mut self, v: &str) -> Result<(), E> {
        self.weigh();
        self.newline();
        self.out.put(v);
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, seq: A) -> Result<(), A::Error> {
        self.newline();
        Content { out: self.out, count: self.weight, plain: None }.visit_seq(seq)
    }
    fn visit_bool<E>(mut self, _: bool) -> Result<(), E> {
        self.weigh();
        self.newline();
        Ok(())
    }
    fn visit_unit<E>(mut self) -> Result<(), E> {
        self.weigh();
        self.newline();
        Ok(())
    }
}

/// A value that is kept when it is a string and skipped otherwise.
struct StringOrNot(Option<String>);

impl<'de> Deserialize<'de> for StringOrNot {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StringOrNot;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_str<E>(self, v: &str) -> Result<StringOrNot, E> {
                Ok(StringOrNot(Some(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<StringOrNot, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(StringOrNot(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StringOrNot, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(StringOrNot(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<StringOrNot, E> {
                Ok(StringOrNot(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<StringOrNot, E> {
                Ok(StringOrNot(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<StringOrNot, E> {
                Ok(StringOrNot(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<StringOrNot, E> {
                Ok(StringOrNot(None))
            }
            fn visit_unit<E>(self) -> Result<StringOrNot, E> {
                Ok(StringOrNot(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// The same text from a document tree: the definition the visitor is checked against (unit
/// tests here, and the fuzz target on every input whose tree parses). `None` when the body
/// is not JSON at all.
#[cfg(any(test, feature = "fuzzing"))]
pub fn canonical_prompt_from_tree(body: &[u8]) -> Option<String> {
    use serde_json::Value;
    fn push_content(out: &mut String, v: &Value) {
        match v {
            Value::String(s) => out.push_str(s),
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Value::Object(o) => {
                            if let Some(Value::String(t)) = o.get("text") {
                                out.push_str(t);
                            }
                        }
                        Value::Number(n) => {
                            if i > 0 {
                                out.push(' ');
                            }
                            out.push_str(&n.to_string());
                        }
                        other => {
                            if i > 0 {
                                out.push('\n');
                            }
                            push_content(out, other);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    let tree: Value = serde_json::from_slice(body).ok()?;
    let Value::Object(request) = tree else { return Some(String::new()) };
    let mut out = String::new();
    match request.get("messages") {
        Some(Value::Array(messages)) => {
            for m in messages {
                let Value::Object(m) = m else { return Some(String::new()) };
                let role = match m.get("role") {
                    None | Some(Value::Null) => "",
                    Some(Value::String(r)) => r,
                    Some(_) => return Some(String::new()),
                };
                out.push_str("<|");
                out.push_str(role);
                out.push_str("|>\n");
                if let Some(c) = m.get("content") {
                    push_content(&mut out, c);
                }
                out.push('\n');
            }
        }
        None | Some(Value::Null) => {
            if let Some(p) = request.get("prompt") {
                push_content(&mut out, p);
            }
        }
        Some(_) => return Some(String::new()),
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_prompt_renders_the_whole_conversation() {
        let chat = br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"assistant","content":null}]}"#;
        assert_eq!(canonical_prompt(chat), "<|system|>\nbe brief\n<|user|>\nab\n<|assistant|>\n\n");
        // A continued conversation extends the previous canonical text.
        let first = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let second = br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#;
        assert!(canonical_prompt(second).starts_with(&canonical_prompt(first)));
        assert_eq!(canonical_prompt(br#"{"prompt":"once upon"}"#), "once upon");
        assert_eq!(canonical_prompt(br#"{"prompt":["a","b"]}"#), "a\nb");
        assert_eq!(canonical_prompt(br#"{"prompt":[1,2,3]}"#), "1 2 3");
        assert_eq!(canonical_prompt(br#"{"prompt":[[1,2],[3]]}"#), "1 2\n3");
        assert_eq!(canonical_prompt(br#"{"messages":5}"#), "");
        assert_eq!(canonical_prompt(b"{}"), "");
    }

    #[test]
    fn the_role_may_follow_the_content_and_the_last_of_a_repeated_key_counts() {
        let late_role = br#"{"messages":[{"content":"hi","role":"user"}]}"#;
        assert_eq!(canonical_prompt(late_role), "<|user|>\nhi\n");
        let twice = br#"{"messages":[{"role":"x","content":"a","content":"b","role":"user"}]}"#;
        assert_eq!(canonical_prompt(twice), "<|user|>\nb\n");
        let parts = br#"{"prompt":[{"text":"a","text":5},{"text":1,"text":"b"}]}"#;
        assert_eq!(canonical_prompt(parts), "b");
        assert_eq!(canonical_prompt(br#"{"messages":null,"prompt":"p"}"#), "p");
        assert_eq!(canonical_prompt(br#"{"prompt":"p","messages":[]}"#), "", "messages win over prompt");
    }

    #[test]
    fn shapes_that_are_not_requests_give_no_text() {
        for body in [
            &br#"[1,2]"#[..],
            br#"{"messages":[5]}"#,
            br#"{"messages":[{"role":7,"content":"x"}]}"#,
            br#"{"messages":"hi"}"#,
            br#"{"prompt":"a"} trailing"#,
            br#"{"prompt":"a""#,
            b"\xff",
        ] {
            assert_eq!(canonical_prompt(body), "", "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn the_visitor_agrees_with_the_tree_on_every_case() {
        let cases: &[&[u8]] = &[
            br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}]}"#,
            br#"{"prompt":[1,-2,3.5,1e300,18446744073709551616,-0,0.1]}"#,
            br#"{"prompt":["a",[1,2],null,true,{"text":"t"},[["x"],"y"]]}"#,
            br#"{"prompt":{"text":"not a part"}}"#,
            br#"{"prompt":"caf\u00e9 \ud83d\ude00 \"q\"\n"}"#,
            br#"{"messages":[{"role":null},{},{"content":[1,2]}],"prompt":"p"}"#,
            br#"{"model":"m","messages":[{"role":"user","content":"hi","name":"n"}],"stream":true}"#,
            br#"{"messages":[{"role":"user","content":"a"},3]}"#,
            br#"{"messages":{"role":"user"}}"#,
            br#"{"other":[[[[[[1]]]]]],"prompt":"ok"}"#,
            br#"{}"#,
            br#"[]"#,
            br#""s""#,
        ];
        for body in cases {
            let tree = canonical_prompt_from_tree(body).expect("valid JSON");
            assert_eq!(canonical_prompt(body), tree, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn an_integer_prompt_costs_its_text_not_a_tree() {
        // 1 MiB of token ids renders to 1 MiB of text; the tree would be ~16 MiB.
        let mut body = String::from(r#"{"prompt":["#);
        body.push_str(&"1,".repeat(512 * 1024));
        body.push_str("1]}");
        let text = canonical_prompt(body.as_bytes());
        assert_eq!(text.len(), 2 * 512 * 1024 + 1);
        assert_eq!(Some(text), canonical_prompt_from_tree(body.as_bytes()));
    }

    #[test]
    fn block_hashes_come_out_the_same_without_the_text() {
        use crate::policy::prefix_index::block_hashes;
        let chat = br#"{"messages":[{"role":"system","content":"be brief, be kind, be exact"},{"content":[{"type":"text","text":"tell me"},{"type":"text","text":" a story"}],"role":"user"}],"prompt":"x"}"#;
        let ids = br#"{"prompt":[[1,2,3],4,"five",{"text":"six"}],"model":"m"}"#;
        for body in [&chat[..], ids, br#"{"prompt":"p","messages":null}"#, b"{}", b"not json"] {
            let text = canonical_prompt(body);
            for block_bytes in [1, 3, 7, 64] {
                let (hashes, len) = canonical_prompt_blocks(body, block_bytes);
                assert_eq!((hashes, len), (block_hashes(text.as_bytes(), block_bytes), text.len()));
            }
        }
    }
}
