//! The tenant's phases: `admit` (the API key and its request rate) before anything else,
//! the token charge once the request is planned, its settlement in `finish` — against this
//! replica's limiters, or Redis with `auth.shared_limits` ([`crate::shared_limits`]).

use std::time::{Duration, Instant};

use crate::active::Active;
use crate::auth::{Denied, Tenant};
use crate::error::ProxyError;
use crate::shared_limits::{Fallback, Verdict};

use super::ctx::{Ledger, RequestCtx};
use super::plan::RoutePlan;
use super::routes::needs_key;
use super::ProxyApp;

impl ProxyApp {
    /// Phase `admit`: for `/v1/` and inference requests, the API key (the `Authorization`
    /// header's value) and its request rate; the key's tenant goes into `ctx` (refused or not).
    pub(super) async fn admit(
        &self,
        active: &Active,
        authorization: Option<&[u8]>,
        ctx: &mut RequestCtx,
    ) -> Result<(), ProxyError> {
        if !needs_key(&ctx.path) {
            return Ok(());
        }
        let authenticated = active.auth.authenticate(authorization);
        match authenticated {
            Ok(None) => Ok(()),
            Ok(Some(tenant)) => {
                let rate = self
                    .check_rate(&tenant)
                    .await
                    .map_err(|wait| ProxyError::rate_limited("requests", "second", &tenant.name, wait));
                ctx.tenant = Some(tenant);
                rate
            }
            Err(Denied::Missing) => Err(ProxyError::Unauthorized(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
            )),
            Err(Denied::Unknown) => Err(ProxyError::Unauthorized("Incorrect API key provided.")),
        }
    }

    /// The key's request rate: in Redis with `auth.shared_limits` (or its fallback while
    /// Redis cannot answer), else this replica's limiter.
    async fn check_rate(&self, tenant: &Tenant) -> Result<(), Duration> {
        let Some(shared) = &self.state.shared_limits else { return tenant.check_rate() };
        let Some((rps, burst)) = tenant.rate_limit() else { return Ok(()) };
        match shared.check_rate(tenant.key_id(), rps, burst).await {
            Verdict::Allowed => Ok(()),
            Verdict::Limited(wait) => Err(wait),
            Verdict::Unavailable => {
                shared.count_unavailable();
                match shared.fallback() {
                    Fallback::Local => tenant.fallback(shared.replicas()).check_rate(),
                    Fallback::Open => Ok(()),
                    Fallback::Closed => Err(Duration::from_secs(1)),
                }
            }
        }
    }

    /// Charge `charge` tokens to the key's budget: the ledger it went to, `None` when the key
    /// has no budget (or Redis is down and `fail_open` admits), or how long until it fits.
    async fn take_tokens(&self, tenant: &Tenant, charge: u64) -> Result<Option<Ledger>, Duration> {
        let Some(shared) = &self.state.shared_limits else {
            let Some(budget) = &tenant.tokens else { return Ok(None) };
            return budget.take(charge, Instant::now()).map(|()| Some(Ledger::Local));
        };
        let Some(per_minute) = tenant.tokens_per_minute() else { return Ok(None) };
        match shared.take_tokens(tenant.key_id(), per_minute, charge).await {
            Verdict::Allowed => Ok(Some(Ledger::Shared)),
            Verdict::Limited(wait) => Err(wait),
            Verdict::Unavailable => {
                shared.count_unavailable();
                match shared.fallback() {
                    Fallback::Local => {
                        let share = tenant.fallback(shared.replicas());
                        let budget = share.tokens.as_ref().expect("a key with tokens_per_minute has a share");
                        budget.take(charge, Instant::now())?;
                        Ok(Some(Ledger::Fallback(share)))
                    }
                    Fallback::Open => Ok(None),
                    Fallback::Closed => Err(Duration::from_secs(1)),
                }
            }
        }
    }

    /// Charge the tenant's token budget what `plan` may use (429 when it does not fit).
    pub(super) async fn charge_tokens(&self, plan: &RoutePlan, ctx: &mut RequestCtx) -> Result<(), ProxyError> {
        let Some(tenant) = ctx.tenant.clone() else { return Ok(()) };
        if let Some(limit) = tenant.tokens_per_minute().filter(|&limit| plan.charge > limit) {
            let tenant = ctx.tenant_name().to_string();
            return Err(ProxyError::TokensTooLarge { tenant, limit, requested: plan.charge });
        }
        match self.take_tokens(&tenant, plan.charge).await {
            Ok(Some(ledger)) => {
                ctx.charged = Some((plan.charge, plan.prompt_charge));
                ctx.ledger = ledger;
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(wait) => Err(ProxyError::rate_limited("tokens", "minute", ctx.tenant_name(), wait)),
        }
    }

    /// Settle the tenant's token budget: refund what the request did not use, or take more.
    pub(super) fn settle_tokens(&self, ctx: &RequestCtx, status: u16) {
        let (Some(tenant), Some((charged, prompt))) = (&ctx.tenant, ctx.charged) else { return };
        let used = if status < 400 && ctx.response_bytes > 0 { ctx.usage.used(prompt) } else { 0 };
        match &ctx.ledger {
            Ledger::Local => {
                if let Some(budget) = &tenant.tokens {
                    budget.settle(charged, used, Instant::now());
                }
            }
            Ledger::Fallback(share) => {
                if let Some(budget) = &share.tokens {
                    budget.settle(charged, used, Instant::now());
                }
            }
            Ledger::Shared => {
                let (Some(shared), Some(per_minute)) = (self.state.shared_limits.clone(), tenant.tokens_per_minute())
                else {
                    return;
                };
                // As the local budget settles: the charge (capped at the whole budget) back,
                // what was used taken.
                let give = charged.min(per_minute) as f64 - used as f64;
                let key = tenant.key_id().to_string();
                tokio::spawn(async move { shared.give_tokens(&key, per_minute, give).await });
            }
        }
    }
}
