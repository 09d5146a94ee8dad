//! The tokenizer interface of the engine, and chat rendering.
//!
//! Everything above the model talks to tokenizers through the [`Tokenizer`] trait. Two
//! implementations exist: [`SimTokenizer`] ([`sim`]), the `sim` backend's deterministic
//! stand-in, and [`ModelTokenizer`], a real model's tokenizer and chat template (from the
//! `switchyard-tokenizer` crate, which the gateway shares), loaded with its weights.

pub mod sim;

pub use sim::{SimTokenizer, WORDS};

pub use switchyard_tokenizer::{render_chatml, ChatMessage, ModelTokenizer, TokenId};

/// What the engine needs from a tokenizer.
pub trait Tokenizer: Send + Sync {
    /// Text → token ids (no special tokens added).
    fn encode(&self, text: &str) -> Vec<TokenId>;
    /// Token ids → text. Ids that cannot be decoded become U+FFFD.
    fn decode(&self, ids: &[TokenId]) -> String;
    /// The end-of-sequence token.
    fn eos_token_id(&self) -> TokenId;
    /// Render a conversation, with the generation prompt, as the model expects it (ChatML
    /// unless the model brings its own template). An error names what the template rejected.
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        Ok(render_chatml(messages))
    }
    /// Whether [`Self::render_chat_with_tools`] works: the chat template puts function
    /// definitions in the prompt.
    fn renders_tools(&self) -> bool {
        false
    }
    /// Render a conversation (JSON message objects, tool calls included) with `tools`.
    fn render_chat_with_tools(
        &self,
        _messages: &[serde_json::Value],
        _tools: &serde_json::Value,
    ) -> Result<String, String> {
        Err("this model's chat template does not render tools".into())
    }
    /// Every token's bytes, by id (special tokens start with
    /// [`switchyard_tokenizer::vocab::SPECIAL_MARKER`]): what constrained decoding matches
    /// grammars against.
    fn token_bytes(&self) -> Vec<Vec<u8>>;
    /// Ids below this are valid inputs (`None`: any id is, as for the simulator).
    fn vocab_size(&self) -> Option<usize> {
        None
    }
}

impl Tokenizer for ModelTokenizer {
    fn encode(&self, text: &str) -> Vec<TokenId> {
        ModelTokenizer::encode(self, text)
    }

    fn decode(&self, ids: &[TokenId]) -> String {
        ModelTokenizer::decode(self, ids)
    }

    fn eos_token_id(&self) -> TokenId {
        ModelTokenizer::eos_token_id(self)
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        self.render(messages).map_err(|e| e.to_string())
    }

    fn token_bytes(&self) -> Vec<Vec<u8>> {
        ModelTokenizer::token_bytes(self)
    }

    fn renders_tools(&self) -> bool {
        ModelTokenizer::renders_tools(self)
    }

    fn render_chat_with_tools(
        &self,
        messages: &[serde_json::Value],
        tools: &serde_json::Value,
    ) -> Result<String, String> {
        self.render_with_tools(messages, tools).map_err(|e| e.to_string())
    }

    fn vocab_size(&self) -> Option<usize> {
        Some(self.vocab_len())
    }
}
