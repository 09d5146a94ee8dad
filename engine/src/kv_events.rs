//! Publishing KV events the way vLLM does (`--kv-events-config`), for routers that track
//! which prefixes each engine really caches.
//!
//! The engine thread hands each step's events ([`crate::kv::KvEvent`]) to a [`KvEventSink`]:
//! a bounded queue (`max_queue_size`) to the publisher thread, never waited on — when it is
//! full the batch is dropped and counted (`switchyard:kv_events_dropped_total`), so
//! publishing never slows a step. The publisher thread encodes each batch
//! ([`crate::kv::encode_batch`]) and sends it on a ZMQ PUB socket as three frames,
//! `[topic, sequence (u64 big-endian, from 0), payload]`; it keeps the last `buffer_steps`
//! batches and, when `replay_endpoint` is set, answers a ROUTER request
//! `[identity, "", start_seq]` with every buffered batch from `start_seq` on, then the end
//! marker (sequence all `0xFF`, empty payload). Facts: docs/design/KV-EVENTS-AND-EPP.md, A1.
//!
//! The PUB socket binds when the endpoint has `*` or `::` in it (vLLM's rule), else connects;
//! `*` means every interface. TCP only (`ipc://` is refused). Its per-subscriber queue is the zeromq crate's
//! (it drops for a slow subscriber, as a ZMQ high-water mark does); `hwm` is validated but
//! that crate has no setting for it.

use std::collections::VecDeque;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use prometheus::IntCounter;
use serde::Deserialize;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::error::ConfigError;
use crate::kv::{encode_batch, KvEvent};

/// `--kv-events-config`: vLLM's `KVEventsConfig` keys and defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Publish at all.
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; unset: `"zmq"` when enabled.
    pub publisher: Option<String>,
    /// Where the PUB socket binds (or connects).
    pub endpoint: String,
    /// Where the ROUTER socket for replays binds (none: no replay).
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// ZMQ high-water mark (validated; see the module documentation).
    pub hwm: usize,
    /// Batches queued for the publisher thread before new ones are dropped.
    pub max_queue_size: usize,
    /// The first frame of every message.
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

fn invalid(value: impl ToString, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: "--kv-events-config", value: value.to_string(), reason: reason.into() }
}

impl KvEventsConfig {
    /// Parse and check the flag's JSON. `Ok(None)` when events are off (disabled, or the
    /// `null` publisher).
    pub fn parse(json: &str) -> Result<Option<Self>, ConfigError> {
        let cfg: KvEventsConfig =
            serde_json::from_str(json).map_err(|e| invalid(json, format!("not vLLM's KV events config: {e}")))?;
        let publisher = cfg.publisher.as_deref().unwrap_or(if cfg.enable_kv_cache_events { "zmq" } else { "null" });
        match publisher {
            "null" => return Ok(None),
            "zmq" if cfg.enable_kv_cache_events => {}
            "zmq" => return Ok(None),
            other => return Err(invalid(other, "publisher must be \"zmq\" or \"null\"")),
        }
        for (what, endpoint) in [("endpoint", Some(&cfg.endpoint)), ("replay_endpoint", cfg.replay_endpoint.as_ref())] {
            if let Some(e) = endpoint {
                // The zeromq crate is built with its TCP transport only.
                if !e.starts_with("tcp://") {
                    return Err(invalid(e, format!("{what} must be tcp://HOST:PORT (ipc:// is not supported)")));
                }
            }
        }
        if cfg.max_queue_size == 0 || cfg.hwm == 0 || (cfg.replay_endpoint.is_some() && cfg.buffer_steps == 0) {
            return Err(invalid(json, "max_queue_size, hwm and (with replay) buffer_steps must be > 0"));
        }
        Ok(Some(cfg))
    }
}

/// Where the engine thread leaves each step's events.
#[derive(Debug, Clone)]
pub struct KvEventSink {
    tx: SyncSender<(f64, Vec<KvEvent>)>,
    dropped: IntCounter,
}

impl KvEventSink {
    /// Queue one step's events for publishing; when the queue is full they are dropped and
    /// counted (the step never waits).
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        match self.tx.try_send((ts, events)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => self.dropped.inc(),
            // The publisher thread is gone (it logged why): nothing to publish to.
            Err(TrySendError::Disconnected(_)) => self.dropped.inc(),
        }
    }
}

/// The socket address a ZMQ endpoint names, `*` meaning every interface; and whether the
/// socket binds (vLLM: `*` or `::` in it) or connects.
fn socket_address(endpoint: &str) -> (String, bool) {
    let binds = endpoint.contains('*') || endpoint.contains("::");
    (endpoint.replacen("://*:", "://0.0.0.0:", 1), binds)
}

/// Start the publisher thread for `cfg`; its sockets are bound (or connecting) when this
/// returns. `dropped` counts batches that found the queue full.
pub fn start(cfg: &KvEventsConfig, dropped: IntCounter) -> anyhow::Result<KvEventSink> {
    let (tx, rx) = sync_channel(cfg.max_queue_size);
    // The thread runs its own runtime (the caller may be inside one) and says whether its
    // sockets opened before it publishes anything.
    let (opened_tx, opened) = sync_channel::<anyhow::Result<()>>(1);
    let cfg = cfg.clone();
    std::thread::Builder::new().name("kv-events".into()).spawn(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(r) => r,
            Err(e) => return drop(opened_tx.send(Err(e.into()))),
        };
        runtime.block_on(async {
            match open_sockets(&cfg).await {
                Ok((publisher, replay)) => {
                    let _ = opened_tx.send(Ok(()));
                    publish_loop(rx, publisher, replay, Bytes::from(cfg.topic.clone()), cfg.buffer_steps).await;
                }
                Err(e) => drop(opened_tx.send(Err(e))),
            }
        });
    })?;
    opened.recv().map_err(|_| anyhow::anyhow!("the KV events thread stopped before opening its sockets"))??;
    Ok(KvEventSink { tx, dropped })
}

async fn open_sockets(cfg: &KvEventsConfig) -> anyhow::Result<(zeromq::PubSocket, Option<zeromq::RouterSocket>)> {
    let mut publisher = zeromq::PubSocket::new();
    let (address, binds) = socket_address(&cfg.endpoint);
    if binds {
        publisher.bind(&address).await.map_err(|e| anyhow::anyhow!("binding {}: {e}", cfg.endpoint))?;
    } else {
        publisher.connect(&address).await.map_err(|e| anyhow::anyhow!("connecting {}: {e}", cfg.endpoint))?;
    }
    let replay = match &cfg.replay_endpoint {
        Some(e) => {
            let mut router = zeromq::RouterSocket::new();
            router.bind(&socket_address(e).0).await.map_err(|err| anyhow::anyhow!("binding {e}: {err}"))?;
            Some(router)
        }
        None => None,
    };
    Ok((publisher, replay))
}

/// The end of a replay: sequence -1 as 8 big-endian bytes.
const REPLAY_END: [u8; 8] = [0xFF; 8];

async fn publish_loop(
    rx: Receiver<(f64, Vec<KvEvent>)>,
    mut publisher: zeromq::PubSocket,
    mut replay: Option<zeromq::RouterSocket>,
    topic: Bytes,
    buffer_steps: usize,
) {
    // The engine thread's std channel is drained on a blocking thread and forwarded here.
    let (tx, mut batches) = tokio::sync::mpsc::channel::<(f64, Vec<KvEvent>)>(64);
    std::thread::spawn(move || {
        while let Ok(b) = rx.recv() {
            if tx.blocking_send(b).is_err() {
                return;
            }
        }
    });
    let mut seq: u64 = 0;
    let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
    loop {
        let request = async {
            match replay.as_mut() {
                Some(r) => r.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            batch = batches.recv() => {
                let Some((ts, events)) = batch else { return };
                let payload = Bytes::from(encode_batch(ts, &events, 0));
                let frames = vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
                if let Ok(message) = ZmqMessage::try_from(frames) {
                    if let Err(e) = publisher.send(message).await {
                        tracing::warn!(error = %e, "publishing KV events failed");
                    }
                }
                if replay.is_some() {
                    if buffer.len() == buffer_steps {
                        buffer.pop_front();
                    }
                    buffer.push_back((seq, payload));
                }
                seq += 1;
            }
            request = request => {
                let Ok(request) = request else { continue };
                if let Some(router) = replay.as_mut() {
                    answer_replay(router, request, &buffer).await;
                }
            }
        }
    }
}

/// `[identity, "", start_seq]` → each buffered `[identity, "", seq, payload]` from
/// `start_seq` on, then `[identity, "", 0xFF×8, ""]`. A malformed request gets nothing.
async fn answer_replay(router: &mut zeromq::RouterSocket, request: ZmqMessage, buffer: &VecDeque<(u64, Bytes)>) {
    let frames = request.into_vec();
    let [identity, _empty, start] = frames.as_slice() else { return };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else { return };
    let reply = |seq: Bytes, payload: Bytes| {
        ZmqMessage::try_from(vec![identity.clone(), Bytes::new(), seq, payload]).expect("four frames")
    };
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        if router.send(reply(Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone())).await.is_err() {
            return;
        }
    }
    let _ = router.send(reply(Bytes::from_static(&REPLAY_END), Bytes::new())).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_reads_vllms_keys_and_defaults() {
        let cfg = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#).unwrap().unwrap();
        assert_eq!((cfg.endpoint.as_str(), cfg.buffer_steps, cfg.topic.as_str()), ("tcp://*:5557", 10_000, ""));
        let full = r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
                      "replay_endpoint":"tcp://*:5558","topic":"kv@pod@model"}"#;
        assert_eq!(KvEventsConfig::parse(full).unwrap().unwrap().replay_endpoint.as_deref(), Some("tcp://*:5558"));
        // Off: disabled, or the null publisher.
        assert_eq!(KvEventsConfig::parse("{}").unwrap(), None);
        assert_eq!(KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"null"}"#).unwrap(), None);
        for bad in [
            r#"{"enable_kv_cache_events":true,"publisher":"kafka"}"#,
            r#"{"enable_kv_cache_events":true,"endpoint":"http://x:1"}"#,
            r#"{"enable_kv_cache_events":true,"max_queue_size":0}"#,
            r#"{"enable_kv_cache_events":true,"endpont":"tcp://*:1"}"#,
            "not json",
        ] {
            assert!(KvEventsConfig::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn endpoints_bind_or_connect_as_vllm_decides() {
        assert_eq!(socket_address("tcp://*:5557"), ("tcp://0.0.0.0:5557".into(), true));
        assert_eq!(socket_address("tcp://10.0.0.5:5557"), ("tcp://10.0.0.5:5557".into(), false));
        assert!(KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"endpoint":"ipc:///tmp/kv"}"#).is_err());
    }
}
