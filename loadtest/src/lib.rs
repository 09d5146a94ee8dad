//! # switchyard-loadtest
//!
//! The load generator and benchmark harness Switchyard measures everything with: an
//! OpenAI streaming client timed token by token ([`client`]), seeded workloads
//! ([`workload`]), closed- and open-loop arrivals with sweeps ([`runner`]), pure statistics
//! ([`stats`]: percentiles, goodput) and reports ([`report`]: JSON, Markdown, SVG/PNG
//! plots), and a local cluster launcher ([`cluster`]).

pub mod cli;
pub mod client;
pub mod cluster;
pub mod record;
pub mod report;
pub mod runner;
pub mod stats;
pub mod workload;

use std::time::Duration;

use anyhow::{bail, Context};

use crate::cli::{RunArgs, WorkloadName};
use crate::client::OpenAiClient;
use crate::record::RequestRecord;
use crate::runner::{Load, RunPlan};
use crate::stats::{RunSummary, Slo};
use crate::workload::{Workload, WorkloadKind};

/// Turn `run` options into a plan (reads the trace file; asks the first target for its
/// model when none is given).
pub async fn plan_from_args(a: &RunArgs) -> anyhow::Result<RunPlan> {
    if a.targets.is_empty() {
        bail!("at least one --target NAME=URL is needed");
    }
    let mut names = std::collections::HashSet::new();
    for t in &a.targets {
        if !names.insert(&t.name) {
            bail!("--target name {:?} is used twice", t.name);
        }
    }
    if a.requests.is_none() && a.duration_s.is_none() {
        bail!("give --requests N and/or --duration-s S");
    }
    if a.requests == Some(0) || a.duration_s.is_some_and(|d| d <= 0.0) {
        bail!("--requests and --duration-s must be > 0");
    }
    let kind = match a.workload {
        WorkloadName::Synthetic => WorkloadKind::Synthetic,
        WorkloadName::SharedPrefix => {
            if a.groups == 0 {
                bail!("--groups must be >= 1");
            }
            WorkloadKind::SharedPrefix { groups: a.groups, prefix_len: a.prefix_len }
        }
        WorkloadName::MultiTurn => {
            if a.turns == 0 || a.think_time_s.is_nan() || a.think_time_s < 0.0 {
                bail!("--turns must be >= 1 and --think-time-s >= 0");
            }
            WorkloadKind::MultiTurn { turns: a.turns, think_time_s: a.think_time_s }
        }
        WorkloadName::Trace => {
            let path = a.trace.as_ref().context("--workload trace needs --trace FILE")?;
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let requests = workload::load_trace(&text, &a.output_len, a.seed).map_err(anyhow::Error::msg)?;
            WorkloadKind::Trace { requests, path: path.display().to_string() }
        }
    };
    let mut loads: Vec<Load> = a.concurrency.iter().map(|&c| Load::Concurrency(c)).collect();
    loads.extend(a.rate.iter().map(|&r| Load::Rate(r)));
    if loads
        .iter()
        .any(|l| matches!(l, Load::Concurrency(0)) || matches!(l, Load::Rate(r) if !(*r > 0.0 && r.is_finite())))
    {
        bail!("--concurrency values must be >= 1 and --rate values > 0");
    }
    if loads.is_empty() {
        if matches!(kind, WorkloadKind::Trace { .. }) {
            loads.push(Load::Trace);
        } else {
            bail!("give --concurrency N or --rate R (comma lists sweep)");
        }
    }
    let model = match &a.model {
        Some(m) => m.clone(),
        None => {
            let client = OpenAiClient::new(a.api_key.clone(), Duration::from_secs(30), a.ca_file.as_deref())?;
            client.first_model(&a.targets[0].base_url).await?
        }
    };
    Ok(RunPlan {
        targets: a.targets.clone(),
        model,
        endpoint: a.endpoint,
        workload: Workload { kind, input: a.input_len, output: a.output_len, seed: a.seed },
        loads,
        arrival: a.arrival,
        burst_size: a.burst_size,
        requests: a.requests,
        duration_s: a.duration_s,
        warmup: a.warmup,
        stream: !a.no_stream,
        ignore_eos: !a.no_ignore_eos,
    })
}

/// Run every sweep point against every target, then summarize and write the report.
pub async fn execute(
    plan: &RunPlan,
    a: &RunArgs,
    extra: serde_json::Value,
) -> anyhow::Result<(RunSummary, Vec<RequestRecord>)> {
    let slo = a.slo.as_deref().map(Slo::parse).transpose().map_err(|e| anyhow::anyhow!("--slo: {e}"))?;
    let client = OpenAiClient::new(a.api_key.clone(), Duration::from_secs_f64(a.timeout_s), a.ca_file.as_deref())?;
    let mut all = Vec::new();
    let mut summaries = Vec::new();
    for (point, load) in plan.loads.iter().enumerate() {
        for target in &plan.targets {
            for url in target.base_urls() {
                client.prewarm(url, a.prewarm_connections).await?;
            }
            let label = format!("{} {}", target.name, load.label());
            let pb = runner::progress_bar(plan.requests, &label);
            let result = runner::run_point(plan, &client, target, point, pb).await;
            let summary = stats::summarize(&result.records, &target.name, point, &load.label(), result.duration_s, slo);
            eprintln!(
                "{label}: {} ok, {} failed, {:.2} req/s, {:.1} output tok/s, TTFT p50 {} ms",
                summary.completed,
                summary.failed,
                summary.requests_per_s,
                summary.output_tokens_per_s,
                summary.ttft_ms.map_or("-".into(), |d| format!("{:.1}", d.p50)),
            );
            summaries.push(summary);
            all.extend(result.records);
        }
    }
    let mut config = serde_json::to_value(plan)?;
    config["extra"] = extra;
    let run = RunSummary { schema_version: 1, targets: summaries, config };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let files = report::write_all(&a.out, &run, &all)?;
    for f in files {
        eprintln!("wrote {}", f.display());
    }
    Ok((run, all))
}
