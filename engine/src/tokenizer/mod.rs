//! The tokenizer interface of the engine, and chat rendering.
//!
//! Everything above the model talks to tokenizers through the [`Tokenizer`] trait. Two
//! implementations exist: [`SimTokenizer`] ([`sim`]), the `sim` backend's deterministic
//! stand-in, and [`LoadedTokenizer`], a real model's tokenizer and chat template
//! ([`ModelTokenizer`], from the `switchyard-tokenizer` crate, which the gateway shares),
//! loaded with its weights.

pub mod sim;

pub use sim::{SimTokenizer, WORDS};

pub use switchyard_tokenizer::{render_chatml, ChatMessage, ModelTokenizer, PieceCache, TokenId};

/// Bytes of prompt pieces' token ids a [`LoadedTokenizer`] remembers (the gateway's default
/// `kv_events.tokenizer_cache_bytes`).
pub const PIECE_CACHE_BYTES: usize = 32 * 1024 * 1024;

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

/// A real model's tokenizer as the engine runs it: text is encoded piece by piece between
/// the added tokens, each piece split by hand and the long ones remembered
/// ([`ModelTokenizer::encode_cached`], as the gateway tokenizes for precise routing) — about
/// a tenth of the instructions of `tokenizers`' regex pipeline per prompt byte, and a
/// repeated system prompt costs a lookup. The result is the pipeline's: it is compared with
/// it on the first texts and one in 1,024 after, and a difference turns the cache off.
pub struct LoadedTokenizer {
    model: ModelTokenizer,
    pieces: PieceCache,
}

impl LoadedTokenizer {
    /// `model`, remembering up to [`PIECE_CACHE_BYTES`] of pieces.
    pub fn new(model: ModelTokenizer) -> Self {
        LoadedTokenizer { model, pieces: PieceCache::new(PIECE_CACHE_BYTES) }
    }
}

impl Tokenizer for LoadedTokenizer {
    fn encode(&self, text: &str) -> Vec<TokenId> {
        self.model.encode_cached(text, &self.pieces)
    }

    fn decode(&self, ids: &[TokenId]) -> String {
        self.model.decode(ids)
    }

    fn eos_token_id(&self) -> TokenId {
        self.model.eos_token_id()
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        self.model.render(messages).map_err(|e| e.to_string())
    }

    fn token_bytes(&self) -> Vec<Vec<u8>> {
        self.model.token_bytes()
    }

    fn renders_tools(&self) -> bool {
        self.model.renders_tools()
    }

    fn render_chat_with_tools(
        &self,
        messages: &[serde_json::Value],
        tools: &serde_json::Value,
    ) -> Result<String, String> {
        self.model.render_with_tools(messages, tools).map_err(|e| e.to_string())
    }

    fn vocab_size(&self) -> Option<usize> {
        Some(self.model.vocab_len())
    }
}
