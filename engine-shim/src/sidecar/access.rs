//! Which requests the sidecar forwards to its engine: a pure decision over the path and the
//! admin token a caller presents.
//!
//! The sidecar listens on the pod's address, so without this any pod in the cluster could
//! walk around the gateway's keys, limits and budgets and reach the engine's admin routes
//! (vLLM's `/collective_rpc`, `/reset_prefix_cache`, `/sleep`, `/v1/load_lora_adapter`, …).
//! The default forwards only inference routes ([`INFERENCE_ROUTES`]); `--allow-path PREFIX`
//! widens that; a caller presenting the admin token (`--admin-token`) in
//! [`ADMIN_TOKEN_HEADER`] reaches every path. Everything else is refused with 403 before
//! any byte goes to the engine.
//!
//! Paths are matched as sent, by whole segments (`/v1/models` allows `/v1/models/x`, not
//! `/v1/modelsx`). A path an engine's router might read differently from this matcher —
//! dot segments, empty segments, a backslash, or a percent-encoded `.`, `/` or `\` — is
//! refused unless the caller holds the token, so `/v1/models/../collective_rpc` never
//! reaches an engine that normalizes paths.

use sha2::{Digest, Sha256};

/// The request header carrying the admin token. The sidecar removes it before forwarding.
pub const ADMIN_TOKEN_HEADER: &str = "x-switchyard-admin-token";

/// The routes forwarded by default: what the OpenAI-compatible servers (vLLM, SGLang, TGI's
/// Messages API, llama.cpp) serve for inference, and their health and model list. Each
/// allows its sub-paths.
pub const INFERENCE_ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/score",
    "/v1/models",
    "/rerank",
    "/score",
    "/pooling",
    "/classify",
    "/tokenize",
    "/detokenize",
    "/health",
];

/// What the sidecar does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Forward it to the engine.
    Forward,
    /// Answer 403; the engine never sees it.
    Refuse,
}

/// The forwarding rules, built once from the flags.
#[derive(Debug, Clone)]
pub struct AccessPolicy {
    /// Prefixes forwarded to anyone: [`INFERENCE_ROUTES`] plus each `--allow-path`.
    allowed: Vec<String>,
    /// SHA-256 of the admin token; `None` when no token is configured (then nobody gets past
    /// the allowlist).
    token_sha256: Option<[u8; 32]>,
}

impl AccessPolicy {
    /// The default routes plus `extra` prefixes (each normalized to start with `/` and not end
    /// with one), and the admin `token` if one is set (an empty token counts as none).
    pub fn new(extra: &[String], token: Option<&str>) -> AccessPolicy {
        let mut allowed: Vec<String> = INFERENCE_ROUTES.iter().map(|r| (*r).to_owned()).collect();
        for p in extra {
            // Stored without a trailing slash; the root `/` becomes "", which allows every path.
            let trimmed = p.trim().trim_end_matches('/');
            let p =
                if trimmed.is_empty() || trimmed.starts_with('/') { trimmed.to_owned() } else { format!("/{trimmed}") };
            if !allowed.contains(&p) {
                allowed.push(p);
            }
        }
        let token_sha256 = token.filter(|t| !t.is_empty()).map(|t| Sha256::digest(t.as_bytes()).into());
        AccessPolicy { allowed, token_sha256 }
    }

    /// Whether a request for `path` (without the query), presenting `token` in
    /// [`ADMIN_TOKEN_HEADER`] if any, goes to the engine.
    pub fn decide(&self, path: &str, token: Option<&[u8]>) -> Access {
        if self.holds_token(token) {
            return Access::Forward;
        }
        if is_plain(path) && self.allowed.iter().any(|p| within(path, p)) {
            Access::Forward
        } else {
            Access::Refuse
        }
    }

    /// Whether `token` is the configured admin token. Digests are compared, so how long the
    /// comparison takes says nothing about the token.
    fn holds_token(&self, token: Option<&[u8]>) -> bool {
        match (self.token_sha256, token) {
            (Some(want), Some(got)) => {
                let got: [u8; 32] = Sha256::digest(got).into();
                got.iter().zip(want.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
            }
            _ => false,
        }
    }
}

/// `path` is `prefix` or below it, by whole segments. The root prefix `/` allows every path.
fn within(path: &str, prefix: &str) -> bool {
    if prefix.is_empty() {
        return true;
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// A path every router reads the same way: absolute, no `.`/`..` or empty segments, no
/// backslash, no percent-encoded `.`, `/` or `\`.
fn is_plain(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else { return false };
    if path.contains('\\') {
        return false;
    }
    let lower = path.to_ascii_lowercase();
    if ["%2e", "%2f", "%5c"].iter().any(|e| lower.contains(e)) {
        return false;
    }
    // A trailing slash leaves one empty last segment; that is harmless, anything else is not.
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    rest.is_empty() || rest.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn default_policy() -> AccessPolicy {
        AccessPolicy::new(&[], None)
    }

    #[test]
    fn inference_routes_pass_and_admin_routes_do_not() {
        let p = default_policy();
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
            "/v1/responses",
            "/v1/responses/resp_1/cancel",
            "/v1/models",
            "/v1/models/meta-llama/Llama-3",
            "/tokenize",
            "/detokenize",
            "/health",
            "/v1/completions/",
        ] {
            assert_eq!(p.decide(path, None), Access::Forward, "{path}");
        }
        for path in [
            "/collective_rpc",
            "/reset_prefix_cache",
            "/sleep",
            "/wake_up",
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/start_profile",
            "/v1/modelsx",
            "/v1",
            "/",
            "",
            "v1/completions",
        ] {
            assert_eq!(p.decide(path, None), Access::Refuse, "{path}");
        }
    }

    #[test]
    fn paths_a_router_could_normalize_differently_are_refused() {
        let p = default_policy();
        for path in [
            "/v1/models/../collective_rpc",
            "/v1/models/..",
            "/v1/completions/./x",
            "/v1/models//x",
            "//v1/completions",
            "/v1/models/%2e%2e/collective_rpc",
            "/v1/models%2F..%2Fsleep",
            "/v1/models/%2E%2E",
            "/v1/models\\..\\sleep",
            "/v1/models/%5csleep",
        ] {
            assert_eq!(p.decide(path, None), Access::Refuse, "{path}");
        }
    }

    #[test]
    fn allow_path_widens_by_whole_segments() {
        let p = AccessPolicy::new(&["/reset_prefix_cache".into(), "metrics-extra/".into()], None);
        assert_eq!(p.decide("/reset_prefix_cache", None), Access::Forward);
        assert_eq!(p.decide("/metrics-extra/x", None), Access::Forward);
        assert_eq!(p.decide("/reset_prefix_cachex", None), Access::Refuse);
        assert_eq!(p.decide("/collective_rpc", None), Access::Refuse);
        let all = AccessPolicy::new(&["/".into()], None);
        assert_eq!(all.decide("/collective_rpc", None), Access::Forward);
        assert_eq!(all.decide("/v1/models/../x", None), Access::Refuse, "still only plain paths");
    }

    #[test]
    fn the_admin_token_opens_every_path_and_nothing_else_does() {
        let p = AccessPolicy::new(&[], Some("s3cret"));
        assert_eq!(p.decide("/collective_rpc", Some(b"s3cret")), Access::Forward);
        assert_eq!(p.decide("/v1/models/../sleep", Some(b"s3cret")), Access::Forward);
        assert_eq!(p.decide("/collective_rpc", Some(b"s3cre")), Access::Refuse);
        assert_eq!(p.decide("/collective_rpc", Some(b"")), Access::Refuse);
        assert_eq!(p.decide("/collective_rpc", None), Access::Refuse);
        assert_eq!(p.decide("/v1/completions", Some(b"wrong")), Access::Forward, "a wrong token changes nothing else");
        // No token configured: presenting one (even empty) opens nothing.
        let none = AccessPolicy::new(&[], Some(""));
        assert_eq!(none.decide("/collective_rpc", Some(b"")), Access::Refuse);
    }
}
