//! `report.md`: a pure function from the run summary (and the list of plots) to Markdown.
//!
//! Sections, in order: results (one row per `(target, sweep point)`, in summary order),
//! ratios against the first target (only when 2+ targets ran: for each sweep point, every
//! other target's value ÷ the first target's at the same point, formatted `0.98×`; "–" where
//! either side is missing or the denominator is 0), errors by target and point, links to the
//! plots, and the run configuration as JSON. Latencies are in ms; values that do not exist
//! (no successful request, no SLO) print as "–".

use std::fmt::Write as _;

use crate::stats::{Distribution, RunSummary, TargetSummary};

const NONE: &str = "–";

/// A plot to link: file stem (`<stem>.svg`, `<stem>.png`) and title.
#[derive(Debug, Clone, Copy)]
pub struct PlotLink<'a> {
    /// File name without extension.
    pub stem: &'a str,
    /// Title shown in the report.
    pub title: &'a str,
}

/// Escapes text for a Markdown table cell.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// A latency in ms, with precision that suits its magnitude.
fn ms(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn stat(d: Option<Distribution>, pick: fn(&Distribution) -> f64) -> String {
    d.map_or_else(|| NONE.to_string(), |d| ms(pick(&d)))
}

/// `num ÷ den` as `0.98×`, or "–" when undefined.
pub fn ratio(num: Option<f64>, den: Option<f64>) -> String {
    match (num, den) {
        (Some(n), Some(d)) if n.is_finite() && d.is_finite() && d != 0.0 => format!("{:.2}×", n / d),
        _ => NONE.to_string(),
    }
}

/// Target names in order of first appearance.
pub fn target_names(run: &RunSummary) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for s in &run.targets {
        if !names.contains(&s.target.as_str()) {
            names.push(&s.target);
        }
    }
    names
}

fn results_table(out: &mut String, run: &RunSummary) {
    let with_goodput = run.targets.iter().any(|s| s.goodput.is_some());
    out.push_str(
        "| Target | Label | Completed | Failed | Req/s | Output tok/s | TTFT p50 | TTFT p90 | TTFT p99 \
         | ITL p50 | ITL p99 | TPOT p50 | E2E p50 | E2E p99 |",
    );
    out.push_str(if with_goodput { " Goodput |\n" } else { "\n" });
    out.push_str("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    out.push_str(if with_goodput { "--:|\n" } else { "\n" });
    for s in &run.targets {
        let _ = write!(
            out,
            "| {} | {} | {} | {} | {:.2} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(&s.target),
            cell(&s.label),
            s.completed,
            s.failed,
            s.requests_per_s,
            s.output_tokens_per_s,
            stat(s.ttft_ms, |d| d.p50),
            stat(s.ttft_ms, |d| d.p90),
            stat(s.ttft_ms, |d| d.p99),
            stat(s.itl_ms, |d| d.p50),
            stat(s.itl_ms, |d| d.p99),
            stat(s.tpot_ms, |d| d.p50),
            stat(s.e2e_ms, |d| d.p50),
            stat(s.e2e_ms, |d| d.p99),
        );
        if with_goodput {
            match s.goodput {
                Some(g) => {
                    let _ = write!(out, " {:.2} req/s ({:.1}%) |", g.requests_per_s, 100.0 * g.fraction);
                }
                None => {
                    let _ = write!(out, " {NONE} |");
                }
            }
        }
        out.push('\n');
    }
    out.push_str("\nLatencies in ms; ITL pools every inter-token gap of the successful requests.");
    if let Some(g) = run.targets.iter().find_map(|s| s.goodput) {
        let bounds: Vec<String> = [("ttft_ms", g.slo.ttft_ms), ("tpot_ms", g.slo.tpot_ms), ("e2e_ms", g.slo.e2e_ms)]
            .iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k} ≤ {v}")))
            .collect();
        let _ = write!(
            out,
            " Goodput: successful requests meeting the SLO ({}) per second, and as a share of all finished requests.",
            bounds.join(", ")
        );
    }
    out.push('\n');
}

fn ratio_table(out: &mut String, run: &RunSummary, base_name: &str) {
    let _ = writeln!(out, "## Ratios vs {base_name}\n");
    let _ = writeln!(
        out,
        "Each target's value ÷ {base_name}'s at the same sweep point: above 1× is better for \
         throughput, below 1× is better for latency.\n"
    );
    out.push_str("| Label | Target | Req/s | Output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |\n");
    out.push_str("|---|---|--:|--:|--:|--:|--:|--:|\n");
    let bases = run.targets.iter().filter(|s| s.target == base_name);
    for base in bases {
        for other in run.targets.iter().filter(|s| s.point == base.point && s.target != base_name) {
            let r = |pick: fn(&TargetSummary) -> Option<f64>| ratio(pick(other), pick(base));
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                cell(&base.label),
                cell(&other.target),
                r(|s| Some(s.requests_per_s)),
                r(|s| Some(s.output_tokens_per_s)),
                r(|s| s.ttft_ms.map(|d| d.p50)),
                r(|s| s.ttft_ms.map(|d| d.p99)),
                r(|s| s.itl_ms.map(|d| d.p50)),
                r(|s| s.itl_ms.map(|d| d.p99)),
            );
        }
    }
    out.push('\n');
}

fn errors_section(out: &mut String, run: &RunSummary) {
    out.push_str("## Errors\n\n");
    if run.targets.iter().all(|s| s.errors.is_empty()) {
        out.push_str("No failed requests.\n\n");
        return;
    }
    out.push_str("| Target | Label | Error | Count |\n|---|---|---|--:|\n");
    for name in target_names(run) {
        for s in run.targets.iter().filter(|s| s.target == name) {
            for (kind, count) in &s.errors {
                let _ = writeln!(out, "| {} | {} | {} | {count} |", cell(name), cell(&s.label), cell(kind));
            }
        }
    }
    out.push('\n');
}

/// Renders `report.md`.
pub fn render(run: &RunSummary, plots: &[PlotLink<'_>]) -> String {
    let mut out = String::from("# Load test report\n\n");
    let names = target_names(run);
    let _ = writeln!(out, "Targets: {}. Schema version {}.\n", names.join(", "), run.schema_version);

    out.push_str("## Results\n\n");
    results_table(&mut out, run);
    out.push('\n');

    if let [base, _, ..] = names.as_slice() {
        ratio_table(&mut out, run, base);
    }

    errors_section(&mut out, run);

    out.push_str("## Plots\n\n");
    for p in plots {
        let _ = writeln!(out, "### {}\n\n![{}]({}.svg)\n\n[PNG]({}.png)\n", p.title, p.title, p.stem, p.stem);
    }

    out.push_str("## Configuration\n\n```json\n");
    out.push_str(&serde_json::to_string_pretty(&run.config).unwrap_or_else(|_| "null".into()));
    out.push_str("\n```\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_formatting() {
        assert_eq!(ratio(Some(98.0), Some(100.0)), "0.98×");
        assert_eq!(ratio(Some(3.0), Some(1.5)), "2.00×");
        assert_eq!(ratio(Some(1.0), Some(0.0)), "–");
        assert_eq!(ratio(None, Some(1.0)), "–");
        assert_eq!(ratio(Some(1.0), None), "–");
    }

    #[test]
    fn ms_precision_and_cells() {
        assert_eq!(ms(1234.56), "1235");
        assert_eq!(ms(12.345), "12.3");
        assert_eq!(ms(1.2345), "1.23");
        assert_eq!(cell("a|b\nc"), "a\\|b c");
    }

    #[test]
    fn single_target_has_no_ratio_table() {
        let run = RunSummary::new(vec![crate::stats::summarize(&[], "solo", 0, "", 1.0, None)], serde_json::json!({}));
        let md = render(&run, &[]);
        assert!(md.contains("| solo |"));
        assert!(!md.contains("Ratios vs"));
        assert!(!md.contains("Goodput"));
        assert!(md.contains("No failed requests."));
    }
}
