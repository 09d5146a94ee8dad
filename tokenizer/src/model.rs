//! The tokenizer and chat template of a real model.
//!
//! Both sources end up in the same `tokenizers::Tokenizer`:
//! - an HF checkpoint's `tokenizer.json` is loaded as is;
//! - a GGUF file's `tokenizer.ggml.*` metadata (byte-level BPE, `model = gpt2`) is turned into
//!   the equivalent `tokenizer.json` document: vocabulary and merges, control and
//!   user-defined tokens as added tokens, and the pre-tokenizer its `pre` names (`smollm`:
//!   digits one by one, then the GPT-2 split — what llama.cpp's `LLAMA_VOCAB_PRE_TYPE_SMOLLM`
//!   and SmolLM's own `tokenizer.json` do).
//!
//! The chat template stored with the model (`tokenizer.chat_template`, or
//! `tokenizer_config.json`'s `chat_template`) is rendered with minijinja, Python string
//! methods enabled, the way `transformers` renders it.

use std::fmt;
use std::path::PathBuf;

// The word cache's map: keyed with a per-process seed, a few instructions per word where
// SipHash takes ~150 (a prompt looks up each of its words).
use foldhash::HashMap as WordMap;
use parking_lot::RwLock;
use serde_json::{json, Value as Json};

use crate::gguf::{GgufError, Header, Value};
use crate::pieces::{Piece, PieceCache, PieceSplitter, MIN_CACHED_BYTES};
use crate::split::Gpt2Split;
use crate::vocab::Scheme;
use crate::{ChatMessage, TokenId};

/// Why a tokenizer cannot be built or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// Metadata is missing or malformed.
    #[error("tokenizer metadata `{key}`: {reason}")]
    Metadata {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// This tokenizer family is not supported.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    /// The `tokenizers` crate rejected the document.
    #[error("tokenizer: {0}")]
    Build(String),
    /// The chat template does not compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// A file cannot be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file is not what it should be (`tokenizer_config.json` that is not JSON).
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The GGUF file cannot be read.
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

fn meta_err(key: &str, reason: impl Into<String>) -> TokenizerError {
    TokenizerError::Metadata { key: key.to_string(), reason: reason.into() }
}

/// A real model's tokenizer with its special tokens and chat template.
pub struct ModelTokenizer {
    inner: tokenizers::Tokenizer,
    eos: TokenId,
    bos_text: String,
    eos_text: String,
    template: Option<minijinja::Environment<'static>>,
    /// The template reads `tools` (it can put function definitions in the prompt).
    template_tools: bool,
    /// How text is cut at added tokens (`None`: some added token does not match plainly).
    pieces: Option<PieceSplitter>,
    /// The GPT-2 split scanned by hand, for a byte-level BPE built from GGUF metadata (an HF
    /// `tokenizer.json` may configure anything: it keeps `tokenizers`' own pipeline).
    fast: Option<FastBpe>,
}

/// Byte-level BPE without `tokenizers`' pre-tokenizer pipeline: the split of [`crate::split`],
/// GPT-2's byte characters, then the BPE model itself; the ids of the words seen first are
/// kept (`words`), so a word seen before costs a lookup, not the model's `Token` strings.
struct FastBpe {
    split: Gpt2Split,
    byte_chars: [char; 256],
    words: RwLock<WordMap<Box<str>, Box<[TokenId]>>>,
}

/// Words whose ids are kept: the first ones seen, like `tokenizers`' own BPE cache (~1 MB).
const WORD_CACHE_ENTRIES: usize = 10_000;
/// Longer pieces are rare and are not kept.
const WORD_CACHE_MAX_BYTES: usize = 32;

impl fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("eos", &self.eos)
            .field("chat_template", &self.template.is_some())
            .finish()
    }
}

impl ModelTokenizer {
    /// Build from a GGUF header.
    pub fn from_gguf(h: &Header) -> Result<Self, TokenizerError> {
        let model = h.str("tokenizer.ggml.model").map_err(|e| meta_err("tokenizer.ggml.model", e.to_string()))?;
        if model != "gpt2" {
            return Err(TokenizerError::Unsupported(format!(
                "tokenizer.ggml.model = {model} (byte-level BPE `gpt2` is supported)"
            )));
        }
        let strings = |key: &str| -> Result<Vec<&str>, TokenizerError> {
            h.get(key)
                .and_then(Value::as_array)
                .ok_or_else(|| meta_err(key, "missing or not an array"))?
                .iter()
                .map(|v| v.as_str().ok_or_else(|| meta_err(key, "an element is not a string")))
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = match h.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(meta_err("tokenizer.ggml.token_type", "length differs from tokenizer.ggml.tokens"));
        }
        let pre = h.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
        let split = Gpt2Split { individual_digits: pre == "smollm" };
        let pre_tokenizer = match pre {
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]}),
            "default" | "gpt2" | "gpt-2" => {
                json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
            }
            other => {
                return Err(TokenizerError::Unsupported(format!(
                    "tokenizer.ggml.pre = {other} (supported: smollm, gpt2, default)"
                )))
            }
        };
        let vocab: serde_json::Map<String, Json> =
            tokens.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect();
        // Control (3) and user-defined (4) tokens are matched whole, before the pre-tokenizer.
        let added: Vec<Json> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, &ty))| ty == 3 || ty == 4)
            .map(|(i, (t, &ty))| {
                json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": ty == 3})
            })
            .collect();
        let doc = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges},
        });
        let inner =
            tokenizers::Tokenizer::from_bytes(doc.to_string()).map_err(|e| TokenizerError::Build(e.to_string()))?;
        let id = |key: &str| h.get(key).and_then(Value::as_u64).map(|v| v as TokenId);
        let eos =
            id("tokenizer.ggml.eos_token_id").ok_or_else(|| meta_err("tokenizer.ggml.eos_token_id", "missing"))?;
        let text_of =
            |id: Option<TokenId>| id.and_then(|i| tokens.get(i as usize)).map(|s| s.to_string()).unwrap_or_default();
        let template = h.get("tokenizer.chat_template").and_then(Value::as_str).map(compile_template).transpose()?;
        let bos_text = text_of(id("tokenizer.ggml.bos_token_id"));
        if eos as usize >= tokens.len() {
            return Err(meta_err("tokenizer.ggml.eos_token_id", format!("{eos} is outside the vocabulary")));
        }
        let pieces = splitter(&inner);
        let template_tools = h.get("tokenizer.chat_template").and_then(Value::as_str).is_some_and(reads_tools);
        let fast = crate::split::available().then(|| FastBpe {
            split,
            byte_chars: crate::vocab::byte_chars(),
            words: RwLock::new(WordMap::default()),
        });
        Ok(Self {
            inner,
            eos,
            bos_text,
            eos_text: tokens[eos as usize].to_string(),
            template,
            template_tools,
            pieces,
            fast,
        })
    }

    /// Build from an HF `tokenizer.json` document, with the special tokens and template of
    /// `tokenizer_config.json` (when given).
    pub fn from_hf(tokenizer_json: &[u8], config: Option<&Json>) -> Result<Self, TokenizerError> {
        let inner =
            tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|e| TokenizerError::Build(e.to_string()))?;
        // `bos_token` / `eos_token` are strings or `{"content": ...}` objects.
        let special = |key: &str| -> Option<String> {
            let v = config?.get(key)?;
            v.as_str().or_else(|| v.get("content").and_then(Json::as_str)).map(str::to_owned)
        };
        let eos_text = special("eos_token").unwrap_or_else(|| "<|endoftext|>".to_string());
        let eos = inner
            .token_to_id(&eos_text)
            .ok_or_else(|| meta_err("eos_token", format!("`{eos_text}` is not in the vocabulary")))?;
        let template =
            config.and_then(|c| c.get("chat_template")).and_then(Json::as_str).map(compile_template).transpose()?;
        let pieces = splitter(&inner);
        let template_tools =
            config.and_then(|c| c.get("chat_template")).and_then(Json::as_str).is_some_and(reads_tools);
        Ok(Self {
            inner,
            eos,
            bos_text: special("bos_token").unwrap_or_default(),
            eos_text,
            template,
            template_tools,
            pieces,
            fast: None,
        })
    }

    /// Render a conversation with the model's chat template and a generation prompt
    /// (ChatML when the model has no template).
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        let Some(env) = &self.template else {
            return Ok(crate::render_chatml(messages));
        };
        let tmpl = env.get_template("chat").map_err(|e| TokenizerError::Template(e.to_string()))?;
        let msgs: Vec<Json> = messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect();
        tmpl.render(minijinja::context! {
            messages => msgs,
            add_generation_prompt => true,
            bos_token => self.bos_text,
            eos_token => self.eos_text,
        })
        .map_err(|e| TokenizerError::Template(describe(&e)))
    }

    /// Render messages given as JSON objects (`role`, `content`, `tool_calls`,
    /// `tool_call_id`…) with `tools` (OpenAI's list of function definitions) through the
    /// model's template; only for a template that reads `tools` ([`Self::renders_tools`]).
    pub fn render_with_tools(&self, messages: &[Json], tools: &Json) -> Result<String, TokenizerError> {
        let (Some(env), true) = (&self.template, self.template_tools) else {
            return Err(TokenizerError::Template("this model's chat template does not render tools".into()));
        };
        let tmpl = env.get_template("chat").map_err(|e| TokenizerError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => true,
            bos_token => self.bos_text,
            eos_token => self.eos_text,
        })
        .map_err(|e| TokenizerError::Template(describe(&e)))
    }

    /// Whether the chat template puts `tools` in the prompt.
    pub fn renders_tools(&self) -> bool {
        self.template_tools
    }

    /// Number of tokens in the vocabulary, added tokens included.
    pub fn vocab_len(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether the model brings its own chat template (ChatML is used otherwise).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Text → token ids, no special tokens added (special tokens written in the text, such
    /// as a rendered template's, are matched whole).
    pub fn encode(&self, text: &str) -> Vec<TokenId> {
        match self.inner.encode_fast(text, false) {
            Ok(enc) => enc.get_ids().to_vec(),
            // Encoding only fails on internal errors of the tokenizer (never on user text).
            Err(e) => {
                tracing::error!(error = %e, "tokenizer failed to encode");
                Vec::new()
            }
        }
    }

    /// Whether [`Self::encode_cached`] splits text by hand ([`crate::split`]).
    #[cfg(test)]
    pub(crate) fn splits_by_hand(&self) -> bool {
        self.fast.is_some()
    }

    /// Text without added tokens → token ids: the hand-scanned split and the BPE model when
    /// this tokenizer has them, else [`Self::encode`].
    pub(crate) fn encode_text(&self, text: &str) -> Vec<TokenId> {
        let Some(fast) = &self.fast else { return self.encode(text) };
        let model = self.inner.get_model();
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut mapped = String::new();
        let mut failed = false;
        // Words to keep, with where their ids stand in `out`: written after the text, so the
        // read lock is taken once per text, not per word (each take a write to the lock's
        // word, which the cores tokenizing at once pass between them).
        let mut new_words: Vec<(&str, std::ops::Range<usize>)> = Vec::new();
        {
            let words = fast.words.read();
            let room = words.len() < WORD_CACHE_ENTRIES;
            fast.split.split(text, &mut |piece| {
                if let Some(ids) = words.get(piece) {
                    out.extend_from_slice(ids);
                    return;
                }
                mapped.clear();
                mapped.extend(piece.bytes().map(|b| fast.byte_chars[usize::from(b)]));
                match tokenizers::Model::tokenize(model, &mapped) {
                    Ok(tokens) => {
                        let start = out.len();
                        out.extend(tokens.iter().map(|t| t.id));
                        // Once the cache is full a miss takes no write lock.
                        if room && piece.len() <= WORD_CACHE_MAX_BYTES {
                            new_words.push((piece, start..out.len()));
                        }
                    }
                    Err(_) => failed = true,
                }
            });
        }
        if failed {
            return self.encode(text);
        }
        // Kept when the lock is free: a writer waiting would hold up every core's next text
        // behind a long one still being read (a word not kept now is kept another time).
        if let Some(mut words) = (!new_words.is_empty()).then(|| fast.words.try_write()).flatten() {
            for (piece, ids) in new_words {
                if words.len() >= WORD_CACHE_ENTRIES {
                    break;
                }
                words.entry(piece.into()).or_insert_with(|| out[ids].into());
            }
        }
        out
    }

    /// [`Self::encode`], piece by piece between the added tokens, with the ids of long pieces
    /// remembered in `cache` (see [`crate::pieces`]) and each piece split by hand
    /// ([`crate::split`]) when the tokenizer allows: a prompt that repeats a long system
    /// prompt or conversation costs the tokenization of what is new in it. The first 32
    /// texts and 1 in 1,024 after are also tokenized whole by `tokenizers`' own pipeline; a
    /// difference turns all of this off ([`Self::encode`] from then on).
    pub fn encode_cached(&self, text: &str, cache: &PieceCache) -> Vec<TokenId> {
        let Some(splitter) = self.pieces.as_ref().filter(|_| !cache.is_off()) else {
            return self.encode(text);
        };
        let mut out = Vec::with_capacity(text.len() / 3);
        for piece in splitter.split(text) {
            match piece {
                Piece::Added(id) => out.push(id),
                Piece::Text(t) if t.len() < MIN_CACHED_BYTES => out.extend(self.encode_text(t)),
                Piece::Text(t) => out.extend_from_slice(&cache.get_or_encode(t, |t| self.encode_text(t))),
            }
        }
        if cache.check_now() {
            let whole = self.encode(text);
            if whole != out {
                tracing::warn!("piecewise tokenization differs from whole-text tokenization; turned off");
                cache.turn_off();
                return whole;
            }
        }
        out
    }

    /// Token ids → text; ids that cannot be decoded give U+FFFD.
    pub fn decode(&self, ids: &[TokenId]) -> String {
        self.inner.decode(ids, true).unwrap_or_else(|_| "\u{FFFD}".to_string())
    }

    /// The end-of-sequence token.
    pub fn eos_token_id(&self) -> TokenId {
        self.eos
    }

    /// Every token's bytes, by id ([`crate::vocab`]): what constrained decoding matches
    /// grammars against. Special tokens start with [`crate::vocab::SPECIAL_MARKER`].
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        use tokenizers::DecoderWrapper;
        let scheme = match self.inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => Scheme::ByteLevel,
            Some(DecoderWrapper::Sequence(seq)) if format!("{seq:?}").contains("ByteLevel") => Scheme::ByteLevel,
            _ => Scheme::Metaspace,
        };
        let added = self.inner.get_added_tokens_decoder();
        crate::vocab::token_bytes(
            self.vocab_len(),
            scheme,
            |id| self.inner.id_to_token(id),
            |id| added.get(&id).map(|t| t.special),
        )
    }
}

/// The splitter for `inner`'s added tokens, when they all match plainly on the raw text.
fn splitter(inner: &tokenizers::Tokenizer) -> Option<PieceSplitter> {
    let has_normalizer = inner.get_normalizer().is_some();
    PieceSplitter::new(inner.get_added_tokens_decoder().into_iter().map(|(id, t)| {
        let plain = !(t.single_word || t.lstrip || t.rstrip || (t.normalized && has_normalizer));
        (t.content, id, plain)
    }))
}

fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// Whether a template's source reads a `tools` variable.
fn reads_tools(source: &str) -> bool {
    source.split(|c: char| !(c.is_alphanumeric() || c == '_')).any(|w| w == "tools")
}

fn compile_template(source: &str) -> Result<minijinja::Environment<'static>, TokenizerError> {
    let mut env = minijinja::Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_template_owned("chat", source.to_string()).map_err(|e| TokenizerError::Template(describe(&e)))?;
    Ok(env)
}
