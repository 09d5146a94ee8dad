//! `switchyard-loadtest run …` / `switchyard-loadtest cluster … -- …`

use clap::Parser;
use switchyard_loadtest::cli::{Cli, Command, RunOnly};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => {
            let plan = switchyard_loadtest::plan_from_args(&args).await?;
            switchyard_loadtest::execute(&plan, &args, serde_json::Value::Null).await?;
        }
        Command::Cluster(c) => {
            let mut argv = vec!["cluster --".to_string()];
            argv.extend(c.run_args.iter().cloned());
            let run = RunOnly::try_parse_from(argv).unwrap_or_else(|e| e.exit()).run;
            switchyard_loadtest::cluster::run_cluster(&c, run).await?;
        }
    }
    Ok(())
}
