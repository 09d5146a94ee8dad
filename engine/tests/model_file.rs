//! The default model file (fetched by `scripts/setup.sh`) reads as ENGINE-NOTES.md describes,
//! and damaged copies of it are clear errors.

use std::collections::BTreeMap;
use std::path::PathBuf;

use switchyard_engine::model::gguf::{GgmlType, GgufError, GgufFile};
use switchyard_engine::model::quant::{dequantize_row, dot_row, quantize_q8};
use switchyard_engine::model::{default_model_path, FETCH_COMMAND};

fn model() -> GgufFile {
    let path = default_model_path();
    assert!(path.exists(), "model file {} is missing: run `{FETCH_COMMAND}` first", path.display());
    GgufFile::open(&path).expect("the default model parses")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("switchyard-model-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn header_matches_the_published_facts() {
    let f = model();
    let h = &f.header;
    assert_eq!((h.version, h.tensors.len(), h.metadata.len()), (3, 272, 33));
    assert_eq!(h.str("general.architecture").unwrap(), "llama");
    for (key, want) in [
        ("llama.block_count", 30),
        ("llama.embedding_length", 576),
        ("llama.feed_forward_length", 1536),
        ("llama.attention.head_count", 9),
        ("llama.attention.head_count_kv", 3),
        ("llama.context_length", 8192),
        ("tokenizer.ggml.bos_token_id", 1),
        ("tokenizer.ggml.eos_token_id", 2),
    ] {
        assert_eq!(h.u64(key).unwrap(), want, "{key}");
    }
    assert_eq!(h.f64("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(h.str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(h.str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(h.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map(<[_]>::len), Some(49152));
    assert_eq!(h.get("tokenizer.ggml.merges").and_then(|v| v.as_array()).map(<[_]>::len), Some(48900));
    assert!(h.str("tokenizer.chat_template").unwrap().contains("<|im_start|>"));

    let mut by_type = BTreeMap::new();
    for t in &h.tensors {
        *by_type.entry(t.ty.to_string()).or_insert(0) += 1;
    }
    assert_eq!(by_type, BTreeMap::from([("F32".to_string(), 61), ("Q4_1".to_string(), 210), ("Q8_0".to_string(), 1)]));
    let emb = h.tensor("token_embd.weight").unwrap();
    assert_eq!((emb.ty, emb.dims.as_slice()), (GgmlType::Q8_0, &[576, 49152][..]));
    assert!(h.tensor("output.weight").is_none(), "the LM head is tied to the embedding");
}

#[test]
fn kernels_accept_the_real_tensors() {
    let f = model();
    let emb = f.header.tensor("token_embd.weight").unwrap().clone();
    let row_bytes = emb.ty.bytes_for(emb.row_len());
    let mut x = vec![0f32; emb.row_len()];
    dequantize_row(emb.ty, &f.data(&emb)[..row_bytes], &mut x).unwrap();
    assert!(x.iter().all(|v| v.is_finite()) && x.iter().any(|&v| v != 0.0));

    let q = f.header.tensor("blk.0.attn_q.weight").unwrap().clone();
    assert_eq!((q.ty, q.row_len(), q.rows()), (GgmlType::Q4_1, 576, 576));
    let mut xq = Vec::new();
    quantize_q8(&x, &mut xq);
    let qrow = q.ty.bytes_for(q.row_len());
    let mut w = vec![0f32; q.row_len()];
    for r in [0, 1, 575] {
        let bytes = &f.data(&q)[r * qrow..(r + 1) * qrow];
        dequantize_row(q.ty, bytes, &mut w).unwrap();
        let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        let norm: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
        let got = dot_row(q.ty, bytes, &x, &xq).unwrap();
        assert!((got - exact).abs() <= norm * 0.02, "row {r}: {got} vs {exact}");
    }
}

#[test]
fn truncated_and_corrupt_copies_are_clear_errors() {
    let bytes = std::fs::read(default_model_path()).unwrap_or_else(|_| panic!("run `{FETCH_COMMAND}` first"));
    let cut = scratch("truncated.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = GgufFile::open(&cut).unwrap_err();
    assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
    assert!(err.to_string().contains("tensor"), "names what is missing: {err}");

    let mut bad = bytes[..4096].to_vec();
    bad[..4].copy_from_slice(b"GGML");
    let corrupt = scratch("corrupt.gguf");
    std::fs::write(&corrupt, &bad).unwrap();
    assert!(matches!(GgufFile::open(&corrupt), Err(GgufError::BadMagic(_))));
    std::fs::remove_file(cut).unwrap();
    std::fs::remove_file(corrupt).unwrap();
}

#[test]
fn tokenizer_and_chat_template_come_from_the_file() {
    use switchyard_engine::tokenizer::{ChatMessage, LoadedTokenizer, ModelTokenizer, Tokenizer};
    let f = model();
    // As the engine runs it: piece by piece, pieces remembered.
    let t = LoadedTokenizer::new(ModelTokenizer::from_gguf(&f.header).unwrap());
    assert_eq!(t.eos_token_id(), 2);
    // Special tokens are single ids; digits are split one by one (the `smollm` pre-tokenizer).
    assert_eq!(t.encode("<|im_start|>"), vec![1]);
    let ids = t.encode("Hello world 2024!");
    let pieces: Vec<String> = ids.iter().map(|&i| t.decode(&[i])).collect();
    assert_eq!(pieces.concat(), "Hello world 2024!");
    assert!(pieces.ends_with(&["2".into(), "0".into(), "2".into(), "4".into(), "!".into()]), "{pieces:?}");
    assert_eq!(t.decode(&t.encode("naïve café — ✓")), "naïve café — ✓");

    let text = t.render_chat(&[ChatMessage { role: "user".into(), content: "Hi".into() }]).unwrap();
    assert!(text.starts_with("<|im_start|>system\n"), "the template adds its default system message: {text:?}");
    assert!(text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), "{text:?}");
}
