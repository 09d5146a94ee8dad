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

/// The `data:` payloads of an SSE body, `[DONE]` excluded.
fn sse_events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_follow_openai_and_agree_with_greedy_choice() {
    let addr = engine().await;
    let body = json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 3});
    let r = post(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200);
    let v = r.json().await;
    let choice = &v["choices"][0];
    let lp = &choice["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap(), "{lp}");
    assert_eq!(tokens.concat(), choice["text"].as_str().unwrap(), "token texts spell the completion");
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], offset);
        offset += t.len();
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!((3..=4).contains(&top.len()), "3 alternatives plus the chosen token: {top:?}");
        let best = top.values().map(|x| x.as_f64().unwrap()).fold(f64::NEG_INFINITY, f64::max);
        assert!(
            chosen <= 0.0 && (chosen - best).abs() < 1e-6,
            "greedy picks the most likely token: {chosen} vs {best}"
        );
        assert_eq!(top[*t].as_f64().unwrap(), chosen);
        let mass: f64 = top.values().map(|x| x.as_f64().unwrap().exp()).sum();
        assert!(mass <= 1.0 + 1e-5, "probabilities of distinct tokens sum to at most 1: {mass}");
    }

    // Streamed, the chunks carry the same entries in order.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(addr, "/v1/completions", &streamed).await;
    assert_eq!(r.status, 200);
    let events = sse_events(&r.text().await);
    let mut got: Vec<Value> = Vec::new();
    for e in &events {
        if let Some(l) = e["choices"][0]["logprobs"].as_object() {
            got.extend(l["token_logprobs"].as_array().unwrap().iter().cloned());
        }
    }
    assert_eq!(Value::Array(got), lp["token_logprobs"], "streamed and whole responses agree");

    // Chat: `logprobs: true` with `top_logprobs: n`.
    let mut chat_body = greedy("Which city is the capital of France? Answer with one word.", 4);
    chat_body["logprobs"] = json!(true);
    chat_body["top_logprobs"] = json!(2);
    let r = post(addr, "/v1/chat/completions", &chat_body).await;
    assert_eq!(r.status, 200);
    let v = r.json().await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    assert_eq!(content[0]["token"], "Paris");
    assert_eq!(content[0]["bytes"], json!(b"Paris".to_vec()));
    let top = content[0]["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 2);
    assert_eq!(top[0]["token"], "Paris");
    assert!(top[0]["logprob"].as_f64().unwrap() >= top[1]["logprob"].as_f64().unwrap());
    // Without logprobs the field is null.
    let v = post(addr, "/v1/chat/completions", &greedy("Say hello.", 2)).await.json().await;
    assert!(v["choices"][0]["logprobs"].is_null());

    for (path, body, needle) in [
        ("/v1/completions", json!({"prompt": "a", "logprobs": 21}), "logprobs must be an integer in [0, 20]"),
        ("/v1/completions", json!({"prompt": "a", "logprobs": true}), "logprobs must be an integer"),
        ("/v1/completions", json!({"prompt": "a", "top_logprobs": 2}), "top_logprobs is a chat parameter"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}),
            "needs logprobs",
        ),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "a"}], "logprobs": 2}), "boolean"),
    ] {
        let r = post(addr, path, &body).await;
        assert_eq!(r.status, 400);
        let v = r.json().await;
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{body}: {msg:?} should mention {needle:?}");
    }
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

/// `/v1/embeddings` on SmolLM2: unit vectors of the model's width, meaning-ordered, the same
/// whether computed alone, in a batch, in prefill chunks or as base64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_are_pooled_hidden_states_that_order_by_meaning() {
    let addr = engine().await;
    let embed = async |addr, body: Value| -> Vec<Vec<f32>> {
        let r = post(addr, "/v1/embeddings", &body).await.json().await;
        let data = r["data"].as_array().unwrap_or_else(|| panic!("{r}"));
        data.iter()
            .map(|d| match &d["embedding"] {
                Value::String(b64) => {
                    use base64::Engine as _;
                    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
                    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
                }
                v => v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect(),
            })
            .collect()
    };
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let e = embed(addr, json!({"input": ["cat", "kitten", "carburetor"]})).await;
    assert_eq!(e[0].len(), 576, "SmolLM2-135M's hidden width");
    for v in &e {
        assert!((dot(v, v) - 1.0).abs() < 1e-4, "L2-normalized");
    }
    let (near, far) = (dot(&e[0], &e[1]), dot(&e[0], &e[2]));
    eprintln!("cos(cat, kitten) = {near:.4}, cos(cat, carburetor) = {far:.4}");
    assert!(near > far, "cat is nearer kitten ({near}) than carburetor ({far})");
    // Alone, base64, or as token ids: the same vector.
    let alone = embed(addr, json!({"input": "kitten", "encoding_format": "base64"})).await;
    assert!(dot(&alone[0], &e[1]) > 0.9999);
    // A long input computed in prefill chunks (another engine, 64-token steps) and after a
    // request that cached its prefix: still the mean over every token.
    let text: String = (0..60).map(|i| format!("sentence {i} about cats. ")).collect();
    let whole = embed(addr, json!({"input": text})).await;
    let chunked_engine = spawn_engine(&[
        "--backend",
        "cpu",
        "--max-num-batched-tokens",
        "64",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "2048",
    ])
    .await;
    let _warm = post(chunked_engine, "/v1/completions", &json!({"prompt": text, "max_tokens": 1})).await.text().await;
    let chunked = embed(chunked_engine, json!({"input": text})).await;
    assert!(dot(&whole[0], &chunked[0]) > 0.9999, "chunked prefill pools the same tokens");
    // Bad input, by name.
    for (body, param) in [
        (json!({"input": "a", "dimensions": 8}), "dimensions"),
        (json!({"input": "a", "encoding_format": "hex"}), "encoding_format"),
        (json!({"input": []}), "input"),
        (json!({"input": ["a", ""]}), "input[1]"),
        (json!({"input": [[1, 99999999]]}), "input"),
    ] {
        let r = post(addr, "/v1/embeddings", &body).await;
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(r.json().await["error"]["param"], param, "{body}");
    }
}
