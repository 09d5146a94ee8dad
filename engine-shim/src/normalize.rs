//! Folding parsed samples into a [`LoadSignal`]: the name tables and the
//! aggregation rules. See the crate documentation for the algorithm.

use crate::text::{self, SampleRef};
use crate::{Dialect, LoadSignal, ShimError};

/// The families in tie-break order for detection.
const DIALECTS: [Dialect; 4] = [Dialect::Vllm, Dialect::Sglang, Dialect::Tgi, Dialect::LlamaCpp];

/// What a known metric name contributes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Waiting,
    Running,
    KvUsage,
    /// Used only when [`Slot::KvUsage`] has no value (vLLM V0 name).
    KvUsageFallback,
    /// A gauge that already is the prefix-cache hit rate.
    HitRate,
    PrefixQueries,
    /// Used only when [`Slot::PrefixQueries`] has no value (no `_total` suffix).
    PrefixQueriesFallback,
    PrefixHits,
    /// Used only when [`Slot::PrefixHits`] has no value (no `_total` suffix).
    PrefixHitsFallback,
    GenerationTokens,
    /// Used only when [`Slot::GenerationTokens`] has no value.
    GenerationTokensFallback,
    /// Identifies the family but feeds no field.
    DetectOnly,
}

const SLOTS: usize = 12;
// `Slot as usize` indexes `[Acc; SLOTS]`: keep the two in step.
const _: () = assert!(Slot::DetectOnly as usize + 1 == SLOTS);

/// How the samples of one slot, over all label sets, become one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fold {
    /// Sum of finite, non-negative samples (queue lengths, counters).
    Sum,
    /// Maximum, each sample clamped into 0..=1 (utilisation).
    MaxFraction,
    /// Mean, each sample clamped into 0..=1 (rates of unknown weight).
    MeanFraction,
    /// Nothing.
    Ignore,
}

impl Slot {
    fn fold(self) -> Fold {
        match self {
            Slot::Waiting
            | Slot::Running
            | Slot::PrefixQueries
            | Slot::PrefixQueriesFallback
            | Slot::PrefixHits
            | Slot::PrefixHitsFallback
            | Slot::GenerationTokens
            | Slot::GenerationTokensFallback => Fold::Sum,
            Slot::KvUsage | Slot::KvUsageFallback => Fold::MaxFraction,
            Slot::HitRate => Fold::MeanFraction,
            Slot::DetectOnly => Fold::Ignore,
        }
    }
}

/// The known metric names of every family.
fn classify(name: &str) -> Option<(Dialect, Slot)> {
    use Dialect::{LlamaCpp, Sglang, Tgi, Vllm};
    use Slot::*;
    Some(match name {
        // vLLM V1 (and Switchyard's engine), with the V0 and old
        // prometheus_client spellings as fallbacks.
        "vllm:num_requests_waiting" => (Vllm, Waiting),
        "vllm:num_requests_running" => (Vllm, Running),
        "vllm:kv_cache_usage_perc" => (Vllm, KvUsage),
        "vllm:gpu_cache_usage_perc" => (Vllm, KvUsageFallback),
        "vllm:gpu_prefix_cache_hit_rate" => (Vllm, HitRate),
        "vllm:prefix_cache_queries_total" => (Vllm, PrefixQueries),
        "vllm:prefix_cache_queries" => (Vllm, PrefixQueriesFallback),
        "vllm:prefix_cache_hits_total" => (Vllm, PrefixHits),
        "vllm:prefix_cache_hits" => (Vllm, PrefixHitsFallback),
        "vllm:generation_tokens_total" => (Vllm, GenerationTokens),
        "vllm:generation_tokens" => (Vllm, GenerationTokensFallback),
        // SGLang.
        "sglang:num_queue_reqs" => (Sglang, Waiting),
        "sglang:num_running_reqs" => (Sglang, Running),
        "sglang:token_usage" => (Sglang, KvUsage),
        "sglang:cache_hit_rate" => (Sglang, HitRate),
        "sglang:generation_tokens_total" => (Sglang, GenerationTokens),
        "sglang:gen_throughput" => (Sglang, DetectOnly),
        // Hugging Face TGI. The `_sum` of the per-request generated-tokens
        // histogram is a monotonic generated-tokens counter.
        "tgi_queue_size" => (Tgi, Waiting),
        "tgi_batch_current_size" => (Tgi, Running),
        "tgi_request_generated_tokens_sum" => (Tgi, GenerationTokens),
        // llama.cpp server.
        "llamacpp:requests_deferred" => (LlamaCpp, Waiting),
        "llamacpp:requests_processing" => (LlamaCpp, Running),
        "llamacpp:kv_cache_usage_ratio" => (LlamaCpp, KvUsage),
        "llamacpp:tokens_predicted_total" => (LlamaCpp, GenerationTokens),
        "llamacpp:n_decode_total" => (LlamaCpp, GenerationTokensFallback),
        _ => return None,
    })
}

/// Name prefix of a family, used to detect it when none of its known names
/// is present yet (e.g. TGI before its first request).
fn prefix(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Vllm => "vllm:",
        Dialect::Sglang => "sglang:",
        Dialect::Tgi => "tgi_",
        Dialect::LlamaCpp => "llamacpp:",
    }
}

fn index(dialect: Dialect) -> usize {
    match dialect {
        Dialect::Vllm => 0,
        Dialect::Sglang => 1,
        Dialect::Tgi => 2,
        Dialect::LlamaCpp => 3,
    }
}

/// Running aggregate of one slot.
#[derive(Debug, Clone, Copy, Default)]
struct Acc {
    /// Any sample with this name at all, even NaN.
    seen: bool,
    /// Samples that contributed.
    n: u32,
    value: f64,
}

impl Acc {
    fn add(&mut self, fold: Fold, v: f64) {
        self.seen = true;
        match fold {
            Fold::Sum if v.is_finite() && v >= 0.0 => {
                // Saturate: two huge samples must not add up to +Inf.
                self.value = (self.value + v).min(f64::MAX);
                self.n = self.n.saturating_add(1);
            }
            Fold::MaxFraction if !v.is_nan() => {
                let v = v.clamp(0.0, 1.0);
                self.value = if self.n == 0 { v } else { self.value.max(v) };
                self.n = self.n.saturating_add(1);
            }
            Fold::MeanFraction if !v.is_nan() => {
                self.value += v.clamp(0.0, 1.0);
                self.n = self.n.saturating_add(1);
            }
            _ => {}
        }
    }

    fn get(self, fold: Fold) -> Option<f64> {
        match (self.n, fold) {
            (0, _) | (_, Fold::Ignore) => None,
            (n, Fold::MeanFraction) => Some((self.value / f64::from(n)).clamp(0.0, 1.0)),
            _ => Some(self.value),
        }
    }
}

/// Aggregates of one family.
#[derive(Debug, Clone, Copy, Default)]
struct Family {
    slots: [Acc; SLOTS],
    /// Samples whose name has the family's prefix.
    prefixed: usize,
}

impl Family {
    fn get(&self, slot: Slot) -> Option<f64> {
        self.slots[slot as usize].get(slot.fold())
    }

    /// `preferred`, or `fallback` when `preferred` has no usable sample.
    fn either(&self, preferred: Slot, fallback: Slot) -> Option<f64> {
        self.get(preferred).or_else(|| self.get(fallback))
    }

    /// Distinct known names seen: the detection score.
    fn known(&self) -> usize {
        self.slots.iter().filter(|a| a.seen).count()
    }
}

/// Everything gathered in the single pass over the body.
#[derive(Debug, Default)]
struct Tally {
    families: [Family; 4],
    process_start: Option<f64>,
    max_model_len: Option<u64>,
}

impl Tally {
    fn observe(&mut self, s: &SampleRef<'_, '_>) {
        if let Some((dialect, slot)) = classify(s.name) {
            self.families[index(dialect)].slots[slot as usize].add(slot.fold(), s.value);
        }
        for dialect in DIALECTS {
            if s.name.starts_with(prefix(dialect)) {
                self.families[index(dialect)].prefixed += 1;
            }
        }
        match s.name {
            "process_start_time_seconds" if s.value.is_finite() => {
                // Several would be odd; the latest start is the one that counts.
                self.process_start = Some(self.process_start.map_or(s.value, |p| p.max(s.value)));
            }
            "vllm:max_model_len" => self.max_model_len(length_from_f64(s.value)),
            "vllm:cache_config_info" | "vllm:model_config_info" => {
                self.max_model_len(s.label("max_model_len").and_then(length_from_label));
            }
            _ => {}
        }
    }

    /// Several sources or label sets: keep the largest, so the gateway never
    /// rejects a request some replica would accept.
    fn max_model_len(&mut self, len: Option<u64>) {
        self.max_model_len = self.max_model_len.max(len);
    }

    fn detect(&self) -> Option<Dialect> {
        let by = |score: &dyn Fn(&Family) -> usize| {
            let mut best: Option<(Dialect, usize)> = None;
            for dialect in DIALECTS {
                let s = score(&self.families[index(dialect)]);
                if s > 0 && best.is_none_or(|(_, b)| s > b) {
                    best = Some((dialect, s));
                }
            }
            best.map(|(d, _)| d)
        };
        by(&Family::known).or_else(|| by(&|f: &Family| f.prefixed))
    }

    fn finish(self, scraped_at_unix_ms: u64) -> Result<LoadSignal, ShimError> {
        let dialect = self.detect().ok_or(ShimError::NoKnownMetrics)?;
        let f = &self.families[index(dialect)];
        let queries = f.either(Slot::PrefixQueries, Slot::PrefixQueriesFallback);
        let hits = f.either(Slot::PrefixHits, Slot::PrefixHitsFallback);
        let counted_rate = match (hits, queries) {
            (Some(h), Some(q)) if q > 0.0 => Some((h / q).clamp(0.0, 1.0)),
            _ => None,
        };
        Ok(LoadSignal {
            dialect,
            waiting: f.get(Slot::Waiting).unwrap_or(0.0),
            running: f.get(Slot::Running).unwrap_or(0.0),
            kv_usage: f.either(Slot::KvUsage, Slot::KvUsageFallback),
            prefix_hit_rate: f.get(Slot::HitRate).or(counted_rate),
            prefix_cache_queries_total: queries,
            prefix_cache_hits_total: hits,
            generation_tokens_total: f.either(Slot::GenerationTokens, Slot::GenerationTokensFallback),
            process_start_time_seconds: self.process_start,
            max_model_len: self.max_model_len,
            scraped_at_unix_ms,
        })
    }
}

/// A positive integral length; `None` for anything else.
fn length_from_f64(v: f64) -> Option<u64> {
    // 2^53: beyond it an f64 no longer holds every integer.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    (v.is_finite() && v >= 1.0 && v.fract() == 0.0 && v <= EXACT).then_some(v as u64)
}

fn length_from_label(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.parse::<u64>() {
        Ok(n) => (n > 0).then_some(n),
        Err(_) => s.parse::<f64>().ok().and_then(length_from_f64),
    }
}

/// Parse and normalize in one pass; see [`crate::parse_load_signal`].
pub(crate) fn load_signal(text: &str, scraped_at_unix_ms: u64) -> Result<LoadSignal, ShimError> {
    let mut tally = Tally::default();
    text::for_each_sample(text, |s| tally.observe(s))?;
    tally.finish(scraped_at_unix_ms)
}
