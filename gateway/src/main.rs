//! `switchyard-gateway --config FILE.yaml [--validate]`

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use switchyard_gateway::GatewayConfig;

/// mimalloc, called the way std calls the system allocator (see `switchyard_gateway::alloc`).
#[global_allocator]
static ALLOC: switchyard_gateway::alloc::Mimalloc = switchyard_gateway::alloc::Mimalloc;

/// Switchyard's edge proxy for LLM engines.
#[derive(Debug, Parser)]
#[command(name = "switchyard-gateway", version)]
struct Args {
    /// Configuration file (YAML). Watched and reloaded on change or SIGHUP.
    #[arg(long)]
    config: PathBuf,
    /// Check the file, print every problem, and exit (0 when valid).
    #[arg(long)]
    validate: bool,
    /// Log format.
    #[arg(long, value_enum, default_value = "json")]
    log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = match GatewayConfig::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}: invalid configuration:\n{e}", args.config.display());
            return ExitCode::from(2);
        }
    };
    if args.validate {
        println!("{}: OK", args.config.display());
        return ExitCode::SUCCESS;
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // Log lines (one per request) are written by a background thread, never on the request
    // path; the guard flushes what is left at exit.
    let (writer, _flush_guard) = tracing_appender::non_blocking(std::io::stdout());
    match args.log_format {
        LogFormat::Json => {
            tracing_subscriber::fmt().json().flatten_event(true).with_env_filter(filter).with_writer(writer).init()
        }
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer).init(),
    }
    match switchyard_gateway::run(config, args.config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("switchyard-gateway: {e:#}");
            ExitCode::FAILURE
        }
    }
}
