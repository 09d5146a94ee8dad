//! Pure statistics over [`RequestRecord`]s: latency distributions, throughput and goodput.
//!
//! Nothing here does I/O or reads a clock; every function is a deterministic function of
//! its arguments.
//!
//! # Percentiles
//!
//! [`percentile`] reproduces `numpy.percentile(a, q)` with numpy's default `method="linear"`
//! (what vLLM's `benchmark_serving.py` reports): for `n` sorted samples the *virtual index*
//! is `h = (n − 1)·q/100` and the result interpolates linearly between the closest ranks,
//! `a[⌊h⌋] + (a[⌊h⌋+1] − a[⌊h⌋])·(h − ⌊h⌋)`. The arithmetic follows numpy's own order of
//! operations (virtual index `n·p + (1 − p) − 1` with `p = q/100`, and the two-sided `lerp`
//! that evaluates from the upper neighbour when the fraction is ≥ ½), so results agree with
//! numpy to the last bit or within an ulp. Example: samples `1..=10` give p50 = 5.5,
//! p90 = 9.1, p99 = 9.91.
//!
//! # Summaries
//!
//! [`summarize`] reduces the records of one `(target, sweep point)` pair to a
//! [`TargetSummary`]:
//!
//! * only records with the matching `target` and `point` and `warmup == false` count;
//! * a record is *successful* iff `error.is_none()`; `completed` counts successes,
//!   `failed` counts the rest and `errors` tallies their error kinds;
//! * TTFT, TPOT ([`RequestRecord::tpot_ms`], so requests with ≤ 1 output token have none)
//!   and end-to-end latency are per-request distributions over successful requests; ITL is
//!   the distribution over *all* inter-token gaps of all successful requests pooled together
//!   (as vLLM does), so long responses weigh more;
//! * throughputs divide successful-request totals by the measurement window `duration_s`
//!   (a non-positive or non-finite window yields 0 rather than ∞/NaN);
//! * goodput (only with an [`Slo`]) counts successful requests meeting every given bound
//!   (`value ≤ bound`, as in vLLM). A request without a TTFT fails a TTFT bound; a request
//!   without a TPOT (≤ 1 output token) passes a TPOT bound, matching vLLM, which treats its
//!   TPOT as 0. `fraction = good / (completed + failed)`.
//!
//! Non-finite samples (NaN, ±∞) are ignored by [`Distribution::from_samples`]: NaN has no
//! rank, and JSON cannot carry either, which would make `summary.json` unreadable.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;

/// Version of the `summary.json` layout ([`RunSummary::schema_version`]).
pub const SCHEMA_VERSION: u32 = 1;

/// Errors from parsing statistics settings.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StatsError {
    /// The SLO string named no bound at all.
    #[error("empty SLO: expected e.g. \"ttft_ms=500,tpot_ms=50\"")]
    EmptySlo,
    /// A comma-separated part had no `=`.
    #[error("SLO part {part:?} is not KEY=VALUE (keys: ttft_ms, tpot_ms, e2e_ms)")]
    MissingValue {
        /// The offending part.
        part: String,
    },
    /// A key other than `ttft_ms`, `tpot_ms`, `e2e_ms`.
    #[error("unknown SLO key {key:?} (expected ttft_ms, tpot_ms or e2e_ms)")]
    UnknownKey {
        /// The offending key.
        key: String,
    },
    /// A value that is not a finite, non-negative number of milliseconds.
    #[error("invalid SLO value {value:?} for {key}: expected a non-negative number of milliseconds")]
    InvalidValue {
        /// The key whose value was bad.
        key: String,
        /// The offending value.
        value: String,
    },
    /// The same key given twice.
    #[error("SLO key {key} given more than once")]
    DuplicateKey {
        /// The repeated key.
        key: String,
    },
}

/// Mean, p50, p90, p95, p99 and max over samples (ms or any unit).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    /// Number of (finite) samples.
    pub count: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Median (numpy-linear).
    pub p50: f64,
    /// 90th percentile (numpy-linear).
    pub p90: f64,
    /// 95th percentile (numpy-linear).
    pub p95: f64,
    /// 99th percentile (numpy-linear).
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Distribution {
    /// Summarizes `samples`; `None` when there is no finite sample (NaN and ±∞ are ignored).
    pub fn from_samples(samples: &[f64]) -> Option<Distribution> {
        let mut sorted: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let count = sorted.len();
        let mean = sorted.iter().sum::<f64>() / count as f64;
        Some(Distribution {
            count,
            mean,
            p50: percentile(&sorted, 50.0),
            p90: percentile(&sorted, 90.0),
            p95: percentile(&sorted, 95.0),
            p99: percentile(&sorted, 99.0),
            max: sorted[count - 1],
        })
    }
}

/// The `q`-th percentile (`q` in `0..=100`, clamped) of ascending `sorted` samples, with
/// linear interpolation between the closest ranks exactly as `numpy.percentile`'s default
/// `"linear"` method. Returns NaN for an empty slice or a NaN `q`.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    let n = sorted.len();
    if n == 0 || q.is_nan() {
        return f64::NAN;
    }
    let p = q.clamp(0.0, 100.0) / 100.0;
    // numpy: virtual index = n*p + (alpha + p*(1 - alpha - beta)) - 1 with alpha = beta = 1,
    // i.e. n*p + (1 + p*(-1)) - 1; p*(-1) is exact, so (1 - p) is bit-identical.
    let virtual_index = n as f64 * p + (1.0 - p) - 1.0;
    let last = (n - 1) as f64;
    let below = virtual_index.floor().clamp(0.0, last);
    let above = (below + 1.0).min(last);
    let gamma = virtual_index - virtual_index.floor();
    let a = sorted[below as usize];
    let b = sorted[above as usize];
    let diff = b - a;
    if gamma >= 0.5 {
        b - diff * (1.0 - gamma)
    } else {
        a + diff * gamma
    }
}

/// Service-level objective for goodput: a request counts as "good" if it succeeded and every
/// given bound holds (`value ≤ bound`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Slo {
    /// Bound on time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Bound on time per output token, ms.
    pub tpot_ms: Option<f64>,
    /// Bound on end-to-end latency, ms.
    pub e2e_ms: Option<f64>,
}

impl Slo {
    /// Parses `"ttft_ms=500,tpot_ms=50"`: comma-separated `KEY=VALUE` with keys `ttft_ms`,
    /// `tpot_ms`, `e2e_ms` and non-negative values in ms. Whitespace around parts is
    /// ignored, as are empty parts; at least one key is required and none may repeat.
    pub fn parse(s: &str) -> Result<Slo, StatsError> {
        let mut slo = Slo::default();
        let mut any = false;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) =
                part.split_once('=').ok_or_else(|| StatsError::MissingValue { part: part.to_string() })?;
            let (key, value) = (key.trim(), value.trim());
            let slot = match key {
                "ttft_ms" => &mut slo.ttft_ms,
                "tpot_ms" => &mut slo.tpot_ms,
                "e2e_ms" => &mut slo.e2e_ms,
                _ => return Err(StatsError::UnknownKey { key: key.to_string() }),
            };
            let parsed = value
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| StatsError::InvalidValue { key: key.to_string(), value: value.to_string() })?;
            if slot.replace(parsed).is_some() {
                return Err(StatsError::DuplicateKey { key: key.to_string() });
            }
            any = true;
        }
        if any {
            Ok(slo)
        } else {
            Err(StatsError::EmptySlo)
        }
    }

    /// Whether a successful request meets every given bound (see the module docs for
    /// requests without a TTFT or TPOT). Does not look at `error`.
    pub fn is_met_by(&self, record: &RequestRecord) -> bool {
        let ttft_ok = self.ttft_ms.is_none_or(|bound| record.ttft_ms.is_some_and(|v| v <= bound));
        let tpot_ok = self.tpot_ms.is_none_or(|bound| record.tpot_ms().is_none_or(|v| v <= bound));
        let e2e_ok = self.e2e_ms.is_none_or(|bound| record.e2e_ms <= bound);
        ttft_ok && tpot_ok && e2e_ok
    }
}

/// Requests meeting an SLO.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    /// The SLO applied.
    pub slo: Slo,
    /// Successful requests meeting every bound.
    pub good: u64,
    /// `good / duration_s`.
    pub requests_per_s: f64,
    /// `good / (completed + failed)` (0 when no request finished).
    pub fraction: f64,
}

/// Statistics of one target at one sweep point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetSummary {
    /// Target name.
    pub target: String,
    /// Sweep point index (0 without a sweep).
    pub point: usize,
    /// Sweep point label, e.g. `concurrency=8` or `rate=4`.
    pub label: String,
    /// Successful, non-warm-up requests.
    pub completed: u64,
    /// Failed, non-warm-up requests.
    pub failed: u64,
    /// Error kind → count (non-warm-up).
    pub errors: BTreeMap<String, u64>,
    /// Measurement window, s.
    pub duration_s: f64,
    /// Time to first token over successful requests, ms.
    pub ttft_ms: Option<Distribution>,
    /// Inter-token latency over all gaps of successful requests, ms.
    pub itl_ms: Option<Distribution>,
    /// Per-request time per output token over successful requests, ms.
    pub tpot_ms: Option<Distribution>,
    /// End-to-end latency over successful requests, ms.
    pub e2e_ms: Option<Distribution>,
    /// `completed / duration_s`.
    pub requests_per_s: f64,
    /// Output tokens of successful requests / `duration_s`.
    pub output_tokens_per_s: f64,
    /// Prompt + output tokens of successful requests / `duration_s`.
    pub total_tokens_per_s: f64,
    /// Goodput; `Some` iff an SLO was given.
    pub goodput: Option<Goodput>,
}

/// Everything a run measured (the content of `summary.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// Layout version, [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// One entry per (target, sweep point).
    pub targets: Vec<TargetSummary>,
    /// The run's settings.
    pub config: serde_json::Value,
}

impl RunSummary {
    /// A summary with the current [`SCHEMA_VERSION`].
    pub fn new(targets: Vec<TargetSummary>, config: serde_json::Value) -> RunSummary {
        RunSummary { schema_version: SCHEMA_VERSION, targets, config }
    }
}

/// `count / duration_s`, or 0 when the window is not a positive finite number.
fn per_second(count: f64, duration_s: f64) -> f64 {
    if duration_s.is_finite() && duration_s > 0.0 {
        count / duration_s
    } else {
        0.0
    }
}

/// Summarizes the non-warm-up records of `target` at sweep `point` (see the module docs).
pub fn summarize(
    records: &[RequestRecord],
    target: &str,
    point: usize,
    label: &str,
    duration_s: f64,
    slo: Option<Slo>,
) -> TargetSummary {
    let mut completed = 0u64;
    let mut failed = 0u64;
    let mut good = 0u64;
    let mut errors = BTreeMap::new();
    let (mut ttft, mut itl, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut output_tokens, mut total_tokens) = (0u64, 0u64);

    for r in records.iter().filter(|r| r.target == target && r.point == point && !r.warmup) {
        if let Some(kind) = &r.error {
            failed += 1;
            *errors.entry(kind.clone()).or_insert(0) += 1;
            continue;
        }
        completed += 1;
        ttft.extend(r.ttft_ms);
        itl.extend_from_slice(&r.itl_ms);
        tpot.extend(r.tpot_ms());
        e2e.push(r.e2e_ms);
        output_tokens += r.output_tokens;
        total_tokens += r.prompt_tokens + r.output_tokens;
        if slo.is_some_and(|s| s.is_met_by(r)) {
            good += 1;
        }
    }

    let finished = completed + failed;
    let goodput = slo.map(|slo| Goodput {
        slo,
        good,
        requests_per_s: per_second(good as f64, duration_s),
        fraction: if finished == 0 { 0.0 } else { good as f64 / finished as f64 },
    });

    TargetSummary {
        target: target.to_string(),
        point,
        label: label.to_string(),
        completed,
        failed,
        errors,
        duration_s,
        ttft_ms: Distribution::from_samples(&ttft),
        itl_ms: Distribution::from_samples(&itl),
        tpot_ms: Distribution::from_samples(&tpot),
        e2e_ms: Distribution::from_samples(&e2e),
        requests_per_s: per_second(completed as f64, duration_s),
        output_tokens_per_s: per_second(output_tokens as f64, duration_s),
        total_tokens_per_s: per_second(total_tokens as f64, duration_s),
        goodput,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    macro_rules! assert_close {
        ($a:expr, $b:expr) => {{
            let (a, b) = ($a, $b);
            assert!(close(a, b), "{} = {a}, expected {b}", stringify!($a));
        }};
    }

    /// A successful record.
    fn ok(target: &str, point: usize, ttft: f64, itl: &[f64], output: u64) -> RequestRecord {
        RequestRecord {
            target: target.into(),
            id: 0,
            point,
            start_ms: 0.0,
            ttft_ms: Some(ttft),
            itl_ms: itl.to_vec(),
            e2e_ms: ttft + itl.iter().sum::<f64>(),
            prompt_tokens: 10,
            output_tokens: output,
            status: Some(200),
            error: None,
            warmup: false,
        }
    }

    fn failed(target: &str, point: usize, kind: &str) -> RequestRecord {
        RequestRecord {
            target: target.into(),
            id: 0,
            point,
            start_ms: 0.0,
            ttft_ms: None,
            itl_ms: vec![],
            e2e_ms: 3.0,
            prompt_tokens: 10,
            output_tokens: 0,
            status: None,
            error: Some(kind.into()),
            warmup: false,
        }
    }

    #[test]
    fn percentile_matches_numpy_linear() {
        let s: Vec<f64> = (1..=10).map(f64::from).collect();
        // numpy.percentile(range(1, 11), q)
        assert_close!(percentile(&s, 0.0), 1.0);
        assert_close!(percentile(&s, 50.0), 5.5);
        assert_close!(percentile(&s, 90.0), 9.1);
        assert_close!(percentile(&s, 95.0), 9.55);
        assert_close!(percentile(&s, 99.0), 9.91);
        assert_close!(percentile(&s, 100.0), 10.0);
        assert_close!(percentile(&s, 25.0), 3.25);
        // q is clamped
        assert_close!(percentile(&s, 150.0), 10.0);
        assert_close!(percentile(&s, -5.0), 1.0);
        assert!(percentile(&[], 50.0).is_nan());
        // uneven gaps: numpy.percentile([1, 2, 4, 8, 16], [50, 90, 99]) = 4, 12.8, 15.68
        let s = [1.0, 2.0, 4.0, 8.0, 16.0];
        assert_close!(percentile(&s, 50.0), 4.0);
        assert_close!(percentile(&s, 90.0), 12.8);
        assert_close!(percentile(&s, 99.0), 15.68);
    }

    #[test]
    fn distribution_of_one_to_ten() {
        let s: Vec<f64> = (1..=10).rev().map(f64::from).collect(); // unsorted input
        let d = Distribution::from_samples(&s).unwrap();
        assert_eq!(d.count, 10);
        assert_close!(d.mean, 5.5);
        assert_close!(d.p50, 5.5);
        assert_close!(d.p90, 9.1);
        assert_close!(d.p95, 9.55);
        assert_close!(d.p99, 9.91);
        assert_close!(d.max, 10.0);
    }

    #[test]
    fn distribution_single_and_two_samples() {
        let d = Distribution::from_samples(&[7.0]).unwrap();
        assert_eq!(d, Distribution { count: 1, mean: 7.0, p50: 7.0, p90: 7.0, p95: 7.0, p99: 7.0, max: 7.0 });
        // numpy.percentile([10, 20], [50, 90, 95, 99]) = 15, 19, 19.5, 19.9
        let d = Distribution::from_samples(&[20.0, 10.0]).unwrap();
        assert_eq!(d.count, 2);
        assert_close!(d.mean, 15.0);
        assert_close!(d.p50, 15.0);
        assert_close!(d.p90, 19.0);
        assert_close!(d.p95, 19.5);
        assert_close!(d.p99, 19.9);
        assert_close!(d.max, 20.0);
    }

    #[test]
    fn distribution_ignores_nan_and_empty() {
        assert_eq!(Distribution::from_samples(&[]), None);
        assert_eq!(Distribution::from_samples(&[f64::NAN, f64::INFINITY]), None);
        let d = Distribution::from_samples(&[f64::NAN, 3.0, 1.0, f64::NAN, 2.0]).unwrap();
        assert_eq!(d.count, 3);
        assert_close!(d.mean, 2.0);
        assert_close!(d.p50, 2.0);
        assert_close!(d.max, 3.0);
    }

    #[test]
    fn slo_parse_good() {
        assert_eq!(
            Slo::parse("ttft_ms=500,tpot_ms=50").unwrap(),
            Slo { ttft_ms: Some(500.0), tpot_ms: Some(50.0), e2e_ms: None }
        );
        assert_eq!(
            Slo::parse(" e2e_ms = 2000.5 , ttft_ms=0,").unwrap(),
            Slo { ttft_ms: Some(0.0), tpot_ms: None, e2e_ms: Some(2000.5) }
        );
    }

    #[test]
    fn slo_parse_bad() {
        assert_eq!(Slo::parse(""), Err(StatsError::EmptySlo));
        assert_eq!(Slo::parse(" , "), Err(StatsError::EmptySlo));
        let e = Slo::parse("ttft_ms=500,itl_ms=5").unwrap_err();
        assert_eq!(e, StatsError::UnknownKey { key: "itl_ms".into() });
        assert!(e.to_string().contains("itl_ms"));
        let e = Slo::parse("tpot_ms=fast").unwrap_err();
        assert_eq!(e, StatsError::InvalidValue { key: "tpot_ms".into(), value: "fast".into() });
        assert!(e.to_string().contains("fast") && e.to_string().contains("tpot_ms"));
        assert!(matches!(Slo::parse("ttft_ms=-1"), Err(StatsError::InvalidValue { .. })));
        assert!(matches!(Slo::parse("ttft_ms=NaN"), Err(StatsError::InvalidValue { .. })));
        assert!(matches!(Slo::parse("ttft_ms=inf"), Err(StatsError::InvalidValue { .. })));
        assert!(matches!(Slo::parse("ttft_ms="), Err(StatsError::InvalidValue { .. })));
        let e = Slo::parse("ttft_ms").unwrap_err();
        assert_eq!(e, StatsError::MissingValue { part: "ttft_ms".into() });
        assert!(e.to_string().contains("ttft_ms"));
        assert_eq!(Slo::parse("ttft_ms=1,ttft_ms=2"), Err(StatsError::DuplicateKey { key: "ttft_ms".into() }));
    }

    #[test]
    fn summary_counts_errors_and_excludes_warmup_and_other_pairs() {
        let mut warm = ok("a", 0, 1.0, &[1.0], 2);
        warm.warmup = true;
        let mut warm_failed = failed("a", 0, "timeout");
        warm_failed.warmup = true;
        let records = vec![
            ok("a", 0, 10.0, &[2.0, 4.0], 3),
            ok("a", 0, 30.0, &[6.0], 2),
            failed("a", 0, "http_5xx"),
            failed("a", 0, "http_5xx"),
            failed("a", 0, "connect"),
            warm,
            warm_failed,
            ok("b", 0, 999.0, &[999.0], 2),
            failed("b", 0, "timeout"),
            ok("a", 1, 999.0, &[999.0], 2),
            failed("a", 1, "timeout"),
        ];
        let s = summarize(&records, "a", 0, "concurrency=2", 2.0, None);
        assert_eq!(s.target, "a");
        assert_eq!(s.point, 0);
        assert_eq!(s.label, "concurrency=2");
        assert_eq!(s.completed, 2);
        assert_eq!(s.failed, 3);
        assert_eq!(s.errors, BTreeMap::from([("connect".to_string(), 1), ("http_5xx".to_string(), 2)]));
        assert_eq!(s.goodput, None);

        let ttft = s.ttft_ms.unwrap();
        assert_eq!(ttft.count, 2);
        assert_close!(ttft.mean, 20.0);
        assert_close!(ttft.max, 30.0);
        // ITL pools all gaps: [2, 4, 6]
        let itl = s.itl_ms.unwrap();
        assert_eq!(itl.count, 3);
        assert_close!(itl.mean, 4.0);
        assert_close!(itl.p50, 4.0);
        assert_close!(itl.p90, 5.6);
        // TPOT per request: (16 - 10) / 2 = 3, (36 - 30) / 1 = 6
        let tpot = s.tpot_ms.unwrap();
        assert_eq!(tpot.count, 2);
        assert_close!(tpot.p50, 4.5);
        let e2e = s.e2e_ms.unwrap();
        assert_close!(e2e.p50, 26.0);
        assert_close!(e2e.max, 36.0);
    }

    #[test]
    fn summary_throughput_arithmetic() {
        let mut r1 = ok("a", 0, 5.0, &[1.0; 9], 10);
        r1.prompt_tokens = 100;
        let mut r2 = ok("a", 0, 5.0, &[1.0; 29], 30);
        r2.prompt_tokens = 50;
        let mut r3 = failed("a", 0, "timeout");
        r3.prompt_tokens = 1000; // failed requests add no tokens
        let s = summarize(&[r1, r2, r3], "a", 0, "", 4.0, None);
        assert_close!(s.duration_s, 4.0);
        assert_close!(s.requests_per_s, 0.5); // 2 / 4
        assert_close!(s.output_tokens_per_s, 10.0); // 40 / 4
        assert_close!(s.total_tokens_per_s, 47.5); // (150 + 40) / 4

        // a zero window gives zero rates, never inf/NaN
        let s = summarize(&[ok("a", 0, 5.0, &[1.0], 2)], "a", 0, "", 0.0, None);
        assert_eq!((s.requests_per_s, s.output_tokens_per_s, s.total_tokens_per_s), (0.0, 0.0, 0.0));
    }

    #[test]
    fn summary_of_nothing() {
        let s = summarize(&[], "a", 0, "", 1.0, Some(Slo { ttft_ms: Some(1.0), ..Slo::default() }));
        assert_eq!((s.completed, s.failed), (0, 0));
        assert!(s.ttft_ms.is_none() && s.itl_ms.is_none() && s.tpot_ms.is_none() && s.e2e_ms.is_none());
        let g = s.goodput.unwrap();
        assert_eq!((g.good, g.requests_per_s, g.fraction), (0, 0.0, 0.0));
    }

    #[test]
    fn goodput_with_ttft_and_tpot_violations() {
        let slo = Slo::parse("ttft_ms=100,tpot_ms=10").unwrap();
        let records = vec![
            // good: ttft 50, tpot (50+5+5 - 50)/2 = 5
            ok("a", 0, 50.0, &[5.0, 5.0], 3),
            // good: exactly on both bounds
            ok("a", 0, 100.0, &[10.0, 10.0], 3),
            // violates ttft only
            ok("a", 0, 150.0, &[5.0, 5.0], 3),
            // violates tpot only: (20 + 20) / 2 = 20
            ok("a", 0, 50.0, &[20.0, 20.0], 3),
            // single output token: no tpot, so only ttft is checked -> good
            ok("a", 0, 60.0, &[], 1),
            // success without a first token cannot meet a ttft bound
            RequestRecord { ttft_ms: None, ..ok("a", 0, 0.0, &[], 0) },
            // failures count in the denominator only
            failed("a", 0, "timeout"),
            failed("a", 0, "http_5xx"),
        ];
        let s = summarize(&records, "a", 0, "", 2.0, Some(slo));
        assert_eq!((s.completed, s.failed), (6, 2));
        let g = s.goodput.unwrap();
        assert_eq!(g.slo, slo);
        assert_eq!(g.good, 3);
        assert_close!(g.requests_per_s, 1.5);
        assert_close!(g.fraction, 3.0 / 8.0);

        // an e2e bound alone
        let slo = Slo { e2e_ms: Some(60.0), ..Slo::default() };
        let g = summarize(&records, "a", 0, "", 2.0, Some(slo)).goodput.unwrap();
        // e2e: 60, 120, 160, 90, 60, 0 -> 60, 60, 0 qualify
        assert_eq!(g.good, 3);
    }

    #[test]
    fn run_summary_round_trips_through_json() {
        let s = summarize(&[ok("a", 0, 10.0, &[1.0], 2)], "a", 0, "rate=4", 1.0, Some(Slo::default()));
        let run = RunSummary::new(vec![s], serde_json::json!({"seed": 1}));
        assert_eq!(run.schema_version, 1);
        let text = serde_json::to_string_pretty(&run).unwrap();
        let back: RunSummary = serde_json::from_str(&text).unwrap();
        assert_eq!(back, run);
    }
}
