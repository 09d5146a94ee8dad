//! API keys, tenants and their rate limits.
//!
//! Keys are configured by their SHA-256 (`auth.keys[].key_sha256`, or lists of the same
//! entries in `auth.keys_file` / the environment variable named by `auth.keys_env`); the
//! gateway never holds, logs or compares a plaintext key. A request presents
//! `Authorization: Bearer <key>`; its hash finds the tenant.
//!
//! Each tenant may have two limits:
//! - **requests per second** with a burst — governor's GCRA, one limiter per key;
//! - **tokens per minute** — a [`TokenBudget`] charged the request's estimate (prompt bytes /
//!   `prefix_index.bytes_per_token` + `max_tokens`) before routing, and settled with the
//!   `usage` the engine returned (or the streamed events counted) afterwards. It is
//!   hand-written because it must take refunds and go into debt, which GCRA cannot.
//!
//! Limiter state survives config reloads for every key whose entry did not change.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use sha2::{Digest, Sha256};

use crate::config::auth::parse_sha256;
use crate::config::ApiKeyConfig;

/// SHA-256 of a presented key, as stored in the table.
pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A tenant's token budget per minute: a bucket of `per_minute` tokens refilled
/// continuously, charged an estimate up front and settled with the real count later
/// (a refund, or a debt that delays the next request).
#[derive(Debug)]
pub struct TokenBudget {
    per_minute: f64,
    /// Tokens available (negative: debt) and when that was computed.
    level: Mutex<(f64, Instant)>,
}

impl TokenBudget {
    /// A full budget.
    pub fn new(per_minute: u64, now: Instant) -> Self {
        TokenBudget { per_minute: per_minute as f64, level: Mutex::new((per_minute as f64, now)) }
    }

    fn refill(&self, level: &mut (f64, Instant), now: Instant) {
        let elapsed = now.saturating_duration_since(level.1).as_secs_f64();
        level.0 = (level.0 + elapsed * self.per_minute / 60.0).min(self.per_minute);
        level.1 = now;
    }

    /// Charge `tokens` (capped at the whole budget, so a single large request can pass on a
    /// full bucket), or say how long until they are available.
    pub fn take(&self, tokens: u64, now: Instant) -> Result<(), Duration> {
        let need = (tokens as f64).min(self.per_minute);
        let mut level = self.level.lock();
        self.refill(&mut level, now);
        if level.0 >= need {
            level.0 -= need;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((need - level.0) * 60.0 / self.per_minute))
        }
    }

    /// The request charged `charged` used `used`: refund the difference, or take the rest.
    pub fn settle(&self, charged: u64, used: u64, now: Instant) {
        let charged = (charged as f64).min(self.per_minute);
        let mut level = self.level.lock();
        self.refill(&mut level, now);
        level.0 = (level.0 + charged - used as f64).min(self.per_minute);
    }

    /// Tokens available now (negative: debt).
    #[cfg(test)]
    pub fn available(&self, now: Instant) -> f64 {
        let mut level = self.level.lock();
        self.refill(&mut level, now);
        level.0
    }
}

/// One key's tenant and its limiter state.
pub struct Tenant {
    /// Tenant name.
    pub name: String,
    /// Admission priority.
    pub priority: i32,
    config: ApiKeyConfig,
    requests: Option<DefaultDirectRateLimiter>,
    /// Token budget, if any.
    pub tokens: Option<TokenBudget>,
    /// While shared limits cannot be reached: this key's limits divided by the replicas seen.
    fallback: Mutex<Option<Arc<FallbackLimits>>>,
}

/// A key's limits divided among `replicas` replicas: what one replica enforces while the
/// shared limits in Redis cannot be reached.
pub struct FallbackLimits {
    /// The divisor.
    pub replicas: u32,
    requests: Option<DefaultDirectRateLimiter>,
    /// The budget's share.
    pub tokens: Option<TokenBudget>,
}

impl FallbackLimits {
    /// Count one request against the rate's share.
    pub fn check_rate(&self) -> Result<(), Duration> {
        check(self.requests.as_ref())
    }
}

fn check(limiter: Option<&DefaultDirectRateLimiter>) -> Result<(), Duration> {
    match limiter {
        None => Ok(()),
        Some(l) => l.check().map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now())),
    }
}

/// The burst of a key: configured, else its rate rounded up (at least 1).
fn burst_of(config: &ApiKeyConfig) -> u32 {
    config.burst.unwrap_or(config.requests_per_second.unwrap_or(1.0).ceil().max(1.0) as u32).max(1)
}

/// GCRA for a key's rate (and burst) divided by `replicas`.
fn rate_limiter(config: &ApiKeyConfig, replicas: u32) -> Option<DefaultDirectRateLimiter> {
    let rps = config.requests_per_second? / f64::from(replicas.max(1));
    let burst = (burst_of(config) / replicas.max(1)).max(1);
    Quota::with_period(Duration::from_secs_f64(1.0 / rps))
        .map(|q| RateLimiter::direct(q.allow_burst(NonZeroU32::new(burst).expect("at least 1"))))
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant").field("name", &self.name).field("priority", &self.priority).finish_non_exhaustive()
    }
}

impl Tenant {
    fn new(config: ApiKeyConfig) -> Self {
        let requests = rate_limiter(&config, 1);
        let tokens = config.tokens_per_minute.map(|t| TokenBudget::new(t, Instant::now()));
        Tenant {
            name: config.tenant.clone(),
            priority: config.priority,
            requests,
            tokens,
            config,
            fallback: Mutex::default(),
        }
    }

    /// The key's SHA-256 (hex): its name in shared limit state.
    pub fn key_id(&self) -> &str {
        &self.config.key_sha256
    }

    /// Requests per second and burst, when limited.
    pub fn rate_limit(&self) -> Option<(f64, u32)> {
        let rps = self.config.requests_per_second?;
        Some((rps, burst_of(&self.config)))
    }

    /// Tokens per minute, when limited.
    pub fn tokens_per_minute(&self) -> Option<u64> {
        self.config.tokens_per_minute
    }

    /// This key's limits for one of `replicas` replicas (kept until that number changes).
    pub fn fallback(&self, replicas: u32) -> Arc<FallbackLimits> {
        let mut f = self.fallback.lock();
        match f.as_ref() {
            Some(limits) if limits.replicas == replicas => limits.clone(),
            _ => {
                let n = u64::from(replicas.max(1));
                let limits = Arc::new(FallbackLimits {
                    replicas,
                    requests: rate_limiter(&self.config, replicas),
                    tokens: self.config.tokens_per_minute.map(|t| TokenBudget::new((t / n).max(1), Instant::now())),
                });
                *f = Some(limits.clone());
                limits
            }
        }
    }

    /// Count one request against the rate; on refusal, how long until one is allowed.
    pub fn check_rate(&self) -> Result<(), Duration> {
        check(self.requests.as_ref())
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// No `Authorization: Bearer` key.
    Missing,
    /// A key that is not configured.
    Unknown,
}

/// The key table of one config.
#[derive(Debug, Default)]
pub struct Authenticator {
    by_digest: HashMap<[u8; 32], Arc<Tenant>>,
    enabled: bool,
}

impl Authenticator {
    /// The table for validated `keys`, reusing the limiter state of `previous` for every
    /// entry that did not change.
    pub fn build(enabled: bool, keys: Vec<ApiKeyConfig>, previous: Option<&Authenticator>) -> Self {
        let by_digest = keys
            .into_iter()
            .filter_map(|k| {
                let digest = parse_sha256(&k.key_sha256)?;
                let kept = previous.and_then(|p| p.by_digest.get(&digest)).filter(|t| t.config == k).cloned();
                Some((digest, kept.unwrap_or_else(|| Arc::new(Tenant::new(k)))))
            })
            .collect();
        Authenticator { by_digest, enabled }
    }

    /// The tenant presenting `authorization` (the header's value), `Ok(None)` when auth is off.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Option<Arc<Tenant>>, Denied> {
        if !self.enabled {
            return Ok(None);
        }
        let key = bearer(authorization)?;
        self.by_digest.get(&key_digest(key)).cloned().map(Some).ok_or(Denied::Unknown)
    }
}

/// The token of an `Authorization: Bearer <token>` header value.
pub fn bearer(authorization: Option<&[u8]>) -> Result<&str, Denied> {
    let value = authorization.ok_or(Denied::Missing)?;
    let value = std::str::from_utf8(value).map_err(|_| Denied::Unknown)?.trim();
    let (scheme, token) = value.split_once(' ').ok_or(Denied::Missing)?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(Denied::Missing);
    }
    Ok(token.trim())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AuthConfig;
    use crate::error::Errors;

    fn key(tenant: &str, secret: &str) -> ApiKeyConfig {
        ApiKeyConfig {
            tenant: tenant.into(),
            key_sha256: hex::encode(key_digest(secret)),
            requests_per_second: Some(1.0),
            burst: Some(2),
            tokens_per_minute: None,
            priority: 0,
        }
    }

    #[test]
    fn bearer_keys_find_their_tenant_by_hash() {
        let auth = Authenticator::build(true, vec![key("a", "sk-a"), key("b", "sk-b")], None);
        assert_eq!(auth.authenticate(Some(b"Bearer sk-b")).unwrap().unwrap().name, "b");
        assert_eq!(auth.authenticate(Some(b"bearer  sk-a ")).unwrap().unwrap().name, "a");
        assert_eq!(auth.authenticate(None).unwrap_err(), Denied::Missing);
        assert_eq!(auth.authenticate(Some(b"Basic sk-a")).unwrap_err(), Denied::Missing);
        assert_eq!(auth.authenticate(Some(b"Bearer sk-c")).unwrap_err(), Denied::Unknown);
        assert_eq!(auth.authenticate(Some(b"Bearer \xff")).unwrap_err(), Denied::Unknown);
        assert!(Authenticator::build(false, vec![], None).authenticate(None).unwrap().is_none());
    }

    #[test]
    fn the_request_rate_allows_the_burst_then_refuses_with_a_wait() {
        let auth = Authenticator::build(true, vec![key("a", "sk-a")], None);
        let t = auth.authenticate(Some(b"Bearer sk-a")).unwrap().unwrap();
        assert!(t.check_rate().is_ok() && t.check_rate().is_ok());
        let wait = t.check_rate().unwrap_err();
        assert!(wait > Duration::from_millis(500) && wait <= Duration::from_secs(1), "{wait:?}");
        // A reload with the same entry keeps the spent burst; a changed entry starts afresh.
        let same = Authenticator::build(true, vec![key("a", "sk-a")], Some(&auth));
        assert!(same.authenticate(Some(b"Bearer sk-a")).unwrap().unwrap().check_rate().is_err());
        let mut faster = key("a", "sk-a");
        faster.requests_per_second = Some(100.0);
        let changed = Authenticator::build(true, vec![faster], Some(&auth));
        assert!(changed.authenticate(Some(b"Bearer sk-a")).unwrap().unwrap().check_rate().is_ok());
    }

    #[test]
    fn the_token_budget_charges_refunds_and_carries_debt() {
        let t0 = Instant::now();
        let b = TokenBudget::new(600, t0); // 10 tokens a second
        assert!(b.take(500, t0).is_ok());
        let wait = b.take(200, t0).unwrap_err();
        assert_eq!(wait.as_secs_f64().round(), 10.0, "100 missing at 10/s");
        b.settle(500, 100, t0); // used far less: refunded
        assert!(b.take(400, t0).is_ok());
        b.settle(400, 1000, t0); // used more: now in debt
        assert!(b.available(t0) < 0.0);
        assert!(b.take(1, t0 + Duration::from_secs(1)).is_err());
        // A request larger than the whole budget passes on a full bucket only.
        let later = t0 + Duration::from_secs(600);
        assert!(b.take(10_000, later).is_ok());
        assert!(b.take(1, later).is_err());
    }

    #[test]
    fn keys_come_from_the_config_a_file_and_the_environment() {
        let dir = std::env::temp_dir().join(format!("switchyard-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys.yaml");
        std::fs::write(&file, format!("- {{ tenant: from-file, key_sha256: {} }}\n", hex::encode(key_digest("sk-f"))))
            .unwrap();
        let var = format!("SWITCHYARD_TEST_KEYS_{}", std::process::id());
        std::env::set_var(
            &var,
            format!("[{{\"tenant\": \"from-env\", \"key_sha256\": \"{}\"}}]", hex::encode(key_digest("sk-e"))),
        );
        let cfg = AuthConfig {
            keys: vec![key("inline", "sk-i")],
            keys_file: Some(file.display().to_string()),
            keys_env: Some(var.clone()),
            ..AuthConfig::default()
        };
        let mut errs = Errors::default();
        cfg.validate(&mut errs);
        cfg.check_files(&mut errs);
        assert!(errs.is_empty(), "{errs:?}");
        let auth = Authenticator::build(cfg.enabled(), cfg.all_keys().unwrap(), None);
        for (secret, tenant) in [("sk-i", "inline"), ("sk-f", "from-file"), ("sk-e", "from-env")] {
            let header = format!("Bearer {secret}");
            assert_eq!(auth.authenticate(Some(header.as_bytes())).unwrap().unwrap().name, tenant);
        }
        std::env::remove_var(&var);
        assert_eq!(cfg.all_keys().unwrap_err()[0].field, "auth.keys_env", "an unset variable is an error");
    }

    #[test]
    fn validation_names_each_bad_entry() {
        let mut bad = key("", "x");
        bad.key_sha256 = "abc".into();
        bad.burst = Some(0);
        bad.requests_per_second = Some(-1.0);
        let cfg = AuthConfig { keys: vec![key("a", "k"), key("a2", "k"), bad], ..AuthConfig::default() };
        let mut errs = Errors::default();
        cfg.validate(&mut errs);
        let fields: Vec<_> = errs.list().iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "auth.keys[1].key_sha256",
                "auth.keys[2].tenant",
                "auth.keys[2].key_sha256",
                "auth.keys[2].requests_per_second",
                "auth.keys[2].burst"
            ]
        );
        let missing = AuthConfig { keys_file: Some("/nonexistent/keys.yaml".into()), ..AuthConfig::default() };
        let mut errs = Errors::default();
        missing.validate(&mut errs);
        assert!(errs.is_empty(), "validation reads no file");
        missing.check_files(&mut errs);
        assert_eq!(errs.list()[0].field, "auth.keys_file");
    }
}
