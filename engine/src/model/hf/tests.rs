//! A tiny Llama checkpoint written as an HF directory loads and computes what the same
//! weights assembled directly compute.

use super::*;
use crate::model::llama::{KvStore, SeqInput};
use crate::tokenizer::ChatMessage;

const V: usize = 40;

struct Ckpt {
    dir: PathBuf,
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
}

fn lcg(s: &mut u64) -> f32 {
    *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
}

fn checkpoint(name: &str, tie: bool) -> Ckpt {
    let dir = std::env::temp_dir().join(format!("switchyard-hf-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (d, kv, f, layers) = (16usize, 8usize, 32usize, 2usize);
    let mut s = 3u64;
    let mut tensors = Vec::new();
    let mut add = |n: String, shape: Vec<usize>, s: &mut u64, norm: bool| {
        let len = shape.iter().product();
        let v: Vec<f32> = (0..len).map(|_| if norm { 1.0 + lcg(s) } else { lcg(s) }).collect();
        tensors.push((n, shape, v));
    };
    add("model.embed_tokens.weight".into(), vec![V, d], &mut s, false);
    for i in 0..layers {
        let p = |x: &str| format!("model.layers.{i}.{x}.weight");
        add(p("input_layernorm"), vec![d], &mut s, true);
        add(p("self_attn.q_proj"), vec![d, d], &mut s, false);
        add(p("self_attn.k_proj"), vec![kv, d], &mut s, false);
        add(p("self_attn.v_proj"), vec![kv, d], &mut s, false);
        add(p("self_attn.o_proj"), vec![d, d], &mut s, false);
        add(p("post_attention_layernorm"), vec![d], &mut s, true);
        add(p("mlp.gate_proj"), vec![f, d], &mut s, false);
        add(p("mlp.up_proj"), vec![f, d], &mut s, false);
        add(p("mlp.down_proj"), vec![d, f], &mut s, false);
    }
    add("model.norm.weight".into(), vec![d], &mut s, true);
    if !tie {
        add("lm_head.weight".into(), vec![V, d], &mut s, false);
    }
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, sh, v)| (n.clone(), sh.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, sh, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, sh.clone(), b).unwrap())
        })
        .collect();
    std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": d, "intermediate_size": f,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": layers, "vocab_size": V,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "tie_word_embeddings": tie,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut vocab = serde_json::Map::new();
    vocab.insert("<eos>".into(), 0.into());
    for (i, c) in "abcdefghijklmnopqrstuvwxyz<>/".chars().enumerate() {
        vocab.insert(c.to_string(), (i + 1).into());
    }
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false,
                          "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []},
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let tc = serde_json::json!({"eos_token": {"content": "<eos>"},
        "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content | upper | lower }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"});
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    Ckpt { dir, tensors }
}

fn f32_matrix(t: &(String, Vec<usize>, Vec<f32>)) -> Matrix {
    let bytes: Vec<u8> = t.2.iter().flat_map(|x| x.to_le_bytes()).collect();
    Matrix::new(Arc::new(bytes), 0, GgmlType::F32, t.1[0], t.1[1]).unwrap()
}

fn run(m: &Llama, toks: &[u32]) -> Vec<f32> {
    let mut kv = KvStore::new(&m.cfg, 8, 4);
    m.forward(&mut kv, &[SeqInput { tokens: toks, start: 0, block_table: &[0, 1, 2], logits: true, pool: false }])
        .unwrap()
        .remove(0)
}

#[test]
fn loads_and_computes_like_the_same_weights_assembled_by_hand() {
    for tie in [false, true] {
        let ck = checkpoint(if tie { "tied" } else { "untied" }, tie);
        let (m, tok) = load(&ck.dir).unwrap();
        assert_eq!((m.cfg.n_layers, m.cfg.dim, m.cfg.n_kv_heads, m.cfg.rope), (2, 16, 2, RopeStyle::NeoX));
        let get = |n: &str| ck.tensors.iter().find(|t| t.0 == n).unwrap();
        let layers = (0..2)
            .map(|i| {
                let p = |x: &str| format!("model.layers.{i}.{x}.weight");
                LayerWeights {
                    attn_norm: get(&p("input_layernorm")).2.clone(),
                    wq: f32_matrix(get(&p("self_attn.q_proj"))),
                    wk: f32_matrix(get(&p("self_attn.k_proj"))),
                    wv: f32_matrix(get(&p("self_attn.v_proj"))),
                    wo: f32_matrix(get(&p("self_attn.o_proj"))),
                    ffn_norm: get(&p("post_attention_layernorm")).2.clone(),
                    w_gate: f32_matrix(get(&p("mlp.gate_proj"))),
                    w_up: f32_matrix(get(&p("mlp.up_proj"))),
                    w_down: f32_matrix(get(&p("mlp.down_proj"))),
                }
            })
            .collect();
        let embed = f32_matrix(get("model.embed_tokens.weight"));
        let head = if tie { embed.clone() } else { f32_matrix(get("lm_head.weight")) };
        let by_hand = Llama::assemble(m.cfg.clone(), embed, layers, get("model.norm.weight").2.clone(), head);
        let toks = [3, 1, 4, 1, 5, 9, 2, 6];
        assert_eq!(run(&m, &toks), run(&by_hand, &toks));

        assert_eq!(tok.eos_token_id(), 0);
        assert_eq!(tok.encode("abc"), vec![1, 2, 3]);
        let text = tok.render(&[ChatMessage { role: "user".into(), content: "Hi".into() }]).unwrap();
        assert_eq!(text, "<user>hi<a>");
        std::fs::remove_dir_all(&ck.dir).unwrap();
    }
}

#[test]
fn broken_checkpoints_name_what_is_wrong() {
    let ck = checkpoint("broken", false);
    let st = ck.dir.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() - 10]).unwrap();
    let err = load(&ck.dir).unwrap_err();
    assert!(err.to_string().contains("model.safetensors"), "{err}");

    std::fs::remove_file(&st).unwrap();
    assert!(load(&ck.dir).unwrap_err().to_string().contains("no *.safetensors"));

    std::fs::write(ck.dir.join("config.json"), r#"{"architectures": ["GPT2LMHeadModel"], "hidden_size": 16}"#).unwrap();
    assert!(load(&ck.dir).unwrap_err().to_string().contains("config.json"));
    std::fs::remove_dir_all(&ck.dir).unwrap();
}
