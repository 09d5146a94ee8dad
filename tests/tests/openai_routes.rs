//! Every OpenAI route through the gateway (#21): the official `openai` Python SDK against an
//! engine that answers each route; the bytes engines send arrive unchanged and the bytes
//! clients send reach the engine unchanged, streamed or not, JSON or multipart; bad input
//! gets a 4xx in the OpenAI shape.

use bytes::Bytes;
use serde_json::{json, Value};
use switchyard_testkit::*;

const KEY: &str = "sk-routes-0123456789";

fn cards() -> Vec<Value> {
    ["llama", "embedder", "whisper", "reranker"].into_iter().map(model_card).collect()
}

/// A multipart upload with `fields` (name, value) and a file part first.
fn form(boundary: &str, fields: &[(&str, &str)]) -> Vec<u8> {
    let mut b = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
         Content-Type: audio/wav\r\n\r\nRIFF\r\n--{boundary}-ish\x00\r\n"
    )
    .into_bytes();
    for (name, value) in fields {
        b.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").as_bytes(),
        );
    }
    b.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdk_reaches_every_route_and_bytes_cross_unchanged() {
    let engine = RouteEngine::start("e1", cards()).await;
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new().backends([engine.url()]).api_key(ApiKey::new("team", &sha256(KEY))),
    );
    wait_scraped(&g, 1).await;

    // The SDK, as a user calls it.
    let python = workspace_root().join(".cache/openai-venv/bin/python");
    assert!(python.exists(), "{} is missing: run scripts/setup.sh (it installs the openai SDK)", python.display());
    let out = tokio::process::Command::new(&python)
        .arg(workspace_root().join("tests/openai_sdk.py"))
        .arg(format!("http://{}", g.addr))
        .arg(KEY)
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai_sdk.py failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    let ok = |name: &str| r[name]["ok"].clone();
    for name in ["chat", "chat_stream", "completion", "completion_stream", "responses", "responses_stream"] {
        assert_eq!(ok(name), "from e1", "{name}: {}", r[name]);
    }
    assert_eq!(ok("transcription"), "from e1", "{}", r["transcription"]);
    assert_eq!(ok("transcription_stream"), "from e1", "{}", r["transcription_stream"]);
    assert_eq!(ok("embeddings"), json!([0.25, -0.5, 0.125]), "{}", r["embeddings"]);
    assert_eq!(ok("rerank"), 0.75, "{}", r["rerank"]);
    assert_eq!(ok("rerank_root"), 1, "{}", r["rerank_root"]);
    assert_eq!(ok("tokenize"), json!([101, 2023, 102]), "{}", r["tokenize"]);
    assert_eq!(ok("models"), json!(["embedder", "llama", "reranker", "whisper"]), "{}", r["models"]);
    assert_eq!(ok("model"), "vllm", "{}", r["model"]);
    let unknown = &r["unknown_model"];
    assert_eq!(
        (unknown["status"].as_u64(), unknown["code"].as_str()),
        (Some(404), Some("model_not_found")),
        "{unknown}"
    );
    let paths: Vec<String> = engine.answered().iter().map(|a| a.path.clone()).collect();
    for p in ["/v1/embeddings", "/v1/responses", "/v1/audio/transcriptions", "/v1/rerank", "/rerank", "/tokenize"] {
        assert!(paths.iter().any(|x| x == p), "{p} never reached the engine: {paths:?}");
    }
    // The engine never saw the key.
    assert!(engine.answered().iter().all(|a| a.headers.iter().all(|(k, _)| k != "authorization")));

    // Byte for byte, each way, every route, streamed and not.
    let auth = format!("Bearer {KEY}");
    let json_routes: Vec<(&str, Value)> = vec![
        ("/v1/chat/completions", json!({"model": "llama", "messages": [{"role": "user", "content": "hé"}]})),
        ("/v1/chat/completions", json!({"model": "llama", "messages": [], "stream": true})),
        ("/v1/completions", json!({"model": "llama", "prompt": "x", "stream": true})),
        ("/v1/embeddings", json!({"model": "embedder", "input": ["a", "b"], "encoding_format": "float"})),
        ("/v1/responses", json!({"model": "llama", "input": "hi", "instructions": "be brief"})),
        ("/v1/responses", json!({"model": "llama", "input": "hi", "stream": true})),
        ("/v1/rerank", json!({"model": "reranker", "query": "q", "documents": ["a", "b"]})),
        ("/v2/rerank", json!({"model": "reranker", "query": "q", "documents": ["a"]})),
        ("/score", json!({"model": "reranker", "text_1": "a", "text_2": "b"})),
        ("/tokenize", json!({"model": "llama", "prompt": "hi"})),
        ("/detokenize", json!({"model": "llama", "tokens": [1, 2]})),
        ("/pooling", json!({"model": "embedder", "input": "x"})),
        ("/classify", json!({"model": "embedder", "input": "x"})),
        ("/v1/some/future/route?beta=1", json!({"model": "llama", "x": 1})),
    ];
    for (path, body) in json_routes {
        let sent = body.to_string();
        let r = send_with(g.addr, "POST", path, &[("authorization", &auth)], sent.clone()).await;
        assert_eq!(r.status, 200, "{path}");
        let got = r.text().await;
        let last = engine.answered().pop().unwrap();
        assert_eq!(last.path, path);
        assert_eq!(last.body, Bytes::from(sent), "{path}: the request body changed on the way");
        assert_eq!(got.as_bytes(), &last.answer[..], "{path}: the response changed on the way");
    }
    for stream in ["false", "true"] {
        let body = form("b0undary", &[("model", "whisper"), ("stream", stream), ("language", "en")]);
        let ct = "multipart/form-data; boundary=b0undary";
        let headers = [("authorization", auth.as_str()), ("content-type", ct)];
        let r = send_with(g.addr, "POST", "/v1/audio/transcriptions", &headers, body.clone()).await;
        assert_eq!(r.status, 200);
        let got = r.text().await;
        let last = engine.answered().pop().unwrap();
        assert_eq!(last.body, Bytes::from(body), "the upload changed on the way");
        assert_eq!(got.as_bytes(), &last.answer[..]);
    }
    // The access log names the model of every route.
    eventually("the upload is logged with its model", async || g.log().contains("\"model\":\"whisper\"")).await;
}

/// Method, path, headers, body, the status expected and what its message must say.
type BadCase = (&'static str, &'static str, Vec<(&'static str, &'static str)>, Vec<u8>, u16, &'static str);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_any_route_gets_a_4xx_in_the_openai_shape() {
    let engine = RouteEngine::start("e1", cards()).await;
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new().backends([engine.url()]).section("limits", "{ max_body_bytes: 1048576 }"),
    );
    wait_scraped(&g, 1).await;
    let ct = |v: &'static str| [("content-type", v)];
    let cases: Vec<BadCase> = vec![
        // Several models are served: a body without one cannot be routed.
        ("POST", "/v1/embeddings", vec![], br#"{"input":"x"}"#.to_vec(), 400, "model"),
        (
            "POST",
            "/v1/audio/transcriptions",
            ct("multipart/form-data; boundary=b").to_vec(),
            form("b", &[("language", "en")]),
            400,
            "model",
        ),
        ("POST", "/v1/audio/transcriptions", ct("multipart/form-data").to_vec(), form("b", &[]), 400, "boundary"),
        (
            "POST",
            "/v1/audio/transcriptions",
            ct("multipart/form-data; boundary=b").to_vec(),
            b"--b\r\nno end".to_vec(),
            400,
            "multipart",
        ),
        (
            "POST",
            "/v1/audio/transcriptions",
            ct("multipart/form-data; boundary=b").to_vec(),
            form("b", &[("model", "whisper"), ("model", "llama")]),
            400,
            "twice",
        ),
        ("POST", "/v1/embeddings", vec![], br#"{"model":"emb\u0001edder","input":"x"}"#.to_vec(), 400, "control"),
        (
            "POST",
            "/v1/embeddings",
            vec![],
            format!(r#"{{"model":"{}"}}"#, "m".repeat(300)).into_bytes(),
            400,
            "at most",
        ),
        ("POST", "/v1/embeddings", vec![], b"{\"model\":\"\xff\"}".to_vec(), 400, "UTF-8"),
        ("POST", "/v1/embeddings", vec![], br#"{"model":"gpt-nothing","input":"x"}"#.to_vec(), 404, "gpt-nothing"),
        ("POST", "/v1/load_lora_adapter", vec![], br#"{"lora_name":"x","lora_path":"/tmp"}"#.to_vec(), 404, "no route"),
        ("GET", "/v1/embeddings", vec![], Vec::new(), 405, "GET"),
        ("GET", "/v1/models/nope", vec![], Vec::new(), 404, "nope"),
    ];
    let before = engine.answered().len();
    for (method, path, headers, body, status, says) in cases {
        let r = send_with(g.addr, method, path, &headers, body).await;
        assert_eq!(r.status, status, "{method} {path} ({says})");
        let v = r.json().await;
        let message = v["error"]["message"].as_str().unwrap_or_else(|| panic!("{path}: not the OpenAI shape: {v}"));
        assert!(message.contains(says), "{path}: {message:?} does not say {says:?}");
        assert!(!message.contains(&engine.addr.to_string()), "{message} names an engine");
    }
    // An upload past the body limit: 413 from its Content-Length, before the body is read
    // (the head and the start of the form only: the gateway answers and closes).
    let head = format!(
        "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: g\r\nContent-Type: multipart/form-data; boundary=b\r\n\
         Content-Length: {}\r\n\r\n",
        2 << 20
    );
    let mut start = head.into_bytes();
    start.extend_from_slice(&form("b", &[("model", "whisper")]));
    let (reply, _) = raw_exchange(g.addr, &start, std::time::Duration::from_secs(10)).await;
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply:.200}");
    assert!(reply.contains("\"error\""), "the OpenAI shape: {reply:.400}");
    assert_eq!(engine.answered().len(), before, "none of it reached the engine");
    // The model list is the engine's, objects as it described them.
    let models = send(g.addr, "GET", "/v1/models", Bytes::new()).await.json().await;
    let llama = models["data"].as_array().unwrap().iter().find(|m| m["id"] == "llama").cloned().unwrap();
    assert_eq!(llama, model_card("llama"));
    let one = send(g.addr, "GET", "/v1/models/llama", Bytes::new()).await.json().await;
    assert_eq!(one, model_card("llama"));
}

/// Requests each engine answered for `model` (by what its body named).
fn answered_for(e: &RouteEngine, model: &str) -> usize {
    e.answered().iter().filter(|a| serde_json::from_slice::<Value>(&a.body).is_ok_and(|b| b["model"] == model)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_adapters_and_a_weighted_split_route_where_they_are_served() {
    // e1 and e2 serve model-a and its adapter sql-lora; only e2 has the adapter loaded.
    // e3 serves model-b.
    let a = vec![model_card("model-a"), adapter_card("sql-lora", "model-a")];
    let (e1, e2) = (RouteEngine::start("e1", a.clone()).await, RouteEngine::start("e2", a).await);
    let e3 = RouteEngine::start("e3", vec![model_card("model-b")]).await;
    e2.set_running_adapters(&["sql-lora"]);
    let split = "{ chat-default: { targets: [ { model: model-a, weight: 90 }, { model: model-b, weight: 10 } ] }, \
                 canary: { targets: [ { model: model-b, weight: 1 } ], rewrite_response: true } }";
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backends([e1.url(), e2.url(), e3.url()])
            .policy("least_load")
            .section("models", split),
    );
    wait_scraped(&g, 3).await;
    let ask = |model: &str| json!({"model": model, "prompt": "hi", "max_tokens": 1});

    // Each model only where it is served.
    for _ in 0..20 {
        assert_eq!(post(g.addr, "/v1/completions", &ask("model-a")).await.status, 200);
        assert_eq!(post(g.addr, "/v1/embeddings", &ask("model-b")).await.status, 200);
    }
    assert_eq!(answered_for(&e1, "model-a") + answered_for(&e2, "model-a"), 20);
    assert_eq!(answered_for(&e3, "model-b"), 20);
    assert!(answered_for(&e1, "model-a") > 0 && answered_for(&e2, "model-a") > 0, "least_load spreads model-a");
    // The adapter goes where it is loaded.
    for _ in 0..10 {
        assert_eq!(post(g.addr, "/v1/chat/completions", &ask("sql-lora")).await.status, 200);
    }
    assert_eq!(answered_for(&e2, "sql-lora"), 10, "every adapter request on the engine that has it loaded");
    // Loaded nowhere: any engine with a free slot, by load.
    e2.set_running_adapters(&[]);
    eventually("the gateway sees the adapter unloaded", async || {
        post(g.addr, "/v1/chat/completions", &ask("sql-lora")).await;
        answered_for(&e1, "sql-lora") > 0
    })
    .await;
    // An unknown model: 404 in the OpenAI shape.
    let r = post(g.addr, "/v1/chat/completions", &ask("model-z")).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json().await["error"]["code"], "model_not_found");
    // The model list is the union, adapters with their parent.
    let models = send(g.addr, "GET", "/v1/models", Bytes::new()).await.json().await;
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["model-a", "model-b", "sql-lora"]);
    assert_eq!(models["data"][2]["parent"], "model-a");

    // The alias: 1,000 requests split 90/10 within ±5%, the body's model rewritten.
    let (a_before, b_before) =
        (answered_for(&e1, "model-a") + answered_for(&e2, "model-a"), answered_for(&e3, "model-b"));
    for _ in 0..1000 {
        let r = post(g.addr, "/v1/completions", &ask("chat-default")).await;
        assert_eq!(r.status, 200);
        r.text().await;
    }
    let to_a = answered_for(&e1, "model-a") + answered_for(&e2, "model-a") - a_before;
    let to_b = answered_for(&e3, "model-b") - b_before;
    assert_eq!(to_a + to_b, 1000, "every alias request reached a target with its model rewritten");
    assert!((850..=950).contains(&to_a), "90/10 split: {to_a} to model-a, {to_b} to model-b");
    // The rewrite touched only the model: the rest of the body is the client's, byte for byte.
    let last = e3.answered().into_iter().rev().find(|x| x.path == "/v1/completions").unwrap();
    assert_eq!(last.body, Bytes::from(ask("model-b").to_string()));
    let scraped = scrape(g.admin).await;
    let counted = metric_where(&scraped, "switchyard_alias_requests_total", "target", "model-a");
    assert_eq!(counted as usize, to_a);
    // An alias that writes itself back: the responses say `canary`, streamed or not.
    for (path, stream) in [("/v1/completions", false), ("/v1/chat/completions", true), ("/v1/responses", false)] {
        let r = post(g.addr, path, &json!({"model": "canary", "stream": stream, "input": "x"})).await;
        assert_eq!(r.status, 200);
        let text = r.text().await;
        let sent = String::from_utf8(e3.answered().last().unwrap().answer.to_vec()).unwrap();
        assert!(sent.contains(r#""model":"model-b""#), "{sent}");
        assert_eq!(text, sent.replace(r#""model":"model-b""#, r#""model":"canary""#), "{path}");
    }
    // Sticky per session: each session's requests all go to one target.
    for session in ["alice", "bob", "carol", "dave", "erin"] {
        let (a0, b0) = (answered_for(&e1, "model-a") + answered_for(&e2, "model-a"), answered_for(&e3, "model-b"));
        for _ in 0..10 {
            let body = ask("chat-default").to_string();
            let r = send_with(g.addr, "POST", "/v1/completions", &[("x-session-id", session)], body).await;
            assert_eq!(r.status, 200);
            r.text().await;
        }
        let (a1, b1) = (answered_for(&e1, "model-a") + answered_for(&e2, "model-a"), answered_for(&e3, "model-b"));
        assert!(a1 - a0 == 10 || b1 - b0 == 10, "session {session} was split: {} / {}", a1 - a0, b1 - b0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_loaded_behind_sidecars_draw_their_requests_too() {
    // The chart's layout: the gateway reads each pod's sidecar (`/load`), not the engine.
    let a = vec![model_card("model-a"), adapter_card("sql-lora", "model-a")];
    let (e1, e2) = (RouteEngine::start("e1", a.clone()).await, RouteEngine::start("e2", a).await);
    e2.set_running_adapters(&["sql-lora"]);
    let sidecars: Vec<ShimProc> =
        [&e1, &e2].iter().map(|e| ShimProc::start(&e.url(), &["--scrape-interval-ms", "50"])).collect();
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backends(sidecars.iter().map(|s| format!("http://{}", s.addr)))
            .scrape_source("load")
            .policy("least_load"),
    );
    wait_scraped(&g, 2).await;
    let load = send(sidecars[1].addr, "GET", "/load", Bytes::new()).await.json().await;
    assert_eq!(load["lora"]["running"], json!(["sql-lora"]), "{load}");
    for _ in 0..10 {
        let r = post(g.addr, "/v1/chat/completions", &json!({"model": "sql-lora", "messages": []})).await;
        assert_eq!(r.status, 200);
        r.text().await;
    }
    assert_eq!((answered_for(&e1, "sql-lora"), answered_for(&e2, "sql-lora")), (0, 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_sees_the_engines_choices_seeds_ids_and_prefill() {
    // #22 through the gateway: two simulated A100s whose 8,000-token prefill takes ~1 s.
    let engines: Vec<EngineProc> = (0..2)
        .map(|_| EngineProc::start(&["--sim-profile", "a100-llama3-8b", "--max-num-batched-tokens", "512"]))
        .collect();
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new().backends(engines.iter().map(|e| e.url())).policy("round_robin"),
    );
    wait_scraped(&g, 2).await;
    let python = workspace_root().join(".cache/openai-venv/bin/python");
    assert!(python.exists(), "{} is missing: run scripts/setup.sh", python.display());
    let out = tokio::process::Command::new(&python)
        .arg(workspace_root().join("tests/openai_sdk_engine.py"))
        .arg(format!("http://{}", g.addr))
        .arg("meta-llama/Meta-Llama-3-8B-Instruct")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai_sdk_engine.py failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(r["n2"].as_array().unwrap().len(), 2, "{r}");
    assert_ne!(r["n2"][0], r["n2"][1], "{r}");
    assert_ne!(r["unseeded"][0], r["unseeded"][1], "{r}");
    assert_eq!(r["seeded"][0], r["seeded"][1], "{r}");
    let ids: std::collections::HashSet<&str> =
        r["ids"].as_array().unwrap().iter().map(|i| i.as_str().unwrap()).collect();
    assert_eq!(ids.len(), 8, "ids are unique across the two engines: {r}");
    // The first event waits for the prefill (a lower bound: a busy machine only adds).
    assert_eq!(r["first_role"], "assistant");
    assert!(r["first_event_s"].as_f64().unwrap() > 0.3, "the first event came before the prefill: {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_gets_structured_output_tool_calls_and_embeddings_from_the_cpu_model() {
    // #22 with the real model behind the gateway: schemas validated by `jsonschema`.
    let engine = EngineProc::start(&["--backend", "cpu", "--max-model-len", "2048", "--kv-cache-space", "0.25"]);
    let g = GatewayProc::start(&GatewayConfigBuilder::new().backends([engine.url()]));
    wait_scraped(&g, 1).await;
    let python = workspace_root().join(".cache/openai-venv/bin/python");
    assert!(python.exists(), "{} is missing: run scripts/setup.sh", python.display());
    let out = tokio::process::Command::new(&python)
        .arg(workspace_root().join("tests/openai_sdk_structured.py"))
        .arg(format!("http://{}", g.addr))
        .arg("SmolLM2-135M-Instruct")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai_sdk_structured.py failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    eprintln!("{r}");
    assert_eq!(r["schema_valid"], 20, "every json_schema output parses and validates: {r}");
    assert_eq!(r["schema_streamed_valid"], true, "{r}");
    assert_eq!(r["json_object"], true, "{r}");
    assert_eq!(r["tool_call"]["name"], "get_weather", "{r}");
    assert_eq!(r["tool_call"]["valid"], true, "{r}");
    assert_eq!(r["required_call_valid"], true, "{r}");
    assert!(r["cos_cat_kitten"].as_f64().unwrap() > r["cos_cat_carburetor"].as_f64().unwrap(), "{r}");
    assert_eq!(r["n2"], 2, "{r}");
    assert!(!r["responses_text"].as_str().unwrap().is_empty(), "{r}");
    assert_eq!(r["responses_schema_valid"], true, "{r}");
    assert_eq!(r["responses_streamed_matches"], true, "{r}");
    for case in ["malformed_schema", "unknown_tool", "n_over", "dimensions", "logit_bias", "auto_tools"] {
        assert_eq!(r["bad"][case]["status"], 400, "{case}: {r}");
    }
    assert_eq!(r["bad"]["malformed_schema"]["param"], "response_format", "{r}");
    assert_eq!(r["bad"]["unknown_tool"]["param"], "tool_choice.function.name", "{r}");
    assert_eq!(r["bad"]["n_over"]["param"], "n", "{r}");
    assert_eq!(r["bad"]["dimensions"]["param"], "dimensions", "{r}");
    assert_eq!(r["bad"]["logit_bias"]["param"], "logit_bias", "{r}");
    assert_eq!(r["bad"]["auto_tools"]["param"], "tool_choice", "{r}");
}
