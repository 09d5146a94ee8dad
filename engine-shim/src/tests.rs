//! Tests of the normalization: one realistic fixture per dialect with its
//! exact expected signal, the aggregation and precedence rules, detection,
//! and a seeded mutation run that must never panic.

use crate::text::parse_samples;
use crate::{parse_load_signal, Dialect, LoadSignal, ShimError};

const VLLM_V1: &str = include_str!("testdata/vllm_v1.prom");
const VLLM_V1_DP: &str = include_str!("testdata/vllm_v1_dp.prom");
const VLLM_V0: &str = include_str!("testdata/vllm_v0.prom");
const SWITCHYARD: &str = include_str!("testdata/switchyard.prom");
const SGLANG: &str = include_str!("testdata/sglang.prom");
const TGI: &str = include_str!("testdata/tgi.prom");
const LLAMACPP_OLD: &str = include_str!("testdata/llamacpp_old.prom");
const LLAMACPP_NEW: &str = include_str!("testdata/llamacpp_new.prom");

const FIXTURES: &[&str] = &[VLLM_V1, VLLM_V1_DP, VLLM_V0, SWITCHYARD, SGLANG, TGI, LLAMACPP_OLD, LLAMACPP_NEW];

const AT: u64 = 1_722_000_000_123;

/// A signal with every optional field absent, to fill in with `..`.
fn empty(dialect: Dialect) -> LoadSignal {
    LoadSignal {
        dialect,
        waiting: 0.0,
        running: 0.0,
        kv_usage: None,
        prefix_hit_rate: None,
        prefix_cache_queries_total: None,
        prefix_cache_hits_total: None,
        generation_tokens_total: None,
        process_start_time_seconds: None,
        max_model_len: None,
        scraped_at_unix_ms: AT,
    }
}

fn check(cases: &[(&str, &str, LoadSignal)]) {
    for (case, text, want) in cases {
        let got = parse_load_signal(text, AT).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(got, *want, "{case}");
    }
}

#[test]
fn realistic_bodies_of_every_dialect() {
    check(&[
        (
            "vLLM V1, one engine",
            VLLM_V1,
            LoadSignal {
                waiting: 3.0,
                running: 12.0,
                kv_usage: Some(0.4375),
                prefix_hit_rate: Some(0.75),
                prefix_cache_queries_total: Some(182_272.0),
                prefix_cache_hits_total: Some(136_704.0),
                generation_tokens_total: Some(48_213.0),
                process_start_time_seconds: Some(1_721_983_214.5),
                ..empty(Dialect::Vllm)
            },
        ),
        (
            "vLLM V1, data parallel engine=0/1",
            VLLM_V1_DP,
            LoadSignal {
                waiting: 7.0,
                running: 24.0,
                kv_usage: Some(0.625),
                prefix_hit_rate: Some(0.25),
                prefix_cache_queries_total: Some(8_000.0),
                prefix_cache_hits_total: Some(2_000.0),
                generation_tokens_total: Some(160_500.0),
                process_start_time_seconds: Some(1_721_980_000.0),
                max_model_len: Some(32_768),
                ..empty(Dialect::Vllm)
            },
        ),
        (
            "vLLM V0: gpu_cache_usage_perc, hit-rate gauge, counters without _total",
            VLLM_V0,
            LoadSignal {
                waiting: 17.0,
                running: 31.0,
                kv_usage: Some(0.96875),
                prefix_hit_rate: Some(0.375),
                generation_tokens_total: Some(204_800.0),
                ..empty(Dialect::Vllm)
            },
        ),
        (
            "Switchyard engine (vLLM names, prometheus crate formatting)",
            SWITCHYARD,
            LoadSignal {
                waiting: 0.0,
                running: 4.0,
                kv_usage: Some(0.125),
                // Queries are 0: no rate yet, but the counters are reported.
                prefix_hit_rate: None,
                prefix_cache_queries_total: Some(0.0),
                prefix_cache_hits_total: Some(0.0),
                generation_tokens_total: Some(5_632.0),
                ..empty(Dialect::Vllm)
            },
        ),
        (
            "SGLang",
            SGLANG,
            LoadSignal {
                waiting: 7.0,
                running: 24.0,
                kv_usage: Some(0.8125),
                prefix_hit_rate: Some(0.6875),
                generation_tokens_total: Some(884_736.0),
                process_start_time_seconds: Some(1_730_000_000.0),
                ..empty(Dialect::Sglang)
            },
        ),
        (
            "TGI",
            TGI,
            LoadSignal { waiting: 4.0, running: 9.0, generation_tokens_total: Some(183_040.0), ..empty(Dialect::Tgi) },
        ),
        (
            "llama.cpp, older build with kv_cache_usage_ratio",
            LLAMACPP_OLD,
            LoadSignal {
                waiting: 1.0,
                running: 2.0,
                kv_usage: Some(0.1875),
                generation_tokens_total: Some(9_876.0),
                ..empty(Dialect::LlamaCpp)
            },
        ),
        (
            "llama.cpp, newer build: no KV usage; tokens_predicted_total preferred over n_decode_total",
            LLAMACPP_NEW,
            LoadSignal {
                waiting: 0.0,
                running: 4.0,
                generation_tokens_total: Some(20_480.0),
                ..empty(Dialect::LlamaCpp)
            },
        ),
    ]);
}

#[test]
fn crlf_bodies_give_the_same_signal() {
    for text in FIXTURES {
        let crlf = text.replace('\n', "\r\n");
        assert_eq!(parse_load_signal(&crlf, AT), parse_load_signal(text, AT));
    }
}

#[test]
fn aggregation_over_label_sets() {
    check(&[
        (
            "two models, two engines each: sums and max",
            r#"
vllm:num_requests_waiting{engine="0",model_name="a"} 1
vllm:num_requests_waiting{engine="1",model_name="a"} 2
vllm:num_requests_waiting{engine="0",model_name="b"} 4
vllm:num_requests_waiting{engine="1",model_name="b"} 8
vllm:num_requests_running{engine="0",model_name="a"} 16
vllm:num_requests_running{engine="1",model_name="a"} 32
vllm:num_requests_running{engine="0",model_name="b"} 64
vllm:num_requests_running{engine="1",model_name="b"} 128
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.875
vllm:kv_cache_usage_perc{engine="0",model_name="b"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="b"} 0.0
vllm:prefix_cache_queries_total{engine="0",model_name="a"} 100
vllm:prefix_cache_queries_total{engine="1",model_name="b"} 300
vllm:prefix_cache_hits_total{engine="0",model_name="a"} 50
vllm:prefix_cache_hits_total{engine="1",model_name="b"} 50
vllm:generation_tokens_total{engine="0",model_name="a"} 1000
vllm:generation_tokens_total{engine="1",model_name="b"} 24
"#,
            LoadSignal {
                waiting: 15.0,
                running: 240.0,
                kv_usage: Some(0.875),
                prefix_hit_rate: Some(0.25),
                prefix_cache_queries_total: Some(400.0),
                prefix_cache_hits_total: Some(100.0),
                generation_tokens_total: Some(1024.0),
                ..empty(Dialect::Vllm)
            },
        ),
        (
            "SGLang hit-rate gauges are averaged, token usage is the max",
            r#"
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 3
sglang:num_queue_reqs{model_name="m",tp_rank="1"} 4
sglang:num_running_reqs{model_name="m",tp_rank="0"} 10
sglang:num_running_reqs{model_name="m",tp_rank="1"} 11
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
sglang:token_usage{model_name="m",tp_rank="1"} 0.75
sglang:cache_hit_rate{model_name="m",tp_rank="0"} 0.25
sglang:cache_hit_rate{model_name="m",tp_rank="1"} 0.75
"#,
            LoadSignal {
                waiting: 7.0,
                running: 21.0,
                kv_usage: Some(0.75),
                prefix_hit_rate: Some(0.5),
                ..empty(Dialect::Sglang)
            },
        ),
        (
            "two TGI label sets",
            "tgi_queue_size{shard=\"0\"} 2\ntgi_queue_size{shard=\"1\"} 3\ntgi_batch_current_size 5\n",
            LoadSignal { waiting: 5.0, running: 5.0, ..empty(Dialect::Tgi) },
        ),
    ]);
}

#[test]
fn precedence_fallbacks_and_sanitizing() {
    check(&[
        (
            "kv_cache_usage_perc wins over gpu_cache_usage_perc",
            "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n",
            LoadSignal { kv_usage: Some(0.1), ..empty(Dialect::Vllm) },
        ),
        (
            "gpu_cache_usage_perc used when kv_cache_usage_perc is NaN",
            "vllm:kv_cache_usage_perc NaN\nvllm:gpu_cache_usage_perc 0.5\n",
            LoadSignal { kv_usage: Some(0.5), ..empty(Dialect::Vllm) },
        ),
        (
            "a NaN sample is ignored next to a real one",
            "vllm:kv_cache_usage_perc{engine=\"0\"} NaN\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.25\nvllm:num_requests_running{engine=\"0\"} NaN\nvllm:num_requests_running{engine=\"1\"} 3\n",
            LoadSignal { running: 3.0, kv_usage: Some(0.25), ..empty(Dialect::Vllm) },
        ),
        (
            "NaN everywhere reads as absent",
            "vllm:num_requests_waiting NaN\nvllm:num_requests_running NaN\nvllm:kv_cache_usage_perc NaN\nvllm:generation_tokens_total NaN\n",
            empty(Dialect::Vllm),
        ),
        (
            "KV usage above 1 is clamped",
            "vllm:kv_cache_usage_perc 1.7\n",
            LoadSignal { kv_usage: Some(1.0), ..empty(Dialect::Vllm) },
        ),
        (
            "KV usage below 0 is clamped",
            "sglang:token_usage -0.2\n",
            LoadSignal { kv_usage: Some(0.0), ..empty(Dialect::Sglang) },
        ),
        (
            "KV usage +Inf is clamped",
            "llamacpp:kv_cache_usage_ratio +Inf\n",
            LoadSignal { kv_usage: Some(1.0), ..empty(Dialect::LlamaCpp) },
        ),
        (
            "hit-rate gauge is clamped (vLLM V0 reports -1 when disabled)",
            "vllm:gpu_prefix_cache_hit_rate -1\n",
            LoadSignal { prefix_hit_rate: Some(0.0), ..empty(Dialect::Vllm) },
        ),
        (
            "hit-rate gauge beats the counters",
            "vllm:gpu_prefix_cache_hit_rate 0.5\nvllm:prefix_cache_queries_total 100\nvllm:prefix_cache_hits_total 10\n",
            LoadSignal {
                prefix_hit_rate: Some(0.5),
                prefix_cache_queries_total: Some(100.0),
                prefix_cache_hits_total: Some(10.0),
                ..empty(Dialect::Vllm)
            },
        ),
        (
            "hits above queries clamp the rate to 1",
            "vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total 20\n",
            LoadSignal {
                prefix_hit_rate: Some(1.0),
                prefix_cache_queries_total: Some(10.0),
                prefix_cache_hits_total: Some(20.0),
                ..empty(Dialect::Vllm)
            },
        ),
        (
            "hits without queries: no rate",
            "vllm:prefix_cache_hits_total 20\n",
            LoadSignal { prefix_cache_hits_total: Some(20.0), ..empty(Dialect::Vllm) },
        ),
        (
            "_total preferred over the bare counter name; never added together",
            "vllm:prefix_cache_queries_total 400\nvllm:prefix_cache_queries 400\nvllm:prefix_cache_hits_total 100\nvllm:prefix_cache_hits 100\nvllm:generation_tokens_total 7\nvllm:generation_tokens 7\n",
            LoadSignal {
                prefix_hit_rate: Some(0.25),
                prefix_cache_queries_total: Some(400.0),
                prefix_cache_hits_total: Some(100.0),
                generation_tokens_total: Some(7.0),
                ..empty(Dialect::Vllm)
            },
        ),
        (
            "bare counter names alone",
            "vllm:prefix_cache_queries 400\nvllm:prefix_cache_hits 300\n",
            LoadSignal {
                prefix_hit_rate: Some(0.75),
                prefix_cache_queries_total: Some(400.0),
                prefix_cache_hits_total: Some(300.0),
                ..empty(Dialect::Vllm)
            },
        ),
        (
            "llama.cpp n_decode_total when tokens_predicted_total is missing",
            "llamacpp:requests_processing 1\nllamacpp:n_decode_total 321\n",
            LoadSignal { running: 1.0, generation_tokens_total: Some(321.0), ..empty(Dialect::LlamaCpp) },
        ),
        (
            "negative and infinite queue gauges are ignored",
            "vllm:num_requests_waiting{engine=\"0\"} -3\nvllm:num_requests_waiting{engine=\"1\"} 2\nvllm:num_requests_running{engine=\"0\"} +Inf\nvllm:num_requests_running{engine=\"1\"} 1\n",
            LoadSignal { waiting: 2.0, running: 1.0, ..empty(Dialect::Vllm) },
        ),
        (
            "process_start_time_seconds is family-independent; NaN ignored",
            "tgi_queue_size 1\nprocess_start_time_seconds NaN\nprocess_start_time_seconds 1.7e9\n",
            LoadSignal { waiting: 1.0, process_start_time_seconds: Some(1.7e9), ..empty(Dialect::Tgi) },
        ),
        (
            "sums saturate instead of overflowing to +Inf",
            "vllm:num_requests_waiting{engine=\"0\"} 1.5e308\nvllm:num_requests_waiting{engine=\"1\"} 1.5e308\n",
            LoadSignal { waiting: f64::MAX, ..empty(Dialect::Vllm) },
        ),
        (
            "timestamps on samples are accepted and dropped",
            "vllm:num_requests_running 5 1722000000000\n",
            LoadSignal { running: 5.0, ..empty(Dialect::Vllm) },
        ),
    ]);
}

#[test]
fn max_model_len_sources() {
    check(&[
        ("direct sample", "vllm:num_requests_running 0\nvllm:max_model_len{model_name=\"m\"} 8192\n", LoadSignal { max_model_len: Some(8192), ..empty(Dialect::Vllm) }),
        (
            "label on cache_config_info",
            "vllm:num_requests_running 0\nvllm:cache_config_info{block_size=\"16\",max_model_len=\"4096\"} 1\n",
            LoadSignal { max_model_len: Some(4096), ..empty(Dialect::Vllm) },
        ),
        (
            "label on model_config_info",
            "vllm:num_requests_running 0\nvllm:model_config_info{max_model_len=\"131072\",model=\"m\"} 1\n",
            LoadSignal { max_model_len: Some(131_072), ..empty(Dialect::Vllm) },
        ),
        (
            "several sources: the largest",
            "vllm:num_requests_running 0\nvllm:max_model_len 2048\nvllm:model_config_info{max_model_len=\"4096\"} 1\n",
            LoadSignal { max_model_len: Some(4096), ..empty(Dialect::Vllm) },
        ),
        (
            "unusable values are ignored",
            "vllm:num_requests_running 0\nvllm:max_model_len NaN\nvllm:max_model_len 0\nvllm:max_model_len 12.5\nvllm:cache_config_info{max_model_len=\"None\"} 1\nvllm:model_config_info{max_model_len=\"-1\"} 1\n",
            empty(Dialect::Vllm),
        ),
        (
            "float-looking label",
            "vllm:num_requests_running 0\nvllm:model_config_info{max_model_len=\"8192.0\"} 1\n",
            LoadSignal { max_model_len: Some(8192), ..empty(Dialect::Vllm) },
        ),
        (
            "label on an unrelated metric is not a source",
            "vllm:num_requests_running 0\nvllm:lora_requests_info{max_model_len=\"4096\"} 1\n",
            empty(Dialect::Vllm),
        ),
    ]);
}

#[test]
fn dialect_detection() {
    check(&[
        ("one known name is enough", "sglang:gen_throughput 12.5\n", empty(Dialect::Sglang)),
        (
            "the family with more known names wins",
            "tgi_queue_size 9\nllamacpp:requests_deferred 1\nllamacpp:requests_processing 2\n",
            LoadSignal { waiting: 1.0, running: 2.0, ..empty(Dialect::LlamaCpp) },
        ),
        (
            "ties go to the earlier family (vLLM first)",
            "sglang:num_queue_reqs 5\nvllm:num_requests_waiting 6\n",
            LoadSignal { waiting: 6.0, ..empty(Dialect::Vllm) },
        ),
        (
            "prefix fallback: TGI before its first request",
            "# TYPE tgi_request_count counter\ntgi_request_count 0\n",
            empty(Dialect::Tgi),
        ),
        (
            "prefix fallback: vLLM exposing only info and histograms",
            "vllm:cache_config_info{block_size=\"16\"} 1\nvllm:e2e_request_latency_seconds_count 0\n",
            empty(Dialect::Vllm),
        ),
        (
            "known names beat prefixes",
            "vllm:request_success_total 1\nvllm:e2e_request_latency_seconds_count 1\ntgi_queue_size 2\n",
            LoadSignal { waiting: 2.0, ..empty(Dialect::Tgi) },
        ),
    ]);
}

#[test]
fn errors() {
    let cases: &[(&str, &str, ShimError)] = &[
        ("empty body", "", ShimError::NoKnownMetrics),
        ("comments only", "# HELP x y\n# TYPE x gauge\n\n", ShimError::NoKnownMetrics),
        (
            "a Python process with no engine",
            "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e9\npython_info{version=\"3.12\"} 1\n",
            ShimError::NoKnownMetrics,
        ),
        ("a name that only looks similar", "vllm_num_requests_running 3\nsglang_token_usage 1\n", ShimError::NoKnownMetrics),
        (
            "a syntax error anywhere fails the scrape",
            "vllm:num_requests_running 3\nvllm:num_requests_waiting{model_name=\"m\" 1\n",
            ShimError::Syntax { line: 2, reason: "expected `,` or `}` after the value of label `model_name`, found `1`".into() },
        ),
        (
            "a truncated scrape",
            "vllm:num_requests_running 3\nvllm:num_requests_waiting{model_na",
            ShimError::Syntax { line: 2, reason: "expected `=` after label name `model_na`, found end of line".into() },
        ),
    ];
    for (case, text, want) in cases {
        assert_eq!(parse_load_signal(text, AT).as_ref(), Err(want), "{case}");
    }
    // A syntax error in a fixture reports the fixture's line.
    let broken = VLLM_V1.replacen("vllm:kv_cache_usage_perc{", "vllm:kv_cache_usage_perc{{", 1);
    let line = 1 + VLLM_V1.lines().position(|l| l.starts_with("vllm:kv_cache_usage_perc{")).unwrap();
    assert!(matches!(parse_load_signal(&broken, AT), Err(ShimError::Syntax { line: l, .. }) if l == line));
    assert!(matches!(parse_samples(&broken), Err(ShimError::Syntax { line: l, .. }) if l == line));
}

#[test]
fn dialect_names() {
    let all =
        [(Dialect::Vllm, "vllm"), (Dialect::Sglang, "sglang"), (Dialect::Tgi, "tgi"), (Dialect::LlamaCpp, "llamacpp")];
    for (dialect, name) in all {
        assert_eq!(dialect.as_str(), name);
        assert_eq!(dialect.to_string(), name);
    }
}

#[test]
fn fixtures_parse_to_the_expected_sample_counts() {
    let count = |text: &str| text.lines().filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#')).count();
    for text in FIXTURES {
        assert_eq!(parse_samples(text).unwrap().len(), count(text));
    }
}

/// xorshift64: a tiny deterministic generator, so failures reproduce.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform-ish in `0..n`; `n` must be non-zero.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Characters that stress the grammar, plus some multi-byte ones.
const ALPHABET: &[char] = &[
    '{', '}', '"', ',', '=', '\\', '\n', '\r', '#', ' ', '\t', 'e', 'E', '+', '-', '.', '0', '1', '9', 'N', 'a', 'I',
    'n', 'f', ':', '_', 'x', 'é', '中', '🚀', '\u{0}', '\u{feff}',
];

fn mutate(rng: &mut XorShift, body: &mut Vec<char>) {
    let len = body.len();
    let pos = if len == 0 { 0 } else { rng.below(len) };
    match rng.below(7) {
        0 if len > 0 => {
            body.remove(pos);
        }
        1 => body.insert(pos.min(len), ALPHABET[rng.below(ALPHABET.len())]),
        2 if len > 0 => body[pos] = ALPHABET[rng.below(ALPHABET.len())],
        3 if len > 0 => {
            let end = (pos + 1 + rng.below(64)).min(len);
            let chunk: Vec<char> = body[pos..end].to_vec();
            let at = rng.below(len + 1);
            body.splice(at..at, chunk);
        }
        4 if len > 0 => {
            let end = (pos + 1 + rng.below(64)).min(len);
            body.drain(pos..end);
        }
        5 => body.truncate(pos),
        6 if len > 1 => body.swap(pos, rng.below(len)),
        _ => {}
    }
}

#[test]
fn never_panics_on_mutated_bodies() {
    let fixtures: Vec<Vec<char>> = FIXTURES.iter().map(|f| f.chars().collect()).collect();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let (mut ok, mut syntax, mut unknown) = (0, 0, 0);
    for i in 0..10_000 {
        let mut body = fixtures[i % fixtures.len()].clone();
        for _ in 0..=rng.below(8) {
            mutate(&mut rng, &mut body);
        }
        let text: String = body.into_iter().collect();
        let lines = text.split('\n').count();

        match parse_samples(&text) {
            Ok(_) => {}
            Err(ShimError::Syntax { line, .. }) => {
                assert!((1..=lines).contains(&line), "iteration {i}: line {line} of {lines}")
            }
            Err(e) => panic!("iteration {i}: parse_samples returned {e:?}"),
        }
        match parse_load_signal(&text, AT) {
            Ok(s) => {
                ok += 1;
                assert!(s.waiting.is_finite() && s.waiting >= 0.0, "iteration {i}: {s:?}");
                assert!(s.running.is_finite() && s.running >= 0.0, "iteration {i}: {s:?}");
                for v in [s.kv_usage, s.prefix_hit_rate].into_iter().flatten() {
                    assert!((0.0..=1.0).contains(&v), "iteration {i}: {s:?}");
                }
                assert_eq!(s.scraped_at_unix_ms, AT);
            }
            Err(ShimError::Syntax { line, .. }) => {
                syntax += 1;
                assert!((1..=lines).contains(&line), "iteration {i}: line {line} of {lines}");
            }
            Err(ShimError::NoKnownMetrics) => unknown += 1,
            Err(e @ ShimError::Load(_)) => panic!("iteration {i}: /metrics parsing never gives {e:?}"),
        }
    }
    // The run must exercise both the accepting and the rejecting paths.
    assert!(ok > 500 && syntax > 500, "ok {ok}, syntax {syntax}, unknown {unknown}");
}
