//! The request path's tokenizing service: a request's prompt turned into the block keys the
//! engines will cache it under (`kv_events.tokenizer`), so the [index](super::index) fed by
//! the engines' events ([`super::subscriber::KvEvents`]) can say what each engine holds of it.
//! The planner ([`crate::proxy::plan::plan_request`]) calls it; without a tokenizer there is no
//! such service, and routing uses the approximate index alone.

use std::sync::Arc;

use switchyard_tokenizer::{ModelTokenizer, PieceCache};

use super::index::{prompt_keys, BlockKey};
use crate::request::tokens::{prompt_token_ids, SeenPrompt};

/// A request's prompt as the engines will cache it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrecisePrompt {
    /// The keys of its full blocks, in order.
    pub keys: Vec<BlockKey>,
    /// Its length in tokens.
    pub tokens: u64,
}

/// The served model's tokenizer, with a cache of the pieces it has seen.
#[derive(Debug)]
pub struct PromptTokenizer {
    tokenizer: Arc<ModelTokenizer>,
    /// Token ids of prompt pieces seen before (`kv_events.tokenizer_cache_bytes`).
    pieces: PieceCache,
    /// The engines' block size in tokens (`kv_events.block_size`).
    block_size: usize,
}

impl PromptTokenizer {
    /// Tokenize with `tokenizer` into `block_size`-token blocks, remembering up to
    /// `cache_bytes` of pieces.
    pub fn new(tokenizer: Arc<ModelTokenizer>, cache_bytes: usize, block_size: usize) -> Self {
        PromptTokenizer { tokenizer, pieces: PieceCache::new(cache_bytes), block_size }
    }

    /// The prompt of `body` tokenized as the engine will (`None` for a body with no single
    /// prompt: see [`crate::request::tokens`]); `seen`: what the routing pass read of it.
    pub fn precise_prompt(&self, body: &[u8], seen: SeenPrompt) -> Option<PrecisePrompt> {
        let ids = prompt_token_ids(body, seen, &self.tokenizer, &self.pieces)?;
        Some(PrecisePrompt { keys: prompt_keys(&ids, self.block_size), tokens: ids.len() as u64 })
    }

    /// What `/admin/backends` shows of the piece cache.
    pub fn describe(&self) -> serde_json::Value {
        let (hits, misses) = self.pieces.counts();
        serde_json::json!({
            "piecewise": !self.pieces.is_off(), "cache_hits": hits, "cache_misses": misses,
            "cache_bytes": self.pieces.bytes(),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tokenizer whose tokens are single characters (`a`-`z`, space, `<`, `>`, `|`, `_`,
    /// newline), with no chat template (ChatML).
    pub(crate) fn letters() -> Arc<ModelTokenizer> {
        let alphabet = "abcdefghijklmnopqrstuvwxyz <>|_\n";
        let mut vocab = serde_json::Map::new();
        vocab.insert("<eos>".into(), 0.into());
        for (i, c) in alphabet.chars().enumerate() {
            vocab.insert(c.to_string(), (i + 1).into());
        }
        let doc = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []},
        });
        let config = serde_json::json!({"eos_token": "<eos>"});
        Arc::new(ModelTokenizer::from_hf(doc.to_string().as_bytes(), Some(&config)).unwrap())
    }

    /// A chat asking "hello world", and its prompt as the engine renders it (ChatML:
    /// `<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n`).
    pub(crate) fn hello_world() -> (&'static [u8], String) {
        let text = switchyard_tokenizer::render_chatml(&[switchyard_tokenizer::ChatMessage {
            role: "user".into(),
            content: "hello world".into(),
        }]);
        (br#"{"messages":[{"role":"user","content":"hello world"}]}"#, text)
    }

    #[test]
    fn a_prompt_becomes_the_block_keys_the_engine_caches_it_under() {
        let tokenizer = PromptTokenizer::new(letters(), 1 << 20, 4);
        let (body, text) = hello_world();
        // A token a character.
        let prompt = tokenizer.precise_prompt(body, SeenPrompt::Unknown).expect("a chat tokenizes");
        assert_eq!(prompt.tokens, text.len() as u64);
        assert_eq!(prompt.keys.len(), text.len() / 4);
        assert_eq!(prompt.keys, prompt_keys(&letters().encode(&text), 4));
        // A completion's token ids are taken as they are; a batch has no single prompt.
        let ids = tokenizer.precise_prompt(br#"{"prompt":[1,2,3,4,5]}"#, SeenPrompt::Unknown).unwrap();
        assert_eq!((ids.tokens, ids.keys.len()), (5, 1));
        assert_eq!(tokenizer.precise_prompt(br#"{"prompt":["a","b"]}"#, SeenPrompt::Unknown), None);
    }
}
