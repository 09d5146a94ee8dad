//! The I/O shell around the [`index`](super::index): one ZMQ SUB connection per engine that
//! publishes KV events, feeding every batch into the shared index in sequence order.
//!
//! The service looks at the cluster every second: an engine's PUB endpoint is the one its
//! static entry names (`discovery.static[].kv_events`), else `tcp://<address>:<kv_events.port>`
//! for discovered engines. A new engine gets a slot in the index and a subscriber task; an
//! engine that left loses both (its entries go). A subscriber decodes each message
//! (`[topic, seq, payload]`), applies it, and on a sequence gap asks the engine's replay
//! socket (DEALER → ROUTER, `[ "", start ]`, until the end marker) for the missing batches;
//! with no replay socket, or when the replay does not close the gap, the engine's entries are
//! forgotten and re-learned (stale entries would route wrongly; missing ones only cost a hit).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::index::{Applied, EngineSlot, KvIndex, MAX_ENGINES};
use super::prompt::PrecisePrompt;
use super::wire::{decode_batch, EventBatch};
use crate::active::Active;
use crate::metrics::GatewayMetrics;

/// How often the set of engines is compared with the subscriptions.
const RESYNC: Duration = Duration::from_secs(1);
/// How long a replay may take before the gap is given up on.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// One engine's event stream, as `/admin/backends` shows it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StreamState {
    /// The PUB endpoint subscribed to.
    pub endpoint: String,
    /// The replay endpoint, if any.
    pub replay_endpoint: Option<String>,
    /// A message has arrived since the subscription (ZMQ connects silently).
    pub receiving: bool,
    /// Batches applied.
    pub batches: u64,
    /// Sequence gaps seen, and how many a replay closed.
    pub gaps: u64,
    /// Gaps a replay closed.
    pub replayed: u64,
    /// Messages that did not decode.
    pub undecodable: u64,
}

/// The engines' KV events: the index and the streams feeding it, shared with the admin
/// listener and the request path (which asks it what each engine holds of a prompt that
/// [`PromptTokenizer`](super::prompt::PromptTokenizer) turned into block keys).
#[derive(Debug)]
pub struct KvEvents {
    /// The index.
    pub index: Mutex<KvIndex>,
    /// Per backend key: its slot and stream.
    /// (foldhash: looked up per request and per batch, where SipHash cost ~250 instructions.)
    pub streams: Mutex<foldhash::HashMap<u64, (EngineSlot, StreamState)>>,
    /// The index's block size (fixed at start: read without the index's lock).
    block_size: usize,
}

impl KvEvents {
    /// An empty index for `block_size`-token blocks within `max_bytes`.
    pub fn new(block_size: usize, max_bytes: usize) -> Arc<Self> {
        Arc::new(KvEvents {
            index: Mutex::new(KvIndex::new(block_size, max_bytes)),
            streams: Mutex::default(),
            block_size,
        })
    }

    /// Per backend key of `backends`: the leading tokens of `prompt` that engine holds, for
    /// the engines whose event stream is live (a message has arrived since it was
    /// subscribed); `None` for the others, which the approximate index stands in for.
    pub fn matched_tokens(&self, prompt: &PrecisePrompt, backends: &[u64]) -> Vec<Option<u64>> {
        let streams = self.streams.lock();
        let index = self.index.lock();
        let block = self.block_size as u64;
        backends
            .iter()
            .map(|key| {
                let (slot, stream) = streams.get(key)?;
                stream.receiving.then(|| (index.matched_blocks(*slot, &prompt.keys) as u64 * block).min(prompt.tokens))
            })
            .collect()
    }

    /// What `/admin/backends` shows for the backend keyed `key`.
    pub fn describe(&self, key: u64) -> Option<serde_json::Value> {
        let streams = self.streams.lock();
        let (slot, stream) = streams.get(&key)?;
        let index = self.index.lock();
        let stats = index.stats(*slot).cloned().unwrap_or_default();
        Some(serde_json::json!({
            "endpoint": stream.endpoint,
            "replay_endpoint": stream.replay_endpoint,
            "receiving": stream.receiving,
            "batches": stream.batches,
            "last_seq": stats.last_seq,
            "gaps": stream.gaps,
            "replayed": stream.replayed,
            "undecodable": stream.undecodable,
            "held_blocks": stats.held_blocks,
            "skipped_events": stats.skipped_events,
            "resets": stats.resets,
        }))
    }
}

/// The background service.
pub struct KvEventsService {
    active: Arc<ArcSwap<Active>>,
    shared: Arc<KvEvents>,
    metrics: GatewayMetrics,
    runtimes: Vec<tokio::runtime::Handle>,
}

impl KvEventsService {
    /// Subscribe to the engines `active` lists, feeding `shared`, counting in `metrics`.
    pub fn new(active: Arc<ArcSwap<Active>>, shared: Arc<KvEvents>, metrics: GatewayMetrics) -> Self {
        KvEventsService { active, shared, metrics, runtimes: Vec::new() }
    }

    /// Follow the engines' streams on `runtimes` (the cores serving the API listener), spread
    /// by engine, instead of on this service's own thread (the default, `runtimes` empty).
    ///
    /// An engine publishes a batch per scheduler step. On a thread of its own each batch
    /// wakes that thread: with `--sim-profile instant` (a step per request) the subscriber
    /// then cost 8.8 µs per request, half of it in the kernel switching to it and back. On a
    /// busy core the stream's readiness comes back from the same `epoll_wait` as the
    /// connections', and the core reads it between them.
    pub fn on_runtimes(mut self, runtimes: Vec<tokio::runtime::Handle>) -> Self {
        self.runtimes = runtimes;
        self
    }

    /// Each backend's (PUB, replay) endpoints and URL, by backend key.
    fn wanted(&self) -> HashMap<u64, (String, Option<String>, String)> {
        let active = self.active.load();
        let cfg = &active.config;
        let Some(kv) = &cfg.kv_events else { return HashMap::new() };
        let mut out = HashMap::new();
        for b in &active.cluster.backends {
            let configured = cfg.discovery.static_backends.iter().find(|s| s.url.trim_end_matches('/') == b.url);
            let endpoints = match configured.and_then(|s| s.kv_events.clone()) {
                Some(pub_endpoint) => {
                    Some((pub_endpoint, configured.and_then(|s| s.kv_events_replay.clone()), b.url.clone()))
                }
                None => match (b.addr, kv.port) {
                    (Some(addr), Some(port)) => Some((
                        format!("tcp://{}", std::net::SocketAddr::new(addr.ip(), port)),
                        kv.replay_port.map(|p| format!("tcp://{}", std::net::SocketAddr::new(addr.ip(), p))),
                        b.url.clone(),
                    )),
                    _ => None,
                },
            };
            if let Some(e) = endpoints {
                out.insert(b.key, e);
            }
        }
        out
    }
}

#[async_trait]
impl BackgroundService for KvEventsService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tasks: HashMap<u64, ((String, Option<String>, String), tokio::task::JoinHandle<()>)> = HashMap::new();
        loop {
            let wanted = self.wanted();
            // Engines gone, or whose endpoints changed: stop, forget, free the slot.
            let stale: Vec<u64> =
                tasks.iter().filter(|(k, (e, _))| wanted.get(k) != Some(e)).map(|(k, _)| *k).collect();
            for key in stale {
                if let Some((_, task)) = tasks.remove(&key) {
                    task.abort();
                }
                if let Some((slot, _)) = self.shared.streams.lock().remove(&key) {
                    self.shared.index.lock().remove_engine(slot);
                }
            }
            for (key, endpoints) in wanted {
                if tasks.contains_key(&key) {
                    continue;
                }
                let slot = {
                    let mut streams = self.shared.streams.lock();
                    let used: Vec<EngineSlot> = streams.values().map(|(s, _)| *s).collect();
                    let Some(slot) = (0..MAX_ENGINES as u8).find(|s| !used.contains(s)) else {
                        tracing::warn!(
                            "more than {MAX_ENGINES} engines publish KV events; the rest are routed approximately"
                        );
                        continue;
                    };
                    let state = StreamState {
                        endpoint: endpoints.0.clone(),
                        replay_endpoint: endpoints.1.clone(),
                        ..StreamState::default()
                    };
                    streams.insert(key, (slot, state));
                    slot
                };
                let counters = Counters { metrics: self.metrics.clone(), backend: endpoints.2.clone() };
                let follow = subscribe(self.shared.clone(), key, slot, endpoints.clone(), counters);
                let task = match self.runtimes.get(usize::from(slot) % self.runtimes.len().max(1)) {
                    Some(core) => core.spawn(follow),
                    None => tokio::spawn(follow),
                };
                tasks.insert(key, (endpoints, task));
            }
            tokio::select! {
                _ = shutdown.changed() => {
                    for (_, (_, task)) in tasks.drain() {
                        task.abort();
                    }
                    return;
                }
                _ = tokio::time::sleep(RESYNC) => {}
            }
            self.metrics.kv_index_bytes.set(self.shared.index.lock().charged_bytes() as i64);
        }
    }
}

/// One engine's counters.
struct Counters {
    metrics: GatewayMetrics,
    backend: String,
}

/// Follow one engine's stream until aborted.
async fn subscribe(
    shared: Arc<KvEvents>,
    key: u64,
    slot: EngineSlot,
    endpoints: (String, Option<String>, String),
    counters: Counters,
) {
    let (pub_endpoint, replay_endpoint, _) = endpoints;
    let received = counters.metrics.kv_event_batches.with_label_values(&[counters.backend.as_str()]);
    let Some(mut sub) = connect(&pub_endpoint).await else { return };
    loop {
        let message = match sub.recv().await {
            Ok(m) => m,
            Err(e) => {
                // Not expected while connected (ZMQ reconnects by itself); never spin on it.
                tracing::debug!(endpoint = %pub_endpoint, error = %e, "KV events: receive failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let frames = message.into_vec();
        let decoded = match frames.as_slice() {
            [_topic, seq, payload] => <[u8; 8]>::try_from(seq.as_ref())
                .ok()
                .map(u64::from_be_bytes)
                .and_then(|seq| decode_batch(payload).ok().map(|b| (seq, b))),
            _ => None,
        };
        let Some((seq, batch)) = decoded else {
            stream_mut(&shared, key, |s| s.undecodable += 1);
            continue;
        };
        let applied = shared.index.lock().apply(slot, seq, &batch);
        if let Applied::Gap { missing } = applied {
            let closed = close_gap(&shared, slot, (seq, &batch), missing.start, replay_endpoint.as_deref()).await;
            let outcome = if closed { "replayed" } else { "forgotten" };
            counters.metrics.kv_event_gaps.with_label_values(&[counters.backend.as_str(), outcome]).inc();
            stream_mut(&shared, key, |s| {
                s.gaps += 1;
                s.replayed += u64::from(closed);
            });
        }
        // Receiving from now on: the index holds this engine's blocks, and requests consult it.
        stream_mut(&shared, key, |s| {
            s.receiving = true;
            s.batches += 1;
        });
        received.inc();
    }
}

/// A SUB socket subscribed to everything `endpoint` publishes; `None` when it cannot
/// subscribe. ZMQ reconnects by itself once connected; the first connect may find nobody
/// listening, and is tried again every [`RESYNC`].
async fn connect(endpoint: &str) -> Option<zeromq::SubSocket> {
    let mut sub = zeromq::SubSocket::new();
    loop {
        match sub.connect(endpoint).await {
            Ok(()) => break,
            Err(e) => {
                tracing::debug!(endpoint, error = %e, "KV events: cannot connect yet");
                tokio::time::sleep(RESYNC).await;
            }
        }
    }
    if let Err(e) = sub.subscribe("").await {
        tracing::warn!(endpoint, error = %e, "KV events: cannot subscribe");
        return None;
    }
    Some(sub)
}

/// A gap before batch `seq` (the batches from `missing_from` on were lost): ask the engine's
/// replay socket for them and apply them in order, then `batch`; true when that closed the
/// gap. Otherwise (no replay socket, no answer within [`REPLAY_TIMEOUT`], still a gap) the
/// engine's entries are forgotten and `batch` starts it again.
async fn close_gap(
    shared: &KvEvents,
    slot: EngineSlot,
    (seq, batch): (u64, &EventBatch),
    missing_from: u64,
    replay_endpoint: Option<&str>,
) -> bool {
    let replayed = match replay_endpoint {
        Some(r) => tokio::time::timeout(REPLAY_TIMEOUT, replay(r, missing_from)).await.ok().flatten(),
        None => None,
    };
    let closed = replayed.is_some_and(|batches| {
        let mut index = shared.index.lock();
        for (s, b) in batches.iter().filter(|(s, _)| *s < seq) {
            if !matches!(index.apply(slot, *s, b), Applied::InOrder | Applied::Duplicate) {
                return false;
            }
        }
        matches!(index.apply(slot, seq, batch), Applied::InOrder)
    });
    if !closed {
        let mut index = shared.index.lock();
        index.forget_engine(slot);
        index.apply(slot, seq, batch);
    }
    closed
}

fn stream_mut(shared: &KvEvents, key: u64, f: impl FnOnce(&mut StreamState)) {
    if let Some((_, s)) = shared.streams.lock().get_mut(&key) {
        f(s);
    }
}

/// Every batch the replay socket at `endpoint` still holds from `start` on, in order;
/// `None` when it cannot be asked or answers out of shape.
async fn replay(endpoint: &str, start: u64) -> Option<Vec<(u64, EventBatch)>> {
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(endpoint).await.ok()?;
    let ask = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())]).ok()?;
    dealer.send(ask).await.ok()?;
    let mut out = Vec::new();
    loop {
        let frames = dealer.recv().await.ok()?.into_vec();
        let [_empty, seq, payload] = frames.as_slice() else { return None };
        if payload.is_empty() {
            return Some(out);
        }
        let seq = u64::from_be_bytes(<[u8; 8]>::try_from(seq.as_ref()).ok()?);
        out.push((seq, decode_batch(payload).ok()?));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::prompt::tests::{hello_world, letters, precise_now};
    use crate::kv_events::wire::Event;

    #[test]
    fn live_engines_match_by_the_blocks_they_hold_and_the_others_are_left_to_the_approximate_index() {
        let shared = KvEvents::new(4, 1 << 30);
        let (body, text) = hello_world();
        let prompt = precise_now(body, 4).expect("a chat tokenizes");
        // Engine A (backend 1) stored the prompt's first three blocks, as the engine tokenized them.
        let ids = letters().encode(&text);
        let batch = EventBatch {
            ts: 0.0,
            events: vec![Event::BlockStored {
                block_hashes: vec![901, 902, 903],
                parent_block_hash: None,
                token_ids: ids[..12].to_vec(),
                block_size: 4,
                medium: None,
                lora_name: None,
            }],
            data_parallel_rank: None,
        };
        shared.index.lock().apply(0, 0, &batch);
        let live = StreamState { receiving: true, ..StreamState::default() };
        shared.streams.lock().insert(1, (0, live.clone()));
        // Engine B (backend 2) is subscribed and live but holds nothing; C (3) has not been heard
        // from yet; D (4) has no stream at all.
        shared.streams.lock().insert(2, (1, live));
        shared.streams.lock().insert(3, (2, StreamState::default()));
        assert_eq!(shared.matched_tokens(&prompt, &[1, 2, 3, 4]), vec![Some(12), Some(0), None, None]);
    }
}
