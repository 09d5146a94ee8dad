//! Report files: `summary.json`, `requests.jsonl`, `report.md` and plots (SVG + PNG).
//!
//! [`write_all`] creates the output directory if needed and writes:
//!
//! | File | Content |
//! |---|---|
//! | `summary.json` | [`RunSummary`], pretty-printed (schema below) |
//! | `requests.jsonl` | one [`RequestRecord`] per line, warm-up included (see its `warmup` field) |
//! | `report.md` | results table, ratios vs the first target (2+ targets), errors, plot links, config |
//! | `ttft_cdf.svg` / `.png` | empirical CDF of TTFT, ms |
//! | `itl_cdf.svg` / `.png` | empirical CDF of inter-token latency, ms |
//! | `latency_throughput.svg` / `.png` | TTFT p50/p99 vs output tokens/s, only with ≥ 2 sweep points |
//!
//! The CDF plots draw one line per `(target, sweep point)` of the summary, or only each
//! target's last sweep point when that would exceed 12 lines; see [`plots`] for the details
//! (sampling of large sets, tail cut-off). Plots are 900×600 px; the PNG is the SVG rendered
//! with resvg using the system fonts (no fonts: no text, still a PNG).
//!
//! # `summary.json` schema (version 1)
//!
//! ```text
//! {
//!   "schema_version": 1,                  // u32, bumped on incompatible change
//!   "targets": [                          // one object per (target, sweep point), run order
//!     {
//!       "target": "vllm",                 // target name (--target NAME=URL)
//!       "point": 0,                       // sweep point index, 0 without a sweep
//!       "label": "concurrency=8",         // sweep point label
//!       "completed": 120,                 // successful non-warm-up requests
//!       "failed": 2,                      // failed non-warm-up requests
//!       "errors": { "timeout": 2 },       // error kind -> count (non-warm-up), sorted by kind
//!       "duration_s": 60.0,               // measurement window, seconds
//!       "ttft_ms": DIST | null,           // time to first token per successful request, ms
//!       "itl_ms": DIST | null,            // every inter-token gap of successful requests, ms
//!       "tpot_ms": DIST | null,           // per-request (e2e - ttft) / (output_tokens - 1), ms;
//!                                         //   requests with <= 1 output token excluded
//!       "e2e_ms": DIST | null,            // request start to last byte, ms
//!       "requests_per_s": 2.0,            // completed / duration_s
//!       "output_tokens_per_s": 512.0,     // output tokens of successful requests / duration_s
//!       "total_tokens_per_s": 1536.0,     // (prompt + output) tokens of successful / duration_s
//!       "goodput": null | {               // present iff an SLO was given
//!         "slo": { "ttft_ms": 500.0 | null, "tpot_ms": 50.0 | null, "e2e_ms": null },  // bounds, ms
//!         "good": 110,                    // successful requests meeting every bound (value <= bound)
//!         "requests_per_s": 1.83,         // good / duration_s
//!         "fraction": 0.90                // good / (completed + failed)
//!       }
//!     }
//!   ],
//!   "config": { ... }                     // the run's settings, as given by the caller
//! }
//! DIST = {                                // null when there is no sample
//!   "count": 120,                         // number of samples
//!   "mean": 85.2,                         // arithmetic mean
//!   "p50": 80.1, "p90": 120.4, "p95": 140.0, "p99": 190.3,  // numpy-linear percentiles
//!   "max": 201.7                          // largest sample
//! }
//! ```
//!
//! Rates are 0 when `duration_s` is not positive. All distributions are in milliseconds.

pub mod markdown;
pub mod plots;

use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::record::RequestRecord;
use crate::stats::RunSummary;

/// Name of the summary file.
pub const SUMMARY_FILE: &str = "summary.json";
/// Name of the per-request file.
pub const REQUESTS_FILE: &str = "requests.jsonl";
/// Name of the Markdown report.
pub const REPORT_FILE: &str = "report.md";

fn write_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Writes every report file into `dir` (created if missing) and returns their paths:
/// `summary.json`, `requests.jsonl`, `report.md`, then each plot's `.svg` and `.png`.
pub fn write_all(dir: &Path, run: &RunSummary, records: &[RequestRecord]) -> anyhow::Result<Vec<PathBuf>> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();

    let path = dir.join(SUMMARY_FILE);
    let mut json = serde_json::to_string_pretty(run).context("serializing the run summary")?;
    json.push('\n');
    write_file(&path, json.as_bytes())?;
    written.push(path);

    let path = dir.join(REQUESTS_FILE);
    let file = fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = BufWriter::new(file);
    for record in records {
        serde_json::to_writer(&mut out, record).context("serializing a request record")?;
        out.write_all(b"\n").with_context(|| format!("writing {}", path.display()))?;
    }
    out.flush().with_context(|| format!("writing {}", path.display()))?;
    written.push(path);

    let plots = plots::render_all(run, records).context("drawing the plots")?;
    let links: Vec<markdown::PlotLink<'_>> =
        plots.iter().map(|p| markdown::PlotLink { stem: p.stem, title: p.title }).collect();
    let path = dir.join(REPORT_FILE);
    write_file(&path, markdown::render(run, &links).as_bytes())?;
    written.push(path);

    let png_options = plots::png_options();
    for plot in &plots {
        let svg_path = dir.join(format!("{}.svg", plot.stem));
        write_file(&svg_path, plot.svg.as_bytes())?;
        written.push(svg_path);
        let png_path = dir.join(format!("{}.png", plot.stem));
        let png =
            plots::svg_to_png(&plot.svg, &png_options).with_context(|| format!("rendering {}", png_path.display()))?;
        write_file(&png_path, &png)?;
        written.push(png_path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{summarize, Slo};
    use resvg::{tiny_skia, usvg};

    const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

    /// Equal JSON trees, numbers within a relative 1e-12 (serde_json without its
    /// `float_roundtrip` feature may parse a printed f64 back one ulp off).
    fn json_close(a: &serde_json::Value, b: &serde_json::Value) -> bool {
        use serde_json::Value;
        match (a, b) {
            (Value::Number(x), Value::Number(y)) => {
                let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                (x - y).abs() <= 1e-12 * x.abs().max(y.abs()).max(1.0)
            }
            (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_close(x, y)),
            (Value::Object(x), Value::Object(y)) => {
                x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| json_close(v, w)))
            }
            _ => a == b,
        }
    }

    /// `back` equals `run` up to float parsing (see [`json_close`]).
    fn assert_same_summary(back: &RunSummary, run: &RunSummary) {
        let (a, b) = (serde_json::to_value(back).unwrap(), serde_json::to_value(run).unwrap());
        assert!(json_close(&a, &b), "summary.json did not round-trip:\n{a:#}\nvs\n{b:#}");
    }

    /// A fresh, unique directory under the system temp dir.
    fn temp_dir(tag: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        std::env::temp_dir().join(format!("switchyard-loadtest-report-{tag}-{}-{nanos}", std::process::id()))
    }

    fn record(target: &str, id: u64, point: usize, ttft: f64, gap: f64, error: Option<&str>) -> RequestRecord {
        let itl = if error.is_some() { vec![] } else { vec![gap; 15] };
        RequestRecord {
            target: target.into(),
            id,
            point,
            start_ms: id as f64 * 10.0,
            ttft_ms: error.is_none().then_some(ttft),
            e2e_ms: ttft + itl.iter().sum::<f64>(),
            itl_ms: itl,
            prompt_tokens: 32,
            output_tokens: if error.is_some() { 0 } else { 16 },
            status: Some(if error == Some("http_5xx") { 503 } else { 200 }),
            error: error.map(str::to_string),
            warmup: id == 0,
        }
    }

    /// Two targets ("a|fast" has a pipe to exercise escaping) × a 2-point sweep, with errors.
    fn sample_run() -> (RunSummary, Vec<RequestRecord>) {
        let mut records = Vec::new();
        for (t, target) in ["a|fast", "b"].into_iter().enumerate() {
            for point in 0..2 {
                for id in 0..40u64 {
                    let error = match (t, point, id % 10) {
                        (1, _, 3) => Some("http_5xx"),
                        (_, 1, 7) => Some("timeout"),
                        _ => None,
                    };
                    let ttft = 20.0 + 10.0 * t as f64 + 15.0 * point as f64 + (id % 7) as f64;
                    let gap = 2.0 + t as f64 + 0.1 * (id % 5) as f64;
                    records.push(record(target, id, point, ttft, gap, error));
                }
            }
        }
        let slo = Slo::parse("ttft_ms=40,tpot_ms=3").unwrap();
        let mut targets = Vec::new();
        for target in ["a|fast", "b"] {
            for (point, label) in ["concurrency=1", "concurrency=4"].into_iter().enumerate() {
                targets.push(summarize(&records, target, point, label, 10.0, Some(slo)));
            }
        }
        (RunSummary::new(targets, serde_json::json!({"model": "m", "seed": 7})), records)
    }

    fn check_svgs_and_pngs(paths: &[PathBuf], stems: &[&str]) {
        let opts = usvg::Options::default();
        for stem in stems {
            let svg_path = paths.iter().find(|p| p.file_name().unwrap() == format!("{stem}.svg").as_str()).unwrap();
            let svg = fs::read_to_string(svg_path).unwrap();
            usvg::Tree::from_str(&svg, &opts).unwrap_or_else(|e| panic!("{stem}.svg: {e}"));

            let png_path = paths.iter().find(|p| p.file_name().unwrap() == format!("{stem}.png").as_str()).unwrap();
            let png = fs::read(png_path).unwrap();
            assert!(png.starts_with(PNG_SIGNATURE), "{stem}.png signature");
            let pixmap = tiny_skia::Pixmap::decode_png(&png).unwrap();
            assert_eq!((pixmap.width(), pixmap.height()), (900, 600), "{stem}.png size");
            // something besides the white background was drawn
            assert!(pixmap.pixels().iter().any(|p| p.red() < 200), "{stem}.png is blank");
        }
    }

    #[test]
    fn writes_every_file_for_a_two_target_sweep() {
        let (run, records) = sample_run();
        let dir = temp_dir("sweep");
        let paths = write_all(&dir, &run, &records).unwrap();

        let names: Vec<String> = paths.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(
            names,
            [
                "summary.json",
                "requests.jsonl",
                "report.md",
                "ttft_cdf.svg",
                "ttft_cdf.png",
                "itl_cdf.svg",
                "itl_cdf.png",
                "latency_throughput.svg",
                "latency_throughput.png"
            ]
        );
        assert!(paths.iter().all(|p| p.starts_with(&dir) && p.is_file()));

        // summary.json round-trips and has the documented keys
        let text = fs::read_to_string(dir.join("summary.json")).unwrap();
        let back: RunSummary = serde_json::from_str(&text).unwrap();
        assert_same_summary(&back, &run);
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut keys: Vec<&str> = value.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["config", "schema_version", "targets"]);
        assert_eq!(value["schema_version"], 1);
        let first = value["targets"][0].as_object().unwrap();
        for key in [
            "target",
            "point",
            "label",
            "completed",
            "failed",
            "errors",
            "duration_s",
            "ttft_ms",
            "itl_ms",
            "tpot_ms",
            "e2e_ms",
            "requests_per_s",
            "output_tokens_per_s",
            "total_tokens_per_s",
            "goodput",
        ] {
            assert!(first.contains_key(key), "summary.json targets[0] lacks {key}");
        }
        assert_eq!(first.len(), 15);

        // requests.jsonl: one record per line, in order
        let lines = fs::read_to_string(dir.join("requests.jsonl")).unwrap();
        let parsed: Vec<RequestRecord> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(parsed.len(), records.len());
        for (i, (back, record)) in parsed.iter().zip(&records).enumerate() {
            let (a, b) = (serde_json::to_value(back).unwrap(), serde_json::to_value(record).unwrap());
            assert!(json_close(&a, &b), "requests.jsonl line {}: {a} vs {b}", i + 1);
        }

        // report.md
        let md = fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.contains("| a\\|fast | concurrency=1 |"), "{md}");
        assert!(md.contains("## Ratios vs a|fast"), "{md}");
        let ratio_rows: Vec<&str> =
            md.lines().filter(|l| l.starts_with("| concurrency=") && l.contains("| b |")).collect();
        assert_eq!(ratio_rows.len(), 2, "{md}");
        assert!(ratio_rows.iter().all(|l| l.contains('×')), "{md}");
        assert!(md.contains("| b | concurrency=1 | http_5xx | 4 |"), "{md}");
        assert!(md.contains("| a\\|fast | concurrency=4 | timeout | 4 |"), "{md}");
        assert!(md.contains("Goodput"));
        for stem in ["ttft_cdf", "itl_cdf", "latency_throughput"] {
            assert!(md.contains(&format!("({stem}.svg)")) && md.contains(&format!("({stem}.png)")), "{stem}");
        }
        assert!(md.contains("\"seed\": 7"));

        check_svgs_and_pngs(&paths, &["ttft_cdf", "itl_cdf", "latency_throughput"]);
        let ttft_svg = fs::read_to_string(dir.join("ttft_cdf.svg")).unwrap();
        assert!(ttft_svg.contains("b @ concurrency=4") && ttft_svg.contains("TTFT (ms)"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn single_target_without_sweep_or_data() {
        // one target, one point, only failures: no ratio table, no latency/throughput plot,
        // CDF plots still produced ("no data")
        let records =
            vec![record("solo", 1, 0, 0.0, 0.0, Some("connect")), record("solo", 2, 0, 0.0, 0.0, Some("connect"))];
        let run = RunSummary::new(vec![summarize(&records, "solo", 0, "", 5.0, None)], serde_json::Value::Null);
        let dir = temp_dir("solo");
        let paths = write_all(&dir, &run, &records).unwrap();
        assert_eq!(paths.len(), 7);
        assert!(!dir.join("latency_throughput.svg").exists());
        let md = fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(!md.contains("Ratios vs"));
        assert!(!md.contains("latency_throughput"));
        assert!(md.contains("| solo |  | connect | 2 |"), "{md}");
        check_svgs_and_pngs(&paths, &["ttft_cdf", "itl_cdf"]);
        let back: RunSummary = serde_json::from_str(&fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
        assert_same_summary(&back, &run);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn png_without_fonts_is_still_produced() {
        let (run, records) = sample_run();
        let plots = plots::render_all(&run, &records).unwrap();
        let no_fonts = usvg::Options::default(); // empty font database
        for plot in &plots {
            let png = plots::svg_to_png(&plot.svg, &no_fonts).unwrap();
            let pixmap = tiny_skia::Pixmap::decode_png(&png).unwrap();
            assert_eq!((pixmap.width(), pixmap.height()), (900, 600));
        }
    }
}
