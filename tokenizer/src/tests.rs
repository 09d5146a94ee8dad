//! `load` over the three kinds of path, and what it says when a file is wrong.

use super::*;

/// A scratch directory holding a small Hugging Face tokenizer (letters as tokens) and its
/// config with a chat template.
fn hf_dir(name: &str, config: Option<&str>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("switchyard-tokenizer-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut vocab = serde_json::Map::new();
    vocab.insert("<eos>".into(), 0.into());
    for (i, c) in "abcdefghijklmnopqrstuvwxyz<>/ ".chars().enumerate() {
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
    if let Some(config) = config {
        std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
    }
    dir
}

const CONFIG: &str = r#"{"eos_token": {"content": "<eos>"},
  "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"}"#;

fn user(text: &str) -> Vec<ChatMessage> {
    vec![ChatMessage { role: "user".into(), content: text.into() }]
}

#[test]
fn a_directory_and_its_tokenizer_json_load_the_same_tokenizer_and_template() {
    let dir = hf_dir("dir", Some(CONFIG));
    for t in [load(&dir).unwrap(), load(&dir.join("tokenizer.json")).unwrap()] {
        assert!(t.has_chat_template());
        let text = t.render(&user("hi")).unwrap();
        assert_eq!(text, "<user>hi<a>");
        // `<eos>` is an added token: matched whole; letters one id each.
        assert_eq!(t.encode("ab<eos>"), vec![1, 2, 0]);
        assert_eq!(t.eos_token_id(), 0);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn without_a_template_chat_is_rendered_as_chatml() {
    let dir = hf_dir("chatml", Some(r#"{"eos_token": "<eos>"}"#));
    let t = load(&dir).unwrap();
    assert!(!t.has_chat_template());
    assert_eq!(t.render(&user("hi")).unwrap(), render_chatml(&user("hi")));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_bad_file_is_an_error_that_names_it() {
    let missing = std::env::temp_dir().join("switchyard-tokenizer-no-such-file.json");
    let e = load(&missing).unwrap_err();
    assert!(matches!(e, TokenizerError::Io { .. }) && e.to_string().contains("no-such-file"), "{e}");

    let dir = hf_dir("badconfig", Some("{not json"));
    let e = load(&dir).unwrap_err();
    assert!(matches!(e, TokenizerError::Format { .. }) && e.to_string().contains("tokenizer_config.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = hf_dir("badtemplate", Some(r#"{"eos_token": "<eos>", "chat_template": "{% for %}"}"#));
    assert!(matches!(load(&dir).unwrap_err(), TokenizerError::Template(_)));
    std::fs::remove_dir_all(&dir).unwrap();

    // Four bytes that say GGUF and nothing after them.
    let cut = std::env::temp_dir().join(format!("switchyard-tokenizer-cut-{}.gguf", std::process::id()));
    std::fs::write(&cut, b"GGUF\x03\x00").unwrap();
    assert!(matches!(load(&cut).unwrap_err(), TokenizerError::Gguf(_)));
    std::fs::remove_file(cut).unwrap();
}

/// The model `scripts/setup.sh` fetches (the test suite's command runs it first).
fn default_model() -> ModelTokenizer {
    let path = std::env::var_os("SWITCHYARD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/models"))
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    load(&path).unwrap_or_else(|e| panic!("{e} (scripts/setup.sh fetches the model)"))
}

#[test]
fn piecewise_tokenization_with_a_cache_gives_the_whole_texts_ids() {
    let t = default_model();
    let cache = PieceCache::new(1 << 20);
    let system: String = (0..40).map(|i| format!("Rule {i}: never say 'x{i}' twice; café ✓ 2024. ")).collect();
    for n in 0..60 {
        let mut chat = vec![ChatMessage { role: "system".into(), content: system.clone() }];
        for turn in 0..(n % 4) {
            chat.push(ChatMessage { role: "user".into(), content: format!("question {turn} of {n}: why   <not>?\n") });
            chat.push(ChatMessage { role: "assistant".into(), content: format!("because {turn}{n}!  ") });
        }
        chat.push(ChatMessage { role: "user".into(), content: format!("and now {n}?") });
        let text = t.render(&chat).unwrap();
        assert_eq!(t.encode_cached(&text, &cache), t.encode(&text), "conversation {n}");
    }
    let (hits, misses) = cache.counts();
    assert!(!cache.is_off(), "every checked result agreed");
    assert!(hits > 50 && misses < 40, "the shared system prompt is tokenized once: {hits} hits, {misses} misses");
}

/// The hand-scanned split with the BPE model gives `tokenizers`' ids, on text mixing
/// scripts, numbers, white space and contractions (the split itself is checked against
/// `tokenizers`' pre-tokenizers on random text in `split`).
#[test]
fn the_fast_path_gives_tokenizers_ids() {
    let t = default_model();
    assert!(t.splits_by_hand(), "a GGUF byte-level BPE takes the fast path");
    let words = [
        "Hello",
        " world",
        "it's",
        " they're",
        "  ",
        "\n\n",
        "\t",
        " 2024",
        "½",
        "café",
        " ✓",
        "日本語",
        "😀",
        "!!",
        " 'S",
        "\u{A0}",
        "x",
        "  end ",
        "Ⅻ",
        "\r\n",
    ];
    let mut state = 7u64;
    for n in 0..3000 {
        let len = n % 17;
        let text: String = (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                words[(state >> 33) as usize % words.len()]
            })
            .collect();
        assert_eq!(t.encode_text(&text), t.encode(&text), "{text:?}");
    }
}

#[test]
fn the_default_model_file_loads_by_its_path() {
    let t = default_model();
    assert!(t.has_chat_template());
    assert_eq!(t.encode("<|im_start|>"), vec![1]);
    let text = t.render(&user("Hi")).unwrap();
    assert!(text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), "{text:?}");
}

#[test]
fn every_tokens_bytes_spell_the_text_it_encodes() {
    let t = default_model();
    let bytes = t.token_bytes();
    assert_eq!(bytes.len(), t.vocab_len());
    for text in ["Hello, world!\n", "  {\"name\": \"café ✓\", \"n\": 2024}", "日本語のテキスト\t\r\n", "a\u{1F600}b"]
    {
        let ids = t.encode(text);
        let spelled: Vec<u8> = ids.iter().flat_map(|&id| bytes[id as usize].clone()).collect();
        assert_eq!(spelled, text.as_bytes(), "{text:?} → {ids:?}");
    }
    let special = t.encode("<|im_start|>")[0];
    assert_eq!(bytes[special as usize][0], crate::vocab::SPECIAL_MARKER);
}

#[test]
fn a_template_that_reads_tools_renders_them_and_earlier_calls() {
    let config = r#"{"eos_token": "<eos>", "chat_template": "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}<a>"}"#;
    let dir = hf_dir("tools", Some(config));
    let t = load(&dir).unwrap();
    assert!(t.renders_tools());
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather"}}]);
    let messages = [
        serde_json::json!({"role": "user", "content": "hi"}),
        serde_json::json!({"role": "assistant", "content": null,
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}),
    ];
    let text = t.render_with_tools(&messages, &tools).unwrap();
    assert_eq!(text, r#"<tools>get_weather <user>hi<assistant>call get_weather {"city":"Oslo"}<a>"#);
    // The plain template of the other tests does not read tools: refused, not ignored.
    let plain = load(&hf_dir("no-tools", Some(CONFIG))).unwrap();
    assert!(!plain.renders_tools());
    assert!(plain.render_with_tools(&messages, &tools).is_err());
    std::fs::remove_dir_all(dir).unwrap();
}
