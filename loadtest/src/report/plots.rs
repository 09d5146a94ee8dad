//! The report's plots: SVG drawn with plotters, PNG rasterized from that SVG with resvg.
//!
//! * **CDF plots** (`ttft_cdf`, `itl_cdf`): the empirical CDF of the successful, non-warm-up
//!   samples, one line per `(target, sweep point)` listed in the run summary, in its order.
//!   When that would be more than [`MAX_CDF_LINES`] lines, only the last (highest-index)
//!   sweep point of each target is drawn. Up to [`EXACT_CDF_MAX`] samples the line is the
//!   exact step function; above that it passes through the empirical quantiles at
//!   probabilities 0, 0.001, …, 1 (keeps the SVG small for millions of ITL gaps). The x axis
//!   starts at 0 and ends just past the largest sample, unless the largest sample is more than
//!   1.5× the largest per-line p99.9, in which case the axis is cut at 1.05× that p99.9 (lines
//!   are clipped there, and the title says so) so that one outlier cannot flatten the plot.
//! * **Latency vs throughput** (`latency_throughput`, only with ≥ 2 sweep points): x = output
//!   tokens/s, y = TTFT p50 (solid) and p99 (dashed), one colour per target, points joined in
//!   sweep order; points without a TTFT distribution are skipped.
//!
//! PNGs are the same SVG rendered with resvg onto a white 900×600 canvas. System fonts are
//! loaded into the usvg font database; if there are none, text is simply not drawn.

use std::collections::BTreeSet;

use anyhow::Context;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use resvg::{tiny_skia, usvg};

use crate::record::RequestRecord;
use crate::stats::{percentile, RunSummary, TargetSummary};

/// Width of every plot, px.
pub const WIDTH: u32 = 900;
/// Height of every plot, px.
pub const HEIGHT: u32 = 600;
/// Most lines on a CDF plot before falling back to one line (last sweep point) per target.
pub const MAX_CDF_LINES: usize = 12;
/// Largest sample count drawn as an exact step function.
pub const EXACT_CDF_MAX: usize = 2000;

const FONT: &str = "sans-serif";

/// One rendered plot.
#[derive(Debug, Clone)]
pub struct Plot {
    /// File name without extension.
    pub stem: &'static str,
    /// Human title (used in `report.md`).
    pub title: &'static str,
    /// The SVG document.
    pub svg: String,
}

/// A polyline with its legend entry.
#[derive(Debug, Clone, PartialEq)]
struct Line {
    name: String,
    points: Vec<(f64, f64)>,
}

/// Renders every plot the run calls for, as SVG.
pub fn render_all(run: &RunSummary, records: &[RequestRecord]) -> anyhow::Result<Vec<Plot>> {
    let mut plots = vec![
        Plot {
            stem: "ttft_cdf",
            title: "TTFT CDF",
            svg: cdf_svg(
                "TTFT empirical CDF",
                "TTFT (ms)",
                "fraction of requests",
                &cdf_samples(run, records, |r| r.ttft_ms.into_iter().collect()),
            )?,
        },
        Plot {
            stem: "itl_cdf",
            title: "ITL CDF",
            svg: cdf_svg(
                "Inter-token latency empirical CDF",
                "ITL (ms)",
                "fraction of inter-token gaps",
                &cdf_samples(run, records, |r| r.itl_ms.clone()),
            )?,
        },
    ];
    if let Some(svg) = latency_throughput_svg(run)? {
        plots.push(Plot { stem: "latency_throughput", title: "Latency vs throughput", svg });
    }
    Ok(plots)
}

/// Number of distinct sweep points in the run.
pub fn sweep_points(run: &RunSummary) -> usize {
    run.targets.iter().map(|t| t.point).collect::<BTreeSet<_>>().len()
}

/// The summaries whose samples get a CDF line (see the module docs).
fn cdf_selection(run: &RunSummary) -> Vec<&TargetSummary> {
    if run.targets.len() <= MAX_CDF_LINES {
        return run.targets.iter().collect();
    }
    let mut last: Vec<&TargetSummary> = Vec::new();
    for s in &run.targets {
        match last.iter_mut().find(|l| l.target == s.target) {
            Some(l) if s.point > l.point => *l = s,
            Some(_) => {}
            None => last.push(s),
        }
    }
    last
}

fn point_name(s: &TargetSummary) -> String {
    if s.label.is_empty() {
        format!("point {}", s.point)
    } else {
        s.label.clone()
    }
}

/// `(legend name, sorted finite samples)` per selected summary.
fn cdf_samples(
    run: &RunSummary,
    records: &[RequestRecord],
    metric: impl Fn(&RequestRecord) -> Vec<f64>,
) -> Vec<(String, Vec<f64>)> {
    let sweep = sweep_points(run) > 1;
    cdf_selection(run)
        .into_iter()
        .map(|s| {
            let mut samples: Vec<f64> = records
                .iter()
                .filter(|r| r.target == s.target && r.point == s.point && !r.warmup && r.error.is_none())
                .flat_map(&metric)
                .filter(|v| v.is_finite())
                .collect();
            samples.sort_by(f64::total_cmp);
            let name = if sweep { format!("{} @ {}", s.target, point_name(s)) } else { s.target.clone() };
            (name, samples)
        })
        .collect()
}

/// The empirical CDF of ascending `sorted` samples as a polyline (see the module docs).
fn ecdf_points(sorted: &[f64]) -> Vec<(f64, f64)> {
    let n = sorted.len();
    if n == 0 {
        return Vec::new();
    }
    if n <= EXACT_CDF_MAX {
        let mut points = Vec::with_capacity(2 * n);
        for (i, &x) in sorted.iter().enumerate() {
            points.push((x, i as f64 / n as f64));
            points.push((x, (i + 1) as f64 / n as f64));
        }
        points
    } else {
        (0..=1000)
            .map(|k| {
                let p = k as f64 / 1000.0;
                let rank = ((p * n as f64).ceil() as usize).clamp(1, n);
                (sorted[rank - 1], p)
            })
            .collect()
    }
}

/// Cuts a polyline with non-decreasing x at `upper`, ending it at `(upper, last y)`.
fn clip_x(points: Vec<(f64, f64)>, upper: f64) -> Vec<(f64, f64)> {
    match points.iter().position(|&(x, _)| x > upper) {
        None => points,
        Some(0) => Vec::new(),
        Some(i) => {
            let y = points[i - 1].1;
            let mut kept = points;
            kept.truncate(i);
            kept.push((upper, y));
            kept
        }
    }
}

/// The x-axis end for CDFs of these sample sets, and whether it cuts off a tail.
fn cdf_x_upper(sets: &[(String, Vec<f64>)]) -> (f64, bool) {
    let max = sets.iter().filter_map(|(_, s)| s.last()).copied().fold(0.0, f64::max);
    let p999 = sets.iter().filter(|(_, s)| !s.is_empty()).map(|(_, s)| percentile(s, 99.9)).fold(0.0, f64::max);
    if max <= 0.0 {
        (1.0, false)
    } else if p999 > 0.0 && max > 1.5 * p999 {
        (1.05 * p999, true)
    } else {
        (1.02 * max, false)
    }
}

/// Colour of series `i`.
fn color(i: usize) -> RGBAColor {
    Palette99::pick(i).to_rgba()
}

fn cdf_svg(title: &str, x_desc: &str, y_desc: &str, sets: &[(String, Vec<f64>)]) -> anyhow::Result<String> {
    let (upper, clipped) = cdf_x_upper(sets);
    let lines: Vec<Line> = sets
        .iter()
        .filter(|(_, s)| !s.is_empty())
        .map(|(name, s)| Line { name: name.clone(), points: clip_x(ecdf_points(s), upper) })
        .collect();
    let caption = if clipped { format!("{title} (x axis cut at p99.9)") } else { title.to_string() };

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, (FONT, 24))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..upper, 0f64..1f64)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .axis_desc_style((FONT, 16))
            .label_style((FONT, 13))
            .draw()?;
        for (i, line) in lines.iter().enumerate() {
            let style = color(i).stroke_width(2);
            chart
                .draw_series(LineSeries::new(line.points.iter().copied(), style))?
                .label(line.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        }
        if lines.is_empty() {
            chart.draw_series(std::iter::once(Text::new("no data", (upper * 0.45, 0.5), (FONT, 20))))?;
        } else {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .label_font((FONT, 14))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// `(target, [(output tok/s, TTFT p50), …], [(output tok/s, TTFT p99), …])` in sweep order.
type LatencyCurve = (String, Vec<(f64, f64)>, Vec<(f64, f64)>);

fn latency_curves(run: &RunSummary) -> Vec<LatencyCurve> {
    let mut targets: Vec<&str> = Vec::new();
    for s in &run.targets {
        if !targets.contains(&s.target.as_str()) {
            targets.push(&s.target);
        }
    }
    targets
        .into_iter()
        .map(|t| {
            let mut points: Vec<&TargetSummary> = run.targets.iter().filter(|s| s.target == t).collect();
            points.sort_by_key(|s| s.point);
            let with_ttft = || points.iter().filter_map(|s| s.ttft_ms.map(|d| (s.output_tokens_per_s, d)));
            (
                t.to_string(),
                with_ttft().map(|(x, d)| (x, d.p50)).collect(),
                with_ttft().map(|(x, d)| (x, d.p99)).collect(),
            )
        })
        .collect()
}

fn latency_throughput_svg(run: &RunSummary) -> anyhow::Result<Option<String>> {
    if sweep_points(run) < 2 {
        return Ok(None);
    }
    let curves = latency_curves(run);
    let all = || curves.iter().flat_map(|(_, p50, p99)| p50.iter().chain(p99));
    let max_x = all().map(|p| p.0).filter(|v| v.is_finite()).fold(0.0, f64::max);
    let max_y = all().map(|p| p.1).filter(|v| v.is_finite()).fold(0.0, f64::max);
    let x_end = if max_x > 0.0 { max_x * 1.05 } else { 1.0 };
    let y_end = if max_y > 0.0 { max_y * 1.05 } else { 1.0 };

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("TTFT vs output throughput across the sweep", (FONT, 24))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_end, 0f64..y_end)?;
        chart
            .configure_mesh()
            .x_desc("output throughput (tokens/s)")
            .y_desc("TTFT (ms)")
            .axis_desc_style((FONT, 16))
            .label_style((FONT, 13))
            .draw()?;
        let mut any = false;
        for (i, (target, p50, p99)) in curves.iter().enumerate() {
            let c = color(i);
            let style = c.stroke_width(2);
            if !p50.is_empty() {
                any = true;
                chart
                    .draw_series(LineSeries::new(p50.iter().copied(), style))?
                    .label(format!("{target} TTFT p50"))
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
                chart.draw_series(p50.iter().map(|&p| Circle::new(p, 4, c.filled())))?;
            }
            if !p99.is_empty() {
                any = true;
                chart
                    .draw_series(DashedLineSeries::new(p99.iter().copied(), 8, 5, style))?
                    .label(format!("{target} TTFT p99"))
                    .legend(move |(x, y)| DashedPathElement::new(vec![(x, y), (x + 24, y)], 6, 4, style));
                chart.draw_series(p99.iter().map(|&p| Circle::new(p, 4, style)))?;
            }
        }
        if any {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .label_font((FONT, 14))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        } else {
            chart.draw_series(std::iter::once(Text::new("no data", (x_end * 0.45, y_end * 0.5), (FONT, 20))))?;
        }
        root.present()?;
    }
    Ok(Some(svg))
}

/// usvg options with the system fonts loaded. When fontconfig names no usable generic
/// `sans-serif`/`serif` family, the first installed face (preferring a "Sans" one) stands
/// in. With no fonts at all, text is skipped at render time; nothing fails.
pub fn png_options() -> usvg::Options<'static> {
    use usvg::fontdb::{Family, Query};
    let mut opts = usvg::Options::default();
    let db = opts.fontdb_mut();
    db.load_system_fonts();
    let has = |db: &usvg::fontdb::Database, family: Family| {
        db.query(&Query { families: &[family], ..Query::default() }).is_some()
    };
    let generics_resolve = has(db, Family::SansSerif) && has(db, Family::Serif);
    if !generics_resolve && !db.is_empty() {
        let families = || db.faces().filter_map(|f| f.families.first().map(|(name, _)| name.clone()));
        let fallback = families().find(|n| n.contains("Sans")).or_else(|| families().next());
        if let Some(name) = fallback {
            if !has(db, Family::SansSerif) {
                db.set_sans_serif_family(name.clone());
            }
            if !has(db, Family::Serif) {
                db.set_serif_family(name);
            }
        }
    }
    opts
}

/// Rasterizes an SVG onto a white [`WIDTH`]×[`HEIGHT`] canvas and encodes it as PNG.
pub fn svg_to_png(svg: &str, opts: &usvg::Options) -> anyhow::Result<Vec<u8>> {
    let tree = usvg::Tree::from_str(svg, opts).context("parsing the plot SVG")?;
    let mut pixmap = tiny_skia::Pixmap::new(WIDTH, HEIGHT).context("allocating the PNG canvas")?;
    pixmap.fill(tiny_skia::Color::WHITE);
    let size = tree.size();
    let transform = tiny_skia::Transform::from_scale(WIDTH as f32 / size.width(), HEIGHT as f32 / size.height());
    resvg::render(&tree, transform, &mut pixmap.as_mut());
    pixmap.encode_png().context("encoding the PNG")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_lines_fall_back_to_last_point_per_target() {
        let run = |points: usize| {
            let mut targets = Vec::new();
            for t in ["a", "b"] {
                for p in 0..points {
                    targets.push(crate::stats::summarize(&[], t, p, &format!("rate={p}"), 1.0, None));
                }
            }
            RunSummary::new(targets, serde_json::Value::Null)
        };
        let small = run(6); // 12 lines: all drawn
        assert_eq!(cdf_selection(&small).len(), 12);
        let big = run(7); // 14 lines: last point of each target
        let picked: Vec<(&str, usize)> = cdf_selection(&big).iter().map(|s| (s.target.as_str(), s.point)).collect();
        assert_eq!(picked, [("a", 6), ("b", 6)]);
        let names: Vec<String> = cdf_samples(&big, &[], |r| r.itl_ms.clone()).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a @ rate=6", "b @ rate=6"]);
    }

    #[test]
    fn exact_ecdf_is_a_step_function() {
        assert_eq!(ecdf_points(&[]), vec![]);
        assert_eq!(ecdf_points(&[1.0, 3.0]), vec![(1.0, 0.0), (1.0, 0.5), (3.0, 0.5), (3.0, 1.0)]);
    }

    #[test]
    fn large_ecdf_uses_quantiles() {
        let sorted: Vec<f64> = (1..=10_000).map(f64::from).collect();
        let points = ecdf_points(&sorted);
        assert_eq!(points.len(), 1001);
        assert_eq!(points[0], (1.0, 0.0));
        assert_eq!(points[500], (5000.0, 0.5));
        assert_eq!(points[1000], (10_000.0, 1.0));
    }

    #[test]
    fn clipping_ends_at_the_cut() {
        let pts = vec![(1.0, 0.0), (1.0, 0.5), (3.0, 0.5), (3.0, 1.0)];
        assert_eq!(clip_x(pts.clone(), 5.0), pts);
        assert_eq!(clip_x(pts.clone(), 2.0), vec![(1.0, 0.0), (1.0, 0.5), (2.0, 0.5)]);
        assert_eq!(clip_x(pts, 0.5), vec![]);
    }

    #[test]
    fn x_axis_cut_only_for_far_outliers() {
        let even: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(cdf_x_upper(&[("a".into(), even.clone())]), (102.0, false));
        // p99.9 of 1..=10000 plus one 1e6 outlier is 9991: the axis stops at 1.05 × 9991
        let mut tail: Vec<f64> = (1..=10_000).map(f64::from).collect();
        tail.push(1e6);
        let (upper, clipped) = cdf_x_upper(&[("a".into(), even), ("b".into(), tail)]);
        assert!(clipped);
        assert!((upper - 1.05 * 9991.0).abs() < 1e-6, "{upper}");
        assert_eq!(cdf_x_upper(&[("a".into(), vec![])]), (1.0, false));
    }
}
