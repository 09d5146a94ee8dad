//! Prints the sim calibration table (model vs published) as Markdown.
//!
//! `cargo bench -p switchyard-engine --bench sim_calibration`

use switchyard_engine::backend::sim::calibration::{model_value, Figure, SCENARIOS};

fn main() {
    println!("| profile | workload | figure | model | published | model ÷ published | source |");
    println!("|---|---|---|---:|---:|---:|---|");
    for s in SCENARIOS {
        let m = model_value(s);
        let figure = match s.figure {
            Figure::MeanItlMs => "mean ITL (ms)",
            Figure::MeanTtftMs => "TTFT (ms)",
            Figure::MeanE2eMs => "mean e2e latency (ms)",
            Figure::RequestsPerS => "requests/s",
        };
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.2} | {} |",
            s.profile,
            s.workload,
            figure,
            m,
            s.published,
            m / s.published,
            s.source
        );
    }
}
