//! KV events from a real engine process (#19, engine side): with `--kv-events-config` the
//! engine publishes, per scheduler step that changed its prefix cache, vLLM's three-frame ZMQ
//! messages `[topic, seq, msgpack batch]` — here to a SUB socket the test binds (the engine
//! connects, as vLLM does for an endpoint without `*`) — and answers replays on a ROUTER.

use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use switchyard_testkit::*;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// One received message: (sequence, decoded batch).
async fn next_batch(sub: &mut zeromq::SubSocket) -> (u64, Value) {
    let msg = tokio::time::timeout(PATIENCE, sub.recv()).await.expect("an event batch").expect("recv");
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    assert_eq!(&frames[0][..], b"kv@test@m", "the topic frame");
    let seq = u64::from_be_bytes(frames[1][..].try_into().expect("8-byte sequence"));
    (seq, rmp_serde::from_slice(&frames[2]).expect("a msgpack batch"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_publishes_and_replays_kv_events_as_vllm_does() {
    let mut sub = zeromq::SubSocket::new();
    let endpoint = sub.bind("tcp://127.0.0.1:0").await.expect("bind SUB");
    sub.subscribe("").await.unwrap();
    let replay_port = free_port();
    let config = json!({
        "enable_kv_cache_events": true, "publisher": "zmq", "endpoint": endpoint.to_string(),
        "replay_endpoint": format!("tcp://127.0.0.1:{replay_port}"), "topic": "kv@test@m",
    });
    let engine = EngineProc::start(&["--sim-profile", "instant", "--kv-events-config", &config.to_string()]);
    // 40 words: several 16-token blocks.
    let prompt: String = (0..40).map(|i| format!("word{i} ")).collect();
    let body = json!({"prompt": prompt, "max_tokens": 4});
    // The engine's PUB connects in the background; requests before it is up publish to no one.
    let mut received = Vec::new();
    while received.is_empty() {
        assert_eq!(post(engine.addr, "/v1/completions", &body).await.status, 200);
        if let Ok(Ok(msg)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
            received.push(msg);
        }
    }
    let first = received.remove(0).into_vec();
    let first_seq = u64::from_be_bytes(first[1][..].try_into().unwrap());

    // A prompt not seen before: its blocks are stored, chained, with their tokens.
    let fresh: String = (0..40).map(|i| format!("other{i} ")).collect();
    assert_eq!(post(engine.addr, "/v1/completions", &json!({"prompt": fresh, "max_tokens": 4})).await.status, 200);
    let (seq, batch) = next_batch(&mut sub).await;
    assert!(seq > first_seq, "sequence numbers grow ({first_seq} then {seq})");
    let batch = batch.as_array().expect("the batch is [ts, events, dp_rank]");
    assert!(batch[0].as_f64().unwrap() > 1.7e9, "a Unix timestamp");
    assert_eq!(batch[2], 0, "data_parallel_rank");
    let stored = &batch[1].as_array().unwrap()[0];
    assert_eq!(stored["type"], "BlockStored", "{stored}");
    assert_eq!(stored["parent_block_hash"], Value::Null, "a sequence's block 0 has no parent");
    assert_eq!((&stored["block_size"], &stored["medium"]), (&json!(16), &json!("GPU")));
    let hashes = stored["block_hashes"].as_array().unwrap();
    assert!(!hashes.is_empty());
    assert_eq!(stored["token_ids"].as_array().unwrap().len(), hashes.len() * 16, "every token of those blocks");
    for key in ["lora_id", "lora_name"] {
        assert!(stored.get(key).is_some_and(Value::is_null), "{key} present and nil");
    }

    // Replay from the first sequence this test saw: the same batches, then the end marker.
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&format!("tcp://127.0.0.1:{replay_port}")).await.expect("connect DEALER");
    let ask = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&first_seq.to_be_bytes())]).unwrap();
    dealer.send(ask).await.unwrap();
    let mut replayed = Vec::new();
    loop {
        let msg = tokio::time::timeout(PATIENCE, dealer.recv()).await.expect("a replay answer").unwrap().into_vec();
        assert_eq!((msg.len(), msg[0].is_empty()), (3, true), "[\"\", seq, payload]");
        if msg[2].is_empty() {
            assert_eq!(&msg[1][..], &[0xFF; 8], "the end marker");
            break;
        }
        replayed.push(u64::from_be_bytes(msg[1][..].try_into().unwrap()));
    }
    assert_eq!(replayed.first(), Some(&first_seq));
    assert!(replayed.contains(&seq), "the replay has every buffered batch: {replayed:?}");
    assert!(replayed.windows(2).all(|w| w[1] == w[0] + 1), "consecutive: {replayed:?}");
    eprintln!("{} blocks stored by the fresh prompt; replayed sequences {replayed:?}", hashes.len());
    let m = scrape(engine.addr).await;
    assert_eq!(metric(&m, "switchyard:kv_events_dropped_total"), 0.0);

    // vLLM's admin route: the cache reset is published as AllBlocksCleared, a batch of its own.
    assert_eq!(send(engine.addr, "POST", "/reset_prefix_cache", "").await.status, 200);
    loop {
        let (_, batch) = next_batch(&mut sub).await;
        let events = batch[1].as_array().unwrap();
        if events.iter().any(|e| e["type"] == "AllBlocksCleared") {
            assert_eq!(batch[1], json!([{"type": "AllBlocksCleared"}]), "a batch of its own");
            break;
        }
    }
}

/// The engine's KV events, through the bytes it publishes, rebuild in the gateway's index
/// exactly the blocks the engine's pool caches — after every step of a random workload with
/// evictions and preemptions, and after a restart (#19).
#[test]
fn the_engines_events_rebuild_its_cache_in_the_gateways_index() {
    use std::collections::HashSet;
    use switchyard_engine::kv::workload::RandomWorkload;
    use switchyard_engine::kv::{encode_batch, BlockPool, KvCacheManager};
    use switchyard_gateway::kv_events::index::{Applied, KvIndex};
    use switchyard_gateway::kv_events::wire::decode_batch;

    let bs = 16;
    let mut ix = KvIndex::new(bs, 1 << 30);
    let mut ts = 1.0;
    for life in 0..2 {
        // A fresh engine process: its sequence starts at 0 again, later in time.
        let mut m = KvCacheManager::new(BlockPool::new(40, bs, true));
        m.enable_events();
        let mut workload = RandomWorkload::new(11 + life, 4, 100, 20);
        let mut seq = 0u64;
        for step in 0..3000u64 {
            workload.step(&mut m, step);
            let events = m.take_events();
            if !events.is_empty() {
                ts += 1.0;
                let batch = decode_batch(&encode_batch(ts, &events, 0)).expect("the engine's bytes decode");
                let applied = ix.apply(0, seq, &batch);
                let want = if life > 0 && seq == 0 { Applied::Restarted } else { Applied::InOrder };
                assert_eq!(applied, want, "life {life}, step {step}");
                seq += 1;
            }
            let cached: HashSet<u64> = m.pool().cached_hashes().map(|h| h.0).collect();
            assert_eq!(ix.held_engine_hashes(0), cached, "life {life}, step {step}");
        }
        assert!(seq > 500, "the workload changed the cache often ({seq} batches)");
    }
}

/// The gateway subscribes to an engine's KV events (#19): batches it receives build its
/// index (`/admin/backends` shows the stream and the blocks held); a sequence gap is closed by
/// asking the engine's replay socket; without a replay socket the engine's entries are
/// forgotten rather than left stale. The engine's side is played by the test, with the
/// engine's own encoder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_indexes_an_engines_events_and_replays_gaps() {
    use switchyard_engine::kv::{encode_batch, KvEvent};
    let engine = FaultEngine::start(Fault::Healthy).await;
    let mut publisher = zeromq::PubSocket::new();
    let pub_endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut router = zeromq::RouterSocket::new();
    let replay_endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backend_with_kv_events(&engine.url(), &pub_endpoint, Some(&replay_endpoint))
            .section("kv_events", "{ block_size: 4 }"),
    );
    let stored = |hashes: &[u64], parent: Option<u64>, first_token: u32| KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: (first_token..first_token + 4 * hashes.len() as u32).collect(),
        block_size: 4,
    };
    // Every batch published, by sequence (what the replay socket answers from).
    let sent = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(u64, Vec<u8>)>::new()));
    let frames = |seq: u64, payload: &[u8]| {
        ZmqMessage::try_from(vec![
            Bytes::from_static(b"kv@e@m"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ])
        .unwrap()
    };
    let kv = async || backends(&g).await["backends"][0]["kv_events"].clone();
    // The gateway's SUB connects in the background: publish harmless batches until it hears.
    let mut seq = 0u64;
    loop {
        let payload = encode_batch(seq as f64 + 1.0, &[], 0);
        sent.lock().unwrap().push((seq, payload.clone()));
        publisher.send(frames(seq, &payload)).await.unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if kv().await["receiving"] == true {
            break;
        }
        assert!(seq < 400, "the gateway never received a batch: {}", kv().await);
    }
    let mut publish = async |seq: u64, events: Vec<KvEvent>, send: bool| {
        let payload = encode_batch(seq as f64 + 1.0, &events, 0);
        sent.lock().unwrap().push((seq, payload.clone()));
        if send {
            publisher.send(frames(seq, &payload)).await.unwrap();
        }
    };
    publish(seq, vec![stored(&[11, 12], None, 0)], true).await;
    eventually("two blocks held", async || kv().await["held_blocks"] == 2).await;

    // Batches seq+1 and seq+2 are lost on the way; seq+3 arrives: the gateway asks for a replay.
    let replays = tokio::spawn({
        let sent = sent.clone();
        async move {
            let ask = router.recv().await.unwrap().into_vec();
            let start = u64::from_be_bytes(ask[2][..].try_into().unwrap());
            let reply = |s: Bytes, p: Bytes| ZmqMessage::try_from(vec![ask[0].clone(), Bytes::new(), s, p]).unwrap();
            let batches: Vec<(u64, Vec<u8>)> =
                sent.lock().unwrap().iter().filter(|(s, _)| *s >= start).cloned().collect();
            for (s, p) in batches {
                router.send(reply(Bytes::copy_from_slice(&s.to_be_bytes()), Bytes::from(p))).await.unwrap();
            }
            router.send(reply(Bytes::from_static(&[0xFF; 8]), Bytes::new())).await.unwrap();
            start
        }
    });
    publish(seq + 1, vec![stored(&[13], Some(12), 8)], false).await;
    publish(seq + 2, vec![KvEvent::BlockRemoved { block_hashes: vec![11] }], false).await;
    publish(seq + 3, vec![stored(&[21], None, 100)], true).await;
    let start = tokio::time::timeout(PATIENCE, replays).await.expect("a replay request").unwrap();
    assert_eq!(start, seq + 1, "the replay starts at the first missing batch");
    eventually("the gap closed by the replay", async || {
        let s = kv().await;
        s["replayed"] == 1 && s["last_seq"] == seq + 3
    })
    .await;
    let state = kv().await;
    // 11, 12 stored; 13 stored (replayed); 11 removed (replayed); 21 stored.
    assert_eq!((&state["held_blocks"], &state["gaps"], &state["resets"]), (&json!(3), &json!(1), &json!(0)), "{state}");
    wait_for_metrics(g.admin, PATIENCE, "the index's memory is reported", |m| {
        metric(m, "switchyard_kv_index_bytes") > 0.0
    })
    .await;
    let m = scrape(g.admin).await;
    assert_eq!(metric_where(&m, "switchyard_kv_events_gaps_total", "outcome", "replayed"), 1.0);
    assert!(metric(&m, "switchyard_kv_events_batches_total") >= 3.0, "each message received counts");
}

/// Without a replay socket a gap cannot be closed: the engine's entries are forgotten (stale
/// ones would route wrongly) and re-learned from the next batches (#19).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replay_socket_a_gap_forgets_the_engine() {
    use switchyard_engine::kv::{encode_batch, KvEvent};
    let engine = FaultEngine::start(Fault::Healthy).await;
    let mut publisher = zeromq::PubSocket::new();
    let pub_endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backend_with_kv_events(&engine.url(), &pub_endpoint, None)
            .section("kv_events", "{ block_size: 4 }"),
    );
    let stored = |hash: u64, first_token: u32| KvEvent::BlockStored {
        block_hashes: vec![hash],
        parent_block_hash: None,
        token_ids: (first_token..first_token + 4).collect(),
        block_size: 4,
    };
    let message = |seq: u64, events: &[KvEvent]| {
        let payload = encode_batch(seq as f64 + 1.0, events, 0);
        ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)])
            .unwrap()
    };
    let kv = async || backends(&g).await["backends"][0]["kv_events"].clone();
    let mut seq = 0u64;
    while kv().await["receiving"] != true {
        publisher.send(message(seq, &[])).await.unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(seq < 400, "the gateway never received a batch");
    }
    publisher.send(message(seq, &[stored(1, 0), stored(2, 100)])).await.unwrap();
    eventually("two blocks held", async || kv().await["held_blocks"] == 2).await;
    // seq + 1 is lost; seq + 2 arrives.
    publisher.send(message(seq + 2, &[stored(3, 200)])).await.unwrap();
    eventually("the engine forgotten, then re-learned", async || {
        let s = kv().await;
        s["resets"] == 1 && s["held_blocks"] == 1 && s["last_seq"] == seq + 2
    })
    .await;
    let m = scrape(g.admin).await;
    assert_eq!(metric_where(&m, "switchyard_kv_events_gaps_total", "outcome", "forgotten"), 1.0);
}

/// Six simulated engines that tokenize with the real model's tokenizer and publish their KV
/// events, bound on free ports; with the events' endpoints.
fn publishing_engines(n: usize) -> Vec<(EngineProc, String, String)> {
    let tokenizer = switchyard_engine::model::default_model_path();
    (0..n)
        .map(|_| {
            let (p, r) = (free_port(), free_port());
            let config = json!({
                "enable_kv_cache_events": true, "publisher": "zmq",
                "endpoint": format!("tcp://*:{p}"), "replay_endpoint": format!("tcp://*:{r}"),
            });
            let engine = EngineProc::start(&[
                "--sim-profile",
                "instant",
                "--served-model-name",
                "m",
                "--tokenizer",
                tokenizer.to_str().unwrap(),
                "--kv-events-config",
                &config.to_string(),
            ]);
            (engine, format!("tcp://127.0.0.1:{p}"), format!("tcp://127.0.0.1:{r}"))
        })
        .collect()
}

/// Per engine URL (sorted), `field` of one gateway's `/admin/backends` entry.
async fn per_engine(g: &GatewayProc, field: impl Fn(&Value) -> u64) -> Vec<(String, u64)> {
    let b = backends(g).await;
    let mut v: Vec<(String, u64)> =
        b["backends"].as_array().unwrap().iter().map(|x| (x["url"].as_str().unwrap().to_string(), field(x))).collect();
    v.sort();
    v
}

/// Per engine URL, the blocks one gateway's index holds.
async fn held_blocks(g: &GatewayProc) -> Vec<(String, u64)> {
    per_engine(g, |x| x["kv_events"]["held_blocks"].as_u64().unwrap_or(0)).await
}

/// Per engine URL (sorted), the requests one gateway routed there.
async fn routed_counts(g: &GatewayProc) -> Vec<u64> {
    per_engine(g, |x| x["routed"].as_u64().unwrap()).await.into_iter().map(|x| x.1).collect()
}

/// A chat request of prefix group `group`: a long system prompt shared by the group, then a
/// question of its own.
fn group_request(group: usize, n: usize) -> Value {
    let system: String = (0..60)
        .map(|i| format!("Rule {i} of handbook {group}: answer in the style of chapter {}. ", i * 7 + group))
        .collect();
    json!({"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        // Long enough to end in blocks of its own: ties between idle engines are broken by a
        // hash of the request's last block, which must not be the group's.
        {"role": "user", "content": format!("Question {n}: what does rule {} say? {}", n * 3 + 1,
            (0..30).map(|i| format!("detail {} ", i * n + 11)).collect::<String>())},
    ]})
}

/// Sends `followers` requests of each group round-robin over `gateways` (after one request
/// per group through the first): returns the share of the followers that went to the engine
/// the group's first request went to.
async fn agreement(gateways: &[GatewayProc], groups: std::ops::Range<usize>, followers: usize) -> f64 {
    let which = |before: &[u64], after: &[u64]| before.iter().zip(after).position(|(b, a)| a > b).unwrap();
    let mut home = Vec::new();
    for group in groups.clone() {
        let before = routed_counts(&gateways[0]).await;
        assert_eq!(post(gateways[0].addr, "/v1/chat/completions", &group_request(group, 0)).await.status, 200);
        home.push(which(&before, &routed_counts(&gateways[0]).await));
    }
    // Every replica has heard what the engines stored (each group's system prompt is over
    // 40 blocks), and holds the same index.
    let stored = 40 * groups.len() as u64;
    eventually("the replicas' indexes agree", async || {
        let mut all = Vec::new();
        for g in gateways {
            all.push(held_blocks(g).await);
        }
        all.windows(2).all(|w| w[0] == w[1]) && all[0].iter().map(|x| x.1).sum::<u64>() >= stored
    })
    .await;
    let (mut same, mut total) = (0, 0);
    for n in 1..=followers {
        for (k, group) in groups.clone().enumerate() {
            let g = &gateways[(n + k) % gateways.len()];
            let before = routed_counts(g).await;
            assert_eq!(post(g.addr, "/v1/chat/completions", &group_request(group, n)).await.status, 200);
            same += usize::from(which(&before, &routed_counts(g).await) == home[k]);
            total += 1;
        }
    }
    same as f64 / total as f64
}

/// Until every gateway hears every engine's events (ZMQ connects in the background, and an
/// engine publishes only when its cache changes): requests straight to the engines.
async fn until_every_stream_is_live(engines: &[(EngineProc, String, String)], gateways: &[GatewayProc]) {
    for round in 0.. {
        for (i, (e, _, _)) in engines.iter().enumerate() {
            let body =
                json!({"model": "m", "max_tokens": 1, "prompt": format!("warm up {round} {i} {}", "x ".repeat(40))});
            assert_eq!(post(e.addr, "/v1/completions", &body).await.status, 200);
        }
        let mut live = true;
        for g in gateways {
            let b = backends(g).await;
            live &= b["backends"].as_array().unwrap().iter().all(|x| x["kv_events"]["receiving"] == true);
        }
        if live {
            return;
        }
        assert!(round < 100, "the gateways never heard every engine: {}", backends(&gateways[0]).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Four gateway replicas in front of the same six engines route every request of a prefix
/// group to the engine that holds the group's prefix (#19): each replica subscribes to every
/// engine's KV events and tokenizes requests as the engines do, so all hold the same index
/// and score alike. With the approximate index alone (what each replica routed itself) the
/// same workload scatters: the check that this test can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_route_each_prefix_group_to_the_engine_that_holds_it() {
    let engines = publishing_engines(6);
    let tokenizer = switchyard_engine::model::default_model_path();
    // Half the replicas follow the streams on their cores (the default), half on a thread of
    // their own (`work_stealing: true`): the same events, the same index either way.
    let replica = |precise: bool, i: usize| {
        let mut c = GatewayConfigBuilder::new().policy("cost").section("work_stealing", &(i % 2 == 1).to_string());
        for (e, p, r) in &engines {
            c = c.backend_with_kv_events(&e.url(), p, Some(r));
        }
        let kv = match precise {
            true => format!("{{ block_size: 16, tokenizer: {:?} }}", tokenizer.to_str().unwrap()),
            false => "{ block_size: 16 }".to_string(),
        };
        GatewayProc::start(&c.section("kv_events", &kv))
    };
    let precise: Vec<GatewayProc> = (0..4).map(|i| replica(true, i)).collect();
    for g in &precise {
        wait_scraped(g, 6).await;
    }
    until_every_stream_is_live(&engines, &precise).await;
    let share = agreement(&precise, 0..12, 6).await;
    eprintln!("precise: {:.1}% of followers went to their group's engine", share * 100.0);
    assert!(share >= 0.99, "precise: {:.0}% of requests went to their group's engine", share * 100.0);
    drop(precise);

    let approximate: Vec<GatewayProc> = (0..4).map(|i| replica(false, i)).collect();
    for g in &approximate {
        wait_scraped(g, 6).await;
    }
    until_every_stream_is_live(&engines, &approximate).await;
    let share = agreement(&approximate, 100..112, 6).await;
    eprintln!("approximate: {:.1}% of followers went to their group's engine", share * 100.0);
    assert!(share < 0.8, "approximate: {:.0}% agreed; the workload does not tell the two apart", share * 100.0);
}
