//! A served model's tokenizer and chat template, shared by the engine and the gateway.
//!
//! The engine renders and tokenizes every prompt it serves; the gateway does the same for
//! precise prefix routing, so that the blocks it looks up are the blocks the engine stored.
//! Both must produce the same token ids for the same request, so both use this crate:
//! [`ModelTokenizer`] (a `tokenizers::Tokenizer` plus the model's chat template, rendered
//! with minijinja as `transformers` renders it), built by [`load`] from a GGUF file's
//! metadata ([`gguf`]), a `tokenizer.json`, or a Hugging Face model directory.

pub mod gguf;
mod model;
pub mod pieces;
mod split;
pub mod vocab;

use std::path::{Path, PathBuf};

pub use model::{ModelTokenizer, TokenizerError};
pub use pieces::PieceCache;

/// A token id.
pub type TokenId = u32;

/// One chat message with its content flattened to text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`…
    pub role: String,
    /// The message text.
    pub content: String,
}

/// Render messages in ChatML with a generation prompt: what a model without a chat
/// template gets (and the format of the models the `sim` backend stands in for).
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

/// Load the tokenizer at `path`: a `.gguf` file (its `tokenizer.ggml.*` metadata and chat
/// template; the weights are mapped, not read), a `tokenizer.json` file (with the
/// `tokenizer_config.json` beside it, when there is one), or a directory holding a
/// `tokenizer.json` (a Hugging Face checkpoint).
pub fn load(path: &Path) -> Result<ModelTokenizer, TokenizerError> {
    if path.is_dir() {
        return load_hf(&path.join("tokenizer.json"));
    }
    let mut magic = [0u8; 4];
    let is_gguf = {
        use std::io::Read;
        let mut f = std::fs::File::open(path).map_err(io(path))?;
        f.read(&mut magic).map_err(io(path))? == 4 && &magic == b"GGUF"
    };
    if is_gguf {
        let file = gguf::GgufFile::open(path)?;
        ModelTokenizer::from_gguf(&file.header)
    } else {
        load_hf(path)
    }
}

/// A `tokenizer.json` and the `tokenizer_config.json` beside it (optional).
pub fn load_hf(tokenizer_json: &Path) -> Result<ModelTokenizer, TokenizerError> {
    let tok = std::fs::read(tokenizer_json).map_err(io(tokenizer_json))?;
    let config_path = tokenizer_json.with_file_name("tokenizer_config.json");
    let config: Option<serde_json::Value> = match std::fs::read(&config_path) {
        Ok(b) => Some(
            serde_json::from_slice(&b)
                .map_err(|e| TokenizerError::Format { path: config_path.clone(), reason: e.to_string() })?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(TokenizerError::Io { path: config_path, source: e }),
    };
    ModelTokenizer::from_hf(&tok, config.as_ref())
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TokenizerError + '_ {
    move |source| TokenizerError::Io { path: PathBuf::from(path), source }
}

#[cfg(test)]
mod tests;
