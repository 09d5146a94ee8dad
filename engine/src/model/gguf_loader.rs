//! The GGUF loader: a llama-architecture GGUF file ([`super::gguf`]) to a [`Llama`] — its
//! hyperparameters from the `llama.*` metadata, its tensors by their GGUF names
//! (`blk.{i}.attn_q.weight`, …) as [`Matrix`] views of the mapped file, shapes checked.

use std::sync::Arc;

use super::gguf::{GgufFile, Header};
use super::llama::{cfg_err, tensor_err, LayerNames, LayerWeights, Llama, LlamaConfig, ModelError, RopeStyle};
use super::quant::dequantize_row;
use super::tensor::Matrix;

/// What GGUF calls the tensors of a block (`blk.{i}.{part}.weight`).
const GGUF_LAYER: LayerNames = LayerNames {
    attn_norm: "attn_norm",
    q: "attn_q",
    k: "attn_k",
    v: "attn_v",
    o: "attn_output",
    ffn_norm: "ffn_norm",
    gate: "ffn_gate",
    up: "ffn_up",
    down: "ffn_down",
};

/// The model's shape from the `llama.*` metadata (the vocabulary from the embedding's rows).
fn gguf_config(h: &Header) -> Result<LlamaConfig, ModelError> {
    let arch = h.str("general.architecture")?;
    if arch != "llama" {
        return Err(cfg_err("general.architecture", format!("{arch} (only llama is supported)")));
    }
    let count = |key: &str| -> Result<usize, ModelError> {
        let v = h.u64(&format!("llama.{key}"))?;
        usize::try_from(v).ok().filter(|&v| v > 0).ok_or_else(|| cfg_err(key, format!("{v} is not a positive count")))
    };
    let dim = count("embedding_length")?;
    let n_heads = count("attention.head_count")?;
    let n_kv_heads = count("attention.head_count_kv").unwrap_or(n_heads);
    if !dim.is_multiple_of(n_heads) || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(cfg_err("attention.head_count", format!("{dim} dims, {n_heads} heads, {n_kv_heads} kv heads")));
    }
    let vocab = h.tensor("token_embd.weight").ok_or_else(|| tensor_err("token_embd.weight", "missing"))?.rows();
    Ok(LlamaConfig {
        n_layers: count("block_count")?,
        dim,
        ffn_dim: count("feed_forward_length")?,
        n_heads,
        n_kv_heads,
        vocab,
        max_ctx: count("context_length")?,
        rope_theta: h.f64("llama.rope.freq_base").unwrap_or(10000.0) as f32,
        eps: h.f64("llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f32,
        rope: RopeStyle::Interleaved,
    })
}

impl Llama {
    /// Load a GGUF llama model: its shape from the metadata, its weights as views of the
    /// mapped file (norms dequantized to f32), every shape checked.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let h = &file.header;
        let cfg = gguf_config(h)?;
        let (vocab, dim) = (cfg.vocab, cfg.dim);
        let buf: Arc<dyn AsRef<[u8]> + Send + Sync> = file.map();
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Matrix, ModelError> {
            let t = h.tensor(name).ok_or_else(|| tensor_err(name, "missing"))?;
            if t.dims.len() != 2 || t.row_len() != cols || t.rows() != rows {
                return Err(tensor_err(name, format!("shape {:?}, expected [{cols}, {rows}]", t.dims)));
            }
            Ok(Matrix::new(buf.clone(), t.start, t.ty, rows, cols)?)
        };
        let vector = |name: &str, n: usize| -> Result<Vec<f32>, ModelError> {
            let t = h.tensor(name).ok_or_else(|| tensor_err(name, "missing"))?;
            if t.elements() != n {
                return Err(tensor_err(name, format!("{} elements, expected {n}", t.elements())));
            }
            let mut out = vec![0.0; n];
            dequantize_row(t.ty, file.data(t), &mut out)?;
            Ok(out)
        };
        let layers = (0..cfg.n_layers)
            .map(|i| LayerWeights::load(&cfg, |part| format!("blk.{i}.{part}.weight"), &GGUF_LAYER, &matrix, &vector))
            .collect::<Result<Vec<_>, ModelError>>()?;
        let embed = matrix("token_embd.weight", vocab, dim)?;
        let lm_head =
            if h.tensor("output.weight").is_some() { matrix("output.weight", vocab, dim)? } else { embed.clone() };
        let norm = vector("output_norm.weight", dim)?;
        Ok(Self::assemble(cfg, embed, layers, norm, lm_head))
    }
}
