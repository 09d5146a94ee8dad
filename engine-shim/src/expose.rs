//! What the sidecar serves: the normalized load as vLLM-named Prometheus gauges (so one
//! dashboard, one KEDA query and one gateway scrape work for every engine) followed by the
//! engine's own series passed through, and the same load as JSON for `/load`.
//!
//! Pure: the caller passes the parsed signal, the engine's raw text and the sidecar's own
//! counters.

use std::fmt::Write;

use crate::{Dialect, LoadSignal, LoraInfo, ShimError};

/// The sidecar's own view of its engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SidecarState {
    /// Requests proxied and not finished (the response body still streaming).
    pub in_flight: u64,
    /// The engine answers its health check and lists its model.
    pub ready: bool,
    /// SIGTERM received: not ready, finishing in-flight requests.
    pub draining: bool,
}

/// The gauges written under vLLM's names; engine lines with these names are not passed
/// through (a vLLM engine's own copies would duplicate them).
pub const NORMALIZED: [&str; 3] =
    ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"];

fn metric_name(line: &str) -> Option<&str> {
    let line = line.trim_start();
    if let Some(rest) = line.strip_prefix('#') {
        // `# HELP name …` / `# TYPE name …`
        let mut it = rest.split_whitespace();
        return match it.next() {
            Some("HELP" | "TYPE") => it.next(),
            _ => None,
        };
    }
    let end = line.find(|c: char| c == '{' || c.is_whitespace()).unwrap_or(line.len());
    (end > 0).then(|| &line[..end])
}

/// The `/metrics` body: normalized gauges (labelled with the detected dialect), the
/// sidecar's state, then `engine_text` without the normalized names. `signal` is `None`
/// when the last scrape failed (the gauges are then absent, not zero).
pub fn metrics_text(signal: Option<&LoadSignal>, state: SidecarState, engine_text: &str) -> String {
    let mut out = String::with_capacity(engine_text.len() + 1024);
    if let Some(s) = signal {
        let d = s.dialect.as_str();
        let gauges = [
            (NORMALIZED[0], "Requests waiting (normalized by switchyard-shim).", Some(s.waiting)),
            (NORMALIZED[1], "Requests running (normalized by switchyard-shim).", Some(s.running)),
            (NORMALIZED[2], "KV-cache usage, 1 = full (normalized by switchyard-shim).", s.kv_usage),
        ];
        for (name, help, value) in gauges {
            if let Some(v) = value {
                let _ =
                    writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{engine_dialect=\"{d}\"}} {v}");
            }
        }
    }
    let own = [
        ("switchyard_shim_in_flight_requests", "Requests proxied and not finished.", state.in_flight as f64),
        (
            "switchyard_shim_ready",
            "1 when the engine is healthy, lists its model and is not draining.",
            f64::from(u8::from(state.ready && !state.draining)),
        ),
        ("switchyard_shim_draining", "1 after SIGTERM.", f64::from(u8::from(state.draining))),
    ];
    for (name, help, v) in own {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
    for line in engine_text.lines() {
        if metric_name(line).is_some_and(|n| NORMALIZED.contains(&n)) {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn json_num(v: Option<f64>) -> String {
    v.filter(|x| x.is_finite()).map_or_else(|| "null".to_string(), |x| x.to_string())
}

/// The `/load` body: `{"dialect", "waiting", "running", "kv_usage", "prefix_hit_rate",
/// "in_flight", "ready", "draining", "scraped_at_unix_ms", "lora", "error"}`; the signal
/// fields are `null` when the last scrape failed, and `error` says why. `lora` is the
/// engine's loaded adapters (`{"running": [...], "waiting": [...], "max_lora": n}`), `null`
/// when it reports none.
pub fn load_json(
    signal: Option<&LoadSignal>,
    state: SidecarState,
    lora: Option<&LoraInfo>,
    error: Option<&str>,
) -> String {
    let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', " ");
    let lora = lora.map_or_else(
        || "null".to_string(),
        |l| serde_json::json!({"running": l.running, "waiting": l.waiting, "max_lora": l.max_lora}).to_string(),
    );
    format!(
        "{{\"dialect\":{},\"waiting\":{},\"running\":{},\"kv_usage\":{},\"prefix_hit_rate\":{},\"in_flight\":{},\
         \"ready\":{},\"draining\":{},\"scraped_at_unix_ms\":{},\"lora\":{},\"error\":{}}}",
        signal.map_or_else(|| "null".into(), |s| format!("\"{}\"", s.dialect.as_str())),
        json_num(signal.map(|s| s.waiting)),
        json_num(signal.map(|s| s.running)),
        json_num(signal.and_then(|s| s.kv_usage)),
        json_num(signal.and_then(|s| s.prefix_hit_rate)),
        state.in_flight,
        state.ready && !state.draining,
        state.draining,
        signal.map_or_else(|| "null".into(), |s| s.scraped_at_unix_ms.to_string()),
        lora,
        error.map_or_else(|| "null".into(), |e| format!("\"{}\"", esc(e))),
    )
}

/// The adapters a sidecar's `/load` body reports (its `lora` field); `None` when it has none
/// or the body does not parse.
pub fn parse_load_lora(text: &str) -> Option<LoraInfo> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let lora = v.get("lora").filter(|l| l.is_object())?;
    let names = |k: &str| -> Vec<String> {
        lora[k].as_array().map_or_else(Vec::new, |a| a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
    };
    Some(LoraInfo {
        running: names("running"),
        waiting: names("waiting"),
        max_lora: lora["max_lora"].as_u64().and_then(|m| u32::try_from(m).ok()),
    })
}

/// Read a sidecar's `/load` body back into a [`LoadSignal`] (what a gateway configured to
/// read sidecars does). A sidecar without a signal, not ready or draining is an error that
/// says so: the backend must take no new requests.
pub fn parse_load_json(text: &str, scraped_at_unix_ms: u64) -> Result<LoadSignal, ShimError> {
    let bad = |why: String| ShimError::Load(why);
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    if v["draining"].as_bool() == Some(true) {
        return Err(bad("draining".into()));
    }
    let reason = v["error"].as_str().unwrap_or("no reason given");
    if v["ready"].as_bool() != Some(true) {
        return Err(bad(format!("not ready: {reason}")));
    }
    let dialect = match v["dialect"].as_str() {
        Some("vllm") => Dialect::Vllm,
        Some("sglang") => Dialect::Sglang,
        Some("tgi") => Dialect::Tgi,
        Some("llamacpp") => Dialect::LlamaCpp,
        Some(other) => return Err(bad(format!("unknown dialect `{other}`"))),
        None => return Err(bad(format!("no load signal: {reason}"))),
    };
    let num = |k: &str| v[k].as_f64().filter(|x| x.is_finite() && *x >= 0.0);
    let (Some(waiting), Some(running)) = (num("waiting"), num("running")) else {
        return Err(bad("`waiting` and `running` must be non-negative numbers".into()));
    };
    Ok(LoadSignal {
        dialect,
        waiting,
        // The sidecar's own in-flight count includes requests the engine has not admitted
        // yet; the engine's running count is what its batch holds.
        running,
        kv_usage: num("kv_usage").map(|x| x.min(1.0)),
        prefix_hit_rate: num("prefix_hit_rate").map(|x| x.min(1.0)),
        prefix_cache_queries_total: None,
        prefix_cache_hits_total: None,
        generation_tokens_total: None,
        process_start_time_seconds: None,
        max_model_len: None,
        scraped_at_unix_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SGLANG: &str = include_str!("testdata/sglang.prom");
    const VLLM: &str = include_str!("testdata/vllm_v1.prom");

    fn state() -> SidecarState {
        SidecarState { in_flight: 3, ready: true, draining: false }
    }

    #[test]
    fn sglang_reads_as_vllm_names_and_keeps_its_own_series() {
        let s = crate::parse_load_signal(SGLANG, 5).unwrap();
        let text = metrics_text(Some(&s), state(), SGLANG);
        assert!(text.contains(&format!("vllm:num_requests_waiting{{engine_dialect=\"sglang\"}} {}", s.waiting)));
        assert!(text.contains("switchyard_shim_in_flight_requests 3"));
        assert!(text.contains("sglang:num_queue_reqs"), "the engine's own series pass through");
        // The result is itself valid exposition text that normalizes to the same load.
        let again = crate::parse_load_signal(&text, 5).unwrap();
        assert_eq!((again.waiting, again.running), (s.waiting, s.running));
    }

    #[test]
    fn a_vllm_engine_is_not_counted_twice() {
        let s = crate::parse_load_signal(VLLM, 5).unwrap();
        let text = metrics_text(Some(&s), state(), VLLM);
        let samples = text.lines().filter(|l| l.starts_with("vllm:num_requests_waiting")).count();
        assert_eq!(samples, 1, "{text}");
        let types = text.lines().filter(|l| *l == "# TYPE vllm:num_requests_waiting gauge").count();
        assert_eq!(types, 1);
    }

    #[test]
    fn load_json_round_trips_and_refuses_what_must_take_no_traffic() {
        let s = crate::parse_load_signal(SGLANG, 7).unwrap();
        let back = parse_load_json(&load_json(Some(&s), state(), None, None), 9).unwrap();
        assert_eq!(
            (back.dialect, back.waiting, back.running, back.kv_usage),
            (s.dialect, s.waiting, s.running, s.kv_usage)
        );
        assert_eq!(back.scraped_at_unix_ms, 9);
        let draining = SidecarState { draining: true, ..state() };
        assert_eq!(
            parse_load_json(&load_json(Some(&s), draining, None, None), 9),
            Err(ShimError::Load("draining".into()))
        );
        let down = load_json(None, SidecarState { ready: false, ..state() }, None, Some("engine /health failing"));
        assert_eq!(parse_load_json(&down, 9), Err(ShimError::Load("not ready: engine /health failing".into())));
        assert!(matches!(parse_load_json("<html>", 9), Err(ShimError::Load(m)) if m.starts_with("not JSON")));
        let negative = r#"{"dialect":"vllm","waiting":-1,"running":0,"ready":true,"draining":false}"#;
        assert!(parse_load_json(negative, 9).is_err());
    }

    #[test]
    fn loaded_adapters_cross_the_sidecar() {
        let s = crate::parse_load_signal(VLLM, 7).unwrap();
        let lora = LoraInfo { running: vec!["sql".into()], waiting: vec![], max_lora: Some(4) };
        let j = load_json(Some(&s), state(), Some(&lora), None);
        assert_eq!(parse_load_lora(&j), Some(lora));
        assert_eq!(parse_load_lora(&load_json(Some(&s), state(), None, None)), None);
    }

    #[test]
    fn load_json_is_null_where_unknown() {
        let j = load_json(
            None,
            SidecarState { in_flight: 0, ready: false, draining: true },
            None,
            Some("connection \"refused\""),
        );
        assert_eq!(
            j,
            r#"{"dialect":null,"waiting":null,"running":null,"kv_usage":null,"prefix_hit_rate":null,"in_flight":0,"ready":false,"draining":true,"scraped_at_unix_ms":null,"lora":null,"error":"connection \"refused\""}"#
        );
        let s = crate::parse_load_signal(SGLANG, 7).unwrap();
        let j = load_json(Some(&s), state(), None, None);
        assert!(
            j.starts_with("{\"dialect\":\"sglang\"") && j.contains("\"in_flight\":3") && j.ends_with("\"error\":null}")
        );
    }
}
