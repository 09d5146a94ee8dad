//! Which LoRA adapters an engine has loaded, from vLLM's `vllm:lora_requests_info` gauge.
//!
//! vLLM reports adapters as labels, not as series: `max_lora` (slots), and
//! `running_lora_adapters` / `waiting_lora_adapters` (comma-separated adapter names). Each
//! change adds a label set whose value is the time of the change, and old label sets stay
//! in the registry, so the current state is the sample with the largest value. SGLang, TGI
//! and llama.cpp report no adapters; their bodies give `None`.

use crate::error::ShimError;
use crate::text;

/// The metric vLLM reports adapters in.
pub const LORA_INFO: &str = "vllm:lora_requests_info";

/// An engine's adapters, as its latest `vllm:lora_requests_info` sample says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraInfo {
    /// Adapters of requests in the running batch.
    pub running: Vec<String>,
    /// Adapters of waiting requests.
    pub waiting: Vec<String>,
    /// Adapters the engine can hold at once (`--max-loras`), when reported.
    pub max_lora: Option<u32>,
}

impl LoraInfo {
    /// Whether `adapter` is loaded (running or waiting).
    pub fn holds(&self, adapter: &str) -> bool {
        self.running.iter().chain(&self.waiting).any(|a| a == adapter)
    }

    /// Whether another adapter fits without evicting one (unknown `max_lora`: yes).
    pub fn has_free_slot(&self) -> bool {
        let mut loaded: Vec<&String> = self.running.iter().chain(&self.waiting).collect();
        loaded.sort();
        loaded.dedup();
        self.max_lora.is_none_or(|max| loaded.len() < max as usize)
    }
}

/// The adapters in a `/metrics` body; `None` when it has no `vllm:lora_requests_info`.
pub fn parse_lora_info(body: &str) -> Result<Option<LoraInfo>, ShimError> {
    let mut latest: Option<(f64, LoraInfo)> = None;
    text::for_each_sample(body, |s| {
        if s.name != LORA_INFO || !s.value.is_finite() {
            return;
        }
        if latest.as_ref().is_some_and(|(at, _)| *at > s.value) {
            return;
        }
        let names = |label: &str| -> Vec<String> {
            s.label(label)
                .unwrap_or_default()
                .split(',')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(str::to_string)
                .collect()
        };
        let info = LoraInfo {
            running: names("running_lora_adapters"),
            waiting: names("waiting_lora_adapters"),
            max_lora: s.label("max_lora").and_then(|m| m.trim().parse().ok()),
        };
        latest = Some((s.value, info));
    })?;
    Ok(latest.map(|(_, info)| info))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_label_set_is_the_state() {
        let body = "# TYPE vllm:lora_requests_info gauge\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"\"} 1.7e9\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql, chat\",waiting_lora_adapters=\"x\"} 1.8e9\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.6e9\n\
            vllm:num_requests_running 1\n";
        let info = parse_lora_info(body).unwrap().unwrap();
        assert_eq!(info.running, ["sql", "chat"]);
        assert_eq!(info.waiting, ["x"]);
        assert_eq!(info.max_lora, Some(2));
        assert!(info.holds("x") && info.holds("chat") && !info.holds("other"));
        assert!(!info.has_free_slot(), "three loaded, two slots");
        let idle = LoraInfo { max_lora: Some(2), ..LoraInfo::default() };
        assert!(idle.has_free_slot());
    }

    #[test]
    fn engines_without_adapters_report_none() {
        assert_eq!(parse_lora_info(include_str!("testdata/sglang.prom")).unwrap(), None);
        assert_eq!(parse_lora_info("vllm:num_requests_running 1\n").unwrap(), None);
        assert!(parse_lora_info("not { prometheus").is_err());
    }
}
