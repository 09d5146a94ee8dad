//! The tokenizer interface of the engine, and chat rendering.
//!
//! Everything above the model talks to tokenizers through the [`Tokenizer`] trait. Two
//! implementations exist: [`SimTokenizer`] ([`sim`]), the `sim` backend's deterministic
//! stand-in, and [`ModelTokenizer`](crate::model::model_tokenizer::ModelTokenizer), a real
//! model's tokenizer and chat template, loaded with its weights.

pub mod sim;

pub use sim::{SimTokenizer, WORDS};

/// A token id.
pub type TokenId = u32;

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
    /// Ids below this are valid inputs (`None`: any id is, as for the simulator).
    fn vocab_size(&self) -> Option<usize> {
        None
    }
}

/// One chat message with its content flattened to text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`…
    pub role: String,
    /// The message text.
    pub content: String,
}

/// Render messages in ChatML with a generation prompt, the format of the models the
/// simulator stands in for when no template of a real model is loaded.
pub fn render_chatml(messages: &[ChatMessage]) -> String {
    let mut out = String::with_capacity(messages.iter().map(|m| m.content.len() + 32).sum());
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        out.push_str(&m.content);
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    out
}
