//! The `attempt` loop: pick a backend, exchange the request with it, and decide whether a
//! failure is retried on another one.
//!
//! A connection failure, or the engine closing or resetting the connection before any
//! response byte (a dead pooled connection, a crashed engine), or an answer in
//! `retries.retry_on_status`, is retried on another backend within `retries.max_attempts`
//! and the retry budget — never after anything reached the client, never after a
//! first-byte timeout (the engine may still be working on it). Every failure goes through
//! [`ProxyApp::upstream_failed`]: one place counts it and feeds outlier ejection.

use std::fmt::Display;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use pingora::upstreams::peer::{HttpPeer, Peer};
use tokio::net::TcpStream;

use crate::active::Active;
use crate::cluster::Backend;
use crate::config::GatewayConfig;
use crate::downstream::Downstream;
use crate::error::{ProxyError, UpstreamErrorKind};
use crate::policy::RouteInput;
use crate::upstream::{request_head, EngineConnection, EngineIoError, EngineStream, Forwarded, ResponseHead};

use super::ctx::{Outcome, RequestCtx};
use super::driver::Planned;
use super::inflight::InflightGuard;
use super::plan::RoutePlan;
use super::stream::Engine;
use super::{routable, ProxyApp};

/// Outcome of one exchange that did not produce a response header.
pub(super) enum AttemptError {
    /// The engine exchange failed; the kind says whether another backend may be tried.
    Upstream(UpstreamErrorKind, ProxyError),
    /// The request cannot be sent as it is (answered, not counted against the engine).
    Refused(ProxyError),
    /// The client went away.
    ClientGone,
}

/// The backend a policy picked for one attempt, with the work it takes on.
pub(crate) struct Pick {
    /// Position in the cluster view.
    pub index: usize,
    /// This request's prompt tokens the backend probably does not have cached.
    pub uncached: u64,
    /// Prefill work ahead of and including this request (for learning the prefill rate).
    pub work: u64,
}

impl ProxyApp {
    /// Attempts until one answers (then stream it) or none is left. `planned.ticket` (the
    /// admission queue's) is let go once the request is counted in flight.
    pub(super) async fn attempt_loop(&self, s: &mut Downstream<'_>, ctx: &mut RequestCtx, planned: Planned) -> Outcome {
        let Planned { active, plan, body, mut ticket } = planned;
        // One clock reading per attempt: routing, the pool's idle check and the dispatch time.
        let mut now = Instant::now();
        self.state.retry_budget.lock().record_request(now);
        loop {
            let pick = match self.pick(&active, &plan, ctx, now) {
                Ok(p) => p,
                Err(e) => return self.fail(s, e, ctx).await,
            };
            let backend = active.cluster.backends[pick.index].clone();
            let mut inflight = InflightGuard::new(backend.clone(), pick.uncached, pick.work, plan.stream, now);
            drop(ticket.take());
            match self.exchange(s, &backend, &body, &active.config, ctx, now).await {
                Ok((_, head)) if self.retry_status(&active, &plan, ctx, pick.index, head.status) => {}
                Ok((up, head)) => {
                    let engine = Engine { active: &active, index: pick.index };
                    return self.stream(s, up, head, engine, ctx, &mut inflight).await;
                }
                Err(AttemptError::Refused(error)) => return self.fail(s, error, ctx).await,
                Err(AttemptError::ClientGone) => return Outcome::client_gone(499),
                Err(AttemptError::Upstream(kind, error)) => {
                    self.upstream_failed(&active, Some(pick.index), kind, error.log_detail());
                    if !kind.retryable() {
                        return self.fail(s, error, ctx).await;
                    }
                    ctx.tried.push(pick.index);
                    if !self.may_retry(&active, &plan.model, &ctx.tried) {
                        return self.fail(s, error, ctx).await;
                    }
                    ctx.last_error = Some(error);
                    self.state.metrics.retries.inc();
                    ctx.retries += 1;
                    now = Instant::now();
                }
            }
        }
    }

    /// Let the policy choose among the routable backends not tried yet, with each one's
    /// matched prefix filled in from the prefix index; the index learns the choice.
    fn pick(
        &self,
        active: &Arc<Active>,
        plan: &RoutePlan,
        ctx: &mut RequestCtx,
        now: Instant,
    ) -> Result<Pick, ProxyError> {
        let (candidates, prompt_tokens) = match self.scored(active, plan, &ctx.tried, now) {
            Ok(x) => x,
            // Every backend tried: answer the last attempt's error.
            Err(e @ ProxyError::NoBackend(_)) => return Err(ctx.last_error.take().unwrap_or(e)),
            Err(e) => return Err(e),
        };
        let (at, reason) = choose(active, plan, &candidates, ctx.tried.len() as u64);
        Ok(self.commit(active, plan, ctx, candidates[at], reason, prompt_tokens))
    }

    /// [`Self::pick`] for the Endpoint Picker: among the routable backends not in `excluded`,
    /// the policy's choice (committed as `pick` commits it) and up to `fallbacks` more, each
    /// the policy's choice among those left, for a gateway that retries down the list.
    pub(crate) fn pick_with_fallbacks(
        &self,
        active: &Arc<Active>,
        plan: &RoutePlan,
        ctx: &mut RequestCtx,
        excluded: &[usize],
        fallbacks: usize,
    ) -> Result<(Pick, Vec<usize>), ProxyError> {
        let (mut candidates, prompt_tokens) = self.scored(active, plan, excluded, Instant::now())?;
        let (at, reason) = choose(active, plan, &candidates, 0);
        let pick = self.commit(active, plan, ctx, candidates.swap_remove(at), reason, prompt_tokens);
        let mut rest = Vec::with_capacity(fallbacks.min(candidates.len()));
        for salt in 1..=fallbacks as u64 {
            if candidates.is_empty() {
                break;
            }
            let (at, _) = choose(active, plan, &candidates, salt);
            rest.push(candidates.swap_remove(at).index);
        }
        Ok((pick, rest))
    }

    /// The routable backends for `plan` (those in `tried` left out), each with the prompt
    /// tokens it probably holds, and the prompt's length in tokens.
    fn scored(
        &self,
        active: &Arc<Active>,
        plan: &RoutePlan,
        tried: &[usize],
        now: Instant,
    ) -> Result<(Vec<crate::policy::Candidate>, u64), ProxyError> {
        let (mut candidates, known) = routable(active, &plan.model, tried, now);
        if !known {
            // Before any backend has told its models (none scraped yet: starting up, or
            // every engine unreachable since), nobody can say the model does not exist.
            return Err(if active.cluster.models().is_empty() {
                ProxyError::NoBackend(plan.model.clone())
            } else {
                ProxyError::ModelNotFound(plan.model.clone())
            });
        }
        if candidates.is_empty() {
            return Err(ProxyError::NoBackend(plan.model.clone()));
        }
        let pcfg = &active.config.prefix_index;
        // The prompt's length: exact when tokenized for the precise index, else estimated.
        let prompt_tokens = plan.precise.as_ref().map_or(plan.prompt_tokens, |p| p.tokens);
        if !plan.hashes.is_empty() {
            let keys: Vec<(u64, u32)> = candidates
                .iter()
                .map(|c| {
                    let b = &active.cluster.backends[c.index];
                    (b.key, b.restarts.load(Ordering::Relaxed))
                })
                .collect();
            let blocks = self.state.prefix.matched_blocks(&plan.hashes, &keys);
            // The approximate index's estimate, in the prompt's tokens (exact ones when it
            // was tokenized).
            let approximate = blocks.into_iter().map(|n| {
                let t = pcfg.tokens(n * pcfg.block_bytes).min(plan.prompt_tokens);
                match plan.prompt_tokens == prompt_tokens {
                    true => t,
                    false => (t as f64 / plan.prompt_tokens.max(1) as f64 * prompt_tokens as f64) as u64,
                }
            });
            match (&plan.precise, &self.state.kv_events) {
                // Engines whose KV events are live: the blocks they hold. The others: the
                // approximate estimate.
                (Some(p), Some(kv)) => {
                    let precise = kv.matched_tokens(p, &keys.iter().map(|k| k.0).collect::<Vec<_>>());
                    let approximate: Vec<u64> = approximate.collect();
                    for (c, m) in candidates.iter_mut().zip(matched_tokens(&precise, &approximate)) {
                        c.matched_tokens = m;
                    }
                }
                _ => candidates.iter_mut().zip(approximate).for_each(|(c, m)| c.matched_tokens = m),
            }
        }
        Ok((candidates, prompt_tokens))
    }

    /// Record the policy's choice: the decision metric, the backend and reason in `ctx`, the
    /// prefix index learning where the prompt went; the work the backend takes on.
    fn commit(
        &self,
        active: &Active,
        plan: &RoutePlan,
        ctx: &mut RequestCtx,
        chosen: crate::policy::Candidate,
        reason: &'static str,
        prompt_tokens: u64,
    ) -> Pick {
        self.state.metrics.decisions.with_label_values(&[active.policy.name(), reason]).inc();
        let backend = &active.cluster.backends[chosen.index];
        ctx.backend = Some(backend.clone());
        ctx.reason = Some(reason);
        if !plan.hashes.is_empty() {
            let m = &self.state.metrics;
            m.prefix_match_ratio.observe(chosen.matched_tokens as f64 / prompt_tokens.max(1) as f64);
            m.prefix_index_bytes.set(self.state.prefix.insert(backend.key, &plan.hashes) as i64);
        }
        let uncached = prompt_tokens.saturating_sub(chosen.matched_tokens);
        Pick { index: chosen.index, uncached, work: chosen.pending_prefill_tokens + uncached }
    }

    /// Whether the engine's answer `status` is one to retry elsewhere, and a retry was
    /// granted (then the answer and its connection are dropped: nothing reached the client).
    fn retry_status(&self, active: &Active, plan: &RoutePlan, ctx: &mut RequestCtx, index: usize, status: u16) -> bool {
        if !active.config.retries.retry_on_status.contains(&status) {
            return false;
        }
        ctx.tried.push(index);
        if !self.may_retry(active, &plan.model, &ctx.tried) {
            return false;
        }
        let error = ProxyError::Upstream(format!("engine answered {status}"));
        self.upstream_failed(active, Some(index), UpstreamErrorKind::RetriedStatus, error.log_detail());
        ctx.last_error = Some(error);
        self.state.metrics.retries.inc();
        ctx.retries += 1;
        true
    }

    /// Whether a request that failed on `tried` may have another attempt: attempts left,
    /// another backend to try, and the retry budget not spent (taken from it when true).
    fn may_retry(&self, active: &Active, model: &str, tried: &[usize]) -> bool {
        if tried.len() as u32 >= active.config.retries.max_attempts {
            return false;
        }
        let now = Instant::now();
        if routable(active, model, tried, now).0.is_empty() {
            return false;
        }
        let granted = self.state.retry_budget.lock().try_retry(now);
        if !granted {
            self.upstream_failed(active, None, UpstreamErrorKind::RetryBudgetSpent, &"no retry left in the budget");
        }
        granted
    }

    /// The one place an upstream failure is counted: `switchyard_upstream_errors_total`,
    /// the backend's failure streak (outlier ejection) when the kind counts, and a log line.
    pub(crate) fn upstream_failed(
        &self,
        active: &Active,
        index: Option<usize>,
        kind: UpstreamErrorKind,
        detail: &dyn Display,
    ) {
        self.state.metrics.upstream_errors.with_label_values(&[kind.label()]).inc();
        let Some(index) = index else { return };
        if kind.ejects() {
            active.cluster.record_failure(index, kind.label(), Instant::now(), &active.config.health);
        }
        if !matches!(kind, UpstreamErrorKind::Status5xx | UpstreamErrorKind::RetriedStatus) {
            let backend = &active.cluster.backends[index].url;
            tracing::warn!(%backend, kind = kind.label(), error = %detail, "upstream attempt failed");
        }
    }

    /// Connect, send the request and wait for the response header (or the client leaving).
    async fn exchange(
        &self,
        s: &mut Downstream<'_>,
        backend: &Backend,
        body: &Bytes,
        cfg: &GatewayConfig,
        ctx: &RequestCtx,
        now: Instant,
    ) -> Result<(EngineConnection, ResponseHead), AttemptError> {
        let Some(peer) = &backend.peer else {
            let error = ProxyError::Upstream(format!("{} does not resolve", backend.authority));
            return Err(AttemptError::Upstream(UpstreamErrorKind::Unresolved, error));
        };
        // A pooled connection first. Connecting (TCP, maybe TLS) is a future of ~9 KB that
        // would otherwise be inlined into every request's state machine and copied when
        // pingora boxes it, so it gets its own box, on the rare path only.
        let pooled = self.state.pools.of(crate::cores::current()).take(backend.pool_key, now);
        let (mut up, reused) = match pooled {
            Some(up) => (up, true),
            None => match Box::pin(connect(&self.state.connector, peer, cfg)).await {
                Ok(stream) => (EngineConnection::new(stream), false),
                Err(e) => return Err(AttemptError::Upstream(UpstreamErrorKind::Connect, ProxyError::Upstream(e))),
            },
        };
        let fwd = Forwarded {
            peer: s.peer(),
            proto: if cfg.tls.is_some() { "https" } else { "http" },
            request_id: ctx.request_id.as_deref().unwrap_or(""),
            strip_authorization: cfg.auth.enabled(),
        };
        // The query string goes too: the route's bytes reach the engine as the client sent
        // them, or in their normal form when that differs (what was routed).
        let path = ctx.target.as_deref().unwrap_or(s.head().path_and_query());
        request_head(up.request_head_buffer(), s.head(), path, &backend.authority, body.len(), &fwd)
            .map_err(|e| AttemptError::Refused(ProxyError::BadRequest(format!("cannot forward this request: {e}"))))?;
        let sent = async {
            up.send(body, cfg.timeouts.idle()).await?;
            up.read_head(cfg.timeouts.first_byte()).await
        };
        // The engine's side first: once its answer is in, the client is not read as well.
        let result = tokio::select! {
            biased;
            r = sent => r,
            () = s.closed() => return Err(AttemptError::ClientGone),
        };
        let kind = match result {
            Ok(head) => return Ok((up, head)),
            Err(EngineIoError::ReadTimeout) => {
                let error = ProxyError::UpstreamTimeout(cfg.timeouts.first_byte_ms);
                return Err(AttemptError::Upstream(UpstreamErrorKind::FirstByteTimeout, error));
            }
            Err(e) if reused => (UpstreamErrorKind::ReusedConnection, e),
            // The engine closed or reset the connection before answering (it died, or is
            // restarting): nothing reached the client, so another engine may take it.
            Err(e) => (UpstreamErrorKind::UpstreamIo, e),
        };
        Err(AttemptError::Upstream(kind.0, ProxyError::Upstream(kind.1.to_string())))
    }
}

/// Open a new connection to `peer` within the connect timeout: a plain socket with
/// `TCP_NODELAY` (as pingora sets it) for an `http://` engine, pingora's connector (TLS,
/// its certificate checks) for an `https://` one.
async fn connect(
    connector: &pingora::connectors::TransportConnector,
    peer: &HttpPeer,
    cfg: &GatewayConfig,
) -> Result<EngineStream, String> {
    let limit = cfg.timeouts.connect();
    if let (false, Some(addr)) = (peer.is_tls(), peer.address().as_inet()) {
        let stream = match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err(format!("connecting to {addr}: {e}")),
            Err(_) => return Err(format!("connecting to {addr}: no answer within {} ms", limit.as_millis())),
        };
        stream.set_nodelay(true).map_err(|e| format!("connecting to {addr}: {e}"))?;
        return Ok(EngineStream::Tcp(stream));
    }
    let mut peer = peer.clone();
    peer.options.connection_timeout = Some(limit);
    peer.options.total_connection_timeout = Some(limit);
    connector.new_stream(&peer).await.map(EngineStream::Tls).map_err(|e| e.to_string())
}

/// The policy's choice among `candidates` (their position, and its reason). Policies that
/// read prefixes break ties by the request (its prompt's chained block hashes, with `salt`),
/// not a per-replica RNG: every gateway replica given the same load and index sends a prompt
/// to the same engine.
fn choose(
    active: &Active,
    plan: &RoutePlan,
    candidates: &[crate::policy::Candidate],
    salt: u64,
) -> (usize, &'static str) {
    let prompt_tokens = plan.precise.as_ref().map_or(plan.prompt_tokens, |p| p.tokens);
    let input = RouteInput { model: &plan.model, prompt_tokens, session: plan.session.as_deref() };
    let decision = match plan.hashes.last() {
        Some(&seed) => active.policy.select(&input, candidates, &mut TieBreak(seed ^ salt)),
        None => active.policy.select(&input, candidates, &mut rand::rng()),
    };
    (decision.pick, decision.reason)
}

/// The random stream a request's ties are broken with: SplitMix64 seeded by the request,
/// the same on every replica, and (unlike `StdRng`'s ChaCha, ~600 instructions to seed)
/// nearly free to start for each request.
struct TieBreak(u64);

impl rand::RngCore for TieBreak {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
    fn fill_bytes(&mut self, dst: &mut [u8]) {
        for chunk in dst.chunks_mut(8) {
            chunk.copy_from_slice(&self.next_u64().to_le_bytes()[..chunk.len()]);
        }
    }
}

/// Each candidate's matched tokens from the engines' KV events (`precise`: `None` where an
/// engine's stream is not live) and this gateway's approximate index. Live engines count what
/// they hold, the others the approximate estimate — unless no engine holds any of the prompt
/// (a new prompt, or one evicted everywhere): then the events say nothing about where it
/// belongs, and the approximate index (where this gateway sent it before) decides for all,
/// which keeps such a prompt on one home instead of a copy wherever load puts it.
fn matched_tokens(precise: &[Option<u64>], approximate: &[u64]) -> Vec<u64> {
    let held_somewhere = precise.iter().any(|m| m.is_some_and(|t| t > 0));
    precise
        .iter()
        .zip(approximate)
        .map(|(exact, &approx)| match (held_somewhere, exact) {
            (true, Some(t)) => *t,
            _ => approx,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{matched_tokens, TieBreak};
    use rand::{Rng, RngCore};

    #[test]
    fn a_tie_break_stream_is_splitmix64_and_spreads_its_picks() {
        // SplitMix64's first outputs for seed 0 (Vigna's reference implementation).
        let mut r = TieBreak(0);
        assert_eq!([r.next_u64(), r.next_u64()], [0xe220_a839_7b1d_cdaf, 0x6e78_9e6a_a1b9_65f4]);
        let mut counts = [0u32; 4];
        for seed in 0..4000u64 {
            counts[TieBreak(seed.wrapping_mul(0x1234_5678_9abc_def1)).random_range(0..4)] += 1;
        }
        assert!(counts.iter().all(|&c| (850..1150).contains(&c)), "{counts:?}");
    }

    #[test]
    fn live_engines_count_what_they_hold_unless_nobody_holds_anything() {
        // Engine 0 holds 320 tokens; 1 is live and holds nothing (the approximate index wrongly
        // thinks 640); 2 is not live: its estimate stands.
        assert_eq!(matched_tokens(&[Some(320), Some(0), None], &[0, 640, 160]), vec![320, 0, 160]);
        // Evicted everywhere: the approximate index's home wins again.
        assert_eq!(matched_tokens(&[Some(0), Some(0), None], &[640, 0, 160]), vec![640, 0, 160]);
        assert_eq!(matched_tokens(&[None, None], &[1, 2]), vec![1, 2]);
    }
}
