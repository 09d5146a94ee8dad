//! The runtime: a dedicated thread that owns the [`EngineCore`] and the [`OutputProcessor`],
//! and paces the core.
//!
//! HTTP handlers talk to it through an [`EngineHandle`]: `submit` queues a tokenized
//! request and returns a [`RequestStream`] of [`Event`]s. Dropping the stream before the
//! request finished — the client went away, during prefill or decode — sends an abort, and
//! the thread frees the request's blocks before its next step.
//!
//! Loop: drain commands (block when idle) → step → for a simulated backend, sleep until
//! `step start + modelled step time` (a plain OS thread sleeps with ~0.1 ms precision,
//! tokio's timer has 1 ms granularity, too coarse for 7 ms steps) → turn the step's tokens
//! into text events, aborting in the scheduler the requests a stop string ended → publish
//! gauges → deliver events and record TTFT / ITL / e2e.

use std::collections::HashMap;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::watch;

use crate::backend::BackendFailure;

use crate::engine_core::EngineCore;
use crate::metrics::EngineMetrics;
use crate::output_processor::{Event, OutputProcessor};
use crate::scheduler::{Request, RequestId, SamplingParams};
use crate::structured::Constraint;
use crate::tokenizer::TokenId;

enum Command {
    Add {
        req: Box<Request>,
        arrival: Instant,
        events: UnboundedSender<Event>,
    },
    Abort(RequestId),
    /// Forget the prefix cache; the answer is the pool's (`Err`: blocks still held).
    ResetPrefixCache(tokio::sync::oneshot::Sender<Result<(), usize>>),
}

/// Cloneable sender side of the runtime.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

/// A submitted request's events; dropping it early aborts the request.
pub struct RequestStream {
    /// The request id.
    pub id: RequestId,
    rx: UnboundedReceiver<Event>,
    abort: Option<mpsc::Sender<Command>>,
}

impl RequestStream {
    /// Next event; `None` if the engine stopped.
    pub async fn next(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        if matches!(ev, Some(Event::Finished { .. }) | None) {
            self.abort = None;
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if let Some(tx) = self.abort.take() {
            let _ = tx.send(Command::Abort(self.id));
        }
    }
}

/// The engine thread stopped.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the engine thread has stopped")]
pub struct EngineStopped;

impl EngineHandle {
    /// Queue a request, its output following `constraint` when given; `arrival` is when it
    /// reached the server (TTFT counts from there).
    pub fn submit(
        &self,
        id: RequestId,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        constraint: Option<Constraint>,
        arrival: Instant,
    ) -> Result<RequestStream, EngineStopped> {
        let (etx, erx) = unbounded_channel();
        let req = Box::new(Request::new(id, prompt, params).with_constraint(constraint));
        self.tx.send(Command::Add { req, arrival, events: etx }).map_err(|_| EngineStopped)?;
        Ok(RequestStream { id, rx: erx, abort: Some(self.tx.clone()) })
    }

    /// Forget the prefix cache (vLLM's `reset_prefix_cache`): `Ok(Err(n))` while `n` blocks
    /// are still held by requests.
    pub async fn reset_prefix_cache(&self) -> Result<Result<(), usize>, EngineStopped> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx.send(Command::ResetPrefixCache(tx)).map_err(|_| EngineStopped)?;
        rx.await.map_err(|_| EngineStopped)
    }
}

struct Sink {
    events: UnboundedSender<Event>,
    arrival: Instant,
    last_token: Option<Instant>,
}

/// Start the engine thread. It stops when every [`EngineHandle`] is dropped and no
/// request is left, or when the backend fails: then the returned watch holds the reason,
/// every open request ends with an error and the server should report unhealthy and exit.
pub fn spawn(
    core: EngineCore,
    output: OutputProcessor,
    metrics: EngineMetrics,
    kv_events: Option<crate::kv_events::KvEventSink>,
) -> (EngineHandle, thread::JoinHandle<()>, watch::Receiver<Option<String>>) {
    let (tx, rx) = mpsc::channel();
    let (failed_tx, failed) = watch::channel(None);
    let join = thread::Builder::new()
        .name("engine-core".into())
        .spawn(move || {
            let outcome =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(core, output, metrics, rx, kv_events)));
            let reason = match outcome {
                Ok(Ok(())) => return,
                Ok(Err(e)) => e.to_string(),
                Err(p) => {
                    format!("the engine thread panicked: {}", crate::backend::tp_group::panic_message(p.as_ref()))
                }
            };
            tracing::error!(error = %reason, "the engine cannot continue");
            failed_tx.send_replace(Some(reason));
        })
        .expect("spawn engine thread");
    (EngineHandle { tx }, join, failed)
}

/// What the engine thread owns besides the core.
struct Shell {
    output: OutputProcessor,
    sinks: HashMap<RequestId, Sink>,
    metrics: EngineMetrics,
    /// Where KV events go, when published.
    kv_events: Option<crate::kv_events::KvEventSink>,
}

fn run(
    mut core: EngineCore,
    output: OutputProcessor,
    metrics: EngineMetrics,
    rx: mpsc::Receiver<Command>,
    kv_events: Option<crate::kv_events::KvEventSink>,
) -> Result<(), BackendFailure> {
    let mut shell = Shell { output, sinks: HashMap::new(), metrics, kv_events };
    loop {
        if core.scheduler.is_idle() {
            publish(&core, &mut shell.metrics);
            match rx.recv() {
                Ok(cmd) => shell.handle(cmd, &mut core),
                Err(_) => return Ok(()),
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            shell.handle(cmd, &mut core);
        }
        let started = Instant::now();
        // A failed backend drops every sink on the way out: streams end with an error.
        let Some(step) = core.step()? else {
            // Requests exist but none can be scheduled: wait for a command rather than spin.
            if let Ok(cmd) = rx.recv_timeout(Duration::from_millis(1)) {
                shell.handle(cmd, &mut core);
            }
            continue;
        };
        if let Some(t) = step.model_time {
            let deadline = started + t;
            let now = Instant::now();
            if deadline > now {
                thread::sleep(deadline - now);
            }
        }
        if let Some(sink) = &shell.kv_events {
            sink.publish(step.kv_events);
        }
        let processed = shell.output.process(step.outputs);
        // A stop string ended these: free their blocks before the gauges and the next step.
        for id in processed.stopped {
            core.scheduler.abort(id);
        }
        // Publish first, so a client that sees a token also sees the state that made it.
        publish(&core, &mut shell.metrics);
        let now = Instant::now();
        for ev in processed.events {
            shell.deliver(ev, now);
        }
    }
}

impl Shell {
    fn handle(&mut self, cmd: Command, core: &mut EngineCore) {
        match cmd {
            Command::Add { req, arrival, events } => {
                self.sinks.insert(req.id, Sink { events, arrival, last_token: None });
                self.output.add(req.id, &req.params);
                core.scheduler.add(*req);
            }
            Command::Abort(id) => {
                if core.scheduler.abort(id) {
                    self.metrics.finished(crate::scheduler::FinishReason::Abort);
                }
                self.output.abort(id);
                self.sinks.remove(&id);
            }
            Command::ResetPrefixCache(reply) => {
                let _ = reply.send(core.scheduler.reset_prefix_cache());
                // The reset is a batch of its own (`AllBlocksCleared`), as in vLLM.
                if let Some(sink) = &self.kv_events {
                    sink.publish(core.scheduler.take_kv_events());
                }
            }
        }
    }

    fn deliver(&mut self, ev: Event, now: Instant) {
        let (sinks, metrics) = (&mut self.sinks, &self.metrics);
        let id = match &ev {
            Event::Token { id, .. } | Event::Finished { id, .. } => *id,
        };
        let finished = match &ev {
            Event::Finished { reason, .. } => Some(*reason),
            Event::Token { .. } => None,
        };
        let Some(sink) = sinks.get_mut(&id) else { return };
        match sink.last_token {
            None => metrics.ttft.observe((now - sink.arrival).as_secs_f64()),
            Some(last) => metrics.itl.observe((now - last).as_secs_f64()),
        }
        sink.last_token = Some(now);
        if let Some(reason) = finished {
            metrics.e2e.observe((now - sink.arrival).as_secs_f64());
            metrics.finished(reason);
        }
        // A closed receiver means the client is gone; its abort is already on the way.
        let _ = sink.events.send(ev);
        if finished.is_some() {
            sinks.remove(&id);
        }
    }
}

fn publish(core: &EngineCore, metrics: &mut EngineMetrics) {
    let s = &core.scheduler;
    metrics.observe_scheduler(s.num_running(), s.num_waiting(), s.pool().usage(), s.kv_waste(), s.stats());
}
