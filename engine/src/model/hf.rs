//! Hugging Face checkpoint directories of the Llama architecture with F32 / F16 / BF16
//! weights: `config.json`, `*.safetensors` (one file or shards), `tokenizer.json`, and
//! `tokenizer_config.json` for special tokens and the chat template.
//!
//! Weights stay in the memory-mapped files (matrices point into them); only the norm
//! vectors are copied to f32. HF checkpoints keep Q/K rows in the order of the NeoX
//! (half-split) rotary layout, so the model runs with [`RopeStyle::NeoX`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use super::gguf::GgmlType;
use super::llama::{LayerNames, LayerWeights, Llama, LlamaConfig, Matrix, ModelError, RopeStyle};
use super::quant::dequantize_row;
use switchyard_tokenizer::{ModelTokenizer, TokenizerError};

/// Why a checkpoint directory cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file cannot be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` or a safetensors header is malformed.
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The weights do not make a Llama model.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The tokenizer files.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// The `config.json` fields a Llama checkpoint needs.
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    num_hidden_layers: usize,
    vocab_size: usize,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    #[serde(default = "default_eps")]
    rms_norm_eps: f32,
    #[serde(default = "default_ctx")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
}

fn default_theta() -> f32 {
    10000.0
}
fn default_eps() -> f32 {
    1e-5
}
fn default_ctx() -> usize {
    2048
}

/// Where one tensor lives.
struct Located {
    buf: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
    ty: GgmlType,
    shape: Vec<usize>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io { path: path.to_path_buf(), source }
}

/// Load a checkpoint directory.
pub fn load(dir: &Path) -> Result<(Llama, ModelTokenizer), HfError> {
    let cfg_path = dir.join("config.json");
    let raw = std::fs::read(&cfg_path).map_err(io(&cfg_path))?;
    let hc: HfConfig =
        serde_json::from_slice(&raw).map_err(|e| HfError::Format { path: cfg_path.clone(), reason: e.to_string() })?;
    if !hc.architectures.is_empty() && !hc.architectures.iter().any(|a| a == "LlamaForCausalLM") {
        return Err(HfError::Format {
            path: cfg_path,
            reason: format!("architectures {:?} (LlamaForCausalLM is supported)", hc.architectures),
        });
    }
    let n_kv_heads = hc.num_key_value_heads.unwrap_or(hc.num_attention_heads);
    if hc.num_attention_heads == 0
        || !hc.hidden_size.is_multiple_of(hc.num_attention_heads)
        || n_kv_heads == 0
        || !hc.num_attention_heads.is_multiple_of(n_kv_heads)
    {
        return Err(HfError::Format { path: cfg_path, reason: "inconsistent head counts".into() });
    }
    let cfg = LlamaConfig {
        n_layers: hc.num_hidden_layers,
        dim: hc.hidden_size,
        ffn_dim: hc.intermediate_size,
        n_heads: hc.num_attention_heads,
        n_kv_heads,
        vocab: hc.vocab_size,
        max_ctx: hc.max_position_embeddings,
        rope_theta: hc.rope_theta,
        eps: hc.rms_norm_eps,
        rope: RopeStyle::NeoX,
    };

    let mut tensors: HashMap<String, Located> = HashMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(HfError::Format { path: dir.to_path_buf(), reason: "no *.safetensors file".into() });
    }
    for path in &files {
        let file = std::fs::File::open(path).map_err(io(path))?;
        // SAFETY: read-only private map of a checkpoint file, which is not modified while
        // the engine runs (the same contract as every mmap loader, see `GgufFile::open`).
        #[allow(unsafe_code)]
        let map = Arc::new(unsafe { memmap2::Mmap::map(&file) }.map_err(io(path))?);
        let st = safetensors::SafeTensors::deserialize(&map[..])
            .map_err(|e| HfError::Format { path: path.clone(), reason: e.to_string() })?;
        let base = map.as_ptr() as usize;
        let buf: Arc<dyn AsRef<[u8]> + Send + Sync> = map.clone();
        for (name, view) in st.tensors() {
            let ty = match view.dtype() {
                safetensors::Dtype::F32 => GgmlType::F32,
                safetensors::Dtype::F16 => GgmlType::F16,
                safetensors::Dtype::BF16 => GgmlType::BF16,
                other => {
                    return Err(HfError::Format {
                        path: path.clone(),
                        reason: format!("tensor `{name}`: dtype {other:?}"),
                    })
                }
            };
            let data = view.data();
            tensors.insert(
                name,
                Located {
                    buf: buf.clone(),
                    start: data.as_ptr() as usize - base,
                    len: data.len(),
                    ty,
                    shape: view.shape().to_vec(),
                },
            );
        }
    }
    let terr = |name: &str, reason: String| ModelError::Tensor { name: name.to_string(), reason };
    let matrix = |name: &str, rows: usize, cols: usize| -> Result<Matrix, ModelError> {
        let t = tensors.get(name).ok_or_else(|| terr(name, "missing".into()))?;
        if t.shape != [rows, cols] {
            return Err(terr(name, format!("shape {:?}, expected [{rows}, {cols}]", t.shape)));
        }
        Ok(Matrix::new(t.buf.clone(), t.start, t.ty, rows, cols)?)
    };
    let vector = |name: &str, n: usize| -> Result<Vec<f32>, ModelError> {
        let t = tensors.get(name).ok_or_else(|| terr(name, "missing".into()))?;
        if t.shape != [n] {
            return Err(terr(name, format!("shape {:?}, expected [{n}]", t.shape)));
        }
        let mut out = vec![0.0; n];
        let all: &[u8] = (*t.buf).as_ref();
        dequantize_row(t.ty, &all[t.start..t.start + t.len], &mut out)?;
        Ok(out)
    };
    const HF_LAYER: LayerNames = LayerNames {
        attn_norm: "input_layernorm",
        q: "self_attn.q_proj",
        k: "self_attn.k_proj",
        v: "self_attn.v_proj",
        o: "self_attn.o_proj",
        ffn_norm: "post_attention_layernorm",
        gate: "mlp.gate_proj",
        up: "mlp.up_proj",
        down: "mlp.down_proj",
    };
    let d = cfg.dim;
    let layers = (0..cfg.n_layers)
        .map(|i| {
            LayerWeights::load(&cfg, |part| format!("model.layers.{i}.{part}.weight"), &HF_LAYER, &matrix, &vector)
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let embed = matrix("model.embed_tokens.weight", cfg.vocab, d)?;
    let lm_head = if hc.tie_word_embeddings && !tensors.contains_key("lm_head.weight") {
        embed.clone()
    } else {
        matrix("lm_head.weight", cfg.vocab, d)?
    };
    let norm = vector("model.norm.weight", d)?;
    let model = Llama::assemble(cfg, embed, layers, norm, lm_head);

    let tokenizer = switchyard_tokenizer::load_hf(&dir.join("tokenizer.json"))?;
    Ok((model, tokenizer))
}

#[cfg(test)]
mod tests;
