//! The request path: one OpenAI request from the client to an engine and back, on any
//! transport.
//!
//! The gateway owns the upstream leg instead of using pingora's stock proxy loop, whose
//! retry buffer silently drops request bodies over 64 KiB (see docs/design/PINGORA-NOTES.md).
//! One driver ([`driver`]) runs a request's named phases over one [`RequestCtx`], whatever
//! carries it: HTTP/1.1 and HTTP/2 ([`http`]), or an Endpoint Picker's ext_proc stream
//! ([`crate::epp`]):
//!
//! | phase | where | what |
//! |---|---|---|
//! | `read_head` | the transport ([`http`], [`crate::epp`]) | the head within `limits.header_read_timeout_ms` (else the connection closes), the size and field limits (431), one framing (400) |
//! | `admit` | [`tenant`] | the API key (401) and its request rate (429), [`crate::auth`] |
//! | `route` | [`routes`] | the route table: the gateway's own answers, inference routes, 404/405 for the rest (engine administration included) |
//! | `read_and_plan` | [`driver`] | the body within `limits.max_body_bytes` (413) and `limits.body_read_timeout_ms` (408); the pure [`plan_request`] (model, stream, priority, token charge, prompt hashes, session); the key's token budget (429) |
//! | `queue` | [`queue`] | held while no engine can take it ([`crate::admission`]); re-planned once if a reload came meanwhile |
//! | `deliver` | the transport | HTTP: pick ([`crate::policy`]), exchange, retry decision ([`attempt`]), the response chunk by chunk ([`stream`]); the picker: the pick with fallbacks, named to the gateway in front, the answer watched as it passes |
//! | `finish` | [`driver`] | from the phases' [`Outcome`]: settle the token charge, metrics, one access-log line |
//!
//! While waiting for the engine the client is watched, so a client that leaves during a
//! long prefill closes the upstream connection and the engine aborts the request.

mod attempt;
mod ctx;
pub(crate) mod driver;
mod http;
mod inflight;
pub(crate) mod plan;
mod queue;
pub(crate) mod routes;
mod stream;
mod tenant;

use std::sync::Arc;
use std::time::Instant;

use pingora::apps::HttpServerOptions;

use crate::active::Active;
use crate::cluster::BackendState;
use crate::state::GatewayState;

pub(crate) use ctx::{Outcome, RequestCtx, Reuse};
pub(crate) use inflight::InflightGuard;

pub(crate) use stream::Engine;

/// The OpenAI API listener, and the request driver every transport runs requests through.
pub struct ProxyApp {
    state: Arc<GatewayState>,
    options: HttpServerOptions,
}

impl ProxyApp {
    /// A proxy over `state`; accepts HTTP/1.1, and cleartext HTTP/2 (h2c) when the config's
    /// `h2c` is on (HTTP/2 over TLS is negotiated by ALPN instead). An HTTP/2 connection with
    /// no open stream is closed after `limits.idle_connection_timeout_ms` (read here, once).
    pub fn new(state: Arc<GatewayState>) -> Self {
        let mut options = HttpServerOptions::default();
        let config = &state.active.load().config;
        options.h2c = config.h2c;
        options.h2_idle_timeout = Some(config.limits.idle_connection_timeout());
        ProxyApp { state, options }
    }

    /// The shared state the proxy works on.
    pub(crate) fn state(&self) -> &Arc<GatewayState> {
        &self.state
    }

    /// `GET /-/ready` (and the picker's gRPC health): draining, no routable backend (503
    /// when `readiness.require_backend`), or how many are routable.
    pub(crate) fn readiness(&self, active: &Active) -> (u16, String) {
        if self.state.lifecycle.is_draining() {
            return (503, "draining\n".into());
        }
        let now = Instant::now();
        let down_after = active.config.scrape.down_after_failures;
        let up = active.cluster.backends.iter().filter(|b| b.state(now, down_after) == BackendState::Up).count();
        match (up, active.config.readiness.require_backend) {
            (0, true) => (503, "no routable backend\n".into()),
            // Requests wait in the admission queue (scale from zero).
            (0, false) => (200, "ready: no routable backend yet; requests are queued\n".into()),
            (up, _) => (200, format!("ready: {up} routable backends\n")),
        }
    }
}

/// Backends that may take a request for `model` now, `tried` excluded: up, not ejected,
/// under the circuit breaker's in-flight limit, as of `now`. Also whether any backend serves
/// the model.
pub(crate) fn routable(
    active: &Active,
    model: &str,
    tried: &[usize],
    now: Instant,
) -> (Vec<crate::policy::Candidate>, bool) {
    let cfg = &active.config;
    let (mut candidates, known) =
        active.cluster.candidates(model, tried, now, cfg.scrape.down_after_failures, cfg.scrape.stale_after());
    let max = cfg.health.max_inflight_per_backend;
    if max > 0 {
        candidates.retain(|c| c.inflight < max);
    }
    (candidates, known)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::downstream::Downstream;

    #[test]
    fn a_request_id_is_kept_when_sane_and_made_otherwise() {
        let mut ctx = RequestCtx::new("POST", "/v1/completions");
        ctx.take_request_id(Some(b"req-42"));
        assert_eq!(ctx.request_id.as_deref(), Some("req-42"));
        for bad in [&b""[..], b"has space", &[b'x'; 129]] {
            ctx.take_request_id(Some(bad));
            let id = ctx.request_id.clone().unwrap();
            assert!(id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
    }

    /// Size of what `f` returns, without calling it.
    fn returned_size<A, B, R>(_f: impl FnOnce(A, B) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// pingora boxes each connection's handler future (async_trait), which copies the whole
    /// state machine once per request: at 12 KB (pingora's connect future inlined) that copy
    /// was 9% of the gateway's instructions. Rare paths with big futures get their own box.
    #[test]
    fn the_per_request_future_stays_small() {
        let handle = returned_size(|app: &'static ProxyApp, s: &'static mut Downstream<'static>| {
            app.drive(s, app.state.active.load_full())
        });
        // 4,192 bytes in a debug build with pingora 0.9.1 before the request path was split
        // into phases, 3,632 after (release builds are smaller).
        eprintln!("the request handler's future: {handle} bytes");
        assert!(handle <= 6 * 1024, "the request handler's future grew to {handle} bytes");
    }
}
