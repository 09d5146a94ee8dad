//! `auth`: API keys (by their SHA-256), their limits, and `auth.shared_limits` — what the
//! config says; [`crate::auth`] and [`crate::shared_limits`] enforce it.

use serde::Deserialize;

use crate::error::{ConfigError, Errors, FieldError};

/// `auth`: absent or without keys, every request is let through unauthenticated.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Keys written in the config file.
    pub keys: Vec<ApiKeyConfig>,
    /// A YAML file holding a list of more entries (e.g. a mounted Secret).
    pub keys_file: Option<String>,
    /// An environment variable holding a YAML/JSON list of more entries.
    pub keys_env: Option<String>,
    /// `max_tokens` assumed for token budgets when a request does not set it.
    pub default_max_tokens: u64,
    /// Keep the keys' limits in Redis, shared by every replica (read at start).
    pub shared_limits: Option<SharedLimitsConfig>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            keys: Vec::new(),
            keys_file: None,
            keys_env: None,
            default_max_tokens: DEFAULT_MAX_TOKENS,
            shared_limits: None,
        }
    }
}

/// One API key.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Who the key belongs to (logged and used in metrics instead of the key).
    pub tenant: String,
    /// Lowercase hex SHA-256 of the key (`printf %s "$KEY" | sha256sum`).
    pub key_sha256: String,
    /// Sustained requests per second (unset: unlimited).
    #[serde(default)]
    pub requests_per_second: Option<f64>,
    /// Requests allowed at once above the rate (default: the rate rounded up, at least 1).
    #[serde(default)]
    pub burst: Option<u32>,
    /// Token budget per minute, prompt and completion together (unset: unlimited).
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Admission-queue priority of this key's requests (higher first; default 0).
    #[serde(default)]
    pub priority: i32,
}

/// Default `auth.default_max_tokens`.
pub const DEFAULT_MAX_TOKENS: u64 = 256;

impl AuthConfig {
    /// Whether requests need a key.
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty() || self.keys_file.is_some() || self.keys_env.is_some()
    }

    /// Every key: those of the file, then of `keys_file` and `keys_env` (read now). Errors
    /// name the source and entry.
    pub fn all_keys(&self) -> Result<Vec<ApiKeyConfig>, Vec<FieldError>> {
        let mut keys = self.keys.clone();
        let mut errs = Vec::new();
        let mut extend = |field: &str, value: &str, text: Result<String, String>| match text
            .and_then(|t| serde_yaml::from_str::<Vec<ApiKeyConfig>>(&t).map_err(|e| e.to_string()))
        {
            Ok(more) => keys.extend(more),
            Err(reason) => errs.push(FieldError {
                field: field.into(),
                value: value.into(),
                reason: format!("cannot read a list of keys: {reason}"),
            }),
        };
        if let Some(path) = &self.keys_file {
            extend("auth.keys_file", path, std::fs::read_to_string(path).map_err(|e| e.to_string()));
        }
        if let Some(var) = &self.keys_env {
            extend("auth.keys_env", var, std::env::var(var).map_err(|e| e.to_string()));
        }
        if errs.is_empty() {
            Ok(keys)
        } else {
            Err(errs)
        }
    }

    /// Every key, read now and checked as [`Self::check_files`] checks them: what a reload
    /// of the key sources puts in force, or why it keeps the keys it has.
    pub fn read_checked_keys(&self) -> Result<Vec<ApiKeyConfig>, ConfigError> {
        let mut errs = Errors::default();
        let keys = match self.all_keys() {
            Ok(keys) => {
                validate_keys(&keys, 0, &mut errs);
                keys
            }
            Err(list) => {
                for e in list {
                    errs.add(e.field, e.value, e.reason);
                }
                Vec::new()
            }
        };
        errs.into_result().map(|()| keys)
    }

    /// Field-level problems of the keys written in the file (pure; the key sources are
    /// [`Self::check_files`]'s).
    pub fn validate(&self, errs: &mut Errors) {
        validate_keys(&self.keys, 0, errs);
        if let Some(s) = &self.shared_limits {
            s.validate(errs);
        }
    }

    /// Read `keys_file` and `keys_env` now and check the keys they hold; a key listed twice
    /// anywhere is a duplicate. They are numbered after the file's own (`auth.keys[N+i]`).
    pub fn check_files(&self, errs: &mut Errors) {
        if self.keys_file.is_none() && self.keys_env.is_none() {
            return;
        }
        match self.all_keys() {
            Ok(keys) => validate_keys(&keys, self.keys.len(), errs),
            Err(list) => {
                for e in list {
                    errs.add(e.field, e.value, e.reason);
                }
            }
        }
    }
}

/// Field-level problems of `keys`, reported as `auth.keys[i]` from position `from` on
/// (earlier ones only count for duplicates).
fn validate_keys(keys: &[ApiKeyConfig], from: usize, errs: &mut Errors) {
    {
        let mut bad = |i: usize, field: &str, value: String, reason: &str| {
            if i >= from {
                errs.add(format!("auth.keys[{i}].{field}"), value, reason)
            }
        };
        let mut seen = std::collections::HashSet::new();
        for (i, k) in keys.iter().enumerate() {
            if k.tenant.is_empty() {
                bad(i, "tenant", String::new(), "must name the tenant");
            }
            match parse_sha256(&k.key_sha256) {
                None => bad(i, "key_sha256", k.key_sha256.clone(), "must be 64 hex digits (the SHA-256 of the key)"),
                Some(h) if !seen.insert(h) => bad(i, "key_sha256", k.key_sha256.clone(), "listed twice"),
                Some(_) => {}
            }
            if let Some(r) = k.requests_per_second {
                if !(r.is_finite() && r > 0.0 && r <= 1e9) {
                    bad(i, "requests_per_second", r.to_string(), "must be a positive number of requests per second");
                }
            }
            if k.burst == Some(0) {
                bad(i, "burst", "0".into(), "must be at least 1");
            }
            if k.burst.is_some() && k.requests_per_second.is_none() {
                bad(i, "burst", format!("{:?}", k.burst), "needs requests_per_second");
            }
            if k.tokens_per_minute == Some(0) {
                bad(i, "tokens_per_minute", "0".into(), "must be at least 1 (omit it for no limit)");
            }
        }
    }
}

/// The 32 bytes of a hex SHA-256 (surrounding whitespace ignored).
pub(crate) fn parse_sha256(hex_digest: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_digest.trim(), &mut out).ok()?;
    Some(out)
}

/// `auth.shared_limits`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedLimitsConfig {
    /// `redis://[user:password@]host:port[/db]`.
    pub redis_url: String,
    /// Prefix of every key the gateway writes.
    #[serde(default = "default_prefix")]
    pub key_prefix: String,
    /// When Redis cannot answer: unset, per-replica limits of limit ÷ replicas seen;
    /// `true`, admit; `false`, refuse (429).
    #[serde(default)]
    pub fail_open: Option<bool>,
    /// How long one check may wait on Redis.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_prefix() -> String {
    "switchyard".into()
}

fn default_timeout_ms() -> u64 {
    100
}

impl SharedLimitsConfig {
    /// Field-level problems (pure: parses the URL, connects to nothing).
    pub fn validate(&self, errs: &mut Errors) {
        if let Err(e) = redis::Client::open(self.redis_url.as_str()) {
            errs.add("auth.shared_limits.redis_url", &self.redis_url, format!("not a Redis URL: {e}"));
        }
        if self.key_prefix.is_empty() || self.key_prefix.contains(char::is_whitespace) {
            errs.add("auth.shared_limits.key_prefix", &self.key_prefix, "must be non-empty, without spaces");
        }
        if !(1..=10_000).contains(&self.timeout_ms) {
            errs.add("auth.shared_limits.timeout_ms", self.timeout_ms, "must be in 1..=10000");
        }
    }
}
