//! Driving load: arrivals, sweeps, targets one after another.
//!
//! For each sweep point and each target (in order, never two targets at once, so they do
//! not share the machine), requests `0..N` are issued:
//!
//! - **closed loop** (`--concurrency C`): C workers, each sending its next request as soon
//!   as the previous one finished;
//! - **open loop** (`--rate R`): arrivals at R requests/s — Poisson (exponential gaps),
//!   `constant` gaps, or `burst` (groups of `--burst-size` at once, R on average); the
//!   gaps come from the seed, so every target sees the same arrival times;
//! - **trace**: the trace's own timestamps;
//! - multi-turn conversations are the unit of arrival: each runs its turns in order with the
//!   think time between a reply and the next turn.
//!
//! The run stops issuing at `--requests` or after `--duration-s`; requests in flight finish.
//! The first `--warmup` requests are marked and left out of the statistics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::client::{Call, Endpoint, OpenAiClient, Target};
use crate::record::RequestRecord;
use crate::workload::{Message, RequestSpec, Workload, WorkloadKind};

/// How arrivals are spaced in an open loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arrival {
    /// Exponential gaps.
    Poisson,
    /// Equal gaps.
    Constant,
    /// Groups of `burst_size` at once.
    Burst,
}

/// One sweep point's load.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Load {
    /// Closed loop with this many concurrent requests (or conversations).
    Concurrency(usize),
    /// Open loop at this many requests (or conversations) per second.
    Rate(f64),
    /// The trace's timestamps.
    Trace,
}

impl Load {
    /// Label for reports.
    pub fn label(&self) -> String {
        match self {
            Load::Concurrency(c) => format!("concurrency={c}"),
            Load::Rate(r) => format!("rate={r}"),
            Load::Trace => "trace".into(),
        }
    }
}

/// Everything a run needs.
#[derive(Debug, Clone, Serialize)]
pub struct RunPlan {
    /// Targets, in order.
    pub targets: Vec<Target>,
    /// Model name.
    pub model: String,
    /// Endpoint.
    pub endpoint: Endpoint,
    /// Workload.
    pub workload: Workload,
    /// Sweep points.
    pub loads: Vec<Load>,
    /// Open-loop spacing.
    pub arrival: Arrival,
    /// Burst size for `burst`.
    pub burst_size: usize,
    /// Requests per point and target (conversations count each turn).
    pub requests: Option<u64>,
    /// Time limit per point and target.
    pub duration_s: Option<f64>,
    /// Leading requests excluded from statistics.
    pub warmup: u64,
    /// Stream responses.
    pub stream: bool,
    /// Send `ignore_eos` (exact output lengths on vLLM-compatible servers).
    pub ignore_eos: bool,
}

/// Result of one (point, target).
pub struct PointResult {
    /// Records.
    pub records: Vec<RequestRecord>,
    /// Measurement window (first request sent → last response ended).
    pub duration_s: f64,
}

/// The JSON body of a request.
pub fn request_body(plan: &RunPlan, spec: &RequestSpec) -> Bytes {
    let mut v = match plan.endpoint {
        Endpoint::Chat => serde_json::json!({ "model": plan.model, "messages": spec.messages }),
        Endpoint::Completions => serde_json::json!({ "model": plan.model, "prompt": spec.prompt_text() }),
    };
    v["max_tokens"] = spec.max_tokens.into();
    v["stream"] = plan.stream.into();
    if plan.stream {
        v["stream_options"] = serde_json::json!({ "include_usage": true });
    }
    if plan.ignore_eos {
        v["ignore_eos"] = true.into();
    }
    Bytes::from(v.to_string())
}

struct Shared {
    plan: RunPlan,
    client: OpenAiClient,
    target: Target,
    point: usize,
    started: Instant,
    records: Mutex<Vec<RequestRecord>>,
    issued: AtomicU64,
    progress: ProgressBar,
}

impl Shared {
    fn budget_left(&self) -> bool {
        let within_time = self.plan.duration_s.is_none_or(|d| self.started.elapsed().as_secs_f64() < d);
        let within_count = self.plan.requests.is_none_or(|n| self.issued.load(Ordering::Relaxed) < n);
        within_time && within_count
    }

    /// Claim the next request id, if the budget allows.
    fn claim(&self) -> Option<u64> {
        if !self.budget_left() {
            return None;
        }
        let id = self.issued.fetch_add(1, Ordering::Relaxed);
        if self.plan.requests.is_some_and(|n| id >= n) {
            return None;
        }
        Some(id)
    }

    async fn send(&self, id: u64, spec: &RequestSpec) -> String {
        let start_ms = self.started.elapsed().as_secs_f64() * 1e3;
        let record = RequestRecord::started(&self.target.name, id, self.point, start_ms, id < self.plan.warmup);
        let call = Call {
            base_url: self.target.url_for(id),
            endpoint: self.plan.endpoint,
            body: request_body(&self.plan, spec),
            stream: self.plan.stream,
        };
        let result = self.client.call(call, record).await;
        self.progress.inc(1);
        self.records.lock().expect("records lock").push(result.record);
        result.text
    }

    /// One unit of arrival: a request, or a whole conversation.
    async fn unit(self: Arc<Self>, first_id: u64) {
        match &self.plan.workload.kind {
            WorkloadKind::MultiTurn { turns, think_time_s } => {
                let conversation = first_id;
                let mut history: Vec<Message> = Vec::new();
                let mut id = first_id;
                for turn in 0..*turns {
                    let spec = if turn == 0 {
                        self.plan.workload.request(conversation)
                    } else {
                        self.plan.workload.next_turn(conversation, turn, &history)
                    };
                    let reply = self.send(id, &spec).await;
                    history = spec.messages;
                    history.push(Message { role: "assistant".into(), content: reply });
                    if turn + 1 == *turns {
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs_f64(*think_time_s)).await;
                    match self.claim() {
                        Some(next) => id = next,
                        None => break,
                    }
                }
            }
            _ => {
                let spec = self.plan.workload.request(first_id);
                self.send(first_id, &spec).await;
            }
        }
    }
}

/// Run one (point, target).
pub async fn run_point(
    plan: &RunPlan,
    client: &OpenAiClient,
    target: &Target,
    point: usize,
    progress: ProgressBar,
) -> PointResult {
    let shared = Arc::new(Shared {
        plan: plan.clone(),
        client: client.clone(),
        target: target.clone(),
        point,
        started: Instant::now(),
        records: Mutex::new(Vec::new()),
        issued: AtomicU64::new(0),
        progress,
    });
    let mut tasks = Vec::new();
    match plan.loads[point] {
        Load::Concurrency(c) => {
            for _ in 0..c {
                let s = shared.clone();
                tasks.push(tokio::spawn(async move {
                    while let Some(id) = s.claim() {
                        s.clone().unit(id).await;
                    }
                }));
            }
        }
        Load::Rate(rate) => {
            let mut rng = StdRng::seed_from_u64(plan.workload.seed ^ 0xA11);
            let mut t = 0.0f64;
            let mut n = 0usize;
            while let Some(id) = shared.claim() {
                let gap = match plan.arrival {
                    Arrival::Poisson => -(1.0 - rng.random::<f64>()).ln() / rate,
                    Arrival::Constant => 1.0 / rate,
                    Arrival::Burst => {
                        if n.is_multiple_of(plan.burst_size.max(1)) {
                            plan.burst_size.max(1) as f64 / rate
                        } else {
                            0.0
                        }
                    }
                };
                if n > 0 {
                    t += gap;
                }
                n += 1;
                let at = shared.started + Duration::from_secs_f64(t);
                tokio::time::sleep_until(at.into()).await;
                tasks.push(tokio::spawn(shared.clone().unit(id)));
            }
        }
        Load::Trace => {
            while let Some(id) = shared.claim() {
                let spec = plan.workload.request(id);
                if let Some(at) = spec.at_s {
                    tokio::time::sleep_until((shared.started + Duration::from_secs_f64(at)).into()).await;
                }
                tasks.push(tokio::spawn(shared.clone().unit(id)));
            }
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    let records = std::mem::take(&mut *shared.records.lock().expect("records lock"));
    let end = records.iter().map(|r| r.start_ms + r.e2e_ms).fold(0.0, f64::max);
    let begin = records.iter().filter(|r| !r.warmup).map(|r| r.start_ms).fold(f64::INFINITY, f64::min);
    let duration_s = if begin.is_finite() { ((end - begin) / 1e3).max(1e-9) } else { 0.0 };
    shared.progress.finish_and_clear();
    PointResult { records, duration_s }
}

/// A progress bar (drawn only on a terminal).
pub fn progress_bar(total: Option<u64>, label: &str) -> ProgressBar {
    let pb = match total {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new_spinner(),
    };
    pb.set_style(
        ProgressStyle::with_template("{prefix:>24} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_prefix(label.to_string());
    pb
}
