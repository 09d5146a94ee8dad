//! Tensor parallelism on the real model: SmolLM2-135M (9 heads, 3 K/V heads) split over 3
//! ranks gives the greedy tokens and the very logits (bit for bit; the bar is 1e-4
//! relative) of one rank on the llama.cpp fixture's prompts, 32 greedy steps each; N = 2 is refused at start-up with the numbers; a rank
//! that dies takes the engine down with a failed exit instead of a hang.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use switchyard_engine::backend::cpu::{argmax, load};
use switchyard_engine::backend::tp_group::{TpGroup, FAIL_RANK_ENV};
use switchyard_engine::model::llama::SeqInput;
use switchyard_engine::model::{default_model_path, FETCH_COMMAND};

const STEPS: usize = 32;
const BLOCK: usize = 16;

#[test]
fn three_ranks_match_one_on_the_fixture_prompts() {
    let path = default_model_path();
    assert!(path.exists(), "model file {} is missing: run `{FETCH_COMMAND}` first", path.display());
    let model = load(&path).unwrap().model;
    let fixture: Value = serde_json::from_str(include_str!("fixtures/llama_cpp_smollm2.json")).unwrap();
    let mut group = TpGroup::spawn(&model, 3, 2, 64, BLOCK).unwrap();
    let mut worst = 0f32;
    for (i, p) in fixture["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt: Vec<u32> = p["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        // Same block ids for both: each run has its own cache (rank caches hold their heads).
        let table: Vec<u32> = (0..(prompt.len() + STEPS).div_ceil(BLOCK) as u32).collect();
        let mut kv = model.kv_store(64, BLOCK);
        let (mut one_toks, mut tp_toks) = (prompt.clone(), prompt.clone());
        let mut start = 0;
        for step in 0..STEPS {
            let one = model
                .forward(
                    &mut kv,
                    &[SeqInput { tokens: &one_toks[start..], start, block_table: &table, logits: true, pool: false }],
                )
                .unwrap()
                .remove(0);
            let tp = group
                .forward(&[SeqInput {
                    tokens: &tp_toks[start..],
                    start,
                    block_table: &table,
                    logits: true,
                    pool: false,
                }])
                .unwrap()
                .remove(0);
            assert_eq!(tp.len(), one.len());
            let scale = one.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = tp.iter().zip(&one).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(diff / scale);
            assert!(diff <= 1e-4 * scale, "prompt {i} step {step}: max |Δlogit| {diff} vs scale {scale}");
            assert!(
                tp.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                "prompt {i} step {step}: not bit-identical"
            );
            let (a, b) = (argmax(&one), argmax(&tp));
            assert_eq!(a, b, "prompt {i} step {step}: greedy token");
            start = one_toks.len();
            one_toks.push(a);
            tp_toks.push(b);
        }
    }
    eprintln!(
        "worst max|Δlogit| / max|logit| over all steps: {worst:.2e}; all-reduce time {:.3}s",
        group.comm_seconds()
    );
}

fn engine(extra: &[&str], env: Option<(&str, &str)>) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_switchyard-engine"));
    c.args(["--backend", "cpu", "--host", "127.0.0.1", "--port", "0", "--threads", "2", "--kv-cache-space", "0.05"])
        .args(extra);
    if let Some((k, v)) = env {
        c.env(k, v);
    }
    c
}

#[test]
fn a_size_that_does_not_fit_is_refused_at_start() {
    let out = engine(&["--tensor-parallel-size", "2"], None).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--tensor-parallel-size 2: the model's 9 attention heads do not divide by 2")
            && stderr.contains("sizes that fit this model: 1, 3"),
        "{stderr}"
    );
}

#[test]
fn a_rank_that_panics_ends_the_engine_with_a_failed_exit() {
    let mut child = engine(&["--tensor-parallel-size", "3"], Some((FAIL_RANK_ENV, "1")))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("the engine prints its address").unwrap();
        if let Some(a) = line.strip_prefix("listening on http://") {
            break a.to_string();
        }
    };
    // One request: rank 1 panics in the first step; the client gets an error, not a hang.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = r#"{"prompt": "Hello", "max_tokens": 4}"#;
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the engine did not exit after its rank failed");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(!status.success(), "exit status {status}");
    assert!(stderr.contains("rank 1 failed"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_with_three_ranks_answers_like_one() {
    let flags = ["--backend", "cpu", "--kv-cache-space", "0.05", "--max-model-len", "512", "--threads", "2"];
    let one = common::spawn_engine(&flags).await;
    let mut tp_flags = flags.to_vec();
    tp_flags.extend(["--tensor-parallel-size", "3"]);
    let three = common::spawn_engine(&tp_flags).await;
    for q in ["Which city is the capital of France? Answer with one word.", "Name three colors."] {
        let body = serde_json::json!({"messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 12,
                                      "logprobs": true, "top_logprobs": 3});
        let a = common::post(one, "/v1/chat/completions", &body).await.json().await;
        let b = common::post(three, "/v1/chat/completions", &body).await.json().await;
        assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"], "{q}");
        assert_eq!(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"], "{q}: the same log probabilities");
    }
}
