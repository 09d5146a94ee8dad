//! The `cpu` backend serving SmolLM2-135M-Instruct (fetched by `scripts/setup.sh`) through the
//! OpenAI API: the answers llama.cpp's `llama-server` gives with the same file, reproducible
//! sampling, batching that changes nothing, and clear errors for damaged files.

mod common;

use common::*;
use serde_json::{json, Value};
use switchyard_engine::model::{default_model_path, FETCH_COMMAND};

async fn engine() -> std::net::SocketAddr {
    let path = default_model_path();
    assert!(path.exists(), "model file {} is missing: run `{FETCH_COMMAND}` first", path.display());
    spawn_engine(&["--backend", "cpu", "--kv-cache-space", "0.25", "--max-model-len", "2048"]).await
}

async fn chat(addr: std::net::SocketAddr, body: Value) -> String {
    let resp = post(addr, "/v1/chat/completions", &body).await;
    let status = resp.status;
    let text = resp.text().await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

fn greedy(question: &str, max_tokens: u32) -> Value {
    json!({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
           "temperature": 0, "max_tokens": max_tokens})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_answers_match_llama_server() {
    let addr = engine().await;
    let paris = chat(addr, greedy("Which city is the capital of France? Answer with one word.", 8)).await;
    assert_eq!(paris.trim_end_matches('.'), "Paris", "got {paris:?}");
    let four = chat(addr, greedy("What is 2 plus 2?", 24)).await;
    assert!(four.contains('4'), "got {four:?}");
    let colors = chat(addr, greedy("Name three colors.", 16)).await;
    assert_eq!(colors, "1. Red\n2. Blue\n3. Green", "got {colors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_repeats_and_batching_changes_nothing() {
    let addr = engine().await;
    let sampled = json!({"messages": [{"role": "user", "content": "Write a short poem about the sea."}],
                         "temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 12});
    let a = chat(addr, sampled.clone()).await;
    let b = chat(addr, sampled).await;
    assert_eq!(a, b);
    assert!(!a.is_empty());

    let questions: Vec<String> = [
        "What is the capital of Italy?",
        "Name a fruit.",
        "What color is the sky?",
        "Say hello.",
        "What is 3 times 3?",
        "Name an animal.",
        "What day comes after Monday?",
        "Spell cat.",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut alone = Vec::new();
    for q in &questions {
        alone.push(chat(addr, greedy(q, 6)).await);
    }
    let together = futures_util::future::join_all(questions.iter().map(|q| chat(addr, greedy(q, 6)))).await;
    assert_eq!(alone, together);
}

#[test]
fn a_corrupt_model_file_is_a_clear_error_and_a_failed_exit() {
    let dir = std::env::temp_dir().join(format!("switchyard-cpu-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.gguf");
    let bytes = std::fs::read(default_model_path()).unwrap_or_else(|_| panic!("run `{FETCH_COMMAND}` first"));
    std::fs::write(&bad, &bytes[..1 << 20]).unwrap();
    for (file, want) in [(bad.clone(), "truncated"), (dir.join("absent.gguf"), "No such file")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard-engine"))
            .args(["--backend", "cpu", "--host", "127.0.0.1", "--port", "0", "--model"])
            .arg(&file)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{file:?} must fail");
        assert!(stderr.contains(want) && stderr.contains(file.to_str().unwrap()), "{file:?}: {stderr}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
