//! Readiness: whether the engine behind the sidecar may take traffic, decided from one round
//! of checks. Pure: the caller fetches, passes the answers and the scrape time in.
//!
//! Every scrape interval the sidecar fetches the engine's `/metrics`, `/health` and
//! `/v1/models` ([`super::scrape`]) and hands what came back to [`assess`]. The engine is
//! ready when all three checks pass, and the first one that fails, in this order, is the
//! reason `/-/healthz` and `/load` give:
//!
//! 1. `/metrics` answers 2xx with text that normalizes to a load signal
//!    ([`crate::parse_load_signal`]) of the expected dialect (`--dialect`; any when `auto`);
//! 2. `/health` answers 2xx;
//! 3. `/v1/models` answers 2xx with JSON whose `data[].id` lists `--served-model-name`
//!    (any model when the flag is unset).
//!
//! The resulting [`ScrapeSnapshot`] keeps the signal when check 1 passed (never a stale
//! one), the engine's metrics text when it had any (passed through on `/metrics`), and the
//! reason. [`healthz`] adds the drain on top: a draining sidecar is not ready, whatever the
//! engine says.

use axum::http::StatusCode;
use bytes::Bytes;

use crate::expose::SidecarState;
use crate::{parse_load_signal, Dialect, LoadSignal};

/// One fetch from the engine: its status and body, or why nothing came back.
pub(crate) type Fetched = Result<(StatusCode, Bytes), String>;

/// What one round of checks got from the engine.
#[derive(Debug)]
pub(crate) struct Checks {
    /// `GET /metrics`.
    pub(crate) metrics: Fetched,
    /// When `/metrics` was read, stamped on the signal.
    pub(crate) scraped_at_unix_ms: u64,
    /// `GET /health`.
    pub(crate) health: Fetched,
    /// `GET /v1/models`.
    pub(crate) models: Fetched,
}

/// What the engine must show to be ready, from the flags.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expected<'a> {
    /// The dialect its metrics must be in; `None` for any.
    pub(crate) dialect: Option<Dialect>,
    /// The model it must list; `None` for any.
    pub(crate) model: Option<&'a str>,
}

/// What the last round of checks learned, swapped in whole by the scrape loop.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ScrapeSnapshot {
    /// The normalized load; `None` when the metrics check failed.
    pub(crate) signal: Option<LoadSignal>,
    /// The engine's own `/metrics` text (empty when none came back).
    pub(crate) text: String,
    /// Why the engine is not ready; `None` when it is.
    pub(crate) error: Option<String>,
}

/// Decide from one round of checks: the snapshot to serve, and whether the engine is ready.
pub(crate) fn assess(checks: Checks, expected: Expected<'_>) -> (ScrapeSnapshot, bool) {
    let metrics = match checks.metrics {
        Ok((s, body)) if s.is_success() => {
            let text = String::from_utf8_lossy(&body).into_owned();
            match parse_load_signal(&text, checks.scraped_at_unix_ms) {
                Ok(sig) => match expected.dialect {
                    Some(d) if d != sig.dialect => {
                        Err((format!("the engine's metrics are {}, --dialect says {d}", sig.dialect), text))
                    }
                    _ => Ok((sig, text)),
                },
                Err(e) => Err((format!("/metrics: {e}"), text)),
            }
        }
        Ok((s, _)) => Err((format!("/metrics answered {s}"), String::new())),
        Err(e) => Err((e, String::new())),
    };
    let healthy = matches!(checks.health, Ok((s, _)) if s.is_success());
    let listed = match checks.models {
        Ok((s, body)) if s.is_success() => lists_model(&body, expected.model),
        _ => false,
    };
    let (mut snapshot, metrics_ok) = match metrics {
        Ok((sig, text)) => (ScrapeSnapshot { signal: Some(sig), text, error: None }, true),
        Err((e, text)) => (ScrapeSnapshot { signal: None, text, error: Some(e) }, false),
    };
    if snapshot.error.is_none() && !healthy {
        snapshot.error = Some("the engine's /health is failing".into());
    } else if snapshot.error.is_none() && !listed {
        snapshot.error = Some(match expected.model {
            Some(m) => format!("the engine does not list model `{m}`"),
            None => "the engine lists no model".into(),
        });
    }
    (snapshot, metrics_ok && healthy && listed)
}

/// Whether a `/v1/models` body lists `model` (any model when `None`).
fn lists_model(body: &[u8], model: Option<&str>) -> bool {
    serde_json::from_slice::<serde_json::Value>(body).ok().is_some_and(|v| {
        let ids: Vec<&str> = v["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str()).collect();
        match model {
            Some(m) => ids.contains(&m),
            None => !ids.is_empty(),
        }
    })
}

/// The `/-/healthz` decision: `Ok` when ready, else why not (`draining` first, then the last
/// check's reason, or that no check has run yet).
pub(crate) fn healthz(state: SidecarState, last_error: Option<&str>) -> Result<(), String> {
    if state.ready && !state.draining {
        Ok(())
    } else if state.draining {
        Err("draining".into())
    } else {
        Err(last_error.unwrap_or("the engine has not been checked yet").into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = include_str!("../testdata/vllm_v1.prom");
    const MODELS: &str = r#"{"object":"list","data":[{"id":"llama","object":"model"}]}"#;

    fn ok(body: &str) -> Fetched {
        Ok((StatusCode::OK, Bytes::from(body.to_owned())))
    }

    fn healthy() -> Checks {
        Checks { metrics: ok(VLLM), scraped_at_unix_ms: 42, health: ok(""), models: ok(MODELS) }
    }

    const ANY: Expected<'static> = Expected { dialect: None, model: None };

    #[test]
    fn a_healthy_engine_listing_a_model_is_ready() {
        let (snap, ready) = assess(healthy(), ANY);
        assert!(ready);
        assert_eq!(snap.error, None);
        let sig = snap.signal.expect("a signal");
        assert_eq!((sig.dialect, sig.scraped_at_unix_ms), (Dialect::Vllm, 42));
        assert_eq!(snap.text, VLLM);
        let (_, ready) = assess(healthy(), Expected { dialect: Some(Dialect::Vllm), model: Some("llama") });
        assert!(ready);
    }

    #[test]
    fn the_wrong_dialect_keeps_the_text_but_not_the_signal() {
        let (snap, ready) = assess(healthy(), Expected { dialect: Some(Dialect::Sglang), model: None });
        assert!(!ready);
        assert_eq!(snap.signal, None);
        assert_eq!(snap.text, VLLM);
        assert_eq!(snap.error.as_deref(), Some("the engine's metrics are vllm, --dialect says sglang"));
    }

    #[test]
    fn the_first_failed_check_is_the_reason() {
        let down = Checks { metrics: Err("/metrics: connection refused".into()), ..healthy() };
        let (snap, ready) = assess(Checks { health: Err("x".into()), ..down }, ANY);
        assert!(!ready);
        assert_eq!((snap.signal, snap.text.as_str()), (None, ""));
        assert_eq!(snap.error.as_deref(), Some("/metrics: connection refused"));

        let failing = Checks { metrics: Ok((StatusCode::INTERNAL_SERVER_ERROR, Bytes::new())), ..healthy() };
        assert_eq!(assess(failing, ANY).0.error.as_deref(), Some("/metrics answered 500 Internal Server Error"));
        let garbled = assess(Checks { metrics: ok("<html>"), ..healthy() }, ANY).0;
        assert!(garbled.error.as_deref().is_some_and(|e| e.starts_with("/metrics: malformed")), "{garbled:?}");
        assert_eq!(garbled.text, "<html>", "the text is passed through even when it does not parse");

        let sick =
            Checks { health: Ok((StatusCode::SERVICE_UNAVAILABLE, Bytes::new())), models: ok("{}"), ..healthy() };
        let (snap, ready) = assess(sick, ANY);
        assert!(!ready);
        assert!(snap.signal.is_some(), "the load is still served while /health fails");
        assert_eq!(snap.error.as_deref(), Some("the engine's /health is failing"));

        let (snap, ready) = assess(healthy(), Expected { dialect: None, model: Some("nope") });
        assert!(!ready);
        assert_eq!(snap.error.as_deref(), Some("the engine does not list model `nope`"));
        let (snap, _) = assess(Checks { models: ok(r#"{"data":[]}"#), ..healthy() }, ANY);
        assert_eq!(snap.error.as_deref(), Some("the engine lists no model"));
        let (snap, _) = assess(Checks { models: Err("timeout".into()), ..healthy() }, ANY);
        assert_eq!(snap.error.as_deref(), Some("the engine lists no model"));
    }

    #[test]
    fn draining_is_never_ready() {
        let st = |ready, draining| SidecarState { in_flight: 0, ready, draining };
        assert_eq!(healthz(st(true, false), None), Ok(()));
        assert_eq!(healthz(st(true, true), None), Err("draining".into()));
        assert_eq!(healthz(st(false, true), Some("down")), Err("draining".into()));
        assert_eq!(healthz(st(false, false), Some("down")), Err("down".into()));
        assert_eq!(healthz(st(false, false), None), Err("the engine has not been checked yet".into()));
    }
}
