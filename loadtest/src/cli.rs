//! Command-line interface: `run` and `cluster`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::client::{Endpoint, Target};
use crate::runner::Arrival;
use crate::workload::LengthDist;

/// OpenAI-compatible streaming load generator and benchmark harness.
#[derive(Debug, Parser)]
#[command(name = "switchyard-loadtest", version)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process; boxing would only obscure clap's derive
pub enum Command {
    /// Run a workload against one or more OpenAI-compatible targets.
    Run(RunArgs),
    /// Start a local cluster (sim or cpu engines + the gateway), run a workload through it,
    /// collect the engines' metrics, tear everything down.
    Cluster(ClusterArgs),
}

/// Which workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadName {
    /// Independent random prompts.
    Synthetic,
    /// Groups sharing a long system prompt.
    SharedPrefix,
    /// Conversations re-sending their history.
    MultiTurn,
    /// Replay a JSONL trace.
    Trace,
}

/// Options of `run` (also what follows `--` in `cluster`).
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// `NAME=URL` of an OpenAI-compatible server; repeat to compare several. `NAME=URL1,URL2,…`:
    /// replicas of one server, the requests spread over them in turn.
    #[arg(long = "target")]
    pub targets: Vec<Target>,
    /// Model name (default: the first model the first target lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Endpoint.
    #[arg(long, value_enum, default_value = "chat")]
    pub endpoint: Endpoint,
    /// Workload.
    #[arg(long, value_enum, default_value = "synthetic")]
    pub workload: WorkloadName,
    /// Prompt (question / turn) length in tokens: N, fixed:N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEAN:STD.
    #[arg(long, default_value = "256")]
    pub input_len: LengthDist,
    /// Output length in tokens (sent as max_tokens, with ignore_eos).
    #[arg(long, default_value = "128")]
    pub output_len: LengthDist,
    /// shared-prefix: number of groups.
    #[arg(long, default_value_t = 8)]
    pub groups: u32,
    /// shared-prefix: shared system prompt length (tokens).
    #[arg(long, default_value_t = 2000)]
    pub prefix_len: u32,
    /// multi-turn: turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub turns: u32,
    /// multi-turn: pause between a reply and the next turn.
    #[arg(long, default_value_t = 1.0)]
    pub think_time_s: f64,
    /// trace: JSONL file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Closed loop: concurrent requests; a comma list sweeps.
    #[arg(long, value_delimiter = ',', conflicts_with = "rate")]
    pub concurrency: Vec<usize>,
    /// Open loop: requests per second; a comma list sweeps.
    #[arg(long, value_delimiter = ',')]
    pub rate: Vec<f64>,
    /// Open-loop spacing.
    #[arg(long, value_enum, default_value = "poisson")]
    pub arrival: Arrival,
    /// burst: requests per burst.
    #[arg(long, default_value_t = 8)]
    pub burst_size: usize,
    /// Requests per target and sweep point.
    #[arg(long)]
    pub requests: Option<u64>,
    /// Seconds per target and sweep point.
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Leading requests excluded from statistics.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Seed: the same seed gives every target the same requests and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (summary.json, requests.jsonl, report.md, plots).
    #[arg(long)]
    pub out: PathBuf,
    /// Goodput SLO, e.g. `ttft_ms=500,tpot_ms=50`.
    #[arg(long)]
    pub slo: Option<String>,
    /// API key (sent as a Bearer token).
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// PEM CA certificate(s) to trust for `https://` targets (default: none, so https
    /// targets need this).
    #[arg(long)]
    pub ca_file: Option<PathBuf>,
    /// Per-request timeout.
    #[arg(long, default_value_t = 600.0)]
    pub timeout_s: f64,
    /// Ask for whole responses instead of streams (no TTFT/ITL then).
    #[arg(long)]
    pub no_stream: bool,
    /// Do not send `ignore_eos` (outputs may end early).
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Open this many keep-alive connections to each target before measuring (as a client
    /// with a warm pool would have): without it an open-loop run against a TLS target starts
    /// with a storm of handshakes.
    #[arg(long, default_value_t = 0)]
    pub prewarm_connections: usize,
}

/// Options of `cluster`.
#[derive(Debug, Clone, Args)]
pub struct ClusterArgs {
    /// Engines to start.
    #[arg(long, default_value_t = 2)]
    pub engines: usize,
    /// Engine backend.
    #[arg(long, default_value = "sim")]
    pub backend: String,
    /// Sim profile of every engine.
    #[arg(long, default_value = "h100-llama3-8b")]
    pub sim_profile: String,
    /// Extra flag for every engine (repeat), e.g. `--engine-arg=--num-gpu-blocks-override=2000`.
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// Gateway routing policy (`type` of `policy:`).
    #[arg(long, default_value = "cost")]
    pub policy: String,
    /// Gateway worker threads.
    #[arg(long, default_value_t = 2)]
    pub gateway_threads: usize,
    /// Skip the gateway and target the engines directly (one target per engine).
    #[arg(long)]
    pub no_gateway: bool,
    /// Gateway replicas, each in front of every engine; the requests are spread over them
    /// in turn (clients behind a load balancer).
    #[arg(long, default_value_t = 1)]
    pub gateways: usize,
    /// Engines publish their KV-cache events and every gateway subscribes (precise prefix
    /// routing when the gateways have a --tokenizer too).
    #[arg(long)]
    pub kv_events: bool,
    /// Another router in front of the same engines instead of the gateway, to compare: a
    /// shell command with `{port}` (where it must listen), `{workers}` (the engines' base
    /// URLs, space-separated) and `{metrics_port}` (a second free port) filled in; e.g.
    /// `python3 -m smg launch --host 127.0.0.1 --port {port} --worker-urls {workers} …`.
    #[arg(long)]
    pub router: Option<String>,
    /// Path the --router answers 200 on once it routes.
    #[arg(long, default_value = "/v1/models")]
    pub router_ready_path: String,
    /// A real model's tokenizer (`.gguf`, `tokenizer.json` or HF directory): sim engines
    /// tokenize with it (`--tokenizer`), and with --kv-events the gateways too.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The run options (those of `run`), after `--`.
    #[arg(last = true, allow_hyphen_values = true)]
    pub run_args: Vec<String>,
}

/// `run` options parsed on their own (for what follows `--` in `cluster`).
#[derive(Debug, Parser)]
#[command(name = "switchyard-loadtest cluster --")]
pub struct RunOnly {
    /// The options.
    #[command(flatten)]
    pub run: RunArgs,
}
