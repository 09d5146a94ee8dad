//! Tenant limits that hold across gateway replicas: kept in Redis (`auth.shared_limits`).
//!
//! Per-key limits kept in each replica let a tenant through at N× its limit behind N
//! replicas. With `shared_limits` every replica asks Redis, where one atomic script per check
//! keeps the state:
//! - **requests per second**: GCRA, as governor computes it locally — the key's theoretical
//!   arrival time (ms) under `<prefix>:rate:<key sha256>`; a request is allowed when it is
//!   at most `burst` intervals ahead of now, and moves it one interval on;
//! - **tokens per minute**: the same bucket as [`crate::auth::TokenBudget`] (charged the
//!   estimate up front, settled with the real count after, may go into debt) as a hash
//!   `{level, ts}` under `<prefix>:tokens:<key sha256>`.
//!
//! Time is Redis's (`TIME` inside the scripts), so replicas' clocks do not matter. Each
//! replica also beats every second in `<prefix>:replicas` (a sorted set of replica ids by
//! last beat; ids older than 5 s leave it), which gives the number of replicas seen.
//!
//! **Redis unavailable** (no connection, an error, no answer within `timeout_ms`): by
//! `fail_open` — unset, each replica enforces the key's limits divided by the replicas last
//! seen (so the cluster stays near the limit); `true`, requests are admitted unlimited;
//! `false`, refused with 429. Every such decision is counted
//! (`switchyard_shared_limits_unavailable_total{decision}`) and the first of an outage is
//! logged. A lost connection is retried at most once a second; requests in between decide
//! at once, without waiting on Redis.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use redis::aio::MultiplexedConnection;

use crate::config::SharedLimitsConfig;
use crate::metrics::GatewayMetrics;

/// What Redis said about a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Within the limit.
    Allowed,
    /// Over it: allowed again after this long.
    Limited(Duration),
    /// Redis did not answer: the caller applies `fail_open`.
    Unavailable,
}

/// What to do while Redis is unavailable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// Per-replica limits of limit ÷ replicas seen.
    Local,
    /// Admit.
    Open,
    /// Refuse.
    Closed,
}

/// GCRA: `KEYS[1]` holds the theoretical arrival time (ms); `ARGV`: emission interval and
/// burst tolerance (ms). Returns the wait in ms as a string, "0" when allowed.
const RATE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local interval = tonumber(ARGV[1])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local next_tat = tat + interval
local wait = next_tat - tonumber(ARGV[2]) - now
if wait > 0 then return tostring(wait) end
redis.call('SET', KEYS[1], tostring(next_tat), 'PX', math.ceil(next_tat - now) + 1000)
return '0'
";

/// Token bucket: `KEYS[1]` a hash `{level, ts}`; `ARGV`: tokens per minute, `take` or
/// `give`, the amount (a `give` may be negative: a debt). Returns the wait in ms, "0" when
/// taken (or given).
const TOKENS: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local per = tonumber(ARGV[1])
local v = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(v[1]) or per
local ts = tonumber(v[2]) or now
level = math.min(per, level + math.max(0, now - ts) * per / 60000)
local amount = tonumber(ARGV[3])
local wait = 0
if ARGV[2] == 'take' then
  amount = math.min(amount, per)
  if level >= amount then level = level - amount else wait = (amount - level) * 60000 / per end
else
  level = math.min(per, level + amount)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((per - level) * 60000 / per) + 60000)
return tostring(wait)
";

/// Replica beats: `KEYS[1]` a sorted set; `ARGV`: this replica's id, the window (ms).
/// Returns the replicas that beat within the window.
const HEARTBEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('PEXPIRE', KEYS[1], window * 2)
return redis.call('ZCARD', KEYS[1])
";

/// How often a replica beats, and how long a beat counts.
const BEAT: Duration = Duration::from_secs(1);
const BEAT_WINDOW_MS: u64 = 5_000;
/// Connection attempts at most this often.
const RECONNECT: Duration = Duration::from_secs(1);

/// The shared limiter of one replica. See the module documentation.
pub struct SharedLimits {
    cfg: SharedLimitsConfig,
    client: redis::Client,
    conn: Mutex<Option<MultiplexedConnection>>,
    /// No connection attempt before this.
    next_attempt: Mutex<Instant>,
    /// Serializes connection attempts.
    connecting: tokio::sync::Mutex<()>,
    replica: String,
    replicas: AtomicU32,
    available: AtomicBool,
    rate: redis::Script,
    tokens: redis::Script,
    heartbeat: redis::Script,
    metrics: GatewayMetrics,
}

impl std::fmt::Debug for SharedLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLimits").field("replica", &self.replica).finish_non_exhaustive()
    }
}

impl SharedLimits {
    /// A limiter for a validated config (connects on first use).
    pub fn new(cfg: SharedLimitsConfig, metrics: GatewayMetrics) -> Arc<SharedLimits> {
        let client = redis::Client::open(cfg.redis_url.as_str()).expect("validated Redis URL");
        Arc::new(SharedLimits {
            client,
            conn: Mutex::new(None),
            next_attempt: Mutex::new(Instant::now()),
            connecting: tokio::sync::Mutex::new(()),
            replica: format!("{:016x}", rand::random::<u64>()),
            replicas: AtomicU32::new(1),
            available: AtomicBool::new(true),
            rate: redis::Script::new(RATE),
            tokens: redis::Script::new(TOKENS),
            heartbeat: redis::Script::new(HEARTBEAT),
            metrics,
            cfg,
        })
    }

    /// What to do while Redis is unavailable.
    pub fn fallback(&self) -> Fallback {
        match self.cfg.fail_open {
            None => Fallback::Local,
            Some(true) => Fallback::Open,
            Some(false) => Fallback::Closed,
        }
    }

    /// Whether the last call to Redis was answered.
    pub fn is_available(&self) -> bool {
        self.available.load(Ordering::Relaxed)
    }

    /// Replicas seen beating (at least 1: this one).
    pub fn replicas(&self) -> u32 {
        self.replicas.load(Ordering::Relaxed).max(1)
    }

    /// Count one decision taken without Redis.
    pub fn count_unavailable(&self) {
        let decision = match self.fallback() {
            Fallback::Local => "local",
            Fallback::Open => "open",
            Fallback::Closed => "closed",
        };
        self.metrics.shared_limits_unavailable.with_label_values(&[decision]).inc();
    }

    /// Request `key` (a key's SHA-256, hex) against `rps` with `burst`.
    pub async fn check_rate(&self, key: &str, rps: f64, burst: u32) -> Verdict {
        let interval = 1000.0 / rps;
        let tolerance = interval * f64::from(burst.max(1));
        let mut inv = self.rate.key(format!("{}:rate:{key}", self.cfg.key_prefix));
        inv.arg(interval).arg(tolerance);
        self.verdict(self.run::<String>(&inv).await)
    }

    /// Take `amount` tokens of `key`'s `per_minute` budget.
    pub async fn take_tokens(&self, key: &str, per_minute: u64, amount: u64) -> Verdict {
        let mut inv = self.tokens.key(format!("{}:tokens:{key}", self.cfg.key_prefix));
        inv.arg(per_minute).arg("take").arg(amount);
        self.verdict(self.run::<String>(&inv).await)
    }

    /// Give `amount` tokens back to `key`'s budget (negative: take more, into debt).
    pub async fn give_tokens(&self, key: &str, per_minute: u64, amount: f64) {
        let mut inv = self.tokens.key(format!("{}:tokens:{key}", self.cfg.key_prefix));
        inv.arg(per_minute).arg("give").arg(amount);
        if self.run::<String>(&inv).await.is_none() {
            self.metrics.shared_limits_unavailable.with_label_values(&["settle_lost"]).inc();
        }
    }

    fn verdict(&self, reply: Option<String>) -> Verdict {
        match reply.and_then(|r| r.parse::<f64>().ok()) {
            Some(wait) if wait > 0.0 => Verdict::Limited(Duration::from_secs_f64(wait / 1000.0)),
            Some(_) => Verdict::Allowed,
            None => Verdict::Unavailable,
        }
    }

    /// Run a script invocation within `timeout_ms`; `None` when Redis cannot answer now.
    async fn run<T: redis::FromRedisValue>(&self, inv: &redis::ScriptInvocation<'_>) -> Option<T> {
        let mut conn = self.connection().await?;
        let timeout = Duration::from_millis(self.cfg.timeout_ms);
        match tokio::time::timeout(timeout, inv.invoke_async::<T>(&mut conn)).await {
            Ok(Ok(v)) => {
                self.set_available(true, None);
                Some(v)
            }
            Ok(Err(e)) => {
                self.lost(&e.to_string());
                None
            }
            Err(_) => {
                self.lost(&format!("no answer within {} ms", self.cfg.timeout_ms));
                None
            }
        }
    }

    /// The connection, or a new one when the last attempt is a second old.
    async fn connection(&self) -> Option<MultiplexedConnection> {
        if let Some(c) = self.conn.lock().clone() {
            return Some(c);
        }
        if Instant::now() < *self.next_attempt.lock() {
            return None;
        }
        let _one = self.connecting.try_lock().ok()?;
        *self.next_attempt.lock() = Instant::now() + RECONNECT;
        let timeout = Duration::from_millis(self.cfg.timeout_ms.max(250));
        match tokio::time::timeout(timeout, self.client.get_multiplexed_async_connection()).await {
            Ok(Ok(c)) => {
                *self.conn.lock() = Some(c.clone());
                Some(c)
            }
            Ok(Err(e)) => {
                self.set_available(false, Some(&e.to_string()));
                None
            }
            Err(_) => {
                self.set_available(false, Some("connecting timed out"));
                None
            }
        }
    }

    /// A call failed: drop the connection (the next call reconnects, at most once a second).
    fn lost(&self, why: &str) {
        *self.conn.lock() = None;
        *self.next_attempt.lock() = Instant::now() + RECONNECT;
        self.set_available(false, Some(why));
    }

    fn set_available(&self, up: bool, why: Option<&str>) {
        if self.available.swap(up, Ordering::Relaxed) != up {
            match up {
                true => tracing::info!("shared limits: Redis answers again"),
                false => tracing::warn!(
                    error = why.unwrap_or(""),
                    fallback = ?self.fallback(),
                    replicas = self.replicas(),
                    "shared limits: Redis unavailable"
                ),
            }
        }
    }

    /// Beat once; the replicas seen are updated when Redis answers.
    pub async fn beat(&self) {
        let mut inv = self.heartbeat.key(format!("{}:replicas", self.cfg.key_prefix));
        inv.arg(&self.replica).arg(BEAT_WINDOW_MS);
        if let Some(n) = self.run::<u32>(&inv).await {
            self.replicas.store(n.max(1), Ordering::Relaxed);
        }
    }
}

/// The background service that beats every second.
pub struct Heartbeat(pub Arc<SharedLimits>);

#[async_trait]
impl BackgroundService for Heartbeat {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(BEAT);
        loop {
            tokio::select! {
                _ = tick.tick() => self.0.beat().await,
                _ = shutdown.changed() => return,
            }
        }
    }
}
